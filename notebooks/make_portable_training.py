"""Writes portable_training.ipynb (run: python notebooks/make_portable_training.py)."""

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

cells = [
    new_markdown_cell(
        "# Training that continues anywhere ONNX runs\n\n"
        "onnxruntime-training is frozen at 1.19.2 and its gradient graphs use operators "
        "no other runtime has. graphkit rewrites them in standard ONNX, so a model "
        "trained here can keep training elsewhere. We train a scikit-learn MLP for a few "
        "epochs with graphkit, export the trained model *carrying its own training step* "
        "(an ONNX `TrainingInfoProto`), and continue training it with `onnx.reference`, "
        "ONNX's pure-Python runtime, next to graphkit continuing on its side."
    ),
    new_code_cell(
        "import warnings\n"
        "import numpy as np\n"
        "import onnx\n"
        "import matplotlib.pyplot as plt\n"
        "from skl2onnx import to_onnx\n"
        "from sklearn.datasets import load_diabetes\n"
        "from sklearn.neural_network import MLPRegressor\n"
        "from sklearn.preprocessing import StandardScaler\n\n"
        "import graphkit as gk\n"
        "from graphkit.training_info import run_training_info\n"
        "from graphkit_train import OrtGradientOptimizer"
    ),
    new_markdown_cell("## Three epochs with graphkit"),
    new_code_cell(
        "X, y = load_diabetes(return_X_y=True)\n"
        "X = StandardScaler().fit_transform(X).astype(np.float32)\n"
        "y = ((y - y.mean()) / y.std()).astype(np.float32)\n"
        "with warnings.catch_warnings():\n"
        "    warnings.simplefilter('ignore')\n"
        "    mlp = MLPRegressor(hidden_layer_sizes=(16,), max_iter=1, random_state=0).fit(X, y)\n"
        "trainer = OrtGradientOptimizer(\n"
        "    gk.add_loss_output(to_onnx(mlp, X[:1])),\n"
        "    learning_rate=(gk.optimizers.adam(), gk.schedules.cosine(0.003, 10 * 45)),\n"
        "    max_iter=3, batch_size=10, shuffle=False,\n"
        ")\n"
        "trainer.fit(X, y)\n"
        "trainer.train_losses_"
    ),
    new_markdown_cell(
        "## Export\n\n"
        "The trained prediction model, with the training step (forward, gradient, Adam "
        "and the cosine schedule, every operator standard) in `training_info`: the "
        "update bindings assign the new weights and optimizer state after each step."
    ),
    new_code_cell(
        "model = trainer.export_training_info()\n"
        "info = model.training_info[0]\n"
        "domains = {n.domain or 'ai.onnx' for n in info.algorithm.node}\n"
        "print(len(info.algorithm.node), 'nodes in the algorithm, domains', domains)\n"
        "print([f'{b.key} <- {b.value}' for b in info.update_binding][:4], '...')\n"
        "assert domains <= {'ai.onnx'}"
    ),
    new_markdown_cell(
        "## Seven more epochs on onnx.reference, and on graphkit\n\n"
        "`run_training_info` feeds each batch to the algorithm and applies the bindings. "
        "It needs only onnx and numpy (and onnxruntime, for `runtime='onnxruntime'`; the "
        "suite runs it on the latest plain onnxruntime too)."
    ),
    new_code_cell(
        "label = trainer.training_step_.label\n"
        "batches = [{'X': X[i:i + 10], label: y[i:i + 10, None]} for i in range(0, len(X), 10)]\n"
        "reference_losses = []\n"
        "for epoch in range(7):\n"
        "    model, history = run_training_info(model, batches, runtime='reference')\n"
        "    reference_losses.append(float(np.mean([h['loss'] for h in history])))\n\n"
        "trainer.set_params(warm_start=True, max_iter=7).fit(X, y)\n"
        "graphkit_losses = trainer.train_losses_\n"
        "print(np.round(reference_losses, 6))\n"
        "print(np.round(graphkit_losses[3:], 6))\n"
        "assert np.allclose(reference_losses, graphkit_losses[3:], rtol=1e-4)"
    ),
    new_code_cell(
        "epochs = np.arange(1, 11)\n"
        "plt.plot(epochs, graphkit_losses, 'o-', label='graphkit (onnxruntime-training)')\n"
        "plt.plot(epochs[3:], reference_losses, 'x--', label='onnx.reference, from the export')\n"
        "plt.axvline(3.5, color='grey', lw=0.5)\n"
        "plt.xlabel('epoch'); plt.ylabel('training loss'); plt.legend();"
    ),
    new_markdown_cell(
        "The model continued on `onnx.reference` holds the same weights as graphkit's, and "
        "it still predicts like any ONNX model:"
    ),
    new_code_cell(
        "weights = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}\n"
        "state = trainer.get_state()\n"
        "print(max(float(np.abs(weights[w] - state[w]).max()) for w in trainer.weights_to_train_))\n"
        "prediction = gk.run(model, {'X': X[:3]})\n"
        "prediction"
    ),
]

notebook = new_notebook(
    cells=cells,
    metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
)
nbformat.write(notebook, __file__.replace("make_portable_training.py", "portable_training.ipynb"))
