"""The sampler's numpy actor: same numbers as the torch model, correct sampling, strict loading."""

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load as np_load
from safetensors.numpy import save as np_save

from services.sampler.rollout import RolloutWorker
from shared.rl.arch import PolicyArch
from shared.rl.model import ActorCritic, load_weights, weights_to_bytes
from shared.rl.policy_np import NumpyPolicy, WeightsError, expected_shapes

ROOT = Path(__file__).resolve().parents[2]


def _model(seed: int = 0, obs_dim: int = 4, num_actions: int = 2, hidden: int = 64) -> ActorCritic:
    torch.manual_seed(seed)
    model = ActorCritic(obs_dim, num_actions, hidden)
    # Orthogonal init with std 0.01 makes the last layer nearly uniform: spread the logits so the
    # comparison and the sampling test see skewed distributions.
    with torch.no_grad():
        model.actor[4].weight.mul_(150.0)
        model.actor[4].bias.uniform_(-1.0, 1.0)
    return model


def _policy(model: ActorCritic) -> NumpyPolicy:
    policy = NumpyPolicy(model.obs_dim, model.num_actions, model.actor[0].out_features)
    policy.load(weights_to_bytes(model))
    return policy


def test_expected_shapes_are_those_of_the_torch_model() -> None:
    for obs_dim, actions, hidden in [(4, 2, 64), (8, 5, 16)]:
        own = ActorCritic(obs_dim, actions, hidden).state_dict()
        assert expected_shapes(obs_dim, actions, hidden) == {k: tuple(v.shape) for k, v in own.items()}


@pytest.mark.parametrize(("obs_dim", "num_actions", "hidden"), [(4, 2, 64), (8, 6, 32)])
def test_log_probs_equal_torch(obs_dim: int, num_actions: int, hidden: int) -> None:
    model = _model(1, obs_dim, num_actions, hidden)
    policy = _policy(model)
    obs = np.random.default_rng(0).normal(0, 2, (256, obs_dim)).astype(np.float32)
    with torch.no_grad():
        want = torch.log_softmax(model.actor(torch.from_numpy(obs)), dim=-1).numpy()
    got = policy.log_probs(obs)
    assert got.dtype == np.float32 and got.shape == (256, num_actions)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    # Batched [T, N, obs] like the trainer's input gives the same numbers.
    np.testing.assert_allclose(policy.log_probs(obs.reshape(16, 16, obs_dim)).reshape(256, -1), got, atol=1e-6)
    actions, logp = policy.act(obs, np.random.default_rng(0))
    assert actions.dtype == np.int64 and logp.dtype == np.float32 and actions.shape == logp.shape == (256,)
    np.testing.assert_allclose(logp, want[np.arange(256), actions], atol=1e-5, rtol=0)


def test_log_softmax_is_stable_for_large_logits() -> None:
    model = _model(2)
    with torch.no_grad():
        model.actor[4].bias.copy_(torch.tensor([1000.0, -1000.0]))
    lp = _policy(model).log_probs(np.zeros((3, 4), np.float32))
    assert np.isfinite(lp).all()
    np.testing.assert_allclose(lp[:, 0], 0.0, atol=1e-6)
    actions, logp = _policy(model).act(np.zeros((500, 4), np.float32), np.random.default_rng(1))
    assert (actions == 0).all() and np.isfinite(logp).all()


def test_sampled_frequencies_match_the_probabilities() -> None:
    model = _model(3, num_actions=5)
    policy = _policy(model)
    obs = np.random.default_rng(3).normal(0, 1, (1, 4)).astype(np.float32)
    p = np.exp(policy.log_probs(obs)[0].astype(np.float64))
    assert p.min() > 0.01 and p.max() < 0.9, p  # a skewed distribution, every action reachable
    n_rows, reps = 1000, 100
    rng = np.random.default_rng(4)
    counts = np.zeros(5)
    for _ in range(reps):
        actions, _ = policy.act(np.repeat(obs, n_rows, axis=0), rng)
        counts += np.bincount(actions, minlength=5)
    n = n_rows * reps
    chi2 = float((((counts - n * p) ** 2) / (n * p)).sum())
    # 4 degrees of freedom: P(chi2 > 30) ~ 5e-6. A wrong sampler (e.g. off by one) is far beyond.
    assert chi2 < 30, (chi2, counts / n, p)


def test_zero_probability_actions_are_never_sampled() -> None:
    model = _model(4, num_actions=4)
    with torch.no_grad():
        model.actor[4].weight.zero_()
        model.actor[4].bias.copy_(torch.tensor([-200.0, 0.0, -200.0, 0.0]))  # exp(-200) is 0 in float32
    actions, _ = _policy(model).act(np.zeros((20_000, 4), np.float32), np.random.default_rng(5))
    counts = np.bincount(actions, minlength=4)
    assert counts[0] == counts[2] == 0 and min(counts[1], counts[3]) > 9_000


def test_same_seed_same_actions() -> None:
    policy = _policy(_model(5))
    obs = np.random.default_rng(6).normal(0, 1, (64, 4)).astype(np.float32)
    a1, l1 = policy.act(obs, np.random.default_rng(42))
    a2, l2 = policy.act(obs, np.random.default_rng(42))
    a3, _ = policy.act(obs, np.random.default_rng(43))
    np.testing.assert_array_equal(a1, a2)
    np.testing.assert_array_equal(l1, l2)
    assert not np.array_equal(a1, a3)


def test_rollout_is_reproducible_from_its_seed() -> None:
    blob = weights_to_bytes(_model(6))

    def fragment(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        w = RolloutWorker("CartPole-v1", num_envs=3, fragment_steps=40, sampler_id="s", arch=PolicyArch(hidden=64),
                          seed=seed)
        w.set_policy(0, blob)
        frag = w.collect()
        w.close()
        return frag.obs, frag.actions, frag.logp

    a, b, c = fragment(7), fragment(7), fragment(8)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a[1], c[1])


def _blob(model: ActorCritic, **changes: np.ndarray | None) -> bytes:
    tensors = dict(np_load(weights_to_bytes(model)))
    for k, v in changes.items():
        if v is None:
            del tensors[k.replace("__", ".")]
        else:
            tensors[k.replace("__", ".")] = v
    return np_save(tensors)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda m: _blob(m, critic__4__bias=None), r"keys differ: missing \['critic.4.bias'\]"),
        (lambda m: _blob(m, actor__9__bias=np.zeros(2, np.float32)), r"extra \['actor.9.bias'\]"),
        (lambda m: _blob(m, actor__2__weight=np.zeros((64, 32), np.float32)), r"actor.2.weight: shape \(64, 32\)"),
        (lambda m: _blob(m, actor__4__bias=np.zeros(2, np.float64)), r"actor.4.bias: shape \(2,\) float64"),
        (lambda m: _blob(m, actor__0__bias=np.full(64, np.nan, np.float32)), r"actor.0.bias holds NaN or infinite"),
        (lambda m: _blob(m, critic__0__bias=np.full(64, np.inf, np.float32)), r"critic.0.bias holds NaN or infinite"),
        (lambda m: b"\x00garbage, not safetensors", r"not a safetensors blob"),
        (lambda m: b"", r"not a safetensors blob"),
    ],
)
def test_bad_blobs_are_refused_like_the_torch_loader(make: Callable[[ActorCritic], bytes], match: str) -> None:
    model = _model(7)
    blob = make(model)
    policy = _policy(model)
    before = policy.log_probs(np.ones((2, 4), np.float32))
    with pytest.raises(WeightsError, match=match):
        policy.load(blob)
    np.testing.assert_array_equal(policy.log_probs(np.ones((2, 4), np.float32)), before)  # kept its weights
    # The torch loader refuses the same blobs (its WeightsError may still be its own class).
    with pytest.raises(ValueError):
        load_weights(ActorCritic(4, 2, 64), blob)


def test_act_before_load_is_an_error() -> None:
    policy = NumpyPolicy(4, 2)
    assert not policy.loaded
    with pytest.raises(RuntimeError, match="no weights"):
        policy.act(np.zeros((1, 4), np.float32), np.random.default_rng(0))


def test_sampler_process_never_imports_torch() -> None:
    """Import the sampler's entrypoint and service, load a blob, collect a fragment: no torch."""
    code = """
import sys
import numpy as np
from safetensors.numpy import save
import services.sampler.__main__, services.sampler.service
from services.sampler.rollout import RolloutWorker
from shared.rl.arch import PolicyArch
from shared.rl.policy_np import expected_shapes
rng = np.random.default_rng(0)
blob = save({k: rng.normal(0, 0.3, s).astype(np.float32) for k, s in expected_shapes(4, 2, 64).items()})
w = RolloutWorker("CartPole-v1", num_envs=2, fragment_steps=8, sampler_id="s", arch=PolicyArch(hidden=64), seed=0)
w.set_policy(0, blob)
assert w.collect().actions.shape == (8, 2)
torch = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
assert not torch, torch[:5]
"""
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]


def test_non_finite_observations_fail_loudly_instead_of_sampling_garbage() -> None:
    policy = _policy(_model())
    obs = np.zeros((3, 4), np.float32)
    obs[1, 2] = np.nan
    with pytest.raises(ValueError, match="not finite"):
        policy.act(obs, np.random.default_rng(0))


# ---- continuous actions and observation normalisation ----
def _gaussian(seed: int, obs_dim: int = 3, action_dim: int = 2, normalize: bool = False) -> ActorCritic:
    torch.manual_seed(seed)
    model = ActorCritic(obs_dim, action_dim, 32, continuous=True, log_std_init=-0.5,
                        normalize_observations=normalize)
    with torch.no_grad():  # a state-dependent mean of order 1 and per-dim standard deviations
        model.actor[4].weight.mul_(100.0)
        model.log_std.copy_(torch.linspace(-2.0, -0.5, action_dim))
        if model.obs_norm is not None:
            model.obs_norm.update(np.random.default_rng(seed).normal(2.0, 3.0, (500, obs_dim)))
    return model


def _np_policy(model: ActorCritic) -> NumpyPolicy:
    policy = NumpyPolicy(model.obs_dim, model.num_actions, model.actor[0].out_features, continuous=model.continuous,
                         normalize_observations=model.obs_norm is not None)
    policy.load(weights_to_bytes(model))
    return policy


@pytest.mark.parametrize(("continuous", "normalize"), [(True, False), (True, True), (False, True)])
def test_expected_shapes_with_log_std_and_obs_norm(continuous: bool, normalize: bool) -> None:
    own = ActorCritic(5, 3, 16, continuous=continuous, normalize_observations=normalize).state_dict()
    got = expected_shapes(5, 3, 16, continuous=continuous, normalize_observations=normalize)
    assert got == {k: tuple(v.shape) for k, v in own.items()}
    assert ("log_std" in got) == continuous and ("obs_norm.mean" in got) == normalize


@pytest.mark.parametrize("normalize", [False, True])
def test_gaussian_log_probs_equal_torch(normalize: bool) -> None:
    model = _gaussian(11, normalize=normalize)
    policy = _np_policy(model)
    obs = np.random.default_rng(0).normal(2, 4, (256, 3)).astype(np.float32)
    actions, logp = policy.act(obs, np.random.default_rng(1))
    assert actions.dtype == np.float32 and actions.shape == (256, 2) and logp.dtype == np.float32
    assert logp.shape == (256,) and (logp > 0).any()  # narrow dims: densities above 1
    with torch.no_grad():
        want, entropy = model.logp_entropy(torch.from_numpy(obs), torch.from_numpy(actions))
        dist = model.dist(torch.from_numpy(obs))
        dist_logp, dist_entropy = dist.log_prob(torch.from_numpy(actions)), dist.entropy()
        mean = model.actor(model._features(torch.from_numpy(obs)))
    np.testing.assert_allclose(logp, want.numpy(), atol=1e-5, rtol=0)
    np.testing.assert_allclose(dist_logp.numpy(), want.numpy(), atol=1e-5, rtol=0)
    np.testing.assert_allclose(entropy.numpy(), dist_entropy.numpy(), atol=1e-5)
    np.testing.assert_allclose(policy.logits(obs), mean.numpy(), atol=1e-5)


def test_gaussian_samples_have_the_policy_mean_and_std() -> None:
    model = _gaussian(12)
    policy = _np_policy(model)
    obs = np.random.default_rng(2).normal(0, 1, (1, 3)).astype(np.float32)
    n = 200_000
    actions, _ = policy.act(np.repeat(obs, n, axis=0), np.random.default_rng(3))
    mean = policy.logits(obs)[0]
    std = np.exp(model.log_std.detach().numpy())
    assert np.abs(mean).max() > 0.1  # not a trivial zero mean
    # Standard errors: std / sqrt(n) for the mean, about std / sqrt(2n) for the std; 5 of them is ~1e-6 odds.
    np.testing.assert_array_less(np.abs(actions.mean(axis=0) - mean), 5 * std / np.sqrt(n))
    np.testing.assert_array_less(np.abs(actions.std(axis=0) - std), 5 * std / np.sqrt(2 * n))
    assert abs(float(np.corrcoef(actions.T)[0, 1])) < 0.02  # independent dims


def test_observation_normalisation_is_applied_like_torch_for_discrete_policies() -> None:
    torch.manual_seed(13)
    model = ActorCritic(4, 3, 16, normalize_observations=True)
    assert model.obs_norm is not None
    model.obs_norm.update(np.random.default_rng(0).normal(5.0, 0.1, (1000, 4)))  # far from the unit scale
    with torch.no_grad():
        model.actor[4].weight.mul_(100.0)
    obs = np.random.default_rng(1).normal(5.0, 0.5, (64, 4)).astype(np.float32)  # some clip at +-10
    got = _np_policy(model).log_probs(obs)
    with torch.no_grad():
        want = model.log_probs(torch.from_numpy(obs)).numpy()
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    # The statistics are what they should be, and they are in the blob under their own keys.
    np.testing.assert_allclose(model.obs_norm.mean.numpy(), 5.0, atol=0.02)
    np.testing.assert_allclose(model.obs_norm.var.numpy(), 0.01, rtol=0.2)
    assert float(model.obs_norm.count) == pytest.approx(1000, abs=0.01)
    assert {"obs_norm.mean", "obs_norm.var", "obs_norm.count"} <= set(np_load(weights_to_bytes(model)))


def test_blob_keys_follow_the_model_configuration() -> None:
    """A policy that normalises refuses a blob without statistics and vice versa; negative variances are refused."""
    plain, normed = ActorCritic(4, 2, 16), ActorCritic(4, 2, 16, normalize_observations=True)
    with pytest.raises(WeightsError, match=r"missing \['obs_norm.count', 'obs_norm.mean', 'obs_norm.var'\]"):
        NumpyPolicy(4, 2, 16, normalize_observations=True).load(weights_to_bytes(plain))
    with pytest.raises(WeightsError, match="extra"):
        NumpyPolicy(4, 2, 16).load(weights_to_bytes(normed))
    with pytest.raises(WeightsError, match="missing \\['log_std'\\]"):
        NumpyPolicy(4, 2, 16, continuous=True).load(weights_to_bytes(plain))
    bad = _blob(normed, obs_norm__var=np.full(4, -1.0, np.float32))
    with pytest.raises(WeightsError, match="negative variances"):
        NumpyPolicy(4, 2, 16, normalize_observations=True).load(bad)
    with pytest.raises(WeightsError, match="negative variances"):
        load_weights(ActorCritic(4, 2, 16, normalize_observations=True), bad)


# ---- gSDE: state-dependent exploration noise ----
def _gsde(seed: int, normalize: bool = False, freq: int = 4) -> tuple[ActorCritic, NumpyPolicy]:
    torch.manual_seed(seed)
    model = ActorCritic(3, 2, 32, continuous=True, gsde=True, normalize_observations=normalize)
    with torch.no_grad():  # per-feature, per-dim noise scales
        model.log_std.copy_(torch.linspace(-2.0, 0.0, 64).reshape(32, 2))
        if model.obs_norm is not None:
            model.obs_norm.update(np.random.default_rng(seed).normal(2.0, 3.0, (500, 3)))
    policy = NumpyPolicy(3, 2, 32, continuous=True, gsde=True, sde_sample_freq=freq, normalize_observations=normalize)
    policy.load(weights_to_bytes(model))
    return model, policy


def test_gsde_log_std_is_a_matrix_in_both_loaders() -> None:
    own = ActorCritic(5, 3, 16, continuous=True, gsde=True).state_dict()
    got = expected_shapes(5, 3, 16, continuous=True, gsde=True)
    assert got == {k: tuple(v.shape) for k, v in own.items()} and got["log_std"] == (16, 3)
    with pytest.raises(WeightsError, match=r"log_std: shape \(3,\)"):  # a plain Gaussian's blob does not fit
        NumpyPolicy(5, 3, 16, continuous=True, gsde=True).load(weights_to_bytes(ActorCritic(5, 3, 16, continuous=True)))
    with pytest.raises(ValueError, match="needs continuous actions"):
        ActorCritic(4, 2, 16, gsde=True)
    with pytest.raises(ValueError, match="needs continuous actions"):
        NumpyPolicy(4, 2, 16, gsde=True)


@pytest.mark.parametrize("normalize", [False, True])
def test_gsde_log_probs_equal_torch(normalize: bool) -> None:
    model, policy = _gsde(21, normalize)
    obs = np.random.default_rng(0).normal(2, 4, (256, 3)).astype(np.float32)
    actions, logp = policy.act(obs, np.random.default_rng(1))
    assert actions.shape == (256, 2) and actions.dtype == np.float32 and logp.dtype == np.float32
    with torch.no_grad():
        want, entropy = model.logp_entropy(torch.from_numpy(obs), torch.from_numpy(actions))
        dist = model.dist(torch.from_numpy(obs))
    np.testing.assert_allclose(logp, want.numpy(), atol=1e-4, rtol=0)
    np.testing.assert_allclose(dist.log_prob(torch.from_numpy(actions)).numpy(), want.numpy(), atol=1e-4, rtol=0)
    np.testing.assert_allclose(entropy.numpy(), dist.entropy().numpy(), atol=1e-5)
    assert entropy.std() > 0  # the spread depends on the state


def test_gsde_noise_is_kept_for_sde_sample_freq_steps_and_redrawn_for_a_new_policy() -> None:
    model, policy = _gsde(22, freq=3)
    rng = np.random.default_rng(4)
    obs = np.random.default_rng(5).normal(0, 1, (6, 3)).astype(np.float32)
    first = [policy.act(obs, rng)[0] for _ in range(4)]
    np.testing.assert_array_equal(first[1], first[0])  # one noise matrix per env for 3 steps ...
    np.testing.assert_array_equal(first[2], first[0])
    assert not np.isclose(first[3], first[0]).any()  # ... then every env's is redrawn
    assert len({tuple(row) for row in first[0]}) == 6  # and the envs' matrices differ
    policy.load(weights_to_bytes(model))  # a new version: its first step draws
    assert not np.isclose(policy.act(obs, rng)[0], first[3]).any()
    # The noise is the features times the matrix: a state change moves it smoothly, not independently.
    a0, _ = policy.act(obs, rng)
    a1, _ = policy.act(obs + 1e-3, rng)
    mean0, mean1 = policy.logits(obs), policy.logits(obs + 1e-3)
    np.testing.assert_allclose(a1 - mean1, a0 - mean0, atol=1e-2)


def test_gsde_samples_have_the_state_dependent_mean_and_std() -> None:
    model, policy = _gsde(23)
    obs = np.random.default_rng(2).normal(0, 1, (1, 3)).astype(np.float32)
    n = 100_000  # one row per env, each with its own matrix: independent draws of one state's Gaussian
    actions, _ = policy.act(np.repeat(obs, n, axis=0), np.random.default_rng(3))
    with torch.no_grad():
        dist = model.dist(torch.from_numpy(obs))
    mean, std = dist.mean.numpy()[0], dist.stddev.numpy()[0]
    assert std.min() > 0.05 and np.abs(std[0] - std[1]) > 0.01  # a real, per-dim spread
    np.testing.assert_array_less(np.abs(actions.mean(axis=0) - mean), 5 * std / np.sqrt(n))
    np.testing.assert_array_less(np.abs(actions.std(axis=0) - std), 5 * std / np.sqrt(2 * n))


# ---- trainer.activation / trainer.ortho_init (rl-zoo's MuJoCo network) ----
@pytest.mark.parametrize("continuous", [False, True])
def test_a_relu_mlp_acts_as_the_torch_model_and_differs_from_tanh(continuous: bool) -> None:
    torch.manual_seed(0)
    model = ActorCritic(5, 3, 32, continuous=continuous, activation="relu")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    assert isinstance(model.actor[1], torch.nn.ReLU) and isinstance(model.critic[3], torch.nn.ReLU)
    blob = weights_to_bytes(model)
    relu, tanh = (NumpyPolicy(5, 3, 32, continuous=continuous, activation=a) for a in ("relu", "tanh"))
    relu.load(blob)
    tanh.load(blob)
    obs = np.random.default_rng(0).normal(0, 2, (64, 5)).astype(np.float32)
    with torch.no_grad():
        want = model.actor(torch.from_numpy(obs)).numpy()
    np.testing.assert_allclose(relu.logits(obs), want, atol=1e-5, rtol=0)
    assert np.abs(tanh.logits(obs) - want).max() > 0.1  # the blob alone cannot tell: the settings must
    if continuous:  # the log-density the sampler reports is the trainer's
        actions, logp = relu.act(obs, np.random.default_rng(1))
        with torch.no_grad():
            want_logp = model.logp_entropy(torch.from_numpy(obs), torch.from_numpy(actions))[0].numpy()
        np.testing.assert_allclose(logp, want_logp, atol=1e-4, rtol=0)


def test_ortho_init_off_leaves_pytorchs_default_init() -> None:
    torch.manual_seed(0)
    ortho = ActorCritic(17, 6, 256, continuous=True)
    torch.manual_seed(0)
    plain = ActorCritic(17, 6, 256, continuous=True, ortho_init=False)
    # Orthogonal init: zero biases and a 0.01-gain policy head; PyTorch's default: uniform(+-1/sqrt(fan_in)).
    assert float(ortho.actor[0].bias.detach().abs().max()) == 0.0 < float(plain.actor[0].bias.detach().abs().max())
    assert float(ortho.actor[4].weight.abs().max()) < 0.05 < float(plain.actor[4].weight.abs().max())
    bound = 1 / np.sqrt(256)
    assert float(plain.critic[2].weight.abs().max()) <= bound and float(plain.critic[2].weight.std()) > bound / 3
    w = ortho.actor[2].weight.detach()
    torch.testing.assert_close(w @ w.T, 2.0 * torch.eye(256), atol=1e-4, rtol=0)  # sqrt(2)-gain orthogonal


def test_an_unknown_activation_or_one_asked_of_a_cnn_is_refused_by_name() -> None:
    from shared.fragment import FragmentSpec

    with pytest.raises(ValueError, match="trainer.activation='gelu'"):
        NumpyPolicy(4, 2, 16, activation="gelu")
    with pytest.raises(ValueError, match="trainer.activation='gelu'"):
        ActorCritic(4, 2, 16, activation="gelu")
    frames = FragmentSpec(obs_shape=(10, 10, 4), num_actions=3, obs_dtype="uint8")
    with pytest.raises(ValueError, match="trainer.activation='relu' shapes the MLP only"):
        ActorCritic.for_spec(frames, 64, activation="relu")
    with pytest.raises(ValueError, match="trainer.ortho_init=False shapes the MLP only"):
        ActorCritic.for_spec(frames, 64, model="minatar_cnn", ortho_init=False)
