"""``flywheel export`` and ``flywheel eval`` on policy blobs in the trainer's format, published through the
marker protocol into a real (directory) store: the exported ONNX graph acts as the samplers' numpy policy
does (onnxruntime), the safetensors file holds the same tensors, eval runs the episodes it says it runs,
and video is recorded."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from safetensors import safe_open

from services.admin import cli
from services.admin.evaluate import EvalError, choose, evaluate, load_version, make_env, policy_for, run_episodes
from services.admin.export import OPSET, export_version
from shared.fragment import FragmentSpec
from shared.marker import VersionedStore, VersionRecord
from shared.rl.model import ActorCritic, weights_to_bytes
from shared.rl.policy_np import NumpyPolicy
from shared.settings import Settings
from shared.store import LocalDirStore


def random_blob(env_id: str, *, normalize: bool = False, gsde: bool = False, seed: int = 0,
                activation: str = "tanh") -> bytes:
    """Trainer-format weights with every tensor perturbed (the actor's last layer is initialised near zero,
    which would make every logit alike) and, with ``normalize``, observation statistics far from 0 / 1."""
    env = gym.make(env_id)
    obs_dim = int(np.prod(env.observation_space.shape or ()))
    space = env.action_space
    env.close()
    continuous = isinstance(space, gym.spaces.Box)
    width = int(np.prod(space.shape or ())) if continuous else int(space.n)  # type: ignore[attr-defined]
    torch.manual_seed(seed)
    model = ActorCritic(obs_dim, width, 64, continuous=continuous, normalize_observations=normalize, gsde=gsde,
                        activation=activation)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
        if model.obs_norm is not None:
            model.obs_norm.mean.copy_(torch.randn(obs_dim))
            model.obs_norm.var.copy_(torch.rand(obs_dim) * 4 + 0.1)
            model.obs_norm.count.fill_(1000.0)
    return weights_to_bytes(model)


def settings_for(tmp_path: Path, env_id: str, *, normalize: bool = False, gsde: bool = False,
                 run: str = "exp", activation: str = "tanh") -> Settings:
    return Settings.model_validate({
        "run": run, "store": {"backend": "local", "local_root": str(tmp_path / "store")}, "env": {"id": env_id},
        "trainer": {"normalize_observations": normalize, "gsde": gsde, "activation": activation}})


def publish(settings: Settings, blob: bytes, version: int) -> VersionedStore:
    """``blob`` published as ``version`` the way the trainer and paramsync do (blob, then marker)."""
    policies = VersionedStore(LocalDirStore(settings.store.local_root), settings.run, "policy")
    key, sha = policies.put_blob(blob)
    policies.publish_next(VersionRecord(version=version, blob=key, sha256=sha, size=len(blob), trainer_step=version))
    return policies


def assert_float32_close(actual: np.ndarray, expected: np.ndarray, scale: np.ndarray | None = None) -> None:
    """Equal up to float32 sums taken in another order, whose error grows with the largest output (``scale``;
    ``expected`` by default): ReLU outputs reach ~130, and over 200 random draws the worst error was 5e-7 of the
    largest output, so 1e-5 of it leaves a margin; a single weight off by 1e-3 still fails."""
    largest = float(np.abs(expected if scale is None else scale).max())
    np.testing.assert_allclose(actual, expected, atol=1e-5 * max(1.0, largest), rtol=1e-5)


def observations(env_id: str, n: int, seed: int = 0) -> np.ndarray:
    """States the env visits plus wide random ones (beyond the normalisation clip)."""
    env = gym.make(env_id)
    rng = np.random.default_rng(seed)
    rows = []
    obs, _ = env.reset(seed=seed)
    env.action_space.seed(seed)  # the same states every run
    for _ in range(n // 2):
        rows.append(obs)
        obs, _, term, trunc, _ = env.step(env.action_space.sample())
        if term or trunc:
            obs, _ = env.reset()
    env.close()
    wide = rng.normal(size=(n - len(rows), len(rows[0]))) * 5
    return np.concatenate([np.asarray(rows, np.float32), wide.astype(np.float32)])


# ---- ONNX acts as the samplers' policy -------------------------------------------------------------
@pytest.mark.parametrize(("env_id", "normalize", "gsde", "activation"), [("CartPole-v1", False, False, "tanh"),
                                                                       ("Pendulum-v1", True, True, "tanh"),
                                                                       ("Pendulum-v1", True, False, "relu")])
def test_onnx_policy_gives_the_samplers_actions(tmp_path: Path, env_id: str, normalize: bool, gsde: bool,
                                                activation: str) -> None:
    settings = settings_for(tmp_path, env_id, normalize=normalize, gsde=gsde, activation=activation)
    blob = random_blob(env_id, normalize=normalize, gsde=gsde, activation=activation)
    policies = publish(settings, blob, 3)
    path, record = export_version(settings, policies, None, "onnx", tmp_path / "out" / "policy.onnx")
    assert path.is_file() and record.version == 3

    model = onnx.load(str(path))
    assert {o.version for o in model.opset_import if o.domain in ("", "ai.onnx")} == {OPSET}
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta["flywheel.env_id"] == env_id and meta["flywheel.version"] == "3"
    assert meta["flywheel.activation"] == activation

    sampler_policy = policy_for(settings)  # what the samplers build, with the same blob
    assert isinstance(sampler_policy, NumpyPolicy)  # an MLP env: the numpy policy
    sampler_policy.load(blob)
    env = gym.make(env_id)
    bounds = (env.action_space.low, env.action_space.high) if isinstance(env.action_space, gym.spaces.Box) else None
    env.close()
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["obs"]
    obs = observations(env_id, 64)
    for batch in (obs, obs[:1], obs[:7]):  # the batch axis is dynamic
        action, out, value = session.run(["action", "mean" if bounds is not None else "logits", "value"],
                                         {"obs": batch})
        expected = sampler_policy.logits(batch)
        assert_float32_close(out, expected)
        want = np.stack([np.asarray(choose(sampler_policy, row, bounds, None)) for row in batch])
        if bounds is None:
            assert action.dtype == np.int64
            np.testing.assert_array_equal(action, want)
            assert len(batch) < len(obs) or len(set(action.tolist())) > 1  # the test sees more than one action
        else:
            assert_float32_close(action, want.reshape(action.shape), scale=expected)
            if len(batch) == len(obs):  # the bounds clip some actions and not others
                assert (np.abs(action) == bounds[1][0]).any() and (np.abs(action) < bounds[1][0]).any()
        torch_model = ActorCritic(sampler_policy.obs_dim, sampler_policy.num_actions, 64, continuous=bounds is not None,
                                  normalize_observations=normalize, gsde=gsde, activation=activation)
        torch_model.load_state_dict({k: torch.from_numpy(v) for k, v in _tensors(blob).items()})
        assert_float32_close(value, torch_model.value(torch.from_numpy(batch)).detach().numpy())


def _tensors(blob: bytes) -> dict[str, np.ndarray]:
    from safetensors.numpy import load

    return load(blob)


def test_safetensors_export_holds_the_tensors_and_metadata(tmp_path: Path) -> None:
    settings = settings_for(tmp_path, "Pendulum-v1", normalize=True)
    blob = random_blob("Pendulum-v1", normalize=True)
    policies = publish(settings, blob, 1)
    publish(settings, random_blob("Pendulum-v1", normalize=True, seed=1), 2)
    path, record = export_version(settings, policies, 1, "safetensors", tmp_path / "v1.safetensors")
    assert record.version == 1
    with safe_open(str(path), framework="numpy") as f:
        meta = f.metadata()
        got = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a mapping)
    want = _tensors(blob)
    assert set(got) == set(want) and all(np.array_equal(got[k], want[k]) for k in want)
    assert meta["flywheel.version"] == "1" and meta["flywheel.actions"] == "continuous"
    assert meta["flywheel.normalize_observations"] == "true"
    reloaded = policy_for(settings)
    reloaded.load(path.read_bytes())  # still the format the samplers load


def test_export_refuses_unknown_versions_and_mismatched_configs(tmp_path: Path) -> None:
    settings = settings_for(tmp_path, "CartPole-v1")
    policies = VersionedStore(LocalDirStore(settings.store.local_root), settings.run, "policy")
    with pytest.raises(LookupError, match="no policy is published"):
        load_version(policies, None)
    publish(settings, random_blob("CartPole-v1"), 4)
    with pytest.raises(LookupError, match=r"version 9 is not kept .*kept: 4"):
        export_version(settings, policies, 9, "safetensors")
    wider = Settings.model_validate({**settings.model_dump(), "trainer": {"hidden": 32}})
    with pytest.raises(EvalError, match=r"does not fit .*trainer.hidden=32"):
        export_version(wider, policies, None, "safetensors", tmp_path / "x.safetensors")


# ---- eval --------------------------------------------------------------------------------------------
def always_right_blob() -> bytes:
    """CartPole weights whose argmax is always action 1 (push right)."""
    model = ActorCritic(4, 2, 64)
    with torch.no_grad():
        model.actor[4].weight.zero_()  # type: ignore[operator]
        model.actor[4].bias.copy_(torch.tensor([0.0, 5.0]))  # type: ignore[operator]
    return weights_to_bytes(model)


def test_eval_runs_the_episodes_it_reports(tmp_path: Path) -> None:
    settings = settings_for(tmp_path, "CartPole-v1")
    policies = publish(settings, always_right_blob(), 5)
    report = evaluate(settings, policies, None, 4, deterministic=True, seed=10)
    env = gym.make("CartPole-v1")  # the same episodes by hand: always push right
    want = []
    for i in range(4):
        env.reset(seed=10 + i)
        steps, done = 0, False
        while not done:
            _, _, term, trunc, _ = env.step(1)
            steps, done = steps + 1, term or trunc
        want.append(steps)
    assert report.version == 5 and list(report.lengths) == want and list(report.returns) == [float(n) for n in want]
    assert report.mean == pytest.approx(np.mean(want)) and report.std == pytest.approx(np.std(want))
    text = "\n".join(report.lines())
    assert f"return {np.mean(want):.2f} ± {np.std(want):.2f}" in text and "version 5" in text


def test_stochastic_eval_samples_and_is_reproducible(tmp_path: Path) -> None:
    settings = settings_for(tmp_path, "Pendulum-v1", gsde=True)
    policies = publish(settings, random_blob("Pendulum-v1", gsde=True), 1)
    policy = policy_for(settings)
    policy.load(load_version(policies, None)[1])
    env = gym.make("Pendulum-v1")
    a = run_episodes(policy, env, 2, deterministic=False, seed=3)
    b = run_episodes(policy, env, 2, deterministic=False, seed=3)
    c = run_episodes(policy, env, 2, deterministic=True, seed=3)
    env.close()
    assert a == b and a[0] != c[0] and a[1] == [200, 200]


def test_cli_eval_and_export_read_the_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    settings = settings_for(tmp_path, "CartPole-v1", run="clirun")
    publish(settings, always_right_blob(), 2)
    for key, value in {"FLYWHEEL_RUN": "clirun", "FLYWHEEL_STORE_BACKEND": "local",
                       "FLYWHEEL_STORE_LOCAL_ROOT": str(settings.store.local_root)}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("FLYWHEEL_CONFIG", raising=False)
    assert cli.main(["eval", "--episodes", "3", "--deterministic", "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["version"] == 2 and body["episodes"] == 3 and len(body["returns"]) == 3
    assert cli.main(["eval", "7", "--episodes", "1"]) == 1
    assert "version 7 is not kept" in capsys.readouterr().err
    monkeypatch.chdir(tmp_path)
    assert cli.main(["export", "--format", "safetensors"]) == 0
    assert "clirun-v2.safetensors" in capsys.readouterr().out and (tmp_path / "clirun-v2.safetensors").is_file()
    with pytest.raises(SystemExit):
        cli.main(["eval", "--episodes", "0"])


# ---- video -------------------------------------------------------------------------------------------
def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_video_falls_back_to_png_frames_without_moviepy(tmp_path: Path) -> None:
    pytest.importorskip("pygame", reason="classic-control rendering needs pygame (the test extra installs it)")
    settings = settings_for(tmp_path, "CartPole-v1")
    policy = policy_for(settings)
    policy.load(always_right_blob())
    env, how = make_env("CartPole-v1", tmp_path / "video", "exp-v1", moviepy_available=lambda: False)
    assert how is not None and "PNG" in how
    _, lengths = run_episodes(policy, env, 2, deterministic=True, seed=0)
    env.close()
    for i, n in enumerate(lengths):
        frames = sorted((tmp_path / "video" / f"episode-{i}").glob("frame-*.png"))
        assert len(frames) == n + 1  # the reset frame and one per step
        assert _png_size(frames[0]) == (600, 400)


def test_video_is_recorded_with_moviepy(tmp_path: Path) -> None:
    pytest.importorskip("pygame")
    pytest.importorskip("moviepy", reason="the video extra")
    settings = settings_for(tmp_path, "CartPole-v1")
    policies = publish(settings, always_right_blob(), 1)
    t0 = time.time()
    report = evaluate(settings, policies, None, 2, deterministic=True, video_dir=tmp_path / "video")
    videos = sorted((tmp_path / "video").glob("*.mp4"))
    assert report.video is not None and len(videos) == 2, (report.video, list((tmp_path / "video").iterdir()))
    assert all(v.stat().st_size > 0 and v.stat().st_mtime >= t0 - 1 for v in videos)


class _NoRender(gym.Env[np.ndarray, int]):
    """An env without an ``rgb_array`` render mode."""

    metadata: dict[str, object] = {"render_modes": []}
    observation_space = gym.spaces.Box(-1, 1, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)  # type: ignore[assignment]

    def __init__(self, render_mode: str | None = None) -> None:
        self.render_mode = render_mode


def test_video_needs_an_env_that_renders(tmp_path: Path) -> None:
    if "FlywheelNoRender-v0" not in gym.registry:
        gym.register("FlywheelNoRender-v0", entry_point=_NoRender)  # type: ignore[arg-type]
    with pytest.raises(EvalError, match="does not render rgb_array"):
        make_env("FlywheelNoRender-v0", tmp_path / "video", "x")
    assert not (tmp_path / "video").exists()


# ---- CNN policies (image envs: MinAtar) ---------------------------------------------------------------------
MINATAR = "MinAtar/Breakout-v1"


def cnn_settings(tmp_path: Path, frame_stack: int, run: str = "cnn") -> Settings:
    return Settings.model_validate({
        "run": run, "store": {"backend": "local", "local_root": str(tmp_path / "store")},
        "env": {"id": MINATAR, "frame_stack": frame_stack}, "trainer": {"model": "minatar_cnn"}})


def cnn_blob(frame_stack: int, seed: int = 0, action: int | None = None) -> bytes:
    """Trainer-format MinAtar CNN weights, perturbed; with ``action`` the argmax is always that action."""
    from shared.rl.envs import fragment_spec

    torch.manual_seed(seed)
    model = ActorCritic.for_spec(fragment_spec(MINATAR, 1 << 22, frame_stack=frame_stack), 64, model="minatar_cnn")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
        if action is not None:
            model.actor.weight.zero_()  # type: ignore[operator]
            model.actor.bias.copy_(torch.nn.functional.one_hot(torch.tensor(action), 3) * 5.0)  # type: ignore[operator]
    return weights_to_bytes(model)


def frame_stacks(frame_stack: int, n: int, seed: int = 0) -> np.ndarray:
    """Stacks ``[n, K, 10, 10, 4]`` of MinAtar-like 0/255 frames."""
    rng = np.random.default_rng(seed)
    return (rng.random((n, frame_stack, 10, 10, 4)) < 0.15).astype(np.uint8) * np.uint8(255)


@pytest.mark.parametrize("frame_stack", [1, 2])
def test_cnn_onnx_export_acts_as_the_samplers_cnn(tmp_path: Path, frame_stack: int) -> None:
    pytest.importorskip("minatar", reason="the minatar extra (pip install -e '.[minatar]')")
    settings = cnn_settings(tmp_path, frame_stack)
    blob = cnn_blob(frame_stack)
    policies = publish(settings, blob, 6)
    path, record = export_version(settings, policies, None, "onnx", tmp_path / "cnn.onnx")
    assert record.version == 6
    meta = {p.key: p.value for p in onnx.load(str(path)).metadata_props}
    assert meta["flywheel.model"] == "minatar_cnn" and meta["flywheel.obs_dtype"] == "uint8"
    assert meta["flywheel.obs_shape"] == f"{frame_stack},10,10,4" and meta["flywheel.frame_stack"] == str(frame_stack)

    sampler_policy = policy_for(settings)  # the CNN the samplers build, with the same blob
    sampler_policy.load(blob)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [(i.name, i.type) for i in session.get_inputs()] == [("obs", "tensor(uint8)")]
    obs = frame_stacks(frame_stack, 32)
    for batch in (obs, obs[:1]):
        action, logits, value = session.run(["action", "logits", "value"], {"obs": batch})
        want = sampler_policy.log_probs(batch)
        assert_float32_close(torch.log_softmax(torch.from_numpy(logits), -1).numpy(), want)
        np.testing.assert_array_equal(action, want.argmax(1))
        np.testing.assert_array_equal(action, [choose(sampler_policy, row, None, None) for row in batch])
        assert action.dtype == np.int64 and (len(batch) == 1 or len(set(action.tolist())) > 1)
        torch_model = ActorCritic.for_spec(_minatar_spec(frame_stack), 64, model="minatar_cnn")
        torch_model.load_state_dict({k: torch.from_numpy(v) for k, v in _tensors(blob).items()})
        assert_float32_close(value, torch_model.value(torch.from_numpy(batch)).detach().numpy())

    path, _ = export_version(settings, policies, None, "safetensors", tmp_path / "cnn.safetensors")
    with safe_open(str(path), framework="numpy") as f:
        assert f.metadata()["flywheel.model"] == "minatar_cnn"
    policy_for(settings).load(path.read_bytes())  # the format the samplers load


def _minatar_spec(frame_stack: int) -> FragmentSpec:
    from shared.rl.envs import fragment_spec

    return fragment_spec(MINATAR, 1 << 22, frame_stack=frame_stack)


class _Observations(gym.Wrapper[np.ndarray, int, np.ndarray, int]):
    """Keeps every observation the env returns (reset and steps)."""

    def __init__(self, env: gym.Env[np.ndarray, int]) -> None:
        super().__init__(env)
        self.seen: list[np.ndarray] = []

    def reset(self, **kwargs: Any) -> Any:
        obs, info = self.env.reset(**kwargs)
        self.seen.append(obs.copy())
        return obs, info

    def step(self, action: int) -> Any:
        out = self.env.step(action)
        self.seen.append(out[0].copy())
        return out


def test_cnn_eval_runs_minatar_episodes_on_the_samplers_frame_stacks(tmp_path: Path) -> None:
    pytest.importorskip("minatar", reason="the minatar extra (pip install -e '.[minatar]')")
    from services.admin.evaluate import build_env
    from shared.rl.policy_torch import TorchPolicy

    settings = cnn_settings(tmp_path, 2)
    policies = publish(settings, cnn_blob(2, action=2), 3)
    report = evaluate(settings, policies, None, 2, deterministic=True, seed=5)
    env = build_env(MINATAR)  # the same episodes by hand in a fresh env (the same random draws): always action 2
    want = []
    for i in range(2):
        env.reset(seed=5 + i)
        steps, done = 0, False
        while not done:
            _, _, term, trunc, _ = env.step(2)
            steps, done = steps + 1, term or trunc
        want.append(steps)
    assert report.version == 3 and list(report.lengths) == want

    class Recording(TorchPolicy):  # what the CNN is shown at each step
        seen: list[np.ndarray] = []

        def log_probs(self, obs: np.ndarray) -> np.ndarray:
            self.seen.append(obs.copy())
            return super().log_probs(obs)

    policy = Recording(policy_for(settings).model)  # type: ignore[union-attr]
    policy.load(cnn_blob(2, action=2))
    recorded = _Observations(build_env(MINATAR))
    _, lengths = run_episodes(policy, recorded, 1, deterministic=True, seed=5)
    episode = [np.asarray(o, np.uint8) * np.uint8(255) for o in recorded.seen]  # MinAtar's booleans as 0/255
    assert len(policy.seen) == lengths[0] == len(episode) - 1 and lengths[0] > 1
    for t, stack in enumerate(policy.seen):  # [1, K=2, 10, 10, 4]: the previous frame (zeros at the start), this one
        assert stack.shape == (1, 2, 10, 10, 4) and stack.dtype == np.uint8
        np.testing.assert_array_equal(stack[0, 1], episode[t])
        np.testing.assert_array_equal(stack[0, 0], episode[t - 1] if t > 0 else np.zeros_like(episode[0]))
    assert any((stack[0, 0] != stack[0, 1]).any() for stack in policy.seen[1:])  # the frames do change

    stochastic = policy_for(settings)
    stochastic.load(cnn_blob(2, seed=1))
    env.close()
    runs = []
    for _ in range(2):  # each in a fresh env: MinAtar's own draws (sticky actions) do not restart at reset(seed)
        env = build_env(MINATAR)
        runs.append(run_episodes(stochastic, env, 2, deterministic=False, seed=3))
        env.close()
    assert runs[0] == runs[1] and all(n > 0 for n in runs[0][1])
