"""graphkit/resize.py: a nearest-neighbour Resize by whole factors as a broadcast,
against onnxruntime's Resize kernel (outputs) and torch (a U-Net-style upsampling,
both exporters, trained on both backends)."""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import pytest
from conftest import (
    INSTALLED_BACKENDS,
    assert_sgd_epoch_equals_torch,
    export_dynamo,
    requires_torch,
)
from onnx import TensorProto, helper, numpy_helper

from graphkit.engine.ort_engine import Runner
from graphkit.resize import resizes_as_broadcasts_or_products


def resize(shape, scales=None, sizes=None, **attrs) -> onnx.ModelProto:
    inputs = ["X", "", "scales" if scales is not None else ""]
    inits = []
    if scales is not None:
        inits.append(numpy_helper.from_array(np.array(scales, np.float32), "scales"))
    if sizes is not None:
        inputs.append("sizes")
        inits.append(numpy_helper.from_array(np.array(sizes, np.int64), "sizes"))
    graph = helper.make_graph(
        [helper.make_node("Resize", inputs, ["Y"], **attrs)],
        "resize",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None] * len(shape))],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


NEAREST = {"mode": "nearest"}
TAKEN = {
    "asymmetric floor, 2x2": (
        [None, 2, 3, 4],
        [1, 1, 2, 2],
        None,
        dict(NEAREST, coordinate_transformation_mode="asymmetric", nearest_mode="floor"),
    ),
    "half_pixel (the default), 3x2": ([None, 2, 3, 4], [1, 1, 3, 2], None, NEAREST),
    "pytorch_half_pixel, round up": (
        [None, 2, 3, 4],
        [1, 1, 2, 3],
        None,
        dict(
            NEAREST,
            coordinate_transformation_mode="pytorch_half_pixel",
            nearest_mode="round_prefer_ceil",
        ),
    ),
    "sizes of a static shape": ([2, 2, 3, 4], None, [2, 2, 6, 8], NEAREST),
    "rank 3": ([None, 2, 5], [1, 1, 4], None, NEAREST),
    "rank 5": ([None, 1, 2, 3, 2], [1, 1, 2, 1, 2], None, NEAREST),
}


@pytest.mark.parametrize("case", sorted(TAKEN))
def test_the_broadcast_computes_onnxruntimes_resize(case):
    shape, scales, sizes, attrs = TAKEN[case]
    original = resize(shape, scales, sizes, **attrs)
    rewritten = resizes_as_broadcasts_or_products(original)
    kinds = {n.op_type for n in rewritten.graph.node}
    assert "Resize" not in kinds and "Expand" in kinds
    onnx.checker.check_model(rewritten, full_check=True)
    concrete = [2 if d is None else d for d in shape]
    X = np.random.default_rng(0).normal(size=concrete).astype(np.float32)
    (got,), (expected,) = Runner(rewritten)({"X": X}), Runner(original)({"X": X})
    np.testing.assert_array_equal(got, expected)


LINEAR = {
    "half_pixel (the default), 2x2": ([None, 2, 3, 4], [1, 1, 2, 2], None, {}),
    "pytorch_half_pixel, 3x on the width": (
        [None, 2, 3, 4],
        [1, 1, 1, 3],
        None,
        dict(coordinate_transformation_mode="pytorch_half_pixel"),
    ),
    "align_corners, sizes": (
        [2, 2, 3, 4],
        None,
        [2, 2, 7, 5],
        dict(coordinate_transformation_mode="align_corners"),
    ),
    "asymmetric, 1.5x": (
        [None, 1, 4, 4],
        [1, 1, 1.5, 2],
        None,
        dict(coordinate_transformation_mode="asymmetric"),
    ),
    "a reduction": ([None, 1, 6, 6], [1, 1, 0.5, 0.5], None, {}),
    "rank 3": ([None, 2, 5], [1, 1, 2], None, {}),
}


@pytest.mark.parametrize("case", sorted(LINEAR))
def test_the_products_compute_onnxruntimes_linear_resize(case):
    shape, scales, sizes, attrs = LINEAR[case]
    original = resize(shape, scales, sizes, mode="linear", **attrs)
    rewritten = resizes_as_broadcasts_or_products(original)
    kinds = {n.op_type for n in rewritten.graph.node}
    assert "Resize" not in kinds and "MatMul" in kinds
    onnx.checker.check_model(rewritten, full_check=True)
    concrete = [3 if d is None else d for d in shape]
    X = np.random.default_rng(0).normal(size=concrete).astype(np.float32)
    (got,), (expected,) = Runner(rewritten)({"X": X}), Runner(original)({"X": X})
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


LEFT = {
    "cubic": ([1, 1, 2, 2], dict(mode="cubic")),
    "linear on the channels": ([1, 2, 2, 2], dict(mode="linear")),
    "align_corners": ([1, 1, 2, 2], dict(NEAREST, coordinate_transformation_mode="align_corners")),
    "asymmetric rounding": (
        [1, 1, 2, 2],
        dict(
            NEAREST, coordinate_transformation_mode="asymmetric", nearest_mode="round_prefer_floor"
        ),
    ),
    "half_pixel floor": ([1, 1, 2, 2], dict(NEAREST, nearest_mode="floor")),
    "a fraction": ([1, 1, 1.5, 2], NEAREST),
    "a reduction": ([1, 1, 0.5, 0.5], NEAREST),
}


@pytest.mark.parametrize("case", sorted(LEFT))
def test_other_resizes_are_left(case):
    scales, attrs = LEFT[case]
    original = resize([None, 2, 4, 4], scales, **attrs)
    assert resizes_as_broadcasts_or_products(original) is original


def test_a_linear_resize_of_unknown_extents_is_left():
    original = resize([None, 2, "H", "W"], [1, 1, 2, 2], mode="linear")
    assert resizes_as_broadcasts_or_products(original) is original


def test_scales_computed_from_a_weight_are_left():
    """``scales`` from an initializer through a ``Concat``: an initializer may be a weight
    the user trains, so nothing computed from one is evaluated."""
    original = resize([None, 2, 4, 4], [1, 1])
    graph = original.graph
    graph.initializer.append(numpy_helper.from_array(np.array([2, 2], np.float32), "more"))
    graph.node.insert(0, helper.make_node("Concat", ["scales", "more"], ["all"], axis=0))
    graph.node[1].input[2] = "all"
    assert resizes_as_broadcasts_or_products(original) is original


class _Decoder:
    """A U-Net-style piece: a strided Conv down, ReLU, upsampling by 2, a Conv."""

    @staticmethod
    def build(mode: str = "nearest", align_corners: bool | None = None):
        import torch

        class Net(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.down = torch.nn.Conv2d(1, 4, 3, stride=2, padding=1)
                self.up = torch.nn.Upsample(scale_factor=2, mode=mode, align_corners=align_corners)
                self.out = torch.nn.Conv2d(4, 1, 3, padding=1)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.out(self.up(torch.relu(self.down(x))))

        torch.manual_seed(0)
        return Net()


def _export(net, X: np.ndarray, exporter: str) -> onnx.ModelProto:
    import torch

    if exporter == "dynamo":
        return export_dynamo(net, X)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        buffer = io.BytesIO()
        torch.onnx.export(
            net,
            (torch.from_numpy(X[:2]),),
            buffer,
            dynamo=False,
            opset_version=17,
            do_constant_folding=False,
            input_names=["X"],
            output_names=["Y"],
            dynamic_axes={"X": {0: "N"}, "Y": {0: "N"}},
        )
        return onnx.load_from_string(buffer.getvalue())


@requires_torch
@pytest.mark.parametrize("backend", INSTALLED_BACKENDS)
@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_a_nearest_upsampling_trains_as_torch(exporter, backend):
    """Both exporters write ``nn.Upsample(scale_factor=2)`` as a ``Resize`` (the native
    backend needed its whole shape, onnxruntime-training has no CPU ``ResizeGrad``):
    2 SGD steps equal torch's within 1e-5."""

    rng = np.random.default_rng(4)
    X = rng.normal(size=(16, 1, 8, 8)).astype(np.float32)
    y = rng.normal(size=(16, 1, 8, 8)).astype(np.float32)
    net = _Decoder.build()
    onx = _export(net, X, exporter)
    assert "Resize" in {n.op_type for n in onx.graph.node}
    assert_sgd_epoch_equals_torch(onx, net, X, y, backend)


@requires_torch
@pytest.mark.parametrize("backend", INSTALLED_BACKENDS)
@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("align_corners", [False, True])
def test_a_bilinear_upsampling_trains_as_torch(align_corners, exporter, backend):
    """``nn.Upsample(mode="bilinear")``, a linear ``Resize``: the native backend needed
    its whole shape, onnxruntime-training has no CPU ``ResizeGrad``; as products by
    interpolation matrices, 2 SGD steps equal torch's within 1e-5."""
    rng = np.random.default_rng(5)
    X = rng.normal(size=(16, 1, 8, 8)).astype(np.float32)
    y = rng.normal(size=(16, 1, 8, 8)).astype(np.float32)
    net = _Decoder.build("bilinear", align_corners)
    onx = _export(net, X, exporter)
    assert "Resize" in {n.op_type for n in onx.graph.node}
    assert_sgd_epoch_equals_torch(onx, net, X, y, backend)
