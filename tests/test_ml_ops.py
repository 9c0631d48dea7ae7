"""skl2onnx's linear models rewritten with standard operators compute what onnxruntime's
own ai.onnx.ml kernels compute, and then train."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from onnx import TensorProto, helper

import graphkit as gk
from graphkit.ml_ops import linear_models_as_standard_ops
from graphkit_train import OrtGradientOptimizer


def _data(task, rng):
    X = rng.normal(size=(120, 5)).astype(np.float32)
    if task == "regression":
        return X, X @ rng.normal(size=5) + 0.1 * rng.normal(size=120)
    if task == "binary":
        return X, (X[:, 0] + X[:, 1] > 0).astype(np.int64)
    return X, np.digitize(X[:, 0] + 0.5 * X[:, 1], [-0.5, 0.5])


def _sklearn(kind):
    from sklearn.linear_model import LinearRegression, LogisticRegression, Ridge
    from sklearn.multiclass import OneVsRestClassifier
    from sklearn.svm import LinearSVC

    return {
        "Ridge": (Ridge(alpha=0.5), "regression"),
        "LinearRegression": (LinearRegression(), "regression"),
        "LogisticRegression binary": (LogisticRegression(), "binary"),
        "LogisticRegression multiclass": (LogisticRegression(), "multiclass"),
        "one-vs-rest (Normalizer)": (OneVsRestClassifier(LogisticRegression()), "multiclass"),
        "LinearSVC (ArrayFeatureExtractor)": (LinearSVC(), "binary"),
    }[kind]


KINDS = [
    "Ridge",
    "LinearRegression",
    "LogisticRegression binary",
    "LogisticRegression multiclass",
    "one-vs-rest (Normalizer)",
    "LinearSVC (ArrayFeatureExtractor)",
]


@pytest.mark.parametrize("kind", KINDS)
def test_rewritten_linear_models_match_onnxruntime(kind, rng):
    from skl2onnx import to_onnx

    model, task = _sklearn(kind)
    X, y = _data(task, rng)
    model.fit(X, y)
    options = None if task == "regression" or "SVC" in kind else {"zipmap": False}
    onx = to_onnx(model, X[:1], options=options, target_opset={"": 17, "ai.onnx.ml": 3})
    rewritten = linear_models_as_standard_ops(onx)
    rewritten_ops = {"LinearRegressor", "LinearClassifier", "Normalizer"}
    assert not [n.op_type for n in rewritten.graph.node if n.op_type in rewritten_ops]
    for node in rewritten.graph.node:  # only label tables are still picked by ml operators
        if node.op_type == "ArrayFeatureExtractor":
            table = next(i for i in rewritten.graph.initializer if i.name == node.input[0])
            assert table.data_type not in (TensorProto.FLOAT, TensorProto.DOUBLE)
    expected, got = gk.run(onx, {"X": X}), gk.run(rewritten, {"X": X})
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    assert list(gk.get_train_initializer(rewritten))  # the coefficients are weights now


def test_logistic_regression_trains_from_a_poor_start(rng):
    from skl2onnx import to_onnx
    from sklearn.linear_model import LogisticRegression

    X, y = _data("multiclass", rng)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        clf = LogisticRegression(max_iter=1).fit(X[:20], y[:20])
    onx = to_onnx(clf, X[:1], options={"zipmap": False})
    trainer = OrtGradientOptimizer(
        gk.add_loss_output(onx, "log", output_index="probabilities", label_name="y"),
        max_iter=30,
        batch_size=16,
        learning_rate=(gk.optimizers.get("adam"), 0.05),
        random_state=0,
    ).fit(X, y)
    reference = LogisticRegression().fit(X, y).score(X, y)
    assert trainer.score(X, y) >= reference - 0.03
    # the exported model is the user's model with standard operators and trained weights
    exported = trainer.get_trained_onnx()
    np.testing.assert_allclose(
        gk.run(exported, {"X": X})["probabilities"], trainer.predict_proba(X), rtol=1e-5
    )


def test_a_variant_without_formula_is_left_alone_and_refused():
    """One coefficient row for two classes (a binary linear SVM) is not rewritten."""
    node = helper.make_node(
        "LinearClassifier",
        ["X"],
        ["label", "scores"],
        domain="ai.onnx.ml",
        coefficients=[1.0, 2.0],
        intercepts=[0.5],
        classlabels_ints=[0, 1],
    )
    graph = helper.make_graph(
        [node],
        "svm",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 2])],
        [
            helper.make_tensor_value_info("label", TensorProto.INT64, ["N"]),
            helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["N", 2]),
        ],
    )
    onx = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ai.onnx.ml", 3)],
        ir_version=10,
    )
    assert linear_models_as_standard_ops(onx).graph.node[0].op_type == "LinearClassifier"
    with pytest.raises(gk.MissingGradientError, match="LinearClassifier"):
        OrtGradientOptimizer(gk.add_loss_output(onx, output_index="scores")).fit(
            np.ones((4, 2), np.float32), np.ones(4, np.float32)
        )


@pytest.mark.parametrize("norm", ["L1", "L2", "MAX"])
def test_normalizer_matches_onnxruntime(norm, rng):
    node = helper.make_node("Normalizer", ["X"], ["Y"], domain="ai.onnx.ml", norm=norm)
    graph = helper.make_graph(
        [node],
        "normalizer",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 4])],
    )
    onx = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ai.onnx.ml", 3)],
        ir_version=10,
    )
    X = rng.uniform(0.1, 2.0, size=(6, 4)).astype(np.float32)
    X[0] *= -1  # a row of negative values: the norms take absolute values, the maximum not
    rewritten = linear_models_as_standard_ops(onx)
    assert "Normalizer" not in {n.op_type for n in rewritten.graph.node}
    np.testing.assert_allclose(
        gk.run(rewritten, {"X": X})["Y"], gk.run(onx, {"X": X})["Y"], rtol=1e-6
    )


def test_a_model_above_the_opsets_every_backend_loads_keeps_its_opset(rng):
    """A linear model at an opset newer than every backend loads (22) is rewritten at
    its own opset (a trainer's backend converts it down where its runtime needs it), and
    computes the same wherever it runs (graphkit.run converts it for onnxruntime 1.19.2)."""
    from skl2onnx import to_onnx
    from sklearn.linear_model import Ridge

    from graphkit.compat import MAX_OPSET, opset_of

    X, y = _data("regression", rng)
    onx = to_onnx(Ridge().fit(X, y), X[:1], target_opset={"": 17, "ai.onnx.ml": 3})
    next(o for o in onx.opset_import if o.domain == "").version = MAX_OPSET + 1
    onx.ir_version = 10
    rewritten = linear_models_as_standard_ops(onx)
    assert opset_of(rewritten) == MAX_OPSET + 1
    got = next(iter(gk.run(rewritten, {"X": X}).values())).ravel()
    coefficients = np.array(
        [a for a in onx.graph.node[0].attribute if a.name == "coefficients"][0].floats
    )
    intercepts = np.array(
        [a for a in onx.graph.node[0].attribute if a.name == "intercepts"][0].floats
    )
    np.testing.assert_allclose(got, X @ coefficients + intercepts, rtol=1e-5, atol=1e-5)


def test_graphkit_s_own_loss_graph_is_still_checked_for_short_tensors():
    """A graph that says add_loss_output wrote it is not converted again, but a tensor
    whose data does not fill its dims is refused all the same."""
    from graphkit.prepare import standard_model
    from graphkit.rewrite import META_LOSS

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 2])
    loss = helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])
    w = helper.make_tensor("w", TensorProto.FLOAT, [2], np.ones(2, np.float32).tobytes(), raw=True)
    w.raw_data = w.raw_data[:4]  # one float for two
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["p"]),
        helper.make_node("ReduceSum", ["p"], ["loss"], keepdims=0),
    ]
    graph = helper.make_graph(nodes, "g", [x], [loss], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    helper.set_model_props(model, {META_LOSS: "loss"})
    with pytest.raises(gk.IncompatibleModelError, match="'w'"):
        standard_model(model)
