"""``flywheel export``: a published policy version as a file other programs load (docs/using-a-policy.md).

- ``onnx``: the samplers' policy as an ONNX graph (opset :data:`OPSET`), built by exporting a torch module that
  computes exactly what :class:`shared.rl.policy_np.NumpyPolicy` computes, from the same blob:
  input ``obs`` ``float32 [batch, obs_dim]`` (dynamic batch); outputs ``action`` (the deterministic action:
  ``int64 [batch]`` argmax of the logits, or ``float32 [batch, A]`` Gaussian mean clipped to the action
  space's bounds), ``logits`` (discrete) or ``mean`` (continuous) ``float32 [batch, A]``, and ``value``
  ``float32 [batch]`` (the critic). Observation normalisation, when the run uses it, is inside the graph.
  The model's ``metadata_props`` hold :func:`metadata` (env id, version, ...).
  A CNN policy (image envs, docs/pixels.md) takes ``obs`` ``uint8 [batch, K, *frame]``: the last ``K``
  (``env.frame_stack``) frames of each env, oldest first, 0-255 (MinAtar's booleans as 0/255), as the samplers
  stack them; its outputs are ``action`` (argmax), ``logits`` and ``value``.
- ``safetensors``: the blob's tensors under their state_dict names (``actor.0.weight`` ``[out, in]``, ...,
  ``critic.*``, ``log_std``, ``obs_norm.*``), with :func:`metadata` in the header.

Torch and onnx are imported only by :func:`export_onnx`. No print here: the CLI prints.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from services.admin.evaluate import SamplerPolicy, action_bounds, build_env, load_trusted, loaded_policy
from shared.marker import VersionedStore, VersionRecord
from shared.rl.policy_np import NumpyPolicy, validate_weights
from shared.rl.policy_onnx import quiet_exporter
from shared.settings import Settings

if TYPE_CHECKING:
    from torch import Tensor, nn

FORMATS = ("onnx", "safetensors")
OPSET = 18
"""ONNX opset of the exported graph (onnxruntime >= 1.14 runs it)."""
SUFFIX = {"onnx": ".onnx", "safetensors": ".safetensors"}


def metadata(run: str, env_id: str, record: VersionRecord, policy: SamplerPolicy) -> dict[str, str]:
    """What a loader needs to know besides the tensors, as strings (ONNX and safetensors metadata are str -> str)."""
    common = {"flywheel.run": run, "flywheel.env_id": env_id, "flywheel.version": str(record.version),
              "flywheel.trainer_step": str(record.trainer_step), "flywheel.sha256": record.sha256}
    if not isinstance(policy, NumpyPolicy):  # a CNN: its input is a stack of uint8 frames
        return {**common, "flywheel.model": policy.kind,
                "flywheel.obs_shape": ",".join(str(d) for d in policy.input_shape), "flywheel.obs_dtype": "uint8",
                "flywheel.frame_stack": str(policy.frame_stack), "flywheel.action_dim": str(policy.model.num_actions),
                "flywheel.actions": "discrete"}
    return {**common, "flywheel.model": "mlp",
            "flywheel.obs_dim": str(policy.obs_dim), "flywheel.action_dim": str(policy.num_actions),
            "flywheel.actions": "continuous" if policy.continuous else "discrete",
            "flywheel.hidden": str(policy.hidden), "flywheel.activation": policy.activation,
            "flywheel.gsde": str(policy.gsde).lower(),
            "flywheel.normalize_observations": str(any(k.startswith("obs_norm.") for k in policy.shapes)).lower()}


def export_safetensors(blob: bytes, policy: SamplerPolicy, path: Path, meta: dict[str, str]) -> Path:
    """The blob's tensors, checked against ``policy``'s shapes, with ``meta`` in the header; ``path``."""
    from safetensors.numpy import save_file

    tensors = validate_weights(blob, policy.shapes)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=meta)
    return path


def policy_module(blob: bytes, policy: SamplerPolicy, bounds: tuple[np.ndarray, np.ndarray] | None) -> nn.Module:
    """A torch module ``obs [B, obs_dim] -> (action, logits | mean, value)`` that computes what ``policy``
    computes with ``blob`` loaded: :class:`shared.rl.model.ActorCritic` loaded with the same check the samplers
    apply, its actor and critic behind the same observation normalisation. A CNN policy: ``obs [B, K, *frame]``
    uint8 through the torso the policy and value heads share."""
    import torch
    from torch import nn

    from shared.rl.model import ActorCritic, load_weights

    if not isinstance(policy, NumpyPolicy):
        cnn = policy.model
        load_weights(cnn, blob)
        cnn.eval()

        class ImagePolicy(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.model = cnn

            def forward(self, obs: Tensor) -> tuple[Tensor, Tensor, Tensor]:
                features = self.model._features(obs)  # the torso, run once for both heads
                logits = self.model.actor(features)
                return torch.argmax(logits, dim=-1), logits, self.model.critic(features).squeeze(-1)

        return ImagePolicy().eval()

    model = ActorCritic(policy.obs_dim, policy.num_actions, policy.hidden, continuous=policy.continuous,
                        normalize_observations="obs_norm.mean" in policy.shapes, gsde=policy.gsde,
                        activation=policy.activation)
    load_weights(model, blob)
    model.eval()
    continuous = policy.continuous

    class Policy(nn.Module):
        low: Tensor
        high: Tensor

        def __init__(self) -> None:
            super().__init__()
            self.model = model
            if bounds is not None:
                self.register_buffer("low", torch.as_tensor(np.asarray(bounds[0], np.float32).reshape(-1)))
                self.register_buffer("high", torch.as_tensor(np.asarray(bounds[1], np.float32).reshape(-1)))

        def forward(self, obs: Tensor) -> tuple[Tensor, Tensor, Tensor]:
            x = obs if self.model.obs_norm is None else self.model.obs_norm(obs)
            out = self.model.actor(x)
            value = self.model.critic(x).squeeze(-1)
            if not continuous:
                return torch.argmax(out, dim=-1), out, value
            action = out if bounds is None else torch.maximum(torch.minimum(out, self.high), self.low)
            return action, out, value

    return Policy().eval()


def export_onnx(blob: bytes, policy: SamplerPolicy, bounds: tuple[np.ndarray, np.ndarray] | None, path: Path,
                meta: dict[str, str], opset: int = OPSET) -> Path:
    """``blob`` as an ONNX file at ``path`` (see the module docstring for inputs and outputs); ``path``."""
    import onnx
    import torch

    module = policy_module(blob, policy, bounds)
    if isinstance(policy, NumpyPolicy):
        example = torch.zeros((2, policy.obs_dim), dtype=torch.float32)
        second = "mean" if policy.continuous else "logits"
    else:
        example = torch.zeros((2, *policy.input_shape), dtype=torch.uint8)
        second = "logits"
    path.parent.mkdir(parents=True, exist_ok=True)
    with quiet_exporter(), torch.no_grad():
        program: Any = torch.onnx.export(
            module, (example,), dynamo=True, input_names=["obs"], output_names=["action", second, "value"],
            opset_version=opset, dynamic_shapes=({0: torch.export.Dim("batch", min=1)},), verbose=False,
            external_data=False)
    model = program.model_proto
    for key, value in meta.items():
        model.metadata_props.append(onnx.StringStringEntryProto(key=key, value=value))
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def export_version(settings: Settings, policies: VersionedStore, version: int | None, fmt: str,
                   out: Path | None = None) -> tuple[Path, VersionRecord]:
    """Write ``version`` (None: the published one) of the run's policy in ``fmt`` to ``out`` (default
    ``./<run>-v<version>.<fmt>``); the path written and the version's record. Raises :class:`LookupError`
    (no such version), :class:`~services.admin.evaluate.EvalError` (the settings do not describe the blob)."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    record, blob = load_trusted(settings, policies, version)
    policy = loaded_policy(settings, record, blob)
    path = out if out is not None else Path(f"{settings.run}-v{record.version}{SUFFIX[fmt]}")
    meta = metadata(settings.run, settings.env.id, record, policy)
    if fmt == "safetensors":
        return export_safetensors(blob, policy, path, meta), record
    env = build_env(settings.env.id)
    try:
        bounds = action_bounds(env.action_space)
    finally:
        env.close()
    return export_onnx(blob, policy, bounds, path, meta), record
