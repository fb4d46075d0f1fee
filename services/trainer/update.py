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

import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np
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
    target_kl: float | None = None
    advantage_std_floor: float = 0.0
    """Normalised advantages divide by max(std, floor) (0: by std, as before)."""
    separate_grad_clip: bool = False
    """Clip the actor's (log_std included) and the critic's gradients to max_grad_norm each."""
    behaviour_weight_mode: Literal["truncate", "mask"] = "truncate"
    """``truncate``: weights above behaviour_weight_cap become the cap; ``mask``: those samples get weight 0
    (they stay in the advantage statistics and in the mean's denominator, so the policy step shrinks by
    the masked fraction)."""
    objective: Literal["decoupled", "ppo"] = "decoupled"
    """``ppo``: plain PPO, the ratio clipped around the behaviour policy and no importance weight (what
    standard PPO does with stale data; the forced-staleness benchmark's baseline, and
    configs/cartpole.yaml's objective)."""
    bf16: bool = False
    """Forward passes (targets and each minibatch's loss) under bf16 autocast; the actor's and critic's
    outputs are cast back to float32 before the loss math (log-ratio, exp, KL), and the weights, gradients
    and optimizer state stay float32 (``trainer.precision``). False: float32 throughout, as before."""


@dataclass(frozen=True)
class UpdateStats:
    policy_loss: float
    value_loss: float
    entropy: float
    approx_kl: float
    clip_fraction: float
    behaviour_weight_mean: float
    env_steps: int
    sgd_steps: int
    """Minibatch gradient steps taken (fewer than epochs x minibatches when stopped early)."""
    sample_passes: int
    """Samples through a gradient step, summed over the steps (sgd_steps x minibatch size): the
    update's work, comparable across updates that stopped early and ones that did not."""
    stopped_early: bool
    """True when ``target_kl`` ended the update before its last epoch."""
    skipped_steps: int = 0
    """Minibatch steps refused because the loss or the gradient was not finite (weights kept)."""
    masked_fraction: float = 0.0
    """Samples left out of the policy loss because their behaviour weight exceeded the cap (mask mode)."""
    grad_norm: float = 0.0
    explained_variance: float = math.nan
    """1 - Var(returns - V) / Var(returns) with the critic before this update (NaN when the returns are
    constant): how much of the return the critic explains (returns - V is the GAE advantage)."""
    """The largest gradient norm before clipping over the update's steps (inf when one was not finite):
    what the rollback guard reads for an explosion."""


class GradSync(Protocol):
    """The collectives of a data-parallel update (``services.trainer.ranks.Ranks``)."""

    def sum_step(self, params: Iterable[nn.Parameter], scale: float, values: list[float]) -> list[float]: ...


def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``x`` (a CPU tensor) on ``device``: on CUDA copied through pinned memory without blocking the host (the
    stream orders the copy before any kernel that reads it); on the CPU ``x`` itself, untouched."""
    if device.type != "cuda":
        return x
    return x.pin_memory().to(device, non_blocking=True)


def _t(x: object, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A batch array built on the CPU, moved in its own dtype (uint8 frames: a quarter of float32's bytes),
    then cast on the device."""
    return to_device(torch.as_tensor(x), device).to(dtype)


def rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The rows ``idx`` of ``x`` (``x[idx]``), gathered as whole contiguous rows: a batch of images laid out NHWC
    (``torch.channels_last``) is gathered as the NHWC array it is in memory and comes back in the same layout
    (about half the time of ``x[idx]`` for a Pong minibatch)."""
    if x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last):
        return x.permute(0, 2, 3, 1).index_select(0, idx).permute(0, 3, 1, 2)
    return x.index_select(0, idx)


@contextmanager
def _forward_precision(model: ActorCritic, device: torch.device, bf16: bool) -> Iterator[None]:
    """Forward passes under bf16 autocast when ``bf16`` (Micikevicius et al. 2018, "Mixed Precision Training",
    https://arxiv.org/abs/1710.03740: low-precision matmuls and convolutions, float32 master weights), with the
    outputs of the policy and value heads cast back to float32, so the log-softmax and everything after it (the
    log-ratios, their exp, the KL estimate, the value loss) is float32 math. Off: nothing changes."""
    if not bf16:
        yield
        return
    heads = [m[-1] if isinstance(m, nn.Sequential) else m for m in (model.actor, model.critic)]
    hooks = [h.register_forward_hook(lambda _m, _i, out: out.float()) for h in heads]
    try:
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
            yield
    finally:
        for hook in hooks:
            hook.remove()


def gae(rewards: np.ndarray, values: np.ndarray, next_value: np.ndarray, done: np.ndarray,
        gamma: float, lam: float) -> np.ndarray:
    """Generalised advantage estimation (Schulman et al. 2015, https://arxiv.org/abs/1506.02438) on
    [T, N] arrays; ``next_value`` [N] is the value of the step after the last, ``done`` cuts the trace."""
    adv = np.zeros_like(rewards)
    not_done = 1.0 - done.astype(rewards.dtype)
    last = np.zeros_like(next_value)
    nv = next_value
    for t in range(rewards.shape[0] - 1, -1, -1):
        delta = rewards[t] + gamma * nv * not_done[t] - values[t]
        last = delta + gamma * lam * not_done[t] * last
        adv[t] = last
        nv = values[t]
    return adv


@torch.no_grad()
def _targets(
    model: ActorCritic, fragments: list[Fragment], cfg: UpdateConfig, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """Flat (obs, actions, behaviour log-probs, proximal log-probs, advantages, returns) of a batch.

    Advantages use the *current* critic. One evaluation of the batch gives the proximal log-probs and the
    values (a shared CNN torso runs once for both), one critic forward the final and truncation observations'
    values; the GAE recursion runs on small numpy arrays.
    """
    obs_dim = int(np.prod(fragments[0].obs.shape[2:]))
    steps = [f.steps for f in fragments]
    n_envs = [f.last_obs.shape[0] for f in fragments]
    n_trunc = [f.trunc_obs.shape[0] for f in fragments]
    # The observations moved in their own dtype (uint8 frames: a quarter of float32's bytes) and made into what the
    # model's passes take (image models: the torso's input, scaled and laid out) once for every minibatch.
    all_obs = model.prepare(to_device(torch.as_tensor(np.concatenate(
        [f.obs.reshape(-1, obs_dim) for f in fragments] + [f.last_obs.reshape(-1, obs_dim) for f in fragments]
        + [f.trunc_obs.reshape(-1, obs_dim) for f in fragments])), device),
        torch.bfloat16 if cfg.bf16 else None)
    obs = all_obs[: sum(steps)]
    if model.continuous:  # [B, A] floats: the unclipped samples the behaviour log-probs belong to
        actions = _t(np.concatenate([f.actions.reshape(f.steps, -1) for f in fragments]), device)
    else:
        actions = _t(np.concatenate([f.actions.reshape(-1) for f in fragments]), device, torch.long)
    # The proximal policy (the weights as they are before this update's first gradient step) and the critic's
    # values, in one evaluation of the batch; the bootstrap observations need only the critic.
    with _forward_precision(model, device, cfg.bf16):
        prox_logp, _, batch_values = model.evaluate(obs, actions, prepared=True)
        values_all = torch.cat([batch_values, model.value(all_obs[sum(steps):], prepared=True)]).cpu().numpy()
    values = np.split(values_all[: sum(steps)], np.cumsum(steps)[:-1])
    next_values = np.split(values_all[sum(steps) : sum(steps) + sum(n_envs)], np.cumsum(n_envs)[:-1])
    trunc_values = np.split(values_all[sum(steps) + sum(n_envs) :], np.cumsum(n_trunc)[:-1])
    advs, rets = [], []
    for f, v, nv, tv in zip(fragments, values, next_values, trunc_values, strict=True):
        v = v.reshape(f.rewards.shape)
        rewards = np.array(f.rewards, np.float32)
        truncated = np.asarray(f.truncated, bool)
        # Bootstrapping on truncation (Pardo et al. 2018, "Time Limits in RL"): a time-limit cut is
        # not a terminal state, so add gamma * V(final obs) to the reward of that step.
        rewards[truncated] += cfg.gamma * tv
        adv = gae(rewards, v, nv, np.asarray(f.terminated, bool) | truncated, cfg.gamma, cfg.gae_lambda)
        advs.append(adv.reshape(-1))
        rets.append((adv + v).reshape(-1))
    behav_logp = _t(np.concatenate([f.logp.reshape(-1) for f in fragments]), device)
    return obs, actions, behav_logp, prox_logp, _t(np.concatenate(advs), device), _t(np.concatenate(rets), device)


def ppo_update(
    model: ActorCritic,
    optimizer: torch.optim.Optimizer,
    fragments: list[Fragment],
    cfg: UpdateConfig,
    device: torch.device,
    generator: torch.Generator | None = None,
    sync: GradSync | None = None,
) -> UpdateStats:
    """Decoupled-PPO update on ``fragments``; returns diagnostics. Mutates model and optimizer.

    With ``sync`` (data-parallel ranks) every rank runs exactly ``epochs x minibatches`` steps, in the same
    order of collectives, whatever data it holds (none at all included): the KL stop and the step counts
    are decided on the sums over ranks, and each step applies the sample-weighted mean of the ranks'
    gradients, so every rank's weights stay identical. Advantages are normalised per rank's minibatch."""
    # ---- 1. Targets with the current critic, per fragment, then one flat batch ----
    if fragments:
        obs, actions, behav_logp, prox_logp, adv, returns = _targets(model, fragments, cfg, device)
    else:  # a data-parallel rank with nothing this step: it only takes part in the collectives
        empty = torch.zeros(0, device=device)
        obs, actions, behav_logp, prox_logp, adv, returns = empty, empty, empty, empty, empty, empty
    ret_var = float(returns.var()) if returns.numel() > 1 else 0.0
    explained_variance = 1.0 - float(adv.var()) / ret_var if ret_var > 0 else math.nan
    batch = actions.shape[0]
    # The policy the clip is centred on: the proximal one, or (plain PPO) the behaviour policy itself. The
    # KL stop below measures drift from the proximal policy in both, so target_kl limits how far *this
    # update* moves the policy and plain PPO with old data is not stopped at its first step for the lag.
    clip_logp = behav_logp if cfg.objective == "ppo" else prox_logp

    # ---- 2. Off-policy correction: truncated importance weight pi_prox / pi_behaviour (AReaL eq. 5) ----
    behaviour_weight = torch.exp(clip_logp - behav_logp)  # identically 1 for plain PPO
    over_cap = behaviour_weight > cfg.behaviour_weight_cap
    if cfg.behaviour_weight_mode == "mask":  # AReaL's masking: too off-policy samples leave the policy loss
        behaviour_weight = torch.where(over_cap, torch.zeros_like(behaviour_weight), behaviour_weight)
    else:
        behaviour_weight = behaviour_weight.clamp(max=cfg.behaviour_weight_cap)
    actor_params, critic_params = model.actor_parameters(), model.critic_parameters()

    # ---- 3. Epochs of minibatch SGD on the clipped objective (around the proximal policy, or plain PPO's
    # behaviour policy) ----
    # Exactly ``minibatches`` steps an epoch; when the batch does not divide evenly the remainder sits
    # out that epoch (a fresh permutation each epoch, so not the same samples).
    mb_size = max(1, batch // cfg.minibatches)
    n_minibatches = min(cfg.minibatches, batch)
    steps_per_epoch = cfg.minibatches if sync is not None else n_minibatches
    stats = {"pg": 0.0, "v": 0.0, "ent": 0.0, "kl": 0.0, "clip": 0.0}
    n, n_local, skipped, stopped = 0, 0, 0, False
    max_grad_norm = 0.0
    for _ in range(cfg.epochs):
        order = torch.randperm(batch, generator=generator).to(device)
        for step in range(steps_per_epoch):
            have = step < n_minibatches  # this rank has samples for this step
            if have:
                idx = order[step * mb_size : (step + 1) * mb_size]
                with _forward_precision(model, device, cfg.bf16):  # trainer.precision: bf16 or float32
                    logp, entropy, new_value = model.evaluate(rows(obs, idx), actions[idx], prepared=True)
                with torch.no_grad():
                    prox_log_ratio = logp - prox_logp[idx]  # http://joschu.net/blog/kl-approx.html
                    kl = float(((torch.exp(prox_log_ratio) - 1) - prox_log_ratio).mean())
            else:
                kl = 0.0
            local_samples = mb_size if have else 0
            optimizer.zero_grad(set_to_none=True)
            if have:
                ratio = torch.exp(logp - clip_logp[idx])
                mb_adv = adv[idx]
                if cfg.normalize_advantages and mb_adv.numel() > 1:
                    # The floor keeps noise-level advantages of a solved task from being blown up to unit scale.
                    adv_std = (mb_adv.std().clamp(min=cfg.advantage_std_floor) if cfg.advantage_std_floor
                               else mb_adv.std())
                    mb_adv = (mb_adv - mb_adv.mean()) / (adv_std + 1e-8)
                # PPO clipped surrogate (Schulman et al. 2017, https://arxiv.org/abs/1707.06347), weighted by
                # the behaviour correction: the decoupled objective.
                surrogate = torch.min(ratio * mb_adv, ratio.clamp(1 - cfg.clip_coef, 1 + cfg.clip_coef) * mb_adv)
                policy_loss = -(behaviour_weight[idx] * surrogate).mean()
                value_loss = 0.5 * (new_value - returns[idx]).pow(2).mean()
                entropy = entropy.mean()
                loss = policy_loss + cfg.vf_coef * value_loss
                if cfg.ent_coef:  # with no bonus the entropy stays out of the graph: no backward pass through it
                    loss = loss - cfg.ent_coef * entropy
                loss.backward()  # type: ignore[no-untyped-call]
                if not torch.isfinite(loss) and sync is not None:  # refuse the step on every rank alike
                    for p in model.parameters():
                        if p.grad is not None:
                            p.grad.fill_(math.nan)
            if sync is not None:
                # One collective a step (the step is latency-bound across a network: a round trip or two per
                # collective): the sample-weighted gradients, the KL and the step's size summed over the ranks
                # together, so the KL below is every rank's.
                kl_sum, step_samples_f = sync.sum_step(model.parameters(), float(local_samples),
                                                       [kl * local_samples, float(local_samples)])
                step_samples = round(step_samples_f)
                if step_samples == 0:  # no rank has samples for this step
                    continue
                kl = kl_sum / step_samples
                for p in model.parameters():  # the sum of local_samples x gradient -> the gradient of the mean
                    if p.grad is not None:
                        p.grad.div_(step_samples)
            # KL early stopping (as CleanRL's target_kl): once the policy has moved this far from the proximal
            # policy, further steps on the same batch overfit it; stop before stepping again. The first minibatch
            # always trains (the policy is still the proximal one there). Decided after the backward pass, which
            # the stopping step wastes (once an update), so that ranks decide on the KL summed with the gradients.
            if cfg.target_kl is not None and n > 0 and kl > cfg.target_kl:
                stopped = True
                break
            if cfg.separate_grad_clip:  # a large value gradient no longer shrinks the policy's step
                grad_norm = torch.maximum(nn.utils.clip_grad_norm_(actor_params, cfg.max_grad_norm),
                                          nn.utils.clip_grad_norm_(critic_params, cfg.max_grad_norm))
            else:
                grad_norm = nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            # A non-finite loss or gradient would make the weights NaN for good: refuse the step, keep the
            # weights and the optimizer state as they are, and let the caller count it.
            g = float(grad_norm)
            max_grad_norm = max(max_grad_norm, g if math.isfinite(g) else math.inf)
            if not math.isfinite(g) or (have and not torch.isfinite(loss)):
                optimizer.zero_grad(set_to_none=True)
                skipped += 1
                continue
            optimizer.step()
            n += 1
            if not have:
                continue
            stats["kl"] += kl
            with torch.no_grad():
                stats["clip"] += float(((ratio - 1).abs() > cfg.clip_coef).float().mean())
            stats["pg"] += float(policy_loss.detach())
            stats["v"] += float(value_loss.detach())
            stats["ent"] += float(entropy.detach())
            n_local += 1
        if stopped:
            break

    d = max(n_local, 1)
    return UpdateStats(
        policy_loss=stats["pg"] / d,
        value_loss=stats["v"] / d,
        entropy=stats["ent"] / d,
        approx_kl=stats["kl"] / d,
        clip_fraction=stats["clip"] / d,
        behaviour_weight_mean=float(behaviour_weight.mean()),
        env_steps=batch,
        sgd_steps=n,
        sample_passes=n_local * mb_size,
        stopped_early=stopped,
        skipped_steps=skipped,
        masked_fraction=float(over_cap.float().mean()) if cfg.behaviour_weight_mode == "mask" else 0.0,
        grad_norm=max_grad_norm,
        explained_variance=explained_variance,
    )
