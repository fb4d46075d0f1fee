"""The actor-critic networks and their weights as safetensors bytes (never pickle): the MLP, and the
convolutional actor-critics for image observations.

Convolutional actor-critics for image observations (uint8 frames, HWC or CHW, frame-stacked).

One torso shared by the policy and the value head, as CleanRL's ``ppo_atari.py`` and Stable-Baselines3's
``CnnPolicy``: ``nature_cnn`` (Mnih et al., "Human-level control through deep reinforcement learning",
Nature 2015: three convolutions and a 512-unit layer, for 84x84 Atari frames) or ``minatar_cnn`` (Young &
Tian, "MinAtar", 2019: one 3x3 convolution of 16 channels and a 128-unit layer, for 10x10 MinAtar
frames). Inputs arrive flat, shaped ``[..., K, *O]``, or with ``K == 1`` ``[..., *O]``; each forward pass
reshapes them to ``[B, K * C, H, W]`` and scales 0-255 to 0-1.
"""

from __future__ import annotations

from itertools import islice
from typing import Protocol

import numpy as np
import torch
from safetensors.torch import save as st_save
from torch import nn
from torch.distributions import Categorical, Distribution, Independent, Normal

from shared.fragment import FragmentSpec
from shared.rl.layout import CONVS, TORSOS, WIDTH, Torso, auto_torso, check_torso, image_layout
from shared.rl.policy_np import OBS_CLIP, OBS_EPS, SDE_EPS, check_activation, check_gsde, validate_weights
from shared.rl.policy_np import WeightsError as WeightsError  # re-exported: one class for both loaders


class Architecture(Protocol):
    """What a model is built from: :class:`shared.rl.arch.PolicyArch` (defined there, next to the settings it is
    read from; this module only names the fields it reads, so it does not depend on that one)."""

    @property
    def model(self) -> str: ...
    @property
    def hidden(self) -> int: ...
    @property
    def activation(self) -> str: ...
    @property
    def normalize_observations(self) -> bool: ...
    @property
    def gsde(self) -> bool: ...


_HALF_LOG_2PI = float(0.5 * np.log(2 * np.pi))


def _layer(layer: nn.Linear, std: float = float(np.sqrt(2)), bias: float = 0.0, *, ortho: bool = True) -> nn.Linear:
    """Orthogonal init as in CleanRL's PPO (https://iclr-blog-track.github.io/2022/03/25/ppo-implementation-details/),
    or with ``ortho`` False PyTorch's default init (as Stable-Baselines3's ``ortho_init=False``)."""
    if ortho:
        nn.init.orthogonal_(layer.weight, std)
        nn.init.constant_(layer.bias, bias)
    return layer


def update_moments(mean: np.ndarray, var: np.ndarray, count: float, x: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray, float]:
    """Running mean and (population) variance after the rows of ``x`` ``[B, *shape]``: the parallel
    algorithm of Chan et al. (https://en.wikipedia.org/wiki/Algorithms_for_calculating_variance#Parallel_algorithm),
    as Stable-Baselines3's ``RunningMeanStd``. Float64 throughout."""
    x = np.asarray(x, np.float64)
    n = x.shape[0]
    if n == 0:
        return mean, var, count
    batch_mean, batch_var = x.mean(axis=0), x.var(axis=0)
    delta = batch_mean - mean
    total = count + n
    m2 = var * count + batch_var * n + delta**2 * count * n / total
    return mean + delta * n / total, m2 / total, total


class ObsNormalizer(nn.Module):
    """Running observation statistics as buffers (``obs_norm.mean``, ``.var``, ``.count`` in the
    state_dict, so the published weights carry them); ``forward`` normalises and clips to +-10. The
    trainer updates them (:meth:`update`); nothing else does. Float32 like every tensor of the blob
    (count loses integer precision past 2^24 steps, which only rounds the weight of a new batch)."""

    mean: torch.Tensor
    var: torch.Tensor
    count: torch.Tensor

    def __init__(self, obs_dim: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(obs_dim))
        self.register_buffer("var", torch.ones(obs_dim))
        self.register_buffer("count", torch.full((1,), 1e-4))  # SB3's epsilon: the first batch all but replaces

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return ((obs - self.mean) / torch.sqrt(self.var + OBS_EPS)).clamp(-OBS_CLIP, OBS_CLIP)

    @torch.no_grad()
    def update(self, obs: np.ndarray) -> None:
        """Fold observations ``[B, obs_dim]`` into the statistics."""
        mean, var, count = update_moments(self.mean.double().cpu().numpy(), self.var.double().cpu().numpy(),
                                          float(self.count), obs)
        self.mean.copy_(torch.from_numpy(mean))
        self.var.copy_(torch.from_numpy(var))
        self.count.fill_(count)


class ActorCritic(nn.Module):
    """Separate two-layer MLPs (tanh, or ReLU: ``activation``) for the policy and the state value. Discrete
    actions: the actor gives the logits of a categorical. Continuous actions: it gives the mean of a diagonal
    Gaussian whose log standard deviation is one state-independent parameter per action dim (``log_std``, as CleanRL's
    ``ppo_continuous_action.py``), or with ``gsde`` a ``[hidden, action dims]`` matrix of generalized
    state-dependent exploration (Raffin et al., "Smooth Exploration for Robotic Reinforcement Learning",
    2021; Stable-Baselines3's ``use_sde`` with ``full_std``): the noise is ``latent @ E`` for the actor's
    last hidden features ``latent`` and a matrix ``E ~ N(0, exp(log_std)^2)`` the sampler draws per env and
    keeps for ``sde_sample_freq`` steps, so an action's distribution is a Gaussian with variance
    ``latent^2 @ exp(log_std)^2`` (the features detached: only ``log_std`` learns the noise scale). With
    ``normalize_observations`` both MLPs see normalised observations. ``ortho_init`` False leaves PyTorch's
    default init (rl-zoo's MuJoCo settings); it changes only the starting weights, so samplers need not know it."""

    def __init__(self, obs_dim: int, num_actions: int, hidden: int = 64, *, continuous: bool = False,
                 log_std_init: float = 0.0, normalize_observations: bool = False, gsde: bool = False,
                 activation: str = "tanh", ortho_init: bool = True) -> None:
        """``num_actions``: the actor's output width, the action count or (continuous) the action dims."""
        super().__init__()
        check_gsde(gsde, continuous)
        check_activation(activation)
        act: type[nn.Module] = nn.ReLU if activation == "relu" else nn.Tanh
        o = ortho_init
        self.obs_dim = obs_dim
        self.num_actions = num_actions
        self.continuous = continuous
        self.gsde = gsde
        self.obs_norm = ObsNormalizer(obs_dim) if normalize_observations else None
        self.actor = nn.Sequential(
            _layer(nn.Linear(obs_dim, hidden), ortho=o), act(),
            _layer(nn.Linear(hidden, hidden), ortho=o), act(),
            _layer(nn.Linear(hidden, num_actions), std=0.01, ortho=o),
        )
        self.critic = nn.Sequential(
            _layer(nn.Linear(obs_dim, hidden), ortho=o), act(),
            _layer(nn.Linear(hidden, hidden), ortho=o), act(),
            _layer(nn.Linear(hidden, 1), std=1.0, ortho=o),
        )
        std_shape = (hidden, num_actions) if gsde else (num_actions,)
        self.log_std = nn.Parameter(torch.full(std_shape, float(log_std_init))) if continuous else None

    @classmethod
    def for_spec(cls, spec: FragmentSpec, hidden: int, *, log_std_init: float = 0.0,
                 normalize_observations: bool = False, gsde: bool = False, model: str = "auto",
                 activation: str = "tanh", ortho_init: bool = True) -> ActorCritic:
        """A model for the envs ``spec`` describes: ``model`` ``mlp`` (observations and actions flattened),
        or a CNN (:class:`ImageActorCritic`: ``nature_cnn``, ``minatar_cnn``); ``auto`` picks a CNN for uint8
        image observations and the MLP otherwise. ``activation`` and ``ortho_init`` shape the MLP; a CNN
        (ReLU, orthogonal init) refuses other values than the defaults, naming the setting."""
        check_gsde(gsde, spec.continuous, spec.env_id)
        if model == "auto":
            model = "mlp" if spec.obs_dtype != "uint8" else "cnn"
        if model != "mlp":
            for name, value, default in (("activation", activation, "tanh"), ("ortho_init", ortho_init, True)):
                if value != default:
                    raise ValueError(f"trainer.{name}={value!r} shapes the MLP only; trainer.model={model!r} "
                                     "(image observations) has its own (ReLU, orthogonal init)")
            return image_model(spec, model, normalize_observations=normalize_observations)
        return cls(int(np.prod(spec.obs_shape)), spec.action_dim, hidden, continuous=spec.continuous,
                   log_std_init=log_std_init, normalize_observations=normalize_observations, gsde=gsde,
                   activation=activation, ortho_init=ortho_init)

    @classmethod
    def for_arch(cls, spec: FragmentSpec, arch: Architecture, *, log_std_init: float = 0.0,
                 ortho_init: bool = True) -> ActorCritic:
        """:meth:`for_spec` with the architecture from ``arch`` (``PolicyArch.of`` the trainer's settings),
        so the trainer, paramsync and the samplers build the same network; ``log_std_init`` and ``ortho_init``
        only initialise it (the trainer's; loaded weights replace them)."""
        return cls.for_spec(spec, arch.hidden, log_std_init=log_std_init,
                            normalize_observations=arch.normalize_observations, gsde=arch.gsde, model=arch.model,
                            activation=arch.activation, ortho_init=ortho_init)

    def actor_parameters(self) -> list[nn.Parameter]:
        """The policy's parameters (``log_std`` included)."""
        return [*self.actor.parameters(), *([self.log_std] if self.log_std is not None else [])]

    def critic_parameters(self) -> list[nn.Parameter]:
        return list(self.critic.parameters())

    def _features(self, obs: torch.Tensor) -> torch.Tensor:
        return self.obs_norm(obs) if self.obs_norm is not None else obs

    def _gaussian(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Continuous actions: the Gaussian's mean and log standard deviation ``[..., A]`` at ``obs``, and
        the actor's last hidden features ``[..., hidden]`` (detached; gSDE's noise is drawn on them)."""
        assert self.log_std is not None
        latent = self._features(obs)
        for layer in islice(self.actor, 4):  # the last hidden features (no new Sequential per call)
            latent = layer(latent)
        mean = self.actor[4](latent)
        latent = latent.detach()
        if not self.gsde:
            return mean, self.log_std.expand_as(mean), latent
        variance = latent.pow(2) @ torch.exp(2 * self.log_std)
        return mean, 0.5 * torch.log(variance + SDE_EPS), latent

    def dist(self, obs: torch.Tensor) -> Distribution:
        if self.log_std is None:
            return Categorical(logits=self.actor(self._features(obs)))
        mean, log_std, _ = self._gaussian(obs)
        return Independent(Normal(mean, log_std.exp()), 1)

    def log_probs(self, obs: torch.Tensor) -> torch.Tensor:
        """Discrete: log-probabilities of every action, [..., A] (cheaper than building a distribution)."""
        return torch.log_softmax(self.actor(self._features(obs)), dim=-1)

    def logp_entropy(self, obs: torch.Tensor, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-prob (continuous: log-density, summed over the action dims) of ``actions`` and the policy's
        entropy at ``obs``. Continuous ``actions`` are ``[..., A]`` floats, discrete ``[...]`` integers."""
        if self.log_std is None:
            lp = self.log_probs(obs)
            logp = lp.gather(-1, actions.unsqueeze(-1)).squeeze(-1)
            entropy = -(lp.exp() * lp).sum(-1)
            return logp, entropy
        mean, log_std, _ = self._gaussian(obs)
        z = (actions - mean) * torch.exp(-log_std)
        logp = (-0.5 * z.pow(2) - log_std).sum(-1) - _HALF_LOG_2PI * self.num_actions
        entropy = (0.5 + _HALF_LOG_2PI + log_std).sum(-1)
        return logp, entropy

    @torch.no_grad()
    def act(self, obs: torch.Tensor, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample actions (continuous: unclipped); return them with their log-probs. gSDE: a fresh noise
        matrix per row (the samplers' :class:`~shared.rl.policy_np.NumpyPolicy` keeps one per env)."""
        if self.log_std is None:
            lp = self.log_probs(obs)
            actions = torch.multinomial(lp.exp(), 1, generator=generator).squeeze(-1)
            return actions, lp.gather(-1, actions.unsqueeze(-1)).squeeze(-1)
        mean, log_std, latent = self._gaussian(obs)
        if self.gsde:
            matrices = torch.randn((*latent.shape, self.num_actions), generator=generator, device=mean.device)
            noise = (latent.unsqueeze(-2) @ (matrices * self.log_std.exp())).squeeze(-2)
        else:
            noise = torch.randn(mean.shape, generator=generator, device=mean.device) * log_std.exp()
        actions = mean + noise
        return actions, self.logp_entropy(obs, actions)[0]

    def prepare(self, obs: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A batch ``[B, ...]`` of observations as :meth:`evaluate` and :meth:`value` take them with ``prepared``
        True, rows in the batch's order (an update prepares its batch once, then passes rows of it, instead of
        converting every minibatch again): float32 here, the MLP normalises them in each pass. ``dtype``, the
        autocast dtype the passes run under, concerns image models only (:class:`ImageActorCritic`)."""
        return obs.to(torch.float32)

    def value(self, obs: torch.Tensor, prepared: bool = False) -> torch.Tensor:
        value: torch.Tensor = self.critic(self._features(obs)).squeeze(-1)
        return value

    def evaluate(self, obs: torch.Tensor, actions: torch.Tensor, prepared: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(logp, entropy, value)`` at ``obs``: what an update step needs, as :meth:`logp_entropy` and
        :meth:`value` give them. Separate actor and critic networks here; a shared torso computes its features
        once for both heads (:class:`ImageActorCritic`). ``prepared``: ``obs`` are rows of :meth:`prepare`'s
        output (the same numbers either way)."""
        logp, entropy = self.logp_entropy(obs, actions)
        return logp, entropy, self.value(obs)


def _conv(layer: nn.Conv2d) -> nn.Conv2d:
    nn.init.orthogonal_(layer.weight, float(np.sqrt(2)))
    assert layer.bias is not None
    nn.init.constant_(layer.bias, 0.0)
    return layer


def make_torso(kind: Torso, channels: int, h: int, w: int) -> tuple[nn.Sequential, int]:
    """The torso and its output width (its layers: :data:`shared.rl.layout.CONVS` and ``WIDTH``)."""
    layers: list[nn.Module] = []
    c = channels
    for out, k, s in CONVS[check_torso(kind)]:
        layers += [_conv(nn.Conv2d(c, out, k, s)), nn.ReLU()]
        c = out
    convs = nn.Sequential(*layers, nn.Flatten())
    width = WIDTH[kind]
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

    def prepare(self, obs: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The torso's input ``[B, K * C, H, W]`` for flat observations ``[B, ...]`` (as :meth:`_features` makes it
        in each pass: frames / 255 in float32, NHWC in memory where ``channels_last_input``), converted once. An
        update passes rows of it to :meth:`evaluate` with ``prepared`` True in every minibatch, where converting
        each minibatch's frames again (the cast, the division, the NHWC copy and autocast's bf16 cast) took about a
        fifth of a float32 Pong update's CPU time and a quarter of a bf16 one's (torch.profiler, 2 threads). The
        frames are laid out first (in their own dtype: a quarter of float32's bytes for uint8), then cast and divided
        in place: the same float32 numbers as ``obs.float() / 255.0``, in fewer passes over
        memory. ``dtype`` (bfloat16: the passes run under that autocast) casts it once more, as autocast would
        cast it at the first convolution in every pass."""
        x = obs.reshape(-1, self.frame_stack, *self.frame_shape)
        if len(self.frame_shape) == 2:
            x = x.unsqueeze(2)
        elif self.channels_last:
            x = x.permute(0, 1, 4, 2, 3)
        x = x.flatten(1, 2)
        # The memory layout _features gives its float32 tensor (the convolutions' kernels, and so their rounding,
        # follow the layout): NHWC where channels_last_input, else the strides of the view above (a MinAtar frame,
        # HWC, stays NHWC in memory: its permute and flatten need no copy).
        out = torch.empty_like(x, dtype=torch.float32, memory_format=(
            torch.channels_last if self.channels_last_input else torch.preserve_format))
        out.copy_(x).div_(255.0)
        return out if dtype is None or dtype == torch.float32 else out.to(dtype)

    def value(self, obs: torch.Tensor, prepared: bool = False) -> torch.Tensor:
        features = self.torso(obs) if prepared else self._features(obs)
        value: torch.Tensor = self.critic(features).squeeze(-1)
        return value

    def evaluate(self, obs: torch.Tensor, actions: torch.Tensor, prepared: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(logp, entropy, value)`` from one pass of the torso shared by both heads (``logp_entropy`` and
        ``value`` would each run it: twice the convolutions forward and backward in every minibatch).
        ``prepared``: ``obs`` are rows ``[B, K * C, H, W]`` of :meth:`prepare`'s output."""
        features: torch.Tensor = self.torso(obs) if prepared else self._features(obs)
        lp = torch.log_softmax(self.actor(features), dim=-1)
        logp = lp.gather(-1, actions.unsqueeze(-1)).squeeze(-1)
        entropy = -(lp.exp() * lp).sum(-1)
        value: torch.Tensor = self.critic(features).squeeze(-1)
        return logp, entropy, value


def image_model(spec: FragmentSpec, model: str, *, normalize_observations: bool = False) -> ActorCritic:
    """The CNN actor-critic for ``spec``'s image observations (``model``: a torso name, or ``cnn`` for
    :func:`auto_torso`'s pick); refuses what it cannot serve, naming the setting."""
    if spec.continuous:
        raise ValueError(f"trainer.model={model!r}: CNN models support discrete actions only")
    if normalize_observations:
        raise ValueError(f"trainer.model={model!r}: image frames are scaled to 0-1, turn off "
                         "trainer.normalize_observations")
    torso = auto_torso(spec.obs_shape) if model == "cnn" else model
    if torso not in TORSOS:
        raise ValueError(f"trainer.model={model!r}: want auto, mlp or one of {TORSOS}")
    return ImageActorCritic(spec.obs_shape, spec.num_actions, torso, spec.frame_stack)


def weights_to_bytes(model: nn.Module) -> bytes:
    """The model's parameters and buffers (observation statistics) as a safetensors blob (CPU, contiguous)."""
    return st_save({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()})


def load_weights(model: nn.Module, data: bytes) -> None:
    """Load a safetensors blob into ``model``, refusing anything that does not fit exactly (the same
    check the samplers' numpy policy applies: :func:`shared.rl.policy_np.validate_weights`)."""
    tensors = validate_weights(data, {k: tuple(v.shape) for k, v in model.state_dict().items()})
    model.load_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()})
