"""Figures quoted in the docs (scaling, results, pixels, policies) are the ones in docs/benchmarks.json, and the
rollback guard's in operations and results are the fault suite's row in docs/reliability.md, rounded as each page
writes them (the README's headline has its own test, test_readme_figures.py)."""

from __future__ import annotations

import json
import math
import re
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]


def _assert_quoted(expected: dict[str, list[str]], source: str) -> None:
    """Each page (under docs/, whitespace folded) contains each of its strings."""
    for name, strings in expected.items():
        page = " ".join((REPO / "docs" / name).read_text().split())
        missing = [e for e in strings if e not in page]
        assert not missing, f"docs/{name} differs from {source}: {missing}"


def _suite_row(page: str, is_row: Callable[[str], bool]) -> tuple[str, str]:
    """The commit a generated suite page (docs/reliability*.md) names in its "Last run" line, and its first row
    ``is_row`` picks."""
    text = (REPO / "docs" / page).read_text()
    commit = re.search(r"^Last run: .*?, commit `(\w+)(?: \+ uncommitted changes)?`", text, re.M)
    row = next((line for line in text.splitlines() if is_row(line)), None)
    assert commit and row, f"docs/{page} has no such row or no commit line"
    return commit[1], row


def test_scaling_page_quotes_the_scaling_figure() -> None:
    n = _figure("scaling")["numbers"]
    rel, at32 = n["relative"], n["per_count"]["32"]
    cores32 = n["cpu_cores"]["32"]
    one = n["per_count"]["1"]["sampled"]["median"]
    expected = [
        f"grow to {rel['8']:.2f}x at 8 latency-bound samplers and {rel['16']:.2f}x at 16",
        f"then fall to {rel['32']:.2f}x at 32",
        f"took {statistics.median(w['samplers'] for w in cores32):.2f} of the 2 cores and the trainer "
        f"{statistics.median(w['trainer'] for w in cores32):.2f}",
        f"busy {at32['busy']['median']:.0%} of the time yet trained only {at32['trained']['median']:,.0f} env steps/s",
        f"flow control held the samplers {at32['backpressure']['median']:.0%} of the time",
        f"(256 env steps at {one:.0f}/s)",
        f"(9.6 KB per 256 env steps at {one:.0f} env steps/s)",
        f"| env steps/s of one latency-bound sampler (4 envs, log-normal 2 ms steps) | {one:.0f} |",
    ]
    _assert_quoted({"scaling.md": expected}, "docs/benchmarks.json")


def test_results_page_quotes_the_cartpole_peers_figure() -> None:
    fig = _figure("peers")
    peers, tests = fig["numbers"]["peers"], fig["numbers"]["rank_tests"]

    def med(peer: str, key: str) -> float:
        return float(peers[peer]["summary"][key]["median"])

    fw, sb3 = "Flywheel (flywheel)", "SB3 PPO (flywheel)"
    same = tests[f"{fw} vs {sb3}"]
    expected = [
        f"{len(fig['numbers']['seeds'])} seeds each, one run at `{fig['machine']['commit']}`",
        f"Flywheel {med(fw, 'end_to_end_s'):.1f} s",
        f"(start-up {med(fw, 'startup_s'):.1f} s, training {med(fw, 'train_s'):.1f} s)",
        f"Stable-Baselines3 PPO {med(sb3, 'end_to_end_s'):.1f} s",
        f"{med('SB3 PPO (rl-zoo)', 'end_to_end_s'):.1f} s with rl-zoo's",
        f"Sample Factory 2.1.1 APPO {med('Sample Factory APPO (SF example)', 'end_to_end_s'):.1f} s",
        f"SB3 ran with {fig['numbers']['sb3_threads']} torch threads",
        f"(p = {same['end_to_end_s']['p_two_sided']:.2f} two-sided, same settings",
        f"(one-sided p = {same['train_s']['p_a_smaller']:.3f})",
    ]
    _assert_quoted({"results.md": expected}, "docs/benchmarks.json")


def test_results_and_pixels_pages_quote_the_minatar_peers_figure() -> None:
    fig = _figure("peers_minatar")
    n = fig["numbers"]
    peers, same = n["peers"], n["rank_tests"]["Flywheel vs SB3 PPO"]

    def cell(peer: str) -> str:
        s = peers[peer]["summary"]["last100_at_budget"]
        return f"{s['median']:.2f} [{s['ci_lo']:.2f}, {s['ci_hi']:.2f}]"

    def startup(peer: str) -> str:
        return f"{peers[peer]['summary']['startup_s']['median']:.1f} s"

    other = [r["other_work_cores"] for p in peers.values() for r in p["runs"]]
    versus = f"Flywheel {cell('Flywheel')} against SB3 PPO's {cell('SB3 PPO')}"
    p_budget = f"two-sided p = {same['last100_at_budget']['p_two_sided']:.3f}"
    commit, seeds = fig["machine"]["commit"], len(n["seeds"])
    expected = {
        "results.md": [
            f"MinAtar Breakout at a {n['wall_s']:.0f} s budget ({seeds} seeds each, one run at `{commit}`",
            f"and {n['sb3_threads']} torch threads, other work {min(other):.2f}-{max(other):.2f} cores per run",
            versus, f"({p_budget})",
            f"({startup('Flywheel')} against {startup('SB3 PPO')}, one-sided p = "
            f"{same['startup_s']['p_a_larger']:.3f})",
        ],
        "pixels.md": [
            f"{seeds} seeds a side in one run at `{commit}`, SB3 with {n['sb3_threads']} torch threads",
            f"({statistics.median(r['env_steps'] for r in peers['SB3 PPO']['runs']) / 1e6:.2f}M against 1.67M, "
            "medians)",
            f"{versus} at {n['wall_s']:.0f} s", f"({p_budget})",
        ],
    }
    _assert_quoted(expected, "docs/benchmarks.json (peers_minatar)")
    assert max(other) <= n["other_work_limit_cores"], "a run above the other-work limit was kept, not redone"


def test_results_and_pixels_pages_quote_the_pong_peers_figure() -> None:
    fig = _figure("peers_pong")
    n = fig["numbers"]
    peers, tests, kept = n["peers"], n["rank_tests"], n.get("not_rerun", {})
    fw, bf, sb3, ep = "Flywheel", "Flywheel bf16", "SB3 PPO", "EnvPool (raw)"
    sync, asyn = "Sample Factory APPO, sync (its example)", "Sample Factory APPO, async"

    def fmt(s: dict[str, Any]) -> str:
        return f"{s['median']:,.0f} [{s['ci_lo']:,.0f}, {s['ci_hi']:,.0f}]"

    def cell(peer: str) -> str:
        return fmt(peers[peer]["frames_per_s"])

    def p(a: str, b: str, key: str) -> str:
        return f"{tests[f'{a} vs {b}'][key]:.3f}"

    def median(peer: str) -> float:
        return float(peers[peer]["frames_per_s"]["median"])

    other = [r["other_work_cores"] for v in peers.values() for r in v["runs"]]
    commit, seeds = fig["machine"]["commit"], len(n["seeds"])
    row = {peer: f"| {cell(peer)} | {peers[peer]['startup_s']['median']:.1f} s | {peers[peer]['cores']['median']:.2f} |"
           for peer in peers}
    busy = {peer: _busy(peers[peer]["runs"]) for peer in (fw, bf)}
    sf = [f"asynchronous mode trained {fmt(kept[asyn]['frames_per_s'])}", f"synchronous Atari example "
          f"{fmt(kept[sync]['frames_per_s'])}", f"at `{kept[asyn]['ran_by']['commit']}`"] if asyn in kept else [
        f"asynchronous {cell(asyn)} (one-sided p = {p(fw, asyn, 'p_a_larger')})",
        f"synchronous Atari example {cell(sync)} (one-sided p = {p(fw, sync, 'p_a_larger')})"]
    expected = {
        "results.md": [
            f"({seeds} seeds a side, one run at `{commit}`, {n['run_s']:.0f} s per side, other work "
            f"{min(other):.2f}-{max(other):.2f} cores per run",
            f"Flywheel with the learner in bf16 {cell(bf)} and in float32 {cell(fw)} against Stable-Baselines3 PPO "
            f"{cell(sb3)}",
            f"bf16 {median(bf) / median(sb3):.2f}x SB3's (one-sided p = {p(bf, sb3, 'p_a_larger')})",
            f"float32 {median(fw) / median(sb3):.2f}x (two-sided p = {p(fw, sb3, 'p_two_sided')})",
            f"EnvPool steps the same envs at {cell(ep)} raw",
            *sf,
        ],
        "pixels.md": [
            f"{seeds} seeds a side in one run at `{commit}`, {n['run_s']:.0f} s per side",
            f"rates over [{n['warmup_s']:.0f} s, end]",
            f"other work on the machine {min(other):.2f}-{max(other):.2f} cores per run",
            *row.values(),
            f"bf16 against SB3: one-sided p = {p(bf, sb3, 'p_a_larger')}",
            f"bf16 against float32: one-sided p = {p(bf, fw, 'p_a_larger')}",
            f"float32 against SB3: two-sided p = {p(fw, sb3, 'p_two_sided')}",
            f"reached {median(bf) / median(ep):.2f}x EnvPool's raw rate",
            f"learner's busy fraction over the steady window: float32 {busy[fw]}, bf16 {busy[bf]}",
            f"trains {n['learner_alone']['env_steps_per_s'] * 4:,.0f} frames/s in float32 and "
            f"{n['learner_alone_bf16']['env_steps_per_s'] * 4:,.0f} in bf16",
            *sf,
        ],
    }
    _assert_quoted(expected, "docs/benchmarks.json (peers_pong)")
    assert max(other) <= n["other_work_limit_cores"], "a run above the other-work limit was kept, not redone"


def _busy(runs: list[dict[str, Any]]) -> str:
    """The median [range] of the learner's busy fraction over a side's runs (5 or fewer: the range is the CI)."""
    xs = sorted(float(r["learner_busy"]) for r in runs if r.get("learner_busy") is not None)
    return f"{statistics.median(xs):.2f} [{xs[0]:.2f}, {xs[-1]:.2f}]"


def test_policies_and_scaling_pages_quote_the_sync_inline_figure() -> None:
    fig = _figure("sync_inline")
    n, window = fig["numbers"], fig["settings"]["window_s"]
    i, s = n["inline"], n["store"]

    def row(label: str, r: dict[str, Any]) -> str:
        return (f"| {label} | {r['versions']} | {r['store_gets']:.0f} | {r['gets_per_version']:.2f} "
                f"| {r['gets_per_s']:.1f} | {r['sync_p50']:.3f} | {r['sync_p95']:.3f} | {r['sync_p99']:.3f} |")

    expected = {
        "policies.md": [
            f"One run at `{fig['machine']['commit']}`",
            f"other work on the machine meanwhile: {fig['other_cpu_cores']:.2f} cores; "
            f"{fig['duration_s']:.0f} s in all",
            f"{i['samplers']} samplers, {window:.0f} s windows",
            row("inline", i), row("store (`inline_max_bytes: 0`)", s),
            f"({i['inline_adoptions']:,.0f} inline adoptions, "
            f"about {i['inline_adoptions'] / i['versions']:.0f} per version)",
            f"{s['gets_per_s']:.1f} GETs/s from {s['samplers']} samplers",
            f"({s['versions'] / window:.1f}/s here) each version cost {s['gets_per_version']:.2f} GETs",
            f"Sync p99 was {s['sync_p99'] / i['sync_p99']:.1f}x lower inline "
            f"({i['sync_p99']:.3f} s against {s['sync_p99']:.3f} s)",
        ],
        "scaling.md": [
            f"| p50 {i['sync_p50']:.3f} / {s['sync_p50']:.3f} s, p99 {i['sync_p99']:.3f} / {s['sync_p99']:.3f} s; "
            f"store GETs of weights per version {i['gets_per_version']:.0f} / {s['gets_per_version']:.2f} "
            f"(one run each, {fig['other_cpu_cores']:.2f} cores of other work) |",
        ],
    }
    _assert_quoted(expected, "docs/benchmarks.json (sync_inline)")
    assert i["store_gets"] == 0 and i["inline_refused"] == 0, "the inline run read weights from the store"


def test_operations_and_results_pages_quote_the_fault_suites_guard_row() -> None:
    """The guard's figures in docs/operations.md and docs/results.md are the fault suite's row in
    docs/reliability.md (written by `make test-faults`; after a local run rewrote it, update the quotes or
    `git checkout docs/reliability.md`)."""
    commit, row = _suite_row("reliability.md", lambda line: line.startswith("| learning_rate(_end)=1.0"))
    m = re.search(r"auto_rollback \((\w+), (\w+)\) ([\d.]+) s after the change; v\d+ republished as v\d+, followed "
                  r"([\d.]+) s after the change; last-100 return (\d+) -> (\d+) \(best (\d+) - drop (\d+)\) "
                  r"([\d.]+) s after the change", row)
    assert m, f"the guard row's note has a shape this test does not know: {row}"
    cause, remedy, decided, followed, low, back, best, drop, recovered = m.groups()
    assert row.split("|")[2].strip() == "ok", "the recorded guard row did not pass"
    expected = {
        "operations.md": [
            f"In its recorded run (commit `{commit}`) `auto_rollback` ({cause}, {remedy}) was audited "
            f"{decided} s after the change",
            f"trainer followed the republished version {followed} s after it",
            f"the last-100 return went from {low} back to {back} (within `drop` of its best, {best}) "
            f"{recovered} s after the change",
        ],
        "results.md": [
            f"recorded at `{commit}` in `reliability.md`",
            f"rolled back {decided} s after the change and the last-100 return was back within `drop` of its best "
            f"{recovered} s after it",
        ],
    }
    _assert_quoted(expected, "docs/reliability.md's guard row")
    assert int(back) >= int(best) - int(drop)


def _figure(name: str) -> dict[str, Any]:
    return dict(json.loads((REPO / "docs" / "benchmarks.json").read_text())["figures"][name])


def test_pixels_page_quotes_the_payloads_and_sampler_inference_figures() -> None:
    pay, inf = _figure("payloads"), _figure("sampler_inference")
    configs, cases = pay["numbers"]["configs"], inf["numbers"]["cases"]
    mn, pg = configs["configs/minatar-breakout.yaml"], configs["configs/pong.yaml"]

    def payload(c: dict[str, Any], k: str) -> str:
        e = c["encodings"][k]
        ratio = f" ({c['zstd_ratio']:.1f}x)" if k == "zstd" else ""
        return f"{e['bytes_median']:,.0f} B{ratio}; encode {e['encode_ms']:.2f} ms, decode {e['decode_ms']:.2f} ms"

    def us(c: dict[str, Any], label: str) -> str:
        x = c["us_per_batch"].get(label)
        return "-" if x is None else f"{x['median']:,.0f} ({x['min']:,.0f}-{x['max']:,.0f})"

    def ratio(path: str) -> str:
        u = cases[path]["us_per_batch"]
        return f"{u['onnxruntime, 1 thread']['median'] / u['torch, 1 thread']['median']:.2f}x"

    labels = ["numpy", "torch, 1 thread", "torch, 2 threads", "onnxruntime, 1 thread", "onnxruntime, 2 threads"]
    rows = [f"| {Path(path).name} ({' x '.join(str(d) for d in c['obs_shape'])}) | "
            + " | ".join(us(c, label) for label in labels) + f" | {c['auto_picks']} |" for path, c in cases.items()]
    pong_us = cases["configs/pong.yaml"]["us_per_batch"]
    speedups = [1 / float(ratio(path).rstrip("x")) for path in ("configs/minatar-breakout.yaml", "configs/pong.yaml")]
    learner = _figure("peers_pong")["numbers"]["learner_alone"]
    expected = {"pixels.md": [
        f"one run at `{pay['machine']['commit']}`, the 2-core {pay['machine']['cpu_model']}, other work "
        f"{pay['other_cpu_cores']:.2f} cores; `docs/benchmarks.md`, payloads",
        f"makes {pay['settings']['fragments']} fragments", f"{pay['settings']['repeats']} times (medians)",
        f"| minatar-breakout.yaml, {mn['fragment_steps']} steps x {mn['num_envs']} envs, 10x10x4 frames "
        f"| {payload(mn, 'none')} | {payload(mn, 'zstd')} |",
        f"| pong.yaml, {pg['fragment_steps']} steps x {pg['num_envs']} envs, 84x84 frames + {pg['history_frames']} "
        f"history frames | {payload(pg, 'none')} | {payload(pg, 'zstd')} |",
        f"fits one record at {pg['encodings']['none']['bytes_median'] / (1 << 20):.2f} MiB",
        f"against {statistics.median(learner['seconds']):.1f} s for one of Pong's updates",
        f"MinAtar's CNN {mn['policy_blob_bytes']:,} B", f"Pong's Nature CNN {pg['policy_blob_bytes']:,} B",
        f"zstd schema-3 fragments (about {pg['encodings']['zstd']['bytes_median'] / 1e3:.0f} KB, above)",
        f"one run at `{inf['machine']['commit']}`, the 2-core {inf['machine']['cpu_model']}, other work "
        f"{inf['other_cpu_cores']:.2f} cores",
        f"median (min-max) of {inf['settings']['repeats']} interleaved rounds of at least "
        f"{inf['settings']['block_s']} s",
        *rows,
        f"onnxruntime takes {ratio('configs/minatar-breakout.yaml')} torch's time for MinAtar's CNN and "
        f"{ratio('configs/pong.yaml')} for Pong's Nature CNN at one thread",
        f"({min(speedups):.1f}-{max(speedups):.1f}x faster than torch at the samplers' batch sizes",
        f"({pong_us['onnxruntime, 1 thread']['median']:,.0f} against "
        f"{pong_us['onnxruntime, 2 threads']['median']:,.0f} µs at 1 and 2 threads)",
        f"(Pong's: {cases['configs/pong.yaml']['onnx_session_1_s'] * 1e3:.0f} ms in the run above)",
        f"trains {learner['env_steps_per_s']:.1f} env steps/s of Pong, {learner['env_steps_per_s'] * 4:,.0f} frames/s",
    ]}
    _assert_quoted(expected, "docs/benchmarks.json (payloads, sampler_inference)")
    assert all(c["one_record_each"] for c in configs.values()) and not pay["numbers"]["skipped"]
    assert all(c["auto_is_fastest_or_tied"] for c in cases.values())


def test_pixels_page_quotes_the_mujoco_peers_figure() -> None:
    n = _figure("peers_mujoco")["numbers"]
    fw, sb3 = n["peers"]["Flywheel (rl-zoo)"], n["peers"]["SB3 PPO (rl-zoo)"]

    def by_seed(peer: dict[str, Any], key: str) -> list[float]:
        return [float(r[key]) for r in sorted(peer["runs"], key=lambda r: r["seed"])]

    def row(label: str, values: list[float], summary: str) -> str:
        return f"| {label} | " + " | ".join(f"{v:,.0f}" for v in values) + f" | {summary} |"

    def med_range(values: list[float]) -> str:
        return f"{statistics.median(values):,.0f} [{min(values):,.0f}, {max(values):,.0f}]"

    fr, sr = by_seed(fw, "return_at_budget"), by_seed(sb3, "return_at_budget")
    fwall, swall = by_seed(fw, "wall_s"), by_seed(sb3, "wall_s")
    fup, sup = by_seed(fw, "startup_s"), by_seed(sb3, "startup_s")
    expected = {"pixels.md": [
        row("Flywheel return", fr, med_range(fr)), row("SB3-zoo return", sr, med_range(sr)),
        row("Flywheel wall s to 300k", fwall, f"{statistics.median(fwall):,.0f}"),
        row("SB3-zoo wall s to 300k", swall, f"{statistics.median(swall):,.0f}"),
        f"Start-up (outside those clocks): Flywheel {min(fup):.1f}-{max(fup):.1f} s, "
        f"SB3 {min(sup):.1f}-{max(sup):.1f} s",
        f"far below every SB3 seed ({fr[3]:,.0f} and {fr[4]:,.0f})",
    ]}
    _assert_quoted(expected, "docs/benchmarks.json (peers_mujoco)")
    assert len(fr) == len(sr) == 5 and not any(r["error"] for p in (fw, sb3) for r in p["runs"])


def test_scaling_page_quotes_the_payloads_figure_and_the_models_sizes() -> None:
    """The fragment and blob sizes in docs/scaling.md are the payloads figure's, and its policy sizes table is
    what the models weigh (parameters and ``weights_to_bytes``, built here as the trainer builds them)."""
    import torch

    from shared.fragment import FragmentSpec
    from shared.rl.model import ActorCritic, weights_to_bytes

    configs = _figure("payloads")["numbers"]["configs"]
    c, pe, pg = (configs[f"configs/{n}.yaml"] for n in ("cartpole", "pendulum", "pong"))
    mn = configs["configs/minatar-breakout.yaml"]
    n = c["encodings"]["none"]
    expected = [
        f"| {n['bytes_median'] / 1e3:.1f} KB ({n['bytes_min']:,}-{n['bytes_max']:,} B over "
        f"{len(n['bytes'])} fragments), "
        f"i.e. {n['bytes_per_env_step']:.1f} B per env step, before Kafka's lz4 | `docs/benchmarks.md`, payloads |",
        f"| {pe['encodings']['none']['bytes_median'] / 1e3:.1f} KB, "
        f"{pe['encodings']['none']['bytes_per_env_step']:.1f} B per env step | `docs/benchmarks.md`, payloads |",
        f"| {c['policy_blob_bytes'] / 1e3:.1f} KB / {pe['policy_blob_bytes'] / 1e3:.1f} KB | `docs/benchmarks.md`, "
        f"payloads |",
        f"| {pg['encodings']['zstd']['bytes_median'] / 1e3:.1f} KB | `docs/benchmarks.md`, payloads;",
    ]
    torch.manual_seed(0)
    for label, spec, model, blob in (
            ("MinAtar Breakout, `minatar_cnn`", FragmentSpec((10, 10, 4), 3, obs_dtype="uint8"), "minatar_cnn",
             mn["policy_blob_bytes"]),
            ("Pong, `nature_cnn`", FragmentSpec((84, 84), 6, obs_dtype="uint8", frame_stack=4), "nature_cnn",
             pg["policy_blob_bytes"]),
            ("Nature CNN on full 210x160 Atari frames", FragmentSpec((210, 160), 6, obs_dtype="uint8", frame_stack=4),
             "nature_cnn", None)):
        m = ActorCritic.for_spec(spec, 64, model=model)
        size = len(weights_to_bytes(m))
        assert blob is None or size == blob, f"{label}: {size} B built here, {blob} B in the payloads figure"
        expected.append(f"| {label}")
        expected.append(f"| {sum(p.numel() for p in m.parameters()):,} | {size:,} B |")
    _assert_quoted({"scaling.md": expected}, "docs/benchmarks.json (payloads) and the models' sizes")


def test_results_page_quotes_the_learning_figures() -> None:
    """docs/results.md's "Learning, and what staleness costs": solve, stability, async_sync_return,
    forced_staleness, pendulum, async_vs_sync and pipeline, as the json has them."""
    solve, stab = _figure("solve"), _figure("stability")["numbers"]
    asr, forced = _figure("async_sync_return")["numbers"], _figure("forced_staleness")["numbers"]
    pend, avs = _figure("pendulum")["numbers"]["table"], _figure("async_vs_sync")["headline"]
    pipe = _figure("pipeline")["numbers"]
    s, r = solve["numbers"], solve["numbers"]["ratios"]
    seeds = stab["seeds"]
    lags = [x["staleness"]["mean"] for x in seeds]
    cp, ac = asr["CartPole-v1"], asr["Acrobot-v1"]

    def pm(side: dict[str, Any], fmt: str = ".0f") -> str:
        ret = side["return"]
        return f"{ret['mean']:{fmt}} +- {ret['ci95_half_width']:.0f}"

    def head(rows: list[dict[str, Any]], start: str) -> str:
        return str(next(x["value"] for x in rows if x["metric"].startswith(start)))

    def times(start: str) -> float:
        return float(head(avs, f"async / sync {start}").rstrip("x"))

    pendulum_lag = forced["Pendulum-v1"]["at_budget"]
    cart_solved = head(_figure("forced_staleness")["headline"], "CartPole-v1: seeds solved").split(" vs ")
    expected = {"results.md": [
        f"5 seeds (at `{solve['machine']['commit']}`): {s['solve100_s']['median']:.1f} s median on the local stack",
        f"{s['sb3_100_s']['median']:.1f} s for Stable-Baselines3 PPO with rl-zoo's settings "
        f"({r['flywheel_over_sb3_wall']:.2f}x;",
        f"{s['sequential100_s']['median']:.1f} s for the same code at zero staleness in one process "
        f"({r['flywheel_over_zero_staleness_wall']:.2f}x), using {r['flywheel_over_sb3_env_steps']:.2f}x SB3's env "
        f"steps ({s['solve100_steps']['median'] / 1e3:.0f}k against {s['sb3_100_steps']['median'] / 1e3:.0f}k;",
        f"One seed of five took {s['solve100_s']['max']:.1f} s / {s['solve100_steps']['max'] / 1e3:.0f}k env steps",
        f"their {s['budget_s']:.0f} s",
        f"at `{_figure('stability')['machine']['commit']}`, {len(seeds)} seeds): every seed stayed >= 475 (lowest "
        f"{min(x['min_after'] for x in seeds):.1f}; "
        f"~{round(statistics.median(x['episodes_after'] for x in seeds), -3):,.0f} "
        f"episodes after solving per seed, lag {min(lags):.1f}-{max(lags):.1f} mean, "
        f"{max(x['staleness']['max'] for x in seeds)} max)",
        f"(full stack, {len(cp['async']['return']['values'])} seeds, mean with 95% interval, at "
        f"`{_figure('async_sync_return')['machine']['commit'].removesuffix('-dirty')}`",
        f"CartPole {pm(cp['async'])} against {pm(cp['sync'])} at {cp['steps'] // 1000}k ({cp['ratio']:.2f}x",
        f"Acrobot {pm(ac['async'])} against {pm(ac['sync'])} at {ac['steps'] // 1000}k ({ac['ratio']:.3f}x",
        f"plain PPO solved {cart_solved[1]} and the decoupled objective {cart_solved[0]}",
        f"reached a last-100 mean of {pendulum_lag['decoupled, lag 16']['median']:.0f} at 100k env steps "
        f"({pendulum_lag['decoupled, lag 0']['median']:.0f} without lag) while plain PPO stayed at "
        f"{pendulum_lag['ppo, lag 16']['median']:.0f}",
        f"last-100 mean {pend['Flywheel']['50000']['median']:.0f} at 50k env steps and "
        f"{pend['Flywheel']['100000']['median']:.0f} at 100k against Stable-Baselines3's "
        f"{pend['SB3 PPO']['50000']['median']:.0f} and {pend['SB3 PPO']['100000']['median']:.0f}",
        f"(medians; our worst seed {pend['Flywheel']['100000']['min']:.0f} at 100k)",
        f"async trains {times('env-steps/s (heavy-tailed'):.1f}x the env steps per second",
        f"({times('wall time to the same return, per-fragment'):.1f}x the wall time to equal return)",
        f"per-step latency that averages out within a fragment, {times('env-steps/s (sequential'):.1f}"
        f"-{times('env-steps/s (overlapped'):.1f}x",
        f"the trainer trained {pipe['ratio']:.2f}x the env steps per second of the same code joined in memory, busy "
        f"{pipe['kafka_busy_fraction']['median']:.2f} of the time, at a lag of {pipe['staleness']['mean']:.1f} "
        f"versions mean, {pipe['staleness']['max']} max",
    ]}
    _assert_quoted(expected, "docs/benchmarks.json (the learning figures)")


def test_scaling_page_and_the_sampler_memory_limit_follow_the_policy_load_figure() -> None:
    """The 50 MB policy's load times and memory in docs/scaling.md are the policy_load figure's, and the samplers'
    memory limit (compose and Kubernetes) is the sum scaling.md states, recomputed from the json: the onnx policy's
    peak + the larger of a CartPole sampler's measured peaks (footprint, swarm) + a fetch in flight (95 MiB) + envs
    (100 MiB), +20%, rounded up to 100 MiB."""
    fig = _figure("policy_load")
    n, loads = fig["numbers"], fig["numbers"]["loads"]
    c = n["cases"]["50 MB stand-in (Nature CNN, 210x160 frames)"]
    onnx = c["memory"]["onnx"]
    peak = onnx["stages"][f"load {loads}"]["VmHWM"]
    rest = _sampler_rest_mib()
    total = peak + rest + 95 + 100
    limit = math.ceil(total * 1.2 / 100) * 100
    assert not onnx["torch_imported"] and c["onnx_levels_off"]
    _assert_quoted({"scaling.md": [
        f"one run at `{fig['machine']['commit']}`",
        f"| {c['sha256_s']:.3f} s for {c['blob_bytes'] / 1e6:.1f} MB |", f"| {c['validate_weights_s']:.3f} s |",
        f"| {c['onnx_load_first_s']:.2f} s first, {c['onnx_load_s']:.2f} s after |",
        f"the onnx backend's {c['onnx_load_s']:.2f} s holds heartbeats",
        f"resident memory changed by {c['onnx_growth_second_half_per_load_mib']:+.2f} MiB a load for the 50 MB policy",
        "the figure's bound is 1 MiB a load",
        f"peak over {loads} loads ({peak:,.0f} MiB:", f"the rest of a sampler ({rest:,.0f} MiB,",
        f"= {total:,.0f} MiB, plus 20% = {total * 1.2:,.0f} MiB, rounded up to **{limit}Mi**",
    ]}, "docs/benchmarks.json (policy_load)")
    res = _resources("sampler")
    assert _quantity(res["requests"]["memory"], True) == _quantity(res["limits"]["memory"], True) == limit, \
        f"deploy/k8s/base/sampler.yaml: want {limit}Mi, request = limit"
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    assert compose["services"]["sampler"]["mem_limit"] == f"{limit}m", f"docker-compose.yml's sampler: want {limit}m"


def _sampler_rest_mib() -> float:
    """A CartPole sampler's memory without a large policy: the larger of its measured peaks, alone (footprint) and
    beside the swarm (swarm)."""
    alone = _figure("footprint")["numbers"]["services"]["sampler-0"]["hwm_mib"]
    swarm = max(r["sampler"]["rss_mib"] for r in _figure("swarm")["numbers"]["runs"].values() if r.get("sampler"))
    return float(max(alone, swarm))


def _resources(manifest: str) -> dict[str, Any]:
    """The resources of the first container of the Deployment or StatefulSet in deploy/k8s/base/<manifest>.yaml."""
    docs = [d for d in yaml.safe_load_all((REPO / "deploy" / "k8s" / "base" / f"{manifest}.yaml").read_text())
            if d and d.get("kind") in ("Deployment", "StatefulSet")]
    return dict(docs[0]["spec"]["template"]["spec"]["containers"][0]["resources"])


def _quantity(value: str | int, memory: bool = False) -> float:
    """A Kubernetes quantity: CPU in cores (``1100m``, ``"1"``) or, with ``memory``, MiB (``1280Mi``, ``6Gi``, or
    plain bytes)."""
    v = str(value)
    suffixes = (("Mi", 1.0), ("Gi", 1024.0)) if memory else (("m", 1e-3),)
    for suffix, scale in suffixes:
        if v.endswith(suffix):
            return float(v[: -len(suffix)]) * scale
    return float(v) / (1 << 20) if memory else float(v)


def test_kubernetes_requests_and_limits_cover_the_footprint_figure() -> None:
    """docs/kubernetes.md's table is the footprint figure, and every request and limit of the base manifests is at
    or above what the rule gives from it (CPU request mean +20%, CPU limit busiest 5 s +20%, memory peak +20%)."""
    fig = _figure("footprint")
    services, derived = fig["numbers"]["services"], fig["numbers"]["rule"]
    rows = []
    for name, label in (("trainer", "trainer (CPU)"), ("paramsync", "paramsync"), ("admin", "admin"),
                        ("sampler-0", "sampler")):
        m, r = services[name], derived[name]
        manifest = "sampler" if name == "sampler-0" else name
        res = _resources(manifest)
        req, lim = res["requests"], res["limits"]
        assert _quantity(req["cpu"]) >= r["cpu_request"] - 1e-9, f"{manifest}: cpu request under {r['cpu_request']:.3f}"
        assert _quantity(lim["cpu"]) >= r["cpu_limit"] - 1e-9, f"{manifest}: cpu limit under {r['cpu_limit']:.3f}"
        for kind in (req, lim):
            assert _quantity(kind["memory"], True) >= r["memory_mib"], \
                f"{manifest}: memory under {r['memory_mib']:.0f} MiB"
        rows.append(f"| {label} | {m['mean_cores']:.2f} / {m['busiest_5s_cores']:.2f} cores / {m['hwm_mib']:,.0f} MiB "
                    f"| {r['cpu_request'] * 1000:,.0f}m, {r['cpu_limit'] * 1000:,.0f}m, {r['memory_mib']:,.0f} MiB "
                    f"| {req['cpu']}, {req['memory']} | {lim['cpu']}, {lim['memory']} |")
    assert not any(s["torch_mapped"] for n, s in services.items() if n.startswith("sampler"))
    _assert_quoted({"kubernetes.md": [
        f"one run at `{fig['machine']['commit']}`", f"other work {fig['other_cpu_cores']:.2f} cores",
        f"it took {services['trainer']['mean_cores']:.2f} of a core with one torch thread",
        f"a CartPole-only fleet can set {math.ceil(_sampler_rest_mib() * 1.2):,} MiB",
        f"({_figure('swarm')['numbers']['runs']['new-1000']['sampler']['cpu_cores']:.2f} of a core for one sampler "
        f"beside the 1,000-identity swarm",
        *rows,
    ]}, "docs/benchmarks.json (footprint) and deploy/k8s/base")


def test_operations_page_quotes_the_partition_suites_slow_link_row() -> None:
    """The slow link between the ranks in docs/operations.md is the partition suite's row in
    docs/reliability-network.md (written by `make test-partitions`; update the quote when a local run rewrites it)."""
    commit, row = _suite_row("reliability-network.md", lambda line: "slow link between the trainer ranks" in line)
    m = re.search(r"\+(\d+) ms each way.*?updates/s ([\d.]+) -> ([\d.]+)", row)
    assert m, f"the slow-link row has a shape this test does not know: {row[:300]}"
    _assert_quoted({"operations.md": [
        f"+{m[1]} ms each way between the two ranks took CartPole from {m[2]} to {m[3]} updates a second",
        f"the slow-link row, recorded at `{commit}`",
    ]}, "docs/reliability-network.md's slow-link row")


def test_scaling_page_quotes_the_swarm_figure() -> None:
    fig = _figure("swarm")
    runs = fig["numbers"]["runs"]
    o2, o10, n2, n10 = runs["old-256"], runs["old-1000"], runs["new-256"], runs["new-1000"]

    def kb(b: float) -> str:
        return f"{b / 1e3:.1f} KB"

    def g(r: dict[str, Any]) -> str:
        return f"{r['grants_per_s'] / r['credits_partitions']:.1f}"

    def sync(r: dict[str, Any]) -> str:
        return f"{r['sync_s']['p50']:.2f} / {r['sync_s']['p99']:.2f} s"

    expected = {"scaling.md": [
        f"one run at `{fig['machine']['commit']}`",
        f"The machine's other work was {fig['other_cpu_cores']:.2f} cores over the figure",
        f"| grant passes/s (g) | 10 (illustration) | {g(o2)} (old), {g(n2)} (new) | {g(o10)} (old), {g(n10)} (new) |",
        f"| old: one grant = what a sampler reads a pass | 11.7 KB / 45 KB | "
        f"{kb(o2['credits_bytes_per_sampler_per_pass'])} | {kb(o10['credits_bytes_per_sampler_per_pass'])} |",
        f"| old: read per sampler | g x 11.7 / 45 KB | {o2['credits_bps_per_sampler'] / 1e3:.1f} KB/s | "
        f"{o10['credits_bps_per_sampler'] / 1e3:.1f} KB/s "
        f"({o10['credits_bps_per_sampler'] / o2['credits_bps_per_sampler']:.1f}x 256's) |",
        f"| new: one shard's grant = what a sampler reads a pass | 1.1 / 0.95 KB | "
        f"{n2['credits_bytes_per_sampler_per_pass']:.0f} B | {n10['credits_bytes_per_sampler_per_pass']:.0f} B |",
        f"| new: read per sampler | g x 1.1 / 0.95 KB | {n2['credits_bps_per_sampler']:,.0f} B/s | "
        f"{n10['credits_bps_per_sampler']:,.0f} B/s "
        f"({n10['credits_bps_per_sampler'] / n2['credits_bps_per_sampler']:.2f}x 256's) |",
        f"| new: read by all samplers | 2.8 / 9.5 MB/s at g = 10 | {n2['credits_bps_fleet'] / 1e6:.2f} MB/s | "
        f"{n10['credits_bps_fleet'] / 1e6:.2f} MB/s |",
        f"| new: written by the trainer | 17 / 59 KB a pass | {n2['credits_bps_total'] / 1e3:.1f} KB/s "
        f"({n2['credits_records_per_s']:.0f} records/s) | {n10['credits_bps_total'] / 1e3:.1f} KB/s "
        f"({n10['credits_records_per_s']:.0f} records/s) |",
        f"mean {o2['lag']['mean']:.2f} / {n2['lag']['mean']:.2f} versions at 256 (old / new)",
        f"at 1,000 mean {o10['lag']['mean']:.2f} / {n10['lag']['mean']:.2f}",
        f"new design: p50 / p99 {sync(n2)} at 256 ({n2['sync_s']['versions']} versions) and "
        f"{n10['sync_s']['p50']:.1f} / {n10['sync_s']['p99']:.1f} s at 1,000 ({n10['sync_s']['versions']} versions)",
        f"old: {sync(o2)} and {o10['sync_s']['p50']:.1f} / {o10['sync_s']['p99']:.1f} s",
        f"{n2['sampler']['rss_mib']:.0f} MiB resident and {n2['sampler']['cpu_cores']:.2f} of a core",
    ]}
    _assert_quoted(expected, "docs/benchmarks.json (swarm)")


def test_scaling_page_quotes_what_the_swarm_cost_the_machine() -> None:
    """scaling.md's bullets on what the swarm cost the 2-core machine (cores per part, heartbeats not sent, the
    policy topic's rate, the consumer-per-identity run, the import probe) are the swarm figure's."""
    n = _figure("swarm")["numbers"]
    runs = n["runs"]
    oldnew = [runs[k] for k in ("old-256", "new-256", "old-1000", "new-1000")]
    at256, at1000 = [runs["old-256"], runs["new-256"]], [runs["old-1000"], runs["new-1000"]]

    def span(rs: list[dict[str, Any]], get: Any, fmt: str = ".2f") -> str:
        values = [get(r) for r in rs]
        return f"{min(values):{fmt}}-{max(values):{fmt}}"

    def unsent(r: dict[str, Any]) -> float:
        return sum(s["heartbeats_failed"] for s in r["swarm"]) / sum(s["heartbeats"] for s in r["swarm"])

    own = runs["own-256"]
    live = list(runs.values())
    _assert_quoted({"scaling.md": [
        f"Every run had the 2 cores fully busy ({span(list(runs.values()), lambda r: r['cores']['machine'])} of 2)",
        f"the trainer got {span(oldnew, lambda r: r['cores']['trainer'])} cores "
        f"({span(oldnew, lambda r: 100 * r['trainer_share_of_busy'], '.0f')}% of the busy CPU) and made "
        f"{span(oldnew, lambda r: r['updates_per_s'], '.1f')} updates/s",
        f"the 3 broker JVMs took {span(at256, lambda r: r['cores']['brokers'])} cores at 256 and "
        f"{span(at1000, lambda r: r['cores']['brokers'])} at 1,000",
        f"paramsync {span(oldnew, lambda r: r['cores']['paramsync'])}",
        f"the swarm processes {span(at256, lambda r: r['cores']['swarm'])} at 256 and "
        f"{span(at1000, lambda r: r['cores']['swarm'])} at 1,000",
        f"could not send {100 * unsent(runs['old-1000']):.0f}% (old) and {100 * unsent(runs['new-1000']):.0f}% (new)",
        f"The policy topic carried {span(live, lambda r: r['policy_bps'] / 1e3, '.0f')} KB/s "
        f"({span(live, lambda r: r['policy_records_per_s'], '.1f')} records/s",
        f"({runs['new-1000']['dropped_stale']:.0f} fragments dropped as stale in new-1000's window",
        f"the 768 consumers cost the swarm processes {own['cores']['swarm']:.2f} cores",
        f"the 3 brokers took {own['cores']['brokers']:.2f} cores",
        f"made {own['updates_per_s']:.2f} updates/s, {own['dropped_stale']:.0f} fragments were dropped as stale",
        f"{100 * unsent(own):.0f}% of the heartbeats were not sent",
        f"held {n['import_probes']['onnx']['rss_mib']:.0f} MiB against {n['import_probes']['auto']['rss_mib']:.0f} MiB "
        f"for numpy",
    ]}, "docs/benchmarks.json (swarm)")
    assert all(r["dropped_stale"] == 0 for k, r in runs.items() if k in ("old-256", "new-256", "old-1000"))


def test_pixels_page_quotes_the_precision_parity_figure() -> None:
    fig = _figure("precision_parity")
    n = fig["numbers"]
    steps = n["budget_env_steps"]
    at, test = n["at"][str(steps)], n["rank_tests"][str(steps)]

    def cell(p: str) -> str:
        return f"{at[p]['median']:.2f} [{at[p]['ci_lo']:.2f}, {at[p]['ci_hi']:.2f}]"

    expected = {"pixels.md": [
        f"{len(n['seeds'])} seeds a side, {steps:,} env steps each",
        f"last-100 return at {steps:,} env steps bf16 {cell('bf16')} against float32 {cell('fp32')}",
        f"two-sided p = {test['p_two_sided']:.3f} at the budget; one-sided p that bf16 is lower "
        f"{test['p_a_smaller']:.3f}",
    ]}
    _assert_quoted(expected, "docs/benchmarks.json (precision_parity)")
    shown = all(t["p_a_smaller"] >= 0.05 and t["p_a_larger"] >= 0.05 for t in n["rank_tests"].values())
    assert shown, "the page says no difference was shown at any mark"
