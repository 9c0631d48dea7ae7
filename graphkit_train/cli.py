"""``graphkit-train``: train an ONNX model on a dataset from the command line.

    graphkit-train model.onnx --data train.csv --label price --loss huber \\
        --optimizer adam --lr 0.01 --epochs 50 --batch-size 32 --output out/

Without a model and data it trains the embedded default job: an MLP built for the
diabetes data (Efron et al. 2004; ``graphkit_train/data/diabetes.npz``, scikit-learn's
copy, shipped so that the demo runs on a bare install), with feature and target scaling
inside the graph. When scikit-learn is installed, it prints the held-out score of
scikit-learn's MLPRegressor trained on the same split next to its own. It writes the
trained model, the fused training-step graph, ``report.json`` and (with matplotlib)
``loss_curve.png`` into ``--output``.

Ctrl-C keeps the finished epochs: the state after the last one is saved (to
``--checkpoint PATH``, else to ``checkpoint.ckpt`` in the output folder), and the same
command with ``--resume`` trains the epochs left. The output folder (and the checkpoint's
and ``--web``'s) is checked to be writable before training, not after.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import csv
import inspect
import json
import os
import shlex
import sys
import tempfile
import time
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import graphkit as gk
from graphkit import losses, optimizers, schedules, tensor_store
from graphkit.compat import load_model
from graphkit.rewrite import META_LOSS, loss_heads, metadata
from graphkit.runtime_check import OnnxruntimeInstallError, OnnxruntimeNotInstalledError
from graphkit_train.trainers.full import Trainer

# where Ctrl-C saves the training state when --checkpoint is not given (in --output), and
# where --resume then reads it
DEFAULT_CHECKPOINT = "checkpoint.ckpt"
INTERRUPTED = 130  # the shell's status for a process ended by SIGINT (128 + 2)


class CliError(Exception):
    """A problem with the command line or the data: printed as one line, exit code 2."""


class _Interrupted(Exception):
    """Ctrl-C during a run: the one line to print (where the state went), and whether a
    checkpoint to resume from exists (exit code 130)."""

    def __init__(self, message: str, resumable: bool) -> None:
        super().__init__(message)
        self.resumable = resumable


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise CliError(f"{message} (see graphkit-train --help)")


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
    return value


def _positive_int(text: str) -> int:
    return _int_at_least(text, 1)


def _epochs(text: str) -> int:
    """Epochs: an integer >= 0 (0 only with 'export --web', checked in run)."""
    return _int_at_least(text, 0)


def _output_index(text: str) -> int | str:
    return int(text) if text.lstrip("-").isdigit() else text


def version() -> str:
    """graphkit's version: its installed distribution's (``graphkit-onnx``, formerly
    ``graphkit``: the one that declares the ``graphkit-train`` command, not another
    project's of that name), else ``graphkit.__version__`` (a source tree on the path)."""
    from importlib import metadata

    for name in ("graphkit-onnx", "graphkit"):
        try:
            distribution = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        if any(e.name == "graphkit-train" for e in distribution.entry_points):
            return distribution.version
    return gk.__version__


class _Formatter(argparse.HelpFormatter):
    """argparse's formatter, but the description and epilog keep their paragraphs (each
    one wrapped), where argparse would run them into one."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n\n".join(
            super(_Formatter, self)._fill_text(paragraph, width, indent)
            for paragraph in text.split("\n\n")
        )


def _backend_help() -> str:
    """``--backend``'s help: the registered names, what each installed one is (a backend
    that is not installed here is not described)."""
    from graphkit import backends

    installed = [b for b in backends.available() if b.installed]
    described = "".join(f" {b.name}: {b.description}." for b in installed)
    first = f" ({installed[0].name} here)" if installed else ""
    return (
        f"where gradients come from and what runs the graphs.{described} Default: the "
        f"backend the {backends.ENVIRONMENT_VARIABLE} environment variable names, else "
        f"graphkit's default, the first installed{first}"
    )


def build_parser() -> argparse.ArgumentParser:
    from graphkit import backends

    parser = _Parser(
        # the usage line shows both commands: 'graphkit-train export ...' takes the same
        # options (main strips the word before parsing)
        prog="graphkit-train [export]",
        description=(
            "Train the weights of an ONNX model on a CSV or NPZ dataset, with onnxruntime."
            "\n\n"
            "With no MODEL and no --data, train the embedded default job: an MLP on the "
            "diabetes data (Efron et al. 2004; 442 rows, shipped with graphkit), and, when "
            "scikit-learn is installed, compare its held-out R^2 with scikit-learn's "
            "MLPRegressor trained on the same split."
            "\n\n"
            "The output folder gets the trained model (model.onnx), the fused training step "
            "(training_step.onnx), report.json and, with matplotlib, loss_curve.png. To "
            "continue training on any ONNX runtime, it also gets the step and a whole epoch "
            "in standard ONNX (training_step.portable.onnx, training_epoch.portable.onnx) "
            "and the trained model carrying the step as a TrainingInfoProto "
            "(model.trainable.onnx). A model whose training cannot be written in standard "
            "ONNX still trains, without those three files (a line says why); "
            "'graphkit-train export ...' (same options) makes that an error instead."
            "\n\n"
            "The defaults differ from graphkit_train.Trainer's: here --optimizer adam, --lr "
            "0.001 and --batch-size 32; Trainer(model) trains with optimizer='sgd' at a "
            "learning rate of 0.01 and batch_size=10."
        ),
        epilog=(
            "onnxruntime's own log lines are hidden but for errors; "
            "GRAPHKIT_ORT_LOG_SEVERITY=2 shows its warnings too (0 shows everything)."
        ),
        formatter_class=_Formatter,
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"graphkit-train {version()}",
        help="print graphkit-train's version and exit",
    )
    parser.add_argument(
        "model",
        nargs="?",
        help="ONNX prediction graph (a loss is appended with --loss) or training graph "
        "(with a 'loss' output, used as is)",
    )
    parser.add_argument("--data", help="dataset: a CSV file with a header row, or an NPZ file")
    parser.add_argument(
        "--label",
        default=None,
        help="CSV: the label column (default: the last one); NPZ: the label array (default: 'y')",
    )
    parser.add_argument("--features", default="X", help="NPZ: the feature array (default: 'X')")
    parser.add_argument(
        "--input",
        action="append",
        default=None,
        metavar="NAME=COLUMNS",
        help="for a model with several inputs, once per input: the CSV columns "
        "(comma-separated) or the NPZ array it reads, e.g. --input X=age,bmi --input "
        "ids=city (integer columns feed int64 inputs); by default every column but the "
        "label goes to the model's only input",
    )
    parser.add_argument(
        "--loss",
        default="squared_error",
        help=f"loss name, one of {', '.join(losses.LOSSES.names())} (default: squared_error)",
    )
    parser.add_argument(
        "--optimizer",
        default="adam",
        help=f"optimizer name, one of {', '.join(optimizers.OPTIMIZERS.names())} (default: adam)",
    )
    parser.add_argument(
        "--schedule",
        default="constant",
        help=f"learning-rate schedule, one of {', '.join(schedules.SCHEDULES.names())} "
        "(default: constant)",
    )
    parser.add_argument(
        "--lr", type=float, default=0.001, help="initial learning rate (eta0; default: 0.001)"
    )
    parser.add_argument(
        "--epochs",
        type=_epochs,
        default=100,
        help="number of epochs (default: 100); 0 with 'export --web' writes the untrained "
        "model for a web page to train",
    )
    parser.add_argument(
        "--batch-size",
        type=_positive_int,
        default=32,
        help="rows per training step (default: 32)",
    )
    parser.add_argument(
        "--output-index",
        type=_output_index,
        default=None,
        help="the model output the loss applies to, a position or a name (default: the only "
        "float output, e.g. a skl2onnx classifier's probabilities)",
    )
    parser.add_argument(
        "--validation-split",
        type=float,
        default=0.2,
        help="fraction of rows held out (default: 0.2)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the split and the shuffling (default: 0)"
    )
    parser.add_argument(
        "--weights", default=None, help="comma-separated weights to train (default: all)"
    )
    parser.add_argument("--backend", choices=backends.names(), default=None, help=_backend_help())
    parser.add_argument(
        "--output", default="graphkit-out", help="folder for the results (default: graphkit-out)"
    )
    parser.add_argument(
        "--checkpoint",
        default=None,
        metavar="PATH",
        help="save the training state (weights, optimizer state, epochs done, shuffling) "
        "to PATH at the end of every epoch, and on Ctrl-C; an existing PATH is refused "
        "unless --resume is given, so that a new run never overwrites an old one's state. "
        "Without it, Ctrl-C saves the state to checkpoint.ckpt in the --output folder",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the run saved in --checkpoint PATH (default: checkpoint.ckpt in the "
        "--output folder, where Ctrl-C saves it): give the same command (model, data, "
        "options) and --resume, and it trains the epochs left to --epochs, ending with the "
        "weights of an uninterrupted run; it goes on saving to that file every epoch",
    )
    parser.add_argument(
        "--nproc",
        type=_positive_int,
        default=1,
        help="train data-parallel in N processes on this machine (default: 1; relaunches "
        "itself with torchrun; needs torch)",
    )
    parser.add_argument(
        "--distributed",
        action="store_true",
        help="this process is one rank of a torchrun launch (torchrun ... -m graphkit_train.cli "
        "--distributed ...): train data-parallel, rank 0 prints and writes",
    )
    parser.add_argument(
        "--web",
        default=None,
        metavar="DIR",
        help="also write DIR, a folder a web page trains with onnxruntime-web: the exported "
        "step and epoch, a manifest, graphkit-web.mjs and the training and held-out rows "
        "(data.json); see the README, 'Training in a web page'",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar, no per-epoch lines")
    return parser


# -- data -------------------------------------------------------------------------------


def read_dataset(
    path: str, label: str | None, features: str
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """``(X, y, feature names)`` from a CSV (header row) or an NPZ file.

    Raises:
        CliError: a missing file, an unknown column or array, an empty or non-numeric
            cell (naming the file's line and column).
    """
    if not os.path.isfile(path):
        raise CliError(f"no data file {path!r}")
    if path.endswith(".npz"):
        return _read_npz(path, label, features)
    return _read_csv(path, label)


def _npz_arrays(path: str, keys: list[str]) -> dict[str, np.ndarray]:
    """The numeric arrays ``keys`` of the NPZ file ``path`` (a CliError says which is
    missing or not numeric)."""
    try:
        data = np.load(path)
    except (OSError, ValueError) as exc:
        raise CliError(f"{path} is not a readable NPZ file: {exc}") from None
    with data:
        missing = [k for k in keys if k not in data]
        if missing:
            raise CliError(f"{path} has no array {missing}; it holds {sorted(data)}")
        arrays = {k: _npz_array(data, path, k) for k in keys}
    for name, array in arrays.items():
        if array.dtype.kind not in "iufb":
            raise CliError(f"{path}: array {name!r} is {array.dtype}, not numeric")
    return arrays


def _npz_array(data: Any, path: str, name: str) -> np.ndarray:
    """The array ``name`` of the open NPZ file ``path`` (a CliError names the file and
    the array when it cannot be read: Python objects, a damaged member)."""
    try:
        return data[name]
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
        if _npz_dtype(data, name) == np.dtype(object):
            raise CliError(
                f"{path}: array {name!r} holds Python objects (dtype object), which are "
                "not read (they would need pickle); save numeric arrays, e.g. "
                f"np.savez(..., {name}=array.astype(float))"
            ) from None
        raise CliError(
            f"{path}: array {name!r} cannot be read ({type(exc).__name__}: {exc})"
        ) from None


def _npz_dtype(data: Any, name: str) -> np.dtype | None:
    """The dtype the ``.npy`` header of ``name`` in an NPZ file declares (None when the
    header itself cannot be read)."""
    from numpy.lib import format as npy

    readers = {(1, 0): npy.read_array_header_1_0, (2, 0): npy.read_array_header_2_0}
    try:
        with data.zip.open(f"{name}.npy") as member:
            reader = readers.get(npy.read_magic(member))
            return None if reader is None else reader(member)[2]
    except (ValueError, OSError, EOFError, KeyError, zipfile.BadZipFile):
        return None


def _read_npz(
    path: str, label: str | None, features: str
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    label = label or "y"
    arrays = _npz_arrays(path, [features, label])
    X, y = arrays[features], arrays[label]
    if X.ndim != 2:
        raise CliError(f"{path}: array {features!r} has shape {X.shape}; it must be 2-D")
    return X, y, [f"x{i}" for i in range(X.shape[1])]


def _read_csv(path: str, label: str | None) -> tuple[np.ndarray, np.ndarray, list[str]]:
    try:
        return _parse_csv(path, label)
    except UnicodeDecodeError:  # its position is within a chunk the reader decoded
        raise CliError(_not_utf8(path)) from None


def _not_utf8(path: str) -> str:
    """What is wrong with a CSV file that is not UTF-8 text: its first byte that is not
    UTF-8, by line and by position in the file."""
    with open(path, "rb") as handle:
        data = handle.read()
    start = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        data[start:].decode("utf-8")
    except UnicodeDecodeError as exc:
        at = start + exc.start
        line = data.count(b"\n", 0, at) + 1
        return (
            f"{path} is not UTF-8 text (byte 0x{data[at]:02x} on line {line}, at position "
            f"{at} of the file; Latin-1 or Windows-1252, maybe): save it as UTF-8"
        )
    return f"{path} is not UTF-8 text: save it as UTF-8"


def _parse_csv(path: str, label: str | None) -> tuple[np.ndarray, np.ndarray, list[str]]:
    # utf-8-sig: a byte-order mark (Excel's "CSV UTF-8") is not part of the first name
    with open(path, newline="", encoding="utf-8-sig") as handle:
        reader = csv.reader(handle)
        header = [h.strip() for h in next(reader, [])]
        if not header:
            raise CliError(f"{path} is empty: it needs a header row and data rows")
        rows = []
        for row in reader:
            if not any(cell.strip() for cell in row):
                continue  # a blank line
            line = reader.line_num
            if len(row) != len(header):
                raise CliError(
                    f"{path}, line {line}: {len(row)} cells, but the header has {len(header)}"
                )
            rows.append([_number(cell, path, line, i + 1, header[i]) for i, cell in enumerate(row)])
    if not rows:
        raise CliError(f"{path} has a header but no data rows")
    label = label or header[-1]
    if label not in header:
        raise CliError(f"{path} has no column {label!r}; columns are {header}")
    table = np.array(rows, dtype=np.float64)
    index = header.index(label)
    X = np.delete(table, index, axis=1)
    return X, table[:, index], [h for h in header if h != label]


def parse_inputs(specs: Sequence[str]) -> dict[str, list[str]]:
    """``{input name: [column or array names]}`` from ``--input NAME=COLUMNS`` options.

    Raises:
        CliError: a malformed option, or an input named twice.
    """
    inputs: dict[str, list[str]] = {}
    for spec in specs:
        name, _, columns = spec.partition("=")
        names = [c.strip() for c in columns.split(",") if c.strip()]
        if not name.strip() or not names:
            raise CliError(f"--input {spec!r}: write NAME=COLUMNS, e.g. --input X=age,bmi")
        if name.strip() in inputs:
            raise CliError(f"--input names {name.strip()!r} twice; give each input once")
        inputs[name.strip()] = names
    return inputs


def read_inputs(
    path: str, label: str | None, inputs: dict[str, list[str]]
) -> tuple[dict[str, np.ndarray], np.ndarray, list[str]]:
    """``({input name: array}, y, column or array names)``: each input's CSV columns
    (every column but the label must go to one input), or the NPZ array it names.

    Raises:
        CliError: what :func:`read_dataset` refuses, and an unknown column or array, a
            column given to several inputs or to none.
    """
    if not path.endswith(".npz"):
        X, y, names = read_dataset(path, label, "")
        return _columns_to_inputs(path, X, names, inputs), y, names
    if not os.path.isfile(path):
        raise CliError(f"no data file {path!r}")
    if any(len(arrays) != 1 for arrays in inputs.values()):
        raise CliError("--input for an NPZ file names one array per input: NAME=ARRAY")
    wanted = {name: arrays[0] for name, arrays in inputs.items()}
    label = label or "y"
    arrays = _npz_arrays(path, [*wanted.values(), label])
    features = {name: arrays[array] for name, array in wanted.items()}
    y = arrays[label]
    for name, array in [*features.items(), (label, y)]:
        if len(array) != len(y):
            raise CliError(f"{path}: array {name!r} has {len(array)} rows, {label!r} {len(y)}")
    return features, y, list(wanted.values())


def _columns_to_inputs(
    path: str, X: np.ndarray, names: list[str], inputs: dict[str, list[str]]
) -> dict[str, np.ndarray]:
    given = [c for columns in inputs.values() for c in columns]
    unknown = [c for c in given if c not in names]
    if unknown:
        raise CliError(f"--input: {path} has no column {unknown}; its columns are {names}")
    twice = sorted({c for c in given if given.count(c) > 1})
    if twice:
        raise CliError(f"--input: columns {twice} go to several inputs; give each to one")
    left = [c for c in names if c not in given]
    if left:
        raise CliError(
            f"--input: columns {left} go to no input; map each column but the label to an "
            "input (or drop it from the file)"
        )
    return {name: X[:, [names.index(c) for c in columns]] for name, columns in inputs.items()}


def _rows(X: np.ndarray | dict[str, np.ndarray], rows: np.ndarray) -> Any:
    """The rows ``rows`` of one array or of each input's array."""
    if isinstance(X, dict):
        return {name: array[rows] for name, array in X.items()}
    return X[rows]


def _number(cell: str, path: str, line: int, column: int, name: str) -> float:
    text = cell.strip()
    where = f"{path}, line {line}, column {column} ({name!r})"
    if not text:
        raise CliError(f"{where}: empty cell; fill it in or drop the row")
    try:
        return float(text)
    except ValueError:
        raise CliError(
            f"{where}: {text!r} is not a number; encode categories as numbers first"
        ) from None


def split(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    if not 0 <= fraction < 1:
        raise CliError(f"--validation-split must lie in [0, 1), got {fraction}")
    order = np.random.default_rng(seed).permutation(n)
    n_test = int(round(n * fraction))
    return order[n_test:], order[:n_test]


# -- the embedded default job ---------------------------------------------------------

DIABETES = "diabetes (Efron et al. 2004)"  # the default job's dataset, as reports name it


def diabetes() -> tuple[np.ndarray, np.ndarray, list[str]]:
    """The default job's data: ``(X, y, feature names)`` of the diabetes data, 442 rows
    of 10 float64 features and a float64 target, exactly as scikit-learn's
    ``load_diabetes()`` returns them (graphkit_train/data/README.md says how the file was
    made), read from the copy shipped with graphkit_train."""
    from importlib import resources

    shipped = resources.files("graphkit_train").joinpath("data", "diabetes.npz")
    with shipped.open("rb") as handle, np.load(handle) as data:
        return data["X"], data["y"], [str(name) for name in data["feature_names"]]


def default_mlp(X: np.ndarray, y: np.ndarray, hidden: int, seed: int) -> onnx.ModelProto:
    """An MLP for tabular regression; scaling of X and y lives inside the graph.

    Y = ((X - mean) / std) W1 + b1 -> tanh -> W2 + b2, then * y_std + y_mean. The scaling
    constants are initializers that are not trained.
    """
    rng = np.random.default_rng(seed)
    n_features = X.shape[1]
    limit1, limit2 = np.sqrt(6 / (n_features + hidden)), np.sqrt(6 / (hidden + 1))
    init = {
        "x_mean": X.mean(axis=0),
        "x_std": X.std(axis=0) + 1e-12,
        "W1": rng.uniform(-limit1, limit1, (n_features, hidden)),
        "b1": np.zeros(hidden),
        "W2": rng.uniform(-limit2, limit2, (hidden, 1)),
        "b2": np.zeros(1),
        "y_mean": np.array([y.mean()]),
        "y_std": np.array([y.std()]),
    }
    nodes = [
        helper.make_node("Sub", ["X", "x_mean"], ["centered"]),
        helper.make_node("Div", ["centered", "x_std"], ["scaled"]),
        helper.make_node("Gemm", ["scaled", "W1", "b1"], ["hidden_in"]),
        helper.make_node("Tanh", ["hidden_in"], ["hidden_out"]),
        helper.make_node("Gemm", ["hidden_out", "W2", "b2"], ["standardized"]),
        helper.make_node("Mul", ["standardized", "y_std"], ["rescaled"]),
        helper.make_node("Add", ["rescaled", "y_mean"], ["Y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp_regressor",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", n_features])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 1])],
        [numpy_helper.from_array(v.astype(np.float32), k) for k, v in init.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def r2(y: np.ndarray, prediction: np.ndarray) -> float:
    y, prediction = y.reshape(-1).astype(np.float64), prediction.reshape(-1).astype(np.float64)
    return float(1 - ((y - prediction) ** 2).sum() / ((y - y.mean()) ** 2).sum())


# -- the job ----------------------------------------------------------------------------


def cli_schedule(name: str, lr: float, total_steps: int) -> Any:
    """The schedule ``--schedule name`` stands for: ``--lr`` is its initial (or peak)
    rate, and a schedule that decays over a number of steps decays over the run."""
    factory = schedules.SCHEDULES.factory(name)
    known = {"eta0": lr, "max_lr": lr, "total_steps": total_steps, "decay_steps": total_steps}
    parameters = inspect.signature(factory).parameters
    missing = [
        p for p, v in parameters.items() if v.default is inspect.Parameter.empty and p not in known
    ]
    if missing:
        raise CliError(
            f"the schedule {name!r} needs {', '.join(missing)}, which the command line cannot "
            "give; build it in Python (graphkit.schedules) instead"
        )
    return factory(**{k: v for k, v in known.items() if k in parameters})


@dataclass
class _Job:
    """The data, loss and model of one run, checked."""

    X: np.ndarray | dict[str, np.ndarray]  # {input name: array} for several inputs
    y: np.ndarray
    names: list[str]
    dataset: str
    default: bool  # the embedded default job (the diabetes data, an MLP)
    loss: losses.Loss
    train_rows: np.ndarray
    test_rows: np.ndarray
    model: onnx.ModelProto  # the training graph
    weights: list[str] | None


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Train as ``args`` say; return the report (also written to the output folder)."""
    rank, world_size = 0, 1
    if args.distributed:
        from graphkit_train import distributed

        rank, world_size = distributed.init().place
    quiet = args.quiet or rank != 0
    say = (lambda *a: None) if quiet else print
    if args.epochs == 0 and not (getattr(args, "export", False) and args.web):
        raise CliError(
            "--epochs 0 trains nothing: it is for 'graphkit-train export --web DIR', which "
            "then writes the untrained model for a web page to train"
        )
    checkpoint = _checkpoint_file(args)
    job = _job(args)
    if rank == 0:  # rank 0 writes: a folder it cannot write fails now, not after training
        _check_writable(args.output, "--output")
        if checkpoint is not None:
            _check_writable(os.path.dirname(os.path.abspath(checkpoint)), "--checkpoint's")
        if args.web:
            _check_writable(args.web, "--web")
    say(
        f"graphkit-train: {job.dataset}, {len(job.train_rows)} training rows, "
        f"{len(job.test_rows)} held out; loss {job.loss.name}, optimizer {args.optimizer}, "
        f"schedule {args.schedule}, lr {args.lr}, backend {_backend_name(args.backend)}"
    )
    if args.epochs == 0:
        return _export_untrained(job, args, say)
    last = _LastEpoch(keep=not args.distributed)
    try:
        return _train_and_write(job, args, quiet, checkpoint, last, rank, world_size, say)
    except KeyboardInterrupt:
        target = checkpoint or os.path.join(args.output, DEFAULT_CHECKPOINT)
        raise last.interrupted(target, args.epochs, resumed=args.resume) from None


def _train_and_write(
    job: _Job,
    args: argparse.Namespace,
    quiet: bool,
    checkpoint: str | None,
    last: _LastEpoch,
    rank: int,
    world_size: int,
    say: Any,
) -> dict[str, Any]:
    """Train, compare with scikit-learn (the default job, where it is installed), write
    the results; the report."""
    trainer, seconds, epoch_ends = _train(job, args, quiet, checkpoint, last)
    report = _report(job, args, trainer, seconds, epoch_ends, world_size, say)
    if rank != 0:  # rank 0 compares and writes
        return report
    if job.default and len(job.test_rows):
        assert isinstance(job.X, np.ndarray)  # the default job has one input
        reference = _sklearn_reference(job.X, job.y, job.train_rows, job.test_rows, args)
        if reference is None:
            say(
                "held-out R^2 (scikit-learn): not compared, the comparison needs "
                "scikit-learn (pip install scikit-learn)"
            )
        else:
            report["sklearn"] = reference
            say(
                f"held-out R^2 (scikit-learn {reference['estimator']}): "
                f"{reference['held_out_r2']:.4f}"
            )
    report["files"] = _write(trainer, args.output, report, say)
    if args.web:
        report["files"]["web"] = _write_web(trainer, job, args.web)
    say(f"wrote {', '.join(sorted(report['files'].values()))}")
    return report


def _checkpoint_file(args: argparse.Namespace) -> str | None:
    """The checkpoint ``fit`` resumes from and saves to every epoch: ``--checkpoint``,
    or with ``--resume`` alone the file Ctrl-C saves to; None without either.

    Raises:
        CliError: a checkpoint option with ``--nproc`` or ``--distributed``, ``--resume``
            without a file to resume from, or an existing ``--checkpoint`` file without
            ``--resume`` (a new run would overwrite another run's state).
    """
    if args.checkpoint is None and not args.resume:
        return None
    if args.distributed or args.nproc > 1:
        raise CliError(
            "--checkpoint and --resume are not supported with --nproc or --distributed yet; "
            "train in one process to checkpoint"
        )
    path = args.checkpoint or os.path.join(args.output, DEFAULT_CHECKPOINT)
    exists = os.path.exists(path)
    if args.resume and not exists:
        raise CliError(
            f"--resume: there is no checkpoint {path!r} to resume from (Ctrl-C saves one, "
            "and so does --checkpoint PATH every epoch); run without --resume to start over"
        )
    if not args.resume and exists:
        raise CliError(
            f"--checkpoint {path!r} already exists: add --resume to continue that run, or "
            "remove the file (or choose another PATH) to start over"
        )
    return path


def _check_writable(folder: str, option: str) -> None:
    """Create ``folder`` and write and remove a file in it, so that a folder the results
    cannot go to fails before the training rather than after it. The folders it had to
    create are removed again: an error found later (a bad option) leaves none behind."""
    folder = os.path.abspath(folder)
    created = []  # the missing folders, deepest first
    parent = folder
    while not os.path.exists(parent) and os.path.dirname(parent) != parent:
        created.append(parent)
        parent = os.path.dirname(parent)
    try:
        os.makedirs(folder, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".graphkit-write-test-", dir=folder)
        try:
            os.write(fd, b"graphkit")
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as exc:
        raise CliError(
            f"{option} folder {folder!r} cannot be written ({type(exc).__name__}: "
            f"{exc.strerror or exc}): choose another folder, or make this one writable"
        ) from None
    finally:
        for path in created:
            with contextlib.suppress(OSError):  # never made (the error above), or filled
                os.rmdir(path)


class _LastEpoch:
    """The trainer once an epoch has ended, so that Ctrl-C can save its state: a trainer
    interrupted in the middle of an epoch puts back the state of the last finished one
    (weights, optimizer state, shuffling generator; see ``BaseTrainer._fit_epoch``), so
    what it holds then is what a checkpoint must."""

    def __init__(self, keep: bool) -> None:
        self.keep = keep  # distributed ranks keep nothing: their runs cannot checkpoint
        self.trainer: Trainer | None = None

    def record(self, trainer: Trainer) -> None:
        """An epoch of ``trainer`` ended: called at the end of every epoch."""
        if self.keep:
            self.trainer = trainer

    def interrupted(self, path: str, epochs: int, resumed: bool) -> _Interrupted:
        """Save the trainer's state to ``path`` (the run resumed from it when
        ``resumed``); the :class:`_Interrupted` that says where."""
        if self.trainer is None:
            if resumed:  # and no epoch ended since: the file holds what it resumed from
                return _Interrupted(
                    f"interrupted before an epoch ended; {path} holds the state the run "
                    "was resumed from",
                    resumable=True,
                )
            reason = "distributed runs are not checkpointed" if not self.keep else "no epoch ended"
            return _Interrupted(f"interrupted: {reason}, nothing was saved", resumable=False)
        trainer = self.trainer
        done = len(trainer.train_losses_)
        try:
            trainer.save_checkpoint(path)
        except (OSError, gk.GraphkitError) as exc:
            return _Interrupted(
                f"interrupted after epoch {done} of {epochs}, and its state could not be "
                f"saved: {exc}",
                resumable=False,
            )
        return _Interrupted(
            f"interrupted after epoch {done} of {epochs}; saved its state to {path}",
            resumable=True,
        )


def _job(args: argparse.Namespace) -> _Job:
    """The data (labels cast for the loss), the held-out split and the training graph."""
    default_job = args.model is None and args.data is None
    inputs = parse_inputs(args.input) if args.input else None
    X: np.ndarray | dict[str, np.ndarray]
    if default_job:
        if inputs is not None:
            raise CliError("--input maps the columns of --data; the default job has one input")
        X, y, names = diabetes()
        dataset = DIABETES
    elif args.model is None:
        raise CliError("--data needs a MODEL to train (an .onnx file)")
    elif args.data is None:
        raise CliError("a MODEL needs --data (a CSV or NPZ file)")
    elif inputs is not None:
        X, y, names = read_inputs(args.data, args.label, inputs)
        dataset = args.data
    else:
        X, y, names = read_dataset(args.data, args.label, args.features)
        dataset = args.data
    train_rows, test_rows = split(len(y), args.validation_split, args.seed)
    loss = losses.get(args.loss)
    if not isinstance(X, dict):  # several inputs keep their numbers: the trainer casts
        X = X.astype(np.float32)  # each to its input's type (ids to int64)
    if loss.task == "classification":
        if not np.array_equal(y, np.round(y)):
            raise CliError(f"the loss {loss.name!r} needs integer class labels; the labels are not")
        y = y.astype(np.int64)
    else:
        y = y.astype(np.float32)
    weights: list[str] | None
    if default_job:
        assert isinstance(X, np.ndarray)  # the diabetes rows: one input
        model = default_mlp(X[train_rows], y[train_rows], hidden=32, seed=args.seed)
        weights = ["W1", "b1", "W2", "b2"]
    else:
        model = load_model(args.model)
        weights = args.weights.split(",") if args.weights else None
    outputs = [o.name for o in model.graph.output]
    already = metadata(model).get(META_LOSS) or ("loss" if "loss" in outputs else None)
    heads = [h.output for h in loss_heads(model)]
    if len(heads) > 1:
        raise CliError(
            f"the model has a loss per output {heads}, and --label names one column: train "
            "it from Python, graphkit_train.Trainer(model).fit(X, {output name: labels})"
        )
    if not already:
        model = gk.add_loss_output(model, loss, output_index=args.output_index)
    _check_inputs(model, weights, inputs)
    return _Job(X, y, names, dataset, default_job, loss, train_rows, test_rows, model, weights)


def _check_inputs(
    model: onnx.ModelProto, weights: list[str] | None, inputs: dict[str, list[str]] | None
) -> None:
    """The ``--input`` options name the model's inputs (needed when it has several)."""
    from graphkit.training.step import data_inputs

    try:
        features = data_inputs(model, weights or [], "weight")[0]
    except (ValueError, KeyError):  # the trainer explains a graph without its label
        return
    if inputs is None:
        if len(features) > 1:
            raise CliError(
                f"the model takes {len(features)} inputs {features}: say which columns each "
                "reads with --input NAME=COLUMNS, once per input (e.g. --input "
                f"{features[0]}=a,b --input {features[1]}=c)"
            )
        return
    if sorted(inputs) != sorted(features):
        raise CliError(f"--input names {sorted(inputs)}; the model's inputs are {features}")


def _trainer(job: _Job, args: argparse.Namespace, quiet: bool) -> Trainer:
    """The trainer the options describe, not fitted."""
    total_steps = args.epochs * -(-len(job.train_rows) // args.batch_size)
    if not total_steps and args.schedule != "constant":
        raise CliError(
            f"the schedule {args.schedule!r} spreads over the run's steps, and --epochs 0 has "
            "none: export with --schedule constant, or train first"
        )
    return Trainer(
        job.model,
        job.weights,
        optimizer=args.optimizer,  # graphkit.optimizers.get(args.optimizer), as everywhere
        schedule=cli_schedule(args.schedule, args.lr, total_steps),
        max_iter=max(args.epochs, 1),  # 0: exported untrained, never fitted
        backend=args.backend,  # None: GRAPHKIT_BACKEND, else graphkit's default
        batch_size=args.batch_size,
        validation_every=1,
        random_state=args.seed,
        verbose=0 if quiet else 1,
        distributed=args.distributed,
    )


def _train(
    job: _Job, args: argparse.Namespace, quiet: bool, checkpoint: str | None, last: _LastEpoch
) -> tuple[Trainer, float, list[float]]:
    """The fitted trainer, the training time and the time at the end of each epoch (of
    this run: a resumed one times the epochs left). The trainer resumes from
    ``checkpoint`` when it exists and saves to it every epoch; ``last`` keeps the state
    of every finished epoch for Ctrl-C."""
    trainer = _trainer(job, args, quiet)
    test = job.test_rows
    held_out = (_rows(job.X, test), job.y[test]) if len(test) else (None, None)
    epoch_ends: list[float] = []
    start = time.perf_counter()

    def after_epoch(epoch: int, losses: dict[str, float | None], fitted: Any) -> None:
        epoch_ends.append(time.perf_counter() - start)
        last.record(fitted)

    trainer.fit(
        _rows(job.X, job.train_rows),
        job.y[job.train_rows],
        X_val=held_out[0],
        y_val=held_out[1],
        callback=after_epoch,
        checkpoint=checkpoint,
    )
    return trainer, time.perf_counter() - start, epoch_ends


def _report(
    job: _Job,
    args: argparse.Namespace,
    trainer: Trainer,
    seconds: float,
    epoch_ends: list[float],
    world_size: int,
    say: Any,
) -> dict[str, Any]:
    """What ``report.json`` holds, the held-out score included."""
    report: dict[str, Any] = {
        **_job_report(job, args),
        "weights_trained": trainer.weights_to_train_,
        "optimizer": {"name": trainer.optimizer_.name, "params": trainer.optimizer_.params},
        "processes": world_size,
        "train_losses": trainer.train_losses_,
        "held_out_losses": trainer.validation_losses_,
        "training_seconds": seconds,
        "backend": trainer.backend_.name,
        "epoch_end_seconds": epoch_ends,
        "export": getattr(args, "export", False),
    }
    if len(job.test_rows):
        prediction = trainer.predict(_rows(job.X, job.test_rows))
        assert isinstance(prediction, np.ndarray)  # one loss (a loss per output is refused)
        if job.loss.task == "regression":
            report["held_out_r2"] = r2(job.y[job.test_rows], prediction)
            say(f"held-out R^2 (graphkit): {report['held_out_r2']:.4f}")
        else:
            accuracy = float((prediction == job.y[job.test_rows]).mean())
            report["held_out_accuracy"] = accuracy
            say(f"held-out accuracy (graphkit): {accuracy:.4f}")
    return report


def _sklearn_reference(
    X: np.ndarray,
    y: np.ndarray,
    train_rows: np.ndarray,
    test_rows: np.ndarray,
    args: argparse.Namespace,
) -> dict[str, Any] | None:
    """scikit-learn's MLPRegressor on the default job's split, and its held-out R^2;
    None where scikit-learn is not installed (it is no dependency of graphkit)."""
    import warnings

    try:
        from sklearn.compose import TransformedTargetRegressor
        from sklearn.neural_network import MLPRegressor
        from sklearn.pipeline import make_pipeline
        from sklearn.preprocessing import StandardScaler
    except ImportError:
        return None

    # the same model as the default job: scaled features and target, 32 tanh units, Adam
    mlp = MLPRegressor(
        hidden_layer_sizes=(32,),
        activation="tanh",
        solver="adam",
        learning_rate_init=args.lr,
        batch_size=args.batch_size,
        max_iter=args.epochs,
        random_state=args.seed,
    )
    estimator = TransformedTargetRegressor(
        regressor=make_pipeline(StandardScaler(), mlp), transformer=StandardScaler()
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        estimator.fit(X[train_rows], y[train_rows])
    score = r2(y[test_rows], estimator.predict(X[test_rows]))
    return {"estimator": "MLPRegressor(32, tanh, adam), scaled X and y", "held_out_r2": score}


def _job_report(job: _Job, args: argparse.Namespace) -> dict[str, Any]:
    """What every report says of the job: the data, its split and the settings."""
    return {
        "dataset": job.dataset,
        "features": job.names,
        "rows": {"train": int(len(job.train_rows)), "held_out": int(len(job.test_rows))},
        "settings": {k: v for k, v in vars(args).items() if k not in ("quiet", "export")},
    }


def _export_untrained(job: _Job, args: argparse.Namespace, say: Any) -> dict[str, Any]:
    """``export --web DIR --epochs 0``: the web folder of the untrained model, and a report."""
    trainer = _trainer(job, args, quiet=True)
    folder = _write_web(trainer, job, args.web)
    report = {
        **_job_report(job, args),
        "export": True,
        "files": {"web": folder},
    }
    os.makedirs(args.output, exist_ok=True)
    report["files"]["report"] = os.path.join(args.output, "report.json")
    with open(report["files"]["report"], "w") as handle:
        json.dump(report, handle, indent=2)
    say(f"wrote {folder} (untrained: a web page trains it) and {report['files']['report']}")
    return report


def _write_web(trainer: Trainer, job: _Job, folder: str) -> str:
    """The folder a web page trains (graphkit_train.web), with the job's rows."""
    from graphkit_train.web import export_web

    data = {
        "feature_names": job.names,
        "train": (_rows(job.X, job.train_rows), job.y[job.train_rows]),
    }
    if len(job.test_rows):
        data["held_out"] = (_rows(job.X, job.test_rows), job.y[job.test_rows])
    export_web(trainer, folder, data=data)
    return folder


def _write(trainer: Trainer, folder: str, report: dict[str, Any], say: Any) -> dict[str, str]:
    """Write the trained model, the training step, its portable exports and (with
    matplotlib) the loss curve into ``folder``, then ``report.json``; ``{kind: path}``.
    A missing matplotlib is one line through ``say``: the rest is written all the same."""
    os.makedirs(folder, exist_ok=True)
    files = {
        "model": os.path.join(folder, "model.onnx"),
        "training_step": os.path.join(folder, "training_step.onnx"),
        "report": os.path.join(folder, "report.json"),
    }
    tensor_store.save_model(trainer.get_trained_onnx(), files["model"])
    tensor_store.save_model(trainer.training_step_.model, files["training_step"])
    # the same training in standard ONNX, to continue on any runtime
    portable = {
        "portable_training_step": os.path.join(folder, "training_step.portable.onnx"),
        "portable_training_epoch": os.path.join(folder, "training_epoch.portable.onnx"),
        "model_with_training": os.path.join(folder, "model.trainable.onnx"),
    }
    try:
        trainer.export_training_step(portable["portable_training_step"])
        trainer.export_training_epoch(portable["portable_training_epoch"])
        trainer.export_training_info(portable["model_with_training"])
        files.update(portable)
    except gk.IncompatibleModelError as exc:
        if report.get("export"):
            raise
        print(f"graphkit-train: no portable export: {exc}", file=sys.stderr)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        say("loss_curve.png: not drawn, the loss curve needs matplotlib (pip install matplotlib)")
    else:
        files["loss_curve"] = os.path.join(folder, "loss_curve.png")
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(range(1, len(report["train_losses"]) + 1), report["train_losses"], label="train")
        if report["held_out_losses"]:
            ax.plot(
                range(1, len(report["held_out_losses"]) + 1),
                report["held_out_losses"],
                label="held out",
            )
        ax.set_xlabel("epoch")
        ax.set_ylabel("loss")
        ax.set_yscale("log")
        ax.legend()
        fig.tight_layout()
        fig.savefig(files["loss_curve"], dpi=100)
        plt.close(fig)
    with open(files["report"], "w") as handle:
        json.dump({**report, "files": files}, handle, indent=2)
    return files


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; every error is one line on stderr and exit code 2; Ctrl-C
    is one line saying where the finished epochs were saved, and exit code 130."""
    argv = list(sys.argv[1:] if argv is None else argv)
    export = bool(argv) and argv[0] == "export"
    try:
        args = build_parser().parse_args(argv[1:] if export else argv)
        args.export = export
        if args.nproc > 1 and not args.distributed:
            _checkpoint_file(args)  # refused before the processes start
            return _relaunch(argv, args.nproc)
        run(args)
    except _Interrupted as exc:
        resume = [*argv, "--resume"] if "--resume" not in argv else argv
        how = f"; resume with: {shlex.join(['graphkit-train', *resume])}" if exc.resumable else ""
        _fail(f"{exc}{how}")
        return INTERRUPTED
    except KeyboardInterrupt:  # before training (reading the data, building the graphs)
        _fail("interrupted: nothing was saved")
        return INTERRUPTED
    except CliError as exc:
        return _fail(f"error: {exc}")
    except (gk.GraphkitError, FileNotFoundError) as exc:
        return _fail(f"{type(exc).__name__}: {exc}")
    except (OnnxruntimeInstallError, OnnxruntimeNotInstalledError) as exc:  # the install
        return _fail(f"{type(exc).__name__}: {exc}")
    except (ValueError, TypeError, OSError) as exc:  # graphkit's input checks and the OS
        return _fail(f"{type(exc).__name__}: {exc}")
    return 0


def _relaunch(argv: list[str], nproc: int) -> int:
    """This command again in ``nproc`` processes under torchrun, each a rank."""
    import subprocess

    kept, skip = [], False
    for arg in argv:  # drop --nproc N: each rank runs with --distributed instead
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            kept.append(arg)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--nproc_per_node={nproc}", "-m", "graphkit_train.cli", *kept, "--distributed"]
    try:
        import torch  # noqa: F401 - torchrun needs it
    except ImportError:
        raise CliError(
            "--nproc needs torch: pip install torch --index-url "
            "https://download.pytorch.org/whl/cpu"
        ) from None
    done = subprocess.run(command)
    if done.returncode:
        return _fail(f"error: {nproc} processes failed (exit code {done.returncode}); see above")
    return 0


def _backend_name(name: str | None) -> str:
    """The backend ``--backend name`` trains with (None: the default), for the first
    line; a name that cannot be resolved is shown as given (the trainer reports why)."""
    from graphkit import backends

    try:
        return backends.canonical(name)
    except gk.GraphkitError:
        return str(name)


def _fail(message: str) -> int:
    print(f"graphkit-train: {' '.join(message.split())}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
