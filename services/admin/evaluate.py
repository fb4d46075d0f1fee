"""``flywheel eval``: run a published policy version in its env and report its return.

The policy is the samplers' own (:class:`shared.rl.policy_np.NumpyPolicy`, built from the run's settings as
``RolloutWorker.from_settings`` builds it), loaded from the blob the store keeps for the version, so what is
evaluated is exactly what the samplers act with. Image envs (docs/pixels.md) run the CNN of ``trainer.model`` in
torch (:class:`shared.rl.policy_torch.TorchPolicy`; samplers may run the same graph in onnxruntime, whose
log-probs agree to 1e-5) on the last ``env.frame_stack`` frames, stacked as the samplers stack them, in the env
built as the samplers build it (MinAtar and ALE registration, Atari preprocessing).

Stochastic by default (as the samplers act); with ``deterministic`` the action is the most likely one (discrete:
the argmax of the logits) or the Gaussian's mean (continuous), clipped to the action space's bounds as the
samplers clip theirs.

Video (``--video DIR``): one file per episode through gymnasium's ``RecordVideo`` when moviepy is installed
(``pip install -e '.[video]'``), else the frames as PNG files, ``DIR/episode-<i>/frame-<t>.png``, and the report
says which. Needs an env that renders ``rgb_array`` (the classic-control ones need pygame).

Reads the store only (never writes: an unreadable marker is reported, not repaired), except the audit entry of a
policy refused for its signature (docs/security.md). No print here: the CLI prints.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

import gymnasium as gym
import numpy as np

from shared.logging import get_logger
from shared.marker import VersionedStore, VersionRecord
from shared.retry import describe
from shared.rl.arch import PolicyArch, sampler_policy
from shared.rl.envs import as_observation, env_options, fragment_spec, register_image_envs
from shared.rl.frames import FrameStacker
from shared.rl.policy_np import NumpyPolicy
from shared.rl.policy_onnx import OnnxPolicy
from shared.runtime import AuditLog
from shared.settings import Settings
from shared.signing import PolicyVerifier, Refusals, SignatureRefused, record_audit_params

if TYPE_CHECKING:
    from shared.rl.policy_torch import TorchPolicy

SamplerPolicy: TypeAlias = "NumpyPolicy | TorchPolicy"
"""The numpy MLP, or a CNN in torch (imported only for image envs)."""


class EvalError(RuntimeError):
    """The evaluation cannot run as asked (no such version, weights that do not fit, no way to record video);
    the message says what to do."""


# ---- which weights ---------------------------------------------------------------------------------
def find_version(policies: VersionedStore, version: int | None) -> VersionRecord:
    """The record of ``version`` (None: the published one). Read-only: an unreadable marker raises (``BadMarker``)
    instead of being repaired. Raises :class:`LookupError` when there is no such version."""
    if version is None:
        current = policies.read_marker(repair=False)
        if current is None:
            raise LookupError(f"no policy is published under {policies.prefix} yet (is the run name right?)")
        return current[0]
    kept = policies.records()
    found = [r for r in kept if r.version == version]
    if not found:
        have = ", ".join(str(r.version) for r in kept[-20:]) or "none"
        raise LookupError(f"version {version} is not kept under {policies.prefix} (kept: {have})")
    return found[-1]


def load_version(policies: VersionedStore, version: int | None,
                 verifier: PolicyVerifier | None = None) -> tuple[VersionRecord, bytes]:
    """:func:`find_version`'s record and its checked blob. :class:`~shared.signing.SignatureRefused` when
    ``verifier`` refuses the record (before the blob is read)."""
    record = find_version(policies, version)
    if verifier is not None:
        verifier.check_record(record)
    return record, policies.fetch(record)


def load_trusted(settings: Settings, policies: VersionedStore, version: int | None,
                 actor: str = "operator@cli") -> tuple[VersionRecord, bytes]:
    """:func:`load_version` for ``eval`` and ``export``: with signing on, a record without paramsync's valid
    signature is refused: logged, counted, audited (``policy_signature_refused``, best effort: the only write
    these commands make), then :class:`~shared.signing.SignatureRefused` is raised (the CLI exits 1)."""
    record = find_version(policies, version)
    try:
        PolicyVerifier.from_settings(settings).check_record(record)
    except SignatureRefused as exc:
        source = "marker" if version is None else "history"
        log = get_logger()
        Refusals("admin", log).note_record(exc, record, source, command="eval/export")
        try:
            AuditLog(policies.store, settings.run).append(actor, "policy_signature_refused",
                                                         record_audit_params(exc, record, source),
                                                         "refused: not evaluated nor exported")
        except Exception as audit_exc:  # the refusal stands either way
            log.warning("audit_write_failed", action="policy_signature_refused", error=describe(audit_exc))
        raise
    return record, policies.fetch(record)


def policy_for(settings: Settings) -> SamplerPolicy:
    """An empty policy shaped as the run's samplers build theirs (env, width, normalisation, gSDE; for image envs
    the CNN of ``trainer.model`` over ``env.frame_stack`` frames)."""
    spec = fragment_spec(settings.env.id, max_bytes=1 << 30, frame_stack=settings.env.frame_stack)
    arch = PolicyArch.of(settings.trainer)
    # the samplers' own builder; torch rather than onnxruntime for a CNN, so export can trace its module
    policy = sampler_policy(spec, arch, "torch" if arch.is_cnn(spec) else "numpy")
    assert not isinstance(policy, OnnxPolicy)  # the two backends asked for
    return policy


def loaded_policy(settings: Settings, record: VersionRecord, blob: bytes) -> SamplerPolicy:
    """:func:`policy_for` with ``blob`` loaded; :class:`EvalError` when the settings do not describe the blob."""
    try:
        policy = policy_for(settings)
    except ValueError as exc:  # a model the env cannot have (e.g. a CNN torso that does not fit its frames)
        raise EvalError(f"{exc}; pass the run's --config") from None
    try:
        policy.load(blob)
    except ValueError as exc:  # WeightsError: the run's settings do not describe this blob
        t = settings.trainer
        what = (f"trainer.model={t.model!r}, env.frame_stack={policy.frame_stack}"
                if not isinstance(policy, NumpyPolicy) else
                f"trainer.hidden={t.hidden}, trainer.normalize_observations={t.normalize_observations}, "
                f"trainer.gsde={t.gsde}")  # trainer.activation cannot show in a misfit: the blob does not hold it
        raise EvalError(f"version {record.version} does not fit the model for {settings.env.id} with {what} "
                        f"({exc}); pass the run's --config") from None
    return policy


def build_env(env_id: str, **kwargs: Any) -> gym.Env[Any, Any]:
    """``env_id`` as the samplers build it (image envs registered, ALE games preprocessed), one copy."""
    register_image_envs(env_id)
    options, wrappers = env_options(env_id)
    env: gym.Env[Any, Any] = gym.make(env_id, **options, **kwargs)
    for wrap in wrappers:
        env = wrap(env)
    return env


def action_bounds(space: gym.Space[Any]) -> tuple[np.ndarray, np.ndarray] | None:
    """``(low, high)`` of a Box action space (actions are clipped to them), None for a discrete one."""
    return (space.low, space.high) if isinstance(space, gym.spaces.Box) else None


# ---- acting ----------------------------------------------------------------------------------------
def choose(policy: SamplerPolicy, obs: np.ndarray, bounds: tuple[np.ndarray, np.ndarray] | None,
           rng: np.random.Generator | None) -> Any:
    """The env action for one observation (a CNN's: the frame stack ``[K, *O]``, :func:`run_episodes`): sampled
    as the samplers sample (``rng`` given) or the deterministic one (``rng`` None: argmax / mean); continuous
    actions clipped to ``bounds``."""
    if not isinstance(policy, NumpyPolicy):  # a CNN, discrete actions
        stack = np.asarray(obs)[None]
        if rng is None:
            return int(np.argmax(policy.log_probs(stack)[0]))
        return int(policy.act(stack, rng)[0][0])
    x = np.asarray(obs, np.float32).reshape(1, -1)
    if rng is None:
        out = policy.logits(x)[0]
        if not policy.continuous:
            return int(np.argmax(out))
        action = out
    else:
        sampled, _ = policy.act(x, rng)
        if not policy.continuous:
            return int(sampled[0])
        action = sampled[0]
    action = action.reshape(bounds[0].shape) if bounds is not None else action
    return np.clip(action, *bounds) if bounds is not None else action


@dataclass(frozen=True)
class EvalReport:
    """Per-episode returns and lengths of one evaluation."""

    version: int
    env_id: str
    deterministic: bool
    returns: tuple[float, ...]
    lengths: tuple[int, ...]
    video: str | None = None
    """Where and how episodes were recorded, in words (None: not recorded)."""
    trainer_step: int | None = None
    """The trainer update that produced the weights."""

    @property
    def mean(self) -> float:
        return float(np.mean(self.returns))

    @property
    def std(self) -> float:
        """Population standard deviation over episodes (as Stable-Baselines3's ``evaluate_policy``)."""
        return float(np.std(self.returns))

    def lines(self) -> list[str]:
        mode = "deterministic" if self.deterministic else "stochastic"
        n = len(self.returns)
        step = "" if self.trainer_step is None else f" (trainer update {self.trainer_step})"
        out = [f"policy version {self.version}{step} on {self.env_id}, {n} episode{'s' if n != 1 else ''}, {mode}",
               f"return {self.mean:.2f} ± {self.std:.2f}  (min {min(self.returns):.2f}, max {max(self.returns):.2f})",
               f"length {float(np.mean(self.lengths)):.1f} mean  (min {min(self.lengths)}, max {max(self.lengths)})"]
        if self.video:
            out.append(f"video: {self.video}")
        return out

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "trainer_step": self.trainer_step, "env_id": self.env_id,
                "deterministic": self.deterministic,
                "episodes": len(self.returns), "return_mean": self.mean, "return_std": self.std,
                "return_min": min(self.returns), "return_max": max(self.returns),
                "length_mean": float(np.mean(self.lengths)), "returns": list(self.returns),
                "lengths": list(self.lengths), "video": self.video}


def run_episodes(policy: SamplerPolicy, env: gym.Env[Any, Any], episodes: int, *, deterministic: bool,
                 seed: int | None) -> tuple[list[float], list[int]]:
    """``episodes`` whole episodes in ``env``; episode ``i`` resets with seed ``seed + i`` (None: unseeded).
    Returns the undiscounted return and the length of each. A CNN sees what a sampler's sees: uint8 frames
    (booleans as 0/255), the last ``frame_stack`` of them, zeros before the episode's first
    (:class:`~shared.rl.frames.FrameStacker`)."""
    stack = None if isinstance(policy, NumpyPolicy) else policy.frame_stack
    if episodes < 1:
        raise ValueError(f"episodes must be >= 1, got {episodes}")
    rng = None if deterministic else np.random.default_rng(seed)
    bounds = action_bounds(env.action_space)
    returns: list[float] = []
    lengths: list[int] = []
    for i in range(episodes):
        obs, _ = env.reset(seed=None if seed is None else seed + i)
        stacker = None if stack is None else FrameStacker(as_observation(obs, "uint8")[None], stack)
        total, steps, done = 0.0, 0, False
        while not done:
            seen = obs if stacker is None else stacker.stacks[0]
            obs, reward, terminated, truncated, _ = env.step(choose(policy, seen, bounds, rng))
            if stacker is not None:
                stacker.push(as_observation(obs, "uint8")[None], np.zeros(1, bool))
            total += float(reward)
            steps += 1
            done = bool(terminated or truncated)
        returns.append(total)
        lengths.append(steps)
    return returns, lengths


# ---- video -----------------------------------------------------------------------------------------
def write_png(path: Path, frame: np.ndarray) -> None:
    """An RGB ``[H, W, 3]`` uint8 frame as a PNG file (zlib only: no imaging library needed)."""
    if frame.ndim != 3 or frame.shape[2] != 3:
        raise ValueError(f"expected an RGB frame [H, W, 3], got shape {frame.shape}")
    h, w, _ = frame.shape
    raw = b"".join(b"\x00" + np.ascontiguousarray(frame[y], np.uint8).tobytes() for y in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))
    path.write_bytes(png)


class PngFrames(gym.Wrapper[Any, Any, Any, Any]):
    """Writes every rendered frame of every episode as ``<dir>/episode-<i>/frame-<t>.png`` (the fallback
    when moviepy, which ``RecordVideo`` needs, is not installed)."""

    def __init__(self, env: gym.Env[Any, Any], directory: Path) -> None:
        super().__init__(env)
        self.directory = directory
        self.episode = -1
        self.frame = 0

    def _save(self) -> None:
        frame = self.env.render()
        if isinstance(frame, np.ndarray):
            write_png(self.directory / f"episode-{self.episode}" / f"frame-{self.frame:05d}.png", frame)
            self.frame += 1

    def reset(self, **kwargs: Any) -> Any:
        out = self.env.reset(**kwargs)
        self.episode += 1
        self.frame = 0
        (self.directory / f"episode-{self.episode}").mkdir(parents=True, exist_ok=True)
        self._save()
        return out

    def step(self, action: Any) -> Any:
        out = self.env.step(action)
        self._save()
        return out


def _moviepy_available() -> bool:
    try:
        import moviepy  # noqa: F401
    except ImportError:
        return False
    return True


def make_env(env_id: str, video_dir: Path | None, name_prefix: str,
             moviepy_available: Callable[[], bool] = _moviepy_available) -> tuple[gym.Env[Any, Any], str | None]:
    """The env to evaluate in, wrapped to record every episode when ``video_dir`` is given; and how the
    video is recorded, in words. Raises :class:`EvalError` when the env cannot render ``rgb_array`` frames."""
    if video_dir is None:
        return build_env(env_id), None
    env = build_env(env_id, render_mode="rgb_array")
    if "rgb_array" not in (env.metadata.get("render_modes") or []):
        env.close()
        raise EvalError(f"{env_id} does not render rgb_array frames: no video (run without --video)")
    try:
        env.reset(seed=0)
        probe = env.render()
    except gym.error.DependencyNotInstalled as exc:
        env.close()
        raise EvalError(f"--video: {exc} (classic-control envs: pip install -e '.[video]')") from None
    if not isinstance(probe, np.ndarray):
        env.close()
        raise EvalError(f"{env_id} rendered {type(probe).__name__}, not an rgb_array frame: no video")
    if moviepy_available():  # RecordVideo makes the directory
        wrapped = gym.wrappers.RecordVideo(env, str(video_dir), episode_trigger=lambda _: True,
                                           name_prefix=name_prefix, disable_logger=True)
        return wrapped, f"{video_dir}/{name_prefix}-episode-<i>.mp4 (one file per episode)"
    return PngFrames(env, video_dir), (f"moviepy is not installed (pip install -e '.[video]'), so the frames are "
                                       f"PNG files: {video_dir}/episode-<i>/frame-<t>.png")


# ---- the command -----------------------------------------------------------------------------------
def evaluate(settings: Settings, policies: VersionedStore, version: int | None, episodes: int, *,
             deterministic: bool = False, seed: int | None = None, video_dir: Path | None = None) -> EvalReport:
    """Load ``version`` (None: the published one) and run ``episodes`` episodes of ``settings.env.id`` with it."""
    if episodes < 1:
        raise EvalError(f"--episodes must be >= 1, got {episodes}")
    record, blob = load_trusted(settings, policies, version)
    policy = loaded_policy(settings, record, blob)
    env, video = make_env(settings.env.id, video_dir, f"{settings.run}-v{record.version}")
    try:
        returns, lengths = run_episodes(policy, env, episodes, deterministic=deterministic, seed=seed)
    finally:
        env.close()
    return EvalReport(record.version, settings.env.id, deterministic, tuple(returns), tuple(lengths), video,
                      record.trainer_step)
