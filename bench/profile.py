"""Summarise a py-spy collapsed-stack file (``py-spy record -f raw``): ``python -m bench.profile FILE [N]``.

Prints, per thread, its share of the samples, then the functions by inclusive share (a function
counted once per stack) - enough to see where a service's CPU goes without a flame-graph viewer.
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path


def summarise(path: Path, top: int = 40) -> str:
    total = 0
    threads: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        threads[frames[0].split(": ", 1)[-1]] += n
        seen: set[str] = set()
        for f in frames[1:]:
            fn = f.split(" (")[0]
            where = f.split(" (")[1].split(":")[0] if " (" in f else ""
            key = f"{fn} ({where})"
            if key not in seen:
                incl[key] += n
                seen.add(key)
    out = [f"{path}: {total} samples"]
    out += [f"  thread {t}: {100 * c / total:.1f}%" for t, c in threads.most_common()]
    out += [f"  {100 * c / total:5.1f}%  {f}" for f, c in incl.most_common(top)]
    return "\n".join(out)


if __name__ == "__main__":
    print(summarise(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 40))
