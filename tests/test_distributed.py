"""Data-parallel training with real processes (2 ranks, gloo on loopback): N processes
train like one process with N times the batch, and stop together on a failure."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

import graphkit as gk  # noqa: E402
from graphkit_train import OrtGradientOptimizer  # noqa: E402

WORKER = Path(__file__).with_name("distributed_worker.py")


def launch(scenario: str, out: Path, script: Path = WORKER) -> str:
    """Run ``script`` in 2 processes under torchrun (in ``out``); return what it printed."""
    arguments = [scenario, str(out)] if script == WORKER else []
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node=2", str(script), *arguments]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(WORKER.parent)}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=out)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.fixture(scope="module")
def worker():
    sys.path.insert(0, str(WORKER.parent))
    import distributed_worker

    return distributed_worker


def test_two_ranks_train_like_one_process_with_twice_the_batch(tmp_path, worker):
    launch("equivalence", tmp_path)
    X, y, w = worker.data()
    for mode, optimizer, weighted in worker.COMBOS:
        ranks = [
            dict(np.load(tmp_path / f"{mode}-{optimizer}-{weighted}-rank{r}.npz")) for r in (0, 1)
        ]
        for name, value in ranks[0].items():  # identical on every rank
            np.testing.assert_array_equal(ranks[1][name], value, err_msg=f"{mode} {name}")
        single = worker.trainer(mode, optimizer, weighted, False, 2 * worker.PER_RANK_BATCH)
        single.fit(X, y, w if weighted else None, X_val=X[:30], y_val=y[:30])
        reference = {
            **single.get_state(),
            "train": single.train_losses_,
            "validation": single.validation_losses_,
        }
        for name, value in reference.items():
            np.testing.assert_allclose(
                ranks[0][name],
                value,
                rtol=1e-10,
                atol=1e-12,
                err_msg=f"{mode} {optimizer} weighted={weighted} {name}",
            )


def test_a_failure_on_one_rank_stops_every_rank_with_the_same_error(tmp_path):
    launch("errors", tmp_path)
    messages = [json.loads((tmp_path / f"errors-rank{r}.json").read_text()) for r in (0, 1)]
    assert messages[0] == messages[1]
    bad = messages[0]["bad_input_on_rank_1"]
    assert bad.startswith("DistributedError") and "rank 1: ValueError: y contains NaN" in bad
    assert "rank 0:" not in bad
    assert "disagree on the model" in messages[0]["different_models"]
    assert "1 training rows for 2 ranks" in messages[0]["more_ranks_than_rows"]
    overflow = messages[0]["overflow_on_rank_1"]
    assert re.match(r"ConvergenceError: The loss became (nan|inf) during epoch 1", overflow)


def test_a_rank_that_dies_mid_training_does_not_leave_the_others_waiting(tmp_path):
    launch("timeout", tmp_path)
    (message_0, seconds_0), (message_1, _) = [
        json.loads((tmp_path / f"timeout-rank{r}.json").read_text()) for r in (0, 1)
    ]
    assert message_1 == "RuntimeError: rank 1 lost its data"
    assert message_0.startswith("DistributedError: Rank 0 lost the other ranks")
    assert seconds_0 < 8  # the group's 5 s timeout, while rank 1 is still alive


def test_onnx_module_inside_distributed_data_parallel(tmp_path, worker):
    torch = pytest.importorskip("torch")
    from graphkit_train.torch_module import OnnxModule

    launch("ddp", tmp_path)
    ranks = [dict(np.load(tmp_path / f"ddp-rank{r}.npz")) for r in (0, 1)]
    X, y, _ = worker.data()
    module = OnnxModule(worker.mlp())  # one process, both halves: DDP averages the gradients
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    loss = torch.mean((module(torch.from_numpy(X[:32]))[:, 0] - torch.from_numpy(y[:32])) ** 2)
    loss.backward()
    optimizer.step()
    for name, parameter in module.named_parameters():
        np.testing.assert_array_equal(ranks[1][name], ranks[0][name])
        np.testing.assert_allclose(ranks[0][name], parameter.detach().numpy(), rtol=1e-12)


def test_distributed_without_a_process_group_says_how_to_launch(rng):
    from conftest import linear_regression_onnx

    trainer = OrtGradientOptimizer(
        gk.add_loss_output(linear_regression_onnx(np.zeros((3, 1)), np.zeros(1))), distributed=True
    )
    with pytest.raises(
        gk.GraphkitError, match="initialized torch.distributed process group.*torchrun"
    ):
        trainer.fit(rng.normal(size=(10, 3)), rng.normal(size=10))


def test_the_launcher_example_runs(tmp_path):
    example = WORKER.parents[1] / "examples" / "ddp_train.py"
    out = launch("", tmp_path, script=example)
    score = float(out.split("held-out R^2")[-1])
    assert "2 processes" in out and score > 0.2
    assert (tmp_path / "diabetes_mlp.onnx").exists()  # written once, by rank 0


def test_command_line_trains_in_n_processes(tmp_path):
    from graphkit_train.cli import main

    out = tmp_path / "out"
    assert main(["--nproc", "2", "--epochs", "3", "--quiet", "--output", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["processes"] == 2 and len(report["train_losses"]) == 3
