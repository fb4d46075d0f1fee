"""The README's headline figures are the ones in docs/benchmarks.json, rounded as the README writes them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def _headline() -> str:
    text = (REPO / "README.md").read_text()
    start = text.index("## Headline figures")
    return text[start:text.index("\n## ", start + 1)]


def _figures() -> dict[str, Any]:
    return dict(json.loads((REPO / "docs" / "benchmarks.json").read_text())["figures"])


def test_each_headline_number_comes_from_benchmarks_json() -> None:
    f, head = _figures(), " ".join(_headline().split())
    solve, pipe, peers = f["solve"]["numbers"], f["pipeline"]["numbers"], f["peers"]["numbers"]
    speed = f["async_vs_sync"]["numbers"]
    scale = f["scaling"]["numbers"]["relative"]
    expected = [
        f"in {solve['solve100_s']['median']:.1f} s median on the local stack, {len(solve['seeds'])} seeds",
        f"the same {peers['sb3_threads']} cores, end to end (start-up included) "
        f"{peers['peers']['Flywheel (flywheel)']['summary']['end_to_end_s']['median']:.1f} s against "
        f"{peers['peers']['SB3 PPO (flywheel)']['summary']['end_to_end_s']['median']:.1f} s",
        f"(p = {peers['rank_tests']['Flywheel (flywheel) vs SB3 PPO (flywheel)']['end_to_end_s']['p_two_sided']:.2f})",
        f"trains {pipe['ratio']:.2f}x the env steps/s of the same code joined in memory",
        f"busy {pipe['kafka_busy_fraction']['median']:.2f} of the time, "
        f"at a mean lag of {pipe['staleness']['mean']:.1f}",
        f"trains {speed['fragment']['speedup']:.1f}x the env steps/s of the synchronous baseline",
        f"({speed['sequential']['speedup']:.1f}-{speed['overlapped']['speedup']:.1f}x when",
        f"scale {scale['2']:.2f}x / {scale['4']:.2f}x / {scale['8']:.2f}x at 2 / 4 / 8 samplers",
        f"in {f['sync_latency']['numbers']['paramsync']['p95']:.3f} s (p95)",
    ]
    missing = [e for e in expected if e not in head]
    assert not missing, f"README headline figures differ from docs/benchmarks.json: {missing}"


def test_the_headline_is_five_lines_and_links_the_full_tables() -> None:
    head = _headline()
    assert len([line for line in head.splitlines() if line.startswith("- ")]) == 5
    assert "(docs/benchmarks.md)" in head and "(docs/results.md)" in head
