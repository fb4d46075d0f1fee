"""Every file in configs/ loads, validates, and names an environment the services can run."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.fragment import FragmentSpec
from shared.rl.arch import PolicyArch
from shared.rl.envs import fragment_spec
from shared.settings import Settings, load_settings

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))
EXTRAS = {"MinAtar/": "minatar", "ALE/": "ale_py", "HalfCheetah": "mujoco"}
"""Env id prefix -> the module of the optional extra it needs (pyproject.toml): skipped where not installed."""


def spec_of(settings: Settings) -> FragmentSpec:
    for prefix, module in EXTRAS.items():
        if settings.env.id.startswith(prefix):
            pytest.importorskip(module)
    return fragment_spec(settings.env.id, settings.kafka.max_message_bytes, settings.env.frame_stack)


def test_there_are_configs() -> None:
    assert len(CONFIGS) >= 2


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_loads_and_its_env_is_supported(path: Path) -> None:
    settings = load_settings(path, environ={})
    spec = spec_of(settings)
    assert spec.env_id == settings.env.id and (spec.continuous or spec.num_actions >= 2)
    steps = settings.env.num_envs * settings.env.fragment_steps * settings.trainer.batch_fragments
    assert steps >= settings.trainer.minibatches


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_samplers_act_with_what_the_trainer_publishes(path: Path) -> None:
    """The config's trainer, paramsync and sampler agree on the weights (key set and shapes: observation
    statistics, log_std's shape with gSDE), and a fragment made with them is accepted for training."""
    agree(load_settings(path, environ={}))


def test_a_relu_mlp_without_orthogonal_init_is_run_alike_by_every_service() -> None:
    """rl-zoo's MuJoCo network (halfcheetah.yaml's), on an env every venv has: the blob does not say ReLU,
    so the samplers' log-probs match the trainer's only if each builds the MLP from the settings."""
    agree(Settings.model_validate({"env": {"id": "Pendulum-v1", "fragment_steps": 64}, "trainer": {
        "activation": "relu", "ortho_init": False, "normalize_observations": True, "log_std_init": -1.0}}))


def agree(settings: Settings) -> None:
    import torch

    from services.sampler.rollout import RolloutWorker
    from services.trainer.learner import Learner
    from shared.fragment import decode_fragment, encode_fragment
    from shared.rl.frames import stack_frames
    from shared.rl.model import ActorCritic, load_weights

    spec = spec_of(settings)
    if spec.obs_dtype == "uint8":  # image envs: a short fragment keeps the CNN's CPU time small
        settings = settings.model_copy(update={"env": settings.env.model_copy(update={"fragment_steps": 8})})
    t = settings.trainer
    learner = Learner(spec, t.model_copy(update={"device": "cpu"}))
    blob = learner.weights()
    load_weights(ActorCritic.for_arch(spec, PolicyArch.of(t)), blob)  # what paramsync verifies before publishing
    worker = RolloutWorker.from_settings(settings, "config-test", seed=0)
    try:
        worker.set_policy(0, blob)
        assert worker.policy.gsde == t.gsde
        frag = worker.collect()
    finally:
        worker.close()
    compression = None if settings.sampler.compression == "none" else settings.sampler.compression
    frag = decode_fragment(*encode_fragment(frag, compression), spec)
    stacked = stack_frames(frag, spec.frame_stack) if spec.frame_stack > 1 else frag  # as the learner does
    with torch.no_grad():
        logp, _ = learner.model.logp_entropy(torch.from_numpy(stacked.obs),
                                             torch.from_numpy(stacked.actions))
    assert abs(logp.numpy() - frag.logp).max() < 1e-3  # the trainer sees the behaviour policy the sampler used
    assert learner.update([frag]).env_steps == frag.steps
