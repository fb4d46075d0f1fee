"""One architecture from the trainer's settings: the trainer, paramsync, a sampler and ``flywheel eval`` build
the same network (:mod:`shared.rl.arch`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from services.admin.evaluate import policy_for
from services.paramsync.service import Paramsync
from services.sampler.rollout import RolloutWorker
from services.trainer.learner import Learner
from shared.bus import MemoryBus
from shared.rl.arch import PolicyArch, sampler_policy
from shared.rl.envs import fragment_spec
from shared.rl.model import load_weights
from shared.rl.policy_np import NumpyPolicy
from shared.settings import Settings, TrainerSettings


def test_of_takes_every_architecture_setting_from_the_trainer() -> None:
    t = TrainerSettings(model="mlp", hidden=32, activation="relu", normalize_observations=True, gsde=True,
                        sde_sample_freq=8)
    assert PolicyArch.of(t) == PolicyArch("mlp", 32, "relu", True, True, 8)
    assert PolicyArch.of(TrainerSettings()) == PolicyArch()  # the defaults agree


def _settings(tmp_path: Path) -> Settings:
    return Settings.model_validate({
        "run": "arch", "store": {"backend": "local", "local_root": str(tmp_path / "store")},
        "env": {"id": "Pendulum-v1", "num_envs": 2, "fragment_steps": 8},
        "trainer": {"hidden": 32, "activation": "relu", "normalize_observations": True, "gsde": True,
                    "sde_sample_freq": 8, "seed": 3}})


def test_trainer_paramsync_sampler_and_eval_build_the_same_network(tmp_path: Path) -> None:
    """Each service's own constructor, from one Settings with every architecture setting off its default: the
    trainer's weights load everywhere, and the numpy policies run ReLU (tanh would give other actions)."""
    settings = _settings(tmp_path)
    spec = fragment_spec("Pendulum-v1", settings.kafka.max_message_bytes)
    learner = Learner(spec, settings.trainer)
    blob = learner.weights()

    paramsync = Paramsync(settings, bus=MemoryBus().bus())
    load_weights(paramsync.model, blob)  # raises WeightsError on another key set or shape
    assert paramsync.model.state_dict().keys() == learner.model.state_dict().keys()
    worker = RolloutWorker.from_settings(settings, "s", seed=0)
    worker.set_policy(1, blob)
    evaluator = policy_for(settings)
    evaluator.load(blob)
    for policy in (worker.policy, evaluator):
        assert isinstance(policy, NumpyPolicy)
        assert (policy.hidden, policy.activation, policy.gsde, policy.sde_sample_freq) == (32, "relu", True, 8)
        assert "obs_norm.mean" in policy.shapes

    obs = np.random.default_rng(0).normal(size=(5, 3)).astype(np.float32)
    means = {}
    for activation in ("relu", "tanh"):
        p = sampler_policy(spec, PolicyArch("mlp", 32, activation, True, True, 8))
        p.load(blob)
        means[activation] = p.logits(obs)
    assert not np.allclose(means["relu"], means["tanh"])  # the activation changes the forward pass
    with torch.no_grad():  # the networks the trainer and paramsync run: same Gaussian means as the samplers'
        trained = [m.cpu()._gaussian(torch.from_numpy(obs))[0].numpy() for m in (learner.model, paramsync.model)]
    for out in (worker.policy.logits(obs), evaluator.logits(obs), *trained):
        np.testing.assert_allclose(out, means["relu"], rtol=1e-4, atol=1e-5)


def test_a_backend_that_cannot_run_the_arch_is_refused_naming_the_setting() -> None:
    spec = fragment_spec("Pendulum-v1", 1 << 20)
    with pytest.raises(ValueError, match="sampler.inference='torch'"):
        sampler_policy(spec, PolicyArch(gsde=True), "torch")
    with pytest.raises(ValueError, match="sampler.inference='nope'"):
        sampler_policy(spec, PolicyArch(), "nope")
