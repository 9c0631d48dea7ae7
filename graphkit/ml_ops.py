"""skl2onnx's linear models as standard ONNX operators, so that they can be trained.

scikit-learn's linear models convert to ``ai.onnx.ml`` operators (``LinearRegressor``,
``LinearClassifier``, ``Normalizer``, ``Scaler``, ``ArrayFeatureExtractor``) that hold their
coefficients in attributes or have no gradient in onnxruntime-training.
:func:`linear_models_as_standard_ops` writes the same functions with ``Gemm``,
``Sigmoid``, ``Softmax``, ``ArgMax``, ``Gather`` and reductions, and the coefficients
become initializers: Ridge, LinearRegression, LogisticRegression or LinearSVC then
train like any other model. ``add_loss_output`` and both
trainers apply it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from graphkit._graph import GraphInfo, copy_model, int_constant, namer
from graphkit.compat import DSL_OPSET, NEWEST, make_compatible, opset_of


def linear_models_as_standard_ops(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy where ``ai.onnx.ml`` linear models are standard operators (see module).

    * ``LinearRegressor``: ``Y = X W^T + b``;
    * ``LinearClassifier``: ``scores = X W^T + b`` then its ``post_transform`` (NONE,
      LOGISTIC or SOFTMAX), labels ``classlabels[argmax(scores)]``;
    * ``Normalizer``: each row divided by its L1 norm, L2 norm or maximum;
    * ``Scaler``: ``(X - offset) * scale``, its vectors as constants (never trained);
    * ``ArrayFeatureExtractor`` on a float (N, C) tensor: ``Gather`` of its columns.

    The coefficients become the initializers ``<node>/coefficients`` and
    ``<node>/intercepts``. A variant these formulas do not cover is left as it is (and
    refused by the trainers, naming the operator).
    """
    if not any(n.domain == "ai.onnx.ml" and n.op_type in _ML_REWRITES for n in model.graph.node):
        return copy_model(model)
    # ReduceMax takes axes as an input from opset 18 on; a model already there (standard_model
    # made it compatible with its backend) is not converted again
    written = DSL_OPSET <= (opset_of(model) or 0) <= NEWEST.opset
    out = copy_model(model) if written else make_compatible(model, min_opset=DSL_OPSET)
    info = GraphInfo(out)
    nodes: list[onnx.NodeProto] = []
    for node in out.graph.node:
        rewrite = _ML_REWRITES.get(node.op_type) if node.domain == "ai.onnx.ml" else None
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        replacement = rewrite(node, attrs, info, out) if rewrite else None
        nodes.extend([node] if replacement is None else replacement)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out


def _float_input(x: str, info: GraphInfo, name: Callable[[str], str]) -> tuple[str, list]:
    """``x`` as float32 (the ml operators take ints and doubles too)."""
    if info.elem.get(x, onnx.TensorProto.FLOAT) == onnx.TensorProto.FLOAT:
        return x, []
    cast = name("float_input")
    return cast, [helper.make_node("Cast", [x], [cast], to=onnx.TensorProto.FLOAT)]


def _affine(
    node: onnx.NodeProto, attrs: dict, info: GraphInfo, model: onnx.ModelProto, rows: int
) -> tuple[str, list[onnx.NodeProto], Callable[[str], str]]:
    """``X W^T + b`` with W and b as new initializers; returns the scores' name."""
    name = namer(node.name or node.output[0], info.taken)
    coefficients = np.asarray(attrs["coefficients"], dtype=np.float32).reshape(rows, -1)
    intercepts = np.asarray(attrs.get("intercepts", np.zeros(rows)), dtype=np.float32)
    weight, bias, scores = name("coefficients"), name("intercepts"), name("scores")
    model.graph.initializer.extend(
        [
            numpy_helper.from_array(np.ascontiguousarray(coefficients.T), weight),
            numpy_helper.from_array(intercepts.reshape(rows), bias),
        ]
    )
    x, nodes = _float_input(node.input[0], info, name)
    nodes.append(helper.make_node("Gemm", [x, weight, bias], [scores]))
    return scores, nodes, name


def _linear_regressor(
    node: onnx.NodeProto, attrs: dict, info: GraphInfo, model: onnx.ModelProto
) -> list[onnx.NodeProto] | None:
    if _post_transform(attrs) != "NONE":
        return None
    scores, nodes, _ = _affine(node, attrs, info, model, int(attrs.get("targets", 1)))
    nodes.append(helper.make_node("Identity", [scores], [node.output[0]]))
    return nodes


def _linear_classifier(
    node: onnx.NodeProto, attrs: dict, info: GraphInfo, model: onnx.ModelProto
) -> list[onnx.NodeProto] | None:
    labels = attrs.get("classlabels_ints") or attrs.get("classlabels_strings")
    rows = len(attrs["intercepts"]) if attrs.get("intercepts") else None
    post = _post_transform(attrs)
    if not labels or rows != len(labels) or post not in ("NONE", "LOGISTIC", "SOFTMAX"):
        return None  # one row for two classes (a binary SVM), or another transform
    scores, nodes, name = _affine(node, attrs, info, model, rows)
    index, table = name("argmax"), name("classlabels")
    ints = bool(attrs.get("classlabels_ints"))
    values = np.array(labels if ints else [v.decode() for v in labels])
    nodes += [
        helper.make_node("ArgMax", [scores], [index], axis=1, keepdims=0),
        helper.make_node(
            "Constant",
            [],
            [table],
            value=numpy_helper.from_array(values.astype(np.int64 if ints else object)),
        ),
        helper.make_node("Gather", [table, index], [node.output[0]]),
    ]
    if len(node.output) > 1 and node.output[1]:
        transform = {"NONE": "Identity", "LOGISTIC": "Sigmoid", "SOFTMAX": "Softmax"}[post]
        extra: dict[str, Any] = {"axis": 1} if post == "SOFTMAX" else {}
        nodes.append(helper.make_node(transform, [scores], [node.output[1]], **extra))
    return nodes


def _normalizer(
    node: onnx.NodeProto, attrs: dict, info: GraphInfo, model: onnx.ModelProto
) -> list[onnx.NodeProto] | None:
    norm = attrs.get("norm", b"MAX")
    norm = norm.decode() if isinstance(norm, bytes) else norm
    if norm not in ("L1", "L2", "MAX"):
        return None
    name = namer(node.name or node.output[0], info.taken)
    x, nodes = _float_input(node.input[0], info, name)
    axes, total = name("axes"), name("norm")
    nodes.append(int_constant(axes, [1]))
    if norm == "L1":  # y = x / sum |x|
        magnitude = name("abs")
        nodes.append(helper.make_node("Abs", [x], [magnitude]))
        nodes.append(helper.make_node("ReduceSum", [magnitude, axes], [total], keepdims=1))
    elif norm == "L2":  # y = x / sqrt(sum x^2)
        squares, summed = name("squares"), name("sum")
        nodes.append(helper.make_node("Mul", [x, x], [squares]))
        nodes.append(helper.make_node("ReduceSum", [squares, axes], [summed], keepdims=1))
        nodes.append(helper.make_node("Sqrt", [summed], [total]))
    else:  # y = x / max x
        nodes.append(helper.make_node("ReduceMax", [x, axes], [total], keepdims=1))
    nodes.append(helper.make_node("Div", [x, total], [node.output[0]]))
    return nodes


def _array_feature_extractor(
    node: onnx.NodeProto, attrs: dict, info: GraphInfo, model: onnx.ModelProto
) -> list[onnx.NodeProto] | None:
    """Columns of a float (N, C) tensor: ``Gather(X, flatten(indices), axis=1)``."""
    x = node.input[0]
    float_types = (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE)
    if info.rank.get(x) != 2 or info.elem.get(x) not in float_types:
        return None  # a label table (int64 or strings) picked by an argmax: left as it is
    name = namer(node.name or node.output[0], info.taken)
    flat, shape = name("indices"), name("shape")
    return [
        int_constant(shape, [-1]),
        helper.make_node("Reshape", [node.input[1], shape], [flat]),
        helper.make_node("Gather", [x, flat], [node.output[0]], axis=1),
    ]


def _scaler(
    node: onnx.NodeProto, attrs: dict, info: GraphInfo, model: onnx.ModelProto
) -> list[onnx.NodeProto]:
    """``Y = (X - offset) * scale`` (a StandardScaler's mean and 1/std). The two vectors
    are Constant nodes, not initializers: a pipeline's preprocessing is not a parameter
    to train."""
    name = namer(node.name or node.output[0], info.taken)
    x, nodes = _float_input(node.input[0], info, name)
    offset, scale, centred = name("offset"), name("scale"), name("centred")
    for tensor, key in ((offset, "offset"), (scale, "scale")):
        values = np.asarray(attrs.get(key, [0.0 if key == "offset" else 1.0]), np.float32)
        nodes.append(
            helper.make_node("Constant", [], [tensor], value=numpy_helper.from_array(values))
        )
    nodes.append(helper.make_node("Sub", [x, offset], [centred]))
    nodes.append(helper.make_node("Mul", [centred, scale], [node.output[0]]))
    return nodes


_ML_REWRITES = {
    "ArrayFeatureExtractor": _array_feature_extractor,
    "Scaler": _scaler,
    "LinearRegressor": _linear_regressor,
    "LinearClassifier": _linear_classifier,
    "Normalizer": _normalizer,
}


def _post_transform(attrs: dict) -> str:
    value = attrs.get("post_transform", b"NONE")
    return value.decode() if isinstance(value, bytes) else value


__all__ = ["linear_models_as_standard_ops"]
