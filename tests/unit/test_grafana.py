"""Grafana's provisioning (deploy/grafana/) and the Flywheel dashboard.

The check that matters: every PromQL query in the dashboard, and in the alert rules, names metrics
the services actually export. The ground truth is prometheus_client's registry in a fresh
interpreter that has imported every module of `services` and `shared` (a metric registers when its
module is imported), not a regex over the source. Exported series names follow the client's
exposition: a Counter `x` is scraped as `x_total` (and `x_created`), a Histogram `x` as `x_bucket`,
`x_sum`, `x_count` (and `x_created`), a Gauge `x` as `x`. A labelled metric without children yet has
no samples, so names come from each family's type, not from its current samples.

Also: every panel has the provisioned data source and a query; the queries parse (promtool); the
dashboard covers what the admin status page shows; the provisioning files agree with
docker-compose.yml's mounts; docs/operations.md has a section for every alert and names only panels
that exist.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
GRAFANA = REPO / "deploy" / "grafana"
DASHBOARDS = GRAFANA / "dashboards"
DASHBOARD = DASHBOARDS / "flywheel.json"
DATASOURCES = GRAFANA / "provisioning" / "datasources"
PROVIDERS = GRAFANA / "provisioning" / "dashboards"
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yml"
COMPOSE = REPO / "docker-compose.yml"

# Identifiers that name series the services export: ours, and prometheus_client's default collectors.
METRIC = re.compile(r"(?<![A-Za-z0-9_:])(?:flywheel|process|python)_[a-z0-9_]+")
STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
# The modules named in the issue; every other module of `services` and `shared` is imported too.
METRIC_MODULES = ("services.trainer.service", "services.sampler.service", "services.paramsync.service",
                  "services.admin.state", "shared.retry")

# What the admin status page shows, so the dashboard shows it too (series names as scraped).
REQUIRED_SERIES = {
    "flywheel_trainer_episode_return_mean",
    "flywheel_sampler_env_steps_total",
    "flywheel_trainer_env_steps_trained_total",
    "flywheel_backlog_records",
    "flywheel_trainer_fragment_staleness_versions_bucket",
    "flywheel_paramsync_sync_latency_seconds_bucket",
    "flywheel_paramsync_published_version",
    "flywheel_trainer_policy_version",
    "flywheel_trainer_fragments_dead_lettered_total",
    "flywheel_trainer_fragments_dropped_stale_total",
    "flywheel_paramsync_live_samplers",
    "flywheel_service_degraded",
    "flywheel_trainer_stalled",
    "flywheel_trainer_busy_seconds_total",
}

_COLLECT = """
import importlib, json, pkgutil, sys
import services, shared
wanted = sys.argv[1:]
names = []
for package in (services, shared):
    for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        if module.name.rsplit(".", 1)[-1] != "__main__":  # __main__ would start a service
            names.append(module.name)
missing = sorted(set(wanted) - set(names))
assert not missing, f"modules not found: {missing}"
for name in names:
    importlib.import_module(name)
from prometheus_client import REGISTRY
families = [{"name": f.name, "type": f.type, "samples": sorted({s.name for s in f.samples})}
            for f in REGISTRY.collect()]
print(json.dumps(families))
"""

Exported = dict[str, dict[str, Any]]
"""{family: {"type": its type, "series": the names it is scraped under}}."""

_SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
    "stateset": ("",),
    "unknown": ("",),
}


def series_names(family: str, kind: str, samples: list[str] | tuple[str, ...] = ()) -> set[str]:
    """The series names a metric family is scraped under (prometheus_client's text exposition)."""
    return {family + suffix for suffix in _SUFFIXES.get(kind, ("",))} | set(samples)


def metric_names(expr: str) -> set[str]:
    """Names of exported series in a PromQL expression (string literals, e.g. label values, ignored)."""
    return set(METRIC.findall(STRING.sub('""', expr)))


@pytest.fixture(scope="module")
def exported() -> Exported:
    """{family: {"type", "series"}} of every metric the services' modules register."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    proc = subprocess.run(
        [sys.executable, "-c", _COLLECT, *METRIC_MODULES],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240, check=False,
    )
    assert proc.returncode == 0, f"importing the services' modules failed:\n{proc.stderr}"
    families = {}
    for f in json.loads(proc.stdout):
        families[f["name"]] = {"type": f["type"], "series": series_names(f["name"], f["type"], f["samples"])}
    assert any(name.startswith("flywheel_") for name in families), "no flywheel_ metric registered"
    return families


@pytest.fixture(scope="module")
def exported_series(exported: Exported) -> set[str]:
    return set().union(*(f["series"] for f in exported.values()))


def unknown_names(names: set[str], exported: Exported, series: set[str]) -> list[str]:
    """One line per name that no exported series has, with the right names where the family exists."""
    problems = []
    for name in sorted(names - series):
        hint = ""
        for family, info in exported.items():
            if name == family or (name.startswith(family + "_") and name[len(family):] in {
                    "_total", "_bucket", "_sum", "_count", "_created", "_info"}):
                hint = f" ({family} is a {info['type']}: scraped as {', '.join(sorted(info['series']))})"
                break
        problems.append(f"{name}{hint}")
    return problems


# ---- the dashboard ----------------------------------------------------------------------------


def _dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, rows' collapsed children included, rows themselves excluded."""
    out: list[dict[str, Any]] = []
    for panel in dashboard["panels"]:
        if panel.get("type") == "row":
            out.extend(panel.get("panels") or [])
        else:
            out.append(panel)
    return out


def _queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title / refId, expr) of every query."""
    return [(f"{p['title']} / {t['refId']}", t["expr"]) for p in _panels(dashboard) for t in p.get("targets", [])]


def _datasource_uid() -> str:
    (source,) = _provisioned_datasources()
    uid: str = source["uid"]
    return uid


def _provisioned_datasources() -> list[dict[str, Any]]:
    sources: list[dict[str, Any]] = []
    for path in sorted(DATASOURCES.glob("*.y*ml")):
        doc = yaml.safe_load(path.read_text())
        assert doc["apiVersion"] == 1, path
        sources.extend(doc.get("datasources") or [])
    return sources


def test_every_panel_has_a_datasource_and_a_query() -> None:
    dashboard = _dashboard()
    uid = _datasource_uid()
    panels = _panels(dashboard)
    assert len(panels) >= 14
    for panel in panels:
        where = f"panel {panel.get('id')} {panel.get('title')!r}"
        assert panel.get("title"), f"{where}: no title"
        assert panel.get("datasource") == {"type": "prometheus", "uid": uid}, (
            f"{where}: datasource must be the provisioned Prometheus ({uid}), got {panel.get('datasource')}"
        )
        targets = panel.get("targets") or []
        assert targets, f"{where}: no query"
        ref_ids = [t.get("refId") for t in targets]
        assert all(ref_ids) and len(set(ref_ids)) == len(ref_ids), f"{where}: refIds {ref_ids}"
        for target in targets:
            assert isinstance(target.get("expr"), str) and target["expr"].strip(), f"{where}: empty query"
            assert target.get("datasource", panel["datasource"]) == panel["datasource"], f"{where}: mixed sources"
            assert not target.get("hide"), f"{where}: hidden query {target['refId']}"


def test_dashboard_queries_name_exported_metrics(exported: Exported, exported_series: set[str]) -> None:
    problems = []
    used: set[str] = set()
    for where, expr in _queries(_dashboard()):
        names = metric_names(expr)
        used |= names
        problems += [f"{where}: {p}" for p in unknown_names(names, exported, exported_series)]
    assert not problems, "dashboard queries name metrics no service exports:\n" + "\n".join(problems)
    assert used, "no metric found in the dashboard's queries"


def test_alert_rules_name_exported_metrics(exported: Exported, exported_series: set[str]) -> None:
    problems = []
    rules = [r for group in yaml.safe_load(ALERTS.read_text())["groups"] for r in group["rules"]]
    assert rules
    for rule in rules:
        name = rule.get("alert") or rule.get("record")
        problems += [f"{name}: {p}" for p in unknown_names(metric_names(rule["expr"]), exported, exported_series)]
    assert not problems, "alert rules name metrics no service exports:\n" + "\n".join(problems)


def test_the_check_knows_the_exposition_suffixes(exported: Exported, exported_series: set[str]) -> None:
    """The control for the two tests above: a histogram or counter named without its scrape suffix is caught."""
    assert exported["flywheel_paramsync_sync_latency_seconds"]["type"] == "histogram"
    assert exported["flywheel_trainer_updates"]["type"] == "counter"
    assert exported["flywheel_trainer_fragments_dead_lettered"]["type"] == "counter"  # labelled, no child yet
    ok = {"flywheel_paramsync_sync_latency_seconds_bucket", "flywheel_trainer_updates_total",
          "flywheel_trainer_fragments_dead_lettered_total", "flywheel_backlog_records", "process_start_time_seconds"}
    assert unknown_names(ok, exported, exported_series) == []
    wrong = unknown_names({"flywheel_paramsync_sync_latency_seconds", "flywheel_trainer_updates",
                           "flywheel_backlog_records_total", "flywheel_no_such_metric"}, exported, exported_series)
    assert [w.split()[0] for w in wrong] == ["flywheel_backlog_records_total", "flywheel_no_such_metric",
                                            "flywheel_paramsync_sync_latency_seconds", "flywheel_trainer_updates"]
    assert "scraped as flywheel_paramsync_sync_latency_seconds_bucket" in wrong[2]


def test_metric_names_ignore_label_values_and_functions() -> None:
    expr = ('histogram_quantile(0.95, sum by (le) (rate(flywheel_a_seconds_bucket{job=~"flywheel_x.*"}[5m])))'
            " / on() flywheel_b_total offset 5m and process_start_time_seconds")
    assert metric_names(expr) == {"flywheel_a_seconds_bucket", "flywheel_b_total", "process_start_time_seconds"}
    assert series_names("x", "counter") == {"x_total", "x_created"}
    assert series_names("h", "histogram") == {"h_bucket", "h_sum", "h_count", "h_created"}
    assert series_names("g", "gauge", ["g"]) == {"g"}


def test_dashboard_covers_the_status_page() -> None:
    queries = _queries(_dashboard())
    used = set().union(*(metric_names(expr) for _, expr in queries))
    missing = REQUIRED_SERIES - used
    assert not missing, f"the dashboard has no panel for {sorted(missing)}"
    for histogram in ("flywheel_trainer_fragment_staleness_versions", "flywheel_paramsync_sync_latency_seconds"):
        quantiles = {m.group(1) for _, expr in queries for m in re.finditer(
            r"histogram_quantile\(\s*(0\.\d+)\s*,[^;]*" + histogram + "_bucket", expr)}
        assert "0.95" in quantiles, f"no p95 of {histogram}"
    assert any("histogram_quantile(0.5," in expr and "sync_latency_seconds_bucket" in expr for _, expr in queries)
    assert any("staleness_versions_sum" in expr and "staleness_versions_count" in expr for _, expr in queries), (
        "no mean lag at training time"
    )


def test_dashboard_layout() -> None:
    dashboard = _dashboard()
    assert dashboard["uid"] == "flywheel" and dashboard["title"]
    assert dashboard.get("id") is None, "a provisioned dashboard carries no database id"
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["schemaVersion"] >= 39
    ids = [p["id"] for p in dashboard["panels"]] + [c["id"] for p in dashboard["panels"] for c in p.get("panels", [])]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells: dict[tuple[int, int], str] = {}
    for panel in dashboard["panels"]:
        g = panel["gridPos"]
        assert g["x"] >= 0 and g["w"] >= 1 and g["x"] + g["w"] <= 24 and g["h"] >= 1, panel["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = panel["title"]


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        if os.environ.get("FLYWHEEL_SKIP_PROMTOOL") == "1":
            pytest.skip("promtool not installed and FLYWHEEL_SKIP_PROMTOOL=1")
        pytest.fail("promtool not found on PATH: install Debian's `prometheus` package, "
                    "or set FLYWHEEL_SKIP_PROMTOOL=1 to skip this check deliberately")
    return path


def test_dashboard_queries_parse(tmp_path: Path) -> None:
    """Every query as a recording rule, so that `promtool check rules` parses it with Prometheus's parser."""
    rules = [{"record": f"flywheel_dashboard:query_{i}", "expr": expr}
             for i, (_, expr) in enumerate(_queries(_dashboard()))]
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    proc = subprocess.run([_promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, f"promtool rejected a dashboard query:\n{proc.stdout}\n{proc.stderr}"


# ---- provisioning -----------------------------------------------------------------------------


def _grafana_mounts() -> dict[str, Path]:
    """{container path: repository path} of grafana's bind mounts in docker-compose.yml."""
    grafana = yaml.safe_load(COMPOSE.read_text())["services"]["grafana"]
    mounts = {}
    for volume in grafana["volumes"]:
        source, target, *_ = volume.split(":")
        if source.startswith("./"):
            mounts[target] = (REPO / source).resolve()
    return mounts


def test_the_prometheus_data_source() -> None:
    (source,) = _provisioned_datasources()
    assert source["type"] == "prometheus" and source["access"] == "proxy"
    assert source["url"] == "http://prometheus:9090"
    assert source.get("isDefault") is True and source.get("editable") is False
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    assert "prometheus" in services, "the data source names the compose service `prometheus`"
    assert any(str(p).endswith(":9090") for p in services["prometheus"]["ports"])
    assert _grafana_mounts()["/etc/grafana/provisioning/datasources"] == DATASOURCES


def test_the_dashboard_provider_loads_the_mounted_dashboards() -> None:
    mounts = _grafana_mounts()
    assert mounts["/etc/grafana/provisioning/dashboards"] == PROVIDERS
    providers = []
    for path in sorted(PROVIDERS.glob("*.y*ml")):
        doc = yaml.safe_load(path.read_text())
        assert doc["apiVersion"] == 1, path
        providers.extend(doc["providers"])
    (provider,) = providers
    assert provider["type"] == "file" and provider.get("allowUiUpdates") is False
    container_dir = provider["options"]["path"]
    assert mounts.get(container_dir) == DASHBOARDS, f"{container_dir} is not where compose mounts {DASHBOARDS}"
    assert sorted(p.name for p in DASHBOARDS.glob("*.json")) == [DASHBOARD.name]

    env = yaml.safe_load(COMPOSE.read_text())["services"]["grafana"]["environment"]
    home = Path(env["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"])
    assert home.parent == Path(container_dir) and (DASHBOARDS / home.name).is_file()


# ---- the runbook (docs/operations.md) names what the dashboard and the rules have -------------

RUNBOOK = REPO / "docs" / "operations.md"
ALERTS_RUNBOOK = REPO / "docs" / "alerts.md"
# Bold text in the runbook that is not a panel or row title.
RUNBOOK_LABELS = {"How it shows", "Check", "Fix", "compose", "local", "Sign in"}


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation other than - and _ dropped, spaces as -."""
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", markdown, re.M)}


def test_the_runbook_covers_every_alert_and_its_links_resolve() -> None:
    text = RUNBOOK.read_text()
    own, alerts_md = _anchors(text), _anchors(ALERTS_RUNBOOK.read_text())
    rules = [r["alert"] for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"] if "alert" in r]
    missing = [name for name in rules if name.lower() not in own or f"(alerts.md#{name.lower()})" not in text]
    assert not missing, f"docs/operations.md needs a section linking alerts.md for {missing}"
    broken = []
    for link in re.findall(r"\]\(([^)\s]+)\)", text):
        path, _, anchor = link.partition("#")
        if link.startswith("http"):
            continue
        if not path:
            broken += [link] if anchor not in own else []
        elif not (RUNBOOK.parent / path).is_file():
            broken.append(link)
        elif path == "alerts.md" and anchor and anchor not in alerts_md:
            broken.append(link)
    assert not broken, f"docs/operations.md links to nothing: {broken}"


def test_the_runbook_names_panels_that_exist() -> None:
    dashboard = _dashboard()
    titles = [p["title"] for p in dashboard["panels"]]
    unknown = []
    for phrase in re.findall(r"\*\*(.+?)\*\*", RUNBOOK.read_text(), re.S):
        phrase = " ".join(phrase.split())
        if phrase.endswith(":") or phrase in RUNBOOK_LABELS or phrase == dashboard["title"]:
            continue
        if not any(title.startswith(phrase) for title in titles):
            unknown.append(phrase)
    assert not unknown, f"docs/operations.md names Grafana panels the dashboard lacks: {unknown}"
