"""The multi-host local stack, live (devstack.hosts): opt-in only.

These tests make network namespaces, veth links, a bridge and iptables rules, and run a 3-broker, 2-rank stack for
several minutes, so they run only when selected with ``-m hosts`` (``make test`` never runs them), as root, on a
machine where ``ip netns`` and ``iptables`` work, and when no other multi-host stack runs on the machine. The soak
(``test_soak.py``, ``-m soak``, ``make test-soak``) uses the same stack and runs only when selected with ``-m soak``.

One stack serves the whole session (``net``): the must-show first (``test_multihost_stack.py``), then the
partition rows in file order (``test_partitions.py``); at the end ``docs/reliability-network.md`` is written from
the rows, then the stack goes down and nothing ``fw-`` may be left on the machine."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from devstack import hosts as mh
from devstack.config import REPO_ROOT, StackError
from tests.hosts.net import Net, run_py
from tests.hosts.report import write_network_reliability

CHECKPOINT_EVERY = 20
"""The partition stack's trainer.checkpoint_every (cartpole.yaml's 50, made shorter so that each row's
``flywheel verify`` has a checkpoint written after its heal within seconds)."""


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "soak: partitions and kill -9 at random on the multi-host stack for "
                            "SOAK_MINUTES (default 10; make test-soak, outside CI)")


def selected(markexpr: str, marker: str) -> bool:
    """Whether ``-m markexpr`` asks for ``marker`` (named, and not as ``not marker``)."""
    words = markexpr.replace("(", " ").replace(")", " ").split()
    return any(w == marker and (i == 0 or words[i - 1] != "not") for i, w in enumerate(words))


@pytest.fixture(scope="session")
def multihost_machine(request: pytest.FixtureRequest) -> None:
    """Skip unless selected with -m hosts (or -m soak) and this machine can run test hosts (saying why not)."""
    expr = request.config.option.markexpr or ""
    if not (selected(expr, "hosts") or selected(expr, "soak")):
        pytest.skip("the multi-host stack (minutes, root, network namespaces): select it with -m hosts (or -m soak)")
    try:
        mh.preflight()
    except StackError as exc:
        pytest.skip(f"this machine cannot run test hosts: {exc}")
    seen = mh.observe()
    if seen.owner is not None and mh.active(Path(seen.owner)):
        pytest.skip(f"another multi-host stack (home {seen.owner}) runs on this machine")


def no_leftovers() -> list[str]:
    seen = mh.observe()
    return [*seen.netns, *seen.links, *(r for r in seen.forward_rules if mh.RULE_COMMENT in r)]


@pytest.fixture(scope="session")
def net(multihost_machine: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Net]:
    root = tmp_path_factory.mktemp("multihost")
    home = root / "home"
    config = yaml.safe_load((REPO_ROOT / "configs" / "cartpole.yaml").read_text())
    config["trainer"]["checkpoint_every"] = CHECKPOINT_EVERY
    config["run"] = "netparts"
    (root / "netparts.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    started = time.monotonic()
    n = Net(home)
    try:
        up = run_py(home, "-m", "devstack", "up", "--hosts", "--brokers", "3", "--trainers", "2", "--samplers", "2",
                    "--store", "s3", "--config", str(root / "netparts.yaml"), "--timeout", "400",
                    timeout=480)
        print(up.stdout[-2500:])
        yield n
    finally:
        if n.rows:
            path = write_network_reliability(n.rows, minutes=(time.monotonic() - started) / 60)
            print(f"wrote {path}")
        down = run_py(home, "-m", "devstack", "down", timeout=300, check=False)
        print(down.stdout[-2500:], down.stderr[-2000:])
        assert down.returncode == 0, down.stderr
        assert no_leftovers() == [], "down left fw- namespaces, links or rules behind"
        assert not (home / mh.STATE_FILE).exists()
