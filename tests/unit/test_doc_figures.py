"""Figures quoted in the docs (scaling, results, pixels, policies) are the ones in docs/benchmarks.json, and the
rollback guard's in operations and results are the fault suite's row in docs/reliability.md, rounded as each page
writes them (the README's headline has its own test, test_readme_figures.py)."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def _assert_quoted(expected: dict[str, list[str]], source: str) -> None:
    """Each page (under docs/, whitespace folded) contains each of its strings."""
    for name, strings in expected.items():
        page = " ".join((REPO / "docs" / name).read_text().split())
        missing = [e for e in strings if e not in page]
        assert not missing, f"docs/{name} differs from {source}: {missing}"


def _scaling() -> dict[str, Any]:
    return dict(json.loads((REPO / "docs" / "benchmarks.json").read_text())["figures"]["scaling"]["numbers"])


def test_scaling_page_quotes_the_scaling_figure() -> None:
    n, page = _scaling(), " ".join((REPO / "docs" / "scaling.md").read_text().split())
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
    ]
    missing = [e for e in expected if e not in page]
    assert not missing, f"docs/scaling.md differs from docs/benchmarks.json: {missing}"


def test_results_page_quotes_the_cartpole_peers_figure() -> None:
    fig = json.loads((REPO / "docs" / "benchmarks.json").read_text())["figures"]["peers"]
    page = " ".join((REPO / "docs" / "results.md").read_text().split())
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
    missing = [e for e in expected if e not in page]
    assert not missing, f"docs/results.md differs from docs/benchmarks.json: {missing}"


def test_results_and_pixels_pages_quote_the_minatar_peers_figure() -> None:
    fig = json.loads((REPO / "docs" / "benchmarks.json").read_text())["figures"]["peers_minatar"]
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
            f"{versus} at {n['wall_s']:.0f} s", f"({p_budget})",
        ],
    }
    _assert_quoted(expected, "docs/benchmarks.json (peers_minatar)")
    assert max(other) <= n["other_work_limit_cores"], "a run above the other-work limit was kept, not redone"


def test_results_and_pixels_pages_quote_the_pong_peers_figure() -> None:
    fig = json.loads((REPO / "docs" / "benchmarks.json").read_text())["figures"]["peers_pong"]
    n = fig["numbers"]
    peers, tests = n["peers"], n["rank_tests"]
    fw, sb3 = "Flywheel", "SB3 PPO"
    sync, asyn = "Sample Factory APPO, sync (its example)", "Sample Factory APPO, async"

    def cell(peer: str) -> str:
        s = peers[peer]["frames_per_s"]
        return f"{s['median']:,.0f} [{s['ci_lo']:,.0f}, {s['ci_hi']:,.0f}]"

    def p(peer: str, key: str) -> str:
        return f"{tests[f'{fw} vs {peer}'][key]:.3f}"

    other = [r["other_work_cores"] for v in peers.values() for r in v["runs"]]
    commit, seeds = fig["machine"]["commit"], len(n["seeds"])
    row = {peer: f"| {cell(peer)} | {peers[peer]['startup_s']['median']:.1f} s | {peers[peer]['cores']['median']:.2f} |"
           for peer in peers}
    expected = {
        "results.md": [
            f"({seeds} seeds a side, one run at `{commit}`, {n['run_s']:.0f} s per side, other work "
            f"{min(other):.2f}-{max(other):.2f} cores per run",
            f"Flywheel {cell(fw)} against Stable-Baselines3 PPO {cell(sb3)}",
            f"({n['sb3_threads']} torch threads; no difference shown, two-sided p = {p(sb3, 'p_two_sided')})",
            f"asynchronous {cell(asyn)} (one-sided p = {p(asyn, 'p_a_larger')})",
            f"synchronous Atari example {cell(sync)} (one-sided p = {p(sync, 'p_a_larger')})",
            f"EnvPool steps the same envs at {cell('EnvPool (raw)')} raw",
        ],
        "pixels.md": [
            f"{seeds} seeds a side in one run at `{commit}`, {n['run_s']:.0f} s per side",
            f"rates over [{n['warmup_s']:.0f} s, end]",
            f"other work on the machine {min(other):.2f}-{max(other):.2f} cores per run",
            *row.values(),
            f"asynchronous mode (one-sided p = {p(asyn, 'p_a_larger')})",
            f"synchronous example (one-sided p = {p(sync, 'p_a_larger')})",
            f"(two-sided p = {p(sb3, 'p_two_sided')})",
            f"0.7x EnvPool ({0.7 * peers['EnvPool (raw)']['frames_per_s']['median']:,.0f} frames/s)",
            f"reached {peers[fw]['frames_per_s']['median'] / peers['EnvPool (raw)']['frames_per_s']['median']:.2f}x",
            f"trains {n['learner_alone']['env_steps_per_s'] * 4:,.0f} frames/s",
        ],
    }
    _assert_quoted(expected, "docs/benchmarks.json (peers_pong)")
    assert max(other) <= n["other_work_limit_cores"], "a run above the other-work limit was kept, not redone"


def test_policies_and_scaling_pages_quote_the_sync_inline_figure() -> None:
    fig = json.loads((REPO / "docs" / "benchmarks.json").read_text())["figures"]["sync_inline"]
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
    rel = (REPO / "docs" / "reliability.md").read_text()
    commit = re.search(r"^Last run: .*?, commit `(\w+)`", rel, re.M)
    row = next((line for line in rel.splitlines() if line.startswith("| learning_rate(_end)=1.0")), None)
    assert commit and row, "docs/reliability.md has no guard row or no commit line"
    m = re.search(r"auto_rollback \((\w+), (\w+)\) ([\d.]+) s after the change; v\d+ republished as v\d+, followed "
                  r"([\d.]+) s after the change; last-100 return (\d+) -> (\d+) \(best (\d+) - drop (\d+)\) "
                  r"([\d.]+) s after the change", row)
    assert m, f"the guard row's note has a shape this test does not know: {row}"
    cause, remedy, decided, followed, low, back, best, drop, recovered = m.groups()
    assert row.split("|")[2].strip() == "ok", "the recorded guard row did not pass"
    expected = {
        "operations.md": [
            f"In its recorded run (commit `{commit[1]}`) `auto_rollback` ({cause}, {remedy}) was audited "
            f"{decided} s after the change",
            f"trainer followed the republished version {followed} s after it",
            f"the last-100 return went from {low} back to {back} (within `drop` of its best, {best}) "
            f"{recovered} s after the change",
        ],
        "results.md": [
            f"recorded at `{commit[1]}` in `reliability.md`",
            f"rolled back {decided} s after the change and the last-100 return was back within `drop` of its best "
            f"{recovered} s after it",
        ],
    }
    _assert_quoted(expected, "docs/reliability.md's guard row")
    assert int(back) >= int(best) - int(drop)
