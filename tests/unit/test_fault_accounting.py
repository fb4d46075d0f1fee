"""The fault suite's record accounting (tests/faults/accounting.py): records are counted by (partition, offset),
so a doubled outcome cannot cover a missing one, and a second outcome nothing explains fails the check."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.faults.accounting import Key, account

EVENTS = {"trained": "fragment_trained", "dropped_stale": "fragment_dropped_stale",
          "dead_lettered": "fragment_dead_lettered"}


def _produced(n: int, partition: int = 0) -> dict[Key, dict[str, str]]:
    return {(partition, off): {"sample-id": f"s{partition}-{off}"} for off in range(n)}


def _outcome(kind: str, off: int, partition: int = 0, reason: str | None = None) -> dict[str, Any]:
    e: dict[str, Any] = {"event": EVENTS[kind], "partition": partition, "offset": off,
                         "sample_id": f"s{partition}-{off}"}
    if reason is not None:
        e["reason"] = reason
    return e


def _start(offsets: dict[int, int] | None = None) -> list[dict[str, Any]]:
    run: list[dict[str, Any]] = [{"event": "config_resolved"}]
    if offsets is not None:
        run.append({"event": "checkpoint_restored",
                    "checkpoint_offsets": {f"r.samples:{p}": off for p, off in offsets.items()}})
    return run


def _log(tmp_path: Path, *events: dict[str, Any]) -> Path:
    path = tmp_path / "trainer.log"
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    return path


def test_a_doubled_outcome_covering_a_missing_record_fails(tmp_path: Path) -> None:
    # Three records; record 1 has two outcomes (trained, then dropped as stale in the same run), record 2 none.
    # The group committed only up to 2, so the committed-offset check ("missing") sees nothing wrong, and the
    # old drained check, sum(outcomes) >= produced, read 3 >= 3.
    log = _log(tmp_path, *_start(), _outcome("trained", 0), _outcome("trained", 1), _outcome("dropped_stale", 1))
    acc = account(_produced(3), log, {0: 2})
    assert sum(acc.outcomes.values()) >= acc.produced  # what the old check accepted
    assert acc.missing == [] and acc.problems() == []
    assert acc.accounted == 2
    assert acc.unaccounted == [(0, 2)]
    assert acc.unexplained_outcomes == [(0, 1)]
    found = acc.every_record_once()
    assert len(found) == 2 and found[0].startswith("unaccounted: 1") and found[1].startswith("unexplained_outcomes: 1")


def test_a_record_with_two_outcomes_fails_even_when_none_is_missing(tmp_path: Path) -> None:
    log = _log(tmp_path, *_start(), _outcome("trained", 0), _outcome("dead_lettered", 1, reason="non_finite"),
               _outcome("trained", 1))
    acc = account(_produced(2), log, {0: 2})
    assert acc.unaccounted == [] and acc.accounted == 2
    assert acc.unexplained_outcomes == [(0, 1)]
    assert acc.every_record_once()


def test_every_record_once_passes_with_refused_redeliveries_and_a_restore(tmp_path: Path) -> None:
    log = _log(tmp_path,
               *_start(),
               _outcome("trained", 0), _outcome("trained", 1), _outcome("dead_lettered", 2, reason="non_finite"),
               _outcome("trained", 3),
               # re-delivered in the same run (a commit lost in a rebalance): refused, never trained again
               _outcome("dead_lettered", 1, reason="duplicate"), _outcome("dead_lettered", 2, reason="non_finite"),
               # a crash, then a restart from the checkpoint at offset 3: record 3 is re-processed
               *_start({0: 3}), _outcome("trained", 3), _outcome("dropped_stale", 4))
    acc = account(_produced(5), log, {0: 5})
    assert acc.accounted == 5 and acc.unaccounted == [] and acc.unexplained_outcomes == []
    assert acc.every_record_once() == [] and acc.problems() == []
    assert acc.retrained_after_restore == 1


def test_a_later_run_giving_an_outcome_below_its_restored_offsets_is_unexplained(tmp_path: Path) -> None:
    log = _log(tmp_path, *_start(), _outcome("dropped_stale", 0), _outcome("trained", 1),
               *_start({0: 2}), _outcome("dropped_stale", 0), _outcome("trained", 2))
    acc = account(_produced(3), log, {0: 3})
    assert acc.unexplained_outcomes == [(0, 0)]
    assert acc.every_record_once()
