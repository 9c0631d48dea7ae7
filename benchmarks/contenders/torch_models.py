"""The torch modules of the workloads, shared by the torch contenders and by
``peers.py`` (which exports the transformer and the recurrent networks to ONNX from
them). Weights are named as in ``state_dict()``; the JAX contenders compute the same
functions from the same names (``jax_peer.py``)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


class Dense(nn.Module):
    """``x @ W + b`` with W stored (in, out), as the ONNX Gemm of the MLP workloads."""

    def __init__(self, W: np.ndarray, b: np.ndarray) -> None:
        super().__init__()
        self.linear = nn.Linear(*W.shape)
        with torch.no_grad():
            self.linear.weight.copy_(torch.from_numpy(W.T.copy()))
            self.linear.bias.copy_(torch.from_numpy(b))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def sequential(layers: list[dict], weights: dict[str, np.ndarray]) -> nn.Sequential:
    """dense / conv / relu / maxpool / flatten layers (``arch["layers"]``)."""
    modules: list[nn.Module] = []
    for layer in layers:
        op = layer["op"]
        if op == "dense":
            modules.append(Dense(weights[layer["W"]], weights[layer["b"]]))
        elif op == "conv":
            K, c = weights[layer["K"]], weights[layer["c"]]
            conv = nn.Conv2d(K.shape[1], K.shape[0], K.shape[2:], padding=layer["pad"])
            with torch.no_grad():
                conv.weight.copy_(torch.from_numpy(K))
                conv.bias.copy_(torch.from_numpy(c))
            modules.append(conv)
        elif op == "relu":
            modules.append(nn.ReLU())
        elif op == "maxpool":
            modules.append(nn.MaxPool2d(layer["size"]))
        elif op == "flatten":
            modules.append(nn.Flatten())
        else:
            raise ValueError(op)
    return nn.Sequential(*modules)


class EncoderLayer(nn.Module):
    """Post-norm self-attention + ReLU feed-forward (dropout 0), written out so that
    the ONNX export and the JAX contender compute the same operations."""

    def __init__(self, d_model: int, heads: int, d_ff: int, seq: int) -> None:
        super().__init__()
        self.heads, self.seq, self.d_model = heads, seq, d_model
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.norm1 = nn.LayerNorm(d_model)
        self.ff1 = nn.Linear(d_model, d_ff)
        self.ff2 = nn.Linear(d_ff, d_model)
        self.norm2 = nn.LayerNorm(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        head = self.d_model // self.heads
        qkv = self.qkv(x).reshape(-1, self.seq, 3, self.heads, head).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]  # (batch, heads, seq, head)
        attention = torch.softmax(q @ k.transpose(-1, -2) * (1.0 / head**0.5), dim=-1)
        h = (attention @ v).transpose(1, 2).reshape(-1, self.seq, self.d_model)
        x = self.norm1(x + self.out(h))
        return self.norm2(x + self.ff2(torch.relu(self.ff1(x))))


class Transformer(nn.Module):
    """Input projection + learned positions, encoder layers, mean over the sequence,
    a linear classifier."""

    def __init__(self, d_in, d_model, heads, layers, d_ff, seq, classes) -> None:
        super().__init__()
        self.embed = nn.Linear(d_in, d_model)
        self.pos = nn.Parameter(torch.zeros(seq, d_model))
        self.layers = nn.ModuleList(EncoderLayer(d_model, heads, d_ff, seq) for _ in range(layers))
        self.head = nn.Linear(d_model, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.pos
        for layer in self.layers:
            h = layer(h)
        return self.head(h.mean(dim=1))


class LSTMClassifier(nn.Module):
    """One LSTM layer (batch first), the last hidden state, a linear classifier."""

    def __init__(self, d_in, hidden, classes) -> None:
        super().__init__()
        self.lstm = nn.LSTM(d_in, hidden, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, (h, _) = self.lstm(x)
        return self.head(h[-1])


class GRUClassifier(nn.Module):
    """One GRU layer (batch first), the last hidden state, a linear classifier."""

    def __init__(self, d_in, hidden, classes) -> None:
        super().__init__()
        self.gru = nn.GRU(d_in, hidden, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, h = self.gru(x)
        return self.head(h[-1])


class LSTMTagger(nn.Module):
    """One bidirectional LSTM layer (batch first) and a linear classifier applied at
    every step to the two directions' hidden states: logits (batch, seq, classes)."""

    def __init__(self, d_in, hidden, classes) -> None:
        super().__init__()
        self.lstm = nn.LSTM(d_in, hidden, batch_first=True, bidirectional=True)
        self.head = nn.Linear(2 * hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return self.head(out)


MODULES = {
    "transformer": Transformer,
    "lstm": LSTMClassifier,
    "gru": GRUClassifier,
    "bilstm_tagger": LSTMTagger,
}


def build(arch: dict, weights: dict[str, np.ndarray] | None) -> nn.Module:
    """The workload's module, holding the given initial weights (None: torch's own)."""
    if arch["kind"] == "sequential":
        return sequential(arch["layers"], weights)
    config = {k: v for k, v in arch.items() if k != "kind"}
    module = MODULES[arch["kind"]](**config)
    if weights is not None:
        module.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()})
    return module
