"""Convolutional actor-critics for image observations (uint8 frames, HWC or CHW, frame-stacked).

One torso shared by the policy and the value head, as CleanRL's ``ppo_atari.py`` and Stable-Baselines3's
``CnnPolicy``: ``nature_cnn`` (Mnih et al., "Human-level control through deep reinforcement learning",
Nature 2015: three convolutions and a 512-unit layer, for 84x84 Atari frames) or ``minatar_cnn`` (Young &
Tian, "MinAtar", 2019: one 3x3 convolution of 16 channels and a 128-unit layer, for 10x10 MinAtar
frames). Inputs arrive flat, shaped ``[..., K, *O]``, or with ``K == 1`` ``[..., *O]``; each forward pass
reshapes them to ``[B, K * C, H, W]`` and scales 0-255 to 0-1.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from torch import nn

from shared.rl.model import ActorCritic, _layer

Torso = Literal["nature_cnn", "minatar_cnn"]
TORSOS: tuple[Torso, ...] = ("nature_cnn", "minatar_cnn")


def image_layout(obs_shape: tuple[int, ...]) -> tuple[int, int, int, bool]:
    """``(C, H, W, channels_last)`` of a frame shape: ``(H, W)`` is one channel; of three dims the channel
    axis is the smaller end (``(10, 10, 4)`` HWC, ``(4, 84, 84)`` CHW)."""
    if len(obs_shape) == 2:
        return 1, obs_shape[0], obs_shape[1], True
    if len(obs_shape) == 3:
        if obs_shape[-1] <= obs_shape[0]:
            return obs_shape[2], obs_shape[0], obs_shape[1], True
        return obs_shape[0], obs_shape[1], obs_shape[2], False
    raise ValueError(f"image observations must be [H, W], [H, W, C] or [C, H, W], got {obs_shape}")


def auto_torso(obs_shape: tuple[int, ...]) -> Torso:
    """``nature_cnn`` for frames of at least 36x36 pixels (its convolutions need them), else ``minatar_cnn``."""
    _, h, w, _ = image_layout(obs_shape)
    return "nature_cnn" if min(h, w) >= 36 else "minatar_cnn"


def _conv(layer: nn.Conv2d) -> nn.Conv2d:
    nn.init.orthogonal_(layer.weight, float(np.sqrt(2)))
    assert layer.bias is not None
    nn.init.constant_(layer.bias, 0.0)
    return layer


def make_torso(kind: Torso, channels: int, h: int, w: int) -> tuple[nn.Sequential, int]:
    """The torso and its output width."""
    if kind == "nature_cnn":
        convs = nn.Sequential(_conv(nn.Conv2d(channels, 32, 8, 4)), nn.ReLU(), _conv(nn.Conv2d(32, 64, 4, 2)),
                              nn.ReLU(), _conv(nn.Conv2d(64, 64, 3, 1)), nn.ReLU(), nn.Flatten())
        width = 512
    elif kind == "minatar_cnn":
        convs = nn.Sequential(_conv(nn.Conv2d(channels, 16, 3, 1)), nn.ReLU(), nn.Flatten())
        width = 128
    else:
        raise ValueError(f"trainer.model={kind!r}: want one of {TORSOS}")
    with torch.no_grad():
        try:
            flat = int(convs(torch.zeros(1, channels, h, w)).shape[1])
        except RuntimeError as exc:
            raise ValueError(f"trainer.model={kind!r} does not fit {h}x{w} frames: {exc}") from None
    return nn.Sequential(*convs, _layer(nn.Linear(flat, width)), nn.ReLU()), width


class ImageActorCritic(ActorCritic):
    """A CNN torso shared by a linear policy head (discrete actions: logits) and a linear value head; the
    interface of :class:`ActorCritic` (the update step and the samplers use either). State dict keys:
    ``torso.*``, ``actor.*``, ``critic.*``. :meth:`actor_parameters` includes the torso, :meth:`critic_parameters`
    is the value head only (the torso's gradient is clipped with the policy's under ``separate_grad_clip``)."""

    def __init__(self, obs_shape: tuple[int, ...], num_actions: int, torso: Torso, frame_stack: int = 1) -> None:
        nn.Module.__init__(self)
        c, h, w, self.channels_last = image_layout(obs_shape)
        self.frame_shape = obs_shape
        self.frame_stack = frame_stack
        self.obs_dim = int(np.prod(obs_shape)) * frame_stack
        self.num_actions = num_actions
        self.continuous = False
        self.gsde = False
        self.obs_norm = None
        self.log_std = None
        self.kind = torso
        self.torso, width = make_torso(torso, c * frame_stack, h, w)
        self.actor = _layer(nn.Linear(width, num_actions), std=0.01)  # type: ignore[assignment]
        self.critic = _layer(nn.Linear(width, 1), std=1.0)  # type: ignore[assignment]
        # The torso's input laid out channels last (NHWC) in memory: the learner turns it on (its minibatches
        # of hundreds of frames convolve faster so: docs/pixels.md); samplers and exports keep the default.
        # Only the activations' layout changes, never the parameters' (checkpoints and exports stay contiguous).
        self.channels_last_input = False

    def actor_parameters(self) -> list[nn.Parameter]:
        return [*self.torso.parameters(), *self.actor.parameters()]

    def _features(self, obs: torch.Tensor) -> torch.Tensor:
        """``[..., obs_dim]`` or ``[..., K, *O]`` frames (0-255, any dtype) -> torso features ``[..., width]``."""
        stacked = (self.frame_stack, *self.frame_shape)
        if tuple(obs.shape[obs.dim() - len(stacked):]) == stacked:
            lead = obs.shape[: obs.dim() - len(stacked)]
        elif self.frame_stack == 1 and tuple(obs.shape[obs.dim() - len(self.frame_shape):]) == self.frame_shape:
            lead = obs.shape[: obs.dim() - len(self.frame_shape)]  # unstacked frames [..., *O]
        elif obs.shape[-1] == self.obs_dim:
            lead = obs.shape[:-1]
        else:
            raise ValueError(f"observations of shape {tuple(obs.shape)}: want [..., {self.obs_dim}] "
                             f"or [..., *{stacked}]")
        x = obs.reshape(-1, self.frame_stack, *self.frame_shape).float() / 255.0
        if len(self.frame_shape) == 2:
            x = x.unsqueeze(2)  # [B, K, 1, H, W]
        elif self.channels_last:
            x = x.permute(0, 1, 4, 2, 3)  # [B, K, H, W, C] -> [B, K, C, H, W] (non-negative dims: ONNX export)
        x = x.flatten(1, 2)  # [B, K * C, H, W]
        if self.channels_last_input:
            x = x.contiguous(memory_format=torch.channels_last)
        features: torch.Tensor = self.torso(x)
        return features.reshape(*lead, -1)

    def evaluate(self, obs: torch.Tensor, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(logp, entropy, value)`` from one pass of the torso shared by both heads (``logp_entropy`` and
        ``value`` would each run it: twice the convolutions forward and backward in every minibatch)."""
        features = self._features(obs)
        lp = torch.log_softmax(self.actor(features), dim=-1)
        logp = lp.gather(-1, actions.unsqueeze(-1)).squeeze(-1)
        entropy = -(lp.exp() * lp).sum(-1)
        value: torch.Tensor = self.critic(features).squeeze(-1)
        return logp, entropy, value
