"""HalfCheetah-v5 (MuJoCo) at a fixed budget of 300k env steps: the return reached and the wall time taken,
Flywheel on the local stack (2 samplers) against Stable-Baselines3 PPO with rl-zoo's HalfCheetah settings.

Per seed, SB3 first (``bench.peers.sb3_mujoco``, a fresh process), then Flywheel, never two at once. Flywheel
runs ``configs/halfcheetah.yaml`` with rl-zoo's values written over it wherever Flywheel can express them
(``zoo_overrides``: the same numbers as that file except the value-loss weight, which is doubled because
Flywheel's value loss is 0.5 x MSE and SB3's is MSE); ``NOT_SHARED`` lists what stays different.

Both are measured from the episodes their behaviour policy finished: the return at the budget is the mean
raw return of the last ``LAST_N`` episodes that ended within the first ``budget`` env steps
(``return_at_budget``), the wall time is from the first env step to the ``budget``-th.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import asdict, dataclass, field, fields
from functools import partial
from pathlib import Path
from typing import Any

import yaml

from bench.context import BENCH_HOME, Context, say
from bench.peers import flywheel_peer, sb3_mujoco
from bench.peers.measure import guarded
from bench.peers.stats import MedianCI
from bench.report import FigureResult, Row
from bench.samples import FragmentInfo, episode_curve, read_samples
from bench.seeds import bench_seeds, earlier_runs, provenance_md
from bench.stack import BenchStack
from devstack import REPO_ROOT

NAME = "peers_mujoco"
TITLE = ("HalfCheetah-v5 (MuJoCo) at 300k env steps: return of the last 10 training episodes and wall time, "
         "Flywheel (local stack, 2 samplers) against Stable-Baselines3 PPO with rl-zoo's settings; start-up shown, "
         "one machine, each seed's sides one after the other.")
TARGET = "Flywheel's return at 300k >= SB3-zoo's, in less wall time"
EXTENDS = True  # `--extend` pools new seeds with the earlier entry's (``earlier_runs``)
BUDGET = 300_000
QUICK_BUDGET = 20_000
LAST_N = 10
SAMPLERS = flywheel_peer.SAMPLERS
BASE_CONFIG = REPO_ROOT / "configs" / "halfcheetah.yaml"
PEERS = ("SB3 PPO (rl-zoo)", "Flywheel (rl-zoo)")

Curve = list[tuple[float, int, float]]  # (seconds since the first env step, env steps so far, episode return)

NOT_SHARED = (
    "the rollout: Flywheel's 512 env steps an update come from 2 samplers x 1 env x 256 steps (two shorter "
    "trajectories, GAE cut at 256); SB3's from 1 env x 512 steps",
    "asynchrony: Flywheel's samplers act on a policy a few versions old (max_staleness 4, credit flow control) "
    "and the trainer corrects for it with the config's objective (decoupled PPO: clip around the update's "
    "starting policy, truncated importance weight to the behaviour policy); SB3 collects with the current "
    "policy and clips against it",
    "observation normalisation: Flywheel's statistics are the trainer's, updated from each trained batch and "
    "published with the weights (a sampler normalises as its policy version was trained); SB3's VecNormalize "
    "updates them at every env step. Both clip to +-10; rewards are scaled by the running std of the "
    "discounted return (gamma 0.98) and clipped to +-10 on both sides",
    "the value loss: Flywheel's is 0.5 x MSE, SB3's is MSE, so Flywheel runs vf_coef 2 x 0.58096 (same gradient)",
    "the processes: SB3 is one process (1 torch thread); Flywheel is a trainer (1 torch thread), 2 samplers, "
    "paramsync, admin, Kafka and the S3 server on the same cores",
)


# ---- pure: the budget cut ----------------------------------------------------------------------
def cut_curve(curve: Curve, budget: int) -> Curve:
    """The episodes that ended within the first ``budget`` env steps (``curve`` in the order they ended)."""
    return [c for c in curve if c[1] <= budget]


def return_at_budget(curve: Curve, budget: int, n: int = LAST_N) -> float | None:
    """Mean return of the last ``n`` episodes that ended within ``budget`` env steps (fewer if fewer ended);
    None when none did."""
    rs = [r for _, _, r in cut_curve(curve, budget)][-n:]
    return sum(rs) / len(rs) if rs else None


def seconds_to_budget(frags: list[FragmentInfo], budget: int) -> float | None:
    """Seconds from the first fragment's creation to the creation of the one holding the ``budget``-th env
    step (``frags`` in creation order); None when the fragments never got there."""
    total = 0
    for f in frags:
        total += f.steps
        if total >= budget:
            return f.created_at - frags[0].created_at
    return None


# ---- pure: what Flywheel takes from the zoo -------------------------------------------------------
def zoo_overrides(entry: dict[str, Any] = sb3_mujoco.ZOO_HALFCHEETAH,
                  samplers: int = SAMPLERS) -> dict[str, dict[str, Any]]:
    """The ``env`` and ``trainer`` settings that give Flywheel rl-zoo's ``entry``: ``n_steps`` per update from
    ``samplers`` samplers x 1 env (``fragment_steps = n_steps / samplers``, ``batch_fragments = samplers``),
    minibatches of ``batch_size``, constant learning rate and clip, the value-loss weight doubled (Flywheel's
    value loss is 0.5 x MSE, SB3's MSE), log_std_init, the width of the two hidden layers, their activation and
    whether they start orthogonal (SB3's default: yes)."""
    n_steps, batch = int(entry["n_steps"]), int(entry["batch_size"])
    if int(entry["n_envs"]) != 1 or n_steps % samplers or n_steps % batch:
        raise ValueError(f"zoo entry must split evenly: n_envs={entry['n_envs']}, {n_steps=}, {batch=}, {samplers=}")
    pk = entry["policy_kwargs"]
    arch = pk["net_arch"]
    if arch["pi"] != arch["vf"] or len(arch["pi"]) != 2 or arch["pi"][0] != arch["pi"][1]:
        raise ValueError(f"Flywheel's MLP has two equal hidden layers for actor and critic: net_arch={arch}")
    activation = {"ReLU": "relu", "Tanh": "tanh"}.get(str(pk.get("activation_fn", "Tanh")))  # SB3's default: Tanh
    if activation is None:
        raise ValueError(f"Flywheel's MLP is tanh or relu: activation_fn={pk['activation_fn']!r}")
    return {
        "env": {"num_envs": 1, "fragment_steps": n_steps // samplers},
        "trainer": {"batch_fragments": samplers, "minibatches": n_steps // batch, "epochs": entry["n_epochs"],
                    "learning_rate": entry["learning_rate"], "learning_rate_end": None,
                    "clip_coef": entry["clip_range"], "clip_coef_end": None, "target_kl": None,
                    "ent_coef": entry["ent_coef"], "vf_coef": 2 * entry["vf_coef"],
                    "max_grad_norm": entry["max_grad_norm"], "gamma": entry["gamma"],
                    "gae_lambda": entry["gae_lambda"], "log_std_init": float(pk["log_std_init"]),
                    "hidden": arch["pi"][0], "activation": activation, "ortho_init": bool(pk.get("ortho_init", True)),
                    "model": "mlp", "normalize_advantages": True,
                    "normalize_observations": bool(entry["normalize"]),
                    "normalize_rewards": bool(entry["normalize"])},
    }


def zoo_config(dest: Path, base: Path = BASE_CONFIG) -> Path:
    """``base`` with ``zoo_overrides()`` written over it, saved to ``dest``."""
    data: dict[str, Any] = yaml.safe_load(base.read_text())
    for section, values in zoo_overrides().items():
        data[section] = {**data.get(section, {}), **values}
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text("# generated by bench.figures.peers_mujoco.zoo_config: configs/halfcheetah.yaml with rl-zoo's "
                    "HalfCheetah PPO values\n" + yaml.safe_dump(data, sort_keys=False))
    return dest


def describe_flywheel(config: Path) -> str:
    from shared.settings import load_settings

    o, tr = zoo_overrides(), load_settings(config, environ={}).trainer
    return (f"{SAMPLERS} samplers x " + ", ".join(f"{k} {v}" for k, v in o["env"].items()) + "; trainer "
            + ", ".join(f"{k} {v}" for k, v in o["trainer"].items())
            + f" (rest of configs/halfcheetah.yaml unchanged: objective {tr.objective}, max_staleness "
              f"{tr.max_staleness}, flow_window {tr.flow_window})")


# ---- one run ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class BudgetRun:
    """One peer's run to ``budget`` env steps. ``wall_s``: first env step to the ``budget``-th (None: not
    reached, counted as inf); ``return_at_budget``: see ``return_at_budget`` (None: no episode ended);
    ``startup_s``: starting the peer to its first env step (SB3: to ``learn()``)."""

    peer: str
    seed: int
    budget: int
    startup_s: float | None
    wall_s: float | None
    return_at_budget: float | None
    episodes: int  # episodes that ended within the budget
    env_steps: int  # env steps made in all (may pass the budget)
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def steps_per_s(self) -> float | None:
        return None if not self.wall_s else self.budget / self.wall_s

    @property
    def end_to_end_s(self) -> float | None:
        return None if self.startup_s is None or self.wall_s is None else self.startup_s + self.wall_s

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"steps_per_s": self.steps_per_s, "end_to_end_s": self.end_to_end_s}

    @classmethod
    def from_record(cls, d: dict[str, Any]) -> BudgetRun:
        """A run from its ``as_dict`` record (an earlier entry's, kept by ``--extend``; its ``ran`` goes to
        ``extra``)."""
        names = {f.name for f in fields(cls)}
        run = cls(**{k: v for k, v in d.items() if k in names})
        return run if "ran" not in d else BudgetRun(**{**asdict(run), "extra": {**run.extra, "ran": d["ran"]}})


def from_curve(peer: str, seed: int, budget: int, startup_s: float | None, wall_s: float | None, curve: Curve,
               env_steps: int, error: str | None = None, extra: dict[str, Any] | None = None) -> BudgetRun:
    """A ``BudgetRun`` from a peer's episode curve; a run that fell short of the budget is an error."""
    if error is None and (wall_s is None or env_steps < budget):
        error = f"reached {env_steps:,} of {budget:,} env steps"
    return BudgetRun(peer, seed, budget, startup_s, wall_s, return_at_budget(curve, budget),
                     len(cut_curve(curve, budget)), env_steps, error, extra or {})


def run_sb3(seed: int, budget: int, timeout_s: float) -> BudgetRun:
    r = sb3_mujoco.run_seed(seed, steps=budget, timeout_s=timeout_s)
    return from_curve(PEERS[0], seed, budget, r.startup_s, r.budget_s, r.curve, r.env_steps, r.error,
                      {"learn_s": r.learn_s, "episodes_all": r.episodes, "last10_reported": r.last10})


def run_flywheel(ctx: Context, seed: int, config: Path, budget: int, timeout_s: float) -> BudgetRun:
    """The stack with ``config``, stopped once the trainer has trained ``budget`` env steps (admin /status) or
    ``timeout_s`` after the first fragment; every fragment is then read back from ``<run>.samples``."""
    run = ctx.run_name("peers-mujoco", f"fw-seed{seed}")
    trained = 0

    def keep_going(st: BenchStack, t: float) -> bool:
        nonlocal trained
        try:
            trained = int(st.status()["trainer"]["samples_trained"])
        except Exception:  # a busy admin: ask again; the samples decide afterwards anyway
            pass
        return t < timeout_s and trained < budget

    ran = flywheel_peer.run_stack(ctx, run, seed, config, keep_going, poll_s=2.0)
    startup, error = ran.startup_s, ran.error
    frags = read_samples(ctx, run, env_id=sb3_mujoco.ENV_ID) if startup is not None else []
    sampled = sum(f.steps for f in frags)
    if error is None and sampled < budget:  # the samples decide; the trainer's count only said when to stop
        error = f"timed out after {timeout_s:.0f} s: {sampled:,} env steps sampled, {trained:,} trained"
    return from_curve(PEERS[1], seed, budget, startup, seconds_to_budget(frags, budget), episode_curve(frags),
                      sampled, error, {"fragments": len(frags), "trained_at_stop": trained, "run": run})


# ---- the figure ------------------------------------------------------------------------------
@dataclass(frozen=True)
class PeerSummary:
    """Over seeds: the return at the budget (median and range of the runs that have one), and medians with
    order-statistic intervals of wall s (failed runs = inf), start-up s and env steps/s."""

    returns: list[float]
    wall: MedianCI
    startup: MedianCI
    steps_per_s: MedianCI
    ok: int
    n: int

    @classmethod
    def of(cls, runs: list[BudgetRun]) -> PeerSummary:
        return cls([r.return_at_budget for r in runs if r.return_at_budget is not None and r.error is None],
                   MedianCI.of(r.wall_s if r.error is None else None for r in runs),
                   MedianCI.of(r.startup_s for r in runs if r.startup_s is not None),
                   MedianCI.of(r.steps_per_s for r in runs if r.steps_per_s is not None),
                   sum(1 for r in runs if r.error is None), len(runs))

    @property
    def return_median(self) -> float | None:
        return statistics.median(self.returns) if self.returns else None

    def return_fmt(self) -> str:
        if not self.returns:
            return "n/a"
        body = f"{statistics.median(self.returns):,.0f}"
        return body + (f" [{min(self.returns):,.0f}, {max(self.returns):,.0f}]" if len(self.returns) > 1 else "")

    def as_dict(self) -> dict[str, Any]:
        return {"return_at_budget": {"median": self.return_median, "min": min(self.returns, default=None),
                                     "max": max(self.returns, default=None), "values": self.returns},
                "wall_s": self.wall, "startup_s": self.startup, "steps_per_s": self.steps_per_s,
                "ok": self.ok, "n": self.n}


def verdict(fw: PeerSummary, sb3: PeerSummary) -> tuple[bool | None, bool | None]:
    """(Flywheel's median return >= SB3's, Flywheel's median wall s < SB3's): None where SB3 has no finished
    run to compare with; False where Flywheel has a failed run (a failure never meets a target)."""
    if sb3.return_median is None or sb3.ok == 0:
        return None, None
    if fw.ok < fw.n or fw.return_median is None:
        return False, False
    return fw.return_median >= sb3.return_median, fw.wall.median < sb3.wall.median


def why_missed(fw_runs: list[BudgetRun], sb3_runs: list[BudgetRun], budget: int) -> str:
    """What the runs themselves say about a missed return target: by how much, on how many seeds, and whether
    the gap is outside the runs' spread; empty when the return target is met or cannot be judged."""
    fw, sb3 = PeerSummary.of(fw_runs), PeerSummary.of(sb3_runs)
    better, _ = verdict(fw, sb3)
    if better is not False or fw.return_median is None or sb3.return_median is None:
        return ""
    gap = fw.return_median - sb3.return_median
    paired = [(f, b) for f, b in zip(fw_runs, sb3_runs, strict=True)
              if f.return_at_budget is not None and b.return_at_budget is not None]
    ahead = sum(1 for f, b in paired if f.return_at_budget >= b.return_at_budget)  # type: ignore[operator]
    below = [f for f in fw_runs if f.return_at_budget is not None and f.return_at_budget < min(sb3.returns)]
    overlap = bool(fw.returns and sb3.returns and min(sb3.returns) <= max(fw.returns))
    k = f"{budget // 1000}k"
    text = (f"Why the return target is missed: Flywheel's median at {k} is {gap:,.0f} from SB3-zoo's "
            f"({gap / sb3.return_median:+.0%}); Flywheel is ahead on {ahead} of {len(paired)} seeds")
    if below:
        text += (f", and {len(below)} of its runs ended below every SB3 run ("
                 + ", ".join(f"seed {r.seed}: {r.return_at_budget:,.0f}" for r in below) + ")")
    text += (". The ranges overlap: the gap is within the runs' spread at these seeds. " if overlap else
             ". The ranges do not overlap. ")
    return text + ("Whether the samplers' lag costs return is asked separately, on the same seeds with the lag "
                   "held at 0 and at the stack's (`python -m bench.lag_look --config configs/halfcheetah.yaml "
                   "--seed S --lag L`; docs/results.md, \"Runs by hand\", has five seeds of it).")


def _cell(r: BudgetRun) -> str:
    if r.error is not None:
        return f"**failed** ({r.error.splitlines()[0]})"
    ret = "n/a" if r.return_at_budget is None else f"{r.return_at_budget:,.0f}"
    return f"{ret} / {r.wall_s or 0:.0f} s / {r.startup_s or 0:.1f} s / {r.steps_per_s or 0:,.0f}"


def run(ctx: Context) -> FigureResult:
    new_seeds = bench_seeds(NAME, 2, 1, ctx)
    budget = QUICK_BUDGET if ctx.quick else BUDGET
    timeout_s = float(os.environ.get("FLYWHEEL_BENCH_PEERS_MUJOCO_TIMEOUT_S", 300.0 if ctx.quick else 1500.0))
    config = zoo_config(BENCH_HOME / "runs" / f"peers-mujoco-{ctx.stamp}" / "halfcheetah-rl-zoo.yaml")
    kept = earlier_runs(ctx, NAME, new_seeds, {"budget": budget})  # --extend: the earlier entry's other seeds
    runs: dict[str, list[BudgetRun]] = {p: [BudgetRun.from_record(d) for d in kept.get(p, [])] for p in PEERS}
    for seed in new_seeds:  # per seed both peers, one after another: drift of the machine hits both alike
        for peer in PEERS:
            say(f"peers_mujoco: {peer}, seed {seed}, {budget:,} env steps, at most {timeout_s:.0f} s")
            fn = (partial(run_sb3, seed, budget, timeout_s) if peer == PEERS[0]
                  else partial(run_flywheel, ctx, seed, config, budget, timeout_s))
            r = guarded(f"peers_mujoco: {peer} seed {seed}", fn,
                        partial(BudgetRun, peer, seed, budget, None, None, None, 0, 0))
            runs[peer].append(r)
            say(f"peers_mujoco:   -> {_cell(r)}")
    for v in runs.values():
        v.sort(key=lambda r: r.seed)
    seeds = [r.seed for r in runs[PEERS[1]]]
    if seeds != [r.seed for r in runs[PEERS[0]]]:
        raise ValueError(f"{NAME}: the peers' seeds differ ({seeds} vs {[r.seed for r in runs[PEERS[0]]]})")
    stats = {p: PeerSummary.of(v) for p, v in runs.items()}
    sb3, fw = stats[PEERS[0]], stats[PEERS[1]]
    better, faster = verdict(fw, sb3)
    n, k = len(seeds), f"{budget // 1000}k"
    meets = None if better is None else bool(better and faster)
    headline = [
        Row(f"Flywheel against SB3-zoo: return at {k} env steps (last {LAST_N} episodes, median [range]); wall s "
            f"to {k} (median)",
            f"{fw.return_fmt()} vs {sb3.return_fmt()}; {fw.wall.fmt(0, ' s')} vs {sb3.wall.fmt(0, ' s')}",
            TARGET.replace("300k", k), meets),
        Row(f"Flywheel return at {k} >= SB3-zoo's ({fw.ok} of {n} and {sb3.ok} of {n} runs reached {k})",
            f"{fw.return_fmt()} vs {sb3.return_fmt()}", ">= SB3-zoo's", better),
        Row(f"Flywheel wall s to {k} env steps < SB3-zoo's", f"{fw.wall.fmt(0, ' s')} vs {sb3.wall.fmt(0, ' s')}",
            "< SB3-zoo's", faster),
    ]
    for peer, st in stats.items():
        headline.append(Row(f"{peer}: start-up; env steps/s to {k}",
                            f"{st.startup.fmt(1, ' s')}; {st.steps_per_s.fmt(0)}"))
    table = [f"| peer | reached {k} | return at {k} (last {LAST_N}) | wall s to {k} | start-up s | env steps/s |",
             "|---|---|---|---|---|---|"]
    for peer, st in stats.items():
        table.append(f"| {peer} | {st.ok} of {n} | {st.return_fmt()} | {st.wall.fmt(0)} | {st.startup.fmt(1)} | "
                     f"{st.steps_per_s.fmt(0)} |")
    per_seed = ["| seed | " + " | ".join(PEERS) + " |", "|---|" + "---|" * len(PEERS)]
    for i, seed in enumerate(seeds):
        per_seed.append(f"| {seed} | " + " | ".join(_cell(runs[p][i]) for p in PEERS) + " |")
    failures = [f"- {r.peer} seed {r.seed}: {r.error.splitlines()[0]}" for v in runs.values() for r in v if r.error]
    pooled = provenance_md({**r.extra, "seed": r.seed} for v in runs.values() for r in v)
    details = "\n".join([
        *([pooled, ""] if pooled else []),
        f"{n} seed(s); the return is the median [range] over the runs that reached {k} env steps, wall s, start-up "
        "and env steps/s medians [range] (a run that did not reach the budget counts as not reached). Seeds, "
        "timeout: `FLYWHEEL_BENCH_PEERS_MUJOCO_SEEDS` (default 2; a list such as `4,5` with `--extend` adds "
        "seeds to the earlier entry's), `FLYWHEEL_BENCH_PEERS_MUJOCO_TIMEOUT_S` "
        f"(default 1500 s; this run {timeout_s:.0f} s).",
        "",
        *table,
        "",
        f"Per seed (return at {k} / wall s to {k} / start-up s / env steps/s):",
        "",
        *per_seed,
        "",
        "Failures:" if failures else "No run failed.",
        *failures,
        "",
        *([why, ""] if (why := why_missed(runs[PEERS[1]], runs[PEERS[0]], budget)) else []),
        "Not shared between the two: " + "; ".join(NOT_SHARED) + ".",
    ])
    return FigureResult(
        headline=headline,
        numbers={"seeds": list(seeds), "budget": budget, "last_n": LAST_N, "timeout_s": timeout_s,
                 "peers": {p: {"summary": stats[p], "runs": [r.as_dict() for r in v]} for p, v in runs.items()}},
        settings={"config": "configs/halfcheetah.yaml", "seeds": list(seeds),
                  "budget_env_steps": budget, "timeout_s": timeout_s,
                  "sb3 rl-zoo": sb3_mujoco.describe(), "flywheel rl-zoo": describe_flywheel(config),
                  "not shared": list(NOT_SHARED)},
        method=(
            f"Per seed SB3 then Flywheel, each started fresh, never two at once. SB3: a fresh `python -m "
            f"bench.peers.sb3_mujoco` process (CPU torch, 1 thread), stopped at its {budget:,}-th env step; "
            "start-up = process start to `learn()`; returns from its Monitor wrapper (raw, not normalised) per "
            "finished training episode; wall s = `learn()` start to the budget's env step. Flywheel: the local "
            f"stack with {SAMPLERS} samplers and configs/halfcheetah.yaml with rl-zoo's values (settings), "
            f"stopped once the trainer has trained {budget:,} env steps (admin /status) or after the timeout; "
            "start-up = stack up (every service healthy) + first fragment; afterwards every fragment is read "
            "back from `<run>.samples` and the behaviour policy's finished episodes are taken in creation order; "
            "wall s = the first fragment's creation to the creation of the fragment holding the budget's env "
            f"step. Return at the budget, both: the mean of the last {LAST_N} episodes that ended within the "
            "first budget env steps (HalfCheetah episodes are 1,000 steps, truncated). Env steps/s = budget / "
            "wall s."),
        details_md=details,
    )
