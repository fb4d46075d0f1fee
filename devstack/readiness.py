"""Polling a process until it really works, with progress lines and a clear failure."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from devstack.config import StackError
from devstack.procs import tail

T = TypeVar("T")
REPORT_EVERY_S = 5.0
POLL_S = 0.5
LOG_TAIL_LINES = 30


def run_coro(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to completion from sync code, on a private loop in a worker thread.

    The thread keeps this independent of any event loop the caller has (running or merely set,
    e.g. pytest-asyncio's session loop), which `asyncio.run` here would otherwise disturb.
    """
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="devstack") as pool:
        return pool.submit(asyncio.run, coro).result()


def wait_until(
    what: str,
    check: Callable[[float], None],
    *,
    deadline: float,
    alive: Callable[[], bool],
    log_path: Path,
    progress: Callable[[str], None] | None = None,
) -> float:
    """Call ``check(seconds_left)`` until it returns without raising; return the seconds it took.

    Raises StackError, with the last error and the tail of ``log_path``, when the process behind
    the service exits (``alive()`` false) or ``deadline`` (time.monotonic()) passes.
    """
    started = time.monotonic()
    next_report = started + REPORT_EVERY_S
    last_error: BaseException | None = None
    while (left := deadline - time.monotonic()) > 0:
        try:
            check(left)
            return time.monotonic() - started
        except Exception as exc:  # every failure is retried until the deadline; the last is reported
            last_error = exc
        if not alive():
            raise StackError(f"{what} exited during start-up (last check: {_describe(last_error)}).\n"
                             f"last {LOG_TAIL_LINES} lines of {log_path}:\n{tail(log_path, LOG_TAIL_LINES)}")
        now = time.monotonic()
        if progress is not None and now >= next_report:
            progress(f"  ... waiting for {what} ({now - started:.0f} s; last: {_describe(last_error)})")
            next_report = now + REPORT_EVERY_S
        time.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))
    raise StackError(f"{what} was not ready within {time.monotonic() - started:.0f} s (last check: "
                     f"{_describe(last_error)}).\nlast {LOG_TAIL_LINES} lines of {log_path}:\n"
                     f"{tail(log_path, LOG_TAIL_LINES)}")


def http_ok(url: str, timeout_s: float = 2.0) -> None:
    """Return if a GET of ``url`` answers 200; raise (saying what answered) otherwise."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310 (our own 127.0.0.1 URL)
            status = int(resp.status)
    except urllib.error.HTTPError as exc:
        raise StackError(f"{url}: HTTP {exc.code}: {exc.read(300).decode(errors='replace')}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise StackError(f"{url}: {type(reason).__name__}: {reason}") from None
    if status != 200:
        raise StackError(f"{url}: HTTP {status}")


def _describe(exc: BaseException | None) -> str:
    if exc is None:
        return "none"
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else ""
    name = type(exc).__name__
    return (text if text.startswith(name) or isinstance(exc, StackError) else f"{name}: {text}" if text else name)[:200]
