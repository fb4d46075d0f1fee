"""The wire format of a rollout fragment: Kafka headers + a safetensors payload. Never pickle.

A fragment is ``T`` steps of ``N`` vectorised envs made by one sampler with one policy version.
:func:`encode_fragment` turns it into ``(headers, payload)``; :func:`decode_fragment` validates a
record and raises one typed error, :class:`FragmentError`, whose ``reason`` is a short code (it
goes into the dead-letter header) and whose message names what is wrong.

Reason codes: ``ambiguous_header`` (a required header twice, or another Flywheel header twice with
different values), ``missing_header``, ``unknown_schema``, ``bad_header`` (a header value out of its
format: policy-version, created-at, a sample id that is not 1-64 ASCII letters and digits),
``env_mismatch``, ``oversize``, ``undecodable``, ``missing_tensor``, ``bad_shape``, ``bad_dtype``,
``non_finite``, ``out_of_range``, ``bad_value``.

Image observations (schema 3, ``docs/pixels.md``): observations are uint8 single frames (never stacked
copies: ``obs_history`` carries the ``frame_stack - 1`` frames before the first step and
:func:`stack_frames` rebuilds the stacks), the payload may be zstd-compressed (header
``flywheel-encoding: zstd``; its decompressed size is bounded, ``oversize`` past it), and a fragment
that would exceed the topic's limit is split along time into fragments that each stand alone
(:func:`encode_fitting`), with :class:`FragmentTooLarge` only when a single step cannot fit.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field

import numpy as np
import zstandard
from safetensors import SafetensorError
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from shared.credits import H_SAMPLER_SEQ
from shared.identity import IDENTITY_HEADERS

SCHEMA_VERSION = "3"
"""3: observations in the spec's dtype (uint8 images or float32), an ``obs_history`` tensor for frame
stacking and optional zstd compression of the payload. 2: the action space is part of the schema
(continuous actions are float32 ``[T, N, *A]``). Samplers write schema 2, byte for byte as before, for a
fragment that needs nothing of 3 (float32 observations, no stacking, no compression); readers accept 2
and 3. Schema 1 fragments (discrete only) come from samplers older than the trainer that reads them."""
LEGACY_SCHEMA_VERSION = "2"
ACCEPTED_SCHEMAS = frozenset((LEGACY_SCHEMA_VERSION, SCHEMA_VERSION))
CONTENT_TYPE = "application/vnd.flywheel.fragment+safetensors"

H_SCHEMA = "flywheel-schema"
H_SAMPLE_ID = "sample-id"
H_SAMPLER_ID = "sampler-id"
H_POLICY_VERSION = "policy-version"
H_ENV_ID = "env-id"
H_CREATED_AT = "created-at"
H_CONTENT_TYPE = "content-type"
H_ENCODING = "flywheel-encoding"
"""Schema 3: ``zstd`` when the payload is a zstd frame around the safetensors blob (absent: not compressed)."""
ENCODINGS = ("zstd",)
REQUIRED_HEADERS = (H_SCHEMA, H_SAMPLE_ID, H_SAMPLER_ID, H_POLICY_VERSION, H_ENV_ID, H_CREATED_AT)
FLYWHEEL_HEADERS = frozenset((*REQUIRED_HEADERS, H_CONTENT_TYPE, H_ENCODING, H_SAMPLER_SEQ, *IDENTITY_HEADERS))
"""Headers whose meaning Flywheel defines: one value each (a required one may appear only once; another
may repeat only with the same value). Headers of other names are ignored."""
MAX_SAMPLE_ID_BYTES = 64
"""Longest sample id accepted. Sample ids are ASCII letters and digits (samplers write 32 hex digits):
within what ``GET /trace/{sample_id}`` accepts (alphanumeric, at most 64), so every fragment can be traced."""
_SAMPLE_ID_CHARS = frozenset("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")

Headers = list[tuple[str, bytes]]


class FragmentTooLarge(ValueError):
    """A single env step does not fit the topic's message limit: no split can help (the sampler's
    fatal configuration error: raise ``kafka.max_message_bytes`` or shrink ``env.num_envs``)."""


class FragmentError(ValueError):
    """A record is not a valid fragment. ``reason`` is a stable short code for counting."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


@dataclass(frozen=True)
class FragmentSpec:
    """What a consumer expects of fragments: the env's observation shape and its action space."""

    obs_shape: tuple[int, ...]
    num_actions: int
    """Discrete actions: how many there are. Continuous actions: 0 (unused)."""
    max_bytes: int = 4 * 1024 * 1024
    env_id: str | None = None
    """The run's env: a fragment from another env is refused (None: not checked)."""
    max_abs_value: float = 1e6
    """Largest magnitude accepted in observations, rewards and returns. Finite but huge values (3e38)
    pass a finiteness check and still turn the weights NaN; no sane env emits them."""
    action_shape: tuple[int, ...] = ()
    """``()``: discrete actions (int64 ``[T, N]``). Otherwise the shape ``A`` of a Box action space:
    continuous actions, float32 ``[T, N, *A]``, the unclipped Gaussian samples (they may lie outside the
    env's bounds, which only the sampler applies when it steps the env)."""
    obs_dtype: str = "float32"
    """``float32``, or ``uint8`` for image observations (frames, 0-255; schema 3 only)."""
    frame_stack: int = 1
    """Frames the policy sees per step (``K``); fragments carry single frames and ``K - 1`` history frames."""
    max_decoded_bytes: int = 256 * 1024 * 1024
    """Largest decompressed payload accepted (a small zstd frame can claim gigabytes)."""

    @property
    def continuous(self) -> bool:
        return bool(self.action_shape)

    @property
    def action_dim(self) -> int:
        """Width of the policy head: the action count (discrete) or the flattened action size (continuous)."""
        return int(np.prod(self.action_shape)) if self.continuous else self.num_actions


@dataclass
class Fragment:
    """``T`` steps x ``N`` envs of experience. Shapes below; obs dims ``*O``."""

    obs: np.ndarray  # float32 | uint8 [T, N, *O]  observation (a single frame) before each action
    actions: np.ndarray  # int64 [T, N] discrete action | float32 [T, N, *A] unclipped Gaussian sample
    logp: np.ndarray  # float32 [T, N]  log-prob (continuous: log-density) of the action under the behaviour policy
    rewards: np.ndarray  # float32 [T, N]
    terminated: np.ndarray  # uint8 [T, N]  1 where the episode ended in a terminal state
    truncated: np.ndarray  # uint8 [T, N]  1 where it was cut by a time limit (bootstrap!)
    trunc_obs: np.ndarray  # obs dtype [D, *O]  final obs of each truncated step, row-major (t, n) order
    last_obs: np.ndarray  # obs dtype [N, *O]  observation after the last step (bootstrap)
    episode_returns: np.ndarray  # float32 [K]  returns of the episodes that ended in this fragment
    episode_lengths: np.ndarray  # int32 [K]
    policy_version: int
    sampler_id: str
    env_id: str
    sample_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created_at: float = field(default_factory=time.time)
    obs_history: np.ndarray | None = None  # obs dtype [K-1, N, *O]  frames before obs[0], oldest first (zeros
    # before an episode's first frame); None: no stacking (K = 1). Schema 3 only.

    @property
    def steps(self) -> int:
        """Env steps in this fragment (T x N)."""
        return int(self.rewards.size)


_TENSORS: dict[str, np.dtype] = {
    "obs": np.dtype(np.float32),  # schema 3: the spec's obs dtype (also trunc_obs, last_obs, obs_history)
    "actions": np.dtype(np.int64),  # discrete; continuous actions are float32 (_dtypes)
    "logp": np.dtype(np.float32),
    "rewards": np.dtype(np.float32),
    "terminated": np.dtype(np.uint8),
    "truncated": np.dtype(np.uint8),
    "trunc_obs": np.dtype(np.float32),
    "last_obs": np.dtype(np.float32),
    "episode_returns": np.dtype(np.float32),
    "episode_lengths": np.dtype(np.int32),
}
_OBS_TENSORS = ("obs", "trunc_obs", "last_obs", "obs_history")
OBS_DTYPES = ("float32", "uint8")
ZSTD_LEVEL = 3
"""zstd level of compressed payloads (docs/pixels.md has the measured sizes and decode cost)."""


def _dtypes(continuous: bool, obs_dtype: str = "float32", history: bool = False) -> dict[str, np.dtype]:
    """The payload's tensors and their dtypes for an action space, an observation dtype and (schema 3)
    the frame-stacking history tensor."""
    dtypes = {**_TENSORS, "actions": np.dtype(np.float32)} if continuous else dict(_TENSORS)
    if history:
        dtypes["obs_history"] = np.dtype(obs_dtype)
    for name in _OBS_TENSORS:
        if name in dtypes:
            dtypes[name] = np.dtype(obs_dtype)
    return dtypes


def encode_fragment(frag: Fragment, compression: str | None = None) -> tuple[Headers, bytes]:
    """Kafka headers and safetensors payload for ``frag`` (float actions are continuous ones; uint8
    observations are frames). Schema 2, unchanged, unless the fragment needs schema 3: uint8 frames, a
    frame-stacking history, or ``compression`` (``"zstd"``)."""
    if compression is not None and compression not in ENCODINGS:
        raise ValueError(f"compression={compression!r}: want None or one of {ENCODINGS}")
    obs_dtype = "uint8" if frag.obs.dtype == np.uint8 else "float32"
    v3 = compression is not None or obs_dtype != "float32" or frag.obs_history is not None
    dtypes = _dtypes(bool(np.issubdtype(frag.actions.dtype, np.floating)), obs_dtype, history=v3)
    tensors = {}
    for name, dt in dtypes.items():
        value = getattr(frag, name)
        if value is None:  # obs_history of an unstacked fragment: no rows
            value = np.zeros((0, *frag.last_obs.shape), dt)
        tensors[name] = np.ascontiguousarray(value, dtype=dt)
    payload = st_save(tensors)
    if compression == "zstd":
        payload = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(payload)  # writes the content size
    headers: Headers = [
        (H_SCHEMA, (SCHEMA_VERSION if v3 else LEGACY_SCHEMA_VERSION).encode()),
        (H_SAMPLE_ID, frag.sample_id.encode()),
        (H_SAMPLER_ID, frag.sampler_id.encode()),
        (H_POLICY_VERSION, str(frag.policy_version).encode()),
        (H_ENV_ID, frag.env_id.encode()),
        (H_CREATED_AT, repr(frag.created_at).encode()),
        (H_CONTENT_TYPE, CONTENT_TYPE.encode()),
    ]
    if compression is not None:
        headers.append((H_ENCODING, compression.encode()))
    return headers, payload


def split_fragment(frag: Fragment) -> tuple[Fragment, Fragment]:
    """The first and the second half of ``frag``'s steps (``T >= 2``), each a valid fragment on its own:
    the first bootstraps from the second's first observation, the second's frame history is the first's
    last frames, and truncation observations and finished episodes go with the step that produced them.
    Concatenating the halves' per-step tensors gives back ``frag``'s. Each half gets a fresh sample id."""
    steps = frag.rewards.shape[0]
    if steps < 2:
        raise ValueError(f"a fragment of {steps} step cannot be split")
    cut = steps // 2
    done = (np.asarray(frag.terminated, bool) | np.asarray(frag.truncated, bool))
    n_trunc = int(np.asarray(frag.truncated, bool)[:cut].sum())
    n_eps = int(done[:cut].sum())
    history_len = 0 if frag.obs_history is None else frag.obs_history.shape[0]
    second_history = None
    if frag.obs_history is not None:
        # The K-1 frames before step ``cut``, with zeros before an episode's first frame (the stacking rule).
        frames = np.concatenate([frag.obs_history, frag.obs[:cut]])[-history_len:].copy() if history_len else \
            frag.obs_history[:0]
        for j in range(history_len):  # frames[j] is step cut - history_len + j
            step = cut - history_len + j
            ended_after = done[max(step, 0):cut].any(axis=0)  # an episode ended at or after that frame
            frames[j][ended_after] = 0
        second_history = frames

    def part(sl: slice, trunc: slice, eps: slice, last_obs: np.ndarray, history: np.ndarray | None) -> Fragment:
        return Fragment(obs=frag.obs[sl], actions=frag.actions[sl], logp=frag.logp[sl], rewards=frag.rewards[sl],
                        terminated=frag.terminated[sl], truncated=frag.truncated[sl],
                        trunc_obs=frag.trunc_obs[trunc], last_obs=last_obs,
                        episode_returns=frag.episode_returns[eps], episode_lengths=frag.episode_lengths[eps],
                        policy_version=frag.policy_version, sampler_id=frag.sampler_id, env_id=frag.env_id,
                        created_at=frag.created_at, obs_history=history)

    first = part(slice(0, cut), slice(0, n_trunc), slice(0, n_eps), frag.obs[cut], frag.obs_history)
    second = part(slice(cut, steps), slice(n_trunc, None), slice(n_eps, None), frag.last_obs, second_history)
    return first, second


def encode_fitting(frag: Fragment, max_bytes: int, compression: str | None = None
                   ) -> list[tuple[Fragment, Headers, bytes]]:
    """``frag`` encoded as one record, or split in time (:func:`split_fragment`, recursively) into as many
    as it takes for every payload to stay within ``max_bytes`` (the topic's message limit less the
    headers' share). Raises :class:`FragmentTooLarge` when a single step does not fit."""
    headers, payload = encode_fragment(frag, compression)
    if len(payload) <= max_bytes:
        return [(frag, headers, payload)]
    if frag.rewards.shape[0] < 2:
        raise FragmentTooLarge(
            f"one step of {frag.rewards.shape[1]} envs encodes to {len(payload)} bytes, over the limit of "
            f"{max_bytes} (kafka.max_message_bytes less header room): raise kafka.max_message_bytes, "
            f"lower env.num_envs or turn on sampler.compression")
    first, second = split_fragment(frag)
    return encode_fitting(first, max_bytes, compression) + encode_fitting(second, max_bytes, compression)


def header_dict(headers: Headers | None) -> dict[str, str]:
    """Headers as text; undecodable values become a replacement-marked string. A repeated name keeps its
    last value: for logging only; :func:`decode_fragment` refuses records whose identity is ambiguous."""
    return {k: v.decode("utf-8", "replace") if v is not None else "" for k, v in (headers or [])}


def check_unambiguous(headers: Headers | None) -> None:
    """Raise ``FragmentError("ambiguous_header")`` naming the header if a required header appears more
    than once (even with the same value: which copy is the identity must never depend on the reader), or
    another Flywheel header appears more than once with different values."""
    first: dict[str, bytes | None] = {}
    for name, value in headers or []:
        if name not in FLYWHEEL_HEADERS:
            continue
        if name in first and (name in REQUIRED_HEADERS or first[name] != value):
            raise FragmentError("ambiguous_header", f"header {name!r} appears more than once "
                                f"({_short(first[name])} and {_short(value)}); a fragment has one identity")
        first.setdefault(name, value)


def _short(value: bytes | None, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def check_sample_id(sample_id: str) -> None:
    """Raise ``FragmentError("bad_header")`` unless ``sample_id`` is 1 to :data:`MAX_SAMPLE_ID_BYTES` ASCII
    letters and digits."""
    if len(sample_id.encode("utf-8", "replace")) > MAX_SAMPLE_ID_BYTES:
        raise FragmentError("bad_header", f"sample-id is {len(sample_id.encode('utf-8', 'replace'))} bytes long, "
                            f"the limit is {MAX_SAMPLE_ID_BYTES}")
    if not sample_id or not set(sample_id) <= _SAMPLE_ID_CHARS:
        raise FragmentError("bad_header", f"sample-id {sample_id!r} must be ASCII letters and digits only")


def decode_fragment(headers: Headers | None, payload: bytes | None, spec: FragmentSpec) -> Fragment:
    """Validate and decode one record, or raise :class:`FragmentError` (never anything else: a record
    that breaks the decoder in an unforeseen way is poison too, reason ``undecodable``)."""
    try:
        return _decode(headers, payload, spec)
    except FragmentError:
        raise
    except Exception as exc:  # e.g. a safetensors dtype numpy lacks (BF16) raises KeyError inside load
        raise FragmentError("undecodable", f"payload could not be decoded: {type(exc).__name__}: {exc}") from None


def _decode(headers: Headers | None, payload: bytes | None, spec: FragmentSpec) -> Fragment:
    check_unambiguous(headers)
    h = header_dict(headers)
    schema = h.get(H_SCHEMA)
    if schema is None:
        raise FragmentError("missing_header", f"header {H_SCHEMA!r} is missing")
    if schema not in ACCEPTED_SCHEMAS:
        hint = ""
        if schema.isdigit() and int(schema) < int(LEGACY_SCHEMA_VERSION):
            hint = (f": schema {schema} fragments come from samplers older than this trainer; "
                    f"run samplers of the trainer's release (they write schema {SCHEMA_VERSION})")
        raise FragmentError("unknown_schema", f"schema version {schema!r} is not supported "
                            f"(want {LEGACY_SCHEMA_VERSION} or {SCHEMA_VERSION}){hint}")
    for name in REQUIRED_HEADERS:
        if not h.get(name):
            raise FragmentError("missing_header", f"header {name!r} is missing or empty")
    check_sample_id(h[H_SAMPLE_ID])
    try:
        version = int(h[H_POLICY_VERSION])
        created_at = float(h[H_CREATED_AT])
    except ValueError as exc:
        raise FragmentError("bad_header", f"policy-version/created-at not numeric: {exc}") from None
    if version < 0:
        raise FragmentError("bad_header", f"policy-version must be >= 0, got {version}")
    if not math.isfinite(created_at):
        raise FragmentError("bad_header", f"created-at must be a finite unix time, got {h[H_CREATED_AT]!r}")
    if spec.env_id is not None and h[H_ENV_ID] != spec.env_id:
        raise FragmentError("env_mismatch", f"fragment is from env {h[H_ENV_ID]!r}, this run trains {spec.env_id!r}")
    if payload is None:
        raise FragmentError("undecodable", "record has no payload")
    if len(payload) > spec.max_bytes:
        raise FragmentError("oversize", f"payload of {len(payload)} bytes exceeds the limit of {spec.max_bytes}")
    encoding = h.get(H_ENCODING)
    if encoding is not None:
        if schema != SCHEMA_VERSION or encoding not in ENCODINGS:
            raise FragmentError("bad_header", f"{H_ENCODING} {encoding!r} with schema {schema}: want one of "
                                f"{ENCODINGS} with schema {SCHEMA_VERSION}")
        payload = _decompress(payload, spec.max_decoded_bytes)
    try:
        tensors = st_load(payload)
    except (SafetensorError, ValueError, TypeError) as exc:
        raise FragmentError("undecodable", f"payload is not a safetensors blob: {exc}") from None
    _check_tensors(tensors, spec, v3=schema == SCHEMA_VERSION)
    history = tensors.get("obs_history")
    return Fragment(
        **{name: tensors[name] for name in _TENSORS},  # the same names for both action kinds
        policy_version=version,
        sampler_id=h[H_SAMPLER_ID],
        env_id=h[H_ENV_ID],
        sample_id=h[H_SAMPLE_ID],
        created_at=created_at,
        obs_history=history if history is not None and history.shape[0] else None,
    )


def _decompress(payload: bytes, limit: int) -> bytes:
    """The zstd frame's content, refusing frames that do not declare their size or declare more than ``limit``."""
    try:
        size = zstandard.frame_content_size(payload)
        if size < 0:
            raise FragmentError("undecodable", "zstd frame does not declare its content size")
        if size > limit:
            raise FragmentError("oversize", f"payload decompresses to {size} bytes, over the limit of {limit}")
        out = zstandard.ZstdDecompressor().decompress(payload, max_output_size=limit)
    except zstandard.ZstdError as exc:
        raise FragmentError("undecodable", f"payload is not a zstd frame: {exc}") from None
    if len(out) != size:
        raise FragmentError("undecodable", f"zstd frame declared {size} bytes and held {len(out)}")
    return out


def _check_tensors(t: dict[str, np.ndarray], spec: FragmentSpec, v3: bool = False) -> None:
    dtypes = _dtypes(spec.continuous, spec.obs_dtype, history=v3 or spec.frame_stack > 1)
    missing = sorted(set(dtypes) - set(t))
    if missing:
        raise FragmentError("missing_tensor", f"payload lacks tensors {missing}")
    extra = sorted(set(t) - set(dtypes))
    if extra:
        raise FragmentError("bad_shape", f"payload has unexpected tensors {extra}")
    for name, dt in dtypes.items():
        if t[name].dtype != dt:
            raise FragmentError("bad_dtype", f"tensor {name!r} has dtype {t[name].dtype}, want {dt}")
    a = t["actions"]
    if a.ndim != 2 + len(spec.action_shape) or 0 in a.shape[:2]:
        raise FragmentError("bad_shape", f"tensor 'actions' must be [T, N, *{spec.action_shape}] with T, N > 0, "
                            f"got {a.shape}")
    steps, envs = a.shape[:2]
    n_trunc = int(t["truncated"].sum())
    n_eps = t["episode_returns"].shape[0] if t["episode_returns"].ndim == 1 else -1
    want = {
        "obs": (steps, envs, *spec.obs_shape),
        "actions": (steps, envs, *spec.action_shape),
        "logp": (steps, envs),
        "rewards": (steps, envs),
        "terminated": (steps, envs),
        "truncated": (steps, envs),
        "trunc_obs": (n_trunc, *spec.obs_shape),
        "last_obs": (envs, *spec.obs_shape),
        "obs_history": (spec.frame_stack - 1, envs, *spec.obs_shape),
        "episode_returns": (n_eps,),
        "episode_lengths": (n_eps,),
    }
    for name, shape in want.items():
        if name in t and tuple(t[name].shape) != shape:
            raise FragmentError("bad_shape", f"tensor {name!r} has shape {tuple(t[name].shape)}, want {shape}")
    floats = tuple(n for n in ("obs", "logp", "rewards", "trunc_obs", "last_obs", "obs_history", "episode_returns")
                   if n in t and t[n].dtype.kind == "f")  # uint8 frames are finite and bounded by their type
    for name in ("actions", *floats) if spec.continuous else floats:
        if not np.isfinite(t[name]).all():
            raise FragmentError("non_finite", f"tensor {name!r} holds NaN or infinite values")
        if t[name].size and float(np.abs(t[name]).max()) > spec.max_abs_value:
            raise FragmentError("out_of_range", f"tensor {name!r} holds a value of magnitude "
                                f"{float(np.abs(t[name]).max()):.3g} > {spec.max_abs_value:g}")
    if not spec.continuous:
        # Probabilities are at most 1; a Gaussian density can exceed 1, so continuous log-probs may be positive.
        if (t["logp"] > 1e-5).any():
            raise FragmentError("bad_value", "tensor 'logp' holds positive log-probabilities")
        if a.min() < 0 or a.max() >= spec.num_actions:
            raise FragmentError("bad_value", f"actions outside [0, {spec.num_actions}): min {a.min()}, max {a.max()}")
    for name in ("terminated", "truncated"):
        if t[name].max() > 1:
            raise FragmentError("bad_value", f"tensor {name!r} must hold only 0 or 1")
