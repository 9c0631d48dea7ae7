"""graphkit-train against faults: Ctrl-C keeps the finished epochs (and --resume ends
where an uninterrupted run does), data files in another encoding or with Python objects
are named in one line, and an output folder that cannot be written fails before
training."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from conftest import linear_regression_onnx

import graphkit as gk
from graphkit_train import checkpoint
from graphkit_train.cli import main as cli_main
from graphkit_train.cli import read_dataset
from graphkit_train.trainers.full import Trainer


@pytest.fixture
def job(tmp_path, rng):
    """A CSV dataset and a linear model: the common part of a command line."""
    X = rng.normal(size=(200, 3))
    y = X @ np.array([2.0, -1.0, 0.5]) + 1.0 + rng.normal(scale=0.05, size=200)
    data = tmp_path / "train.csv"
    np.savetxt(data, np.column_stack([X, y]), delimiter=",", header="a,b,c,t", comments="")
    model = tmp_path / "linear.onnx"
    onnx.save(linear_regression_onnx(np.zeros((3, 1), np.float32), np.zeros(1, np.float32)), model)
    return [str(model), "--data", str(data), "--lr", "0.05", "--batch-size", "16", "--quiet"]


def main(argv: list[str]) -> int:
    """The command line's exit code; Ctrl-C escaping it fails the test, not the session."""
    try:
        return cli_main(argv)
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt escaped graphkit-train's main()")


def _trained(out) -> dict[str, np.ndarray]:
    return gk.get_train_initializer(onnx.load(str(out / "model.onnx")))


def _train_losses(out) -> list[float]:
    return json.loads((out / "report.json").read_text())["train_losses"]


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("graphkit-train: "), err
    return err.strip()


@pytest.fixture
def ctrl_c_in_epoch_2(monkeypatch):
    """Ctrl-C right after the second epoch's batches ran, before the epoch is counted:
    the weights, optimizer state and shuffling generator have moved past epoch 1."""
    run_epoch = Trainer._run_epoch
    calls = []

    def interrupted(self, *args, **kwargs):
        loss = run_epoch(self, *args, **kwargs)
        calls.append(loss)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return loss

    monkeypatch.setattr(Trainer, "_run_epoch", interrupted)
    return monkeypatch


def test_ctrl_c_saves_the_finished_epochs_and_resume_ends_as_an_uninterrupted_run(
    job, tmp_path, capsys, ctrl_c_in_epoch_2
):
    out = tmp_path / "out"
    command = [*job, "--epochs", "3", "--output", str(out)]
    assert main(command) == 130
    line = _one_error_line(capsys)
    saved = out / "checkpoint.ckpt"
    assert f"interrupted after epoch 1 of 3; saved its state to {saved}" in line, line
    assert line.endswith("--resume") and "resume with: graphkit-train " in line, line
    assert not (out / "model.onnx").exists()
    ctrl_c_in_epoch_2.undo()

    # the saved state is the one after epoch 1: an uninterrupted 1-epoch run's
    one = tmp_path / "one"
    assert main([*job, "--epochs", "1", "--output", str(one)]) == 0
    arrays, header = checkpoint.read(saved)
    expected = _trained(one)
    for name in ("coef", "intercept"):
        np.testing.assert_array_equal(arrays[name], expected[name], err_msg=name)
    assert header["epochs"] == 1
    assert header["train_losses"] == _train_losses(one)

    # the command the line gives trains epochs 2 and 3, to an uninterrupted run's weights
    resume = line.split("resume with: graphkit-train ", 1)[1].split()
    assert resume == [*command, "--resume"]
    assert main(resume) == 0
    whole = tmp_path / "whole"
    assert main([*job, "--epochs", "3", "--output", str(whole)]) == 0
    resumed, uninterrupted = _trained(out), _trained(whole)
    for name in ("coef", "intercept"):
        np.testing.assert_array_equal(resumed[name], uninterrupted[name], err_msg=name)
    assert _train_losses(out) == _train_losses(whole) and len(_train_losses(out)) == 3


def test_checkpoint_option_saves_every_epoch_and_refuses_to_overwrite(
    job, tmp_path, capsys, ctrl_c_in_epoch_2
):
    path = tmp_path / "state" / "run.ckpt"  # its folder is created
    command = [*job, "--epochs", "3", "--output", str(tmp_path / "out")]
    assert main([*command, "--checkpoint", str(path)]) == 130
    line = _one_error_line(capsys)
    assert f"saved its state to {path}" in line and line.endswith("--resume"), line
    assert checkpoint.read(path)[1]["epochs"] == 1
    assert not (tmp_path / "out" / "checkpoint.ckpt").exists()  # only where it was told
    ctrl_c_in_epoch_2.undo()

    # a new run would overwrite the interrupted one's state: refused, in one line
    assert main([*command, "--checkpoint", str(path)]) == 2
    assert "already exists: add --resume" in _one_error_line(capsys)
    assert checkpoint.read(path)[1]["epochs"] == 1
    assert main([*command, "--checkpoint", str(path), "--resume"]) == 0
    assert checkpoint.read(path)[1]["epochs"] == 3  # saved at every epoch's end
    # --resume with nothing to resume from
    assert main([*command, "--output", str(tmp_path / "new"), "--resume"]) == 2
    assert "--resume: there is no checkpoint" in _one_error_line(capsys)
    # data-parallel runs cannot resume yet: refused before torchrun starts
    assert main([*command, "--checkpoint", str(path), "--resume", "--nproc", "2"]) == 2
    assert "not supported with --nproc" in _one_error_line(capsys)


def test_ctrl_c_before_the_first_epoch_ends_saves_nothing(job, tmp_path, capsys, monkeypatch):
    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(Trainer, "_run_epoch", interrupted)
    out = tmp_path / "out"
    assert main([*job, "--epochs", "3", "--output", str(out)]) == 130
    assert "no epoch ended, nothing was saved" in _one_error_line(capsys)
    assert not (out / "checkpoint.ckpt").exists()


def test_a_byte_order_mark_is_not_part_of_the_first_column(tmp_path):
    path = tmp_path / "excel.csv"
    path.write_bytes(b"\xef\xbb\xbfa,b,t\r\n1,2,3\r\n4,5,6\r\n")
    X, y, names = read_dataset(str(path), "a", "X")
    assert names == ["b", "t"]
    np.testing.assert_array_equal(y, [1.0, 4.0])
    np.testing.assert_array_equal(X, [[2.0, 3.0], [5.0, 6.0]])


def test_a_latin_1_csv_is_named_in_one_line(job, tmp_path, capsys):
    # the byte lies far past the reader's first chunk: its position is the file's
    lines = ["a,b,c,t"] + [f"{i},2,3,4" for i in range(3000)] + ["1,2,3,4 caf\xe9"]
    data = "\n".join(lines).encode("latin-1")
    path = tmp_path / "latin.csv"
    path.write_bytes(data)
    position = data.index(b"\xe9")
    assert position > 8192
    code = main([job[0], "--data", str(path), "--output", str(tmp_path / "out"), "--quiet"])
    assert code == 2
    line = _one_error_line(capsys)
    assert f"{path} is not UTF-8 text (byte 0xe9 on line 3002, at position {position}" in line
    assert line.endswith("save it as UTF-8"), line


def test_an_npz_with_python_objects_is_named_in_one_line(job, tmp_path, capsys):
    path = tmp_path / "objects.npz"
    X = np.array([[1.0, "a", 2.0]] * 10, dtype=object)
    np.savez(path, X=X, y=np.arange(10.0))
    code = main([job[0], "--data", str(path), "--output", str(tmp_path / "out"), "--quiet"])
    assert code == 2
    line = _one_error_line(capsys)
    assert f"{path}: array 'X' holds Python objects (dtype object)" in line, line
    assert "save numeric arrays" in line, line


@pytest.mark.parametrize(
    ("option", "expected"),
    [("--output", "--output folder"), ("--web", "--web folder"), ("--checkpoint", "--checkpoint")],
)
def test_a_folder_that_cannot_be_written_fails_before_training(
    job, tmp_path, capsys, monkeypatch, option, expected
):
    def never(*args, **kwargs):
        raise AssertionError("trained before checking the output folder")

    monkeypatch.setattr(Trainer, "fit", never)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    folder = blocker / "results"  # cannot be created: a file is in the way
    target = folder / "run.ckpt" if option == "--checkpoint" else folder
    argv = [*job, "--epochs", "2", "--output", str(tmp_path / "out"), option, str(target)]
    assert main(argv) == 2
    line = _one_error_line(capsys)
    assert f"{expected}" in line and f"{str(folder)!r} cannot be written" in line, line
    assert "NotADirectoryError" in line, line


def test_the_write_check_leaves_no_folder_when_a_later_check_fails(job, tmp_path, capsys):
    out = tmp_path / "new" / "results"
    assert main([*job, "--optimizer", "lions", "--output", str(out)]) == 2
    assert "Unknown optimizer" in _one_error_line(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["linear.onnx", "train.csv"]


def test_a_broken_onnxruntime_install_is_one_line(monkeypatch, capsys):
    """Two onnxruntime builds installed over each other: the runtime check's message,
    one line and exit code 2, not a traceback."""
    from graphkit.runtime_check import OnnxruntimeInstallError
    from graphkit_train import cli

    def broken(args):
        raise OnnxruntimeInstallError("onnxruntime 1.32.0 and onnxruntime-training-cpu 1.19.2")

    monkeypatch.setattr(cli, "run", broken)
    assert cli.main(["--epochs", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "graphkit-train: OnnxruntimeInstallError: onnxruntime 1.32.0 and "
        "onnxruntime-training-cpu 1.19.2"
    ]
