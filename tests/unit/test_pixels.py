"""Pixels end to end (docs/pixels.md): CNN models, uint8 frames on the wire, zstd payloads, splitting to
fit the topic's limit, frame stacking rebuilt by the trainer exactly as the samplers saw it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zstandard

from shared.fragment import (
    H_ENCODING,
    H_SCHEMA,
    Fragment,
    FragmentError,
    FragmentSpec,
    FragmentTooLarge,
    decode_fragment,
    encode_fitting,
    encode_fragment,
)
from shared.rl.arch import PolicyArch
from shared.rl.frames import FrameStacker, stack_frames
from shared.rl.model import ActorCritic, weights_to_bytes

FRAME = (10, 10, 4)


def image_spec(k: int = 1, frame: tuple[int, ...] = FRAME, max_bytes: int = 1 << 22) -> FragmentSpec:
    return FragmentSpec(obs_shape=frame, num_actions=3, max_bytes=max_bytes, env_id="MinAtar/Breakout-v1",
                        obs_dtype="uint8", frame_stack=k)


def rollout(steps: int = 12, envs: int = 3, k: int = 4, seed: int = 0, frame: tuple[int, ...] = FRAME
            ) -> tuple[Fragment, np.ndarray, np.ndarray, np.ndarray, list[np.ndarray]]:
    """A fragment made as the sampler makes one (random frames, random episode ends, a FrameStacker run
    from before the fragment), with the stacks the policy saw: per step, after the last step, and for
    each truncated step's final frame."""
    rng = np.random.default_rng(seed)

    def frames() -> np.ndarray:
        return rng.integers(0, 256, (envs, *frame), dtype=np.uint8)

    stacker = FrameStacker(frames(), k)
    for _ in range(3):  # some history, with an episode end in it
        stacker.push(frames(), rng.random(envs) < 0.3)
    history = stacker.history()
    obs, seen, trunc_obs, trunc_seen = [], [], [], []
    term = np.zeros((steps, envs), np.uint8)
    trunc = np.zeros((steps, envs), np.uint8)
    n_eps = 0
    for t in range(steps):
        obs.append(stacker.stacks[:, -1].copy())
        seen.append(stacker.stacks.copy())
        term[t] = rng.random(envs) < 0.15
        trunc[t] = (rng.random(envs) < 0.15) & (term[t] == 0)
        for i in np.flatnonzero(trunc[t]):
            final = rng.integers(0, 256, frame, dtype=np.uint8)
            trunc_obs.append(final)
            trunc_seen.append(stacker.with_final(i, final))
        n_eps += int((term[t] | trunc[t]).sum())
        stacker.push(frames(), (term[t] | trunc[t]).astype(bool))
    frag = Fragment(obs=np.stack(obs), actions=rng.integers(0, 3, (steps, envs)),
                    logp=np.full((steps, envs), -1.1, np.float32), rewards=rng.random((steps, envs), np.float32),
                    terminated=term, truncated=trunc,
                    trunc_obs=np.stack(trunc_obs) if trunc_obs else np.zeros((0, *frame), np.uint8),
                    last_obs=stacker.stacks[:, -1].copy(),
                    episode_returns=np.arange(n_eps, dtype=np.float32),
                    episode_lengths=np.arange(n_eps, dtype=np.int32), policy_version=2, sampler_id="s1",
                    env_id="MinAtar/Breakout-v1", obs_history=history)
    return frag, np.stack(seen), stacker.stacks.copy(), np.stack(trunc_seen) if trunc_seen else np.zeros(0), trunc_obs


# ---- models ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("frame", "k", "kind"), [((10, 10, 4), 1, "minatar_cnn"), ((84, 84), 4, "nature_cnn"),
                                                  ((4, 84, 84), 1, "nature_cnn"), ((84, 84, 3), 2, "nature_cnn")])
def test_cnn_shapes_and_auto_choice(frame: tuple[int, ...], k: int, kind: str) -> None:
    model = ActorCritic.for_spec(image_spec(k, frame), hidden=64)  # auto: a CNN for uint8 frames
    assert type(model).__name__ == "ImageActorCritic" and model.kind == kind  # type: ignore[attr-defined]
    x = torch.randint(0, 256, (5, k, *frame), dtype=torch.uint8)
    assert model.log_probs(x).shape == (5, 3)
    assert model.value(x).shape == (5,)
    flat = x.reshape(5, -1).float()  # what the update step feeds it
    torch.testing.assert_close(model.value(flat), model.value(x))
    actions, logp = model.act(x)
    assert actions.shape == (5,) and bool((logp <= 0).all())


def test_cnn_refusals_name_the_setting() -> None:
    with pytest.raises(ValueError, match="trainer.model='nature_cnn' does not fit 10x10"):
        ActorCritic.for_spec(image_spec(), 64, model="nature_cnn")
    with pytest.raises(ValueError, match="normalize_observations"):
        ActorCritic.for_spec(image_spec(), 64, model="minatar_cnn", normalize_observations=True)
    mlp = ActorCritic.for_spec(FragmentSpec(obs_shape=(4,), num_actions=2), 64)  # float obs: the MLP as before
    assert type(mlp) is ActorCritic


def test_torch_policy_loads_the_trainers_weights_and_refuses_others() -> None:
    from shared.rl.policy_np import WeightsError
    from shared.rl.policy_torch import TorchPolicy

    spec = image_spec(2)
    trainer = ActorCritic.for_spec(spec, 64)
    policy = TorchPolicy.for_spec(spec, "auto", 64)
    policy.load(weights_to_bytes(trainer))
    obs = np.random.default_rng(0).integers(0, 256, (6, 2, *FRAME), dtype=np.uint8)
    np.testing.assert_allclose(policy.log_probs(obs), trainer.log_probs(torch.from_numpy(obs)).detach().numpy(),
                               rtol=1e-5, atol=1e-6)
    actions, logp = policy.act(obs, np.random.default_rng(1))
    assert actions.dtype == np.int64 and logp.dtype == np.float32 and actions.max() < 3
    with pytest.raises(WeightsError):
        policy.load(weights_to_bytes(ActorCritic.for_spec(image_spec(1), 64)))  # other channel count


# ---- wire format ----------------------------------------------------------------------------------------------

def test_uint8_round_trip_is_schema_3_and_float_fragments_stay_schema_2() -> None:
    frag = rollout(k=1)[0]
    headers, payload = encode_fragment(frag)
    assert dict(headers)[H_SCHEMA] == b"3"
    back = decode_fragment(headers, payload, image_spec(1))
    for name in ("obs", "trunc_obs", "last_obs"):
        assert getattr(back, name).dtype == np.uint8
        np.testing.assert_array_equal(getattr(back, name), getattr(frag, name))
    # A float fragment without stacking or compression is written as before: schema 2, no encoding header.
    floats = Fragment(**{**frag.__dict__, "obs": frag.obs.astype(np.float32), "trunc_obs": frag.trunc_obs.astype(
        np.float32), "last_obs": frag.last_obs.astype(np.float32), "obs_history": None})
    headers2, _ = encode_fragment(floats)
    assert dict(headers2)[H_SCHEMA] == b"2" and H_ENCODING not in dict(headers2)
    # ... which an image run refuses: its frames are uint8.
    with pytest.raises(FragmentError) as e:
        decode_fragment(*encode_fragment(floats), image_spec(1))
    assert e.value.reason == "bad_dtype"


def test_zstd_round_trip_and_its_poison_checks() -> None:
    frag = rollout(k=4)[0]
    frag.obs[:] = frag.obs // 64  # few distinct values, as real frames: compressible
    plain = encode_fragment(frag)[1]
    headers, payload = encode_fragment(frag, "zstd")
    assert dict(headers)[H_ENCODING] == b"zstd" and len(payload) < len(plain) / 2
    back = decode_fragment(headers, payload, image_spec(4))
    np.testing.assert_array_equal(back.obs, frag.obs)
    assert back.obs_history is not None and frag.obs_history is not None
    np.testing.assert_array_equal(back.obs_history, frag.obs_history)

    def reason(h: list[tuple[str, bytes]], p: bytes, spec: FragmentSpec | None = None) -> str:
        with pytest.raises(FragmentError) as e:
            decode_fragment(h, p, spec or image_spec(4))
        return e.value.reason

    bomb = zstandard.ZstdCompressor().compress(b"\0" * (1 << 20))  # 1 MiB of zeros in a few bytes
    small = FragmentSpec(**{**image_spec(4).__dict__, "max_decoded_bytes": 1 << 19})
    assert reason(headers, bomb, small) == "oversize"
    assert reason(headers, b"not zstd at all") == "undecodable"
    streamed = zstandard.ZstdCompressor().compressobj().compress(plain)  # no content size in the frame header
    assert reason(headers, streamed + zstandard.ZstdCompressor().compressobj().flush()) == "undecodable"
    assert reason([(k, b"lz77" if k == H_ENCODING else v) for k, v in headers], payload) == "bad_header"
    legacy = [(k, b"2" if k == H_SCHEMA else v) for k, v in headers]
    assert reason(legacy, payload) == "bad_header"  # schema 2 has no compression
    assert reason([*headers, (H_ENCODING, b"identity")], payload) == "ambiguous_header"


def test_history_of_the_wrong_depth_is_refused() -> None:
    frag = rollout(k=4)[0]
    with pytest.raises(FragmentError) as e:
        decode_fragment(*encode_fragment(frag), image_spec(2))
    assert e.value.reason == "bad_shape" and "obs_history" in str(e.value)


# ---- frame stacking --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 2, 4])
def test_stack_frames_rebuilds_what_the_sampler_saw(k: int) -> None:
    for seed in range(5):
        frag, seen, last_seen, trunc_seen, _ = rollout(k=k, seed=seed)
        back = decode_fragment(*encode_fragment(frag, "zstd"), image_spec(k))
        stacked = stack_frames(back, k)
        np.testing.assert_array_equal(stacked.obs, seen)
        np.testing.assert_array_equal(stacked.last_obs, last_seen)
        if trunc_seen.size:
            np.testing.assert_array_equal(stacked.trunc_obs, trunc_seen)


# ---- splitting -------------------------------------------------------------------------------------------------

def test_split_pieces_fit_stand_alone_and_add_up_to_the_fragment() -> None:
    k = 4
    frag, seen, last_seen, trunc_seen, _ = rollout(steps=16, envs=3, k=k, seed=3)
    whole = len(encode_fragment(frag)[1])
    limit = whole // 3
    pieces = encode_fitting(frag, limit)
    assert len(pieces) >= 4
    decoded = []
    for _piece, headers, payload in pieces:
        assert len(payload) <= limit
        decoded.append(decode_fragment(headers, payload, image_spec(k, max_bytes=limit)))
    assert len({d.sample_id for d in decoded}) == len(decoded)
    for name in ("obs", "actions", "logp", "rewards", "terminated", "truncated", "trunc_obs", "episode_returns",
                 "episode_lengths"):
        np.testing.assert_array_equal(np.concatenate([getattr(d, name) for d in decoded]), getattr(frag, name))
    np.testing.assert_array_equal(decoded[-1].last_obs, frag.last_obs)
    # Each piece rebuilds the stacks the sampler saw for its steps (its history: the frames before it).
    stacked = [stack_frames(d, k) for d in decoded]
    np.testing.assert_array_equal(np.concatenate([s.obs for s in stacked]), seen)
    np.testing.assert_array_equal(stacked[-1].last_obs, last_seen)
    np.testing.assert_array_equal(np.concatenate([s.trunc_obs for s in stacked]), trunc_seen)
    for a, b in zip(stacked, stacked[1:], strict=False):  # a piece bootstraps from the next one's first stack
        np.testing.assert_array_equal(a.last_obs, b.obs[0])


def test_a_fragment_that_fits_is_one_record_and_a_step_that_cannot_fit_is_a_clear_error() -> None:
    frag = rollout(steps=4, envs=2, k=1)[0]
    assert len(encode_fitting(frag, 1 << 20)) == 1
    with pytest.raises(FragmentTooLarge, match="one step of 2 envs encodes to .* bytes, over the limit of 2000"):
        encode_fitting(frag, 2000)


# ---- the sampler's worker and the learner on a real pixel env ---------------------------------------------------

def test_minatar_worker_fragments_decode_and_train() -> None:
    pytest.importorskip("minatar")
    from services.sampler.rollout import RolloutWorker
    from services.trainer.learner import Learner
    from shared.rl.envs import fragment_spec
    from shared.settings import TrainerSettings

    for k in (1, 2):
        spec = fragment_spec("MinAtar/Breakout-v1", 1 << 22, frame_stack=k)
        assert (spec.obs_shape, spec.obs_dtype, spec.num_actions) == ((10, 10, 4), "uint8", 3)
        cfg = TrainerSettings(model="minatar_cnn", minibatches=2, epochs=1)
        learner = Learner(spec, cfg)
        worker = RolloutWorker("MinAtar/Breakout-v1", 4, 16, "s1", PolicyArch("minatar_cnn", 64), seed=0, frame_stack=k)
        worker.set_policy(0, learner.weights())
        frag = worker.collect()
        assert frag.obs.dtype == np.uint8 and set(np.unique(frag.obs)) <= {0, 255}
        back = decode_fragment(*encode_fragment(frag, "zstd"), spec)
        stats = learner.update([back])
        assert stats.env_steps == 64 and np.isfinite(stats.value_loss)
        worker.set_policy(1, learner.weights())
        worker.close()


def test_only_the_env_ids_package_is_imported() -> None:
    """A CartPole service must not import MinAtar (its module imports matplotlib and seaborn: seconds of every
    service's start-up); a MinAtar id registers it. In a fresh interpreter, so other tests' imports do not count."""
    import subprocess
    import sys

    code = ("import sys; from shared.rl.envs import fragment_spec, make_vector_env; "
            "fragment_spec('CartPole-v1', 1 << 20); make_vector_env('CartPole-v1', 2).close(); "
            "print(sorted(m for m in ('minatar', 'matplotlib', 'ale_py') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
    pytest.importorskip("minatar")
    code = ("import sys; from shared.rl.envs import fragment_spec; "
            "print(fragment_spec('MinAtar/Breakout-v1', 1 << 20).obs_shape, 'minatar' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "(10, 10, 4) True", out.stdout + out.stderr


# ---- the learner's CNN evaluation ------------------------------------------------------------------------------

def test_a_cnn_evaluates_both_heads_from_one_pass_of_its_torso() -> None:
    """An update step needs log-probs, entropy and values: one torso pass gives all three, with the values and
    gradients of the separate ``logp_entropy`` and ``value`` passes (which ran the convolutions twice)."""
    from shared.rl.model import ImageActorCritic

    torch.manual_seed(0)
    model = ImageActorCritic(FRAME, 3, "minatar_cnn", frame_stack=2)
    passes: list[int] = []
    model.torso.register_forward_hook(lambda *_: passes.append(1))
    obs = torch.randint(0, 256, (32, 2, *FRAME), dtype=torch.uint8)
    actions = torch.randint(0, 3, (32,))
    logp, entropy, value = model.evaluate(obs, actions)
    assert len(passes) == 1
    ref_logp, ref_entropy = model.logp_entropy(obs, actions)
    ref_value = model.value(obs)
    params = list(model.parameters())

    def loss(lp: torch.Tensor, ent: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return -(lp * torch.linspace(-1, 1, 32)).mean() - 0.01 * ent.mean() + 0.5 * v.pow(2).mean()

    got = torch.autograd.grad(loss(logp, entropy, value), params)
    want = torch.autograd.grad(loss(ref_logp, ref_entropy, ref_value), params)
    for a, b in ((logp, ref_logp), (entropy, ref_entropy), (value, ref_value), *zip(got, want, strict=True)):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5)


def test_the_learner_feeds_the_nature_cnn_channels_last_and_keeps_its_weights_contiguous() -> None:
    from services.trainer.learner import Learner
    from shared.settings import TrainerSettings

    torch.manual_seed(0)
    learner = Learner(image_spec(4, frame=(84, 84)), TrainerSettings(model="nature_cnn"))
    model = learner.model
    assert getattr(model, "channels_last_input", False)
    obs = torch.randint(0, 256, (16, 4, 84, 84), dtype=torch.uint8)
    actions = torch.randint(0, 3, (16,))
    with torch.no_grad():
        nhwc = model.evaluate(obs, actions)
        model.channels_last_input = False  # type: ignore[assignment]
        nchw = model.evaluate(obs, actions)
    for a, b in zip(nhwc, nchw, strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)
    assert all(t.is_contiguous() for t in model.state_dict().values())  # checkpoints and exports as before
    minatar = Learner(image_spec(1), TrainerSettings(model="minatar_cnn")).model
    assert not getattr(minatar, "channels_last_input", True)
