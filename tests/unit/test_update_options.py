"""The update's stability options, each against the same update without it (pure code, no Kafka).

Plain SGD and a single full-batch step keep the arithmetic exact: the actor's step is then linear in the
policy-loss gradient, so "moves less", "ignores these samples" and "keeps its norm" are checked directly.
"""

import copy
import dataclasses

import numpy as np
import pytest
import torch

from services.sampler.rollout import RolloutWorker
from services.trainer.learner import Learner
from services.trainer.update import UpdateConfig, ppo_update
from shared.fragment import Fragment
from shared.rl.arch import PolicyArch
from shared.rl.envs import fragment_spec
from shared.rl.model import ActorCritic
from shared.settings import TrainerSettings

SPEC = fragment_spec("CartPole-v1", 1 << 22)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def setup() -> tuple[ActorCritic, list[Fragment], UpdateConfig]:
    learner = Learner(SPEC, TrainerSettings(seed=4, epochs=1, minibatches=1, ent_coef=0.0))
    frags = []
    for i in range(2):
        w = RolloutWorker("CartPole-v1", num_envs=4, fragment_steps=32, sampler_id=f"s{i}",
                          arch=PolicyArch(hidden=64), seed=i)
        w.set_policy(0, learner.weights())
        frags.append(w.collect())
        w.close()
    return learner.model, frags, dataclasses.replace(learner.update_cfg, gamma=0.0, gae_lambda=0.0)


def _actor_step(model: ActorCritic, frags: list[Fragment], cfg: UpdateConfig, lr: float = 0.1
                ) -> tuple[torch.Tensor, float]:
    """One SGD step on a copy of ``model``: the actor's parameter change (flat) and the masked fraction."""
    m = copy.deepcopy(model)
    before = torch.cat([p.detach().flatten() for p in m.actor_parameters()])
    stats = ppo_update(m, torch.optim.SGD(m.parameters(), lr=lr), frags, cfg, CPU, torch.Generator().manual_seed(0))
    assert stats.sgd_steps == 1
    return torch.cat([p.detach().flatten() for p in m.actor_parameters()]) - before, stats.masked_fraction


def _with_rewards(model: ActorCritic, frags: list[Fragment], noise: float) -> list[Fragment]:
    """With gamma = lambda = 0 an advantage is r - V(s): rewards V(s) + noise make advantages of RMS ``noise``
    (a solved task's)."""
    rng = np.random.default_rng(0)
    out = []
    for f in frags:
        with torch.no_grad():
            v = model.value(torch.from_numpy(f.obs)).numpy()
        out.append(dataclasses.replace(f, rewards=(v + noise * rng.normal(size=v.shape)).astype(np.float32),
                                       terminated=np.zeros_like(f.terminated), truncated=np.zeros_like(f.truncated),
                                       trunc_obs=f.trunc_obs[:0]))
    return out


def test_advantage_std_floor_keeps_noise_advantages_small(setup: tuple[ActorCritic, list[Fragment], UpdateConfig]
                                                          ) -> None:
    model, frags, cfg = setup
    tiny = _with_rewards(model, frags, noise=1e-4)
    plain, _ = _actor_step(model, tiny, cfg)
    floored, _ = _actor_step(model, tiny, dataclasses.replace(cfg, advantage_std_floor=0.01))
    # Without the floor, noise is scaled up to unit advantages and the policy moves as if they meant something;
    # with it the step shrinks by std / floor (~1e-2): linear, since the first step has ratio 1 (no clipping).
    assert float(plain.norm()) > 1e-3
    assert float(floored.norm()) == pytest.approx(float(plain.norm()) * 1e-4 / 0.01, rel=0.1)
    # A floor below the advantages' std changes nothing.
    loose, _ = _actor_step(model, tiny, dataclasses.replace(cfg, advantage_std_floor=1e-6))
    torch.testing.assert_close(loose, plain)


def test_mask_mode_zeroes_the_contribution_of_over_cap_samples(
        setup: tuple[ActorCritic, list[Fragment], UpdateConfig]) -> None:
    model, frags, cfg = setup
    cfg = dataclasses.replace(cfg, normalize_advantages=False, vf_coef=0.0, behaviour_weight_cap=5.0)
    frags = _with_rewards(model, frags, noise=1.0)
    # Every third sample of the first fragment was far less likely under its behaviour policy: weight e^10 > cap.
    over = np.zeros(frags[0].logp.shape, bool)
    over.flat[::3] = True
    skewed = [dataclasses.replace(frags[0], logp=np.where(over, frags[0].logp - 10.0, frags[0].logp)), frags[1]]
    # The same batch with those samples' rewards (so advantages) changed: in mask mode nothing changes.
    changed = [dataclasses.replace(skewed[0], rewards=np.where(over, 50.0, skewed[0].rewards).astype(np.float32)),
               frags[1]]
    mask = dataclasses.replace(cfg, behaviour_weight_mode="mask")
    step_a, fraction = _actor_step(model, skewed, mask)
    step_b, _ = _actor_step(model, changed, mask)
    torch.testing.assert_close(step_a, step_b)
    assert fraction == pytest.approx(over.sum() / (2 * over.size))
    # Truncation keeps them in (at weight = cap): their advantages move the policy.
    trunc_a, trunc_fraction = _actor_step(model, skewed, cfg)
    trunc_b, _ = _actor_step(model, changed, cfg)
    assert float((trunc_a - trunc_b).norm()) > 0.1 * float(trunc_a.norm()) and trunc_fraction == 0.0


def test_separate_grad_clip_keeps_the_actor_step_when_the_critic_gradient_explodes(
        setup: tuple[ActorCritic, list[Fragment], UpdateConfig]) -> None:
    model, frags, cfg = setup
    huge = _with_rewards(model, frags, noise=1.0)
    huge = [dataclasses.replace(f, rewards=f.rewards * 1e4) for f in huge]  # value loss ~1e8: its gradient dominates
    no_critic, _ = _actor_step(model, huge, dataclasses.replace(cfg, vf_coef=0.0))
    joint, _ = _actor_step(model, huge, cfg)
    separate, _ = _actor_step(model, huge, dataclasses.replace(cfg, separate_grad_clip=True))
    # Joint clipping shrinks the actor's step with the critic's norm; separate clipping leaves it as it would be
    # without any critic gradient.
    assert float(joint.norm()) < 1e-3 * float(no_critic.norm())
    torch.testing.assert_close(separate, no_critic)


def test_the_options_are_off_by_default_and_wired_from_settings() -> None:
    cfg = Learner(SPEC, TrainerSettings()).update_cfg
    assert (cfg.advantage_std_floor, cfg.separate_grad_clip, cfg.behaviour_weight_mode) == (0.0, False, "truncate")
    on = Learner(SPEC, TrainerSettings(advantage_std_floor=0.1, separate_grad_clip=True,
                                       behaviour_weight_mode="mask")).update_cfg
    assert (on.advantage_std_floor, on.separate_grad_clip, on.behaviour_weight_mode) == (0.1, True, "mask")


def test_plain_ppo_objective_centres_on_the_behaviour_policy(
        setup: tuple[ActorCritic, list[Fragment], UpdateConfig]) -> None:
    model, frags, cfg = setup
    cfg = dataclasses.replace(cfg, normalize_advantages=False, vf_coef=0.0)
    frags = _with_rewards(model, frags, noise=1.0)
    # Behaviour log-probs 0.5 below the current policy's (stale data): decoupled PPO weights each sample by
    # pi_prox / pi_behaviour = e^0.5 and clips around the proximal policy (ratio 1, inside the clip), so its
    # first step is e^0.5 times the on-policy step. Plain PPO's ratio to the behaviour policy is e^0.5 > 1.2:
    # clipped, so samples with positive advantages push nothing.
    stale = [dataclasses.replace(f, logp=f.logp - 0.5) for f in frags]
    on_policy, _ = _actor_step(model, frags, cfg)
    decoupled, _ = _actor_step(model, stale, cfg)
    torch.testing.assert_close(decoupled, on_policy * float(np.exp(0.5)), rtol=1e-3, atol=1e-7)
    ppo, _ = _actor_step(model, stale, dataclasses.replace(cfg, objective="ppo"))
    assert float((ppo - on_policy).norm()) > 0.1 * float(on_policy.norm())
    # On-policy data: both objectives are the same update.
    same, _ = _actor_step(model, frags, dataclasses.replace(cfg, objective="ppo"))
    torch.testing.assert_close(same, on_policy)
    assert Learner(SPEC, TrainerSettings(objective="ppo")).update_cfg.objective == "ppo"


def test_kl_stop_measures_this_updates_drift_for_both_objectives(
        setup: tuple[ActorCritic, list[Fragment], UpdateConfig]) -> None:
    model, frags, cfg = setup
    # Behaviour policy far from the current one (KL to it ~0.5, far above target_kl): what stops an update is
    # how far the update itself moved the policy, not the lag, so tiny steps run every epoch in both objectives.
    stale = [dataclasses.replace(f, logp=f.logp - 1.0) for f in _with_rewards(model, frags, noise=1.0)]
    cfg = dataclasses.replace(cfg, epochs=4, minibatches=2, target_kl=0.01)
    for objective in ("decoupled", "ppo"):
        m = copy.deepcopy(model)
        stats = ppo_update(m, torch.optim.SGD(m.parameters(), lr=1e-6), stale,
                           dataclasses.replace(cfg, objective=objective), CPU, torch.Generator().manual_seed(0))
        assert (stats.sgd_steps, stats.stopped_early) == (8, False), objective
        assert stats.approx_kl < 1e-6
    # A large step does trip it (after the first minibatch, which always trains).
    m = copy.deepcopy(model)
    stats = ppo_update(m, torch.optim.SGD(m.parameters(), lr=50.0), stale,
                       dataclasses.replace(cfg, objective="ppo"), CPU, torch.Generator().manual_seed(0))
    assert stats.stopped_early and 1 <= stats.sgd_steps < 8


def test_an_epoch_takes_exactly_minibatches_steps_when_the_batch_does_not_divide(
        setup: tuple[ActorCritic, list[Fragment], UpdateConfig]) -> None:
    model, frags, cfg = setup
    batch = sum(f.steps for f in frags)  # 2 fragments x 32 steps x 4 envs = 256 samples
    cfg = dataclasses.replace(cfg, epochs=3, minibatches=3, target_kl=None)
    assert batch % 3 != 0
    m = copy.deepcopy(model)
    stats = ppo_update(m, torch.optim.SGD(m.parameters(), lr=1e-3), frags, cfg, CPU, torch.Generator().manual_seed(0))
    assert stats.sgd_steps == 9 and stats.sample_passes == 9 * (batch // 3)
