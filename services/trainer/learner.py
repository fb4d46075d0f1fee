"""The learner's state: model, optimizer, counters; checkpoint (de)serialisation. No I/O here."""

from __future__ import annotations

import dataclasses
import io
import json
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from services.trainer.ranks import Ranks
from services.trainer.update import UpdateConfig, UpdateStats, ppo_update
from shared.fragment import Fragment, FragmentSpec
from shared.rl.arch import PolicyArch
from shared.rl.frames import stack_frames
from shared.rl.model import ActorCritic, ImageActorCritic, load_weights, update_moments, weights_to_bytes
from shared.settings import TrainerSettings


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("trainer.device='cuda' but CUDA is not available")
    return torch.device(name)


def uses_bf16(precision: str, device: torch.device) -> bool:
    """Whether updates run their forward passes under bf16 autocast (``trainer.precision``): ``bf16`` always,
    ``fp32`` never, ``auto`` on a CUDA device that supports bf16 (Ampere and later) only, so on the CPU ``auto``
    is float32, bit for bit what it was before the setting existed."""
    if precision == "bf16":
        return True
    if precision == "fp32":
        return False
    if precision != "auto":
        raise ValueError(f"trainer.precision={precision!r}: want auto, fp32 or bf16")
    return device.type == "cuda" and torch.cuda.is_bf16_supported()


class ReturnScaler:
    """Rewards divided by the running standard deviation of the discounted return and clipped to +-10,
    as Stable-Baselines3's ``VecNormalize(norm_reward=True)`` (the mean is not subtracted).

    The approximation: SB3 carries each env's discounted return across its whole stream of steps. Here a
    stream arrives as fragments from several samplers, out of order, some dropped as stale, so the
    return is accumulated per fragment: it starts at 0 at each fragment's first step and resets where an
    episode ends. Its first ~1/(1 - gamma) steps miss what the previous fragment would have carried in,
    which biases the measured spread slightly low (gamma 0.9: a 10-step horizon against 256-step
    fragments, negligible; gamma 0.99 with 64-step fragments, noticeably). The scale only sets the reward
    unit the critic learns in, so a biased scale changes step sizes, not the optimum.
    Statistics are updated with a batch before that batch is scaled (SB3's order)."""

    CLIP = 10.0
    EPS = 1e-8

    def __init__(self, gamma: float) -> None:
        self.gamma = gamma
        self.mean, self.var, self.count = 0.0, 1.0, 1e-4

    def _discounted_returns(self, f: Fragment) -> np.ndarray:
        done = np.asarray(f.terminated, bool) | np.asarray(f.truncated, bool)
        ret = np.zeros(f.rewards.shape[1], np.float64)
        out = np.empty(f.rewards.shape, np.float64)
        for t in range(f.rewards.shape[0]):
            ret = ret * self.gamma + f.rewards[t]
            out[t] = ret
            ret[done[t]] = 0.0
        return out

    def returns(self, fragments: list[Fragment]) -> np.ndarray:
        """The batch's discounted returns, flat (what :meth:`fold` takes)."""
        if not fragments:
            return np.zeros(0, np.float64)
        return np.concatenate([self._discounted_returns(f).reshape(-1) for f in fragments])

    def fold(self, returns: np.ndarray) -> None:
        mean, var, self.count = update_moments(np.array(self.mean), np.array(self.var), self.count, returns)
        self.mean, self.var = float(mean), float(var)

    def scale(self, fragments: list[Fragment], fold: bool = True) -> list[Fragment]:
        """Fold the batch's discounted returns into the statistics (unless the caller folded them already,
        as data-parallel ranks do with every rank's returns); the fragments with scaled rewards."""
        if fold:
            self.fold(self.returns(fragments))
        std = np.sqrt(self.var + self.EPS)
        return [dataclasses.replace(f, rewards=np.clip(f.rewards / std, -self.CLIP, self.CLIP).astype(np.float32))
                for f in fragments]

    def state_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.mean, self.var, self.count = float(state["mean"]), float(state["var"]), float(state["count"])


@dataclass
class LearnerCounters:
    updates: int = 0
    env_steps_trained: int = 0
    fragments_trained: int = 0
    policy_version: int = 0
    recent_returns: deque[float] = field(default_factory=lambda: deque(maxlen=100))
    episodes: int = 0  # episodes seen (ever growing: the rollback guard counts its windows in them)
    recent_lengths: deque[int] = field(default_factory=lambda: deque(maxlen=100))


class Learner:
    """Model + optimizer + counters; :meth:`update` trains on fragments, :meth:`state_bytes` checkpoints."""

    def __init__(self, spec: FragmentSpec, cfg: TrainerSettings) -> None:
        torch.manual_seed(cfg.seed)
        self.device = pick_device(cfg.device)
        self.model = ActorCritic.for_arch(spec, PolicyArch.of(cfg), log_std_init=cfg.log_std_init,
                                          ortho_init=cfg.ortho_init).to(self.device)
        # The Nature CNN convolves minibatches of 84x84 frames faster in NHWC (docs/pixels.md); MinAtar's one
        # 3x3 convolution on 10x10 frames gains nothing.
        if isinstance(self.model, ImageActorCritic) and self.model.kind == "nature_cnn":
            self.model.channels_last_input = True
        self.frame_stack = spec.frame_stack  # > 1: fragments carry single frames, stacked here before training
        self.return_scaler = ReturnScaler(cfg.gamma) if cfg.normalize_rewards else None
        # fused: one kernel for all parameters, faster on the CPU (bench/PERF-NOTES.md has the measurement)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=cfg.learning_rate, eps=1e-5, fused=True)
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.update_cfg = UpdateConfig(
            gamma=cfg.gamma,
            gae_lambda=cfg.gae_lambda,
            clip_coef=cfg.clip_coef,
            behaviour_weight_cap=cfg.behaviour_weight_cap,
            epochs=cfg.epochs,
            minibatches=cfg.minibatches,
            ent_coef=cfg.ent_coef,
            vf_coef=cfg.vf_coef,
            max_grad_norm=cfg.max_grad_norm,
            normalize_advantages=cfg.normalize_advantages,
            target_kl=cfg.target_kl,
            advantage_std_floor=cfg.advantage_std_floor,
            separate_grad_clip=cfg.separate_grad_clip,
            behaviour_weight_mode=cfg.behaviour_weight_mode,
            objective=cfg.objective,
            bf16=uses_bf16(cfg.precision, self.device),
        )
        self.counters = LearnerCounters(recent_returns=deque(maxlen=cfg.return_window),
                                        recent_lengths=deque(maxlen=cfg.return_window))
        self.cfg = cfg
        self.restored_ledger: dict[str, Any] = {}  # the ledger of the checkpoint last restored

    def record_returns(self, frag: Fragment) -> None:
        self.counters.recent_returns.extend(float(r) for r in frag.episode_returns)
        self.counters.episodes += len(frag.episode_returns)
        self.counters.recent_lengths.extend(int(n) for n in frag.episode_lengths)

    def _annealed(self, start: float, end: float | None) -> float:
        """Linear from ``start`` to ``end`` over ``anneal_env_steps`` trained env steps, then ``end`` (a
        function of the counters, so a restored trainer continues the schedule where the checkpoint left
        it); ``start`` when ``end`` is None."""
        if end is None:
            return start
        frac = min(1.0, self.counters.env_steps_trained / self.cfg.anneal_env_steps)
        return start + frac * (end - start)

    def learning_rate(self) -> float:
        """The rate for the next update (``learning_rate`` -> ``learning_rate_end``)."""
        return self._annealed(self.cfg.learning_rate, self.cfg.learning_rate_end)

    def clip_coef(self) -> float:
        """The clip range for the next update (``clip_coef`` -> ``clip_coef_end``, the same schedule)."""
        return self._annealed(self.cfg.clip_coef, self.cfg.clip_coef_end)

    def update(self, fragments: list[Fragment], ranks: Ranks | None = None) -> UpdateStats:
        """One update on ``fragments``. With ``ranks`` (data-parallel) every rank calls this at the same
        step with its own fragments (possibly none): the normalisation statistics take every rank's batch,
        in rank order, and the gradients are averaged (``ppo_update``), so the weights stay identical; the
        counters count every rank's data."""
        if ranks is not None:
            return self._update_ranked(fragments, ranks)
        self._apply_schedule()
        # Normalisation statistics first: this update's targets and gradient steps see the observation
        # statistics that are published with its weights, so version v is trained under exactly the
        # normalisation it acts with (updating after would shift a trained policy's inputs unclipped).
        if self.model.obs_norm is not None:
            self.model.obs_norm.update(np.concatenate([f.obs.reshape(f.steps, -1) for f in fragments]))
        if self.return_scaler is not None:
            fragments = self.return_scaler.scale(fragments)
        if self.frame_stack > 1:
            fragments = [stack_frames(f, self.frame_stack) for f in fragments]
        stats = ppo_update(self.model, self.optimizer, fragments, self.update_cfg, self.device, self.generator)
        self.counters.updates += 1
        self.counters.env_steps_trained += stats.env_steps
        self.counters.fragments_trained += len(fragments)
        return stats

    def _update_ranked(self, fragments: list[Fragment], ranks: Ranks) -> UpdateStats:
        self._apply_schedule()
        obs = (np.concatenate([f.obs.reshape(f.steps, -1) for f in fragments]) if fragments
               else np.zeros((0, 0), np.float32))
        returns = self.return_scaler.returns(fragments) if self.return_scaler is not None else None
        shared = ranks.gather((obs if self.model.obs_norm is not None else None, returns, len(fragments)))
        if self.model.obs_norm is not None:
            self.model.obs_norm.update(np.concatenate([o for o, _, _ in shared if o is not None and o.size]
                                                      or [obs]))
        if self.return_scaler is not None:
            self.return_scaler.fold(np.concatenate([r for _, r, _ in shared]))
            fragments = self.return_scaler.scale(fragments, fold=False) if fragments else fragments
        if self.frame_stack > 1:
            fragments = [stack_frames(f, self.frame_stack) for f in fragments]
        stats = ppo_update(self.model, self.optimizer, fragments, self.update_cfg, self.device, self.generator,
                           sync=ranks)
        env_steps, = ranks.sum([float(stats.env_steps)])
        self.counters.updates += 1
        self.counters.env_steps_trained += int(env_steps)
        self.counters.fragments_trained += sum(n for _, _, n in shared)
        return dataclasses.replace(stats, env_steps=int(env_steps))

    def _apply_schedule(self) -> None:
        lr = self.learning_rate()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        clip = self.clip_coef()
        if clip != self.update_cfg.clip_coef:
            self.update_cfg = dataclasses.replace(self.update_cfg, clip_coef=clip)

    def weights(self) -> bytes:
        return weights_to_bytes(self.model)

    def load_policy_weights(self, data: bytes) -> None:
        load_weights(self.model, data)

    def reset_optimizer(self) -> None:
        """Fresh Adam moments (after a rollback: the old ones belong to the abandoned trajectory)."""
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=self.learning_rate(), eps=1e-5, fused=True)

    def set_runtime(self, cfg: TrainerSettings) -> None:
        """Apply runtime settings (learning rate, target_kl, ...) from a new ``cfg``."""
        self.cfg = cfg
        self.update_cfg = dataclasses.replace(self.update_cfg, target_kl=cfg.target_kl)

    def state_bytes(self, offsets: dict[str, int], ledger: dict[str, Any] | None = None) -> bytes:
        """A full checkpoint, loadable with ``torch.load(weights_only=True)``: the weights with the offsets
        and the per-partition ledger (``services.trainer.ledger``) they reflect, in one blob."""
        c = self.counters
        state: dict[str, Any] = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "updates": c.updates,
            "env_steps_trained": c.env_steps_trained,
            "fragments_trained": c.fragments_trained,
            "policy_version": c.policy_version,
            "recent_returns": list(c.recent_returns),
            "episodes": c.episodes,
            "offsets": dict(offsets),
            "ledger": json.dumps(ledger or {}, sort_keys=True),
            "torch_rng": torch.get_rng_state(),
            "generator_rng": self.generator.get_state(),
        }
        if self.return_scaler is not None:
            state["reward_rms"] = self.return_scaler.state_dict()
        buf = io.BytesIO()
        torch.save(state, buf)
        return buf.getvalue()

    def restore(self, data: bytes) -> dict[str, int]:
        """Load a checkpoint written by :meth:`state_bytes`; returns its consumed offsets."""
        # Load on the CPU: RNG states must stay CPU tensors; load_state_dict moves weights and
        # optimizer state to the model's device.
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        c = self.counters
        c.updates = int(state["updates"])
        c.env_steps_trained = int(state["env_steps_trained"])
        c.fragments_trained = int(state["fragments_trained"])
        c.policy_version = int(state["policy_version"])
        c.recent_returns.clear()
        c.recent_returns.extend(float(r) for r in state["recent_returns"])
        c.episodes = int(state.get("episodes", len(c.recent_returns)))
        torch.set_rng_state(state["torch_rng"])
        self.generator.set_state(state["generator_rng"])
        # Checkpoints from before reward scaling (or from a run without it) have none: start fresh.
        if self.return_scaler is not None and "reward_rms" in state:
            self.return_scaler.load_state_dict(state["reward_rms"])
        self.restored_ledger = json.loads(state.get("ledger") or "{}")
        return {str(k): int(v) for k, v in state["offsets"].items()}
