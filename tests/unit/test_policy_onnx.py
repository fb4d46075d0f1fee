"""The samplers' onnxruntime policy (``shared/rl/policy_onnx.py``) against the torch policy it replaces: the same
weights, observations and generator give the same actions; new versions are adopted without a re-export; a blob
that does not fit is refused and the session kept. No env is needed: the specs are written out."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shared.fragment import FragmentSpec
from shared.rl.arch import PolicyArch
from shared.rl.model import ActorCritic, WeightsError, weights_to_bytes
from shared.rl.policy_onnx import OnnxPolicy, example_batch, resolve_inference
from shared.rl.policy_torch import TorchPolicy

MINATAR = FragmentSpec(obs_shape=(10, 10, 4), num_actions=3, max_bytes=1 << 22, env_id="MinAtar/Breakout-v1",
                       obs_dtype="uint8")
MINATAR_K2 = FragmentSpec(obs_shape=(10, 10, 4), num_actions=6, max_bytes=1 << 22, env_id="MinAtar/Breakout-v1",
                          obs_dtype="uint8", frame_stack=2)
MLP = FragmentSpec(obs_shape=(4,), num_actions=2, max_bytes=1 << 22, env_id="CartPole-v1")
# Pong's frames: the Nature CNN has two zero-initialised biases of one shape, which the exporter would merge
PONG = FragmentSpec(obs_shape=(84, 84), num_actions=6, max_bytes=1 << 22, env_id="ALE/Pong-v5", obs_dtype="uint8",
                    frame_stack=4)


def blob(spec: FragmentSpec, model: str, seed: int) -> bytes:
    """Trainer-format weights, every tensor perturbed so that the policy is far from uniform (the heads start
    near zero)."""
    torch.manual_seed(seed)
    m = ActorCritic.for_spec(spec, 64, model=model)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return weights_to_bytes(m)


def observations(spec: FragmentSpec, rows: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    shape = example_batch(spec, rows).shape
    if spec.obs_dtype == "uint8":
        return (rng.random(shape) < 0.2).astype(np.uint8) * np.uint8(255)  # MinAtar's 0/255 frames
    return rng.normal(size=shape).astype(np.float32) * 2


@pytest.mark.parametrize(("spec", "model"), [(MINATAR, "minatar_cnn"), (MINATAR_K2, "minatar_cnn"), (MLP, "mlp"),
                                             (PONG, "nature_cnn")], ids=["minatar", "minatar-k2", "mlp", "pong"])
def test_onnx_gives_the_torch_policys_actions(spec: FragmentSpec, model: str) -> None:
    onnx_policy = OnnxPolicy.for_spec(spec, model, 64)
    torch_policy = TorchPolicy.for_spec(spec, model, 64)
    assert not onnx_policy.loaded
    with pytest.raises(RuntimeError, match="no weights"):
        onnx_policy.act(observations(spec, 2), np.random.default_rng(0))
    for version in (1, 2):  # the second version replaces the first without a new export
        data = blob(spec, model, seed=version)
        onnx_policy.load(data)
        torch_policy.load(data)
        for rows in (16, 1, 5):  # the batch axis is dynamic
            obs = observations(spec, rows, seed=version * 10 + rows)
            want = torch_policy.log_probs(obs)
            # rtol 1e-4: Pong's perturbed Nature CNN reaches log-probs of -50, where the two runtimes' float32
            # sums differ in the 5th digit
            np.testing.assert_allclose(onnx_policy.log_probs(obs), want, atol=1e-5, rtol=1e-4)
            np.testing.assert_array_equal(onnx_policy.log_probs(obs).argmax(1), want.argmax(1))
            a_onnx, lp_onnx = onnx_policy.act(obs, np.random.default_rng(version))
            a_torch, lp_torch = torch_policy.act(obs, np.random.default_rng(version))
            np.testing.assert_array_equal(a_onnx, a_torch)
            np.testing.assert_allclose(lp_onnx, lp_torch, atol=1e-5, rtol=1e-4)
            assert a_onnx.dtype == np.int64 and lp_onnx.dtype == np.float32
        many = observations(spec, 64, seed=version)
        assert len(set(onnx_policy.act(many, np.random.default_rng(0))[0].tolist())) > 1  # not one action always


def test_a_blob_that_does_not_fit_is_refused_and_the_session_kept() -> None:
    policy = OnnxPolicy.for_spec(MINATAR, "minatar_cnn", 64)
    policy.load(blob(MINATAR, "minatar_cnn", seed=1))
    obs = observations(MINATAR, 8)
    before = policy.log_probs(obs)
    with pytest.raises(WeightsError):
        policy.load(blob(MINATAR_K2, "minatar_cnn", seed=2))  # other shapes (6 actions, 8 input channels)
    with pytest.raises(WeightsError):
        policy.load(b"not a blob")
    np.testing.assert_array_equal(policy.log_probs(obs), before)


def test_resolve_inference_picks_what_measured_faster_and_refuses_what_cannot_run() -> None:
    assert resolve_inference("auto", image_model=True) == "onnx"
    assert resolve_inference("auto", image_model=False) == "numpy"
    assert resolve_inference("torch", image_model=True) == "torch"
    assert resolve_inference("onnx", image_model=False) == "onnx"
    with pytest.raises(ValueError, match="sampler.inference='numpy' runs the MLP only"):
        resolve_inference("numpy", image_model=True)
    with pytest.raises(ValueError, match="want auto, numpy, torch or onnx"):
        resolve_inference("tensorrt", image_model=False)


def test_continuous_actions_are_refused() -> None:
    spec = FragmentSpec(obs_shape=(3,), num_actions=0, max_bytes=1 << 22, env_id="Pendulum-v1", action_shape=(1,))
    with pytest.raises(ValueError, match="discrete actions only"):
        OnnxPolicy.for_spec(spec, "mlp", 64)


def test_the_sampler_runs_the_backend_sampler_inference_names() -> None:
    """``sampler.inference`` reaches the RolloutWorker: auto is numpy for the MLP and onnxruntime for a CNN."""
    from services.sampler.rollout import RolloutWorker
    from shared.rl.policy_np import NumpyPolicy

    cartpole = RolloutWorker("CartPole-v1", 2, 4, "s", PolicyArch(hidden=64), seed=0)
    assert isinstance(cartpole.policy, NumpyPolicy)
    cartpole.close()
    with pytest.raises(ValueError, match="without observation normalisation"):
        RolloutWorker("CartPole-v1", 2, 4, "s", PolicyArch(hidden=64, normalize_observations=True), seed=0,
                      inference="onnx")
    pytest.importorskip("minatar", reason="the minatar extra is not installed")
    for inference, kind in (("auto", OnnxPolicy), ("torch", TorchPolicy)):
        w = RolloutWorker("MinAtar/Breakout-v1", 2, 8, "s", PolicyArch("minatar_cnn", 64), seed=0, inference=inference)
        assert isinstance(w.policy, kind), (inference, type(w.policy))
        w.set_policy(0, blob(w.spec, "minatar_cnn", seed=3))
        frag = w.collect()
        assert frag.obs.shape[:2] == (8, 2) and frag.obs.dtype == np.uint8
        w.close()
    with pytest.raises(ValueError, match="MLP only"):
        RolloutWorker("MinAtar/Breakout-v1", 2, 8, "s", PolicyArch("minatar_cnn", 64), seed=0, inference="numpy")


def test_both_exporters_give_the_same_graph_outputs() -> None:
    """TorchScript's exporter serves by default; torch.export's is the fallback where PyTorch has dropped it."""
    import onnxruntime as ort

    from shared.rl.policy_onnx import export_graph

    torch.manual_seed(0)
    model = ActorCritic.for_spec(MINATAR_K2, 64, model="minatar_cnn")

    class LogProbs(torch.nn.Module):
        def forward(self, obs: torch.Tensor) -> torch.Tensor:
            return model.log_probs(obs)

    obs = observations(MINATAR_K2, 7)
    want = model.log_probs(torch.from_numpy(obs)).detach().numpy()
    for legacy in (True, False):
        proto = export_graph(LogProbs().eval(), example_batch(MINATAR_K2), legacy=legacy)
        got = ort.InferenceSession(proto.SerializeToString()).run(["logp"], {"obs": obs})[0]
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4)


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_adopting_versions_does_not_keep_a_copy_of_each() -> None:
    """A sampler adopts a new version every second or so for the whole run: memory must level off. Writing each
    version's weights into the ONNX proto kept about one blob per adoption (Pong's 6.75 MB: ~7 MB a load, 94 MB over
    12 loads measured, no plateau: 133 MiB over 20 here); a fresh proto per load levels off within a few loads."""
    policy = OnnxPolicy.for_spec(PONG, "nature_cnn", 64)
    blobs = [blob(PONG, "nature_cnn", seed) for seed in (1, 2)]
    assert len(blobs[0]) > 6_000_000
    obs = np.random.default_rng(0).integers(0, 255, (2, *example_batch(PONG).shape[1:])).astype(np.uint8)
    for i in range(6):  # warm up: allocator pools, the first sessions
        policy.load(blobs[i % 2])
    settled = _rss_mib()
    for i in range(20):
        policy.load(blobs[i % 2])
    grown = _rss_mib() - settled
    assert grown < 60, f"20 adoptions of a {len(blobs[0]) / 1e6:.1f} MB policy grew the process by {grown:.0f} MiB"
    # and the last load is what acts
    reference = OnnxPolicy.for_spec(PONG, "nature_cnn", 64)
    reference.load(blobs[1])
    np.testing.assert_allclose(policy.log_probs(obs), reference.log_probs(obs), rtol=1e-5, atol=1e-5)
