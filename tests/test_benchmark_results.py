"""The benchmarks' results convention (benchmarks/README.md): every result file is
``benchmarks/results/<script>.md`` and opens with the header ``benchmarks/report.py``
writes. Nothing is run or timed: the files and the header function are read."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
RESULTS = sorted((BENCHMARKS / "results").glob("*.md"))
FIELDS = ("command", "date", "machine", "versions")


def header_fields(text: str) -> list[str]:
    """The bold field names of the header's list, which follows the title."""
    lines = text.splitlines()
    assert lines[0].startswith("# ") and lines[1] == "", lines[:2]
    fields = []
    for line in lines[2:]:
        if line.startswith("  ") and fields:  # a field's wrapped line
            continue
        found = re.match(r"- \*\*(\w+)\*\*: \S", line)
        if not found:
            break
        fields.append(found[1])
    return fields


def test_every_script_has_a_results_file_and_no_result_lies_elsewhere():
    scripts = {
        "run",
        "peers",
        "forward_backward",
        "distributed",
        "gradient_sources",
        "web",
        "finetune",
        "lora",
    }
    names = {p.stem.split("-")[0] for p in RESULTS}
    assert names == scripts
    # beside the README, the profiles behind the results (issue 42's recurrent and CNN rows)
    assert sorted(p.name for p in BENCHMARKS.glob("*.md")) == ["PROFILE.md", "README.md"]


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_each_result_opens_with_the_header(path):
    text = path.read_text()
    assert header_fields(text) == list(FIELDS), path
    assert re.search(r"^- \*\*date\*\*: \d{4}-\d{2}-\d{2}$", text, re.M)
    assert re.search(r"^- \*\*command\*\*: `python benchmarks/\w+\.py", text, re.M)
    assert "us/batch" not in text and "time / " not in text  # µs / batch, x <reference>


def test_the_scripts_header_is_the_convention(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setattr(sys, "argv", [str(BENCHMARKS / "run.py"), "--quick"])
    import report

    lines = report.header("A title")
    assert header_fields("\n".join(lines)) == list(FIELDS)
    assert lines[2] == "- **command**: `python benchmarks/run.py --quick`"
    assert report.default_output(str(BENCHMARKS / "peers.py"), "cuda") == (
        BENCHMARKS / "results" / "peers-cuda.md"
    )
