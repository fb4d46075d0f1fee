"""The policy's architecture, taken from the trainer's settings in one place.

The trainer trains a torch ``ActorCritic``; paramsync reloads its weights; each sampler runs the same network
in numpy, torch or onnxruntime; ``flywheel eval`` and ``flywheel export`` rebuild it from a stored blob. All of
them must agree on what the weights' key set and shapes and the forward pass depend on, so each builds from a
:class:`PolicyArch` made by :meth:`PolicyArch.of` rather than picking the settings it remembers to pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from shared.fragment import FragmentSpec
from shared.rl.policy_np import NumpyPolicy
from shared.rl.policy_onnx import resolve_inference, runs_cnn

if TYPE_CHECKING:
    from shared.rl.policy_onnx import OnnxPolicy
    from shared.rl.policy_torch import TorchPolicy
    from shared.settings import TrainerSettings

    SamplerPolicy = NumpyPolicy | TorchPolicy | OnnxPolicy


@dataclass(frozen=True)
class PolicyArch:
    """``trainer.model``, ``hidden``, ``activation``, ``normalize_observations`` (the weights carry the running
    statistics), ``gsde`` (the weights carry the noise matrix) and ``sde_sample_freq`` (how often a sampler
    redraws it). Initialisation (``log_std_init``, ``ortho_init``) is the trainer's alone: weights loaded
    over it replace it."""

    model: str = "auto"
    hidden: int = 64
    activation: str = "tanh"
    normalize_observations: bool = False
    gsde: bool = False
    sde_sample_freq: int = 4

    @classmethod
    def of(cls, trainer: TrainerSettings) -> PolicyArch:
        return cls(trainer.model, trainer.hidden, trainer.activation, trainer.normalize_observations,
                   trainer.gsde, trainer.sde_sample_freq)

    def is_cnn(self, spec: FragmentSpec) -> bool:
        return runs_cnn(self.model, spec)


def sampler_policy(spec: FragmentSpec, arch: PolicyArch, inference: str = "auto", threads: int = 1) -> SamplerPolicy:
    """The policy a sampler of ``spec``'s env runs (empty until ``load``): ``inference`` is
    ``sampler.inference`` (``auto``: numpy for the MLP, onnxruntime for a CNN). A ValueError names the setting
    when the backend cannot run ``arch`` (numpy has no convolutions; the torch and onnx samplers run the MLP
    without observation normalisation or gSDE only)."""
    cnn = arch.is_cnn(spec)
    backend = resolve_inference(inference, cnn)
    if backend == "numpy":
        return NumpyPolicy.for_spec(spec, arch.hidden, normalize_observations=arch.normalize_observations,
                                    gsde=arch.gsde, sde_sample_freq=arch.sde_sample_freq, activation=arch.activation)
    if not cnn and (arch.normalize_observations or arch.gsde):
        raise ValueError(f"sampler.inference={backend!r} runs an MLP without observation normalisation or gSDE "
                         "only; use numpy or auto")
    if backend == "torch":
        from shared.rl.policy_torch import TorchPolicy  # imported only when used

        return TorchPolicy.for_spec(spec, arch.model, arch.hidden, threads, activation=arch.activation)
    from shared.rl.policy_onnx import OnnxPolicy  # imported only when used (onnxruntime and onnx; no torch)

    return OnnxPolicy.for_spec(spec, arch.model, arch.hidden, threads, activation=arch.activation)
