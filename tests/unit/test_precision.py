"""``trainer.precision`` and the GPU learner's batch transfer (pure code, no Kafka).

What a CPU can check: bf16 autocast runs the update's forward passes and keeps the loss math, the weights and
the optimizer state float32; its results are close to float32's; ``auto`` on the CPU is float32 exactly; the
pinned-memory transfer does nothing on the CPU. The CUDA test at the end runs only where a GPU is present.

Tolerances: bfloat16 keeps 8 significant bits (relative rounding 2^-9, about 0.2%). Autocast rounds the inputs
and weights of each matmul or convolution to it (accumulating in float32), so each layer's output is off by a
few tenths of a percent and three or four layers compound to about 1%; the losses are compared at 5% and the
gradient's direction (cosine) at 0.99, which a wrong cast (e.g. the log-ratio in bf16, whose KL would then be
rounding noise, or a head left in bf16) breaks.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from services.trainer.learner import Learner, uses_bf16
from services.trainer.update import UpdateConfig, UpdateStats, _forward_precision, _t, to_device
from shared.fragment import Fragment, FragmentSpec
from shared.rl.model import ActorCritic
from shared.settings import TrainerSettings

CPU = torch.device("cpu")
MLP_SPEC = FragmentSpec(obs_shape=(6,), num_actions=3, max_bytes=1 << 22, env_id="Synthetic-v0")
IMAGE_SPEC = FragmentSpec(obs_shape=(10, 10, 4), num_actions=3, max_bytes=1 << 22, env_id="MinAtar/Breakout-v1",
                          obs_dtype="uint8")


def fragment(spec: FragmentSpec, steps: int = 32, envs: int = 4, seed: int = 0) -> Fragment:
    """Random observations, actions, behaviour log-probs and rewards, one episode end per env."""
    rng = np.random.default_rng(seed)
    shape = (steps, envs, *spec.obs_shape)
    if spec.obs_dtype == "uint8":
        obs = rng.integers(0, 2, shape, dtype=np.uint8) * np.uint8(255)
        last = rng.integers(0, 2, (envs, *spec.obs_shape), dtype=np.uint8) * np.uint8(255)
    else:
        obs = rng.normal(size=shape).astype(np.float32)
        last = rng.normal(size=(envs, *spec.obs_shape)).astype(np.float32)
    term = np.zeros((steps, envs), np.uint8)
    term[rng.integers(0, steps, envs), np.arange(envs)] = 1
    return Fragment(obs=obs, actions=rng.integers(0, spec.num_actions, (steps, envs)),
                    logp=np.log(rng.uniform(0.2, 0.5, (steps, envs))).astype(np.float32),
                    rewards=rng.normal(size=(steps, envs)).astype(np.float32), terminated=term,
                    truncated=np.zeros((steps, envs), np.uint8), trunc_obs=np.zeros((0, *spec.obs_shape), obs.dtype),
                    last_obs=last, episode_returns=np.zeros(envs, np.float32),
                    episode_lengths=np.full(envs, steps, np.int32), policy_version=0, sampler_id="s1",
                    env_id=str(spec.env_id))


def _update(spec: FragmentSpec, precision: str, optimizer: str = "adam", epochs: int = 2, minibatches: int = 2,
            seed: int = 3, device: str = "cpu") -> tuple[Learner, UpdateStats]:
    cfg = TrainerSettings(model="auto", precision=precision, epochs=epochs, minibatches=minibatches, seed=seed,
                          ent_coef=0.01, device=device)
    learner = Learner(spec, cfg)
    if optimizer == "sgd":
        learner.optimizer = torch.optim.SGD(learner.model.parameters(), lr=0.01)  # type: ignore[assignment]
    stats = learner.update([fragment(spec, seed=seed), fragment(spec, seed=seed + 1)])
    return learner, stats


def _params(model: ActorCritic) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


# ---- the setting ----------------------------------------------------------------------------------------------
def test_precision_resolves_and_bad_values_are_refused() -> None:
    assert uses_bf16("bf16", CPU) and not uses_bf16("fp32", CPU)
    assert not uses_bf16("auto", CPU)  # CPU: float32
    with pytest.raises(ValueError, match="trainer.precision='fp16'"):
        uses_bf16("fp16", CPU)
    with pytest.raises(ValueError, match="precision"):
        TrainerSettings(precision="fp16")
    assert TrainerSettings().precision == "auto"
    assert Learner(MLP_SPEC, TrainerSettings()).update_cfg.bf16 is False
    assert Learner(MLP_SPEC, TrainerSettings(precision="bf16")).update_cfg.bf16 is True


def test_auto_on_cpu_is_float32_bit_for_bit() -> None:
    """``auto`` and ``fp32`` take the very same path on the CPU: identical weights, identical stats (the
    unit tests of the update, which predate the setting, pin the path itself)."""
    a, stats_a = _update(MLP_SPEC, "auto")
    b, stats_b = _update(MLP_SPEC, "fp32")
    assert torch.equal(_params(a.model), _params(b.model)) and stats_a == stats_b
    c, _ = _update(MLP_SPEC, "bf16")
    assert not torch.equal(_params(a.model), _params(c.model))  # bf16 is a different computation


# ---- bf16 on the CPU ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", [MLP_SPEC, IMAGE_SPEC], ids=["mlp", "minatar_cnn"])
def test_bf16_update_is_finite_close_to_float32_and_keeps_float32_state(spec: FragmentSpec) -> None:
    f32, s32 = _update(spec, "fp32")
    b16, s16 = _update(spec, "bf16")
    for name in ("policy_loss", "value_loss", "entropy", "approx_kl", "grad_norm", "explained_variance"):
        assert np.isfinite(getattr(s16, name)), name
    assert s16.sgd_steps == s32.sgd_steps == 4 and s16.skipped_steps == 0
    assert s16.value_loss == pytest.approx(s32.value_loss, rel=0.05)
    assert s16.entropy == pytest.approx(s32.entropy, rel=0.05)
    assert s16.policy_loss == pytest.approx(s32.policy_loss, rel=0.05, abs=2e-3)
    assert s16.grad_norm == pytest.approx(s32.grad_norm, rel=0.05)
    # The KL estimate is a difference of nearby log-probs: in bf16 it would be rounding noise (~1e-3 against
    # a true value ~1e-5 here); cast to float32 first it stays within a factor of float32's.
    assert s32.approx_kl > 0 and s16.approx_kl == pytest.approx(s32.approx_kl, rel=0.5)
    for model, opt in ((b16.model, b16.optimizer), (f32.model, f32.optimizer)):
        assert all(p.dtype == torch.float32 for p in model.parameters())
        assert all(v.dtype == torch.float32 for st in opt.state.values() for v in st.values()
                   if isinstance(v, torch.Tensor) and v.is_floating_point())
    for head in (b16.model.actor, b16.model.critic):  # the casting hooks are gone after the update
        mods = head.modules()
        assert all(not m._forward_hooks for m in mods)


def test_bf16_gradient_points_where_float32_does() -> None:
    """One plain-SGD step on one minibatch: the weight change is -lr x gradient, so its direction in bf16 must
    match float32's."""
    spec = IMAGE_SPEC
    f32, _ = _update(spec, "fp32", optimizer="sgd", epochs=1, minibatches=1)
    b16, _ = _update(spec, "bf16", optimizer="sgd", epochs=1, minibatches=1)
    start = Learner(spec, TrainerSettings(seed=3)).model
    d32, d16 = _params(f32.model) - _params(start), _params(b16.model) - _params(start)
    assert float(d32.norm()) > 0
    assert float(torch.nn.functional.cosine_similarity(d32, d16, dim=0)) > 0.99
    assert float((d16 - d32).norm() / d32.norm()) < 0.1


def test_bf16_forward_outputs_are_float32_for_the_loss_math() -> None:
    """What the loss sees under the update's autocast: float32 log-probs and values, bf16 inside the network."""
    model = ActorCritic.for_spec(IMAGE_SPEC, 64)
    obs = torch.from_numpy(fragment(IMAGE_SPEC).obs.reshape(-1, 400))
    seen: list[torch.dtype] = []
    torso = model.torso
    assert isinstance(torso, torch.nn.Sequential)
    hook = torso[0].register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    with _forward_precision(model, CPU, True):
        logp, entropy = model.logp_entropy(obs, torch.zeros(obs.shape[0], dtype=torch.long))
        value = model.value(obs)
    hook.remove()
    assert seen == [torch.bfloat16, torch.bfloat16]  # the torso ran in bf16 (once per forward)
    assert logp.dtype == entropy.dtype == value.dtype == torch.float32
    with _forward_precision(model, CPU, False):
        assert model.value(obs).dtype == torch.float32


# ---- batch transfer -------------------------------------------------------------------------------------------
def test_pinning_is_a_noop_on_the_cpu() -> None:
    x = torch.arange(6, dtype=torch.uint8)
    assert to_device(x, CPU) is x and not x.is_pinned()
    frames = np.arange(12, dtype=np.uint8).reshape(3, 4)
    out = _t(frames, CPU)
    assert out.dtype == torch.float32 and out.device == CPU and torch.equal(out, torch.from_numpy(frames).float())
    assert _t(np.arange(3), CPU, torch.long).dtype == torch.long


def test_update_config_defaults_to_float32() -> None:
    fields = {f.name: f.default for f in dataclasses.fields(UpdateConfig)}
    assert fields["bf16"] is False


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on the CPU test machines)")
def test_cuda_learner_runs_bf16_with_pinned_batches() -> None:
    cuda = torch.device("cuda")
    x = torch.arange(6, dtype=torch.uint8)
    moved = to_device(x, cuda)
    assert moved.device.type == "cuda" and torch.equal(moved.cpu(), x)
    learner, stats = _update(IMAGE_SPEC, "auto", device="cuda")
    assert learner.update_cfg.bf16 is torch.cuda.is_bf16_supported() and learner.device.type == "cuda"
    assert np.isfinite(stats.value_loss) and np.isfinite(stats.policy_loss) and stats.skipped_steps == 0
    assert all(p.dtype == torch.float32 and p.device.type == "cuda" for p in learner.model.parameters())
    _, cpu_stats = _update(IMAGE_SPEC, "fp32")  # the same seed and batch on the CPU: the same update, roughly
    assert stats.value_loss == pytest.approx(cpu_stats.value_loss, rel=0.05)


def test_bf16_nature_cnn_update_is_finite_close_to_float32_and_keeps_float32_state() -> None:
    """The Nature CNN (84x84 frames, four stacked), whose convolutions are where the CPU's bf16 units pay
    (``trainer.precision: auto`` takes bf16 for it where timed clearly faster): the same checks as above."""
    from services.trainer.compute import probe_fragments

    spec = FragmentSpec(obs_shape=(84, 84), num_actions=6, max_bytes=1 << 24, env_id="ALE/Pong-v5",
                        obs_dtype="uint8", frame_stack=4)
    frags = probe_fragments(spec, 2, steps=16, envs=2, seed=5)
    runs = {}
    for precision in ("fp32", "bf16"):
        learner = Learner(spec, TrainerSettings(model="auto", precision=precision, epochs=2, minibatches=2, seed=3,
                                                ent_coef=0.01))
        assert learner.model.kind == "nature_cnn"  # type: ignore[attr-defined]
        runs[precision] = (learner, learner.update(frags))
    (f32, s32), (b16, s16) = runs["fp32"], runs["bf16"]
    for name in ("policy_loss", "value_loss", "entropy", "approx_kl", "grad_norm"):
        assert np.isfinite(getattr(s16, name)), name
    assert s16.sgd_steps == s32.sgd_steps == 4 and s16.skipped_steps == 0
    assert s16.value_loss == pytest.approx(s32.value_loss, rel=0.05)
    assert s16.entropy == pytest.approx(s32.entropy, rel=0.05)
    assert s16.grad_norm == pytest.approx(s32.grad_norm, rel=0.05)
    assert s16.policy_loss == pytest.approx(s32.policy_loss, rel=0.05, abs=2e-3)
    cos = torch.nn.functional.cosine_similarity(_params(b16.model) - _params(Learner(spec, TrainerSettings(
        model="auto", seed=3)).model), _params(f32.model) - _params(Learner(spec, TrainerSettings(
            model="auto", seed=3)).model), dim=0)
    assert float(cos) > 0.95  # two epochs of Adam from the same start move the same way
    assert all(p.dtype == torch.float32 for p in b16.model.parameters())
    assert all(v.dtype == torch.float32 for st in b16.optimizer.state.values() for v in st.values()
               if isinstance(v, torch.Tensor) and v.is_floating_point())
