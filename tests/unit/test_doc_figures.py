"""Figures quoted in docs/scaling.md are the ones in docs/benchmarks.json, rounded as the page writes them (the
README's headline has its own test, test_readme_figures.py)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


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
