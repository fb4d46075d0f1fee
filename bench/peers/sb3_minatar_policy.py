"""The parts of the SB3 MinAtar peer that need stable-baselines3 (the ``bench`` extra): Flywheel's MinAtar torso
as an SB3 features extractor, and the wall-budget callback. Kept apart so that importing ``bench.peers.sb3_minatar``
(and the figure registry) needs no SB3."""

from __future__ import annotations

import time

import gymnasium as gym
import torch
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.torch_layers import BaseFeaturesExtractor

from bench.peers.sb3_minatar import emit
from shared.rl.cnn import image_layout, make_torso


class MinAtarCNN(BaseFeaturesExtractor):
    """Flywheel's ``minatar_cnn`` torso as an SB3 features extractor. Input: SB3's preprocessed observations,
    channels first ``[B, C, H, W]`` scaled to 0-1 (after ``VecTransposeImage`` and ``normalize_images``);
    output ``[B, 128]``. The torso is ``shared.rl.cnn.make_torso``'s, so the layers cannot drift apart."""

    def __init__(self, observation_space: gym.spaces.Box) -> None:
        c, h, w, channels_last = image_layout(tuple(observation_space.shape))
        if channels_last:
            raise ValueError(f"MinAtarCNN wants channels-first frames (SB3 transposes them), got "
                             f"{observation_space.shape}")
        torso, width = make_torso("minatar_cnn", c, h, w)
        super().__init__(observation_space, features_dim=width)
        self.torso = torso

    def forward(self, observations: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.torso(observations)
        return out


class BudgetWatch(BaseCallback):
    """Stops ``learn()`` at the first env step that ends after ``wall_s`` seconds of learning (that step is not
    counted); records (seconds since ``learn()`` began, env steps, return) of every episode finished before."""

    def __init__(self, wall_s: float) -> None:
        super().__init__()
        self.wall_s = wall_s
        self.t0 = 0.0
        self.curve: list[tuple[float, int, float]] = []
        self.steps_at_budget = 0

    def _on_training_start(self) -> None:
        self.t0 = time.monotonic()
        emit({"event": "learn_start", "wall": time.time()})

    def _on_step(self) -> bool:
        t = time.monotonic() - self.t0
        if t > self.wall_s:
            return False
        self.steps_at_budget = int(self.num_timesteps)
        for info in self.locals["infos"]:
            ep = info.get("episode")
            if ep is not None:
                self.curve.append((round(t, 3), self.steps_at_budget, float(ep["r"])))
        return True
