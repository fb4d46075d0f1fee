"""What /proc says about one process: its memory (VmRSS, VmHWM) and whether a library is mapped into it.

Standard library only, so that ``bench.memory_probe`` can read its own first stage before anything heavy is
imported; ``bench.machine`` has the CPU side (``cpu_seconds``).
"""

from __future__ import annotations

from pathlib import Path


def memory(pid: int | str = "self") -> dict[str, float]:
    """VmRSS and VmHWM of ``pid`` in MiB (``"self"``: this process); empty when it is gone."""
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) / 1024
    except OSError:
        pass
    return out


def mapped(pid: int, needle: str) -> bool | None:
    """Whether a shared object whose path contains ``needle`` is mapped into ``pid`` (torch imported: libtorch);
    None when it is gone."""
    try:
        return needle in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return None
