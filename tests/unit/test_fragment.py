import numpy as np
import pytest
from safetensors.numpy import save as st_save

from shared.fragment import (
    H_SCHEMA,
    Fragment,
    FragmentError,
    FragmentSpec,
    decode_fragment,
    encode_fragment,
)

SPEC = FragmentSpec(obs_shape=(4,), num_actions=2, max_bytes=1 << 20)


def make_fragment(steps: int = 5, envs: int = 3) -> Fragment:
    rng = np.random.default_rng(0)
    truncated = np.zeros((steps, envs), np.uint8)
    truncated[2, 1] = 1
    return Fragment(
        obs=rng.normal(size=(steps, envs, 4)).astype(np.float32),
        actions=rng.integers(0, 2, size=(steps, envs)),
        logp=np.full((steps, envs), -0.69, np.float32),
        rewards=np.ones((steps, envs), np.float32),
        terminated=np.zeros((steps, envs), np.uint8),
        truncated=truncated,
        trunc_obs=rng.normal(size=(1, 4)).astype(np.float32),
        last_obs=rng.normal(size=(envs, 4)).astype(np.float32),
        episode_returns=np.array([12.0], np.float32),
        episode_lengths=np.array([12], np.int32),
        policy_version=3,
        sampler_id="s-1",
        env_id="CartPole-v1",
    )


def test_round_trip() -> None:
    frag = make_fragment()
    headers, payload = encode_fragment(frag)
    back = decode_fragment(headers, payload, SPEC)
    assert back.sample_id == frag.sample_id and back.policy_version == 3 and back.sampler_id == "s-1"
    np.testing.assert_array_equal(back.obs, frag.obs)
    np.testing.assert_array_equal(back.actions, frag.actions)
    assert back.steps == 15


def _tensors(frag: Fragment) -> dict[str, np.ndarray]:
    from shared.fragment import _TENSORS

    return {n: np.ascontiguousarray(getattr(frag, n), dtype=d) for n, d in _TENSORS.items()}


def _with(frag: Fragment, **changes: np.ndarray) -> bytes:
    t = _tensors(frag)
    t.update(changes)
    return st_save(t)


@pytest.mark.parametrize(("schema", "match"), [
    (b"99", "schema version '99' is not supported \\(want 2 or 3\\)$"),
    # Schema 1 (discrete only) is what samplers before continuous actions wrote: say so and how to fix it.
    (b"1", "schema version '1' is not supported.*older than this trainer.*samplers of the trainer's release"),
])
def test_unknown_schema_version(schema: bytes, match: str) -> None:
    headers, payload = encode_fragment(make_fragment())
    headers = [(k, schema if k == H_SCHEMA else v) for k, v in headers]
    with pytest.raises(FragmentError, match=match) as e:
        decode_fragment(headers, payload, SPEC)
    assert e.value.reason == "unknown_schema"


@pytest.mark.parametrize("name", ["flywheel-schema", "sample-id", "sampler-id", "policy-version", "env-id"])
def test_missing_header(name: str) -> None:
    headers, payload = encode_fragment(make_fragment())
    with pytest.raises(FragmentError, match=name) as e:
        decode_fragment([h for h in headers if h[0] != name], payload, SPEC)
    assert e.value.reason == "missing_header"


def test_garbage_payload() -> None:
    headers, _ = encode_fragment(make_fragment())
    with pytest.raises(FragmentError, match="not a safetensors blob") as e:
        decode_fragment(headers, b"\x00garbage\xff" * 10, SPEC)
    assert e.value.reason == "undecodable"


def test_wrong_shape() -> None:
    frag = make_fragment()
    headers, _ = encode_fragment(frag)
    bad = _with(frag, obs=np.zeros((5, 3, 7), np.float32))
    with pytest.raises(FragmentError, match=r"'obs' has shape \(5, 3, 7\), want \(5, 3, 4\)") as e:
        decode_fragment(headers, bad, SPEC)
    assert e.value.reason == "bad_shape"


def test_wrong_dtype() -> None:
    frag = make_fragment()
    headers, _ = encode_fragment(frag)
    bad = _with(frag, rewards=np.ones((5, 3), np.float64))
    with pytest.raises(FragmentError, match="'rewards' has dtype float64") as e:
        decode_fragment(headers, bad, SPEC)
    assert e.value.reason == "bad_dtype"


def test_non_finite() -> None:
    frag = make_fragment()
    headers, _ = encode_fragment(frag)
    rewards = np.ones((5, 3), np.float32)
    rewards[1, 1] = np.nan
    with pytest.raises(FragmentError, match="'rewards' holds NaN") as e:
        decode_fragment(headers, _with(frag, rewards=rewards), SPEC)
    assert e.value.reason == "non_finite"


def test_oversize() -> None:
    headers, payload = encode_fragment(make_fragment())
    with pytest.raises(FragmentError, match="exceeds the limit of 100") as e:
        decode_fragment(headers, payload, FragmentSpec((4,), 2, max_bytes=100))
    assert e.value.reason == "oversize"


def test_action_out_of_range() -> None:
    frag = make_fragment()
    headers, _ = encode_fragment(frag)
    with pytest.raises(FragmentError, match="actions outside") as e:
        decode_fragment(headers, _with(frag, actions=np.full((5, 3), 9, np.int64)), SPEC)
    assert e.value.reason == "bad_value"


def test_missing_tensor() -> None:
    frag = make_fragment()
    headers, _ = encode_fragment(frag)
    t = _tensors(frag)
    del t["logp"]
    with pytest.raises(FragmentError, match="lacks tensors") as e:
        decode_fragment(headers, st_save(t), SPEC)
    assert e.value.reason == "missing_tensor"


# ---- poison records: each raises the typed error (the trainer dead-letters it), never anything else ----
def _raw_safetensors(tensors: dict[str, tuple[str, list[int], bytes]]) -> bytes:
    """A safetensors blob written by hand, so dtypes numpy cannot make (BF16) can be tested."""
    import json
    import struct

    header: dict[str, object] = {}
    data = b""
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    blob = json.dumps(header).encode()
    return struct.pack("<Q", len(blob)) + blob + data


def test_unknown_dtype_is_a_typed_error_not_a_crash() -> None:
    headers, _ = encode_fragment(make_fragment())
    payload = _raw_safetensors({"rewards": ("BF16", [5, 3], b"\x00\x3f" * 15)})
    with pytest.raises(FragmentError) as err:
        decode_fragment(headers, payload, SPEC)
    assert err.value.reason in ("undecodable", "bad_dtype", "missing_tensor")


@pytest.mark.parametrize("value", [3e38, -1e7])
def test_huge_finite_values_are_refused(value: float) -> None:
    frag = make_fragment()
    headers, _ = encode_fragment(frag)
    rewards = np.ones((5, 3), np.float32)
    rewards[1, 1] = value
    with pytest.raises(FragmentError) as err:
        decode_fragment(headers, _with(frag, rewards=rewards), SPEC)
    assert err.value.reason == "out_of_range" and "'rewards'" in str(err.value)


@pytest.mark.parametrize("created_at", [b"nan", b"inf", b"-inf"])
def test_non_finite_created_at_is_refused(created_at: bytes) -> None:
    headers, payload = encode_fragment(make_fragment())
    headers = [(k, created_at if k == "created-at" else v) for k, v in headers]
    with pytest.raises(FragmentError) as err:
        decode_fragment(headers, payload, SPEC)
    assert err.value.reason == "bad_header" and "created-at" in str(err.value)


def test_env_mismatch_is_refused() -> None:
    headers, payload = encode_fragment(make_fragment())
    spec = FragmentSpec(obs_shape=(4,), num_actions=2, max_bytes=1 << 20, env_id="Acrobot-v1")
    with pytest.raises(FragmentError) as err:
        decode_fragment(headers, payload, spec)
    assert err.value.reason == "env_mismatch" and "CartPole-v1" in str(err.value)


# ---- continuous actions: float32 [T, N, *A], unclipped, log-densities may be positive ----
CSPEC = FragmentSpec(obs_shape=(3,), num_actions=0, max_bytes=1 << 20, action_shape=(2,))


def make_continuous(steps: int = 5, envs: int = 3) -> Fragment:
    rng = np.random.default_rng(1)
    return Fragment(
        obs=rng.normal(size=(steps, envs, 3)).astype(np.float32),
        actions=(3.0 * rng.normal(size=(steps, envs, 2))).astype(np.float32),  # beyond Pendulum's [-2, 2] too
        logp=np.full((steps, envs), 1.5, np.float32),  # a narrow Gaussian's density exceeds 1
        rewards=-np.ones((steps, envs), np.float32),
        terminated=np.zeros((steps, envs), np.uint8),
        truncated=np.zeros((steps, envs), np.uint8),
        trunc_obs=np.zeros((0, 3), np.float32),
        last_obs=rng.normal(size=(envs, 3)).astype(np.float32),
        episode_returns=np.zeros(0, np.float32),
        episode_lengths=np.zeros(0, np.int32),
        policy_version=1, sampler_id="s-1", env_id="Pendulum-v1",
    )


def test_continuous_round_trip() -> None:
    frag = make_continuous()
    assert CSPEC.continuous and CSPEC.action_dim == 2 and not SPEC.continuous and SPEC.action_dim == 2
    back = decode_fragment(*encode_fragment(frag), CSPEC)
    assert back.actions.dtype == np.float32 and back.actions.shape == (5, 3, 2) and back.steps == 15
    np.testing.assert_array_equal(back.actions, frag.actions)
    np.testing.assert_array_equal(back.logp, frag.logp)


@pytest.mark.parametrize(
    ("actions", "reason", "match"),
    [
        (np.zeros((5, 3, 2), np.int64), "bad_dtype", "'actions' has dtype int64, want float32"),
        (np.zeros((5, 3, 3), np.float32), "bad_shape", r"'actions' has shape \(5, 3, 3\), want \(5, 3, 2\)"),
        (np.zeros((5, 3), np.float32), "bad_shape", r"'actions' must be \[T, N, \*\(2,\)\]"),
        (np.full((5, 3, 2), np.nan, np.float32), "non_finite", "'actions' holds NaN"),
        (np.full((5, 3, 2), 1e9, np.float32), "out_of_range", "'actions' holds a value of magnitude"),
    ],
)
def test_bad_continuous_actions_are_refused(actions: np.ndarray, reason: str, match: str) -> None:
    frag = make_continuous()
    headers, _ = encode_fragment(frag)
    with pytest.raises(FragmentError, match=match) as e:
        decode_fragment(headers, _with_dtypes(frag, actions=actions), CSPEC)
    assert e.value.reason == reason


def test_continuous_log_densities_must_be_finite() -> None:
    frag = make_continuous()
    headers, _ = encode_fragment(frag)
    with pytest.raises(FragmentError, match="'logp' holds NaN") as e:
        decode_fragment(headers, _with_dtypes(frag, logp=np.full((5, 3), np.inf, np.float32)), CSPEC)
    assert e.value.reason == "non_finite"


def test_action_kinds_do_not_mix() -> None:
    """A continuous fragment sent to a discrete run (and the reverse) is refused by dtype."""
    with pytest.raises(FragmentError, match="'actions' has dtype float32, want int64") as e:
        decode_fragment(*encode_fragment(make_continuous()), SPEC)
    assert e.value.reason == "bad_dtype"
    with pytest.raises(FragmentError, match="'actions' has dtype int64, want float32"):
        decode_fragment(*encode_fragment(make_fragment()), FragmentSpec((4,), 0, action_shape=(2,)))


def _with_dtypes(frag: Fragment, **changes: np.ndarray) -> bytes:
    t = {n: getattr(frag, n) for n in ("obs", "actions", "logp", "rewards", "terminated", "truncated", "trunc_obs",
                                        "last_obs", "episode_returns", "episode_lengths")}
    t.update(changes)
    return st_save({k: np.ascontiguousarray(v) for k, v in t.items()})


# ---- identity: one unambiguous, bounded sample id -----------------------------------------------------

@pytest.mark.parametrize("name", ["flywheel-schema", "sample-id", "sampler-id", "policy-version", "env-id",
                                  "created-at"])
def test_a_required_header_twice_is_ambiguous_even_with_the_same_value(name: str) -> None:
    headers, payload = encode_fragment(make_fragment())
    value = dict(headers)[name]
    for second in (value, b"1" + value):  # an identical copy, then a second identity
        with pytest.raises(FragmentError, match=f"header '{name}' appears more than once") as e:
            decode_fragment([*headers, (name, second)], payload, SPEC)
        assert e.value.reason == "ambiguous_header"


def test_a_second_sample_id_cannot_hide_behind_the_first() -> None:
    # The record a review trained: a valid fragment with a second sample-id header appended. A reader
    # keeping one value would de-duplicate on whichever copy it kept.
    first, _ = encode_fragment(make_fragment())
    headers, payload = encode_fragment(make_fragment())
    sid = dict(first)["sample-id"]
    with pytest.raises(FragmentError) as e:
        decode_fragment([(k, v) for k, v in headers] + [("sample-id", sid)], payload, SPEC)
    assert e.value.reason == "ambiguous_header" and "sample-id" in str(e.value)


def test_optional_flywheel_headers_may_repeat_only_with_the_same_value() -> None:
    headers, payload = encode_fragment(make_fragment())
    ok = [*headers, ("content-type", dict(headers)["content-type"]), ("sampler-seq", b"ab.1"), ("sampler-seq", b"ab.1")]
    assert decode_fragment(ok, payload, SPEC).policy_version == 3
    with pytest.raises(FragmentError, match="'sampler-seq' appears more than once") as e:
        decode_fragment([*headers, ("sampler-seq", b"ab.1"), ("sampler-seq", b"ab.2")], payload, SPEC)
    assert e.value.reason == "ambiguous_header"
    # Headers Flywheel does not define are not its business (tracing, brokers' own).
    assert decode_fragment([*headers, ("traceparent", b"a"), ("traceparent", b"b")], payload, SPEC)


@pytest.mark.parametrize(("sample_id", "match"), [
    ("a" * 65, "65 bytes long, the limit is 64"),
    ("f" * 10_000, "10000 bytes long"),
    ("abc-def", "ASCII letters and digits only"),
    ("abc def", "ASCII letters and digits only"),
    ("ab\u00e9c", "ASCII letters and digits only"),
    ("../../etc", "ASCII letters and digits only"),
])
def test_sample_ids_are_bounded_and_plain(sample_id: str, match: str) -> None:
    frag = make_fragment()
    frag.sample_id = sample_id
    headers, payload = encode_fragment(frag)
    with pytest.raises(FragmentError, match=match) as e:
        decode_fragment(headers, payload, SPEC)
    assert e.value.reason == "bad_header"


@pytest.mark.parametrize("sample_id", ["a" * 64, "0", "DeadBeef42"])
def test_sample_ids_up_to_64_letters_and_digits_pass(sample_id: str) -> None:
    frag = make_fragment()
    frag.sample_id = sample_id
    assert decode_fragment(*encode_fragment(frag), SPEC).sample_id == sample_id
