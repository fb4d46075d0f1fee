"""Running a service object inside a test: ``running(svc)`` starts it, runs its loop as a task and stops it;
``until(cond, tasks)`` waits for a condition and raises a service's error if one died meanwhile."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from typing import Any


@asynccontextmanager
async def running(svc: Any, stop_timeout_s: float = 30) -> AsyncIterator[asyncio.Task[None]]:
    stop = asyncio.Event()
    await svc.start()
    task = asyncio.create_task(svc.run(stop))
    try:
        yield task
    finally:
        stop.set()
        await asyncio.wait_for(task, stop_timeout_s)  # a loop whose readers never return by themselves stops
        await svc.stop()


async def until(cond: Callable[[], bool], tasks: asyncio.Task[None] | Iterable[asyncio.Task[None]],
                timeout_s: float = 10, poll_s: float = 0.01) -> None:
    watched = [tasks] if isinstance(tasks, asyncio.Task) else list(tasks)
    async with asyncio.timeout(timeout_s):
        while not cond():
            for task in watched:
                if task.done():
                    task.result()  # a service died: raise its error
            await asyncio.sleep(poll_s)
