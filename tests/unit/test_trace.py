"""services/admin/trace.py: one sample's timeline from JSON log lines as the services write them."""

from __future__ import annotations

import io
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from services.admin.trace import (
    events_for,
    log_files,
    log_lines,
    outcome,
    parse_line,
    timeline,
    trace_json,
)
from shared.logging import configure_logging, fragment_fields, get_logger

SID = "5f0c8e2a9d7b4c61a3e2f10b8c9d7e6a"
OTHER = "0123456789abcdef0123456789abcdef"
T0 = 1_800_000_000.0


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")


def line(event: str, t: float, service: str, **kw: Any) -> str:
    """A log line as structlog's JSONRenderer writes it (shared/logging.py)."""
    return json.dumps({"service": service, "run": "cartpole", **kw, "event": event, "level": "info",
                       "timestamp": iso(t)})


def produced(t: float, sid: str = SID, sampler: str = "sampler-0", offset: int = 118) -> str:
    return line("fragment_produced", t, "sampler", sampler_id=sampler, sample_id=sid, policy_version=12,
                steps=64, episodes=1, partition=2, offset=offset)


def trainer(event: str, t: float, sid: str = SID, offset: int = 118, **kw: Any) -> str:
    return line(event, t, "trainer", **kw, **fragment_fields(sid, "sampler-0", 12, 2, offset))


def update_done(t: float, update: int, loss: float) -> str:
    return line("update_done", t, "trainer", update=update, fragments=4, env_steps=256, seconds=0.05,
                policy_loss=loss, value_loss=0.5, entropy=0.69, approx_kl=0.001, clip_fraction=0.0)


def started(t: float, service: str) -> str:
    return line("config_resolved", t, service, config={"run": "cartpole", "trainer": {"batch_fragments": 4}})


def kinds(lines: list[str], sid: str = SID) -> list[str]:
    return [s.kind for s in timeline(events_for(sid, lines))]


def test_trained_in_update_n_with_its_update_done_among_other_samples() -> None:
    lines = [
        started(T0, "sampler"), started(T0, "trainer"),
        produced(T0 + 1.0, OTHER, offset=117), produced(T0 + 1.1),
        trainer("fragment_consumed", T0 + 1.2, OTHER, offset=117), trainer("fragment_consumed", T0 + 1.3),
        update_done(T0 + 1.35, 4, -0.4),
        trainer("fragment_trained", T0 + 1.5, OTHER, offset=117, outcome="trained", update=5, staleness=0),
        trainer("fragment_trained", T0 + 1.5, outcome="trained", update=5, staleness=1),
        update_done(T0 + 1.55, 5, -0.0123),
        update_done(T0 + 2.0, 6, -0.9),
        "not json at all", "{broken json", "[1, 2]",
    ]
    steps = timeline(events_for(SID, lines))
    assert [s.kind for s in steps] == ["produced", "consumed", "trained"]
    assert [s.at for s in steps] == [T0 + 1.1, T0 + 1.3, T0 + 1.5]
    p, c, t = steps
    assert p.fields["sampler_id"] == "sampler-0" and p.fields["partition"] == 2 and p.fields["offset"] == 118
    assert "produced by sampler-0 with policy v12, partition 2, offset 118" in p.to_dict()["summary"]
    assert c.service == "trainer" and c.fields["offset"] == 118
    assert t.fields["update"] == 5 and t.fields["staleness"] == 1
    assert t.update is not None and t.update["policy_loss"] == -0.0123  # update 5's line, not 4's or 6's
    assert "trained in update 5, staleness 1 (" in t.to_dict()["summary"]
    assert outcome(steps) == "trained"


def test_produced_comes_first_even_when_the_ack_is_logged_after_the_trainer_consumed_it() -> None:
    lines = [trainer("fragment_consumed", T0 + 1.0), produced(T0 + 1.02),
             trainer("fragment_trained", T0 + 1.5, update=1, staleness=0)]
    assert kinds(lines) == ["produced", "consumed", "trained"]


def test_a_trainer_restart_between_two_consumptions_is_marked() -> None:
    lines = [
        started(T0, "trainer"),
        trainer("fragment_consumed", T0 + 1.0),
        update_done(T0 + 1.2, 5, -0.7),  # run 1's update 5 (the sample was not in it)
        started(T0 + 10.0, "trainer"),  # crashed before training it; resumed from a checkpoint at update 4
        trainer("fragment_consumed", T0 + 11.0),
        trainer("fragment_trained", T0 + 11.5, update=5, staleness=2),
        update_done(T0 + 11.6, 5, -0.1),
        started(T0 + 20.0, "trainer"),  # a later restart: nothing to do with this sample
        produced(T0 + 0.5),
    ]
    steps = timeline(events_for(SID, lines))
    assert [s.kind for s in steps] == ["produced", "consumed", "restart", "consumed", "trained"]
    assert [s.run for s in steps[1:]] == [1, 2, 2, 2]
    assert steps[2].at == T0 + 10.0 and steps[2].to_dict()["summary"] == "trainer restarted (run 2)"
    assert steps[4].update is not None and steps[4].update["policy_loss"] == -0.1


def test_trained_in_both_runs_when_the_first_was_never_checkpointed() -> None:
    lines = [started(T0, "trainer"), trainer("fragment_consumed", T0 + 1), trainer("fragment_trained", T0 + 2,
             update=3, staleness=0), started(T0 + 5, "trainer"), trainer("fragment_consumed", T0 + 6),
             trainer("fragment_trained", T0 + 7, update=3, staleness=1)]
    steps = timeline(events_for(SID, lines))
    assert [s.kind for s in steps] == ["consumed", "trained", "restart", "consumed", "trained"]
    assert [s.run for s in steps if s.kind == "trained"] == [1, 2]


def test_dropped_as_stale() -> None:
    lines = [produced(T0), trainer("fragment_consumed", T0 + 1),
             trainer("fragment_dropped_stale", T0 + 2, outcome="dropped_stale", staleness=9, max_staleness=8,
                     reference_version=21)]
    steps = timeline(events_for(SID, lines))
    assert [s.kind for s in steps] == ["produced", "consumed", "dropped_stale"]
    assert steps[-1].fields["reference_version"] == 21
    assert steps[-1].to_dict()["summary"] == "dropped as stale: staleness 9, max_staleness 8, reference_version 21"
    assert outcome(steps) == "dropped_stale"


def test_dead_lettered_with_reason_and_error() -> None:
    lines = [produced(T0), line("fragment_dead_lettered", T0 + 1, "trainer", outcome="dead_lettered",
                                reason="duplicate", error="offset 118 of partition 2 seen before", sample_id=SID,
                                sampler_id="sampler-0", policy_version="12", partition=2, offset=119)]
    steps = timeline(events_for(SID, lines))
    assert [s.kind for s in steps] == ["produced", "dead_lettered"]
    assert steps[-1].to_dict()["summary"] == "dead-lettered: duplicate (offset 118 of partition 2 seen before)"
    assert outcome(steps) == "dead_lettered"


def test_other_lines_with_the_id_are_kept_by_event_name() -> None:
    lines = [line("fragment_send_failed", T0, "sampler", sample_id=SID, error="KafkaTimeoutError")]
    steps = timeline(events_for(SID, lines))
    assert [s.kind for s in steps] == ["fragment_send_failed"] and "KafkaTimeoutError" in steps[0].to_dict()["summary"]
    assert outcome(steps) is None


def test_not_found() -> None:
    lines = [produced(T0, OTHER), trainer("fragment_trained", T0 + 1, OTHER, update=1, staleness=0)]
    assert events_for(SID, lines) == []
    assert trace_json(SID, lines) == {"sample_id": SID, "found": False, "outcome": None, "steps": []}


def test_docker_compose_prefixes_name_the_process() -> None:
    raw = [
        "sampler-1  | " + started(T0, "sampler"),
        "sampler-2  | " + started(T0, "sampler"),
        "trainer-1  | " + started(T0, "trainer"),
        "\x1b[36msampler-2  |\x1b[0m " + produced(T0 + 1, sampler="sampler-2"),
        "sampler-1  | " + started(T0 + 1.5, "sampler"),  # another sampler's restart: no boundary here
        "trainer-1  | " + trainer("fragment_consumed", T0 + 2),
        "trainer-1  | Traceback (most recent call last):",
        "trainer-1  | " + trainer("fragment_trained", T0 + 3, update=1, staleness=0),
        "sampler-2  | " + started(T0 + 4, "sampler"),  # after the sample: no boundary either
    ]
    steps = timeline(events_for(SID, raw))
    assert [(s.kind, s.who) for s in steps] == [("produced", "sampler-2"), ("consumed", "trainer-1"),
                                                ("trained", "trainer-1")]
    assert parse_line("trainer-1  | 2026-01-01T00:00:00Z {\"a\": 1}") == ("trainer-1", {"a": 1})
    assert parse_line('{"a": 1}') == ("", {"a": 1})
    assert parse_line("kafka | [2026-01-01] INFO {broken") is None


def test_lines_from_the_real_logging_setup() -> None:
    buf = io.StringIO()
    configure_logging("trainer", "cartpole", stream=buf)
    log = get_logger()
    log.info("config_resolved", config={"run": "cartpole"})
    log.info("fragment_consumed", **fragment_fields(SID, "sampler-0", 3, 1, 40))
    log.info("fragment_trained", outcome="trained", update=1, staleness=0,
             **fragment_fields(SID, "sampler-0", 3, 1, 40))
    log.info("update_done", update=1, fragments=1, env_steps=64, policy_loss=-0.01)
    result = trace_json(SID, buf.getvalue().splitlines())
    json.dumps(result)  # serialisable as it is (GET /trace/{sample_id})
    assert result["found"] and result["outcome"] == "trained"
    assert [s["kind"] for s in result["steps"]] == ["consumed", "trained"]
    assert result["steps"][0]["at"] is not None and result["steps"][0]["service"] == "trainer"
    assert result["steps"][1]["update"]["policy_loss"] == -0.01


def _write(path: Path, lines: list[str]) -> None:
    path.write_text("".join(x + "\n" for x in lines))


def test_log_files_oldest_first_and_restarts_across_rotation(tmp_path: Path) -> None:
    _write(tmp_path / "trainer.log.2", [started(T0, "trainer"), trainer("fragment_consumed", T0 + 1)])
    _write(tmp_path / "trainer.log.1", [update_done(T0 + 2, 1, -0.5), started(T0 + 10, "trainer")])
    _write(tmp_path / "trainer.log", [trainer("fragment_consumed", T0 + 11),
                                      trainer("fragment_trained", T0 + 12, update=2, staleness=0)])
    _write(tmp_path / "sampler-0.log", ["===== devstack: starting sampler-0", started(T0, "sampler"),
                                        produced(T0 + 0.5)])
    _write(tmp_path / "sampler-1.log", [started(T0, "sampler"), started(T0 + 0.7, "sampler")])
    _write(tmp_path / "kafka.log", ["[2026] INFO Kafka started " + SID])
    _write(tmp_path / "trainer.out", [trainer("fragment_trained", T0 + 99, update=9, staleness=0)])  # not a log
    _write(tmp_path / "trainer.log.bak", [trainer("fragment_trained", T0 + 98, update=9, staleness=0)])
    assert [p.name for p in log_files(tmp_path)] == ["kafka.log", "sampler-0.log", "sampler-1.log",
                                                     "trainer.log.2", "trainer.log.1", "trainer.log"]
    assert [p.name for p in log_files(tmp_path, "trainer")] == ["trainer.log.2", "trainer.log.1", "trainer.log"]
    assert [p.name for p in log_files(tmp_path, "sampler-0")] == ["sampler-0.log"]
    assert log_files(tmp_path, "sampler") == []  # a name, not a prefix
    assert next(log_lines(tmp_path)).startswith("kafka | ")
    steps = timeline(events_for(SID, log_lines(tmp_path)))
    assert [(s.kind, s.who, s.run) for s in steps] == [
        ("produced", "sampler-0", 1), ("consumed", "trainer", 1), ("restart", "trainer", 2),
        ("consumed", "trainer", 2), ("trained", "trainer", 2)]
    assert log_files(tmp_path / "missing") == []
