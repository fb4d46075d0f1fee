"""The update converts its batch of frames once (``ActorCritic.prepare``) and gathers each minibatch's rows of it
(``services.trainer.update.rows``), where each minibatch used to convert its own frames again: the same numbers in
the same memory layout, so an update trains bit for bit as before, in float32 and in bf16 autocast.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pytest
import torch

from services.trainer.compute import probe_fragments
from services.trainer.learner import Learner
from services.trainer.update import rows
from shared.fragment import Fragment, FragmentSpec
from shared.rl.model import ActorCritic, ImageActorCritic
from shared.settings import TrainerSettings

PONG = FragmentSpec(obs_shape=(36, 36), num_actions=6, max_bytes=1 << 24, env_id="ALE/Pong-v5", obs_dtype="uint8",
                    frame_stack=4)
"""The Nature CNN's shapes but for the frame size (36x36, the smallest its convolutions take: a fast test)."""
MINATAR = FragmentSpec(obs_shape=(10, 10, 4), num_actions=3, max_bytes=1 << 22, env_id="MinAtar/Breakout-v1",
                       obs_dtype="uint8")
CHW = FragmentSpec(obs_shape=(2, 12, 12), num_actions=3, max_bytes=1 << 22, env_id="Synthetic-v0", obs_dtype="uint8",
                   frame_stack=2)
MLP = FragmentSpec(obs_shape=(6,), num_actions=3, max_bytes=1 << 22, env_id="Synthetic-v0")


def _torso_input(model: ImageActorCritic, obs: torch.Tensor) -> torch.Tensor:
    """What ``_features`` hands the torso (the per-pass conversion), captured with a hook."""
    seen: list[torch.Tensor] = []
    hook = model.torso.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    try:
        with torch.no_grad():
            model._features(obs)
    finally:
        hook.remove()
    return seen[0]


@pytest.mark.parametrize("spec, model_name, channels_last", [
    (PONG, "nature_cnn", True), (PONG, "nature_cnn", False), (MINATAR, "minatar_cnn", False),
    (CHW, "minatar_cnn", False)])
def test_prepare_gives_the_torso_input_of_every_pass_bit_for_bit_in_its_layout(
        spec: FragmentSpec, model_name: str, channels_last: bool) -> None:
    model = ActorCritic.for_spec(spec, 64, model=model_name)
    assert isinstance(model, ImageActorCritic)
    model.channels_last_input = channels_last
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, (7, spec.frame_stack, *spec.obs_shape), dtype=np.uint8)
    frames.reshape(-1)[:256] = np.arange(256, dtype=np.uint8)  # every byte value
    obs = torch.from_numpy(frames.reshape(7, -1))
    want = _torso_input(model, obs)
    got = model.prepare(obs)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert got.stride() == want.stride()  # the convolutions' kernels (and rounding) follow the layout
    assert torch.equal(got, want)
    assert torch.equal(model.prepare(obs, torch.bfloat16), want.to(torch.bfloat16))
    assert model.prepare(obs, torch.bfloat16).stride() == want.stride()
    actions = torch.arange(7) % spec.num_actions
    idx = torch.tensor([5, 0, 3])
    with torch.no_grad():
        for a, b in zip(model.evaluate(rows(got, idx), actions[idx], prepared=True), model.evaluate(obs[idx],
                                                                                                   actions[idx]),
                        strict=True):
            assert torch.equal(a, b)
        assert torch.equal(model.value(got, prepared=True), model.value(obs))


def test_rows_gathers_what_indexing_does_and_keeps_the_nhwc_layout() -> None:
    x = torch.rand(9, 4, 6, 5).contiguous(memory_format=torch.channels_last)
    idx = torch.tensor([8, 1, 1, 4])
    got = rows(x, idx)
    assert torch.equal(got, x[idx]) and got.is_contiguous(memory_format=torch.channels_last)
    flat = torch.rand(9, 7)
    assert torch.equal(rows(flat, idx), flat[idx]) and torch.equal(rows(flat[:, 0], idx), flat[idx, 0])


def test_the_mlp_prepares_float32_and_ignores_the_autocast_dtype() -> None:
    model = ActorCritic.for_spec(MLP, 16)
    obs = torch.arange(12, dtype=torch.float64).reshape(2, 6)
    got = model.prepare(obs, torch.bfloat16)
    assert got.dtype == torch.float32 and torch.equal(got, obs.float())


def _unprepared(model: ActorCritic, monkeypatch: pytest.MonkeyPatch) -> None:
    """``model`` as the update ran it before ``prepare``: the batch as float32 frames, converted in every pass."""
    evaluate, value = model.evaluate, model.value

    def old_evaluate(obs: torch.Tensor, actions: torch.Tensor, prepared: bool = False) -> Any:
        return evaluate(obs, actions)

    def old_value(obs: torch.Tensor, prepared: bool = False) -> torch.Tensor:
        return value(obs)

    monkeypatch.setattr(model, "prepare", lambda obs, dtype=None: obs.to(torch.float32))
    monkeypatch.setattr(model, "evaluate", old_evaluate)
    monkeypatch.setattr(model, "value", old_value)


def _fragments(spec: FragmentSpec) -> list[Fragment]:
    frags = probe_fragments(spec, 2, steps=12, envs=3, seed=4)
    for f in frags:  # episode ends, so that stacks restart and bootstrap rows are there
        f.terminated[4, 1] = 1
    return frags


def _digest(learner: Learner) -> str:
    h = hashlib.sha256()
    for t in learner.model.state_dict().values():
        h.update(t.detach().numpy().tobytes())
    for state in learner.optimizer.state_dict()["state"].values():
        for t in state.values():
            h.update(t.numpy().tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("spec", [PONG, MINATAR, MLP], ids=["nature_cnn", "minatar_cnn", "mlp"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_an_update_on_the_prepared_batch_trains_bit_for_bit_as_converting_every_minibatch(
        spec: FragmentSpec, precision: str, monkeypatch: pytest.MonkeyPatch) -> None:
    frags = _fragments(spec)
    out = []
    for old in (False, True):
        with monkeypatch.context() as m:
            learner = Learner(spec, TrainerSettings(model="auto", precision=precision, epochs=2, minibatches=3, seed=7,
                                                    ent_coef=0.01))
            if old:
                _unprepared(learner.model, m)
            stats = [learner.update(frags) for _ in range(2)]
            out.append((_digest(learner), stats))
    (new_digest, new_stats), (old_digest, old_stats) = out
    assert new_digest == old_digest
    assert new_stats == old_stats
