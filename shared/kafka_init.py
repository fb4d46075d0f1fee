"""Provision a run on Kafka: its topics and every role's ACLs, as a Kafka super user, once.

What docker-compose.yml's ``kafka-init`` job runs on every ``docker compose up``, and the Kubernetes ``local``
overlay's ``acls`` sidecar each time the Kafka pod starts: in the Flywheel image, as the anonymous super user of
the broker's loopback PLAINTEXT listener (in the broker's network namespace or pod). It exits 0 when the topics and
the ACLs exist (idempotent: existing ones are kept). What each role may do is not written here:
it is :func:`shared.acl.role_acls`, created by :func:`shared.acl.provision_run` for the run and the topics
that the settings name (``FLYWHEEL_CONFIG`` plus ``FLYWHEEL_*`` variables, as for the services).

Invariants: a broker that is not reachable yet, or times out, is retried with capped, jittered backoff for
at most ``deadline_s``; a refusal (:class:`shared.acl.AclError`: no authorizer, not a super user) or bad
settings stop it at once with exit status 2 and the reason, since retrying cannot fix them.

    python -m shared.kafka_init [--deadline-s 120]   # exit 0: done; 1: broker unreachable until the deadline;
                                                    # 2: refused or bad settings
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections.abc import Awaitable, Callable

from aiokafka.errors import KafkaConnectionError, KafkaTimeoutError, NodeNotReadyError

from shared.acl import AclError, provision_run
from shared.settings import ConfigError, Settings, load_settings

TRANSIENT = (OSError, TimeoutError, KafkaConnectionError, KafkaTimeoutError, NodeNotReadyError)
"""What a broker that is starting, restarting or unreachable raises: worth another attempt."""


class Backoff:
    """Capped exponential backoff with full jitter: attempt ``n`` waits uniformly in ``[0, min(cap, base * 2**n)]``."""

    def __init__(self, base_s: float = 0.5, cap_s: float = 10.0) -> None:
        if base_s <= 0 or cap_s < base_s:
            raise ValueError(f"need 0 < base_s <= cap_s, got base_s={base_s}, cap_s={cap_s}")
        self.base_s, self.cap_s = base_s, cap_s

    def delay(self, attempt: int, rng: random.Random) -> float:
        return rng.uniform(0.0, min(self.cap_s, self.base_s * 2**attempt))


async def run_with_retries(step: Callable[[], Awaitable[object]], deadline_s: float, backoff: Backoff,
                           rng: random.Random, log: Callable[[str], None],
                           sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                           clock: Callable[[], float] = time.monotonic) -> None:
    """Await ``step()`` until it succeeds. Transient errors (:data:`TRANSIENT`) are retried, each after a
    :class:`Backoff` pause, until ``deadline_s`` seconds of ``clock`` have passed since the first attempt; then
    the last one is raised. :class:`AclError` and ``ValueError`` (a refusal, bad settings) are never retried."""
    started, attempt = clock(), 0
    while True:
        try:
            await step()
            return
        except (AclError, ValueError):
            raise
        except TRANSIENT as exc:
            if clock() - started >= deadline_s:
                raise
            pause = backoff.delay(attempt, rng)
            log(f"kafka-init: broker not ready ({type(exc).__name__}: {exc}); retrying in {pause:.1f} s")
            await sleep(pause)
            attempt += 1


def main(deadline_s: float = 120.0) -> int:
    """Provision the run of the environment's settings; the exit status of the module docstring."""
    try:
        settings: Settings = load_settings()
    except ConfigError as exc:
        sys.stderr.write(f"kafka-init: invalid settings: {exc}\n")
        return 2
    granted: dict[str, int] = {}

    async def step() -> None:
        acls = await provision_run(settings)
        granted.update({role: len(rules) for role, rules in acls.items()})

    def log(line: str) -> None:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()

    try:
        asyncio.run(run_with_retries(step, deadline_s, Backoff(), random.Random(), log))
    except (AclError, ValueError) as exc:
        log(f"kafka-init: refused: {exc}")
        return 2
    except Exception as exc:  # noqa: BLE001 - the transient error that outlived the deadline
        log(f"kafka-init: Kafka at {settings.kafka.bootstrap} not usable after {deadline_s:.0f} s: "
            f"{type(exc).__name__}: {exc}")
        return 1
    roles = ", ".join(f"{role} ({n} ACLs)" for role, n in sorted(granted.items()))
    sys.stdout.write(f"kafka-init: run {settings.run}: topics and ACLs in place for {roles}\n")
    return 0


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shared.kafka_init", description=__doc__.split("\n\n")[0])
    parser.add_argument("--deadline-s", type=float, default=120.0,
                        help="retry an unreachable broker this long, then exit 1 (default 120)")
    args = parser.parse_args(argv)
    if not args.deadline_s >= 0:
        parser.error(f"--deadline-s {args.deadline_s}: want seconds >= 0")
    return main(args.deadline_s)


if __name__ == "__main__":
    sys.exit(cli())
