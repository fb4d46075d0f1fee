"""The actor-critic network and its weights as safetensors bytes (never pickle)."""

from __future__ import annotations

import numpy as np
import torch
from safetensors.torch import save as st_save
from torch import nn
from torch.distributions import Categorical

from shared.fragment import FragmentSpec
from shared.rl.policy_np import WeightsError as WeightsError  # re-exported: one class for both loaders
from shared.rl.policy_np import validate_weights


def _layer(layer: nn.Linear, std: float = float(np.sqrt(2)), bias: float = 0.0) -> nn.Linear:
    # Orthogonal init as in CleanRL's PPO (https://iclr-blog-track.github.io/2022/03/25/ppo-implementation-details/)
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias)
    return layer


class ActorCritic(nn.Module):
    """Separate two-layer tanh MLPs for the policy logits and the state value."""

    def __init__(self, obs_dim: int, num_actions: int, hidden: int = 64) -> None:
        super().__init__()
        self.obs_dim = obs_dim
        self.num_actions = num_actions
        self.actor = nn.Sequential(
            _layer(nn.Linear(obs_dim, hidden)), nn.Tanh(),
            _layer(nn.Linear(hidden, hidden)), nn.Tanh(),
            _layer(nn.Linear(hidden, num_actions), std=0.01),
        )
        self.critic = nn.Sequential(
            _layer(nn.Linear(obs_dim, hidden)), nn.Tanh(),
            _layer(nn.Linear(hidden, hidden)), nn.Tanh(),
            _layer(nn.Linear(hidden, 1), std=1.0),
        )

    @classmethod
    def for_spec(cls, spec: FragmentSpec, hidden: int) -> ActorCritic:
        """A model for the envs ``spec`` describes (observations flattened)."""
        return cls(int(np.prod(spec.obs_shape)), spec.num_actions, hidden)

    def dist(self, obs: torch.Tensor) -> Categorical:
        return Categorical(logits=self.actor(obs))

    def log_probs(self, obs: torch.Tensor) -> torch.Tensor:
        """Log-probabilities of every action, [..., A] (cheaper than building a distribution)."""
        return torch.log_softmax(self.actor(obs), dim=-1)

    def logp_entropy(self, obs: torch.Tensor, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-prob of ``actions`` and the policy's entropy at ``obs``."""
        lp = self.log_probs(obs)
        logp = lp.gather(-1, actions.unsqueeze(-1)).squeeze(-1)
        entropy = -(lp.exp() * lp).sum(-1)
        return logp, entropy

    @torch.no_grad()
    def act(self, obs: torch.Tensor, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample actions; return them with their log-probs."""
        lp = self.log_probs(obs)
        actions = torch.multinomial(lp.exp(), 1, generator=generator).squeeze(-1)
        return actions, lp.gather(-1, actions.unsqueeze(-1)).squeeze(-1)

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        value: torch.Tensor = self.critic(obs).squeeze(-1)
        return value


def weights_to_bytes(model: nn.Module) -> bytes:
    """The model's parameters as a safetensors blob (CPU, contiguous)."""
    return st_save({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()})


def load_weights(model: nn.Module, data: bytes) -> None:
    """Load a safetensors blob into ``model``, refusing anything that does not fit exactly (the same
    check the samplers' numpy policy applies: :func:`shared.rl.policy_np.validate_weights`)."""
    tensors = validate_weights(data, {k: tuple(v.shape) for k, v in model.state_dict().items()})
    model.load_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()})
