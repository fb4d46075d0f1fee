"""The parts of the SB3 MinAtar peer that need stable-baselines3 (the ``bench`` extra): Flywheel's torsos (MinAtar's,
and the Nature CNN for the Pong peer ``bench.peers.sb3_atari``) as SB3 features extractors, and the wall-budget
callback. Kept apart so that importing ``bench.peers.sb3_minatar`` (and the figure registry) needs no SB3."""

from __future__ import annotations

import gymnasium as gym
import torch
from stable_baselines3.common.torch_layers import BaseFeaturesExtractor

from shared.rl.model import Torso, image_layout, make_torso


class FlywheelTorso(BaseFeaturesExtractor):
    """A torso of Flywheel's ``shared.rl.model.make_torso`` (``kind``: ``nature_cnn`` or ``minatar_cnn``) as an SB3
    features extractor, so the layers and their initialisation cannot drift apart. Input: SB3's preprocessed
    observations, channels first ``[B, C, H, W]`` scaled to 0-1 (after ``VecTransposeImage`` and
    ``normalize_images``; stacked frames are channels); output ``[B, width]`` (512 for the Nature CNN, 128 for
    MinAtar's). Pass the kind as ``features_extractor_kwargs={"kind": ...}``."""

    def __init__(self, observation_space: gym.spaces.Box, kind: Torso = "nature_cnn") -> None:
        c, h, w, channels_last = image_layout(tuple(observation_space.shape))
        if channels_last:
            raise ValueError(f"{type(self).__name__} wants channels-first frames (SB3 transposes them), got "
                             f"{observation_space.shape}")
        torso, width = make_torso(kind, c, h, w)
        super().__init__(observation_space, features_dim=width)
        self.kind = kind
        self.torso = torso

    def forward(self, observations: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.torso(observations)
        return out


class MinAtarCNN(FlywheelTorso):
    """Flywheel's ``minatar_cnn`` torso as an SB3 features extractor (``[B, C, 10, 10]`` -> ``[B, 128]``)."""

    def __init__(self, observation_space: gym.spaces.Box) -> None:
        super().__init__(observation_space, "minatar_cnn")
