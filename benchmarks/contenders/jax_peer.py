"""JAX contenders (``.venv-bench-jax``: jax and jaxlib 0.10.2 on the CPU, optax 0.2.8),
written as a JAX expert would:

* ``jit``: ``jax.jit`` of one training step (loss, ``value_and_grad``, the optax update)
  with the weights and optimizer state donated, called once per batch; the batch losses
  stay on the device until the epoch ends;
* ``scan``: ``jax.jit`` of a ``lax.scan`` of that step over the epoch's full batches
  (the data laid out as (batches, batch, ...) once, at setup), and the jitted step for a
  short last batch.

optax's ``adamw`` is torch's AdamW: ``p -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * p)``
with bias-corrected moments and the decay taken from the weights before the step, which
is torch's ``p *= 1 - lr wd`` followed by its Adam step. The functions below compute the
workloads' modules (``torch_models.py``) from the same weights, by name. ReLU is
``jax.nn.relu``, whose derivative at 0 is 0 as torch's and ONNX's (``jnp.maximum(x, 0)``
splits it, 0.5: a zero-padded convolution with a zero bias meets x = 0 often).
"""

from __future__ import annotations

import os

# on a GPU, two JAX contenders live side by side: none takes 75% of its memory up front
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402
from spec import NotApplicable, Spec  # noqa: E402

VERSION = f"jax {jax.__version__}, optax {optax.__version__}"


def make(kind: str, spec: Spec):
    platform = "gpu" if spec.device == "cuda" else "cpu"
    try:
        device = jax.devices(platform)[0]
    except RuntimeError as exc:
        raise NotApplicable(f"JAX has no {platform} device here: {exc}") from exc
    jax.config.update("jax_default_device", device)
    # float32 products in float32 on a GPU too (XLA's default there rounds them to TF32)
    jax.config.update("jax_default_matmul_precision", "highest")
    forward = FORWARD[spec.arch["kind"]](spec.arch)
    if spec.optimizer == "sgd":
        opt = optax.sgd(spec.lr)
    else:
        opt = optax.adamw(spec.lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=spec.weight_decay)

    def loss_fn(params, x, y):
        out = forward(params, x)
        if spec.loss == "mse":
            return jnp.mean((out - y) ** 2)
        if spec.loss == "token_ce":  # every token a row: the mean over the batch's tokens
            out, y = out.reshape(-1, out.shape[-1]), y.reshape(-1)
        picked = jnp.take_along_axis(out, y[:, None], axis=1)[:, 0]
        return jnp.mean(jax.nn.logsumexp(out, axis=1) - picked)

    def step(params, state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    def scan_epoch(params, state, X, y):
        def body(carry, batch):
            params, state, loss = step(*carry, *batch)
            return (params, state), loss

        (params, state), losses = lax.scan(body, (params, state), (X, y))
        return params, state, losses

    jit_step = jax.jit(step, donate_argnums=(0, 1))
    params = {k: jnp.asarray(v) for k, v in spec.weights.items()}
    carry = [params, opt.init(params)]
    X, y = jnp.asarray(spec.X), jnp.asarray(spec.y)
    b = spec.batch_size
    full = len(spec.X) // b

    if kind == "jit":
        batches = [(X[s], y[s]) for s in spec.slices()]

        def epoch() -> float:
            losses = []
            for x_batch, y_batch in batches:
                carry[0], carry[1], loss = jit_step(carry[0], carry[1], x_batch, y_batch)
                losses.append(loss)
            return float(np.sum(np.asarray(jax.device_get(losses), np.float64))) / spec.batches

        return epoch

    jit_epoch = jax.jit(scan_epoch, donate_argnums=(0, 1))
    X_full = X[: full * b].reshape(full, b, *X.shape[1:])
    y_full = y[: full * b].reshape(full, b, *y.shape[1:])
    rest = (X[full * b :], y[full * b :]) if full * b < len(spec.X) else None

    def epoch() -> float:
        carry[0], carry[1], losses = jit_epoch(carry[0], carry[1], X_full, y_full)
        parts = [losses]
        if rest is not None:
            carry[0], carry[1], loss = jit_step(carry[0], carry[1], *rest)
            parts.append(loss[None])
        values = jax.device_get(parts)
        return float(sum(np.asarray(v, np.float64).sum() for v in values)) / spec.batches

    return epoch


# -- the workloads' functions ----------------------------------------------------------


def sequential(arch: dict):
    def forward(p, x):
        for layer in arch["layers"]:
            op = layer["op"]
            if op == "dense":
                x = x @ p[layer["W"]] + p[layer["b"]]
            elif op == "conv":
                pad = layer["pad"]
                x = lax.conv_general_dilated(
                    x,
                    p[layer["K"]],
                    (1, 1),
                    [(pad, pad), (pad, pad)],
                    dimension_numbers=("NCHW", "OIHW", "NCHW"),
                )
                x = x + p[layer["c"]][None, :, None, None]
            elif op == "relu":
                x = jax.nn.relu(x)
            elif op == "maxpool":
                size = (1, 1, layer["size"], layer["size"])
                x = lax.reduce_window(x, -jnp.inf, lax.max, size, size, "VALID")
            elif op == "flatten":
                x = x.reshape(x.shape[0], -1)
        return x

    return forward


def _linear(p, name, x):
    """torch's Linear: weight (out, in)."""
    return x @ p[f"{name}.weight"].T + p[f"{name}.bias"]


def _layer_norm(p, name, x, eps=1e-5):
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + eps) * p[f"{name}.weight"] + p[f"{name}.bias"]


def transformer(arch: dict):
    d, heads, seq = arch["d_model"], arch["heads"], arch["seq"]
    head = d // heads

    def forward(p, x):
        h = _linear(p, "embed", x) + p["pos"]
        for i in range(arch["layers"]):
            name = f"layers.{i}"
            qkv = _linear(p, f"{name}.qkv", h).reshape(-1, seq, 3, heads, head)
            q, k, v = (qkv[:, :, j].transpose(0, 2, 1, 3) for j in range(3))
            attention = jax.nn.softmax(q @ k.transpose(0, 1, 3, 2) * (1.0 / head**0.5), axis=-1)
            a = (attention @ v).transpose(0, 2, 1, 3).reshape(-1, seq, d)
            h = _layer_norm(p, f"{name}.norm1", h + _linear(p, f"{name}.out", a))
            ff = _linear(p, f"{name}.ff2", jax.nn.relu(_linear(p, f"{name}.ff1", h)))
            h = _layer_norm(p, f"{name}.norm2", h + ff)
        return _linear(p, "head", h.mean(axis=1))

    return forward


def _lstm(p, name: str, x, hidden: int, reverse: bool = False, sequence: bool = False):
    """torch's LSTM layer ``name`` (weights ``name.weight_ih_l0`` ..., gates i, f, g, o)
    over x (batch, seq, features): the last hidden state (batch, hidden), or with
    ``sequence`` every step's (seq, batch, hidden). ``reverse``: torch's reverse direction
    (its ``*_l0_reverse`` weights), run from the last step to the first;
    ``lax.scan(reverse=True)`` returns its outputs in the sequence's order, as torch
    re-reverses them (step t's output has read steps t to the end)."""
    suffix = "_reverse" if reverse else ""
    W_ih, W_hh = p[f"{name}.weight_ih_l0{suffix}"], p[f"{name}.weight_hh_l0{suffix}"]
    bias = p[f"{name}.bias_ih_l0{suffix}"] + p[f"{name}.bias_hh_l0{suffix}"]
    inputs = x.transpose(1, 0, 2) @ W_ih.T + bias  # (seq, batch, 4 hidden)

    def cell(state, gates_x):
        h, c = state
        gates = gates_x + h @ W_hh.T
        i, f, g, o = (gates[:, j * hidden : (j + 1) * hidden] for j in range(4))
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
        h = jax.nn.sigmoid(o) * jnp.tanh(c)
        # the classifier keeps no step's output: the scan stacks none
        return (h, c), (h if sequence else None)

    zeros = jnp.zeros((x.shape[0], hidden), x.dtype)
    (h, _), outputs = lax.scan(cell, (zeros, zeros), inputs, reverse=reverse)
    return outputs if sequence else h


def lstm(arch: dict):
    hidden = arch["hidden"]

    def forward(p, x):
        return _linear(p, "head", _lstm(p, "lstm", x, hidden))

    return forward


def bilstm_tagger(arch: dict):
    """torch's bidirectional LSTM: each step's output is the forward direction's hidden
    state followed by the reverse direction's; the head reads every step."""
    hidden = arch["hidden"]

    def forward(p, x):
        forward_states = _lstm(p, "lstm", x, hidden, sequence=True)
        backward_states = _lstm(p, "lstm", x, hidden, reverse=True, sequence=True)
        h = jnp.concatenate([forward_states, backward_states], axis=-1)  # (seq, batch, 2 h)
        return _linear(p, "head", h.transpose(1, 0, 2))

    return forward


def gru(arch: dict):
    """torch's GRU (gates r, z, n in its weights' order; the reset gate applied after
    the recurrent product, as ONNX's ``linear_before_reset=1`` that torch exports):
    r = s(W_ir x + b_ir + W_hr h + b_hr), z = s(W_iz x + b_iz + W_hz h + b_hz),
    n = tanh(W_in x + b_in + r (W_hn h + b_hn)), h' = (1 - z) n + z h."""
    hidden = arch["hidden"]

    def forward(p, x):
        W_ih, W_hh = p["gru.weight_ih_l0"], p["gru.weight_hh_l0"]
        b_hh = p["gru.bias_hh_l0"]  # apart: r multiplies its n part
        inputs = x.transpose(1, 0, 2) @ W_ih.T + p["gru.bias_ih_l0"]  # (seq, batch, 3 h)

        def cell(h, gates_x):
            gates_h = h @ W_hh.T + b_hh
            x_r, x_z, x_n = (gates_x[:, j * hidden : (j + 1) * hidden] for j in range(3))
            h_r, h_z, h_n = (gates_h[:, j * hidden : (j + 1) * hidden] for j in range(3))
            r, z = jax.nn.sigmoid(x_r + h_r), jax.nn.sigmoid(x_z + h_z)
            n = jnp.tanh(x_n + r * h_n)
            return (1 - z) * n + z * h, None

        h, _ = lax.scan(cell, jnp.zeros((x.shape[0], hidden), x.dtype), inputs)
        return _linear(p, "head", h)

    return forward


FORWARD = {
    "sequential": sequential,
    "transformer": transformer,
    "lstm": lstm,
    "gru": gru,
    "bilstm_tagger": bilstm_tagger,
}
