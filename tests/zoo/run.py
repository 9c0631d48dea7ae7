"""Train (or see refused) one zoo case with one trainer on one backend, and render the
support table.

``python -m tests.zoo.run`` trains every case with both trainers on every installed backend
and rewrites the support table of the documentation's model zoo page, ``docs/zoo.md``
(between the ``zoo:start`` / ``zoo:end`` markers; the rows it cannot run here, of a
backend not installed or of a torch model without torch, are kept as they are);
``make zoo-table`` runs it.
"""

from __future__ import annotations

import functools
import importlib.util
import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import graphkit as gk
from graphkit import backends, lora
from graphkit.rewrite import select_prediction
from graphkit.train_mode import marked_for_training
from graphkit_train import OrtGradientForwardBackwardOptimizer, OrtGradientOptimizer

from .models import CASES, FORWARD_BACKWARD, FULL, IGNORE, Case, Data

SUPPORT_TABLE_PAGE = Path(__file__).resolve().parents[2] / "docs" / "zoo.md"
"""The page that holds the support table, between :data:`START` and :data:`END`."""
START, END = "<!-- zoo:start -->", "<!-- zoo:end -->"
TRAINER_NAMES = {FULL: "full", FORWARD_BACKWARD: "forward/backward"}
INSTALLED = [b.name for b in backends.available() if b.installed]
"""The backends the zoo trains on here: every installed one."""
HAS_TORCH = importlib.util.find_spec("torch") is not None


def runnable(case: Case) -> bool:
    """Whether ``case`` can be built here (torch's exporters need torch)."""
    return case.exporter == "skl2onnx" or HAS_TORCH


@dataclass
class Outcome:
    case: Case
    trainer: str
    backend: str
    result: str  # "trains" | "refused" | "error"
    metric: str  # "R2" | "accuracy"
    before: float | None = None
    after: float | None = None
    error: BaseException | None = None

    @property
    def key(self) -> tuple[str, str, str, str]:
        """``(model, converter, trainer, backend)``: the row's first four cells."""
        return self.case.name, self.case.exporter, TRAINER_NAMES[self.trainer], self.backend

    @property
    def row(self) -> tuple[str, str, str, str, str]:
        result = self.result
        if self.result == "refused":
            op = self.case.refusal(self.trainer, self.backend) or "?"
            result = f"refused: {type(self.error).__name__} names {op}"
        return (*self.key, result)


@functools.cache
def built(case: Case):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return case.build()


def metric(data: Data, output: np.ndarray, case: Case) -> float:
    """Held-out R^2 (regression), accuracy (classification) or next-token accuracy over
    the labelled positions (language model) of a raw model output."""
    y = data.y_test
    if data.task == "language model":
        labelled = y != IGNORE
        return float((output.argmax(axis=-1)[labelled] == y[labelled]).mean())
    if data.task == "regression":
        p = output.reshape(-1).astype(np.float64)
        return float(1 - ((p - y) ** 2).sum() / ((y - y.mean()) ** 2).sum())
    if output.ndim == 2 and output.shape[1] > 1:
        labels = output.argmax(axis=1)
    else:
        labels = (output.reshape(-1) > (0.5 if case.loss == "log" else 0.0)).astype(int)
    return float((labels == y).mean())


def initial_metric(onx, data: Data, case: Case) -> float:
    """The converted model's held-out metric, its BatchNorm and Dropout layers in
    inference mode (as graphkit predicts with it)."""
    model, prediction = select_prediction(marked_for_training(onx), case.output_index)
    feeds = {model.graph.input[0].name: data.X_test}
    return metric(data, gk.run(model, feeds)[prediction.name], case)


def run_case(case: Case, trainer: str, backend: str) -> Outcome:
    """Train ``case`` with ``trainer`` (``FULL`` or ``FORWARD_BACKWARD``) on ``backend``."""
    onx, data = built(case)
    names = {"regression": "R2", "language model": "token accuracy"}
    outcome = Outcome(case, trainer, backend, "trains", names.get(data.task, "accuracy"))
    try:
        if case.lora:
            onx = lora.add_lora(onx, case.lora, rank=4, alpha=8, random_state=0)
        outcome.before = initial_metric(onx, data, case)
        settings = dict(
            max_iter=case.epochs,
            batch_size=case.batch_size,
            learning_rate=(gk.optimizers.get(case.optimizer), case.lr),
            random_state=0,
            backend=backend,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if trainer == FULL:
                train = gk.add_loss_output(
                    onx, case.loss, output_index=case.output_index, label_name="y"
                )
                model = OrtGradientOptimizer(train, **settings)
            else:
                model = OrtGradientForwardBackwardOptimizer(
                    onx, learning_loss=case.loss, output_index=case.output_index, **settings
                )
            model.fit(data.X_train, data.y_train)
        output = model._predict_outputs(data.X_test)
        outcome.after = metric(data, output, case)
    except gk.GraphkitError as exc:
        outcome.result, outcome.error = "refused", exc
    except Exception as exc:  # a raw error is a defect: the test shows it
        outcome.result, outcome.error = "error", exc
    return outcome


HEADER = [
    "| model | converter | trainer | backend | result | held-out metric: converted -> trained |",
    "|---|---|---|---|---|---|",
]


def render_row(o: Outcome) -> str:
    numbers = f"{o.metric} {o.before:.3f} -> {o.after:.3f}" if o.after is not None else ""
    return "| " + " | ".join([*o.row, numbers]) + " |"


def table_lines(text: str) -> dict[tuple[str, str, str, str], str]:
    """``{(model, converter, trainer, backend): the row's line}`` from the page's table."""
    found = re.search(re.escape(START) + "(.*?)" + re.escape(END), text, re.S)
    if not found:
        return {}
    header, _, *lines = found.group(1).strip().splitlines()
    if "backend" not in [c.strip() for c in header.strip().strip("|").split("|")]:
        return {}  # a table from before the backend column
    rows = {}
    for line in lines:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows[tuple(cells[:4])] = line
    return rows


def table_rows(text: str) -> dict[tuple[str, str, str, str], str]:
    """``{(model, converter, trainer, backend): result}`` from the page's table."""
    return {
        key: [c.strip() for c in line.strip().strip("|").split("|")][4]
        for key, line in table_lines(text).items()
    }


def render(outcomes: list[Outcome], previous: dict[tuple[str, str, str, str], str]) -> str:
    """The table: a row per outcome and, for every other case, trainer and registered
    backend, its ``previous`` line (the page's, kept when it could not run here), in
    the order of :data:`CASES`, trainers, then backends."""
    rows = [
        (c.name, c.exporter, TRAINER_NAMES[t], b)
        for c in CASES
        for t in TRAINER_NAMES
        for b in backends.names()
    ]
    lines = {**previous, **{o.key: render_row(o) for o in outcomes}}
    return "\n".join([*HEADER, *(lines[k] for k in rows if k in lines)])


def write_table(outcomes: list[Outcome]) -> None:
    text = SUPPORT_TABLE_PAGE.read_text()
    table = f"{START}\n{render(outcomes, table_lines(text))}\n{END}"
    pattern = re.escape(START) + ".*?" + re.escape(END)
    if not re.search(pattern, text, re.S):
        raise SystemExit(f"{SUPPORT_TABLE_PAGE} has no {START} ... {END} markers")
    SUPPORT_TABLE_PAGE.write_text(re.sub(pattern, lambda _: table, text, flags=re.S))


def main() -> int:
    outcomes = [
        run_case(case, trainer, backend)
        for case in CASES
        if runnable(case)
        for trainer in (FULL, FORWARD_BACKWARD)
        for backend in INSTALLED
    ]
    for o in outcomes:
        print(" | ".join(o.row), o.before, o.after, o.error or "", file=sys.stderr)
    write_table(outcomes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
