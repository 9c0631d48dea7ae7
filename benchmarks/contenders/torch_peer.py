"""PyTorch contenders (``.venv-bench-torch``: torch 2.13.0 CPU, onnx2torch):

* ``eager``: the workload's module (``torch_models.build``), ``torch.optim`` SGD/AdamW;
* ``compile``: the same module under ``torch.compile`` (inductor, C++ kernels built with
  gcc) and the optimizer step compiled too (PyTorch's recipe for compiled optimizers);
* ``onnx2torch``: the workload's ONNX graph converted by onnx2torch, its weights (which
  it stores as buffers) turned into Parameters, trained eagerly.

Every batch's loss is read back (``loss.item()``), as a real training loop does. On
``cuda`` the module and the whole data set move to the GPU once, at setup, and float32
stays float32 (TF32 off for matmuls and cuDNN, as graphkit's CUDA sessions and the JAX
contenders compute); cuDNN picks its convolution algorithms by timing them
(``cudnn.benchmark``), as onnxruntime's CUDA provider does by default.
"""

from __future__ import annotations

import sys
import types

import torch
import torch.nn.functional as F
from spec import NotApplicable, Spec

VERSION = f"torch {torch.__version__}" + (
    f" on {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
)


def make(kind: str, spec: Spec):
    torch.manual_seed(0)
    torch.set_num_threads(spec.threads)
    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cudnn.benchmark = True
    if kind == "onnx2torch":
        net = onnx2torch_module(spec)
    else:
        from torch_models import build

        net = build(spec.arch, spec.weights)
    net = net.to(device)
    parameters = list(net.parameters())
    if spec.optimizer == "sgd":
        opt = torch.optim.SGD(parameters, lr=spec.lr)
    else:
        opt = torch.optim.AdamW(parameters, lr=spec.lr, weight_decay=spec.weight_decay)
    criterion = CRITERIA[spec.loss]
    forward, update = net, opt.step
    if kind == "compile":
        forward = torch.compile(net)
        update = torch.compile(opt.step)
    X, y = torch.from_numpy(spec.X).to(device), torch.from_numpy(spec.y).to(device)

    def epoch() -> float:
        total = 0.0
        for batch in spec.slices():
            opt.zero_grad()
            loss = criterion(forward(X[batch]), y[batch])
            loss.backward()
            update()
            total += loss.item()
        return total / spec.batches

    return epoch


def _token_cross_entropy(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The mean over every token of (batch, seq, classes) logits: CrossEntropyLoss
    takes the classes on axis 1, so the tokens are flattened into rows first."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


CRITERIA = {
    "mse": torch.nn.MSELoss(),
    "ce": torch.nn.CrossEntropyLoss(),
    "token_ce": _token_cross_entropy,
}


def onnx2torch_module(spec: Spec) -> torch.nn.Module:
    """onnx2torch imports torchvision (for NMS and RoiAlign), whose registry wheel does
    not load beside torch 2.13.0+cpu: a stub module stands in for it in this process
    only (the workloads use neither operator)."""
    if "torchvision" not in sys.modules:
        stub = types.ModuleType("torchvision")
        stub.ops = types.ModuleType("torchvision.ops")
        for name in ("nms", "roi_align", "box_convert"):
            setattr(stub.ops, name, _not_in_the_stub)
        sys.modules["torchvision"] = stub
        sys.modules["torchvision.ops"] = stub.ops
    import onnx
    from onnx2torch import convert

    try:
        net = convert(onnx.load(spec.model_path))
    except Exception as exc:  # an operator onnx2torch does not convert
        raise NotApplicable(f"onnx2torch cannot convert the graph: {exc}") from exc
    # initializers that onnx2torch did not fold into a torch layer (Gemm -> Linear,
    # Conv -> Conv2d, whose weights are Parameters) arrive as buffers of one container:
    # make the floating-point ones trainable, as graphkit trains every float initializer
    container = getattr(net, "initializers", None)
    if container is not None:
        for name, buffer in list(container.named_buffers(recurse=False)):
            if buffer.is_floating_point():
                del container._buffers[name]
                container.register_parameter(name, torch.nn.Parameter(buffer))
    if not list(net.parameters()):
        raise NotApplicable("onnx2torch left no trainable weight")
    return net


def _not_in_the_stub(*args, **kwargs):
    """torchvision's operators, if a converted graph ever called one: a loud failure,
    never a result (the benchmark's workloads hold no NMS or RoiAlign)."""
    raise NotImplementedError("torchvision is stubbed in the onnx2torch contender")
