"""Runtime settings (validated like the config file, revisions) and the append-only audit trail, on the
local-directory store."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.runtime import AuditLog, RuntimeConfig, RuntimeWatcher, apply_runtime, runtime_values
from shared.settings import ConfigError, Settings
from shared.store import LocalDirStore


def test_values_are_validated_and_named() -> None:
    base = Settings()
    assert apply_runtime(base, {"trainer.learning_rate": 0.01}).trainer.learning_rate == 0.01
    with pytest.raises(ConfigError, match="trainer.learning_rate"):
        apply_runtime(base, {"trainer.learning_rate": 0})
    with pytest.raises(ConfigError, match="trainer.gamma: not a runtime setting"):
        apply_runtime(base, {"trainer.gamma": 0.5})
    with pytest.raises(ConfigError, match="sampler.max_backlog"):
        apply_runtime(base, {"sampler.max_backlog": -3})


def test_revisions_and_the_watcher(tmp_path: Path) -> None:
    cfg = RuntimeConfig(LocalDirStore(tmp_path), "r")
    watcher = RuntimeWatcher(cfg)
    assert cfg.latest() is None and watcher.poll() is None
    base = Settings()
    r1 = cfg.write(base, {"sampler.max_backlog": 9}, "op")
    assert r1.revision == 1 and r1.changes == {"sampler.max_backlog": {"old": base.sampler.max_backlog, "new": 9}}
    seen = watcher.poll()
    assert seen is not None and seen.revision == 1
    assert watcher.poll() is not None  # not acknowledged (not applied yet): offered again
    watcher.ack(seen)
    assert watcher.poll() is None
    r2 = cfg.write(base, {"trainer.max_staleness": 2}, "op")  # on top of revision 1
    assert r2.settings["sampler.max_backlog"] == 9 and r2.settings["trainer.max_staleness"] == 2
    assert runtime_values(apply_runtime(base, r2.settings))["trainer.max_staleness"] == 2
    assert [r.revision for r in cfg.history()] == [1, 2]


def test_audit_is_append_only_and_ordered(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path)
    log = AuditLog(store, "r")
    for i in range(5):
        log.append("op", "pause", {"i": i}, "sent")
    entries = log.entries(limit=3)
    assert [e.params["i"] for e in entries] == [2, 3, 4]
    keys = store.list("r/audit/")
    assert len(keys) == 5 and keys == sorted(keys)
