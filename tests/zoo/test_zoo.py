"""The zoo: every model trains to a sane held-out metric or is refused with a graphkit
error naming the operator; the README's support table says the same."""

from __future__ import annotations

import pytest

from .models import CASES, FORWARD_BACKWARD, FULL
from .run import README, Outcome, readme_rows, run_case

OUTCOMES: dict[tuple[str, str, str], Outcome] = {}
PAIRS = [(case, trainer) for case in CASES for trainer in (FULL, FORWARD_BACKWARD)]


@pytest.mark.parametrize("case,trainer", PAIRS, ids=[f"{c.id}-{t}" for c, t in PAIRS])
def test_model_trains_or_is_refused_clearly(case, trainer):
    outcome = run_case(case, trainer)
    OUTCOMES[outcome.row[:3]] = outcome
    operator = case.refusal(trainer)
    if operator is not None:
        assert outcome.result == "refused", (outcome.result, outcome.error)
        assert operator in str(outcome.error)
        return
    assert outcome.result == "trains", repr(outcome.error)
    assert outcome.after >= case.threshold, (outcome.before, outcome.after)


def test_readme_support_table_is_generated_from_the_zoo():
    """``make zoo-table`` regenerates the table; this keeps it true."""
    if not OUTCOMES:
        pytest.skip("run with the zoo tests")
    table = readme_rows(README.read_text())
    for key, outcome in OUTCOMES.items():
        assert table.get(key) == outcome.row[3], (key, "run `make zoo-table`")
