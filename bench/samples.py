"""A run's samples topic read back after it: the fragments' sizes, times and finished episodes, and the
return curve built from them (rolling means, the return at an env-step count, the first time a threshold is
reached).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

from bench.context import Context


@dataclass(frozen=True)
class FragmentInfo:
    created_at: float  # the sampler's wall clock when the fragment was made
    steps: int
    returns: tuple[float, ...]  # returns of the episodes that ended in it
    sampler_id: str
    policy_version: int
    fingerprint: str = ""  # hash of the observations: equal only for identical trajectories


def read_samples(ctx: Context, run: str, timeout_s: float = 60.0, env_id: str = "CartPole-v1") -> list[FragmentInfo]:
    """Every fragment on ``<run>.samples`` (a run of ``env_id``), decoded, sorted by creation time. Read
    after the run, so the reading never competes with the measured processes for CPU."""
    import asyncio

    from aiokafka import AIOKafkaConsumer, TopicPartition

    from shared.fragment import decode_fragment
    from shared.kafka import Topics
    from shared.rl.envs import fragment_spec

    topic = Topics.for_run(run).samples
    spec = fragment_spec(env_id, max_bytes=64 * 1024 * 1024)

    async def go() -> list[FragmentInfo]:
        c = AIOKafkaConsumer(bootstrap_servers=ctx.infra.kafka_bootstrap, enable_auto_commit=False,
                             group_id=None, fetch_max_bytes=64 * 1024 * 1024,
                             max_partition_fetch_bytes=16 * 1024 * 1024)
        await c.start()
        out: list[FragmentInfo] = []
        try:
            parts = c.partitions_for_topic(topic)
            if not parts:
                await c._client.force_metadata_update()  # noqa: SLF001
                parts = c.partitions_for_topic(topic) or set()
            tps = [TopicPartition(topic, p) for p in sorted(parts)]
            c.assign(tps)
            await c.seek_to_beginning(*tps)
            ends = await c.end_offsets(tps)
            done = {tp for tp in tps if ends[tp] == 0}
            deadline = time.monotonic() + timeout_s
            while len(done) < len(tps) and time.monotonic() < deadline:
                polled = await c.getmany(timeout_ms=500, max_records=2000)
                for tp, recs in polled.items():
                    for rec in recs:
                        f = decode_fragment(rec.headers, rec.value, spec)
                        out.append(FragmentInfo(f.created_at, f.steps, tuple(float(r) for r in f.episode_returns),
                                                f.sampler_id, f.policy_version,
                                                hashlib.blake2b(f.obs.tobytes(), digest_size=8).hexdigest()))
                        if rec.offset + 1 >= ends[tp]:
                            done.add(tp)
        finally:
            await c.stop()
        out.sort(key=lambda f: f.created_at)
        return out

    return asyncio.run(go())


def episode_curve(frags: list[FragmentInfo]) -> list[tuple[float, int, float]]:
    """(seconds since the first fragment, env steps so far, return) for every finished episode,
    in the order the fragments were made."""
    if not frags:
        return []
    t0 = frags[0].created_at
    steps = 0
    out: list[tuple[float, int, float]] = []
    for f in frags:
        steps += f.steps
        for r in f.returns:
            out.append((f.created_at - t0, steps, r))
    return out


def rolling_mean(curve: list[tuple[float, int, float]], n: int) -> list[tuple[float, int, float]]:
    """(t, steps, mean of the last ``n`` returns) from the n-th episode on."""
    out: list[tuple[float, int, float]] = []
    window: list[float] = []
    total = 0.0
    for t, steps, r in curve:
        window.append(r)
        total += r
        if len(window) > n:
            total -= window.pop(0)
        if len(window) == n:
            out.append((t, steps, total / n))
    return out


def return_at_steps(curve: list[tuple[float, int, float]], steps: int, n: int = 100) -> float:
    """Mean of the last ``n`` episodes finished within the first ``steps`` env steps."""
    rs = [r for _, s, r in curve if s <= steps][-n:]
    return sum(rs) / len(rs) if rs else float("nan")


def seconds_to_steps(frags: list[FragmentInfo], steps: int) -> float:
    """Seconds from the first fragment's creation to the one that brought the env steps to ``steps``
    (NaN when they never got there)."""
    total = 0
    for f in frags:
        total += f.steps
        if total >= steps:
            return f.created_at - frags[0].created_at
    return float("nan")


def first_reaching(means: list[tuple[float, int, float]], threshold: float) -> tuple[float, int] | None:
    """(seconds, env steps) of the first point of a running-mean curve at or above ``threshold``."""
    for t, steps, m in means:
        if m >= threshold:
            return t, steps
    return None
