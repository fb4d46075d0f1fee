"""The issue's must-show for the multi-host local stack, live: 3 Kafka nodes, 2 trainer ranks, paramsync, admin, the
S3 server and 2 samplers, each in its own network namespace; CartPole trains; ``flywheel status`` works from the root
namespace; rank 0's host is cut from every broker for 60 s (iptables inside its namespace), then restored: training
advances again within 90 s and ``flywheel verify`` exits 0 (the session's ``net`` fixture then checks that ``down``
leaves no ``fw-`` namespace, link or rule).

Opt-in (see conftest.py): ``.venv/bin/python -m pytest tests/hosts -m hosts -s`` as root."""

from __future__ import annotations

import os
import subprocess
import time

import pytest
import yaml

from devstack import hosts as mh
from devstack import prometheus as prom
from devstack.config import REPO_ROOT
from tests.hosts.alerts import prom_get, rule_durations
from tests.hosts.conftest import CHECKPOINT_EVERY
from tests.hosts.net import ADMIN, Net, NetRow, reaches, run_py

pytestmark = [pytest.mark.hosts]
CUT_S = 60.0
RECOVER_S = 90.0


@pytest.mark.timeout(900)
def test_every_part_in_its_own_namespace_trains_and_answers_from_the_root_namespace(net: Net) -> None:
    home = net.home
    table = run_py(home, "-m", "devstack", "hosts").stdout
    print(table)
    rows = [line.split() for line in table.splitlines()[1:]]
    names = {r[0] for r in rows}
    assert names == {"kafka", "kafka-2", "kafka-3", "s3", "trainer", "trainer-1", "paramsync", "admin", "sampler-0",
                     "sampler-1"}
    root = os.readlink("/proc/self/ns/net")
    namespaces = set()
    for name, netns, address, pid, *flag in rows:
        assert not flag, f"{name}: {flag}"
        ns = os.readlink(f"/proc/{pid}/ns/net")
        assert ns != root, f"{name} (pid {pid}) runs in the root namespace"
        assert os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat(f"/run/netns/{netns}").st_ino
        ident = subprocess.run(["ip", "netns", "identify", pid], capture_output=True, text=True).stdout.strip()
        assert ident == netns == mh.netns_name(name) and address == mh.address(name)
        namespaces.add(ns)
    assert len(namespaces) == len(rows)
    # Brokers advertise their hosts' addresses; the ranks meet at rank 0's.
    assert {h for h, _ in net.bootstrap()} == {mh.address(n) for n in net.kafka}, net.bootstrap()

    # The admin API, from the root namespace: at its own address, and at flywheel's default URL (forwarded) when
    # 127.0.0.1:8080 was free for the forwarder.
    deadline = time.monotonic() + 300
    while (net.progress()[0] or 0) < 5:
        assert time.monotonic() < deadline, "CartPole did not train 5 updates in 300 s"
        time.sleep(3)
    plain = run_py(home, "-m", "services.admin.cli", "--url", ADMIN, "status")
    print(plain.stdout)
    procs = run_py(home, "-m", "devstack", "status", check=False).stdout
    if any(line.split()[:2] == ["admin-fwd", "alive"] for line in procs.splitlines()):
        run_py(home, "-m", "services.admin.cli", "status")  # no --url: http://127.0.0.1:8080


@pytest.mark.timeout(900)
def test_rank_0_cut_from_every_broker_for_60_s(net: Net) -> None:
    brokers = net.bootstrap()
    row = NetRow("rank 0 cut from every broker, 60 s")
    net.rows.append(row)
    assert all(reaches("trainer", h, p) for h, p in brokers), "rank 0 cannot reach the brokers before the cut"

    def happened() -> list[str]:
        row.fault = "no broker accepting a connection from rank 0; rank 1 still reaching all three"
        wrong = [f"rank 0 still reaches {h}:{p}" for h, p in brokers if reaches("trainer", h, p)]
        return wrong + [f"rank 1 lost {h}:{p}" for h, p in brokers if not reaches("trainer-1", h, p)]

    at_heal, _ = net.partition(row, "trainer", net.kafka, CUT_S, happened=happened)
    assert row.heal_s is not None and row.heal_s <= RECOVER_S, f"training advanced {row.heal_s} s after the heal"
    # Every part alive again, each in its namespace. Rank 1's collective waits for rank 0 until trainer.rank_timeout_s
    # (60 s, as long as the cut): it may exit as the cut heals and the supervisor restarts it within seconds (the CI
    # rehearsal at 0052e53 asked in that gap and saw rank 1 dead). Recovery is what is asserted, within RECOVER_S.
    deadline = time.monotonic() + RECOVER_S
    while (hosts := run_py(net.home, "-m", "devstack", "hosts", check=False)).returncode != 0:
        assert time.monotonic() < deadline, f"a part not alive {RECOVER_S:.0f} s after the heal:\n{hosts.stdout}"
        time.sleep(2.0)
    net.check(row, at_heal or 0, CHECKPOINT_EVERY)


@pytest.mark.timeout(300)
def test_prometheus_scrapes_every_part_at_its_own_address(net: Net) -> None:
    """Prometheus runs in the root namespace (127.0.0.1:9090) and scrapes each service at its part's address on the
    bridge (``devstack.prometheus`` writes ``address:port`` targets for the multi-host stack): every trainer rank,
    paramsync, admin and both samplers are up targets, and the rules of deploy/prometheus/alerts.yml are loaded,
    unchanged (the partition rows report their alerts)."""
    if prom.binary() is None:
        pytest.skip(prom.NOT_INSTALLED)
    expected = {"flywheel-trainer": ["trainer"], "flywheel-trainer-ranks": ["trainer-1"],
                "flywheel-paramsync": ["paramsync"], "flywheel-admin": ["admin"],
                "flywheel-sampler": ["sampler-0", "sampler-1"]}
    deadline = time.monotonic() + 60
    while True:
        targets = (prom_get("/api/v1/targets?state=active") or {}).get("activeTargets") or []
        got = {(t["labels"]["job"], t["labels"]["instance"]): t["health"] for t in targets
               if t["labels"].get("job", "").startswith("flywheel-")}
        want = {(job, f"{mh.address(part)}:{net.http_port(part)}") for job, parts in expected.items() for part in parts}
        if set(got) == want and all(h == "up" for h in got.values()):
            break
        assert time.monotonic() < deadline, f"Prometheus's targets {got}, wanted {sorted(want)} all up"
        time.sleep(3)
    print(f"Prometheus scrapes {len(got)} targets, all up: {sorted(i for _, i in got)}")
    loaded = rule_durations()
    rules = yaml.safe_load((REPO_ROOT / "deploy" / "prometheus" / "alerts.yml").read_text())
    production = {r["alert"]: r["for"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    assert set(loaded) == set(production), (sorted(loaded), sorted(production))
    for name, duration in production.items():
        unit = {"s": 1, "m": 60, "h": 3600}[duration[-1]]
        assert loaded[name] == int(duration[:-1]) * unit, f"{name}: loaded for {loaded[name]} s, alerts.yml {duration}"
