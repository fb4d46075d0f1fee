"""The actor of :class:`shared.rl.model.ActorCritic` for inference in numpy: no torch import.

Samplers only need the policy's forward pass and categorical or Gaussian sampling; doing both in numpy is
~3x cheaper per vector step than torch on small batches and keeps ``import torch`` (seconds)
out of the sampler process. The trainer keeps the torch model; both read the same safetensors
blob, and :func:`validate_weights` here is the one check both loaders apply (same key set, critic
included, same shapes, float32, finite), so a blob one side accepts the other accepts.

Optional parts of the model change the key set (and are fixed by the run's settings, never guessed
from a blob): ``log_std`` for continuous actions (``[action dims]``, or ``[hidden, action dims]`` with
gSDE), and ``obs_norm.{mean,var,count}`` when the trainer normalises observations. The statistics
travel inside the blob, so version v acts with exactly the normalisation version v was trained with.
"""

from __future__ import annotations

import numpy as np
from safetensors.numpy import load as st_load

from shared.fragment import FragmentSpec

DTYPE = np.dtype(np.float32)
_ACTOR_LAYERS = ("actor.0", "actor.2", "actor.4")
LOG_STD = "log_std"
OBS_MEAN, OBS_VAR, OBS_COUNT = "obs_norm.mean", "obs_norm.var", "obs_norm.count"
OBS_CLIP = 10.0
"""Normalised observations are clipped to +-OBS_CLIP (as Stable-Baselines3's VecNormalize)."""
OBS_EPS = 1e-8
"""Added to the variance before its square root."""
SDE_EPS = 1e-6
"""gSDE: added to the action variance ``latent^2 @ std^2`` before its square root (Stable-Baselines3's epsilon)."""
_HALF_LOG_2PI = float(0.5 * np.log(2 * np.pi))


ACTIVATIONS = ("tanh", "relu")
"""The MLP's hidden activations (``trainer.activation``): tanh as CleanRL's PPO, ReLU as rl-zoo's MuJoCo settings."""


def check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"trainer.activation={activation!r}: want one of {ACTIVATIONS}")


def check_gsde(gsde: bool, continuous: bool, env_id: str | None = None) -> None:
    """gSDE draws its noise on a Gaussian's features: refuse it for discrete actions, naming the env
    when known (the trainer's model and the samplers' policy both check, at start-up)."""
    if gsde and not continuous:
        what = f"{env_id} has discrete ones" if env_id else "this env's are discrete"
        raise ValueError(f"trainer.gsde needs continuous actions; {what}")


class WeightsError(ValueError):
    """A weights blob does not fit the model (missing keys, wrong shapes, non-finite values)."""


def expected_shapes(obs_dim: int, num_actions: int, hidden: int, *, continuous: bool = False,
                    normalize_observations: bool = False, gsde: bool = False) -> dict[str, tuple[int, ...]]:
    """Key -> shape of ``ActorCritic(obs_dim, num_actions, hidden, ...).state_dict()`` (Linear weights
    are ``[out, in]``; ``.0``, ``.2``, ``.4`` are the Linear layers of each ``nn.Sequential``).
    ``num_actions`` is the actor's output width: action count, or action dims when ``continuous``."""
    shapes: dict[str, tuple[int, ...]] = {}
    for head, out in (("actor", num_actions), ("critic", 1)):
        dims = [(hidden, obs_dim), (hidden, hidden), (out, hidden)]
        for idx, (o, i) in zip((0, 2, 4), dims, strict=True):
            shapes[f"{head}.{idx}.weight"] = (o, i)
            shapes[f"{head}.{idx}.bias"] = (o,)
    if continuous:
        shapes[LOG_STD] = (hidden, num_actions) if gsde else (num_actions,)
    if normalize_observations:
        shapes.update({OBS_MEAN: (obs_dim,), OBS_VAR: (obs_dim,), OBS_COUNT: (1,)})
    return shapes


def validate_weights(data: bytes, shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """Decode a safetensors blob and check it against ``shapes`` (float32, finite); the arrays."""
    try:
        tensors = st_load(data)
    except Exception as exc:  # safetensors raises several types for a bad header
        raise WeightsError(f"not a safetensors blob: {exc}") from None
    if set(tensors) != set(shapes):
        missing, extra = sorted(set(shapes) - set(tensors)), sorted(set(tensors) - set(shapes))
        raise WeightsError(f"keys differ: missing {missing}, extra {extra}")
    for k, v in tensors.items():
        if v.shape != shapes[k] or v.dtype != DTYPE:
            raise WeightsError(f"{k}: shape {tuple(v.shape)} {v.dtype}, want {shapes[k]} {DTYPE}")
        if not np.isfinite(v).all():
            raise WeightsError(f"{k} holds NaN or infinite values")
    if OBS_VAR in tensors and (tensors[OBS_VAR] < 0).any():
        raise WeightsError(f"{OBS_VAR} holds negative variances")
    return tensors


class NumpyPolicy:
    """Two-layer MLP (tanh, or ReLU: ``activation``) producing action logits (discrete) or the Gaussian mean
    (continuous, with the state-independent ``log_std``, or gSDE's state-dependent noise), as ``ActorCritic``'s
    actor; float32 throughout. The blob does not say which activation it was trained with: the run's settings do.

    gSDE keeps exploration state: one noise matrix ``[hidden, A]`` per row of ``obs`` (per env), drawn
    from ``N(0, exp(log_std)^2)`` and kept for ``sde_sample_freq`` calls of :meth:`act`, then redrawn; a
    newly loaded policy redraws at its first call (as Stable-Baselines3 does at each rollout's start)."""

    def __init__(self, obs_dim: int, num_actions: int, hidden: int = 64, *, continuous: bool = False,
                 normalize_observations: bool = False, gsde: bool = False, sde_sample_freq: int = 4,
                 activation: str = "tanh") -> None:
        check_gsde(gsde, continuous)
        check_activation(activation)
        if sde_sample_freq < 1:
            raise ValueError(f"sde_sample_freq must be >= 1, got {sde_sample_freq}")
        self.obs_dim = obs_dim
        self.num_actions = num_actions
        self.hidden = hidden
        self.activation = activation
        self._relu = activation == "relu"
        self.continuous = continuous
        self.gsde = gsde
        self.sde_sample_freq = sde_sample_freq
        self.shapes = expected_shapes(obs_dim, num_actions, hidden, continuous=continuous,
                                      normalize_observations=normalize_observations, gsde=gsde)
        # (W^T [in, out], b [out]) per layer; None until weights are loaded.
        self._layers: list[tuple[np.ndarray, np.ndarray]] | None = None
        self._log_std = np.zeros(self.shapes.get(LOG_STD, (num_actions,)), DTYPE)
        self._obs_norm: tuple[np.ndarray, np.ndarray] | None = None  # (mean, 1 / sqrt(var + eps))
        self._sde_noise: np.ndarray | None = None  # gSDE: [N, hidden, A], None = draw at the next act
        self._sde_age = 0  # act calls since the noise was drawn

    @classmethod
    def for_spec(cls, spec: FragmentSpec, hidden: int, *, normalize_observations: bool = False,
                 gsde: bool = False, sde_sample_freq: int = 4, activation: str = "tanh") -> NumpyPolicy:
        """A policy for the envs ``spec`` describes (observations and actions flattened)."""
        check_gsde(gsde, spec.continuous, spec.env_id)
        return cls(int(np.prod(spec.obs_shape)), spec.action_dim, hidden, continuous=spec.continuous,
                   normalize_observations=normalize_observations, gsde=gsde, sde_sample_freq=sde_sample_freq,
                   activation=activation)

    @property
    def loaded(self) -> bool:
        return self._layers is not None

    def load(self, data: bytes) -> None:
        """Adopt a safetensors blob; raises :class:`WeightsError` (keeping the current weights)
        if it does not fit."""
        tensors = validate_weights(data, self.shapes)
        self._layers = [(np.ascontiguousarray(tensors[f"{name}.weight"].T), tensors[f"{name}.bias"].copy())
                        for name in _ACTOR_LAYERS]
        if self.continuous:
            self._log_std = tensors[LOG_STD].copy()
            self._sde_noise = None  # the new policy's noise scale
        if OBS_MEAN in self.shapes:
            inv_std = (1.0 / np.sqrt(tensors[OBS_VAR].astype(np.float64) + OBS_EPS)).astype(DTYPE)
            self._obs_norm = (tensors[OBS_MEAN].copy(), inv_std)

    def logits(self, obs: np.ndarray) -> np.ndarray:
        """The actor's output ``[..., A]`` for observations ``[..., obs_dim]``: action logits, or the
        Gaussian mean for continuous actions. Observations are normalised first when the model does."""
        return self._forward(obs)[1]

    def _forward(self, obs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The actor's last hidden features ``[..., hidden]`` and its output ``[..., A]``."""
        if self._layers is None:
            raise RuntimeError("no weights loaded yet")
        (w0, b0), (w1, b1), (w2, b2) = self._layers
        x = np.asarray(obs, dtype=DTYPE)
        if self._obs_norm is not None:
            mean, inv_std = self._obs_norm
            x = (x - mean) * inv_std
            np.clip(x, -OBS_CLIP, OBS_CLIP, out=x)
        # In place where possible: at 8 rows numpy's per-call overhead is most of the cost.
        h = x @ w0
        h += b0
        self._activate(h)
        h = h @ w1
        h += b1
        self._activate(h)
        out: np.ndarray = h @ w2
        out += b2
        return h, out

    def _activate(self, h: np.ndarray) -> None:
        if self._relu:
            np.maximum(h, 0, out=h)
        else:
            np.tanh(h, out=h)

    def log_probs(self, obs: np.ndarray) -> np.ndarray:
        """Log-probabilities of every action ``[..., A]`` (log-softmax, max-shifted for stability)."""
        z = self.logits(obs)
        z -= z.max(axis=-1, keepdims=True)
        z -= np.log(np.exp(z).sum(axis=-1, keepdims=True))
        return z

    def act(self, obs: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """Sample one action per row of ``obs`` ``[N, obs_dim]``; return the actions (int64 ``[N]``, or
        float32 ``[N, A]`` when continuous) and their log-probs (float32 ``[N]``).

        Discrete: inverse CDF with one uniform per row on the unnormalised, max-shifted ``exp(logits)``:
        the action is the number of cumulative sums ``<= u``, the last column left out so it is at most
        ``A - 1``; a zero-probability action adds nothing to the sum and is never picked."""
        latent, z = self._forward(obs)
        if z.ndim != 2:
            raise ValueError(f"obs must be [N, {self.obs_dim}], got {np.shape(obs)}")
        if not np.isfinite(z).all():  # would sample garbage with NaN log-probs; fail loudly instead
            raise ValueError("policy logits are not finite (an observation with inf/NaN, or an overflow)")
        if self.gsde:
            return self._act_gsde(z, latent, rng)
        if self.continuous:
            return self._act_gaussian(z, rng)
        z -= z.max(axis=1, keepdims=True)
        cdf = np.exp(z).cumsum(axis=1)
        total = cdf[:, -1]  # >= 1: the max-shifted maximum contributes exp(0)
        u = rng.random(z.shape[0]) * total  # float64, so u < total holds exactly
        actions = (cdf[:, :-1] <= u[:, None]).sum(axis=1, dtype=np.int64)
        logp = z[np.arange(z.shape[0]), actions]
        logp -= np.log(total)
        return actions, logp

    def _act_gaussian(self, mean: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """``mean + exp(log_std) * eps`` with ``eps ~ N(0, I)``; the log-density of that (unclipped) sample,
        summed over the action dims: ``sum(-eps^2 / 2 - log_std - log(2 pi) / 2)``."""
        eps = rng.standard_normal(mean.shape, dtype=np.float32)
        actions = mean + np.exp(self._log_std) * eps
        logp = (-0.5 * eps * eps - self._log_std).sum(axis=1) - DTYPE.type(_HALF_LOG_2PI * mean.shape[1])
        return actions, logp.astype(DTYPE, copy=False)

    def _act_gsde(self, mean: np.ndarray, latent: np.ndarray, rng: np.random.Generator
                  ) -> tuple[np.ndarray, np.ndarray]:
        """``mean + latent @ E_i`` for row i's noise matrix ``E_i`` (see the class docstring); the log-density
        of that sample under ``N(mean, latent^2 @ std^2 + SDE_EPS)``, summed over the action dims."""
        n = mean.shape[0]
        if self._sde_noise is None or self._sde_noise.shape[0] != n or self._sde_age >= self.sde_sample_freq:
            std = np.exp(self._log_std)
            self._sde_noise = rng.standard_normal((n, *std.shape), dtype=np.float32) * std
            self._sde_age = 0
        self._sde_age += 1
        noise = np.einsum("nh,nha->na", latent, self._sde_noise)
        variance = (latent * latent) @ np.exp(2.0 * self._log_std) + DTYPE.type(SDE_EPS)
        logp = (-0.5 * noise * noise / variance - 0.5 * np.log(variance)).sum(axis=1)
        logp -= DTYPE.type(_HALF_LOG_2PI * mean.shape[1])
        return mean + noise, logp.astype(DTYPE, copy=False)
