"""The partition suite's alert watch (tests/hosts/alerts.py), its pure parts: Prometheus's times, an alert's short
name with part names for addresses, and the row's summary (this row's alerts apart from those active before the
cut, pending only with the ``for:`` they did not reach); and devstack's Prometheus configuration for the
multi-host stack (``address:port`` targets, not 127.0.0.1)."""

from __future__ import annotations

from pathlib import Path

import yaml

from devstack import hosts as mh
from devstack import prometheus as prom
from tests.hosts.alerts import AlertWatch, alert_key, parse_time


def test_parse_time_reads_prometheus_nanoseconds() -> None:
    assert parse_time("2026-12-03T23:40:01.5Z") == 1796341201.5
    assert parse_time("2026-12-03T23:40:01.123456789Z") == 1796341201.123456789
    assert parse_time("2026-12-03T23:40:01Z") == 1796341201.0
    assert parse_time("garbage") is None


def test_alert_key_names_the_part_behind_an_address() -> None:
    down = {"labels": {"alertname": "FlywheelServiceDown", "job": "flywheel-trainer", "severity": "critical",
                       "instance": f"{mh.address('trainer-1')}:8171"}}
    assert alert_key(down) == "FlywheelServiceDown{trainer-1}"
    degraded = {"labels": {"alertname": "FlywheelServiceDegraded", "service": "paramsync", "severity": "warning",
                           "instance": f"{mh.address('paramsync')}:8102", "job": "flywheel-paramsync"}}
    assert alert_key(degraded) == "FlywheelServiceDegraded{paramsync,paramsync}"
    assert alert_key({"labels": {"alertname": "FlywheelKafkaUnderReplicated", "topic": "r.samples"}}) == \
        "FlywheelKafkaUnderReplicated{r.samples}"
    assert alert_key({"labels": {"alertname": "FlywheelConsumptionStalled", "severity": "critical"}}) == \
        "FlywheelConsumptionStalled"


def _alert(name: str, state: str, active: str, **labels: str) -> dict[str, object]:
    return {"labels": {"alertname": name, **labels}, "state": state, "activeAt": active}


def test_summary_separates_this_rows_alerts_and_says_what_for_was_not_reached() -> None:
    w = AlertWatch(base="http://127.0.0.1:1")  # nothing answers there: polls are fed by hand below
    w.cut_at = parse_time("2026-12-03T23:40:00Z") or 0.0
    w._durations = {"FlywheelKafkaUnderReplicated": 300.0, "FlywheelServiceDown": 60.0}
    answers = [
        [_alert("FlywheelPolicyNotAdvancing", "pending", "2026-12-03T23:35:00Z")],  # from an earlier row
        [_alert("FlywheelPolicyNotAdvancing", "pending", "2026-12-03T23:35:00Z"),
         _alert("FlywheelKafkaUnderReplicated", "pending", "2026-12-03T23:40:12.4Z", topic="r.samples")],
        [_alert("FlywheelKafkaUnderReplicated", "pending", "2026-12-03T23:40:12.4Z", topic="r.samples"),
         _alert("FlywheelKafkaUnderReplicated", "pending", "2026-12-03T23:40:12.4Z", topic="r.policy"),
         _alert("FlywheelServiceDown", "firing", "2026-12-03T23:40:20Z", instance=f"{mh.address('admin')}:8080")],
    ]
    import tests.hosts.alerts as alerts

    real = alerts.prom_get
    try:
        for i, a in enumerate(answers):
            alerts.prom_get = lambda path, base="", timeout_s=5.0, a=a: {"alerts": a}  # type: ignore[misc]
            w._poll(first=i == 0)
    finally:
        alerts.prom_get = real
    w.healed_s, w.stopped_s = 40.0, 70.0
    assert [s.key for s in w.new()] == ["FlywheelKafkaUnderReplicated{r.policy}",
                                        "FlywheelKafkaUnderReplicated{r.samples}", "FlywheelServiceDown{admin}"]
    assert w.pending("FlywheelKafkaUnderReplicated") and not w.fired("FlywheelKafkaUnderReplicated")
    assert w.fired("FlywheelServiceDown")
    text = w.summary()
    assert text.startswith("firing: FlywheelServiceDown{admin} at ")
    assert "pending only: FlywheelKafkaUnderReplicated{r.policy; r.samples} from 12 s (for: 5m, not reached)" in text
    assert "already active at the cut: FlywheelPolicyNotAdvancing" in text
    assert text.endswith("(polled 0-70 s from the cut (heal at 40 s))")


def test_summary_when_nothing_happened_or_prometheus_is_away() -> None:
    w = AlertWatch(base="http://127.0.0.1:1")
    w.healed_s, w.stopped_s, w.polls = 30.0, 50.0, 3
    assert w.summary().startswith("none pending or firing (polled 0-50 s")
    w.failed_polls = 3
    assert w.summary().startswith("Prometheus did not answer")


def test_prometheus_scrapes_the_multihost_parts_at_their_addresses(tmp_path: Path) -> None:
    targets: dict[str, list[int | str]] = {
        "trainer": [f"{mh.address('trainer')}:8101"], "trainer-ranks": [f"{mh.address('trainer-1')}:8171"],
        "paramsync": [f"{mh.address('paramsync')}:8102"], "admin": [f"{mh.address('admin')}:8080"],
        "sampler": [f"{mh.address('sampler-0')}:8110", f"{mh.address('sampler-1')}:8111"]}
    cfg = yaml.safe_load(prom.write_config(tmp_path, targets, 9090).read_text())
    got = {j["job_name"]: [t for sc in j["static_configs"] for t in sc["targets"]] for j in cfg["scrape_configs"]}
    assert got["prometheus"] == ["127.0.0.1:9090"]
    assert {k.removeprefix("flywheel-"): v for k, v in got.items() if k.startswith("flywheel-")} == targets
    assert all(Path(r).is_absolute() and Path(r).is_file() for r in cfg["rule_files"])
