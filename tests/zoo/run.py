"""Train (or see refused) one zoo case with one trainer, and render the support table.

``python -m tests.zoo.run`` trains every case and rewrites the README's support table
(between the ``zoo:start`` / ``zoo:end`` markers); ``make zoo-table`` runs it.
"""

from __future__ import annotations

import functools
import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import graphkit as gk
from graphkit.rewrite import select_prediction
from graphkit_train import OrtGradientForwardBackwardOptimizer, OrtGradientOptimizer

from .models import CASES, FORWARD_BACKWARD, FULL, Case, Data

README = Path(__file__).resolve().parents[2] / "README.md"
START, END = "<!-- zoo:start -->", "<!-- zoo:end -->"
TRAINER_NAMES = {FULL: "full", FORWARD_BACKWARD: "forward/backward"}


@dataclass
class Outcome:
    case: Case
    trainer: str
    result: str  # "trains" | "refused" | "error"
    metric: str  # "R2" | "accuracy"
    before: float | None = None
    after: float | None = None
    error: BaseException | None = None

    @property
    def row(self) -> tuple[str, str, str, str]:
        result = self.result
        if self.result == "refused":
            op = self.case.refusal(self.trainer) or "?"
            result = f"refused: {type(self.error).__name__} names {op}"
        return self.case.name, self.case.exporter, TRAINER_NAMES[self.trainer], result


@functools.cache
def built(case: Case):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return case.build()


def metric(data: Data, output: np.ndarray, case: Case) -> float:
    """Held-out R^2 (regression) or accuracy (classification) of a raw model output."""
    y = data.y_test
    if data.task == "regression":
        p = output.reshape(-1).astype(np.float64)
        return float(1 - ((p - y) ** 2).sum() / ((y - y.mean()) ** 2).sum())
    if output.ndim == 2 and output.shape[1] > 1:
        labels = output.argmax(axis=1)
    else:
        labels = (output.reshape(-1) > (0.5 if case.loss == "log" else 0.0)).astype(int)
    return float((labels == y).mean())


def initial_metric(onx, data: Data, case: Case) -> float:
    model, prediction = select_prediction(onx, case.output_index)
    feeds = {model.graph.input[0].name: data.X_test}
    return metric(data, gk.run(model, feeds)[prediction.name], case)


def run_case(case: Case, trainer: str) -> Outcome:
    """Train ``case`` with ``trainer`` (``FULL`` or ``FORWARD_BACKWARD``)."""
    onx, data = built(case)
    name = "R2" if data.task == "regression" else "accuracy"
    outcome = Outcome(case, trainer, "trains", name)
    try:
        outcome.before = initial_metric(onx, data, case)
        settings = dict(
            max_iter=case.epochs,
            batch_size=case.batch_size,
            learning_rate=(gk.optimizers.get(case.optimizer), case.lr),
            random_state=0,
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


def render(outcomes: list[Outcome]) -> str:
    lines = [
        "| model | converter | trainer | result | held-out metric: converted -> trained |",
        "|---|---|---|---|---|",
    ]
    for o in outcomes:
        model, exporter, trainer, result = o.row
        if o.after is not None:
            numbers = f"{o.metric} {o.before:.3f} -> {o.after:.3f}"
        else:
            numbers = ""
        lines.append(f"| {model} | {exporter} | {trainer} | {result} | {numbers} |")
    return "\n".join(lines)


def readme_rows(text: str) -> dict[tuple[str, str, str], str]:
    """``{(model, converter, trainer): result}`` from the README's table."""
    found = re.search(re.escape(START) + "(.*?)" + re.escape(END), text, re.S)
    if not found:
        return {}
    rows = {}
    for line in found.group(1).strip().splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows[tuple(cells[:3])] = cells[3]
    return rows


def write_readme(outcomes: list[Outcome]) -> None:
    text = README.read_text()
    table = f"{START}\n{render(outcomes)}\n{END}"
    pattern = re.escape(START) + ".*?" + re.escape(END)
    if not re.search(pattern, text, re.S):
        raise SystemExit(f"{README} has no {START} ... {END} markers")
    README.write_text(re.sub(pattern, lambda _: table, text, flags=re.S))


def main() -> int:
    outcomes = [run_case(case, trainer) for case in CASES for trainer in (FULL, FORWARD_BACKWARD)]
    for o in outcomes:
        print(" | ".join(o.row), o.before, o.after, o.error or "", file=sys.stderr)
    write_readme(outcomes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
