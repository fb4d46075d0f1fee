"""Fragments for tests: valid CartPole-shaped experience (zero observations, action 0, reward 1)."""

from __future__ import annotations

import uuid

import numpy as np

from shared.fragment import Fragment


def blank_fragment(version: int, *, steps: int, envs: int, sampler_id: str = "s0", env_id: str = "CartPole-v1",
                   sample_id: str | None = None) -> Fragment:
    """A fragment that passes validation: ``steps`` x ``envs`` steps made by policy ``version``."""
    t, n = steps, envs
    return Fragment(obs=np.zeros((t, n, 4), np.float32), actions=np.zeros((t, n), np.int64),
                    logp=np.full((t, n), -0.69, np.float32), rewards=np.ones((t, n), np.float32),
                    terminated=np.zeros((t, n), np.uint8), truncated=np.zeros((t, n), np.uint8),
                    trunc_obs=np.zeros((0, 4), np.float32), last_obs=np.zeros((n, 4), np.float32),
                    episode_returns=np.zeros(0, np.float32), episode_lengths=np.zeros(0, np.int32),
                    policy_version=version, sampler_id=sampler_id, env_id=env_id,
                    sample_id=sample_id or uuid.uuid4().hex)
