"""The multi-host local stack, live (devstack.hosts): opt-in only.

These tests make network namespaces, veth links, a bridge and iptables rules, and run a 3-broker, 2-rank stack for
several minutes, so they run only when selected with ``-m hosts`` (``make test`` never runs them), as root, on a
machine where ``ip netns`` and ``iptables`` work, and when no other multi-host stack runs on the machine."""

from __future__ import annotations

from pathlib import Path

import pytest

from devstack import hosts as mh
from devstack.config import StackError


@pytest.fixture(scope="session")
def multihost_machine(request: pytest.FixtureRequest) -> None:
    """Skip unless selected with -m hosts and this machine can run test hosts (saying why not)."""
    if "hosts" not in (request.config.option.markexpr or ""):
        pytest.skip("the multi-host stack (minutes, root, network namespaces): select it with -m hosts")
    try:
        mh.preflight()
    except StackError as exc:
        pytest.skip(f"this machine cannot run test hosts: {exc}")
    seen = mh.observe()
    if seen.owner is not None and mh.active(Path(seen.owner)):
        pytest.skip(f"another multi-host stack (home {seen.owner}) runs on this machine")
