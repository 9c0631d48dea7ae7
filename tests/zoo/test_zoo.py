"""The zoo: every model trains to a sane held-out metric or is refused with a graphkit
error naming the operator, with both trainers on every installed backend; the support
table of the documentation's model zoo page (docs/zoo.md) says the same."""

from __future__ import annotations

import pytest

from .models import CASES, FORWARD_BACKWARD, FULL
from .run import INSTALLED, SUPPORT_TABLE_PAGE, Outcome, run_case, runnable, table_rows

OUTCOMES: dict[tuple[str, str, str, str], Outcome] = {}
RUNS = [
    pytest.param(case, trainer, backend, id=f"{case.id}-{trainer}-{backend}")
    for case in CASES
    for trainer in (FULL, FORWARD_BACKWARD)
    for backend in INSTALLED
]


@pytest.mark.parametrize("case,trainer,backend", RUNS)
def test_model_trains_or_is_refused_clearly(case, trainer, backend):
    if not runnable(case):
        pytest.skip("torch is not installed")
    outcome = run_case(case, trainer, backend)
    OUTCOMES[outcome.key] = outcome
    operator = case.refusal(trainer, backend)
    if operator is not None:
        assert outcome.result == "refused", (outcome.result, outcome.error)
        assert operator in str(outcome.error)
        return
    assert outcome.result == "trains", repr(outcome.error)
    assert outcome.after >= case.threshold, (outcome.before, outcome.after)


def test_support_table_is_generated_from_the_zoo():
    """``make zoo-table`` regenerates the table; this keeps it true."""
    if not OUTCOMES:
        pytest.skip("run with the zoo tests")
    table = table_rows(SUPPORT_TABLE_PAGE.read_text())
    for key, outcome in OUTCOMES.items():
        assert table.get(key) == outcome.row[4], (key, "run `make zoo-table`")
