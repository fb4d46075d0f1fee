"""Figure 7: what the services cost on top of the pure code. Sampler env-steps/s inside the service
vs RolloutWorker stepped in a bare loop; trainer sample passes/s (samples through a gradient step)
inside the service vs Learner.update in a bare loop on the same batch size. Each measured alone on
the machine. Sample passes, not env steps, for the trainer: with ``target_kl`` an update stops early
depending on its data (the bare loop re-trains the same fragments, the service a stale backlog), so
env steps per second would compare different amounts of work."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from bench.context import BENCH_HOME, Context, say
from bench.inproc import bare_learner_rate, bare_rollout_rate
from bench.report import FigureResult, Row
from bench.stack import BenchStack, scrape, stack
from bench.stats import Spread
from shared.settings import load_settings

NAME = "service_efficiency"
TITLE = ("Service / bare-loop throughput: sampler env-steps/s (service vs RolloutWorker loop), trainer sample "
         "passes/s (service vs Learner.update loop, same batch).")
TARGET = ">= 0.5 each"
OVERRIDES = {
    "FLYWHEEL_SAMPLER_MAX_BACKLOG": 0,  # no flow control: the sampler runs alone, as fast as it can
    "FLYWHEEL_SAMPLER_CREDITS": "false",
    "FLYWHEEL_TRAINER_MAX_STALENESS": 1_000_000,  # the trainer trains the backlog the sampler left
}


def _windows_multi(url: str, metrics: list[str], window: float, repeats: int) -> list[list[float]]:
    """Per window, the rate of each of ``metrics`` (scraped together at each boundary)."""
    out = []
    first = scrape(url)
    prev, t_prev = [first.get(m, 0.0) for m in metrics], time.monotonic()
    for _ in range(repeats):
        time.sleep(window)
        cur_all, t = scrape(url), time.monotonic()
        cur = [cur_all.get(m, 0.0) for m in metrics]
        out.append([(c - p) / (t - t_prev) for c, p in zip(cur, prev, strict=True)])
        prev, t_prev = cur, t
    return out


def _profile(ctx: Context, st: BenchStack, service: str, seconds: float) -> subprocess.Popen[bytes] | None:
    """With --profile: py-spy the measured service during its windows (collapsed stacks, CPU only)."""
    if not ctx.profile:
        return None
    pid = st.stack.pid(service, 0)
    out = BENCH_HOME / "profiles" / f"{service}-{ctx.stamp}.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    say(f"{NAME}: py-spy on {service} (pid {pid}) -> {out} (collapsed stacks; summarise with python -m bench.profile)")
    return subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "-p", str(pid), "--nonblocking",
                             "-d", str(int(seconds)), "-r", "100", "-f", "raw", "-o", str(out), "--threads"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def run(ctx: Context) -> FigureResult:
    warmup, window, repeats = ctx.scale(5), ctx.scale(10), 3
    settings = load_settings("configs/cartpole.yaml", environ={})
    say(f"{NAME}: bare RolloutWorker loop")
    bare_s = Spread.of(bare_rollout_rate(settings, window) for _ in range(repeats))
    say(f"{NAME}: bare Learner.update loop")
    bare_runs = [bare_learner_rate(settings, window) for _ in range(repeats)]
    bare_t = Spread.of(steps for steps, _ in bare_runs)
    bare_p = Spread.of(passes for _, passes in bare_runs)

    with stack(ctx, ctx.run_name(NAME), OVERRIDES) as st:
        s = st.stack
        # The trainer sends version 0 as a candidate, paramsync publishes it: what a sampler starts from.
        s.start("trainer")
        s.start("paramsync")
        marker = st.home / "store" / st.run / "policy" / "LATEST"
        st.wait_for("version 0 published", marker.exists, 90, 0.2)
        s.stop("paramsync")
        s.stop("trainer")
        say(f"{NAME}: sampler service alone (no trainer, no flow control)")
        s.start("sampler", 0)
        s.wait_healthy("sampler", 0, timeout_s=90)
        surl = st.metrics_url("sampler", 0)
        st.wait_for("the first fragment", lambda: scrape(surl).get("flywheel_sampler_fragments_produced_total", 0) > 0,
                    60, 0.2)
        time.sleep(warmup)
        prof = _profile(ctx, st, "sampler", window * repeats)
        svc_s = Spread.of(w[0] for w in _windows_multi(surl, ["flywheel_sampler_env_steps_total"], window, repeats))
        if prof:
            prof.wait(timeout=60)
        produced = scrape(surl).get("flywheel_sampler_fragments_produced_total", 0.0)
        s.stop("sampler", 0)
        say(f"{NAME}: trainer service alone, on the backlog the sampler left ({produced:.0f} fragments)")
        s.start("trainer")
        s.wait_healthy("trainer", timeout_s=90)
        turl = st.metrics_url("trainer")
        st.wait_for("the first update", lambda: scrape(turl).get("flywheel_trainer_updates_total", 0) > 0, 60, 0.2)
        time.sleep(warmup)
        prof = _profile(ctx, st, "trainer", window * repeats)
        svc_both = _windows_multi(turl, ["flywheel_trainer_env_steps_trained_total",
                                         "flywheel_trainer_sample_passes_total"], window, repeats)
        svc_t = Spread.of(w[0] for w in svc_both)
        svc_p = Spread.of(w[1] for w in svc_both)
        if prof:
            prof.wait(timeout=60)
        tm = scrape(turl)
        consumed = tm.get("flywheel_trainer_fragments_consumed_total", 0.0)
        busy = tm.get("flywheel_trainer_busy_seconds_total", 0.0)
        dropped = tm.get("flywheel_trainer_fragments_dropped_stale_total", 0.0)
        updates = st.events("trainer", "update_done")
        update_s = [e["seconds"] for e in updates]
        sgd = [e["sgd_steps"] for e in updates if "sgd_steps" in e]
    backlog_left = produced - consumed
    rs, rt, rp = svc_s.median / bare_s.median, svc_t.median / bare_t.median, svc_p.median / bare_p.median
    mean_update = sum(update_s) / len(update_s) if update_s else float("nan")
    mean_sgd = sum(sgd) / len(sgd) if sgd else float("nan")
    bs = settings.trainer.batch_fragments * settings.env.num_envs * settings.env.fragment_steps
    details = "\n".join([
        "| | service | bare loop | service / bare |",
        "|---|---|---|---|",
        f"| sampler env-steps/s | {svc_s.fmt()} | {bare_s.fmt()} | **{rs:.2f}** |",
        f"| trainer sample passes/s | {svc_p.fmt()} | {bare_p.fmt()} | **{rp:.2f}** |",
        f"| trainer env-steps trained/s (not comparable: see below) | {svc_t.fmt()} | {bare_t.fmt()} | {rt:.2f} |",
        "",
        f"Trainer: mean `update_done.seconds` in the service {mean_update * 1000:.0f} ms for {bs} env steps "
        f"(bare: {bs / bare_t.median * 1000:.0f} ms), mean SGD steps per update in the service "
        f"{mean_sgd:.1f} of {settings.trainer.epochs * settings.trainer.minibatches}. "
        "With `target_kl` an update stops early depending on its data: the bare loop re-trains 16 fragments "
        "round robin and stops after few steps, the service trains a stale backlog, so env steps/s compare "
        "different amounts of work and sample passes/s are the measure of service overhead. The rest of the "
        "service's time goes to pulling and decoding fragments, publishing a policy after every update and "
        f"logging. The backlog never ran dry during the windows ({backlog_left:.0f} fragments were still "
        f"unconsumed at the end; {dropped:.0f} dropped as stale).",
    ])
    return FigureResult(
        headline=[
            Row("sampler: service / bare RolloutWorker loop", f"{rs:.2f}", ">= 0.5", rs >= 0.5),
            Row("trainer: service / bare Learner.update loop (sample passes/s)", f"{rp:.2f}", ">= 0.5", rp >= 0.5),
            Row("sampler env-steps/s, service vs bare", f"{svc_s.fmt()} vs {bare_s.fmt()}"),
            Row("trainer sample passes/s, service vs bare", f"{svc_p.fmt()} vs {bare_p.fmt()}"),
        ],
        numbers={"sampler_ratio": rs, "trainer_ratio": rp, "trainer_env_steps_ratio": rt, "sampler_service": svc_s,
                 "sampler_bare": bare_s, "trainer_service": svc_p, "trainer_bare": bare_p,
                 "trainer_env_steps_service": svc_t, "trainer_env_steps_bare": bare_t,
                 "mean_update_s_service": mean_update,
                 "backlog_left_fragments": backlog_left, "trainer_busy_s_total": busy},
        settings={**{k.removeprefix("FLYWHEEL_").lower(): v for k, v in OVERRIDES.items()},
                  "warmup_s": warmup, "window_s": window, "windows": repeats},
        method=(f"Bare loops in the bench process (torch 1 thread): `RolloutWorker.collect()` with the initial policy; "
                "`Learner.update()` on batches of `batch_fragments` fragments collected beforehand; "
                f"{repeats} x {window:.0f} s each. Services: one stack, the trainer started once to publish version 0 "
                f"and stopped; then one sampler alone (flow control off) for {warmup:.0f} s warm-up + {repeats} "
                f"windows of {window:.0f} s (`flywheel_sampler_env_steps_total`); it is stopped and the trainer "
                "started alone on the backlog it left (staleness limit off, so nothing is dropped), "
                f"{warmup:.0f} s warm-up + {repeats} windows (`flywheel_trainer_sample_passes_total`, "
                "`flywheel_trainer_env_steps_trained_total`). "
                "Kafka runs beside each (it is part of the service's cost)."),
        details_md=details,
    )
