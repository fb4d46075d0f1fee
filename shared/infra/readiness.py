"""Polling a service until it really works, with progress lines and a clear failure."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from shared.infra.config import InfraError
from shared.infra.procs import tail

T = TypeVar("T")
REPORT_EVERY_S = 5.0


def run_coro(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to completion from sync code, on a private loop in a worker thread.

    The thread keeps this independent of any event loop the caller has (running or merely set,
    e.g. pytest-asyncio's session loop), which `asyncio.run` here would otherwise disturb.
    """
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="flywheel-infra") as pool:
        return pool.submit(asyncio.run, coro).result()


def wait_until(
    what: str,
    check: Callable[[float], None],
    *,
    deadline: float,
    alive: Callable[[], bool],
    log_path: Path,
    progress: Callable[[str], None],
) -> float:
    """Call `check(seconds_left)` until it returns without raising; return the seconds it took.

    Raises InfraError, with the last error and the tail of `log_path`, when the process behind the
    service exits (`alive()` false) or `deadline` (time.monotonic()) passes.
    """
    started = time.monotonic()
    next_report = started + REPORT_EVERY_S
    last_error: BaseException | None = None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            check(left)
            return time.monotonic() - started
        except Exception as exc:  # every failure is retried until the deadline; the last is reported
            last_error = exc
        if not alive():
            raise InfraError(
                f"{what} exited during start-up (last check error: {_describe(last_error)}).\n"
                f"last 30 lines of {log_path}:\n{tail(log_path)}"
            )
        now = time.monotonic()
        if now >= next_report:
            progress(f"  ... waiting for {what} ({now - started:.0f} s; last: {_describe(last_error)})")
            next_report = now + REPORT_EVERY_S
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    raise InfraError(
        f"{what} was not ready within {time.monotonic() - started:.0f} s "
        f"(last check error: {_describe(last_error)}).\nlast 30 lines of {log_path}:\n{tail(log_path)}"
    )


def _describe(exc: BaseException | None) -> str:
    if exc is None:
        return "none"
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else ""
    name = type(exc).__name__
    return (text if text.startswith(name) else f"{name}: {text}" if text else name)[:200]
