"""``make demo``: the DSL at work on scikit-learn's bundled diabetes data.

A linear model is built with onnx.helper, ``add_loss_output`` turns it into a training
graph, onnxruntime-training builds its gradient graph, and the ``adam`` update (an
onnxscript function) trains it with full-batch steps. The held-out R^2 is printed next
to scikit-learn's ``LinearRegression`` on the same split.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

import graphkit as gk


def linear_model(n_features: int) -> object:
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["X", "coef", "intercept"], ["Y"])],
        "linear",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", n_features])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 1])],
        [
            numpy_helper.from_array(np.zeros((n_features, 1), np.float32), "coef"),
            numpy_helper.from_array(np.zeros(1, np.float32), "intercept"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def main(steps: int = 300) -> dict[str, float]:
    from sklearn.datasets import load_diabetes
    from sklearn.linear_model import LinearRegression
    from sklearn.metrics import r2_score
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    X, y = load_diabetes(return_X_y=True)
    X_train, X_test, y_train, y_test = train_test_split(X, y, random_state=0)
    scaler = StandardScaler().fit(X_train)
    X_train, X_test = (scaler.transform(a).astype(np.float32) for a in (X_train, X_test))
    y_train, y_test = y_train.astype(np.float32), y_test.astype(np.float32)

    onx = linear_model(X.shape[1])
    train_onx = gk.add_loss_output(onx, "squared_error")
    weights = gk.get_train_initializer(onx)
    grad_onx = gk.gradient_model(gk.initializers_to_inputs(train_onx, weights), "loss", weights)
    runner = gk._ort.Runner(grad_onx)
    names = runner.output_names

    adam = gk.optimizers.adam()
    state = adam.init(weights)
    print(f"training a linear model on diabetes ({len(X_train)} rows) with Adam, {steps} steps")
    for step in range(steps):
        out = dict(zip(names, runner({"X": X_train, "label": y_train[:, None], **weights})))
        grads = {name: out[f"{name}_grad"] for name in weights}
        weights, state = adam.update(weights, grads, state, lr=5.0, step=step)
        if step % 50 == 0 or step == steps - 1:
            print(f"  step {step:4d}  mean squared error {float(out['loss']):10.2f}")

    trained = gk.set_weights(onx, weights)
    prediction = gk.run(trained, {"X": X_test})["Y"][:, 0]
    reference = LinearRegression().fit(X_train, y_train).predict(X_test)
    scores = {"graphkit": r2_score(y_test, prediction), "sklearn": r2_score(y_test, reference)}
    print(f"held-out R^2: graphkit {scores['graphkit']:.4f}, scikit-learn {scores['sklearn']:.4f}")
    return scores


if __name__ == "__main__":
    main()
