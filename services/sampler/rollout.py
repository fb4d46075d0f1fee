"""Stepping vectorised envs with batched numpy inference into :class:`Fragment`s. No I/O here.

The policy runs where ``sampler.inference`` says (``auto``: what measured faster, docs/pixels.md "Sampler
inference"): the MLP in numpy (:class:`shared.rl.policy_np.NumpyPolicy`, no torch), CNN policies for image envs in
onnxruntime (:class:`shared.rl.policy_onnx.OnnxPolicy`) or torch (:class:`shared.rl.policy_torch.TorchPolicy`),
each imported only when used.
Image observations are uint8 frames; with ``frame_stack`` K the policy sees each env's last K frames
(:class:`shared.rl.frames.FrameStacker`) while the fragment carries single frames (docs/pixels.md).
The envs are a gymnasium vector env or EnvPool (``env.backend``, :mod:`shared.rl.envpool_env`): same frames, same
same-step autoreset.

Continuous actions: the env is stepped with the Gaussian sample clipped to the action space's bounds,
and the fragment keeps the *unclipped* sample and its log-density, so the trainer's ratio is that of
the distribution that was sampled (as CleanRL's ``ppo_continuous_action.py`` and Stable-Baselines3).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import gymnasium as gym
import numpy as np

from shared.fragment import Fragment
from shared.rl.arch import PolicyArch, sampler_policy
from shared.rl.envpool_env import resolve_backend
from shared.rl.envs import LogNormalDelay, as_observation, fragment_spec, make_vector_env
from shared.rl.frames import FrameStacker
from shared.settings import Settings

if TYPE_CHECKING:
    from shared.rl.arch import SamplerPolicy


class RolloutWorker:
    """Owns ``num_envs`` envs and a behaviour policy; :meth:`collect` makes one fragment."""

    def __init__(
        self,
        env_id: str,
        num_envs: int,
        fragment_steps: int,
        sampler_id: str,
        arch: PolicyArch,
        seed: int | None = None,
        latency_median_ms: float = 0.0,
        latency_sigma: float = 1.0,
        latency_overlap: bool = False,
        *,
        fragment_latency_median_ms: float = 0.0,
        fragment_latency_sigma: float = 1.5,
        frame_stack: int | None = None,
        torch_threads: int = 1,
        inference: str = "auto",
        backend: str = "auto",
    ) -> None:
        """``arch`` must be the trainer's (``PolicyArch.of(settings.trainer)``: the weights' key set and shapes,
        the forward pass); ``inference`` and ``torch_threads`` are ``sampler.inference`` and
        ``sampler.torch_threads``; ``fragment_latency_median_ms`` > 0 (benchmarks) sleeps one log-normal draw per
        fragment; ``backend`` is ``env.backend`` (``auto`` resolved here: :func:`shared.rl.envpool_env.resolve_backend`,
        which raises ``BackendUnavailable`` for an explicit ``envpool`` it cannot honour)."""
        self.env_id = env_id
        self.backend = resolve_backend(backend, env_id)
        self.sampler_id = sampler_id
        self.steps = fragment_steps
        self.envs = make_vector_env(env_id, num_envs, latency_median_ms, latency_sigma, seed, latency_overlap,
                                    backend=self.backend)
        self.spec = spec = fragment_spec(env_id, max_bytes=1 << 30, frame_stack=frame_stack, backend=self.backend)
        self.policy: SamplerPolicy = sampler_policy(spec, arch, inference, torch_threads)
        space = self.envs.single_action_space
        self._bounds = (space.low, space.high) if isinstance(space, gym.spaces.Box) else None
        self._fragment_delay = (LogNormalDelay(fragment_latency_median_ms, fragment_latency_sigma, seed)
                                if fragment_latency_median_ms > 0 else None)
        self.rng = np.random.default_rng(seed)  # None: fresh OS entropy
        self.policy_version: int | None = None
        obs, _ = self.envs.reset(seed=seed)
        self._obs = as_observation(obs, spec.obs_dtype)
        self._stacker = FrameStacker(self._obs, spec.frame_stack) if spec.obs_dtype == "uint8" else None
        self._ep_return = np.zeros(num_envs, np.float64)
        self._ep_len = np.zeros(num_envs, np.int64)
        self.num_envs = num_envs

    @classmethod
    def from_settings(cls, settings: Settings, sampler_id: str, seed: int | None) -> RolloutWorker:
        """The worker a sampler of this run uses: env, fragment shape, policy width, normalisation and the
        benchmarks' latency settings all from ``settings``."""
        e = settings.env
        return cls(e.id, e.num_envs, e.fragment_steps, sampler_id, PolicyArch.of(settings.trainer), seed,
                   e.latency_median_ms, e.latency_sigma, e.latency_overlap,
                   fragment_latency_median_ms=e.fragment_latency_median_ms,
                   fragment_latency_sigma=e.fragment_latency_sigma, frame_stack=e.frame_stack,
                   torch_threads=settings.sampler.torch_threads, inference=settings.sampler.inference,
                   backend=e.backend)

    def set_policy(self, version: int, weights: bytes) -> None:
        """Adopt a policy (between fragments only); raises WeightsError if it does not fit."""
        self.policy.load(weights)
        self.policy_version = version

    def collect(self) -> Fragment:
        """Step every env ``fragment_steps`` times with the current policy."""
        if self.policy_version is None:
            raise RuntimeError("no policy loaded yet")
        T, N = self.steps, self.num_envs
        obs_buf = np.empty((T, N, *self._obs.shape[1:]), self._obs.dtype)
        history = self._stacker.history() if self._stacker is not None else None
        actions = np.empty((T, N, *self.spec.action_shape), np.float32 if self.spec.continuous else np.int64)
        logp = np.empty((T, N), np.float32)
        rewards = np.empty((T, N), np.float32)
        terminated = np.empty((T, N), np.uint8)
        truncated = np.empty((T, N), np.uint8)
        trunc_obs: list[np.ndarray] = []
        ep_returns: list[float] = []
        ep_lengths: list[int] = []
        for t in range(T):
            obs_buf[t] = self._obs
            a, logp[t] = self.policy.act(self._obs if self._stacker is None else self._stacker.stacks, self.rng)
            actions[t] = a.reshape(actions.shape[1:])
            env_actions = actions[t] if self._bounds is None else np.clip(actions[t], *self._bounds)
            obs, reward, term, trunc, info = self.envs.step(env_actions)
            rewards[t] = reward
            terminated[t] = term
            truncated[t] = trunc & ~term
            self._ep_return += reward
            self._ep_len += 1
            for i in np.flatnonzero(term | trunc):
                if truncated[t, i]:
                    trunc_obs.append(as_observation(info["final_obs"][i], self.spec.obs_dtype))
                ep_returns.append(float(self._ep_return[i]))
                ep_lengths.append(int(self._ep_len[i]))
                self._ep_return[i] = 0.0
                self._ep_len[i] = 0
            self._obs = as_observation(obs, self.spec.obs_dtype)
            if self._stacker is not None:
                self._stacker.push(self._obs, term | trunc)
        if self._fragment_delay is not None:  # benchmarks: the fragment's generation time as a whole
            time.sleep(float(self._fragment_delay.draw()))
        obs_shape = self._obs.shape[1:]
        return Fragment(
            obs=obs_buf,
            actions=actions,
            logp=logp,
            rewards=rewards,
            terminated=terminated,
            truncated=truncated,
            trunc_obs=np.stack(trunc_obs) if trunc_obs else np.zeros((0, *obs_shape), self._obs.dtype),
            last_obs=self._obs.copy(),
            episode_returns=np.asarray(ep_returns, np.float32),
            episode_lengths=np.asarray(ep_lengths, np.int32),
            policy_version=self.policy_version,
            sampler_id=self.sampler_id,
            env_id=self.env_id,
            obs_history=history,
        )

    def close(self) -> None:
        self.envs.close()
