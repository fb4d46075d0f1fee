"""What a stack remembers between commands: ``localstack.json`` (what ``up`` asked for) and
``supervisor.json`` (restarts and holds), both in its home, both replaced atomically."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any


class _JsonFile:
    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _write(self, data: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        tmp.replace(self.path)


class StackState(_JsonFile):
    """``{"samplers": [0, 1], "prometheus": true, "config": "...", "log_max_bytes": ...}`` in ``<home>``.

    The sampler list is what ``status`` expects to run (so a crashed sampler shows as dead) and
    what Prometheus scrapes.
    """

    def __init__(self, home: Path) -> None:
        super().__init__(home / "localstack.json")

    def save(self, **changes: Any) -> None:
        self._write({**self.load(), **changes})

    def samplers(self) -> list[int]:
        """Sampler replicas this stack runs: those recorded, plus any that is wanted (has a launch record)."""
        recorded = {int(i) for i in self.load().get("samplers", []) if isinstance(i, int)}
        names = (p.stem.removeprefix("sampler-") for p in (self.path.parent / "procs").glob("sampler-*.json"))
        return sorted(recorded | {int(n) for n in names if n.isdigit()})

    def add_sampler(self, replica: int) -> None:
        current = self.samplers()
        if replica not in current:
            self.save(samplers=sorted([*current, replica]))


class SupervisorState(_JsonFile):
    """``{name: {"restarts": n, "last_restart_at": epoch s, "last_exit": "...", "held": bool}}``.

    Written by the supervisor (each restart) and by ``hold`` / ``release``, always under the
    home's ``table_lock``, so neither loses the other's change.
    """

    def __init__(self, home: Path) -> None:
        super().__init__(home / "supervisor.json")

    def update(self, name: str, **fields: Any) -> None:
        data = self.load()
        data[name] = {**data.get(name, {}), **fields}
        self._write(data)

    def forget(self, names: Iterable[str]) -> None:
        data = self.load()
        gone = [n for n in names if n in data]
        if gone:
            self._write({k: v for k, v in data.items() if k not in gone})

    def restarts(self) -> dict[str, int]:
        return {name: int(rec.get("restarts", 0)) for name, rec in self.load().items()}

    def held(self) -> set[str]:
        return {name for name, rec in self.load().items() if rec.get("held")}
