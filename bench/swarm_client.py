"""``python -m bench.swarm_client --first I --count K --out FILE``: K sampler identities in one process, for the
``swarm`` figure (bench/figures/swarm.py).

Each identity speaks Kafka as a sampler does (services/sampler/service.py), with a cheap environment:

- its own sampler id (``swarm-<i>``) and ``sampler-seq`` incarnation: its own :class:`~shared.credits.CreditGate`,
  fed only the grants of its credits partition (:func:`~shared.credits.shard_of`), and it sends only while the
  gate is open;
- fragments through the sampler's own :class:`~services.sampler.sender.FragmentSender` (the real headers, the
  safetensors payload, the sequence header, the credit accounting of lost sends); the fragment is synthetic
  (CartPole-shaped, ``env.fragment_steps x env.num_envs`` steps, made in ``--collect-s`` of sleep, like a
  latency-bound env, with no CPU spent on an env or a policy);
- it adopts the announcements of ``<run>.policy`` between fragments (at once while waiting for credits), and
  sends a heartbeat on every adoption and every ``sampler.heartbeat_interval_s``, as the sampler does (paramsync
  measures sync latency from them).

What the identities of one process share (so that 1,000 of them fit on the 2 cores at all): one producer and,
with ``--readers shared`` (the default), one consumer of the credits partitions that its identities belong to
(each grant is parsed once and handed to the gates of that partition's identities only) and one reader of
``<run>.policy`` (an announcement's signature and inline weights are checked once, then offered to every
identity): the broker then serves each credits partition and the policy topic once per swarm process, not once
per identity. With ``--readers own`` each identity reads as a real sampler does, with consumers of its own: one
of its credits partition, one of ``<run>.control`` (its commands are not acted on), one of ``<run>.policy``
(checking each announcement itself), so the brokers serve every reader: the fan-out's cost. Not done per
identity: the store marker poll, the runtime-settings and pause reads (every ``sync_interval_s`` per sampler: 500
store GETs a second at 1,000), the backlog probe (off unless ``max_backlog``).

On SIGTERM (or after ``--seconds``) it writes ``--out``: per policy version how many identities came to act on
it (or a newer one) and when the first and the last did (epoch seconds), and the fragments sent.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from services.sampler.sender import FragmentSender
from services.sampler.service import POLICY_HISTORY
from shared.bus import Record, TopicTail, kafka_bus
from shared.credits import CreditGate, shard_of
from shared.fragment import Fragment
from shared.kafka import Topics
from shared.logging import configure_logging, get_logger
from shared.messages import CreditGrant, InlineMismatch, PolicyMessage, SamplerBeat
from shared.retry import Health, Retrier, read_forever, stop_clients
from shared.settings import Settings, load_settings
from shared.signing import PolicyVerifier, SignatureRefused


def identity_ids(first: int, count: int) -> list[str]:
    return [f"swarm-{i}" for i in range(first, first + count)]


class Adoptions:
    """Per policy version: how many identities came to act on it or a newer one, first and last time."""

    def __init__(self) -> None:
        self.by_version: dict[int, list[float]] = {}  # version -> [count, first t, last t]

    def note(self, before: int | None, now_version: int, t: float) -> None:
        """An identity went from ``before`` (None: no policy yet) to ``now_version`` at ``t``: it now acts on
        every version in between (it skipped to the newest, as a sampler does)."""
        lo = now_version if before is None else before + 1
        for v in range(lo, now_version + 1):
            e = self.by_version.get(v)
            if e is None:
                self.by_version[v] = [1, t, t]
            else:
                e[0] += 1
                e[1] = min(e[1], t)
                e[2] = max(e[2], t)

    def as_dict(self) -> dict[str, list[float]]:
        return {str(v): e for v, e in sorted(self.by_version.items())}


def synthetic_fragment(settings: Settings, sampler_id: str, version: int, rng: np.random.Generator) -> Fragment:
    """A CartPole-shaped fragment (``fragment_steps x num_envs``; one episode ends in env 0 at the last step)."""
    t, n = settings.env.fragment_steps, settings.env.num_envs
    term = np.zeros((t, n), np.uint8)
    term[-1, 0] = 1
    return Fragment(obs=rng.standard_normal((t, n, 4), dtype=np.float32) * 0.05,
                    actions=rng.integers(0, 2, (t, n)).astype(np.int64),
                    logp=np.full((t, n), np.log(0.5), np.float32), rewards=np.ones((t, n), np.float32),
                    terminated=term, truncated=np.zeros((t, n), np.uint8), trunc_obs=np.zeros((0, 4), np.float32),
                    last_obs=np.zeros((n, 4), np.float32), episode_returns=np.array([float(t)], np.float32),
                    episode_lengths=np.array([t], np.int32), policy_version=version, sampler_id=sampler_id,
                    env_id=settings.env.id)


class Identity:
    def __init__(self, swarm: Swarm, sampler_id: str) -> None:
        self.swarm = swarm
        self.id = sampler_id
        self.gate = CreditGate(sampler_id)
        self.version: int | None = None
        self.offered: int | None = None
        self.adopted_at: float | None = None
        self.collecting = False
        self.wake = asyncio.Event()
        health = Health("sampler")
        log = get_logger(sampler_id=sampler_id)
        self.sender = FragmentSender(swarm.producer, swarm.topics.samples, self.gate, swarm.settings, health=health,
                                     retry=Retrier(health, log), log=log, labels={"sampler": sampler_id})

    def offer(self, version: int) -> None:
        if self.offered is None or version > self.offered:
            self.offered = version
            if not self.collecting:
                self.adopt()

    def adopt(self) -> None:
        if self.offered is None or (self.version is not None and self.offered <= self.version):
            return
        now = time.time()
        self.swarm.adoptions.note(self.version, self.offered, now)
        self.version, self.adopted_at = self.offered, now
        self.swarm.beat(self)  # paramsync measures sync latency from this
        self.wake.set()

    async def run(self, stop: asyncio.Event) -> None:
        rng = np.random.default_rng(abs(hash(self.id)) % 2**32)
        while not stop.is_set() and self.version is None:
            self.wake.clear()
            await self.swarm.wait(self.wake, stop)
        while not stop.is_set():
            if not self.gate.open():
                self.wake.clear()
                await self.swarm.wait(self.wake, stop)
                continue
            self.collecting = True
            version = self.version
            assert version is not None
            await asyncio.sleep(self.swarm.collect_s)
            self.collecting = False
            if stop.is_set():
                break
            await self.sender.send(synthetic_fragment(self.swarm.settings, self.id, version, rng))
            self.adopt()  # between fragments: a version announced meanwhile


class Swarm:
    def __init__(self, settings: Settings, ids: list[str], collect_s: float, readers: str = "shared") -> None:
        self.settings = settings
        self.topics = Topics.for_run(settings.run)
        self.collect_s = collect_s
        self.bus = kafka_bus(settings)
        self.producer = self.bus.publisher
        self.adoptions = Adoptions()
        self.identities = [Identity(self, i) for i in ids]
        shards = settings.kafka.credits_partitions
        self.by_shard: dict[int, list[Identity]] = {}
        for ident in self.identities:
            self.by_shard.setdefault(shard_of(ident.id, shards), []).append(ident)
        self.readers: list[tuple[str, TopicTail, Callable[[Record], None]]] = []
        """(name, tail, handler) of every consumer this process runs."""
        if readers == "shared":
            self.readers = [
                ("credits", self.bus.tail(self.topics.credits, partitions={self.topics.credits: sorted(self.by_shard)}),
                 lambda rec: self.on_grant(rec, self.by_shard.get(rec.partition, ()))),
                ("policy", self.bus.tail(self.topics.policy, history=POLICY_HISTORY),
                 lambda rec: self.on_announcement(rec, self.identities))]
        elif readers == "own":
            for ident in self.identities:
                shard = shard_of(ident.id, shards)
                self.readers += [
                    (f"credits:{ident.id}", self.bus.tail(self.topics.credits,
                                                          partitions={self.topics.credits: [shard]}),
                     lambda rec, only=(ident,): self.on_grant(rec, only)),
                    (f"control:{ident.id}", self.bus.tail(self.topics.control), lambda rec: None),
                    (f"policy:{ident.id}", self.bus.tail(self.topics.policy, history=POLICY_HISTORY),
                     lambda rec, only=(ident,): self.on_announcement(rec, only))]
        else:
            raise ValueError(f"readers {readers!r}: shared or own")
        self.verifier = PolicyVerifier.from_settings(settings)
        self.log = get_logger(swarm=ids[0] if ids else "")
        self.started_at = time.time()
        self.grants = self.announced = self.refused = self.beats = self.beats_failed = 0
        self._pending: set[asyncio.Task[Any]] = set()

    @staticmethod
    async def wait(event: asyncio.Event, stop: asyncio.Event, timeout: float = 0.5) -> None:
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except TimeoutError:
            pass

    def on_grant(self, rec: Record, identities: Iterable[Identity]) -> None:
        """A grant of ``rec.partition``, handed to the gates of ``identities`` (those of that partition)."""
        if rec.value is None:
            return
        try:
            g = CreditGrant.model_validate_json(rec.value)
        except ValueError:
            return
        self.grants += 1
        now = time.monotonic()
        for ident in identities:
            ident.gate.grant(g, now)
            if ident.gate.open():
                ident.wake.set()

    def on_announcement(self, rec: Record, identities: Iterable[Identity]) -> None:
        if rec.value is None:
            return
        try:
            msg = PolicyMessage.model_validate_json(rec.value)
        except ValueError:
            return
        if msg.type != "announce":
            return
        try:
            self.verifier.check_message(msg)
            msg.inline_weights()  # checked against its sha256 (the weights themselves are not used)
        except (SignatureRefused, InlineMismatch):
            self.refused += 1
            return
        self.announced += 1
        for ident in identities:
            ident.offer(msg.version)

    def beat(self, ident: Identity) -> None:
        beat = SamplerBeat(id=ident.id, policy_version=ident.version, adopted_at=ident.adopted_at,
                           credits_window=ident.gate.allowed, credits_in_flight=ident.gate.in_flight,
                           fragments=ident.sender.fragments, env_steps=ident.sender.env_steps,
                           started_at=self.started_at)
        task = asyncio.ensure_future(self.producer.send(self.topics.heartbeats, beat.to_bytes(),
                                                        key=ident.id.encode()))
        self._pending.add(task)
        self.beats += 1
        task.add_done_callback(self._beat_done)

    def _beat_done(self, task: asyncio.Future[Any]) -> None:
        """A heartbeat the producer could not take (its buffer full for ``request_timeout_ms``: the brokers
        are behind) is counted, as the sampler skips it until the next beat."""
        self._pending.discard(task)
        if task.cancelled() or task.exception() is not None:
            self.beats_failed += 1

    async def heartbeats(self, stop: asyncio.Event) -> None:
        """Every identity beats every ``heartbeat_interval_s``, spread over the interval."""
        interval = self.settings.sampler.heartbeat_interval_s
        n = max(1, len(self.identities))
        while not stop.is_set():
            for ident in self.identities:
                if stop.is_set():
                    return
                if ident.version is not None:
                    self.beat(ident)
                await asyncio.sleep(interval / n)

    async def run(self, stop: asyncio.Event) -> None:
        await self.bus.create_topics()
        await self.producer.start()
        starting = asyncio.Semaphore(16)  # a thousand consumers' first metadata requests, not all at once

        async def start(tail: TopicTail) -> None:
            async with starting:
                await tail.start()

        await asyncio.gather(*(start(tail) for _, tail, _ in self.readers))
        tasks = [asyncio.create_task(read_forever(tail, handler, name=name, log=self.log))
                 for name, tail, handler in self.readers]
        tasks.append(asyncio.create_task(self.heartbeats(stop)))
        tasks += [asyncio.create_task(ident.run(stop)) for ident in self.identities]
        await stop.wait()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def close(self) -> None:
        """Close the producer and every consumer, all at once (a thousand one by one take minutes)."""
        clients = [self.producer, *(tail for _, tail, _ in self.readers)]
        await asyncio.gather(*(stop_clients([c], self.log) for c in clients))

    def result(self) -> dict[str, Any]:
        return {"identities": len(self.identities), "consumers": len(self.readers),
                "adoptions": self.adoptions.as_dict(),
                "fragments": sum(i.sender.fragments for i in self.identities), "grants_read": self.grants,
                "announcements": self.announced, "refused": self.refused, "heartbeats": self.beats,
                "heartbeats_failed": self.beats_failed,
                "without_policy": sum(1 for i in self.identities if i.version is None)}


async def amain(args: argparse.Namespace) -> None:
    settings = load_settings()
    configure_logging("swarm", settings.run, level="WARNING")
    swarm = Swarm(settings, identity_ids(args.first, args.count), args.collect_s, args.readers)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    if args.seconds > 0:
        loop.call_later(args.seconds, stop.set)
    try:
        await swarm.run(stop)
    finally:  # the result first: closing a thousand consumers is not part of what was measured
        tmp = args.out.with_suffix(f".{uuid.uuid4().hex[:6]}.tmp")
        tmp.write_text(json.dumps(swarm.result()))
        tmp.replace(args.out)
        await swarm.close()


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.swarm_client")
    p.add_argument("--first", type=int, required=True)
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--collect-s", type=float, default=0.02)
    p.add_argument("--seconds", type=float, default=0.0)
    p.add_argument("--readers", choices=["shared", "own"], default="shared",
                   help="one credits and one policy consumer per process (shared) or per identity (own)")
    asyncio.run(amain(p.parse_args()))


if __name__ == "__main__":
    main()
