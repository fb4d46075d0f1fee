"""The policies' CNN architecture as data, without torch: frame layouts, the torsos' convolutions, and the weights'
key set and shapes.

The trainer's torch model (:func:`shared.rl.model.make_torso`, :class:`~shared.rl.model.ImageActorCritic`) is built
from these tables, and the samplers' onnxruntime policy (:mod:`shared.rl.policy_onnx`) builds its graph from them
without importing torch, so both agree on the network by construction (``tests/unit/test_policy_onnx.py`` checks
the shapes and the outputs against the torch model).
"""

from __future__ import annotations

from typing import Literal

from shared.fragment import FragmentSpec

Torso = Literal["nature_cnn", "minatar_cnn"]
TORSOS: tuple[Torso, ...] = ("nature_cnn", "minatar_cnn")

CONVS: dict[str, tuple[tuple[int, int, int], ...]] = {
    # (out channels, kernel, stride) of each convolution, each followed by a ReLU; no padding.
    "nature_cnn": ((32, 8, 4), (64, 4, 2), (64, 3, 1)),  # Mnih et al. 2015
    "minatar_cnn": ((16, 3, 1),),  # MinAtar's (Young and Tian 2019)
}
WIDTH: dict[str, int] = {"nature_cnn": 512, "minatar_cnn": 128}
"""The torso's output width: one linear layer (and a ReLU) after the flattened convolutions."""


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


def check_torso(kind: str) -> Torso:
    if kind not in TORSOS:
        raise ValueError(f"trainer.model={kind!r}: want one of {TORSOS}")
    return kind


def conv_output(kind: str, h: int, w: int) -> tuple[int, int, int]:
    """``(channels, height, width)`` after ``kind``'s convolutions on ``h`` x ``w`` frames; a ValueError naming
    the setting when the frames are too small."""
    c = 0
    for out, k, s in CONVS[check_torso(kind)]:
        h, w, c = (h - k) // s + 1, (w - k) // s + 1, out
        if h < 1 or w < 1:
            raise ValueError(f"trainer.model={kind!r} does not fit the frames: a {k}x{k} convolution leaves "
                             f"{max(h, 0)}x{max(w, 0)}")
    return c, h, w


def resolve_model(spec: FragmentSpec, model: str) -> str:
    """``trainer.model`` for ``spec``'s env as :meth:`shared.rl.model.ActorCritic.for_spec` builds it: ``mlp`` or a
    torso name (``auto`` and ``cnn`` resolved), refusing what it cannot serve as it does, naming the setting."""
    if model == "auto":
        model = "mlp" if spec.obs_dtype != "uint8" else "cnn"
    if model == "mlp":
        return model
    if spec.continuous:
        raise ValueError(f"trainer.model={model!r}: CNN models support discrete actions only")
    torso = auto_torso(spec.obs_shape) if model == "cnn" else model
    if torso not in TORSOS:
        raise ValueError(f"trainer.model={model!r}: want auto, mlp or one of {TORSOS}")
    return torso


def image_shapes(spec: FragmentSpec, torso: str) -> dict[str, tuple[int, ...]]:
    """Key -> shape of ``ImageActorCritic(spec.obs_shape, spec.num_actions, torso, spec.frame_stack).state_dict()``:
    ``torso.<i>`` for the convolutions (every other module: a ReLU follows each, then a Flatten) and the linear
    layer, ``actor.*`` and ``critic.*`` for the heads."""
    c, h, w, _ = image_layout(spec.obs_shape)
    channels = c * spec.frame_stack
    shapes: dict[str, tuple[int, ...]] = {}
    for i, (out, k, _) in enumerate(CONVS[check_torso(torso)]):
        shapes[f"torso.{2 * i}.weight"] = (out, channels, k, k)
        shapes[f"torso.{2 * i}.bias"] = (out,)
        channels = out
    oc, oh, ow = conv_output(torso, h, w)
    linear = 2 * len(CONVS[torso]) + 1  # after the convolutions, their ReLUs and the Flatten
    width = WIDTH[torso]
    shapes[f"torso.{linear}.weight"] = (width, oc * oh * ow)
    shapes[f"torso.{linear}.bias"] = (width,)
    shapes.update({"actor.weight": (spec.num_actions, width), "actor.bias": (spec.num_actions,),
                   "critic.weight": (1, width), "critic.bias": (1,)})
    return shapes
