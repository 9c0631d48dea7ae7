"""add_loss_output and the weight helpers on real graphs: hand-built, skl2onnx and
torch.onnx.export. The loss each rewritten graph computes is compared with numpy,
scikit-learn or torch on the same data."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
from conftest import linear_regression_onnx
from onnx import TensorProto, helper, numpy_helper

import graphkit as gk
from graphkit import (
    DTypeError,
    ShapeError,
    UnknownNameError,
    add_loss_output,
    get_train_initializer,
    gradient_model,
    initializers_to_inputs,
    inputs_to_initializers,
    rename_weights,
    set_weights,
)
from graphkit.dsl import FLOAT, op, script
from graphkit.engine.ort_engine import Runner
from graphkit.rewrite import metadata


def run(model, **feeds):
    return Runner(model)(feeds)


def finite_difference_wrt_initializer(model, name, feeds, eps=1e-6):
    """d loss / d initializer by central differences on float64 copies of the model."""
    base = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    value = base[name].astype(np.float64)
    grad = np.zeros_like(value)
    for index in np.ndindex(value.shape):
        losses = []
        for sign in (1, -1):
            shifted = value.copy()
            shifted[index] += sign * eps
            losses.append(float(run(set_weights(model, {name: shifted}), **feeds)[0]))
        grad[index] = (losses[0] - losses[1]) / (2 * eps)
    return grad


@pytest.fixture
def linreg(rng):
    coef = rng.normal(size=(3, 1))
    intercept = rng.normal(size=(1,))
    return linear_regression_onnx(coef, intercept), coef, intercept


def test_linear_regression_squared_error_with_penalty(linreg, rng):
    model, coef, intercept = linreg
    X, y = rng.normal(size=(20, 3)), rng.normal(size=20)
    onx = add_loss_output(model, penalty={"coef": {"l1": 0.1, "l2": 0.2}})
    onnx.checker.check_model(onx, full_check=True)
    assert [o.name for o in onx.graph.output] == ["loss", "Y"]
    assert [i.name for i in onx.graph.input] == ["X", "label"]
    loss, prediction = run(onx, X=X, label=y.reshape(-1, 1))
    expected_prediction = X @ coef + intercept
    expected = np.mean((expected_prediction[:, 0] - y) ** 2)
    expected += 0.1 * np.abs(coef).sum() + 0.2 * (coef**2).sum()
    assert loss == pytest.approx(expected, rel=1e-12)
    np.testing.assert_allclose(prediction, expected_prediction, rtol=1e-12)
    assert metadata(onx)["graphkit.label_input"] == "label"


def test_rewrite_leaves_the_original_untouched(linreg):
    model = linreg[0]
    before = model.SerializeToString()
    add_loss_output(model, "elastic", l1_weight=0.1, l2_weight=0.9)
    assert model.SerializeToString() == before


@pytest.mark.parametrize(
    "score,kwargs,reference",
    [
        ("l1", {}, lambda d: np.abs(d).mean()),
        (
            "elastic",
            {"l1_weight": 0.1, "l2_weight": 0.9},
            lambda d: (0.1 * np.abs(d) + 0.9 * d**2).mean(),
        ),
        ("squared_error", {"reduction": "sum"}, lambda d: (d**2).sum()),
        (
            "huber",
            {"delta": 0.5},
            lambda d: np.where(np.abs(d) < 0.5, d**2 / 2, 0.5 * (np.abs(d) - 0.25)).mean(),
        ),
    ],
)
def test_linear_regression_losses(linreg, rng, score, kwargs, reference):
    model, coef, intercept = linreg
    X, y = rng.normal(size=(15, 3)), rng.normal(size=(15, 1))
    onx = add_loss_output(model, score, **kwargs)
    d = X @ coef + intercept - y
    assert run(onx, X=X, label=y)[0] == pytest.approx(reference(d), rel=1e-12)


def test_sample_weights(linreg, rng):
    model, coef, intercept = linreg
    X, y, w = rng.normal(size=(10, 3)), rng.normal(size=(10, 1)), rng.uniform(0, 2, 10)
    onx = add_loss_output(model, weight_name="weight")
    assert [i.name for i in onx.graph.input] == ["X", "label", "weight"]
    d = (X @ coef + intercept - y)[:, 0]
    assert run(onx, X=X, label=y, weight=w)[0] == pytest.approx(
        (w * d**2).sum() / w.sum(), rel=1e-12
    )


def test_training_graph_gradient_matches_finite_differences(linreg, rng):
    model, _, _ = linreg
    X, y = rng.normal(size=(8, 3)), rng.normal(size=(8, 1))
    onx = add_loss_output(model, "huber", delta=0.3, penalty={"coef": {"l1": 0.05, "l2": 0.1}})
    grad = gradient_model(onx, "loss", ["coef", "intercept"])
    out = dict(zip([o.name for o in grad.graph.output], run(grad, X=X, label=y)))
    for name in ("coef", "intercept"):
        expected = finite_difference_wrt_initializer(onx, name, {"X": X, "label": y})
        np.testing.assert_allclose(out[f"{name}_grad"], expected, rtol=1e-6, atol=1e-9)


def test_skl2onnx_mlp_regressor(mlp_regressor, regression_data):
    sk, onx = mlp_regressor
    X, y = regression_data
    assert "shape_tensor" not in get_train_initializer(onx)
    assert list(get_train_initializer(onx)) == [
        "coefficient",
        "intercepts",
        "coefficient1",
        "intercepts1",
    ]
    trained = add_loss_output(onx, penalty={"coefficient1": 0.01})
    loss, prediction = run(trained, X=X, label=y.reshape(-1, 1))
    expected = np.mean((sk.predict(X) - y) ** 2) + 0.01 * (sk.coefs_[1] ** 2).sum()
    assert loss == pytest.approx(expected, rel=1e-5)
    assert any(
        i.name == "shape_tensor" and i.data_type == TensorProto.INT64
        for i in trained.graph.initializer
    )


def test_skl2onnx_mlp_regressor_is_differentiable(mlp_regressor, regression_data):
    """The composed graph (skl2onnx + graphkit loss) goes through the gradient builder."""
    _, onx = mlp_regressor
    X, y = regression_data
    trained = add_loss_output(onx)
    grad = gradient_model(trained, "loss", list(get_train_initializer(onx)))
    names = [o.name for o in grad.graph.output]
    assert {"coefficient_grad", "intercepts1_grad"} <= set(names)
    out = dict(zip(names, run(grad, X=X[:20], label=y[:20].reshape(-1, 1))))
    expected = finite_difference_wrt_initializer(
        trained, "intercepts1", {"X": X[:20], "label": y[:20].reshape(-1, 1)}, eps=1e-3
    )
    np.testing.assert_allclose(out["intercepts1_grad"], expected, rtol=1e-3)


def test_skl2onnx_mlp_classifier_log_loss(mlp_classifier, classification_data):
    from sklearn.metrics import log_loss

    sk, onx = mlp_classifier
    X, y = classification_data
    assert [o.name for o in onx.graph.output] == ["label", "probabilities"]
    with pytest.warns(UserWarning, match="label_name='label'.*'label_1'"):
        trained = add_loss_output(onx, "log", output_index="probabilities", weight_name="w")
    assert [o.name for o in trained.graph.output] == ["loss", "label", "probabilities"]
    label_input = next(i for i in trained.graph.input if i.name == "label_1")
    assert label_input.type.tensor_type.elem_type == TensorProto.INT64
    w = np.linspace(0.5, 1.5, len(y)).astype(np.float32)
    loss = run(trained, X=X, label_1=y, w=w)[0]
    assert loss == pytest.approx(log_loss(y, sk.predict_proba(X), sample_weight=w), rel=1e-5)


def test_output_index_by_position(mlp_classifier, classification_data):
    _, onx = mlp_classifier
    X, y = classification_data
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        by_name = add_loss_output(onx, "log", label_name="y", output_index="probabilities")
        by_index = add_loss_output(onx, "log", label_name="y", output_index=1)
    assert run(by_name, X=X, y=y)[0] == run(by_index, X=X, y=y)[0]


def test_torch_export_dotted_names(torch_mlp, rng):
    torch = pytest.importorskip("torch")
    net, onx = torch_mlp
    assert "0.weight" in get_train_initializer(onx)
    trained = add_loss_output(onx, "huber", delta=0.5, penalty={"0.weight": {"l2": 0.01}})
    X = rng.normal(size=(12, 4)).astype(np.float32)
    y = rng.normal(size=(12, 1)).astype(np.float32)
    with torch.no_grad():
        prediction = net(torch.tensor(X))
        expected = torch.nn.HuberLoss(delta=0.5)(prediction, torch.tensor(y))
        expected = expected + 0.01 * (net[0].weight ** 2).sum()
    assert run(trained, X=X, label=y)[0] == pytest.approx(expected.item(), rel=1e-5)


@script()
def pinball(prediction: FLOAT, label: FLOAT) -> FLOAT:
    """Quantile loss at 0.8: mean max(0.8 d, -0.2 d) with d = y - p."""
    d = label - prediction
    return op.ReduceMean(op.Max(op.CastLike(0.8, d) * d, op.CastLike(-0.2, d) * d), keepdims=0)


def test_custom_loss_in_add_loss_output(linreg, rng):
    model, coef, intercept = linreg
    X, y = rng.normal(size=(10, 3)), rng.normal(size=(10, 1))
    onx = add_loss_output(model, pinball)
    d = y - (X @ coef + intercept)
    assert run(onx, X=X, label=y)[0] == pytest.approx(
        np.maximum(0.8 * d, -0.2 * d).mean(), rel=1e-12
    )


def test_intermediate_named_label_is_renamed(rng):
    """A tensor called 'label' inside the graph must not capture the new label input."""
    coef = rng.normal(size=(2, 1))
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["X", "coef"], ["label"]),
            helper.make_node("Relu", ["label"], ["Y"]),
        ],
        "g",
        [helper.make_tensor_value_info("X", TensorProto.DOUBLE, ["N", 2])],
        [helper.make_tensor_value_info("Y", TensorProto.DOUBLE, ["N", 1])],
        [numpy_helper.from_array(coef, "coef")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    onx = add_loss_output(model)
    assert "label" in [i.name for i in onx.graph.input]
    assert all("label" not in n.output for n in onx.graph.node)
    X, y = rng.normal(size=(5, 2)), rng.normal(size=(5, 1))
    assert run(onx, X=X, label=y)[0] == pytest.approx(np.mean((np.maximum(X @ coef, 0) - y) ** 2))


def test_binary_scores_with_sigmoid_log_loss(rng):
    coef = rng.normal(size=(3, 1)).astype(np.float32)
    model = linear_regression_onnx(coef, np.zeros(1, np.float32))
    onx = add_loss_output(model, "sigmoid_log_loss")
    X = rng.normal(size=(10, 3)).astype(np.float32)
    y = rng.integers(0, 2, 10)
    s = (X @ coef)[:, 0].astype(np.float64)
    expected = np.mean(np.logaddexp(0, s) - y * s)
    assert run(onx, X=X, label=y)[0] == pytest.approx(expected, rel=1e-5)
    grad = gradient_model(onx, "loss", ["coef"])
    g = run(grad, X=X, label=y)[2]
    np.testing.assert_allclose(g[:, 0], X.T @ (1 / (1 + np.exp(-s)) - y) / 10, rtol=1e-4, atol=1e-6)


# -- bad input ------------------------------------------------------------------------


def test_classifier_loss_defaults_to_its_only_float_output(mlp_classifier):
    train = add_loss_output(mlp_classifier[1], "log", label_name="y")
    assert gk.rewrite.metadata(train)[gk.rewrite.META_PREDICTION] == "probabilities"


def test_several_float_outputs_need_output_index(linreg):
    onx = linreg[0]
    two = onnx.ModelProto()
    two.CopyFrom(onx)
    two.graph.node.append(helper.make_node("Neg", ["Y"], ["minus_Y"]))
    two.graph.output.append(helper.make_tensor_value_info("minus_Y", TensorProto.DOUBLE, ["N", 1]))
    with pytest.raises(ValueError, match=r"2 outputs \['Y', 'minus_Y'\].*output_index"):
        add_loss_output(two)


def test_output_index_naming_no_output(mlp_classifier):
    with pytest.raises(UnknownNameError, match="names no output"):
        add_loss_output(mlp_classifier[1], "log", output_index="proba")
    with pytest.raises(UnknownNameError, match="out of range"):
        add_loss_output(mlp_classifier[1], "log", output_index=5)


def test_integer_output_refused(mlp_classifier):
    with pytest.raises(DTypeError, match="'label' is INT64"):
        add_loss_output(mlp_classifier[1], output_index="label")


def test_zipmap_output_stands_for_its_probabilities(classification_data, mlp_classifier):
    """A skl2onnx ZipMap output (a sequence of maps) means the tensor it is made from."""
    from skl2onnx import to_onnx

    X, y = classification_data
    onx = to_onnx(mlp_classifier[0], X[:1])  # zipmap on by default
    train = add_loss_output(onx, "log", output_index="output_probability")
    zipmap = next(n for n in onx.graph.node if n.op_type == "ZipMap")
    assert gk.rewrite.metadata(train)[gk.rewrite.META_PREDICTION] == zipmap.input[0]
    loss = gk.run(train, {"X": X, "label": y})["loss"]
    probabilities = mlp_classifier[0].predict_proba(X)
    expected = -np.log(probabilities[np.arange(len(y)), y]).mean()
    assert loss == pytest.approx(expected, rel=1e-5)


def test_penalty_on_missing_weight(linreg):
    with pytest.raises(
        UnknownNameError, match=r"\['coeff'\].*Trainable weights: \['coef', 'intercept'\]"
    ):
        add_loss_output(linreg[0], penalty={"coeff": 0.1})


def test_unknown_score_name(linreg):
    with pytest.raises(UnknownNameError, match="Valid names"):
        add_loss_output(linreg[0], "squared")


def test_classification_loss_on_one_column(linreg):
    with pytest.raises(ShapeError, match="K >= 2"):
        add_loss_output(linreg[0], "cross_entropy")


# -- moving and renaming weights ------------------------------------------------------


def test_initializers_to_inputs_and_back(linreg, rng):
    model, coef, intercept = linreg
    X = rng.normal(size=(4, 3))
    as_inputs = initializers_to_inputs(model, ["intercept", "coef"])
    assert [i.name for i in as_inputs.graph.input] == ["X", "intercept", "coef"]
    assert not as_inputs.graph.initializer
    new_coef = rng.normal(size=(3, 1))
    out = run(as_inputs, X=X, coef=new_coef, intercept=intercept)[0]
    np.testing.assert_allclose(out, X @ new_coef + intercept, rtol=1e-12)
    back = inputs_to_initializers(as_inputs, {"coef": coef, "intercept": intercept})
    np.testing.assert_allclose(run(back, X=X)[0], run(model, X=X)[0], rtol=1e-15)
    with pytest.raises(UnknownNameError, match="Trainable weights"):
        initializers_to_inputs(model, ["bias"])


def test_rename_weights_dotted(torch_mlp, rng):
    _, onx = torch_mlp
    renamed = rename_weights(onx, {"0.weight": "layer0.w", "0.bias": "layer0.b"})
    assert {"layer0.w", "layer0.b", "2.weight"} <= set(get_train_initializer(renamed))
    X = rng.normal(size=(3, 4)).astype(np.float32)
    np.testing.assert_array_equal(run(renamed, X=X)[0], run(onx, X=X)[0])
    with pytest.raises(ValueError, match="already used"):
        rename_weights(onx, {"0.weight": "2.weight"})


def test_set_weights_writes_back_and_validates(linreg, rng):
    model, _, intercept = linreg
    new = rng.normal(size=(3, 1))
    updated = set_weights(model, {"coef": new})
    X = rng.normal(size=(2, 3))
    np.testing.assert_allclose(run(updated, X=X)[0], X @ new + intercept)
    with pytest.raises(ShapeError, match="shape"):
        set_weights(model, {"coef": np.zeros((1, 3))})
    with pytest.raises(UnknownNameError, match="not initializers"):
        set_weights(model, {"W": new})
    with pytest.raises(DTypeError):
        set_weights(model, {"coef": np.zeros((3, 1), dtype=np.int64)})


def test_keep_outputs_keeps_the_named_outputs_in_order_and_only_their_nodes():
    from graphkit.rewrite import keep_outputs

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in ("a", "b", "c")]
    nodes = [
        helper.make_node("Neg", ["x"], ["a"]),
        helper.make_node("Exp", ["x"], ["b"]),
        helper.make_node("Abs", ["b"], ["c"]),
    ]
    graph = helper.make_graph(nodes, "g", [x], outs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    kept = keep_outputs(model, ["c", "a"])
    assert [o.name for o in kept.graph.output] == ["c", "a"]
    assert sorted(n.op_type for n in kept.graph.node) == ["Abs", "Exp", "Neg"]
    only = keep_outputs(model, ["a"])
    assert [n.op_type for n in only.graph.node] == ["Neg"]
    value = np.array([1.0, -2.0], np.float32)
    got = gk.run(kept, {"x": value})
    np.testing.assert_allclose(got["c"], np.abs(np.exp(value)))
    np.testing.assert_allclose(got["a"], -value)
    assert len(model.graph.node) == 3  # the model given is left as it was
    with pytest.raises(gk.UnknownNameError, match=r"\['z'\] are not outputs"):
        keep_outputs(model, ["z"])
