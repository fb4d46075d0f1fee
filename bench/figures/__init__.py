"""One module per figure. Each has NAME, TITLE, TARGET and ``run(ctx) -> FigureResult``."""

from __future__ import annotations

from types import ModuleType

from bench.figures import (
    actor_learner,
    async_sync_return,
    async_vs_sync,
    footprint,
    forced_staleness,
    learner_roofline,
    learner_scaling,
    payloads,
    peers,
    peers_minatar,
    peers_mujoco,
    peers_pong,
    pendulum,
    pipeline,
    policy_load,
    precision_parity,
    recovery,
    sampler_backends,
    sampler_inference,
    scaling,
    service_efficiency,
    solve,
    stability,
    stability_ablation,
    swarm,
    sync_inline,
    sync_latency,
)

FIGURES: dict[str, ModuleType] = {
    m.NAME: m for m in (pipeline, async_vs_sync, scaling, sync_latency, solve, stability, stability_ablation,
                        async_sync_return, forced_staleness, pendulum, recovery, service_efficiency,
                        learner_scaling, actor_learner, peers, sync_inline, sampler_inference, payloads,
                        policy_load, footprint, peers_minatar, peers_mujoco, peers_pong, swarm, learner_roofline,
                        sampler_backends, precision_parity)
}
