"""Writes custom_optimizer.ipynb (run: python notebooks/make_custom_optimizer.py)."""

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

cells = [
    new_markdown_cell(
        "# A custom optimizer in onnxscript\n\n"
        "An optimizer in graphkit is a chain of *gradient transformations*, as in optax. "
        "We write a new one, Signum (sign of a momentum buffer), as an onnxscript function, "
        "check it against numpy, chain it with gradient clipping and a warm-up + cosine "
        "schedule, look at the ONNX graph it compiles to, and train a scikit-learn MLP "
        "with it next to Adam."
    ),
    new_code_cell(
        "import numpy as np\n"
        "import onnx\n"
        "import matplotlib.pyplot as plt\n\n"
        "import graphkit as gk\n"
        "from graphkit import optimizers, schedules\n"
        "from graphkit import transforms as tx\n"
        "from graphkit.dsl import FLOAT, INT64, op, script"
    ),
    new_markdown_cell(
        "## The transformation\n\n"
        "A scripted transformation maps one weight's update (the gradient, at the start of "
        "the chain), the weight, its state fields and the step to the new update and the "
        "new state: $m \\leftarrow \\beta m + (1 - \\beta) u$, $u' = \\mathrm{sign}(m)$. "
        "The state is declared as fields; graphkit checks the signature against them and "
        "names the state `{weight}.signum.m`."
    ),
    new_code_cell(
        "@script()\n"
        "def signum_update(update: FLOAT, param: FLOAT, m: FLOAT, step: INT64) -> tuple[FLOAT, FLOAT]:\n"
        "    beta = op.CastLike(0.9, update)\n"
        "    m_new = beta * m + (op.CastLike(1.0, update) - beta) * update\n"
        "    return op.Sign(m_new), m_new\n\n"
        "signum = tx.Scripted('signum', signum_update, fields=['m'])\n"
        "signum"
    ),
    new_markdown_cell("A wrong signature is refused when the transformation is built:"),
    new_code_cell(
        "try:\n"
        "    tx.Scripted('signum', signum_update, fields=['m', 'v'])\n"
        "except TypeError as exc:\n"
        "    print(exc)"
    ),
    new_markdown_cell("## Against numpy, on a few steps"),
    new_code_cell(
        "rng = np.random.default_rng(0)\n"
        "params = {'w': rng.normal(size=(3, 2))}\n"
        "state = signum.init(params)\n"
        "m = np.zeros((3, 2))\n"
        "for step in range(5):\n"
        "    g = rng.normal(size=(3, 2))\n"
        "    updates, state = signum.update({'w': g}, state, params, step)\n"
        "    m = 0.9 * m + 0.1 * g\n"
        "    assert np.array_equal(updates['w'], np.sign(m))\n"
        "    assert np.allclose(state['w.signum.m'], m, rtol=1e-15)\n"
        "print(sorted(state))"
    ),
    new_markdown_cell(
        "## Chain it\n\n"
        "Clip the gradients by their global norm (all the weights together), then Signum, "
        "then the learning rate: a linear warm-up joined to a cosine decay. Every piece "
        "compiles into the one graph the training step runs."
    ),
    new_code_cell(
        "# 20 epochs of 34 batches: 50 steps of warm-up, then a cosine decay over the rest\n"
        "schedule = schedules.join(\n"
        "    [schedules.warmup('constant', warmup_steps=50, eta0=0.003), schedules.cosine(0.003, 630)],\n"
        "    [50],\n"
        ")\n"
        "my_optimizer = tx.chain(tx.clip_by_global_norm(1.0), signum, tx.scale_by_learning_rate(schedule))\n"
        "plt.plot([schedule(t) for t in range(680)])\n"
        "plt.xlabel('step'); plt.ylabel('learning rate');"
    ),
    new_markdown_cell("The update of one weight, as ONNX:"),
    new_code_cell(
        "graph = my_optimizer.model({'w': np.zeros((3, 2), np.float32)})\n"
        "print(onnx.printer.to_text(graph.graph)[:2500])"
    ),
    new_markdown_cell(
        "## Train a model with it, next to Adam\n\n"
        "A scikit-learn MLP on the diabetes data, converted with skl2onnx, trained by the "
        "full-training runtime (forward, gradient and update in one ONNX graph)."
    ),
    new_code_cell(
        "import warnings\n"
        "from skl2onnx import to_onnx\n"
        "from sklearn.datasets import load_diabetes\n"
        "from sklearn.metrics import r2_score\n"
        "from sklearn.model_selection import train_test_split\n"
        "from sklearn.neural_network import MLPRegressor\n"
        "from sklearn.preprocessing import StandardScaler\n"
        "from graphkit_train import OrtGradientOptimizer\n\n"
        "X, y = load_diabetes(return_X_y=True)\n"
        "X = StandardScaler().fit_transform(X).astype(np.float32)\n"
        "y = ((y - y.mean()) / y.std()).astype(np.float32)\n"
        "X_train, X_test, y_train, y_test = train_test_split(X, y, random_state=0)\n"
        "with warnings.catch_warnings():\n"
        "    warnings.simplefilter('ignore')\n"
        "    mlp = MLPRegressor(hidden_layer_sizes=(8,), max_iter=1, random_state=0).fit(X_train, y_train)\n"
        "train_onx = gk.add_loss_output(to_onnx(mlp, X[:1]))\n\n"
        "curves, scores = {}, {}\n"
        "for name, learning_rate in [\n"
        "    ('signum (ours)', my_optimizer),\n"
        "    ('adam', optimizers.adam(learning_rate=0.003)),\n"
        "]:\n"
        "    trainer = OrtGradientOptimizer(train_onx, learning_rate=learning_rate, max_iter=20,\n"
        "                                   batch_size=10, random_state=0)\n"
        "    trainer.fit(X_train, y_train)\n"
        "    curves[name] = trainer.train_losses_\n"
        "    scores[name] = r2_score(y_test, trainer.predict(X_test).ravel())\n"
        "print(scores)\n"
        "assert all(c[-1] < 0.5 * c[0] for c in curves.values())\n"
        "assert min(scores.values()) > 0.25"
    ),
    new_code_cell(
        "for name, curve in curves.items():\n"
        "    plt.plot(curve, label=f'{name} (held-out R2 {scores[name]:.2f})')\n"
        "plt.xlabel('epoch'); plt.ylabel('training loss'); plt.legend();"
    ),
    new_markdown_cell(
        "The optimizer state lives in the training step's tensors, named after each weight "
        "(`get_state()`), and `save_onnx_graph` exports the fused step with the whole "
        "chain inside it."
    ),
    new_code_cell("print([name for name in trainer.get_state() if '.adam.' in name][:4])"),
]

notebook = new_notebook(
    cells=cells,
    metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
)
nbformat.write(notebook, __file__.replace("make_custom_optimizer.py", "custom_optimizer.ipynb"))
