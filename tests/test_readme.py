"""The README's promises: its quickstart runs as written, its commands exist. (The
documentation's pages, the optimizer examples among them, are tests/test_docs.py's.)"""

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


def test_readme_links_resolve():
    """The landing page's links into docs/ (and to the repository's files) name files
    that exist, anchors included where the target is a docs page."""
    links = re.findall(r"\]\(([^)\s]+)\)", README)
    local = [link for link in links if "://" not in link]
    assert any(link.startswith("docs/") for link in local)
    for link in local:
        path, _, anchor = link.partition("#")
        target = ROOT / path
        assert target.exists(), link
        if anchor:
            headings = re.findall(r"^#+ (.+)$", target.read_text(), flags=re.M)
            slugs = {re.sub(r"[^\w\- ]", "", h.lower()).strip().replace(" ", "-") for h in headings}
            assert anchor in slugs, (link, sorted(slugs))
