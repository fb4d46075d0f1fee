"""One module per figure. Each has NAME, TITLE, TARGET and ``run(ctx) -> FigureResult``."""

from __future__ import annotations

from types import ModuleType

from bench.figures import (
    async_vs_sync,
    pipeline,
    recovery,
    scaling,
    service_efficiency,
    solve,
    sync_latency,
)

FIGURES: dict[str, ModuleType] = {
    m.NAME: m for m in (pipeline, async_vs_sync, scaling, sync_latency, solve, recovery, service_efficiency)
}
