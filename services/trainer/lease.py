"""One live trainer per run: a lease with a fencing token in the store (``<run>/trainer/lease.json``).

A second trainer process in the group would restore the shared checkpoint, rewind the group's commits and
re-train records the first has trained, and the two would fight over ``checkpoints/LATEST``. So:

- **acquire** at start: a lease nobody holds, or one whose holder stopped renewing it, is taken with a
  conditional write that raises the token by one. A lease that is renewed while this process watches
  (``watch_s``, a few renewal intervals) belongs to a live trainer: the start is refused with
  :class:`LeaseHeld` naming it. A restart after a crash waits at most ``watch_s`` for the dead
  holder's lease; a clean stop releases it, so the next start takes it at once.
- **renew** every ``renew_s`` (a named task); **check** before every checkpoint: a lease that moved to
  another token means this process was fenced out; it stops with :class:`LeaseLost` instead of writing.
Store errors while renewing are transient (the service reports itself degraded); a lost lease is fatal.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from shared.store import ObjectStore, PreconditionFailed

RENEW_S = 2.0
WATCH_S = 5.0


class LeaseHeld(RuntimeError):
    """Another live trainer holds the run's lease."""


class LeaseLost(RuntimeError):
    """This trainer's lease was taken over (it was presumed dead): it must stop writing."""


class TrainerLease:
    def __init__(self, store: ObjectStore, run: str, holder: str, *, renew_s: float = RENEW_S,
                 watch_s: float = WATCH_S, clock: Callable[[], float] = time.time,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.store = store
        self.key = f"{run}/trainer/lease.json"
        self.holder = holder
        self.renew_s = renew_s
        self.watch_s = watch_s
        self.clock = clock
        self.sleep = sleep
        self.token: int | None = None
        self._etag: str | None = None

    def _read(self) -> tuple[dict[str, Any] | None, str | None]:
        obj = self.store.get(self.key)
        if obj is None:
            return None, None
        try:
            data = json.loads(obj.data)
            if not isinstance(data, dict):
                raise ValueError("not an object")
            return data, obj.etag
        except ValueError:  # unreadable: nobody can prove they hold it; the next conditional write replaces it
            return {"holder": None, "token": 0, "renewed_at": 0, "released": True}, obj.etag

    def _write(self, token: int, etag: str | None, released: bool = False) -> None:
        body = json.dumps({"holder": self.holder, "token": token, "renewed_at": self.clock(),
                           "released": released}).encode()
        if etag is None:
            self._etag = self.store.put(self.key, body, if_none_match=True)
        else:
            self._etag = self.store.put(self.key, body, if_match=etag)

    def acquire(self) -> int:
        """Take the lease (blocking up to ``watch_s`` when another holder may be alive); the new token."""
        for _ in range(10):
            data, etag = self._read()
            if data is not None and not data.get("released") and data.get("holder") != self.holder:
                seen = data.get("renewed_at")
                deadline = self.clock() + self.watch_s
                while self.clock() < deadline:
                    self.sleep(min(0.5, self.renew_s / 2))
                    now_data, now_etag = self._read()
                    if now_etag != etag:
                        if now_data is not None and not now_data.get("released") and now_data.get("renewed_at") != seen:
                            raise LeaseHeld(
                                f"trainer {now_data.get('holder')!r} is running for this run (it renewed its lease "
                                f"{self.clock() - float(now_data.get('renewed_at') or 0):.1f} s ago): a second trainer "
                                "would re-train its records. Stop it first (data-parallel ranks are configured with "
                                "trainer.world_size, not by starting more trainers)")
                        break  # released, or replaced: read again
            token = int((data or {}).get("token") or 0) + 1
            try:
                self._write(token, etag)
            except PreconditionFailed:
                continue  # someone moved it meanwhile: look again
            self.token = token
            return token
        raise LeaseHeld(f"could not take the trainer lease {self.key}: it keeps changing")

    def renew(self) -> None:
        """Prove liveness; raise :class:`LeaseLost` if another trainer took the lease."""
        self.check()
        assert self.token is not None
        try:
            self._write(self.token, self._etag)
        except PreconditionFailed:
            self.check()  # a takeover raises; else our own earlier retried write: adopt its etag
            _, self._etag = self._read()

    def check(self) -> None:
        """Fencing: raise :class:`LeaseLost` unless the stored lease is still this process's token."""
        data, etag = self._read()
        if self.token is None or data is None or data.get("holder") != self.holder or data.get("token") != self.token:
            now = data or {}
            raise LeaseLost(f"the trainer lease {self.key} now belongs to {now.get('holder')!r} "
                            f"(token {now.get('token')}, ours {self.token}): "
                            "another trainer took over this run; stopping without writing")
        self._etag = etag

    def release(self) -> None:
        """On a clean stop: the next trainer may take the lease at once."""
        if self.token is None:
            return
        try:
            self.check()
            self._write(self.token, self._etag, released=True)
        except (LeaseLost, PreconditionFailed):
            pass
        self.token = None
