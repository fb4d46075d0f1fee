"""``shared.background.Background``, the one supervisor of every service's background tasks: no task ends
unnoticed, a failure stops the service with its own error, and stop cancels everything."""

from __future__ import annotations

import asyncio

import pytest

from shared.background import Background


class Boom(RuntimeError):
    pass


async def forever() -> None:
    await asyncio.Event().wait()


async def fail_after(s: float) -> None:
    await asyncio.sleep(s)
    raise Boom("the reader broke")


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_failed_task_raises_its_own_error_even_while_stopping() -> None:
    bg = Background("svc")
    bg.start("reader", fail_after(0))
    await settle()
    with pytest.raises(Boom, match="the reader broke"):
        bg.raise_if_ended(stopping=True)
    await bg.stop()


async def test_a_lasting_task_that_ends_or_is_cancelled_before_the_stop_is_an_error_naming_it() -> None:
    bg = Background("svc")
    bg.start("quiet", asyncio.sleep(0))
    await settle()
    bg.raise_if_ended(stopping=True)  # ending at the stop is what lasting tasks do
    with pytest.raises(RuntimeError, match="background task svc-quiet ended"):
        bg.raise_if_ended(stopping=False)
    await bg.stop()
    cancelled = Background("svc")
    cancelled.start("loop", forever()).cancel()
    await settle()
    with pytest.raises(RuntimeError, match="svc-loop was cancelled"):
        cancelled.raise_if_ended(stopping=False)


async def test_a_one_shot_task_is_forgotten_once_it_ended_well_and_raised_if_it_failed() -> None:
    bg = Background("svc")
    bg.start("prune", asyncio.sleep(0), once=True)
    bg.start("loop", forever())
    await settle()
    bg.raise_if_ended(stopping=False)
    bg.raise_if_ended(stopping=False)  # forgotten: no second look at it
    bg.start("prune", fail_after(0), once=True)
    await settle()
    with pytest.raises(Boom):
        bg.raise_if_ended(stopping=False)
    await bg.stop()


async def test_until_done_returns_when_the_main_jobs_do_and_cancels_the_lasting_tasks_not_one_shots() -> None:
    bg = Background("svc")
    loop = bg.start("reader", forever())
    prune = bg.start("prune", asyncio.sleep(0.05), once=True)
    stop = asyncio.Event()

    async def main() -> None:
        await stop.wait()

    asyncio.get_running_loop().call_later(0.01, stop.set)
    await asyncio.wait_for(bg.until_done(main(), main()), 5)
    assert loop.cancelled() and not prune.done()  # the one-shot is left for stop, which may wait for it
    await prune
    await bg.stop()


async def test_until_done_raises_the_first_error_of_a_background_task_and_cancels_the_main_jobs() -> None:
    bg = Background("svc")
    bg.start("inbox", fail_after(0.01))
    stop = asyncio.Event()
    main = asyncio.ensure_future(stop.wait())

    async def job() -> None:
        await main

    with pytest.raises(Boom):
        await asyncio.wait_for(bg.until_done(job()), 5)
    await settle()
    assert main.cancelled()
    await bg.stop()


async def test_until_done_raises_a_main_jobs_error() -> None:
    bg = Background("svc")
    bg.start("inbox", forever())
    with pytest.raises(Boom):
        await asyncio.wait_for(bg.until_done(fail_after(0.01), forever()), 5)
    await bg.stop()


async def test_stop_cancels_every_task_and_swallows_their_errors() -> None:
    bg = Background("svc")
    a, b = bg.start("a", forever()), bg.start("b", fail_after(0))
    await settle()
    await bg.stop()
    assert a.cancelled() and b.done()
    bg.raise_if_ended(stopping=False)  # nothing is left to look at


async def test_until_done_watches_a_one_shot_task_started_while_it_waits() -> None:
    """Paramsync starts its pruning from inside a main job: a failure of it must stop the service at once,
    not at the stop."""
    bg = Background("svc")
    stop = asyncio.Event()

    async def main() -> None:
        bg.start("prune", fail_after(0.01), once=True)
        await stop.wait()

    with pytest.raises(Boom):
        await asyncio.wait_for(bg.until_done(main()), 5)
    assert not stop.is_set()
    await bg.stop()
