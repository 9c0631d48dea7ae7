"""Writes forward_backward.ipynb (run: python notebooks/make_forward_backward.py)."""

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

md, code = new_markdown_cell, new_code_cell
cells = [
    md(
        "# Forward/backward training\n\n"
        "The ONNX graph is one piece of a model; onnxruntime-training's TrainingAgent gives its "
        "forward and backward passes, and graphkit's DSL gives the loss, the penalty and the "
        "weight update. Three parts:\n\n"
        "1. the seed's example: a neural network trained with Nesterov momentum and an elastic penalty;\n"
        "2. binary classification from raw scores, against scikit-learn;\n"
        "3. an ONNX layer inside a PyTorch model, trained by `torch.optim`."
    ),
    code(
        "import time, warnings\n"
        "import numpy as np\n"
        "import matplotlib.pyplot as plt\n"
        "from skl2onnx import to_onnx\n"
        "from sklearn.datasets import make_regression, load_breast_cancer\n"
        "from sklearn.model_selection import train_test_split\n"
        "from sklearn.neural_network import MLPRegressor\n"
        "from sklearn.preprocessing import StandardScaler\n\n"
        "import graphkit as gk\n"
        "from graphkit_train import OrtGradientForwardBackwardOptimizer\n"
        "warnings.filterwarnings('ignore')"
    ),
    md("## 1. A neural network, Nesterov momentum and an elastic penalty"),
    code(
        "X, y = make_regression(2000, n_features=10, noise=5.0, random_state=0)\n"
        "X, y = X.astype(np.float32), (y / 100).astype(np.float32)\n"
        "X_train, X_test, y_train, y_test = train_test_split(X, y, random_state=0)\n"
        "mlp = MLPRegressor(hidden_layer_sizes=(20,), max_iter=3, random_state=0).fit(X_train, y_train)\n"
        "onx = to_onnx(mlp, X_train[:1])  # a prediction graph: no loss in it\n\n"
        "train_session = OrtGradientForwardBackwardOptimizer(\n"
        "    onx, max_iter=40, batch_size=20, random_state=0,\n"
        "    learning_rate=gk.LearningRateSGDNesterov(eta0=0.002, learning_rate='constant'),\n"
        "    learning_loss=gk.SquareLearningLoss(),\n"
        "    learning_penalty=gk.ElasticLearningPenalty(l1=1e-5, l2=1e-4))\n"
        "train_session.fit(X_train, y_train, X_val=X_test, y_val=y_test)\n"
        "print(train_session.learning_loss_, train_session.learning_rate_, train_session.learning_penalty_, sep='\\n')\n"
        "r2 = lambda y, p: 1 - ((y - p) ** 2).sum() / ((y - y.mean()) ** 2).sum()\n"
        "print('held-out R^2: 3 sklearn epochs', mlp.score(X_test, y_test), ' then 40 graphkit epochs', r2(y_test, train_session.predict(X_test)))\n"
        "assert r2(y_test, train_session.predict(X_test)) > 0.95"
    ),
    code(
        "fig, ax = plt.subplots(figsize=(6, 3.5))\n"
        "ax.plot(train_session.train_losses_, label='train (loss + penalty)')\n"
        "ax.plot(np.arange(4, 41, 4) - 1, train_session.validation_losses_, 'o-', label='held out')\n"
        "ax.set_yscale('log'); ax.set_xlabel('epoch'); ax.legend();"
    ),
    md(
        "Each batch takes two onnxruntime calls, the TrainingAgent's forward and backward: "
        "the loss and its gradient run inside the forward, and one update of every weight "
        "(penalty, schedule and optimizer fused) inside the backward. `save_onnx_graph` "
        "exports the pieces:"
    ),
    code(
        "graphs = train_session.save_onnx_graph(bytes)\n"
        "{name: f'{len(data)} bytes' for name, data in graphs.items()}"
    ),
    md(
        "## 2. Binary classification from raw scores\n\n"
        "A linear model produces a score s; the loss is the log loss of sigmoid(s), whose "
        "gradient with respect to the score is sigmoid(s) - y (`NegLogLearningLoss`). We compare it "
        "with scikit-learn's `LogisticRegression` and `SGDClassifier(loss='log_loss')`."
    ),
    code(
        "from onnx import TensorProto, helper, numpy_helper\n"
        "from sklearn.linear_model import LogisticRegression, SGDClassifier\n\n"
        "Xc, yc = load_breast_cancer(return_X_y=True)\n"
        "Xc = StandardScaler().fit_transform(Xc).astype(np.float32)\n"
        "Xc_train, Xc_test, yc_train, yc_test = train_test_split(Xc, yc, random_state=0)\n"
        "graph = helper.make_graph(\n"
        "    [helper.make_node('Gemm', ['X', 'coef', 'intercept'], ['score'])], 'logistic',\n"
        "    [helper.make_tensor_value_info('X', TensorProto.FLOAT, ['N', 30])],\n"
        "    [helper.make_tensor_value_info('score', TensorProto.FLOAT, ['N', 1])],\n"
        "    [numpy_helper.from_array(np.zeros((30, 1), np.float32), 'coef'),\n"
        "     numpy_helper.from_array(np.zeros(1, np.float32), 'intercept')])\n"
        "scores_onx = helper.make_model(graph, opset_imports=[helper.make_opsetid('', 18)], ir_version=10)\n\n"
        "rows = []\n"
        "for name, model in [\n"
        "    ('graphkit forward/backward', OrtGradientForwardBackwardOptimizer(\n"
        "        scores_onx, max_iter=30, batch_size=16, learning_rate=gk.LearningRateAdam(eta0=0.02),\n"
        "        learning_loss=gk.NegLogLearningLoss(), random_state=0)),\n"
        "    ('sklearn SGDClassifier', SGDClassifier(loss='log_loss', max_iter=30, tol=None, random_state=0)),\n"
        "    ('sklearn LogisticRegression', LogisticRegression()),\n"
        "]:\n"
        "    start = time.perf_counter()\n"
        "    model.fit(Xc_train, yc_train)\n"
        "    seconds = time.perf_counter() - start\n"
        "    if name.startswith('graphkit'):\n"
        "        accuracy = ((model.predict(Xc_test) > 0) == yc_test).mean()\n"
        "    else:\n"
        "        accuracy = model.score(Xc_test, yc_test)\n"
        "    rows.append((name, accuracy, seconds))\n"
        "for name, accuracy, seconds in rows:\n"
        "    print(f'{name:28s} held-out accuracy {accuracy:.3f}   fit {seconds * 1000:7.1f} ms')\n"
        "print('(graphkit builds and compiles its graphs during its first fit)')\n"
        "assert rows[0][1] >= rows[2][1] - 0.03"
    ),
    code(
        "classifier = OrtGradientForwardBackwardOptimizer(\n"
        "    scores_onx, max_iter=30, batch_size=16, learning_rate=gk.LearningRateAdam(eta0=0.02),\n"
        "    learning_loss=gk.NegLogLearningLoss(), random_state=0).fit(Xc_train, yc_train, X_val=Xc_test, y_val=yc_test)\n"
        "per_sample = classifier.losses(Xc_test, yc_test)\n"
        "fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))\n"
        "ax[0].plot(classifier.train_losses_, label='train'); ax[0].set_yscale('log'); ax[0].set_xlabel('epoch'); ax[0].legend()\n"
        "ax[1].hist(per_sample, bins=30); ax[1].set_xlabel('log loss per held-out sample');"
    ),
    md(
        "## 3. An ONNX layer inside a PyTorch model\n\n"
        "`OnnxModule` wraps an ONNX graph as a `torch.nn.Module`: its forward and backward run "
        "through the TrainingAgent, tensors cross through DLPack, and its weights are "
        "`torch.nn.Parameter`s that `torch.optim` updates. Here a torch layer feeds an ONNX MLP "
        "exported from PyTorch; a pure-PyTorch twin with the same weights gives the same gradients."
    ),
    code(
        "import torch\n"
        "from graphkit_train.torch_module import OnnxModule\n\n"
        "torch.manual_seed(0)\n"
        "tail = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))\n"
        "torch.onnx.export(tail, (torch.randn(2, 8),), 'tail.onnx', input_names=['X'], output_names=['Y'],\n"
        "                  dynamic_axes={'X': {0: 'N'}, 'Y': {0: 'N'}}, dynamo=False)\n"
        "head = torch.nn.Linear(10, 8)\n"
        "hybrid = torch.nn.Sequential(head, torch.nn.ReLU(), OnnxModule('tail.onnx'))\n"
        "twin = torch.nn.Sequential(head, torch.nn.ReLU(), tail)\n"
        "print([name for name, _ in hybrid.named_parameters()])\n\n"
        "Xt, yt = torch.from_numpy(X_train), torch.from_numpy(y_train).reshape(-1, 1)\n"
        "for model in (hybrid, twin):\n"
        "    model.zero_grad()\n"
        "    torch.nn.functional.mse_loss(model(Xt), yt).backward()\n"
        "gap = max(float((a.grad - b.grad).abs().max()) for a, b in zip(hybrid.parameters(), twin.parameters()))\n"
        "print('largest gradient difference, hybrid vs pure PyTorch:', gap)\n"
        "assert gap < 1e-4"
    ),
    code(
        "optimizer = torch.optim.Adam(hybrid.parameters(), lr=0.01)\n"
        "history = []\n"
        "for epoch in range(20):\n"
        "    for batch in torch.randperm(len(Xt)).split(32):\n"
        "        optimizer.zero_grad()\n"
        "        loss = torch.nn.functional.mse_loss(hybrid(Xt[batch]), yt[batch])\n"
        "        loss.backward()\n"
        "        optimizer.step()\n"
        "    with torch.no_grad():\n"
        "        history.append(torch.nn.functional.mse_loss(hybrid(torch.from_numpy(X_test)), torch.from_numpy(y_test).reshape(-1, 1)).item())\n"
        "fig, ax = plt.subplots(figsize=(6, 3.5))\n"
        "ax.plot(history); ax.set_yscale('log'); ax.set_xlabel('epoch'); ax.set_ylabel('held-out MSE');\n"
        "assert history[-1] < 0.2 * history[0]"
    ),
    md(
        "`hybrid[2].trained_model()` writes the parameters PyTorch trained back into the ONNX graph."
    ),
]

notebook = new_notebook(
    cells=cells,
    metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
)
nbformat.write(notebook, __file__.replace("make_forward_backward.py", "forward_backward.ipynb"))
