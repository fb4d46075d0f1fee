"""What a figure runs with, from the environment: budgets in seconds, the seeds, and under ``--extend`` the
earlier entry's per-seed records pooled with this run's (with a line naming which seeds came from which run).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from bench.context import Context


def env_seconds(name: str, default: float) -> float:
    """Seconds from the environment variable ``name`` (``default`` when unset); anything but a number > 0 is
    a ValueError naming the variable."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: want seconds, a number > 0") from None
    if not value > 0:
        raise ValueError(f"{name}={raw!r}: want seconds, a number > 0")
    return value


def parse_seeds(raw: str, name: str = "seeds") -> tuple[int, ...]:
    """``"N"``: seeds 1..N; ``"4,5"`` or ``"4-5"`` (or a mix, ``"1,4-5"``): exactly those, each once and in order.
    Anything else is a ValueError naming ``name``."""
    seeds: list[int] = []
    try:
        if raw.strip().isdigit():
            seeds = list(range(1, int(raw) + 1))
        else:
            for part in raw.split(","):
                lo, _, hi = part.strip().partition("-")
                seeds.extend(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        seeds = []
    if not seeds or min(seeds) < 1 or len(set(seeds)) != len(seeds):
        raise ValueError(f"{name}={raw!r}: want a count N (seeds 1..N) or distinct seeds >= 1 like '4,5' or '4-5'")
    return tuple(seeds)


def bench_seeds(figure: str, full: int, quick: int, ctx: Context) -> tuple[int, ...]:
    """``FLYWHEEL_BENCH_<FIGURE>_SEEDS`` if set (``parse_seeds``: a count or a list), else seeds 1..``quick``
    under --quick, else 1..``full``."""
    name = f"FLYWHEEL_BENCH_{figure.upper()}_SEEDS"
    if ctx.extend and name not in os.environ:  # the default 1..n would rerun and replace the earlier seeds
        raise ValueError(f"--extend: name the seeds to add with {name} (e.g. {name}=4,5)")
    return parse_seeds(os.environ.get(name, str(quick if ctx.quick else full)), name)


def ran_by(entry: Mapping[str, Any]) -> dict[str, Any]:
    """Where a figure's entry was measured: command, commit, date and CPU (what a per-seed record carries once it
    is kept by a later run that extends the figure)."""
    m = entry.get("machine", {})
    return {"command": entry.get("command"), "commit": m.get("commit"), "date": entry.get("date"),
            "cpu_model": m.get("cpu_model"), "cores": m.get("cores")}


def earlier_runs(ctx: Context, figure: str, seeds: Sequence[int],
                 same: Mapping[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Under ``--extend``: the per-seed records of the figure's earlier entry (``numbers.peers.<peer>.runs``) whose
    seeds this run does not repeat, each tagged with where it ran (``ran``, kept from an earlier merge). The
    earlier entry must have been measured with the ``same`` numbers (a wall budget, an env-step budget), or
    the seeds would not be comparable: a ValueError says which differs, as it does when the peers' kept seeds
    differ. Both are checked before any new seed runs. Without ``--extend``: nothing."""
    if not ctx.extend:
        return {}
    earlier = ctx.earlier or {}
    numbers = earlier.get("numbers") or {}
    if not numbers.get("peers"):
        raise ValueError(f"--extend: {figure} has no earlier result in {ctx.out_dir / 'benchmarks.json'} to extend")
    for key, want in same.items():
        if numbers.get(key) != want:
            raise ValueError(f"--extend: {figure}'s earlier result has {key}={numbers.get(key)!r}, this run "
                             f"{want!r}; seeds measured differently cannot be pooled")
    origin = ran_by(earlier)
    kept: dict[str, list[dict[str, Any]]] = {}
    for peer, body in numbers["peers"].items():
        # a record kept by an earlier merge keeps its origin (top level, or in ``extra`` where a figure puts it)
        kept[peer] = [{**r, "ran": r.get("ran") or (r.get("extra") or {}).get("ran") or origin}
                      for r in body.get("runs", []) if r.get("seed") not in seeds]
    seed_sets = {peer: sorted(r["seed"] for r in v) for peer, v in kept.items()}
    if len({tuple(v) for v in seed_sets.values()}) > 1:
        raise ValueError(f"--extend: {figure}'s earlier result has different seeds per peer ({seed_sets}); "
                         "they cannot be paired")
    return kept


def provenance_md(records: Iterable[Mapping[str, Any]], this_run: str = "this run") -> str:
    """One line naming which seeds came from which run, for a figure pooled from several (empty when every
    record is from this run)."""
    groups: dict[tuple[Any, ...], set[int]] = {}
    for r in records:
        ran = r.get("ran")
        key = (ran["command"], ran["commit"], ran["date"], ran["cpu_model"]) if ran else ()
        groups.setdefault(key, set()).add(int(r["seed"]))
    if set(groups) <= {()}:
        return ""
    parts = []
    for key, seeds in sorted(groups.items(), key=lambda kv: min(kv[1])):
        which = ", ".join(str(s) for s in sorted(seeds))
        if key:
            command, commit, date, cpu = key
            parts.append(f"seeds {which} from `{command}` at commit `{commit}` on {date} ({cpu})")
        else:
            parts.append(f"seeds {which} from {this_run} (its *Ran* line below)")
    return ("Pooled from more than one run (each seed's sides ran one after the other in the same run): "
            + "; ".join(parts) + ".")
