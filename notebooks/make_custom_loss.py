"""Writes custom_loss.ipynb (run: python notebooks/make_custom_loss.py)."""

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

cells = [
    new_markdown_cell(
        "# A custom loss in onnxscript\n\n"
        "We write a quantile (pinball) loss in Python syntax, look at the ONNX graph it "
        "compiles to, check the gradient onnxruntime-training derives against finite "
        "differences, and plug the loss into a scikit-learn MLP converted to ONNX."
    ),
    new_code_cell(
        "import numpy as np\n"
        "import onnx\n"
        "import matplotlib.pyplot as plt\n\n"
        "import graphkit as gk\n"
        "from graphkit.dsl import FLOAT, op, script"
    ),
    new_markdown_cell(
        "## The loss\n\n"
        "For the quantile $q$, with $d = y - p$: "
        "$L(p, y) = \\frac{1}{n}\\sum_i \\max(q\\, d_i, (q - 1)\\, d_i)$. "
        "Constants go through `op.CastLike` so the same body serves float32 and float64."
    ),
    new_code_cell(
        "@script()\n"
        "def pinball(prediction: FLOAT, label: FLOAT) -> FLOAT:\n"
        "    d = label - prediction\n"
        "    q = op.CastLike(0.9, d)\n"
        "    return op.ReduceMean(op.Max(q * d, (q - op.CastLike(1.0, d)) * d), keepdims=0)\n\n"
        "loss = gk.custom_loss(pinball)\n"
        "loss"
    ),
    new_markdown_cell("## Its ONNX graph, and the gradient graph onnxruntime-training builds"),
    new_code_cell("print(onnx.printer.to_text(loss.value_model(np.float64).graph))"),
    new_code_cell(
        "gradient_graph = loss.gradient_model(np.float64)\n"
        "print([n.op_type for n in gradient_graph.graph.node])"
    ),
    new_markdown_cell("## The automatic gradient against finite differences"),
    new_code_cell(
        "rng = np.random.default_rng(0)\n"
        "p, y = rng.normal(size=(50, 1)), rng.normal(size=(50, 1))\n"
        "value, grad = loss.value_and_grad(p, y)\n\n"
        "eps = 1e-6\n"
        "fd = np.zeros_like(p)\n"
        "for i in range(len(p)):\n"
        "    up, down = p.copy(), p.copy()\n"
        "    up[i] += eps\n"
        "    down[i] -= eps\n"
        "    fd[i] = (loss(up, y) - loss(down, y)) / (2 * eps)\n\n"
        "d = y - p\n"
        "print('loss', float(value), 'numpy', np.maximum(0.9 * d, -0.1 * d).mean())\n"
        "print('max |autograd - finite differences|', np.abs(grad - fd).max())\n"
        "assert np.abs(grad - fd).max() < 1e-8"
    ),
    new_code_cell(
        "grid = np.linspace(-3, 3, 201).reshape(-1, 1)\n"
        "zeros = np.zeros_like(grid)\n"
        "per_point = [float(loss(g.reshape(1, 1), z.reshape(1, 1))) for g, z in zip(grid, zeros)]\n"
        "_, slope = loss.value_and_grad(grid, zeros)\n"
        "fig, ax = plt.subplots(1, 2, figsize=(9, 3))\n"
        "ax[0].plot(grid[:, 0], per_point); ax[0].set_title('pinball loss, label = 0')\n"
        "ax[1].plot(grid[:, 0], slope[:, 0] * len(grid)); ax[1].set_title('d loss / d prediction')\n"
        "ax[0].set_xlabel('prediction'); ax[1].set_xlabel('prediction');"
    ),
    new_markdown_cell(
        "## The same loss inside a training graph\n\n"
        "`add_loss_output` appends the loss to a scikit-learn MLP converted by skl2onnx; "
        "the training graph computes the loss of the MLP's predictions."
    ),
    new_code_cell(
        "import warnings\n"
        "from skl2onnx import to_onnx\n"
        "from sklearn.datasets import load_diabetes\n"
        "from sklearn.neural_network import MLPRegressor\n\n"
        "X, target = load_diabetes(return_X_y=True)\n"
        "X, target = X.astype(np.float32), (target / 100).astype(np.float32)\n"
        "with warnings.catch_warnings():\n"
        "    warnings.simplefilter('ignore')\n"
        "    mlp = MLPRegressor(hidden_layer_sizes=(10,), max_iter=200, random_state=0).fit(X, target)\n"
        "onx = to_onnx(mlp, X[:1])\n"
        "train_onx = gk.add_loss_output(onx, pinball, penalty={'coefficient': 1e-3})\n"
        "print([i.name for i in train_onx.graph.input], [o.name for o in train_onx.graph.output])"
    ),
    new_code_cell(
        "out = gk.run(train_onx, {'X': X, 'label': target.reshape(-1, 1)})\n"
        "d = target - mlp.predict(X)\n"
        "expected = np.maximum(0.9 * d, -0.1 * d).mean() + 1e-3 * (mlp.coefs_[0] ** 2).sum()\n"
        "print('graph', float(out['loss']), 'numpy', expected)\n"
        "assert abs(float(out['loss']) - expected) < 1e-5 * abs(expected)"
    ),
    new_markdown_cell(
        "The training graph passes `onnx.checker` and loads in onnxruntime-training 1.19.2. "
        "`graphkit.gradient_model(train_onx, 'loss', weights)` gives its gradient with "
        "respect to the MLP's weights."
    ),
]

notebook = new_notebook(
    cells=cells,
    metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
)
nbformat.write(notebook, __file__.replace("make_custom_loss.py", "custom_loss.ipynb"))
