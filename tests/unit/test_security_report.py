"""The red-team sections of docs/security.md (tests/security/report.py): each suite rewrites only its own section,
and the compose suite's goes right after the local stack's the first time."""

from __future__ import annotations

from pathlib import Path

from tests.security import report
from tests.security.report import AttackRow


def _page(tmp_path: Path) -> Path:
    page = tmp_path / "security.md"
    page.write_text("# Security\n\nby hand\n\n" + "\n".join(report.section([AttackRow("old", "ok")], 1, None))
                    + "\n\n## After, by hand\n")
    return page


def test_the_compose_section_goes_after_the_local_one_and_each_replaces_only_its_own(tmp_path: Path) -> None:
    page = _page(tmp_path)
    report.write_compose([AttackRow("key read | from the sampler", "ok", "not there")], page, minutes=2.0)
    text = page.read_text()
    assert text.index(report.END) < text.index(report.COMPOSE_BEGIN) < text.index("## After, by hand")
    assert "| key read / from the sampler | ok | not there | - | - | - |  |" in text  # a | in a cell is escaped
    assert "the suite took 2.0 min." in text

    report.write_security([AttackRow("new", "ok")], 2, page)
    text = page.read_text()
    assert "| old |" not in text and "| new | ok |" in text and "key read / from the sampler" in text
    report.write_compose([AttackRow("again", "FAILED")], page)
    text = page.read_text()
    assert text.count(report.COMPOSE_BEGIN) == 1 and "key read" not in text and "| again | FAILED |" in text
    assert text.startswith("# Security\n\nby hand\n") and text.rstrip().endswith("## After, by hand")


def test_a_page_without_markers_gets_the_section_at_its_end(tmp_path: Path) -> None:
    page = tmp_path / "security.md"
    page.write_text("# Security\n")
    report.write_compose([AttackRow("a", "ok")], page)
    assert page.read_text().startswith("# Security\n\n" + report.COMPOSE_BEGIN)
    assert page.read_text().endswith(report.COMPOSE_END + "\n")
