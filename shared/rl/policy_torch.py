"""The samplers' policy for CNN models: the trainer's torch module in inference mode.

A CNN forward pass in numpy would be far slower than torch's convolutions, so image policies run in torch
(threads set by ``sampler.torch_threads``) or, faster at the samplers' batch sizes, in onnxruntime
(:mod:`shared.rl.policy_onnx`, ``sampler.inference``); the MLP stays in numpy (:mod:`shared.rl.policy_np`),
which is faster at its size. Actions are sampled in numpy with the sampler's generator, by the same inverse-CDF rule
as :class:`~shared.rl.policy_np.NumpyPolicy`. Weights are checked by the same loader as the trainer's
(:func:`shared.rl.model.load_weights`): a blob that does not fit is refused and the old weights kept.
"""

from __future__ import annotations

import numpy as np
import torch

from shared.fragment import FragmentSpec
from shared.rl.model import ActorCritic, ImageActorCritic, load_weights
from shared.rl.policy_onnx import sample_discrete as sample_discrete  # one rule for every backend, torch-free


class TorchPolicy:
    """``act(obs, rng)`` for observations ``[N, K, *O]`` (or ``[N, obs_dim]``) through a torch model."""

    def __init__(self, model: ActorCritic, threads: int = 1) -> None:
        if model.continuous:
            raise ValueError("TorchPolicy samples discrete actions only")
        torch.set_num_threads(threads)
        self.model = model.eval()
        self._loaded = False
        self.gsde = False  # discrete actions only: no exploration state (as NumpyPolicy.gsde)
        self.image = isinstance(model, ImageActorCritic)
        """A CNN: observations are frame stacks ``[N, K, *O]`` (uint8 0-255), else rows ``[N, obs_dim]``."""
        self.frame_stack = model.frame_stack if isinstance(model, ImageActorCritic) else 1
        self.kind = model.kind if isinstance(model, ImageActorCritic) else "mlp"
        """``trainer.model`` as built: ``nature_cnn``, ``minatar_cnn`` or ``mlp``."""
        self.input_shape: tuple[int, ...] = ((model.frame_stack, *model.frame_shape)
                                             if isinstance(model, ImageActorCritic) else (model.obs_dim,))
        """One row of :meth:`act`'s observations."""
        self.shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        """The weights blob's keys and shapes (what :meth:`load` accepts)."""

    @classmethod
    def for_spec(cls, spec: FragmentSpec, model: str, hidden: int, threads: int = 1, *,
                 activation: str = "tanh") -> TorchPolicy:
        return cls(ActorCritic.for_spec(spec, hidden, model=model, activation=activation), threads)

    @property
    def loaded(self) -> bool:
        return self._loaded

    def load(self, data: bytes) -> None:
        """Adopt a safetensors blob; raises ``WeightsError`` (keeping the current weights) if it does not fit."""
        load_weights(self.model, data)
        self._loaded = True

    def log_probs(self, obs: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            out: np.ndarray = self.model.log_probs(torch.from_numpy(np.ascontiguousarray(obs))).numpy()
        return out

    def act(self, obs: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """One action per row (int64 ``[N]``) and its log-prob (float32 ``[N]``)."""
        if not self._loaded:
            raise RuntimeError("no weights loaded yet")
        return sample_discrete(self.log_probs(obs), rng)
