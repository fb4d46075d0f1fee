"""A sampler's id bound to its own key (shared.identity, issue 43 item 5): the rules of the book, the sampler
signing what it sends, and each reader refusing a record under an id bound to another key (the trainer
dead-letters the fragment and counts no credit for it; paramsync, the admin and a synchronous trainer do not
believe the heartbeat). On the in-memory bus: Kafka's own semantics are not what is tested; the red-team row in
tests/security runs the attack against the local stack's broker."""

from __future__ import annotations

import stat
import time
from pathlib import Path

import pytest
from aiokafka import TopicPartition

from services.admin.state import AdminState
from services.paramsync.service import Paramsync
from services.sampler.service import Sampler
from services.trainer.tasks import LiveSamplers
from shared.bus import MemoryBus, Record
from shared.fragment import encode_fragment
from shared.identity import (
    H_SIG,
    IdentityBook,
    IdentityCheck,
    IdentityRefused,
    SamplerKey,
    beat_message,
    fragment_message,
    identity_of,
)
from shared.messages import CreditGrant, SamplerBeat
from shared.runtime import AuditLog
from shared.settings import Settings
from tests.fragments import blank_fragment
from tests.services import running, until
from tests.unit.test_sampler_bus import publish
from tests.unit.test_trainer_bus import RUN, T, dlq_reasons, make, run_until, trained


def signed_fragment(key: SamplerKey | None, sampler_id: str = "s0", seq: str = "inc1.1",
                    ) -> tuple[list[tuple[str, bytes]], bytes]:
    headers, payload = encode_fragment(blank_fragment(0, steps=4, envs=2, sampler_id=sampler_id))
    headers.append(("sampler-seq", seq.encode()))
    if key is not None:
        headers.extend(key.headers(fragment_message(headers, payload)))
    return headers, payload


def signed_beat(key: SamplerKey | None, sampler_id: str, version: int) -> tuple[bytes, list[tuple[str, bytes]]]:
    value = SamplerBeat(id=sampler_id, policy_version=version).to_bytes()
    return value, [] if key is None else key.headers(beat_message(value))


def check(book: IdentityBook, key: SamplerKey | None, at: float, sampler_id: str = "s0") -> str | None:
    headers, payload = signed_fragment(key, sampler_id)
    return book.check(sampler_id, identity_of(headers), fragment_message(headers, payload), at)


def refusal(book: IdentityBook, key: SamplerKey | None, at: float, sampler_id: str = "s0") -> str:
    with pytest.raises(IdentityRefused) as err:
        check(book, key, at, sampler_id)
    return err.value.reason


def test_an_id_is_bound_to_the_first_key_and_refused_to_any_other_while_that_key_is_heard() -> None:
    a, b = SamplerKey.generate(), SamplerKey.generate()
    book = IdentityBook(handover_s=3.0)
    assert check(book, a, 100.0) == a.key_id
    assert book.bound("s0") == a.public_hex
    assert check(book, a, 101.0) == a.key_id
    assert refusal(book, b, 102.0) == "id_in_use"  # another key while a was heard 1 s ago
    assert refusal(book, None, 102.5) == "unsigned"  # no key at all under a bound id
    assert check(book, a, 103.5) == a.key_id  # the refusals did not move the holder's time
    assert refusal(book, b, 106.0) == "id_in_use"  # 2.5 s of silence: not yet
    assert check(book, b, 200.0) == b.key_id  # 96.5 s of silence: a restart with a fresh key takes the id
    assert book.bound("s0") == b.public_hex
    assert check(book, a, 150.0) == a.key_id  # a's backlog, made before the handover, is still its own
    assert refusal(book, a, 201.0) == "id_in_use"  # a made after it: two processes under one id
    assert check(book, None, 201.0, "s9") is None  # no key, unbound id: claims nothing, accepted
    assert book.bound("s9") is None


def test_a_signature_covers_every_header_and_the_payload() -> None:
    key = SamplerKey.generate()
    headers, payload = signed_fragment(key)
    book = IdentityBook()
    changed_payload = payload[:-1] + bytes([payload[-1] ^ 1])
    renamed = [(n, b"s1" if n == "sampler-id" else v) for n, v in headers]
    for h, p in ((headers, changed_payload), (renamed, payload)):
        with pytest.raises(IdentityRefused) as err:
            book.check("s0", identity_of(h), fragment_message(h, p), 1.0)
        assert err.value.reason == "bad_signature"
    garbled = [(n, b"zz" if n == H_SIG else v) for n, v in headers]
    with pytest.raises(IdentityRefused) as err:
        book.check("s0", identity_of(garbled), fragment_message(garbled, payload), 1.0)
    assert err.value.reason == "malformed"
    assert book.bound("s0") is None  # nothing refused binds
    assert book.check("s0", identity_of(headers), fragment_message(headers, payload), 1.0) == key.key_id


def test_a_kept_key_survives_a_restart_and_is_private(tmp_path: Path) -> None:
    path = tmp_path / "keys" / "sampler-0.key"
    first = SamplerKey.load_or_create(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert SamplerKey.load_or_create(path).public_hex == first.public_hex
    path.write_text("not a key\n")
    with pytest.raises(ValueError, match="sampler.identity_key_file"):
        SamplerKey.load_or_create(path)


def sampler_settings(tmp_path: Path, **sampler: object) -> Settings:
    return Settings.model_validate({
        "run": RUN, "store": {"backend": "local", "local_root": str(tmp_path)},
        "env": {"num_envs": 2, "fragment_steps": 4},
        "sampler": {"sync_interval_s": 0.2, "heartbeat_interval_s": 0.1, **sampler},
    })


async def test_a_sampler_signs_every_fragment_and_heartbeat_with_the_key_it_keeps(tmp_path: Path) -> None:
    mem = MemoryBus()
    mem.create(T.samples, 2)
    kept = tmp_path / "sampler-keys" / "s-1.key"
    sampler = Sampler(sampler_settings(tmp_path, identity_key_file=str(kept), credits=False,
                                       max_fragments_per_s=50), "s-1", bus=mem.bus())
    publish(sampler, 0)
    async with running(sampler) as task:
        await until(lambda: len(mem.records(T.samples)) >= 3 and len(mem.records(T.heartbeats)) >= 2, task)
    book, beats = IdentityBook(), IdentityBook()
    for r in mem.records(T.samples):
        assert book.check("s-1", identity_of(r.headers), fragment_message(r.headers, r.value), time.time()) == \
            sampler.identity.key_id  # type: ignore[union-attr]
    for r in mem.records(T.heartbeats):
        assert beats.check("s-1", identity_of(r.headers), beat_message(r.value or b""), time.time()) is not None
    assert book.bound("s-1") == SamplerKey.load_or_create(kept).public_hex  # the restart's key is this one
    off = Sampler(sampler_settings(tmp_path / "off", identity=False), "s-2", bus=MemoryBus().bus())
    assert off.identity is None and off.sender.identity is None


async def test_the_trainer_dead_letters_a_fragment_under_a_held_id_and_counts_it_for_nobody(tmp_path: Path) -> None:
    owner, intruder = SamplerKey.generate(), SamplerKey.generate()
    t, mem = make(tmp_path, flow_window=6)
    for n in (1, 2):
        headers, payload = signed_fragment(owner, seq=f"own.{n}")
        mem.append(T.samples, payload, headers=headers, partition=0)
    for key, seq in ((intruder, "evil.1"), (None, "evil.2")):  # another key, then none, under s0
        headers, payload = signed_fragment(key, seq=seq)
        mem.append(T.samples, payload, headers=headers, partition=0)
    for n in (3, 4):
        headers, payload = signed_fragment(owner, seq=f"own.{n}")
        mem.append(T.samples, payload, headers=headers, partition=0)

    def grants() -> list[CreditGrant]:
        return [CreditGrant.model_validate_json(r.value or b"") for r in mem.records(T.credits)]

    await run_until(t, lambda: trained(t) == 4 and any(g.consumed.get("s0/own") == 4 for g in grants())
                    and mem.committed.get(TopicPartition(T.samples, 0)) == 6)
    assert dlq_reasons(mem) == ["sampler_identity", "sampler_identity"]
    assert all("s0/evil" not in g.consumed for g in grants())  # no credit, no incarnation of s0 for the intruder
    entries = [e for e in AuditLog(t.store, RUN).entries() if e.action == "sampler_identity_refused"]
    assert [(e.params["reason"], e.params["key_id"]) for e in entries] == [
        ("id_in_use", intruder.key_id), ("unsigned", None)]
    assert all(e.params["sampler_id"] == "s0" and e.params["kind"] == "fragment" for e in entries)
    # Committed past the refused ones: dead-lettered is their outcome.


def beat_record(key: SamplerKey | None, sampler_id: str, version: int, offset: int) -> Record:
    value, headers = signed_beat(key, sampler_id, version)
    return Record(TopicPartition(T.heartbeats, 0), offset, sampler_id.encode(), value, headers,
                  int(time.time() * 1000))


async def test_heartbeats_under_a_held_id_move_no_reader(tmp_path: Path) -> None:
    owner, intruder = SamplerKey.generate(), SamplerKey.generate()
    settings = sampler_settings(tmp_path)
    admin = AdminState(settings, bus=MemoryBus().bus())
    paramsync = Paramsync(settings, bus=MemoryBus().bus())
    live = LiveSamplers(IdentityCheck("trainer", admin.log, settings.sampler.identity_handover_s))
    own, forged = beat_record(owner, "s0", 7, 0), beat_record(intruder, "s0", 99, 1)
    ghost = beat_record(intruder, "s-new", 1, 2)  # an id nobody holds: trust on first use binds it (a known limit)
    for rec in (own, forged):
        admin.observe(rec.value or b"", rec.timestamp_ms / 1000, rec.headers)
        await paramsync._on_inbox(rec)
    assert admin.view.samplers["s0"].beat.policy_version == 7
    assert {sid: s.version for sid, s in paramsync.tracker.samplers.items()} == {"s0": 7}
    live.saw([own, forged, ghost], time.monotonic(), 10.0)
    assert live.live(time.monotonic(), 10.0) == {"s0", "s-new"}
    paramsync_entries = [e for e in AuditLog(paramsync.policies.store, RUN).entries()
                         if e.action == "sampler_identity_refused"]
    assert [(e.params["kind"], e.params["key_id"]) for e in paramsync_entries] == [("heartbeat", intruder.key_id)]


def test_a_binding_silent_for_the_forget_horizon_is_forgotten() -> None:
    a, b = SamplerKey.generate(), SamplerKey.generate()
    book = IdentityBook(handover_s=3.0, forget_s=600.0)
    assert check(book, a, 0.0) == a.key_id
    assert check(book, a, 30.0, "s1") == a.key_id  # another id, keeps the book busy
    assert book.bound("s0") == a.public_hex
    check(book, b, 700.0, "s2")  # 700 s on: s0 (last heard at 0) and s1 (30) are forgotten at the next sweep
    assert book.bound("s0") is None and book.bound("s1") is None and book.bound("s2") == b.public_hex
