"""What a local stack remembers between commands: ``<home>/localstack.json``, and what status reports."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.infra.procs import read_pid


@dataclass(frozen=True)
class ProcStatus:
    """One process of the stack: ``pid`` is the live one, or the last one recorded when dead."""

    name: str
    pid: int | None
    alive: bool
    endpoint: str
    log: Path


class StackState:
    """``{"samplers": [0, 1], "prometheus": true, "config": "...", "last_pids": {...}}`` in ``<home>``.

    The sampler list is what ``status`` expects to run (so a crashed sampler shows as dead) and
    what Prometheus scrapes. Pid files themselves stay ``shared.infra.procs``' business.
    """

    def __init__(self, home: Path) -> None:
        self.path = home / "localstack.json"

    def load(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def save(self, **changes: Any) -> None:
        data = self.load()
        data.update(changes)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        tmp.replace(self.path)

    def samplers(self) -> list[int]:
        """Sampler replicas this stack runs: those recorded, plus any with a pid file."""
        recorded = {int(i) for i in self.load().get("samplers", []) if isinstance(i, int)}
        pids = self.path.parent / "pids"
        found = {int(p.stem.removeprefix("sampler-")) for p in pids.glob("sampler-*.pid")
                 if p.stem.removeprefix("sampler-").isdigit()}
        return sorted(recorded | found)

    def add_sampler(self, replica: int) -> None:
        current = self.samplers()
        if replica not in current:
            self.save(samplers=sorted([*current, replica]))

    def record_pid(self, name: str, pid: int) -> None:
        """Remember the pid a process was started with, for ``status`` after it died."""
        last = self.load().get("last_pids", {})
        self.save(last_pids={**last, name: pid})

    def last_pid(self, pidfile: Path) -> int | None:
        """The pid in ``pidfile``, else the last one recorded for it (the pid file of a dead one is gone)."""
        pid = read_pid(pidfile)
        if pid is not None:
            return pid
        last = self.load().get("last_pids", {}).get(pidfile.stem)
        return last if isinstance(last, int) else None
