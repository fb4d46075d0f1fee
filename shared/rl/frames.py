"""Frame stacking without stacked copies on the wire (``docs/pixels.md``).

The rule both sides apply: the policy at step ``t`` sees the last ``K`` frames ``[t-K+1 .. t]``, oldest
first, where a frame from before the episode's first frame is zeros. Samplers keep the stacks with
:class:`FrameStacker` and send single frames plus the ``K - 1`` frames before the fragment's first step
(``Fragment.obs_history``); the trainer rebuilds exactly the same stacks with :func:`stack_frames`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from shared.fragment import Fragment


class FrameStacker:
    """The ``[N, K, *O]`` stacks of ``N`` envs. ``push`` adds each env's newest frame; envs whose episode
    just ended (``reset``) first lose their old frames."""

    def __init__(self, frames: np.ndarray, k: int) -> None:
        """``frames`` ``[N, *O]``: each env's first frame."""
        if k < 1:
            raise ValueError(f"frame_stack must be >= 1, got {k}")
        self.k = k
        self.stacks = np.zeros((frames.shape[0], k, *frames.shape[1:]), frames.dtype)
        self.stacks[:, -1] = frames

    def push(self, frames: np.ndarray, reset: np.ndarray) -> None:
        self.stacks[:, :-1] = self.stacks[:, 1:]
        self.stacks[reset, :-1] = 0
        self.stacks[:, -1] = frames

    def history(self) -> np.ndarray | None:
        """``[K-1, N, *O]``: the frames before the newest (``Fragment.obs_history``); None when ``K`` is 1."""
        if self.k == 1:
            return None
        history: np.ndarray = np.ascontiguousarray(self.stacks[:, :-1].swapaxes(0, 1))
        return history

    def with_final(self, i: int, frame: np.ndarray) -> np.ndarray:
        """Env ``i``'s stack with ``frame`` as its newest frame instead (a truncated episode's final observation,
        before the push of the reset frame)."""
        stack: np.ndarray = self.stacks[i].copy()
        stack[:-1] = stack[1:]
        stack[-1] = frame
        return stack


def stack_frames(frag: Fragment, k: int) -> Fragment:
    """``frag`` with observations ``[T, N, K, *O]``, ``last_obs`` ``[N, K, *O]`` and ``trunc_obs``
    ``[D, K, *O]`` as the sampler's policy saw them (the module's rule); ``k == 1`` adds the axis only."""
    steps, envs = frag.rewards.shape
    frame_shape = frag.last_obs.shape[1:]
    history = frag.obs_history if frag.obs_history is not None else np.zeros((0, envs, *frame_shape), frag.obs.dtype)
    if history.shape[0] != k - 1:
        raise ValueError(f"fragment carries {history.shape[0]} history frames, frame_stack={k} needs {k - 1}")
    seq = np.concatenate([history, frag.obs, frag.last_obs[None]])  # seq[i] is step i - (K - 1)
    done = np.asarray(frag.terminated, bool) | np.asarray(frag.truncated, bool)
    # first[t, n]: the step of the first frame of env n's episode at step t (-K: it began before the history)
    first = np.full((steps + 1, envs), -k, np.int64)
    for t in range(1, steps + 1):
        first[t] = np.where(done[t - 1], t, first[t - 1])
    offsets = np.arange(-(k - 1), 1)  # frame j of a stack at step t is step t + offsets[j]

    def stacks_at(t: np.ndarray, n: np.ndarray, newest: np.ndarray | None = None) -> np.ndarray:
        steps_of = t[:, None] + offsets[None, :]  # [M, K]
        out: np.ndarray = seq[steps_of + (k - 1), n[:, None]]  # [M, K, *O]
        valid = steps_of >= first[t, n][:, None]
        out[~valid] = 0
        if newest is not None:
            out = np.concatenate([out[:, 1:], newest[:, None]], axis=1)
            out[:, :-1][~valid[:, 1:]] = 0
        return out

    tt, nn = np.meshgrid(np.arange(steps), np.arange(envs), indexing="ij")
    obs = stacks_at(tt.ravel(), nn.ravel()).reshape(steps, envs, k, *frame_shape)
    last = stacks_at(np.full(envs, steps), np.arange(envs))
    trunc_t, trunc_n = np.nonzero(np.asarray(frag.truncated, bool))  # row-major (t, n): trunc_obs's order
    trunc = (stacks_at(trunc_t, trunc_n, frag.trunc_obs) if trunc_t.size
             else np.zeros((0, k, *frame_shape), frag.trunc_obs.dtype))
    return dataclasses.replace(frag, obs=obs, last_obs=last, trunc_obs=trunc, obs_history=None)
