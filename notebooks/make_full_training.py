"""Writes full_training.ipynb (run: python notebooks/make_full_training.py)."""

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

md, code = new_markdown_cell, new_code_cell
cells = [
    md(
        "# Full training with OrtGradientOptimizer\n\n"
        "The seed's first example: a linear regression trained with onnxruntime-training, next to "
        "scikit-learn. The loss is part of the ONNX graph (`add_loss_output`); graphkit fuses "
        "forward, gradient and the optimizer's update into one ONNX graph per training step."
    ),
    code(
        "import warnings\n"
        "import numpy as np\n"
        "import matplotlib.pyplot as plt\n"
        "from onnx import TensorProto, helper, numpy_helper\n"
        "from sklearn.datasets import make_regression\n"
        "from sklearn.linear_model import SGDRegressor, LinearRegression\n"
        "from sklearn.model_selection import train_test_split\n\n"
        "import graphkit as gk\n"
        "from graphkit_train import OrtGradientOptimizer\n\n"
        "X, y = make_regression(1000, n_features=10, noise=2.0, random_state=0)\n"
        "X, y = X.astype(np.float32), (y / 100).astype(np.float32)\n"
        "X_train, X_test, y_train, y_test = train_test_split(X, y, random_state=0)"
    ),
    md("## The prediction graph, built by hand, and its training graph"),
    code(
        "graph = helper.make_graph(\n"
        "    [helper.make_node('MatMul', ['X', 'coef'], ['XW']), helper.make_node('Add', ['XW', 'intercept'], ['Y'])],\n"
        "    'linear_regression',\n"
        "    [helper.make_tensor_value_info('X', TensorProto.FLOAT, ['N', 10])],\n"
        "    [helper.make_tensor_value_info('Y', TensorProto.FLOAT, ['N', 1])],\n"
        "    [numpy_helper.from_array(np.zeros((10, 1), np.float32), 'coef'),\n"
        "     numpy_helper.from_array(np.zeros(1, np.float32), 'intercept')],\n"
        ")\n"
        "onx = helper.make_model(graph, opset_imports=[helper.make_opsetid('', 18)], ir_version=10)\n"
        "onx_loss = gk.add_loss_output(onx)\n"
        "print([i.name for i in onx_loss.graph.input], [o.name for o in onx_loss.graph.output])"
    ),
    md("## Training, next to scikit-learn's SGDRegressor on the same data"),
    code(
        "train_session = OrtGradientOptimizer(\n"
        "    onx_loss, ['coef', 'intercept'], max_iter=30, batch_size=10,\n"
        "    learning_rate=gk.LearningRateSGD(eta0=0.01, learning_rate='invscaling'), random_state=0)\n"
        "train_session.fit(X_train, y_train, X_val=X_test, y_val=y_test)\n"
        "state = train_session.get_state()\n"
        "sgd = SGDRegressor(max_iter=30, tol=None, random_state=0).fit(X_train, y_train)\n"
        "ols = LinearRegression().fit(X_train, y_train)\n"
        "r2 = lambda p: 1 - ((y_test - p) ** 2).sum() / ((y_test - y_test.mean()) ** 2).sum()\n"
        "print('held-out R^2  graphkit', r2(train_session.predict(X_test)),\n"
        "      ' SGDRegressor', sgd.score(X_test, y_test), ' LinearRegression', ols.score(X_test, y_test))\n"
        "print('max |coef - OLS coef|', np.abs(state['coef'][:, 0] - ols.coef_).max())\n"
        "assert r2(train_session.predict(X_test)) > ols.score(X_test, y_test) - 0.01"
    ),
    code(
        "fig, ax = plt.subplots(figsize=(6, 3.5))\n"
        "ax.plot(train_session.train_losses_, label='train')\n"
        "ax.plot(np.linspace(0, 30, len(train_session.validation_losses_) + 1)[1:] - 1,\n"
        "        train_session.validation_losses_, 'o-', label='held out')\n"
        "ax.set_yscale('log'); ax.set_xlabel('epoch'); ax.set_ylabel('mean squared error'); ax.legend();"
    ),
    md(
        "The fused training step is a plain ONNX model. Its inputs are the batch, the weights, "
        "the optimizer state, the step counter and the running loss sum; every `.next` output "
        "feeds the next run."
    ),
    code(
        "step = train_session.training_step_.model\n"
        "print([i.name for i in step.graph.input])\n"
        "print([o.name for o in step.graph.output])\n"
        "print(len(step.graph.node), 'nodes;', sorted({n.op_type for n in step.graph.node if n.domain}))"
    ),
    md(
        "## A neural network: scikit-learn's MLPRegressor converted by skl2onnx, trained further "
        "with Nesterov momentum and an L2 penalty"
    ),
    code(
        "from skl2onnx import to_onnx\n"
        "from sklearn.neural_network import MLPRegressor\n\n"
        "with warnings.catch_warnings():\n"
        "    warnings.simplefilter('ignore')\n"
        "    mlp = MLPRegressor(hidden_layer_sizes=(20,), max_iter=5, random_state=0).fit(X_train, y_train)\n"
        "onx_mlp = gk.add_loss_output(to_onnx(mlp, X_train[:1]), penalty={'coefficient': 1e-4, 'coefficient1': 1e-4})\n"
        "nn_session = OrtGradientOptimizer(\n"
        "    onx_mlp, max_iter=40, batch_size=20, random_state=0,\n"
        "    learning_rate=gk.LearningRateSGDNesterov(eta0=0.002, learning_rate='constant', momentum=0.9))\n"
        "nn_session.fit(X_train, y_train, X_val=X_test, y_val=y_test)\n"
        "print('held-out R^2 after 5 sklearn epochs', mlp.score(X_test, y_test),\n"
        "      ' after 40 more with graphkit', r2(nn_session.predict(X_test)))\n"
        "assert r2(nn_session.predict(X_test)) > mlp.score(X_test, y_test)"
    ),
    code(
        "fig, ax = plt.subplots(figsize=(6, 3.5))\n"
        "ax.plot(nn_session.train_losses_, label='train (loss + penalty)')\n"
        "ax.set_yscale('log'); ax.set_xlabel('epoch'); ax.legend();"
    ),
    md(
        "`get_trained_onnx()` gives the prediction graph with the trained weights, ready for "
        "plain inference; `save_onnx_graph(folder)` exports every graph the trainer uses."
    ),
    code(
        "trained = nn_session.get_trained_onnx()\n"
        "print([o.name for o in trained.graph.output])\n"
        "np.testing.assert_allclose(gk.run(trained, {'X': X_test})['variable'][:, 0], nn_session.predict(X_test), rtol=1e-5, atol=1e-6)"
    ),
]

notebook = new_notebook(
    cells=cells,
    metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
)
nbformat.write(notebook, __file__.replace("make_full_training.py", "full_training.ipynb"))
