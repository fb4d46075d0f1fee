"""The background tasks of a service, supervised one way in all four services (admin, paramsync, sampler, trainer).

A service runs the loops that live as long as it does (``shared.retry.every``, ``read_forever``) as named tasks
of one :class:`Background`. Invariant: no such task ends unnoticed. One that fails stops the service with its own
error (a ``LeaseLost`` stays a ``LeaseLost`` in the stopping line); one that ends without an error, or is
cancelled, before the stop stops the service with an error naming it; all are cancelled together at ``stop``.

Two ways to watch them, for two shapes of service:

- the sampler and the trainer do their main work in a loop of their own and call ``raise_if_ended`` once a pass;
- admin and paramsync hand their main coroutines to ``until_done``, which waits on those and the background
  tasks at once and returns when the main ones have finished (each watches the stop event).

A task started with ``once=True`` (paramsync's pruning of old versions) ends by itself: only its error counts,
and it is forgotten once it has ended well.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterable
from typing import Any

Job = Coroutine[Any, Any, Any]


class Background:
    """The named background tasks of one service (``owner`` prefixes their names)."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._tasks: list[asyncio.Task[Any]] = []
        self._once: set[asyncio.Task[Any]] = set()
        self._started = asyncio.Event()  # wakes ``until_done`` to watch a task started while it waits

    def start(self, name: str, job: Job, *, once: bool = False) -> asyncio.Task[Any]:
        """Run ``job`` as the task ``<owner>-<name>``; ``once``: it ends by itself, only an error of it counts."""
        task = asyncio.create_task(job, name=f"{self.owner}-{name}")
        self._tasks.append(task)
        if once:
            self._once.add(task)
        self._started.set()
        return task

    def start_all(self, jobs: Iterable[tuple[str, Job]]) -> None:
        for name, job in jobs:
            self.start(name, job)

    def raise_if_ended(self, stopping: bool) -> None:
        """Raise the error of a task that failed (even while stopping: the stop must not hide it); while not
        stopping, raise a RuntimeError for a lasting task that ended or was cancelled. Forget one-shot tasks that
        ended well."""
        for task in list(self._tasks):
            if not task.done():
                continue
            if task.cancelled():
                if not stopping:
                    raise RuntimeError(f"background task {task.get_name()} was cancelled; it should run until "
                                       "the stop")
                continue
            exc = task.exception()
            if exc is not None:
                raise exc
            if task in self._once:
                self._tasks.remove(task)
                self._once.discard(task)
            elif not stopping:
                raise RuntimeError(f"background task {task.get_name()} ended; it should run until the stop")

    async def until_done(self, *jobs: Job) -> None:
        """Run ``jobs`` (the service's main coroutines, each of which returns after the stop event) until all have
        returned, watching the background tasks meanwhile; the first error of either is raised. Either way the
        ``jobs`` and the lasting background tasks are cancelled on return (they serve the jobs); one-shot tasks
        are left for ``stop``, which may wait for them to finish."""
        main = [asyncio.create_task(job, name=f"{self.owner}-main-{i}") for i, job in enumerate(jobs)]
        try:
            pending: set[asyncio.Task[Any]] = set(main)
            while pending:
                self._started.clear()
                started = asyncio.create_task(self._started.wait())
                watched = pending | {t for t in self._tasks if not t.done()} | {started}
                try:
                    done, _ = await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    started.cancel()
                for task in done & pending:
                    task.result()  # raises the job's error
                pending -= done
                self.raise_if_ended(stopping=not pending)  # with every job done, the lasting tasks may end
        finally:
            lasting = [t for t in self._tasks if t not in self._once]
            for task in main + lasting:
                task.cancel()
            await asyncio.gather(*main, *lasting, return_exceptions=True)
            self._tasks = [t for t in self._tasks if t in self._once]

    async def stop(self) -> None:
        """Cancel every task and wait for them to end (their errors are not raised here)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        self._once.clear()
