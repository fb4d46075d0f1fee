"""Runtime settings as overrides on each service's own base, one apply path (RuntimeApplier), and the
pause state changed only by conditional read-modify-write (local-directory store)."""

from __future__ import annotations

import asyncio
import io
import json
import threading
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from shared.logging import configure_logging, get_logger
from shared.marker import VersionRecord
from shared.runtime import (
    PAUSE_KEY,
    PauseStateConflict,
    Revision,
    RuntimeApplier,
    RuntimeConfig,
    RuntimeWatcher,
    apply_runtime,
    read_paused,
    runtime_values,
    update_paused,
)
from shared.settings import ConfigError, Settings
from shared.store import LocalDirStore, PreconditionFailed, StoredObject, StoreError

ADMIN = Settings()
TRAINER = Settings.model_validate({"trainer": {"learning_rate": ADMIN.trainer.learning_rate * 3}})
"""The trainer's own base: its environment set a learning rate the admin does not know about."""


def store_revision(cfg: RuntimeConfig, rev: Revision) -> None:
    """Write a revision as some other writer (another admin, older code) would have."""
    data = json.dumps(asdict(rev), sort_keys=True).encode()
    key, sha = cfg.versions.put_blob(data)
    current = cfg.versions.read_marker()
    cfg.versions.publish(VersionRecord(version=rev.revision, blob=key, sha256=sha, size=len(data), trainer_step=0),
                         None if current is None else current[1])


# ---- revisions hold only overrides ----------------------------------------------------------------
def test_a_change_does_not_reset_keys_another_service_set_itself(tmp_path: Path) -> None:
    cfg = RuntimeConfig(LocalDirStore(tmp_path), "r")
    rev = cfg.write(ADMIN, {"sampler.max_backlog": 5}, "op")
    assert rev.settings == {"sampler.max_backlog": 5} and rev.overrides_only
    assert rev.changes == {"sampler.max_backlog": {"old": ADMIN.sampler.max_backlog, "new": 5}}
    trainer = apply_runtime(TRAINER, rev.settings)
    assert trainer.trainer.learning_rate == TRAINER.trainer.learning_rate  # its own value, not admin's
    assert trainer.sampler.max_backlog == 5


def test_overrides_accumulate_and_bad_values_are_refused_by_name(tmp_path: Path) -> None:
    cfg = RuntimeConfig(LocalDirStore(tmp_path), "r")
    cfg.write(ADMIN, {"sampler.max_backlog": 5}, "op")
    r2 = cfg.write(ADMIN, {"trainer.max_staleness": 2}, "op")
    assert r2.settings == {"sampler.max_backlog": 5, "trainer.max_staleness": 2}
    assert r2.changes == {"trainer.max_staleness": {"old": ADMIN.trainer.max_staleness, "new": 2}}
    with pytest.raises(ConfigError, match="sampler.max_backlog"):
        cfg.write(ADMIN, {"sampler.max_backlog": -3}, "op")
    with pytest.raises(ConfigError, match="trainer.gamma"):
        cfg.write(ADMIN, {"trainer.gamma": 0.5}, "op")
    latest = cfg.latest()
    assert latest is not None and latest.revision == 2  # nothing stored for the refused ones


def test_revert_writes_the_overrides_of_that_revision(tmp_path: Path) -> None:
    cfg = RuntimeConfig(LocalDirStore(tmp_path), "r")
    cfg.write(ADMIN, {"sampler.max_backlog": 5}, "op")
    cfg.write(ADMIN, {"trainer.learning_rate": 0.01}, "op")
    r3 = cfg.revert(ADMIN, 1, "op")
    assert r3.revision == 3 and r3.reverted_from == 1 and r3.settings == {"sampler.max_backlog": 5}
    assert apply_runtime(TRAINER, r3.settings).trainer.learning_rate == TRAINER.trainer.learning_rate
    r4 = cfg.revert(ADMIN, 0, "op")
    assert r4.settings == {} and r4.changes == {"sampler.max_backlog": {"old": 5, "new": ADMIN.sampler.max_backlog}}
    r5 = cfg.write(ADMIN, runtime_values(ADMIN), "op", reverted_from=0)  # how admin calls it today
    assert r5.settings == {} and r5.reverted_from == 0
    with pytest.raises(LookupError, match="revision 9"):
        cfg.revert(ADMIN, 9, "op")


def test_a_stored_full_revision_still_loads_and_the_next_write_keeps_only_what_differs(tmp_path: Path) -> None:
    cfg = RuntimeConfig(LocalDirStore(tmp_path), "r")
    full = {**runtime_values(ADMIN), "sampler.max_backlog": 7}
    raw = {"revision": 1, "settings": full, "changes": {}, "actor": "op", "at": 1.0, "reverted_from": None}
    data = json.dumps(raw).encode()  # exactly the old shape: no overrides_only
    key, sha = cfg.versions.put_blob(data)
    cfg.versions.publish(VersionRecord(version=1, blob=key, sha256=sha, size=len(data), trainer_step=0), None)
    old = cfg.latest()
    assert old is not None and old.settings == full and not old.overrides_only
    r2 = cfg.write(ADMIN, {"trainer.max_staleness": 2}, "op")
    assert r2.settings == {"sampler.max_backlog": 7, "trainer.max_staleness": 2}
    assert [r.revision for r in cfg.history()] == [1, 2]


# ---- one apply path -----------------------------------------------------------------------------
def make_applier(tmp_path: Path, base: Settings) -> tuple[RuntimeConfig, RuntimeApplier, list[int], io.StringIO]:
    buf = io.StringIO()
    configure_logging("test", "r", stream=buf)
    cfg = RuntimeConfig(LocalDirStore(tmp_path), "r")
    calls: list[int] = []

    def apply(settings: Settings, revision: int) -> dict[str, Any]:
        calls.append(revision)
        return {"sampler.max_backlog": {"old": None, "new": settings.sampler.max_backlog}}

    return cfg, RuntimeApplier(RuntimeWatcher(cfg), base, apply, get_logger(), "sampler"), calls, buf


def test_applier_applies_on_its_own_base_and_acks(tmp_path: Path) -> None:
    cfg, applier, calls, buf = make_applier(tmp_path, TRAINER)
    assert applier.poll_once() is None
    cfg.write(ADMIN, {"sampler.max_backlog": 4}, "op")
    rev = applier.poll_once()
    assert rev is not None and calls == [1] and applier.revision == 1 and applier.refused == {}
    assert applier.poll_once() is None  # acknowledged
    assert '"runtime_config_applied"' in buf.getvalue()


def test_applier_refuses_what_does_not_validate_here_and_does_not_report_it_applied(tmp_path: Path) -> None:
    cfg, applier, calls, buf = make_applier(tmp_path, ADMIN)
    cfg.write(ADMIN, {"sampler.max_backlog": 4}, "op")
    assert applier.poll_once() is not None and applier.revision == 1
    store_revision(cfg, Revision(revision=2, settings={"sampler.max_backlog": -1}, overrides_only=True))
    rev = applier.poll_once()
    assert rev is not None and rev.revision == 2
    assert calls == [1] and applier.revision == 1 and "sampler.max_backlog" in applier.refused[2]
    assert applier.poll_once() is None  # acknowledged: not retried forever
    line = next(json.loads(x) for x in buf.getvalue().splitlines() if "runtime_config_refused" in x)
    assert line["revision"] == 2


def test_applier_lets_store_errors_through(tmp_path: Path) -> None:
    class Down(LocalDirStore):
        def get(self, key: str) -> StoredObject | None:
            raise StoreError("connection refused")

    applier = RuntimeApplier(RuntimeWatcher(RuntimeConfig(Down(tmp_path), "r")), ADMIN,
                             lambda s, r: {}, None, "sampler")
    with pytest.raises(StoreError):
        applier.poll_once()


def test_the_sampler_reports_only_applied_revisions(tmp_path: Path) -> None:
    from services.sampler.service import Sampler

    settings = Settings.model_validate({"run": "r", "store": {"backend": "local", "local_root": str(tmp_path)}})
    beats: list[bytes] = []

    class Producer:
        async def send(self, topic: str, value: bytes, key: bytes | None = None, headers: object = None) -> None:
            beats.append(value)

    async def scenario() -> None:
        sampler = Sampler(settings, "s-1")
        try:
            sampler.producer = Producer()  # type: ignore[assignment]
            cfg = RuntimeConfig(sampler.store, "r")
            cfg.write(settings, {"sampler.max_backlog": 6}, "op")
            await sampler._refresh_operator_state()
            assert sampler.settings.sampler.max_backlog == 6
            store_revision(cfg, Revision(revision=2, settings={"sampler.max_backlog": -1}, overrides_only=True))
            await sampler._refresh_operator_state()
            assert sampler.settings.sampler.max_backlog == 6  # kept the applied one
            await sampler._heartbeat()
        finally:
            sampler.worker.close()

    asyncio.run(scenario())
    beat = json.loads(beats[-1])
    assert beat["config_revision"] == 1 and beat["max_backlog"] == 6


def test_the_sampler_keeps_running_degraded_when_no_revision_is_readable(tmp_path: Path) -> None:
    from services.sampler.service import Sampler

    settings = Settings.model_validate({"run": "r", "store": {"backend": "local", "local_root": str(tmp_path)}})

    async def scenario() -> dict[str, Any]:
        sampler = Sampler(settings, "s-1")
        try:
            cfg = RuntimeConfig(sampler.store, "r")
            rev = cfg.write(settings, {"sampler.max_backlog": 6}, "op")
            record = cfg.versions.records()[0]
            sampler.store.delete(record.blob)  # the only revision's payload is gone
            sampler.store.put(cfg.versions.marker_key, b"\x00torn")  # and the marker unreadable
            sampler.store.put(f"r/{PAUSE_KEY}", b"not json")  # and the pause state too
            await sampler._refresh_operator_state()  # must not raise: the sampler keeps producing
            assert rev.revision == 1 and sampler.runtime.revision == 0
            return sampler.health()
        finally:
            sampler.worker.close()

    health = asyncio.run(scenario())
    assert health["state"] == "degraded" and "config" in health["reasons"]


# ---- pause state ---------------------------------------------------------------------------------
def pause(sid: str) -> Any:
    def change(state: dict[str, Any]) -> dict[str, Any]:
        state["samplers"].setdefault(sid, 1.0)
        return state
    return change


@pytest.mark.parametrize("existing", [False, True], ids=["state-absent", "state-present"])
def test_concurrent_pauses_of_different_samplers_both_stay(tmp_path: Path, existing: bool) -> None:
    class Interleaved(LocalDirStore):
        """Once armed, before the next write another admin pauses s-b (it reads and writes first)."""

        armed = False

        def put(self, key: str, data: bytes, *, if_none_match: bool = False, if_match: str | None = None) -> str:
            if self.armed and key.endswith(PAUSE_KEY):
                self.armed = False
                update_paused(self, "r", pause("s-b"))
            return super().put(key, data, if_none_match=if_none_match, if_match=if_match)

    store = Interleaved(tmp_path)
    if existing:
        update_paused(store, "r", pause("s-0"))
    store.armed = True
    update_paused(store, "r", pause("s-a"), sleep=lambda s: None)
    assert sorted(read_paused(store, "r")["samplers"]) == ["s-0", "s-a", "s-b"][0 if existing else 1:]


def test_pauses_from_threads_are_all_kept(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path)
    ids = [f"s-{i}" for i in range(6)]
    threads = [threading.Thread(target=update_paused, args=(store, "r", pause(sid))) for sid in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(read_paused(store, "r")["samplers"]) == ids


def test_update_gives_up_with_a_clear_error(tmp_path: Path) -> None:
    class AlwaysLoses(LocalDirStore):
        def put(self, key: str, data: bytes, *, if_none_match: bool = False, if_match: str | None = None) -> str:
            raise PreconditionFailed("someone else wrote")

    waits: list[float] = []
    with pytest.raises(PauseStateConflict, match="try again"):
        update_paused(AlwaysLoses(tmp_path), "r", pause("s-a"), sleep=waits.append)
    assert len(waits) == 20 and max(waits) <= 0.2


def test_an_unreadable_pause_state_reads_as_not_paused_and_is_replaced(tmp_path: Path) -> None:
    buf = io.StringIO()
    configure_logging("test", "r", stream=buf)
    store = LocalDirStore(tmp_path)
    store.put(f"r/{PAUSE_KEY}", b"\x00{garbage")
    assert read_paused(store, "r") == {"all": None, "samplers": {}, "updated_at": None}
    assert "pause_state_unreadable" in buf.getvalue()
    update_paused(store, "r", pause("s-a"))
    assert list(read_paused(store, "r")["samplers"]) == ["s-a"]
