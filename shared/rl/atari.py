"""The Atari preprocessing table every ``ALE/`` game gets, whichever backend steps it (``env.backend``): its own
module so that the gymnasium backend (``shared.rl.envs``) and the EnvPool backend (``shared.rl.envpool_env``) both
read it without importing each other."""

from __future__ import annotations

import dataclasses

ATARI_PREFIX = "ALE/"


@dataclasses.dataclass(frozen=True)
class AtariPreprocessing:
    """The Atari preprocessing of every ``ALE/`` game, whichever backend steps it (``env.backend``): rl-zoo's, as
    the ``NoFrameskip-v4`` games rl-zoo trains on. The gymnasium backend applies it with gymnasium's
    ``AtariPreprocessing`` (:func:`env_options`), the EnvPool backend with EnvPool's own options
    (``shared.rl.envpool_env.envpool_options``); both read this one table."""

    frame_skip: int = 4
    """Env steps repeat the action this many emulator frames; the frame is the max over the last two."""
    noop_max: int = 30
    """Up to this many no-op steps at reset (at least one)."""
    screen_size: int = 84
    """Frames are ``screen_size`` x ``screen_size``, resized with cv2's INTER_AREA."""
    grayscale: bool = True
    """One luminance channel: frames are HW uint8."""
    terminal_on_life_loss: bool = False
    """Episodic life: off, so an episode (its return and length in fragments) is a whole game."""
    repeat_action_probability: float = 0.0
    """Sticky actions: off."""
    full_action_space: bool = False
    """The game's minimal action set (ALE v5's default)."""
    max_episode_frames: int = 108_000
    """ALE v5's truncation: emulator frames per episode (27,000 env steps at frame skip 4)."""
    reward_clip: bool = False
    """Rewards unclipped (Pong's are already +-1)."""


ATARI = AtariPreprocessing()
