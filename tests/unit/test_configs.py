"""Every file in configs/ loads, validates, and names an environment the services can run."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.rl.envs import fragment_spec
from shared.settings import load_settings

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


def test_there_are_configs() -> None:
    assert len(CONFIGS) >= 2


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_loads_and_its_env_is_supported(path: Path) -> None:
    settings = load_settings(path, environ={})
    spec = fragment_spec(settings.env.id, settings.kafka.max_message_bytes)
    assert spec.env_id == settings.env.id and (spec.continuous or spec.num_actions >= 2)
    steps = settings.env.num_envs * settings.env.fragment_steps * settings.trainer.batch_fragments
    assert steps >= settings.trainer.minibatches


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_samplers_act_with_what_the_trainer_publishes(path: Path) -> None:
    """The config's trainer, paramsync and sampler agree on the weights (key set and shapes: observation
    statistics, log_std's shape with gSDE), and a fragment made with them is accepted for training."""
    import torch

    from services.sampler.rollout import RolloutWorker
    from services.trainer.learner import Learner
    from shared.fragment import decode_fragment, encode_fragment
    from shared.rl.model import ActorCritic, load_weights

    settings = load_settings(path, environ={})
    spec = fragment_spec(settings.env.id, settings.kafka.max_message_bytes)
    t = settings.trainer
    learner = Learner(spec, t.model_copy(update={"device": "cpu"}))
    blob = learner.weights()
    load_weights(ActorCritic.for_spec(spec, t.hidden, normalize_observations=t.normalize_observations,
                                      gsde=t.gsde), blob)  # what paramsync verifies before publishing
    worker = RolloutWorker.from_settings(settings, "config-test", seed=0)
    try:
        worker.set_policy(0, blob)
        assert worker.policy.gsde == t.gsde
        frag = worker.collect()
    finally:
        worker.close()
    frag = decode_fragment(*encode_fragment(frag), spec)
    with torch.no_grad():
        logp, _ = learner.model.logp_entropy(torch.from_numpy(frag.obs),
                                             torch.from_numpy(frag.actions))
    assert abs(logp.numpy() - frag.logp).max() < 1e-3  # the trainer sees the behaviour policy the sampler used
    assert learner.update([frag]).env_steps == frag.steps
