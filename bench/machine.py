"""The machine a figure ran on and what it did meanwhile: its description (CPU, cores, commit), the load
average, CPU seconds of one process, of the whole machine and of the suite itself, and reaping exited children so
their CPU is counted.
"""

from __future__ import annotations

import os
import platform
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.context import BENCH_HOME


def machine() -> dict[str, Any]:
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    import torch

    from services.trainer.compute import cpu_info

    flags = cpu_info()[1]
    return {
        "cores": os.cpu_count(),
        "cpu_model": model,
        # The ISA the learner's kernels can use: AVX2/FMA, AVX-512, bf16 (avx512_bf16, amx_bf16), AMX, VNNI.
        "cpu_isa": sorted(f for f in flags if f.startswith(("avx512", "amx")) or f in ("avx2", "fma", "avx_vnni")),
        "mem_gib": mem_gib,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "os": f"{platform.system()} {platform.release()}",
        "commit": _commit(),
    }


def _commit() -> str | None:
    """The code measured: ``git describe`` of the working tree (``-dirty`` with uncommitted changes)."""
    import subprocess

    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def loadavg() -> float:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return float("nan")


def now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_ts(value: str) -> float:
    """An ISO timestamp from a log line -> epoch seconds."""
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


_CLK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` (its threads included), or None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / _CLK


def machine_busy_seconds() -> float:
    """CPU seconds all processes on the machine have used (from /proc/stat): with the stack's own
    processes subtracted, what other work took from the cores during a window."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / _CLK


def reap_children(wait_s: float = 2.0) -> int:
    """Reap this process's exited children (stack processes that were killed or stopped and not yet
    waited for), so their CPU time is counted as the suite's. Returns how many were reaped."""
    reaped, deadline = 0, time.monotonic() + wait_s
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return reaped
        if pid == 0:  # children remain, none has exited yet
            if time.monotonic() >= deadline or not _has_zombie_child():
                return reaped
            time.sleep(0.05)
            continue
        reaped += 1


def _has_zombie_child() -> bool:
    me = str(os.getpid())
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            f = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if f[1] == me and f[0] in ("Z", "X"):
            return True
    return False


def suite_cpu_seconds() -> float:
    """CPU seconds of this bench process, its reaped children (every stack process a figure started and
    stopped) and the bench's Kafka + S3: what the suite itself used."""
    total = 0.0
    try:
        f = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        total += sum(int(x) for x in f[11:15]) / _CLK
    except (OSError, IndexError, ValueError):
        pass
    for name in ("kafka", "s3"):
        try:
            total += cpu_seconds(int((BENCH_HOME / "pids" / f"{name}.pid").read_text().split()[0])) or 0.0
        except (OSError, ValueError, IndexError):
            pass
    return total
