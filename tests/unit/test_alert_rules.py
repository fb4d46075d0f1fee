"""The Prometheus alert rules and scrape configs: promtool checks, rule unit tests, coverage.

promtool comes from Debian's `prometheus` package (`.ci/run` installs it). Without it these
tests fail, unless FLYWHEEL_SKIP_PROMTOOL=1 says to skip them on purpose.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
PROM_DIR = REPO / "deploy" / "prometheus"
ALERTS = PROM_DIR / "alerts.yml"
ALERTS_TEST = PROM_DIR / "alerts_test.yml"
CONFIGS = [PROM_DIR / "prometheus.yml", PROM_DIR / "prometheus.local.yml"]
RUNBOOK = REPO / "docs" / "alerts.md"

# The alerts the design requires, at least.
REQUIRED_ALERTS = {
    "FlywheelServiceDown",
    "FlywheelSampleBacklogHigh",
    "FlywheelConsumptionStalled",
    "FlywheelPolicySyncLatencyHigh",
    "FlywheelDeadLetters",
    "FlywheelStalenessHigh",
    "FlywheelPolicyNotAdvancing",
    "FlywheelNoLiveSamplers",
}
SEVERITIES = {"critical", "warning"}


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        if os.environ.get("FLYWHEEL_SKIP_PROMTOOL") == "1":
            pytest.skip("promtool not installed and FLYWHEEL_SKIP_PROMTOOL=1")
        pytest.fail(
            "promtool not found on PATH: install Debian's `prometheus` package "
            "(`apt-get install -y prometheus`; .ci/run installs it), "
            "or set FLYWHEEL_SKIP_PROMTOOL=1 to skip these checks deliberately"
        )
    return path


def _run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120, check=False)


def _explain(proc: subprocess.CompletedProcess[str]) -> str:
    cmd = " ".join(proc.args)
    return f"`{cmd}` exited {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"


def _load(path: Path) -> dict:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict), f"{path} must hold a mapping"
    return data


def _alert_rules() -> list[dict]:
    groups = _load(ALERTS)["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


# ---- promtool ---------------------------------------------------------------------------------


def test_promtool_check_rules(promtool: str) -> None:
    proc = _run([promtool, "check", "rules", str(ALERTS.relative_to(REPO))])
    assert proc.returncode == 0, _explain(proc)
    n_rules = sum(len(g["rules"]) for g in _load(ALERTS)["groups"])
    assert f"{n_rules} rules found" in proc.stdout + proc.stderr, _explain(proc)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_promtool_check_config(promtool: str, config: Path) -> None:
    # Run from the repo root: promtool resolves rule_files relative to the config file.
    proc = _run([promtool, "check", "config", str(config.relative_to(REPO))])
    assert proc.returncode == 0, _explain(proc)
    # The rules really are loaded (an empty rule_files list would also "pass").
    assert "1 rule files found" in proc.stdout + proc.stderr, _explain(proc)


def test_promtool_rule_unit_tests(promtool: str) -> None:
    proc = _run([promtool, "test", "rules", str(ALERTS_TEST.relative_to(REPO))])
    assert proc.returncode == 0, _explain(proc)
    assert "SUCCESS" in proc.stdout + proc.stderr, _explain(proc)


# ---- structure (no promtool needed) -----------------------------------------------------------


def test_required_alerts_exist_in_group_flywheel() -> None:
    groups = _load(ALERTS)["groups"]
    assert [g["name"] for g in groups] == ["flywheel"]
    names = [r["alert"] for r in _alert_rules()]
    assert len(names) == len(set(names)), f"duplicate alert names: {names}"
    missing = REQUIRED_ALERTS - set(names)
    assert not missing, f"alerts.yml lacks {sorted(missing)}"


@pytest.mark.parametrize("rule", _alert_rules(), ids=lambda r: r["alert"])
def test_alert_has_for_severity_and_annotations(rule: dict) -> None:
    name = rule["alert"]
    assert "for" in rule and re.fullmatch(r"\d+[smh]", str(rule["for"])), f"{name}: needs a `for:` duration"
    assert rule.get("labels", {}).get("severity") in SEVERITIES, (
        f"{name}: severity must be one of {SEVERITIES}"
    )
    ann = rule.get("annotations", {})
    for key in ("summary", "description", "runbook"):
        assert str(ann.get(key, "")).strip(), f"{name}: missing annotation {key!r}"
    assert ann["runbook"] == f"docs/alerts.md#{name.lower()}", (
        f"{name}: runbook must point at its docs section"
    )


def test_every_alert_has_a_runbook_section() -> None:
    headings = {m.group(1) for m in re.finditer(r"^##\s+(\w+)\s*$", RUNBOOK.read_text(), flags=re.M)}
    missing = {r["alert"] for r in _alert_rules()} - headings
    assert not missing, f"docs/alerts.md has no `## <AlertName>` section for {sorted(missing)}"


def test_every_alert_has_firing_and_non_firing_unit_tests() -> None:
    spec = _load(ALERTS_TEST)
    assert spec.get("rule_files") == ["alerts.yml"], "alerts_test.yml must test alerts.yml"
    alerts = {r["alert"] for r in _alert_rules()}
    firing: set[str] = set()
    silent: set[str] = set()
    tested: set[str] = set()
    for test in spec["tests"]:
        for case in test.get("alert_rule_test", []):
            name = case["alertname"]
            tested.add(name)
            (firing if case.get("exp_alerts") else silent).add(name)
    # An unknown alertname never fires, so a typo would make a vacuous "does not fire" case.
    unknown = tested - alerts
    assert not unknown, f"alerts_test.yml tests alerts that alerts.yml does not define: {sorted(unknown)}"
    assert not alerts - firing, f"no firing case for {sorted(alerts - firing)}"
    assert not alerts - silent, f"no non-firing case (empty exp_alerts) for {sorted(alerts - silent)}"


def test_scrape_configs_share_jobs_and_rules() -> None:
    compose_cfg, local_cfg = (_load(p) for p in CONFIGS)
    for cfg in (compose_cfg, local_cfg):
        assert cfg["rule_files"] == ["alerts.yml"]
        assert cfg["global"]["scrape_interval"] == "5s"
    jobs = {j["job_name"] for j in compose_cfg["scrape_configs"]}
    assert {"flywheel-trainer", "flywheel-paramsync", "flywheel-admin", "flywheel-sampler"} <= jobs
    assert jobs == {j["job_name"] for j in local_cfg["scrape_configs"]}, (
        "the two stacks must scrape the same jobs"
    )

    # Compose: samplers are discovered through DNS so that `--scale sampler=N` is scraped.
    sampler = next(j for j in compose_cfg["scrape_configs"] if j["job_name"] == "flywheel-sampler")
    assert sampler["dns_sd_configs"] == [
        {"names": ["sampler"], "type": "A", "port": 8000, "refresh_interval": "10s"}
    ]

    local_targets = {
        j["job_name"]: [t for sc in j["static_configs"] for t in sc["targets"]]
        for j in local_cfg["scrape_configs"]
    }
    assert local_targets["flywheel-trainer"] == ["127.0.0.1:8101"]
    assert local_targets["flywheel-paramsync"] == ["127.0.0.1:8102"]
    assert local_targets["flywheel-admin"] == ["127.0.0.1:8080"]
    assert local_targets["flywheel-sampler"] == ["127.0.0.1:8110", "127.0.0.1:8111"]
