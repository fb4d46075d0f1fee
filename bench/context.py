"""The bench's home, ports and default config, its log line, and the context handed to every figure.

The suite never touches a ``make up`` stack or the test-suite's: its Kafka + S3 live in
``.flywheel/bench`` on 29092/29093/29000 and its services on 28xxx; every stack gets a fresh run
name (so fresh topics, consumer groups and store prefix) and a fresh home under
``.flywheel/bench/runs/``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from devstack import REPO_ROOT, InfraEndpoints, ensure_up

BENCH_HOME = REPO_ROOT / ".flywheel" / "bench"


KAFKA_PORT, CONTROLLER_PORT, S3_PORT = 29092, 29093, 29000


ADMIN_PORT, TRAINER_PORT, PARAMSYNC_PORT, SAMPLER_BASE_PORT = 28080, 28101, 28102, 28110


DEFAULT_CONFIG = REPO_ROOT / "configs" / "cartpole.yaml"


def say(msg: str) -> None:
    sys.stdout.write(f"[bench {time.strftime('%H:%M:%S')}] {msg}\n")
    sys.stdout.flush()


@dataclass
class Context:
    """The suite's infra endpoints, a stamp for run names, and the options of this invocation."""

    infra: InfraEndpoints
    stamp: str
    quick: bool = False
    profile: bool = False
    out_dir: Path = field(default_factory=lambda: REPO_ROOT / "docs")
    extend: bool = False  # --extend: keep the earlier entry's seeds that this run does not repeat
    earlier: Mapping[str, Any] | None = None  # the figure's entry before this run (set per figure by the driver)
    _names: set[str] = field(default_factory=set, repr=False)

    def run_name(self, figure: str, suffix: str = "") -> str:
        """A run name no stack of this invocation had: a run redone (``bench.peers.measure``) gets ``-2``, ``-3``
        appended, so it starts fresh (its own topics, consumer group, store prefix and home) instead of resuming
        the first attempt's checkpoint and reading its fragments."""
        base = f"bench-{figure}-{self.stamp}{('-' + suffix) if suffix else ''}".replace("_", "-")
        name, n = base, 1
        while name in self._names:
            n += 1
            name = f"{base}-{n}"
        self._names.add(name)
        return name

    def scale(self, seconds: float) -> float:
        """Window lengths shrink under --quick (a smoke run of the suite, not for the doc)."""
        return max(2.0, seconds / 5.0) if self.quick else seconds


def bench_infra() -> InfraEndpoints:
    return ensure_up(BENCH_HOME, kafka_port=KAFKA_PORT, controller_port=CONTROLLER_PORT,
                     s3_port=S3_PORT, progress=lambda m: None)
