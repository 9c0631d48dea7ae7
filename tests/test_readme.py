"""The README's promises: its quickstart runs as written, its commands exist, the demo
reaches scikit-learn's score."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_quickstart_runs_as_written(tmp_path, capsys, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    assert blocks, "the README has no python block"
    script = tmp_path / "quickstart.py"  # onnxscript reads sources: run from a real file
    script.write_text(blocks[0])
    monkeypatch.chdir(tmp_path)
    namespace = runpy.run_path(str(script))
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "['coefficient', 'intercepts', 'coefficient1', 'intercepts1']"
    losses = [float(line.split()[1]) for line in printed[1:]]
    assert len(losses) == 4 and losses == sorted(losses, reverse=True)  # it trains
    assert namespace["trained"].graph.initializer[0].name == "coefficient"


def test_readme_commands_exist():
    makefile = (ROOT / "Makefile").read_text()
    for command in ("demo", "test"):
        assert f"make {command}" in README
        assert re.search(rf"^{command}:", makefile, flags=re.M)
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_optimizer_examples_run_as_written(tmp_path, monkeypatch):
    """The optimizer section's blocks build what they say: a chain that trains, and a
    scripted transformation whose state is named after the weight."""
    import textwrap

    import numpy as np
    from conftest import linear_regression_onnx

    import graphkit as gk
    from graphkit_train import Trainer

    section = README.split("## Optimizers are chains of gradient transformations")[1]
    section = section.split("\n## ")[0]
    blocks = [textwrap.dedent(b) for b in re.findall(r"```python\n(.*?)```", section, flags=re.S)]
    assert len(blocks) == 2
    onx = linear_regression_onnx(np.zeros((3, 1), np.float32), np.zeros(1, np.float32))
    script = tmp_path / "optimizers.py"
    script.write_text(
        "from graphkit.dsl import FLOAT, INT64, op, script\n" + blocks[0] + "\n" + blocks[1]
    )
    monkeypatch.chdir(tmp_path)
    namespace = runpy.run_path(
        str(script),
        init_globals={
            "train_onx": gk.add_loss_output(onx),
            "Trainer": Trainer,
        },
    )
    rng = np.random.default_rng(0)
    X = rng.normal(size=(100, 3)).astype(np.float32)
    y = X @ np.array([1.0, -2.0, 0.5], np.float32)
    trainer = namespace["trainer"].set_params(max_iter=60, batch_size=10)
    trainer.fit(X, y)
    assert trainer.train_losses_[-1] < trainer.train_losses_[0] / 2
    assert "coef.adam.m" in trainer.get_state()
    signum = namespace["signum"]
    assert list(signum.init({"w": np.zeros(2)})) == ["w.signum.m"]
