"""The fault suite's log reader: a service's log and its rotated copies, oldest first (pure file logic)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.faults.accounting import read_events, split_runs


def _write(path: Path, *lines: str) -> None:
    path.write_text("".join(line + "\n" for line in lines))


def _ev(event: str, n: int) -> str:
    return json.dumps({"event": event, "n": n})


def test_read_events_joins_rotated_copies_oldest_first_and_skips_other_lines(tmp_path: Path) -> None:
    _write(tmp_path / "trainer.log.2", _ev("config_resolved", 1), _ev("fragment_trained", 2))
    _write(tmp_path / "trainer.log.1", "Traceback (most recent call last):", '  x = {"n": 0}', _ev("x", 3))
    _write(tmp_path / "trainer.log", _ev("config_resolved", 4), "{not json", _ev("fragment_trained", 5))
    _write(tmp_path / "trainer.log.bak", _ev("stray", 98))  # not a rotated copy
    _write(tmp_path / "trainer-2.log", _ev("stray", 99))  # another log
    events = read_events(tmp_path / "trainer.log")
    assert [e["n"] for e in events] == [1, 2, 3, 4, 5]
    assert [[e["n"] for e in run] for run in split_runs(events)] == [[1, 2, 3], [4, 5]]
    assert read_events(tmp_path / "paramsync.log") == []
