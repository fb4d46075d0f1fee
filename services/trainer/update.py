"""One policy update from a batch of fragments: decoupled PPO, read top to bottom.

Why decoupled PPO (AReaL, Fu et al. 2025, https://arxiv.org/abs/2505.24298, sec. 5.2): fragments were
made by a *behaviour* policy up to ``max_staleness`` versions old. Standard PPO would clip the
ratio against that old policy, so with lag the trust region is centred on the wrong policy.
Decoupled PPO separates the two roles: the *proximal* policy (the current weights at the start
of this update) centres the clip, and a truncated importance weight pi_prox / pi_behaviour
corrects for the lag. With no lag the weight is 1 and this is exactly PPO. docs/algorithm.md
compares it with IMPALA's V-trace.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shared.fragment import Fragment
from shared.rl.model import ActorCritic


@dataclass(frozen=True)
class UpdateConfig:
    gamma: float
    gae_lambda: float
    clip_coef: float
    behaviour_weight_cap: float
    epochs: int
    minibatches: int
    ent_coef: float
    vf_coef: float
    max_grad_norm: float
    normalize_advantages: bool


@dataclass(frozen=True)
class UpdateStats:
    policy_loss: float
    value_loss: float
    entropy: float
    approx_kl: float
    clip_fraction: float
    behaviour_weight_mean: float
    env_steps: int


def _t(x: object, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.as_tensor(x, device=device).to(dtype)


@torch.no_grad()
def _advantages(
    model: ActorCritic, frag: Fragment, cfg: UpdateConfig, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """GAE with the *current* critic; truncated steps bootstrap from their final observation."""
    obs = _t(frag.obs, device)  # [T, N, *O]
    rewards = _t(frag.rewards, device).clone()  # [T, N]
    truncated = _t(frag.truncated, device, torch.bool)
    done = _t(frag.terminated, device, torch.bool) | truncated
    values = model.value(obs)  # [T, N]
    next_value = model.value(_t(frag.last_obs, device))  # [N]
    # Bootstrapping on truncation (Pardo et al. 2018, "Time Limits in RL"): a time-limit cut is
    # not a terminal state, so add gamma * V(final obs) to the reward of that step.
    if frag.trunc_obs.shape[0]:
        rewards[truncated] += cfg.gamma * model.value(_t(frag.trunc_obs, device))
    # Generalised advantage estimation (Schulman et al. 2015, https://arxiv.org/abs/1506.02438).
    adv = torch.zeros_like(rewards)
    last = torch.zeros_like(next_value)
    for t in reversed(range(rewards.shape[0])):
        not_done = (~done[t]).float()
        nv = next_value if t == rewards.shape[0] - 1 else values[t + 1]
        delta = rewards[t] + cfg.gamma * nv * not_done - values[t]
        last = delta + cfg.gamma * cfg.gae_lambda * not_done * last
        adv[t] = last
    returns = adv + values
    # The proximal policy: the weights as they are before this update's first gradient step.
    actions = _t(frag.actions, device, torch.long)
    prox_logp, _ = model.logp_entropy(obs, actions)
    per_step = (actions, _t(frag.logp, device), prox_logp, adv, returns)
    return (obs.flatten(0, 1), *(x.flatten() for x in per_step))


def ppo_update(
    model: ActorCritic,
    optimizer: torch.optim.Optimizer,
    fragments: list[Fragment],
    cfg: UpdateConfig,
    device: torch.device,
    generator: torch.Generator | None = None,
) -> UpdateStats:
    """Decoupled-PPO update on ``fragments``; returns diagnostics. Mutates model and optimizer."""
    # ---- 1. Targets with the current critic, per fragment, then one flat batch ----
    parts = [_advantages(model, f, cfg, device) for f in fragments]
    obs, actions, behav_logp, prox_logp, adv, returns = (torch.cat(x) for x in zip(*parts, strict=True))
    batch = actions.shape[0]

    # ---- 2. Off-policy correction: truncated importance weight pi_prox / pi_behaviour (AReaL eq. 5) ----
    behaviour_weight = torch.exp(prox_logp - behav_logp).clamp(max=cfg.behaviour_weight_cap)

    # ---- 3. Epochs of minibatch SGD on the clipped objective around the proximal policy ----
    mb_size = max(1, batch // cfg.minibatches)
    stats = {"pg": 0.0, "v": 0.0, "ent": 0.0, "kl": 0.0, "clip": 0.0}
    n = 0
    for _ in range(cfg.epochs):
        order = torch.randperm(batch, generator=generator).to(device)
        for start in range(0, batch - mb_size + 1, mb_size):
            idx = order[start : start + mb_size]
            logp, entropy = model.logp_entropy(obs[idx], actions[idx])
            ratio = torch.exp(logp - prox_logp[idx])
            mb_adv = adv[idx]
            if cfg.normalize_advantages and mb_adv.numel() > 1:
                mb_adv = (mb_adv - mb_adv.mean()) / (mb_adv.std() + 1e-8)
            # PPO clipped surrogate (Schulman et al. 2017, https://arxiv.org/abs/1707.06347), weighted by
            # the behaviour correction: the decoupled objective.
            surrogate = torch.min(ratio * mb_adv, ratio.clamp(1 - cfg.clip_coef, 1 + cfg.clip_coef) * mb_adv)
            policy_loss = -(behaviour_weight[idx] * surrogate).mean()
            value_loss = 0.5 * (model.value(obs[idx]) - returns[idx]).pow(2).mean()
            entropy = entropy.mean()
            loss = policy_loss - cfg.ent_coef * entropy + cfg.vf_coef * value_loss

            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]
            nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            optimizer.step()

            with torch.no_grad():
                log_ratio = logp - prox_logp[idx]
                stats["kl"] += float(((ratio - 1) - log_ratio).mean())  # http://joschu.net/blog/kl-approx.html
                stats["clip"] += float(((ratio - 1).abs() > cfg.clip_coef).float().mean())
            stats["pg"] += float(policy_loss.detach())
            stats["v"] += float(value_loss.detach())
            stats["ent"] += float(entropy.detach())
            n += 1

    return UpdateStats(
        policy_loss=stats["pg"] / n,
        value_loss=stats["v"] / n,
        entropy=stats["ent"] / n,
        approx_kl=stats["kl"] / n,
        clip_fraction=stats["clip"] / n,
        behaviour_weight_mean=float(behaviour_weight.mean()),
        env_steps=batch,
    )
