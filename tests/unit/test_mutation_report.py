"""docs/reliability.md keeps the mutation-testing summary although the fault suite rewrites it (tests/faults/report.py
embeds it from docs/reliability-mutation.md; tools/mutation/run.py refreshes the same section in place)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

from tests.faults import report

REPO = Path(__file__).resolve().parents[2]

MUTATION_MD = """# Mutation testing of the trust core

<!-- summary -->
| target | mutants |
|---|---|
| digest | 447 |
<!-- /summary -->

## Survivors
"""


def test_the_fault_report_embeds_the_mutation_summary(tmp_path: Path, monkeypatch: Any) -> None:
    md = tmp_path / "reliability-mutation.md"
    md.write_text(MUTATION_MD)
    monkeypatch.setattr(report, "MUTATION_REPORT", md)
    out = report.write_reliability([], seed=1, path=tmp_path / "reliability.md")
    text = out.read_text()
    assert report.MUTATION_BEGIN in text and "| digest | 447 |" in text
    assert "## Survivors" not in text  # only the summary; the survivors stay in their own file
    assert text.index("## What Flywheel guarantees") < text.index(report.MUTATION_BEGIN)
    # The network suite's and the soak's pointers are written by the fault suite too (a rewrite keeps them).
    assert "[reliability-network.md](reliability-network.md)" in text and "make test-soak" in text
    assert text.index("## Across a network") < text.index(report.MUTATION_BEGIN)


def test_without_a_mutation_report_it_says_how_to_make_one(tmp_path: Path) -> None:
    lines = report.mutation_section(tmp_path / "absent.md")
    assert lines[-1] == "Not run yet: `make test-mutation` writes `docs/reliability-mutation.md`."


def test_run_py_replaces_the_section_in_place(tmp_path: Path, monkeypatch: Any) -> None:
    spec = importlib.util.spec_from_file_location("mutation_run", REPO / "tools" / "mutation" / "run.py")
    assert spec is not None and spec.loader is not None
    run = importlib.util.module_from_spec(spec)
    sys.modules["mutation_run"] = run
    spec.loader.exec_module(run)
    md = tmp_path / "reliability-mutation.md"
    md.write_text(MUTATION_MD)
    monkeypatch.setattr(report, "MUTATION_REPORT", md)
    rel = tmp_path / "reliability.md"
    rel.write_text("# Reliability\n\nrows\n")
    monkeypatch.setattr(run, "RELIABILITY", rel)
    run.update_reliability()
    run.update_reliability()
    text = rel.read_text()
    assert text.startswith("# Reliability\n\nrows\n\n" + report.MUTATION_BEGIN)
    assert text.count(report.MUTATION_BEGIN) == 1 and "| digest | 447 |" in text
