"""Signed candidates, policies and checkpoints (docs/security.md, "Signed policies"): Ed25519 with one key per role.
The trainer signs candidates and checkpoints, paramsync publishes only candidates the trainer signed and signs what
it publishes; keys by reference with rotation (``flywheel keys``); the start-up checks (only the trainer and
paramsync hold a private key); and every reader refusing what is unsigned or badly signed: paramsync (a candidate,
a marker at start, a kept record a rollback would republish), a sampler (announcements and the marker), the
trainer's announcement reader (a forged version never becomes "published"), its restore (a checkpoint of another
run, or unsigned), the admin's /status, ``eval`` and ``export``. A refusal is not acted on, is logged, counted and,
where the reader may write the audit trail, audited. Also: /status reports a behaviour version ahead of the
published one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiokafka import TopicPartition

from services.admin import cli
from services.admin.app import create_app
from services.admin.evaluate import evaluate, load_trusted
from services.admin.export import export_version
from services.admin.rollbacks import RollbackRequests, new_request_id
from services.admin.state import AdminState
from services.paramsync.rollbacks import republish
from services.paramsync.service import CANDIDATES, Paramsync
from services.sampler.service import Sampler
from services.trainer.learner import Learner
from services.trainer.service import Trainer
from shared.bus import MemoryBus, Record
from shared.kafka import Topics
from shared.keyfile import (
    PrivateKeyEntry,
    PublicKeyEntry,
    parse_private_key,
    parse_public_keys,
    read_private_key,
    read_public_keys,
)
from shared.marker import VersionedStore, VersionRecord
from shared.messages import KEY_ANNOUNCE, KEY_CANDIDATE, PolicyMessage, SamplerBeat
from shared.rl.envs import fragment_spec
from shared.rollback import RollbackRequest
from shared.runtime import AuditLog
from shared.settings import ConfigError, Settings, load_settings
from shared.signing import (
    REFUSED,
    KeyRing,
    PolicyVerifier,
    SignatureRefused,
    Signer,
    append_public,
    generate_keys,
    new_key,
    public_of,
    retire_key,
    rotate_key,
    startup_problem,
    write_private,
)
from shared.store import open_store
from tests.services import running, until

RUN = "r"
T = Topics.for_run(RUN)
TRAINER = new_key("trainer", "trainer-1")[0]
PARAMSYNC = new_key("paramsync", "paramsync-1")[0]
PARAMSYNC_2 = new_key("paramsync", "paramsync-2")[0]  # the next paramsync key of a rotation
STRANGER = new_key("trainer", "trainer-x")[0]  # a trainer key nobody lists
IMPOSTOR = new_key("paramsync", "paramsync-1")[0]  # paramsync's key id, another key


def pub(private: PrivateKeyEntry) -> PublicKeyEntry:
    return PublicKeyEntry(private.key_id, private.role, public_of(private.seed))


def rec(version: int = 3, sha: str = "ab" * 32, **extra: Any) -> VersionRecord:
    return VersionRecord(version=version, blob=f"{RUN}/policy/blobs/{sha}.safetensors", sha256=sha, size=100,
                         trainer_step=7, created_at=1.0, extra=dict(extra))


def signer(private: PrivateKeyEntry = PARAMSYNC, run: str = RUN) -> Signer:
    """A process holding ``private`` (its ring lists its own public key)."""
    return Signer(run, KeyRing({private.key_id: pub(private)}, private))


def verifier(*listed: PrivateKeyEntry, run: str = RUN) -> PolicyVerifier:
    """A reader listing the public halves of ``listed`` (default: the run's trainer and paramsync keys)."""
    return PolicyVerifier(run, KeyRing({p.key_id: pub(p) for p in listed or (TRAINER, PARAMSYNC)}))


def refused_reason(check: Callable[[], None]) -> str:
    with pytest.raises(SignatureRefused) as info:
        check()
    return info.value.reason


def candidate(record: VersionRecord, by: PrivateKeyEntry | None = TRAINER) -> PolicyMessage:
    msg = PolicyMessage.of("candidate", record)
    return msg if by is None else signer(by).sign_message(msg)


# ---- sign and verify ----------------------------------------------------------------------------
def test_a_signed_record_and_its_announcement_verify() -> None:
    signed = signer().sign_record(rec(lineage=2, rollback_of=1))
    v = verifier()
    v.check_record(signed)
    msg = PolicyMessage.of("announce", signed)
    assert msg.key_id == "paramsync-1" and msg.signature == signed.extra["signature"]["ed25519"]
    v.check_message(msg)
    v.check_message(PolicyMessage.model_validate_json(msg.to_bytes()))  # survives the wire
    v.check_record(PolicyMessage.model_validate_json(msg.to_bytes()).record())  # a sampler installs msg.record()
    v.check_message(signer().sign_message(PolicyMessage.of("announce", rec())))


def test_a_trainer_signed_candidate_verifies_and_rides_on_the_published_record_apart() -> None:
    msg = candidate(rec(version=4, lineage=2))
    assert msg.key_id == "trainer-1" and msg.signature
    v = verifier()
    v.check_candidate(msg)
    v.check_candidate(PolicyMessage.model_validate_json(msg.to_bytes()))  # survives the wire
    # msg.record() (what paramsync publishes) keeps it apart from paramsync's own signature: it is not one.
    record = msg.record()
    assert "signature" not in record.extra
    assert record.extra["candidate_signature"] == {"key_id": "trainer-1", "ed25519": msg.signature}
    assert refused_reason(lambda: v.check_record(record)) == "unsigned"
    published = signer().sign_record(record)
    v.check_record(published)


def test_a_changed_version_digest_size_run_or_lineage_is_refused() -> None:
    signed = signer().sign_record(rec(lineage=2, rollback_of=1))
    v = verifier()
    for changed in ({"version": 1003}, {"sha256": "cd" * 32}, {"size": 101}, {"trainer_step": 8}):
        forged = VersionRecord(**{**signed.__dict__, **changed})
        assert refused_reason(partial(v.check_record, forged)) == "bad_signature", changed
    for extra in ({"lineage": 3}, {"rollback_of": 2}, {"rollback_of": None}):
        forged = VersionRecord(**{**signed.__dict__, "extra": {**signed.extra, **extra}})
        assert refused_reason(partial(v.check_record, forged)) == "bad_signature", extra
    msg = PolicyMessage.of("announce", signed)
    assert refused_reason(lambda: v.check_message(msg.model_copy(update={"version": msg.version + 1000}))) \
        == "bad_signature"
    assert refused_reason(lambda: verifier(run="other").check_record(signed)) == "bad_signature"  # per run
    cand = candidate(rec(version=4))
    for update in ({"version": 9}, {"rollback_of": 0}, {"lineage": 9}, {"sha256": "cd" * 32}):
        assert refused_reason(partial(v.check_candidate, cand.model_copy(update=update))) == "bad_signature"


def test_a_wrong_key_a_missing_signature_and_a_removed_key_are_refused() -> None:
    v = verifier()
    # Another key under paramsync's id: its signatures do not verify with the public key listed for that id.
    assert refused_reason(lambda: v.check_record(signer(IMPOSTOR).sign_record(rec()))) == "bad_signature"
    assert refused_reason(lambda: v.check_record(rec())) == "unsigned"
    assert refused_reason(lambda: v.check_message(PolicyMessage.of("announce", rec()))) == "unsigned"
    assert refused_reason(lambda: v.check_candidate(PolicyMessage.of("candidate", rec()))) == "unsigned"
    half = PolicyMessage.of("announce", signer().sign_record(rec())).model_copy(update={"signature": None})
    assert refused_reason(lambda: v.check_message(half)) == "unsigned"
    assert refused_reason(lambda: v.check_candidate(candidate(rec(), by=STRANGER))) == "unknown_key"
    # paramsync-1 rotated out: what it signed is refused by readers that no longer list it.
    assert refused_reason(lambda: verifier(TRAINER, PARAMSYNC_2).check_record(signer().sign_record(rec()))) \
        == "unknown_key"


def test_rotation_signs_with_the_current_key_and_verifies_with_every_listed_one() -> None:
    both = verifier(TRAINER, PARAMSYNC, PARAMSYNC_2)
    old = signer().sign_record(rec(version=1))
    new = signer(PARAMSYNC_2).sign_record(rec(version=2))
    both.check_record(old)
    both.check_record(new)
    assert new.extra["signature"]["key_id"] == "paramsync-2"


def test_signing_off_checks_nothing_but_a_checkpoint_of_another_run() -> None:
    off = PolicyVerifier(RUN, None)
    off.check_record(rec())
    off.check_message(PolicyMessage.of("announce", rec()))
    off.check_candidate(PolicyMessage.of("candidate", rec()))
    off.check_checkpoint(rec())  # written before checkpoints named their run
    off.check_checkpoint(rec(run=RUN))
    assert refused_reason(lambda: off.check_checkpoint(rec(run="other"))) == "other_run"


def test_candidates_and_unsigned_announcements_encode_as_before() -> None:
    assert "key_id" not in json.loads(PolicyMessage.of("announce", rec()).to_bytes())
    signed = signer().sign_record(rec())
    assert "signature" not in json.loads(PolicyMessage.of("candidate", signed).to_bytes())


# ---- who can sign what ------------------------------------------------------------------------------
def test_a_process_without_a_private_key_cannot_sign_and_a_key_signs_only_its_roles_kinds() -> None:
    readers_ring = KeyRing({k.key_id: pub(k) for k in (TRAINER, PARAMSYNC)})  # a sampler's: public keys only
    for kind in ("policy", "candidate", "checkpoint"):
        with pytest.raises(ValueError, match="verifies only"):
            readers_ring.sign(kind, b"claims")
    with pytest.raises(ValueError, match="signing.private_key_file is required to sign"):
        Signer(RUN, readers_ring)
    # The trainer's key signs candidates and checkpoints, never the policies readers act on; paramsync's the reverse.
    with pytest.raises(ValueError, match="a trainer key does not sign policies"):
        signer(TRAINER).sign_record(rec())
    with pytest.raises(ValueError, match="a paramsync key does not sign checkpoints"):
        signer(PARAMSYNC).sign_checkpoint(rec())
    # A trainer-signed message presented as an announcement (or its signature on a record) is refused by role.
    as_announcement = candidate(rec(version=5)).model_copy(update={"type": "announce"})
    with pytest.raises(SignatureRefused, match="key 'trainer-1' is a trainer key; only a paramsync key signs policies"):
        verifier().check_message(as_announcement)
    as_record = rec(version=5, signature={"key_id": "trainer-1", "ed25519": as_announcement.signature})
    assert refused_reason(lambda: verifier().check_record(as_record)) == "wrong_role"
    # ... and paramsync's announcement presented as a candidate.
    ann = signer().sign_message(PolicyMessage.of("announce", rec(version=6)))
    assert refused_reason(lambda: verifier().check_candidate(ann.model_copy(update={"type": "candidate"}))) \
        == "wrong_role"
    # A private key must be the private half of the public key listed under its id.
    with pytest.raises(ValueError, match="not the private half"):
        KeyRing({"paramsync-1": pub(PARAMSYNC)}, IMPOSTOR)


# ---- keys by reference, start-up ------------------------------------------------------------------
def key_file(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "keys"
    path.write_text("\n".join(["# comment", "", *lines]) + "\n")
    return path


def test_the_key_files_list_ids_roles_and_hex_and_their_errors_never_echo_a_secret() -> None:
    listed = parse_public_keys(f"{pub(TRAINER).line()}\n{pub(PARAMSYNC).line()}\n")
    assert listed == {"trainer-1": pub(TRAINER), "paramsync-1": pub(PARAMSYNC)}
    assert parse_private_key(f"# mine\n{PARAMSYNC.line()}\n") == PARAMSYNC
    seed = PARAMSYNC.seed.hex()
    public = pub(PARAMSYNC).public.hex()
    for text, says in ((f"k1 paramsync {public[:16]}", "is 8 bytes"), ("k1 paramsync zz", "not hex"),
                       ("", "no key"), (f"k1 paramsync {public}\nk1 trainer {public}", "twice"),
                       (f"k1 paramsync {public} extra", "3 fields, got 4"), (f"k/1 paramsync {public}", "key id"),
                       (f"k1 sampler {public}", "role 'sampler'"), (f"k1 {seed}", "2 fields is the shared-secret")):
        with pytest.raises(ValueError, match=says) as info:
            parse_public_keys(text)
        assert "signing.keys_file" in str(info.value)
    for text, says in ((f"k1 paramsync {seed[:16]}", "is 8 bytes"), (f"k1 paramsync {seed} x", "3 fields"),
                       (f"{PARAMSYNC.line()}\n{PARAMSYNC.line()}", "exactly one key line"),
                       (f"k1 {seed}", "2 fields is the shared-secret"), (f"k1 paramsync {seed[:-1]}z", "not hex")):
        with pytest.raises(ValueError, match=says) as info:
            parse_private_key(text)
        said = str(info.value)
        assert "signing.private_key_file" in said and seed[:16] not in said and seed[-16:] not in said
    assert seed not in repr(PARAMSYNC) and seed not in repr(signer().ring) and seed not in repr(signer())


def key_dir(tmp_path: Path, *publics: PrivateKeyEntry) -> Path:
    """``public.keys`` listing the public halves of ``publics`` (default: the trainer's and paramsync's), and each
    one's private key file ``<key id>.key``."""
    path = tmp_path / "public.keys"
    if not path.exists():
        append_public(path, [pub(p).line() for p in publics or (TRAINER, PARAMSYNC)])
    for p in publics or (TRAINER, PARAMSYNC):
        write_private(tmp_path / f"{p.key_id}.key", p)
    return path


def test_settings_name_the_field_when_signing_is_on_without_usable_keys(tmp_path: Path) -> None:
    good = key_dir(tmp_path)
    hmac = key_file(tmp_path, f"r-1 {PARAMSYNC.seed.hex()}")  # the old shared-secret format
    env = {"FLYWHEEL_SIGNING_ENABLED": "true"}
    cases = [({}, "signing.keys_file is required"),
             ({"FLYWHEEL_SIGNING_KEYS_FILE": str(tmp_path / "absent")}, "signing.keys_file cannot be read"),
             ({"FLYWHEEL_SIGNING_KEYS_FILE": str(hmac)}, "signing.keys_file line 3: 2 fields is the shared-secret"),
             ({"FLYWHEEL_SIGNING_KEYS_FILE": str(good), "FLYWHEEL_SIGNING_PRIVATE_KEY_FILE": str(tmp_path / "none")},
              "signing.private_key_file cannot be read"),
             ({"FLYWHEEL_SIGNING_KEYS_FILE": str(good),
               "FLYWHEEL_SIGNING_PRIVATE_KEY_FILE": str(write_key(tmp_path, STRANGER))},
              "signing.private_key_file's key 'trainer-x' is not listed in signing.keys_file")]
    for extra, says in cases:
        with pytest.raises(ConfigError, match=says) as info:
            load_settings(None, {**env, **extra})
        assert PARAMSYNC.seed.hex() not in str(info.value) and STRANGER.seed.hex() not in str(info.value)
    with pytest.raises(ConfigError, match="signing.keys_file is set but signing.enabled=false"):
        load_settings(None, {"FLYWHEEL_SIGNING_KEYS_FILE": str(good)})
    with pytest.raises(ConfigError, match="signing.private_key_file is set but signing.enabled=false"):
        load_settings(None, {"FLYWHEEL_SIGNING_PRIVATE_KEY_FILE": str(tmp_path / "paramsync-1.key")})

    def settings(private: str | None) -> Settings:
        extra = {} if private is None else {"FLYWHEEL_SIGNING_PRIVATE_KEY_FILE": str(tmp_path / private)}
        return load_settings(None, {**env, "FLYWHEEL_SIGNING_KEYS_FILE": str(good), **extra})

    public_only, paramsyncs, trainers = settings(None), settings("paramsync-1.key"), settings("trainer-1.key")
    for reader in ("sampler", "admin"):
        assert startup_problem(reader, public_only) is None
        for holding in (paramsyncs, trainers):  # a process that only verifies must hold no private key
            assert "signing.private_key_file is set for the " + reader in str(startup_problem(reader, holding))
    assert startup_problem("paramsync", paramsyncs) is None and startup_problem("trainer", trainers) is None
    for service in ("paramsync", "trainer"):
        assert f"signing.private_key_file is required by the {service}" in str(startup_problem(service, public_only))
    assert "holds a trainer key" in str(startup_problem("paramsync", trainers))
    assert "holds a paramsync key" in str(startup_problem("trainer", paramsyncs))
    with pytest.raises(ValueError, match="signing.private_key_file is required by the paramsync"):
        Signer.from_settings(public_only, "paramsync")
    with pytest.raises(ValueError, match="holds a trainer key"):
        Signer.from_settings(trainers, "paramsync")
    assert Signer.from_settings(load_settings(None, {}), "paramsync") is None  # signing off
    for s in (public_only, paramsyncs, trainers):
        assert PARAMSYNC.seed.hex() not in s.model_dump_json() and TRAINER.seed.hex() not in s.model_dump_json()


def write_key(tmp_path: Path, private: PrivateKeyEntry) -> Path:
    path = tmp_path / f"{private.key_id}.key"
    write_private(path, private)
    return path


def test_paramsync_without_its_key_exits_2_at_start_naming_the_field(tmp_path: Path) -> None:
    good = key_dir(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    env.update(FLYWHEEL_SIGNING_ENABLED="true", FLYWHEEL_SIGNING_KEYS_FILE=str(good))
    proc = subprocess.run([sys.executable, "-m", "services.paramsync"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "signing.private_key_file is required by the paramsync" in proc.stderr


# ---- flywheel keys ------------------------------------------------------------------------------------
def test_flywheel_keys_init_keeps_its_keys_rotate_leaves_both_verifying_and_retire_spares_the_current(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "keys"
    assert cli.main(["keys", "init", "--dir", str(d)]) == 0
    trainer_key, paramsync_key, public = d / "trainer" / "trainer.key", d / "paramsync" / "paramsync.key", \
        d / "public" / "public.keys"
    for path in (trainer_key, paramsync_key):
        assert path.stat().st_mode & 0o077 == 0, path
    before = {p: p.read_text() for p in (trainer_key, paramsync_key, public)}
    old_trainer = read_private_key(trainer_key)
    assert {e.role for e in read_public_keys(public).values()} == {"trainer", "paramsync"}
    assert old_trainer.seed.hex() not in public.read_text()
    assert cli.main(["keys", "init", "--dir", str(d)]) == 0  # again (a restart): the same keys
    assert {p: p.read_text() for p in before} == before
    old_signed = Signer(RUN, KeyRing(read_public_keys(public), old_trainer)).sign_message(
        PolicyMessage.of("candidate", rec(version=1)))

    assert cli.main(["keys", "rotate", "trainer", "--dir", str(d)]) == 0
    new_trainer = read_private_key(trainer_key)
    assert new_trainer.key_id != old_trainer.key_id and new_trainer.role == "trainer"
    listed = read_public_keys(public)
    assert {old_trainer.key_id, new_trainer.key_id} <= set(listed)
    new_signed = Signer(RUN, KeyRing(listed, new_trainer)).sign_message(PolicyMessage.of("candidate", rec(version=2)))
    both = PolicyVerifier(RUN, KeyRing(listed))
    both.check_candidate(old_signed)
    both.check_candidate(new_signed)
    capsys.readouterr()

    assert cli.main(["keys", "retire", new_trainer.key_id, "--dir", str(d)]) == 1  # the trainer's current key
    assert "current key" in capsys.readouterr().err
    assert cli.main(["keys", "retire", "nobody-1", "--dir", str(d)]) == 1
    assert "not listed" in capsys.readouterr().err
    assert read_public_keys(public) == listed
    assert cli.main(["keys", "retire", old_trainer.key_id, "--dir", str(d)]) == 0
    after = PolicyVerifier(RUN, KeyRing(read_public_keys(public)))
    after.check_candidate(new_signed)
    assert refused_reason(lambda: after.check_candidate(old_signed)) == "unknown_key"
    assert cli.main(["keys", "init", "--dir", str(d)]) == 0  # the rotated directory is still a valid one
    with pytest.raises(ValueError, match="current key"):
        retire_key(d, read_private_key(paramsync_key).key_id)
    old_p, new_p = rotate_key(d, "paramsync")
    assert read_private_key(paramsync_key).key_id == new_p and {old_p, new_p} <= set(read_public_keys(public))


def test_an_old_hmac_key_file_is_refused_with_a_clear_error_naming_the_field(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "keys"
    secret = PARAMSYNC.seed.hex()
    (d / "public").mkdir(parents=True)
    (d / "public" / "public.keys").write_text(f"# policy signing keys of run r\nr-1 {secret}\n")
    assert cli.main(["keys", "init", "--dir", str(d)]) == 1
    err = capsys.readouterr().err
    assert "signing.keys_file line 2: 2 fields is the shared-secret (HMAC) format" in err and secret not in err
    with pytest.raises(ValueError, match="2 fields is the shared-secret"):
        generate_keys(d)
    assert not (d / "trainer").exists()  # nothing written next to a file it cannot read


# ---- the services on the in-memory bus ----------------------------------------------------------
def signed_settings(tmp_path: Path, role: str | None = None, **sections: Any) -> Settings:
    """Signing on with the run's public keys; ``role``: this process's own private key (trainer, paramsync)."""
    path = key_dir(tmp_path)
    signing: dict[str, Any] = {"enabled": True, "keys_file": str(path)}
    if role is not None:
        signing["private_key_file"] = str(tmp_path / f"{role}-1.key")
    return Settings.model_validate({
        "run": RUN, "store": {"backend": "local", "local_root": str(tmp_path / "store")},
        "env": {"num_envs": 2, "fragment_steps": 4}, "signing": signing, **sections})


def loadable(settings: Settings, seed: int) -> bytes:
    spec = fragment_spec(settings.env.id, 1 << 20)
    return Learner(spec, settings.trainer.model_copy(update={"seed": seed})).weights()


def stored(vs: VersionedStore, data: bytes, version: int, **extra: Any) -> VersionRecord:
    key, sha = vs.put_blob(data)
    return VersionRecord(version=version, blob=key, sha256=sha, size=len(data), trainer_step=version, extra=extra)


def publish(vs: VersionedStore, data: bytes, version: int, sign: Signer | None) -> VersionRecord:
    record = stored(vs, data, version)
    record = sign.sign_record(record) if sign is not None else record
    vs.publish_next(record)
    return record


def refused(role: str, source: str, reason: str) -> float:
    return REFUSED.labels(role=role, source=source, reason=reason)._value.get()  # type: ignore[no-any-return]


def candidates_counted(outcome: str) -> float:
    return CANDIDATES.labels(outcome=outcome)._value.get()  # type: ignore[no-any-return]


def audits(store: Any, action: str = "policy_signature_refused") -> list[Any]:
    return [e for e in AuditLog(store, RUN).entries() if e.action == action]


def messages(mem: MemoryBus, type_: str = "announce") -> list[PolicyMessage]:
    msgs = [PolicyMessage.model_validate_json(r.value or b"") for r in mem.records(T.policy)]
    return [m for m in msgs if m.type == type_]


def paramsync(tmp_path: Path, **cfg: Any) -> tuple[Paramsync, MemoryBus, VersionedStore]:
    mem = MemoryBus()
    settings = signed_settings(tmp_path, "paramsync",
                               paramsync={"heartbeat_interval_s": 0.1, "reannounce_interval_s": 60, **cfg})
    svc = Paramsync(settings, bus=mem.bus())
    return svc, mem, VersionedStore(svc.policies.store, RUN, "policy")


def published(svc: Paramsync, version: int) -> Callable[[], bool]:
    return lambda: svc.published_version == version


async def handled(mem: MemoryBus, task: asyncio.Task[None]) -> None:
    """Until paramsync has handled (and committed) every candidate appended so far."""
    end = len(mem.records(T.policy))
    await until(lambda: mem.committed.get(TopicPartition(T.policy, 0), 0) >= end, task)


async def test_paramsync_signs_the_marker_history_and_announcements_and_a_rollback(tmp_path: Path) -> None:
    svc, mem, vs = paramsync(tmp_path, reannounce_interval_s=0.3)
    v = PolicyVerifier.from_settings(svc.settings)
    async with running(svc) as task:
        mem.append(T.policy, candidate(stored(vs, loadable(svc.settings, 0), 0)).to_bytes(), key=KEY_CANDIDATE)
        await until(lambda: len(messages(mem)) >= 2, task)  # the announcement and a re-announcement
    marker = vs.read_marker()
    assert marker is not None
    v.check_record(marker[0])
    v.check_record(vs.records()[0])
    assert marker[0].extra["signature"]["key_id"] == "paramsync-1"
    assert marker[0].extra["candidate_signature"]["key_id"] == "trainer-1"  # the trainer's word, kept
    for msg in messages(mem):
        v.check_message(msg)
    assert svc.signer is not None
    publish(vs, loadable(svc.settings, 1), 1, svc.signer)
    request = RollbackRequest(request_id="r1", version=0, requested_at=1.0)
    back = republish(vs, svc.model, request, svc.signer.sign_record, v.check_record)
    v.check_record(back)
    assert back.extra["rollback_of"] == 0 and back.extra["lineage"] == back.version == 2


async def test_the_trainer_signs_its_candidates_and_paramsync_publishes_them(tmp_path: Path) -> None:
    svc, mem, vs = paramsync(tmp_path)
    trainer = Trainer(signed_settings(tmp_path, "trainer"), trainer_id="t", bus=mem.bus())
    await trainer.producer.start()
    try:
        async with running(svc) as task:
            await trainer.publication.publish(0, loadable(svc.settings, 0), 0, {}, required=True)
            await until(lambda: svc.published_version == 0, task)
    finally:
        await trainer.producer.stop()
    sent = messages(mem, "candidate")
    assert [m.key_id for m in sent] == ["trainer-1"]
    PolicyVerifier.from_settings(svc.settings).check_candidate(sent[0])
    marker = vs.read_marker()
    assert marker is not None and marker[0].extra["signature"]["key_id"] == "paramsync-1"


async def test_paramsync_publishes_only_trainer_signed_candidates_and_a_forgery_never_supersedes_one(
        tmp_path: Path) -> None:
    svc, mem, vs = paramsync(tmp_path)
    s = svc.settings
    v0 = stored(vs, loadable(s, 0), 0)
    v1 = stored(vs, loadable(s, 1), 1)
    good_v1 = candidate(v1)
    # Newer versions naming loadable weights: published (and superseding v1) were their signature not checked.
    forgeries = {
        5: candidate(stored(vs, loadable(s, 5), 5), by=None),  # no signature
        # paramsync's signature (its announcement of the same claims) on a candidate
        6: signer().sign_message(PolicyMessage.of("announce", stored(vs, loadable(s, 6), 6)))
        .model_copy(update={"type": "candidate"}),
        7: candidate(stored(vs, loadable(s, 7), 7), by=STRANGER),  # a trainer key nobody lists
        8: good_v1.model_copy(update={"version": 8}),  # the trainer's signature of v1, its version raised
    }
    before = {r: refused("paramsync", "candidate", r) for r in ("unsigned", "wrong_role", "unknown_key",
                                                                 "bad_signature")}
    counted = candidates_counted("signature_refused")
    async with running(svc) as task:
        mem.append(T.policy, candidate(v0).to_bytes(), key=KEY_CANDIDATE)
        await until(lambda: [m.version for m in messages(mem)] == [0], task)
        # One burst, read in one poll: the forged ones (all newer) around the trainer's v1.
        first = len(mem.records(T.policy))
        mem.append(T.policy, forgeries[5].to_bytes(), key=KEY_CANDIDATE)
        mem.append(T.policy, good_v1.to_bytes(), key=KEY_CANDIDATE)
        for version in (6, 7, 8):
            mem.append(T.policy, forgeries[version].to_bytes(), key=KEY_CANDIDATE)
        await handled(mem, task)
        await until(lambda: [m.version for m in messages(mem)] == [0, 1], task)
        # Read again (a re-read after a restart of the consumer): counted as candidates, logged and audited once.
        mem.append(T.policy, forgeries[5].to_bytes(), key=KEY_CANDIDATE)
        await handled(mem, task)
        await asyncio.sleep(0.1)
    marker = vs.read_marker()
    assert marker is not None and marker[0].version == 1 and marker[0].sha256 == v1.sha256
    assert [r.version for r in vs.records()] == [0, 1]
    assert [m.version for m in messages(mem)] == [0, 1] and svc.published_version == 1
    entries = audits(vs.store, "candidate_refused")
    assert [(e.params["version"], e.params["reason"], e.params["source"]) for e in entries] == [
        (5, "unsigned", "candidate"), (6, "wrong_role", "candidate"), (7, "unknown_key", "candidate"),
        (8, "bad_signature", "candidate")]
    assert all(e.actor == "paramsync" and e.outcome == "not published" for e in entries)
    assert entries[0].params["offset"] == first and entries[2].params["key_id"] == "trainer-x"
    assert candidates_counted("signature_refused") == counted + 5
    for reason, n in before.items():
        assert refused("paramsync", "candidate", reason) == n + 1, reason


async def test_a_forged_rollback_candidate_naming_an_old_kept_blob_is_refused_and_nothing_follows_it(
        tmp_path: Path) -> None:
    # Issue 43's measured attack: a candidate the trainer never made, version current+5, naming an old kept
    # version's blob as a rollback. It is neither published nor announced, so no trainer or sampler follows it.
    svc, mem, vs = paramsync(tmp_path)
    s = svc.settings
    versions = [stored(vs, loadable(s, seed), seed) for seed in range(3)]
    async with running(svc) as task:
        for v in versions:
            mem.append(T.policy, candidate(v).to_bytes(), key=KEY_CANDIDATE)
            await until(published(svc, v.version), task)
        old = versions[0]
        forged = VersionRecord(version=7, blob=old.blob, sha256=old.sha256, size=old.size, trainer_step=7,
                               extra={"lineage": 7, "rollback_of": 0})
        unsigned = PolicyMessage.of("candidate", forged)
        replayed = unsigned.model_copy(update={"key_id": "trainer-1",  # the trainer's signature of version 2
                                               "signature": candidate(versions[2]).signature})
        mem.append(T.policy, unsigned.to_bytes(), key=KEY_CANDIDATE)
        mem.append(T.policy, replayed.model_copy(update={"version": 8}).to_bytes(), key=KEY_CANDIDATE)
        await handled(mem, task)
        await asyncio.sleep(0.1)
    marker = vs.read_marker()
    assert marker is not None and marker[0].version == 2 and marker[0].sha256 == versions[2].sha256
    assert svc.lineage_required == 0  # no rollback lineage was started
    anns = messages(mem)
    assert [m.version for m in anns] == [0, 1, 2] and all(m.rollback_of is None for m in anns)
    entries = audits(vs.store, "candidate_refused")
    assert [(e.params["version"], e.params["reason"]) for e in entries] == [(7, "unsigned"), (8, "bad_signature")]
    # The trainer reading that topic follows no rollback and takes only version 2 as published.
    trainer = Trainer(signed_settings(tmp_path, "trainer"), trainer_id="t", bus=mem.bus())
    for offset, record in enumerate(mem.records(T.policy)):
        if record.key == KEY_ANNOUNCE:
            pending = trainer.saw_announcement(Record(TopicPartition(T.policy, 0), offset, KEY_ANNOUNCE,
                                                      record.value, []))
            if pending is not None:
                await pending
    assert trainer.pending_rollback is None and trainer.intake.published == 2
    assert not audits(vs.store, "trainer_followed_rollback")


async def test_a_rollback_to_a_version_whose_kept_record_paramsync_did_not_sign_is_refused(tmp_path: Path) -> None:
    svc, mem, vs = paramsync(tmp_path)
    s = svc.settings
    sign = signer()
    v0 = publish(vs, loadable(s, 0), 0, sign)
    v1 = publish(vs, loadable(s, 1), 1, sign)
    # Written into the history by another process (store write access): unsigned, and a signed one edited to
    # name other (loadable) weights. Both would be republished as the newest version if not checked.
    vs.store.put(vs.history_key(5), stored(vs, loadable(s, 5), 5).to_json())
    other = stored(vs, loadable(s, 6), 6)
    vs.store.put(vs.history_key(0), dataclasses.replace(v0, blob=other.blob, sha256=other.sha256,
                                                        size=other.size).to_json())
    requests = RollbackRequests(vs.store, RUN)
    unsigned_id, edited_id = new_request_id(), new_request_id()
    requests.create(unsigned_id, 5, "op")
    requests.create(edited_id, 0, "op")
    async with running(svc) as task:
        await until(lambda: all((requests.get(r) or {}).get("status") == "refused" for r in (unsigned_id, edited_id)),
                    task)
        await asyncio.sleep(0.1)
    assert str((requests.get(unsigned_id) or {})["reason"]).startswith("unsigned:")
    assert str((requests.get(edited_id) or {})["reason"]).startswith("bad_signature:")
    marker = vs.read_marker()
    assert marker is not None and marker[0] == v1 and svc.published_version == 1
    assert messages(mem) == [] and svc.lineage_required == 0


async def test_paramsync_neither_takes_nor_re_announces_a_marker_it_did_not_sign(tmp_path: Path) -> None:
    svc, mem, vs = paramsync(tmp_path, reannounce_interval_s=0.1)
    s = svc.settings
    vs.publish_next(stored(vs, loadable(s, 3), 3))  # written by another process: unsigned
    async with running(svc) as task:
        await asyncio.sleep(0.5)  # several re-announcement periods
        assert messages(mem) == [] and svc.published_version is None
        mem.append(T.policy, candidate(stored(vs, loadable(s, 4), 4)).to_bytes(), key=KEY_CANDIDATE)
        await until(lambda: svc.published_version == 4, task)
    entries = audits(vs.store)
    assert [(e.actor, e.params["version"], e.params["source"], e.params["reason"], e.outcome) for e in entries] == [
        ("paramsync", 3, "marker", "unsigned", "not announced")]
    assert {m.version for m in messages(mem)} == {4}


async def test_a_sampler_never_adopts_a_forged_announcement_nor_an_unsigned_marker(tmp_path: Path) -> None:
    mem = MemoryBus()
    settings = signed_settings(tmp_path, sampler={"sync_interval_s": 0.2, "heartbeat_interval_s": 0.1,
                                                  "credits": False, "max_fragments_per_s": 50})
    sampler = Sampler(settings, "s-signed", bus=mem.bus())
    sign = signer()
    vs = VersionedStore(sampler.store, RUN, "policy")
    installed: list[int] = []
    set_policy = sampler.worker.set_policy

    def recording(version: int, weights: bytes) -> None:
        installed.append(version)
        set_policy(version, weights)

    sampler.worker.set_policy = recording  # type: ignore[method-assign]
    v0, v1 = loadable(settings, 0), loadable(settings, 1)
    before_ann = refused("sampler", "announcement", "bad_signature")
    before_role = refused("sampler", "announcement", "wrong_role")
    before_marker = refused("sampler", "marker", "unsigned")
    mem.append(T.policy, PolicyMessage.of("announce", publish(vs, v0, 0, sign)).with_inline(v0).to_bytes(),
               key=KEY_ANNOUNCE)
    async with running(sampler) as task:
        await until(lambda: sampler.worker.policy_version == 0, task)
        # The measured attack: the newest announcement, its version raised by 1,000, written back as it was.
        newest = PolicyMessage.model_validate_json(mem.records(T.policy)[-1].value or b"")
        mem.append(T.policy, newest.model_copy(update={"version": newest.version + 1000}).to_bytes(), key=KEY_ANNOUNCE)
        await until(lambda: refused("sampler", "announcement", "bad_signature") > before_ann, task)
        # A trainer-signed candidate written as an announcement: the trainer's key does not sign policies.
        as_ann = candidate(stored(vs, v1, 2)).model_copy(update={"type": "announce"}).with_inline(v1)
        mem.append(T.policy, as_ann.to_bytes(), key=KEY_ANNOUNCE)
        await until(lambda: refused("sampler", "announcement", "wrong_role") > before_role, task)
        # An unsigned marker (someone with store write access) is not adopted either.
        publish(vs, v1, 5, None)
        await until(lambda: refused("sampler", "marker", "unsigned") > before_marker, task)
        await asyncio.sleep(0.5)  # several marker polls: counted and logged once
        assert refused("sampler", "marker", "unsigned") == before_marker + 1
        assert sampler.worker.policy_version == 0
        real = sign.sign_record(stored(vs, v1, 6))
        vs.publish_next(real)  # paramsync's next version: adopted at once
        mem.append(T.policy, PolicyMessage.of("announce", real).with_inline(v1).to_bytes(), key=KEY_ANNOUNCE)
        await until(lambda: sampler.worker.policy_version == 6, task)
    assert installed == [0, 6]


async def test_the_trainer_takes_only_a_signed_announcement_or_marker_as_published_and_audits_a_forgery(
        tmp_path: Path) -> None:
    mem = MemoryBus()
    settings = signed_settings(tmp_path, "trainer")
    trainer = Trainer(settings, trainer_id="t", bus=mem.bus())
    sign = signer()
    good = PolicyMessage.of("announce", sign.sign_record(rec(version=3)))

    def record(msg: PolicyMessage, offset: int) -> Record:
        return Record(TopicPartition(T.policy, 0), offset, KEY_ANNOUNCE, msg.to_bytes(), [])

    assert trainer.saw_announcement(record(good, 0)) is None
    assert trainer.intake.published == 3
    forged = good.model_copy(update={"version": 1003})
    for offset in (1, 2):  # read twice (a re-read after a reader restart): audited once
        pending = trainer.saw_announcement(record(forged, offset))
        if pending is not None:
            await pending
    unsigned = PolicyMessage.of("announce", rec(version=2000, lineage=2000, rollback_of=1))
    pending = trainer.saw_announcement(record(unsigned, 3))
    assert pending is not None
    await pending
    # The trainer's own key cannot make an announcement it would take: its signature has the wrong role.
    own = candidate(rec(version=3000, lineage=3000, rollback_of=1)).model_copy(update={"type": "announce"})
    pending = trainer.saw_announcement(record(own, 4))
    assert pending is not None
    await pending
    assert trainer.intake.published == 3  # the staleness reference never moved to a forged version
    assert trainer.pending_rollback is None  # nor is a forged rollback followed
    entries = audits(trainer.store)
    assert [(e.params["version"], e.params["reason"], e.params["source"]) for e in entries] == [
        (1003, "bad_signature", "announcement"), (2000, "unsigned", "announcement"),
        (3000, "wrong_role", "announcement")]
    assert entries[0].actor == "trainer" and entries[0].outcome.startswith("refused")
    # The marker: an unsigned one is not taken as published either.
    vs = VersionedStore(trainer.store, RUN, "policy")
    vs.publish_next(rec(version=4000))
    assert not await trainer.refresh_published()
    assert trainer.intake.published == 3
    vs.publish_next(sign.sign_record(rec(version=4001)))
    assert await trainer.refresh_published()
    assert trainer.intake.published == 4001
    assert [e.params["source"] for e in audits(trainer.store)][-1] == "marker"


async def test_status_refuses_a_forged_marker_and_reports_a_behaviour_version_ahead_of_the_published(
        tmp_path: Path) -> None:
    mem = MemoryBus()
    settings = signed_settings(tmp_path, admin={"insecure_dev": True})
    admin = AdminState(settings, bus=mem.bus())
    vs = VersionedStore(admin.store, RUN, "policy")
    sign = signer()
    publish(vs, b"weights-10", 10, sign)
    app = create_app(admin)
    for sid, version in (("s-ok", 10), ("s-ahead", 1010), ("s-behind", 9)):
        admin.observe(SamplerBeat(id=sid, policy_version=version).to_bytes(), time.time())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://admin") as client:
        status = (await client.get("/status")).json()
        assert status["policy"]["version"] == 10
        by_id = {s["id"]: s for s in status["samplers"]}
        assert by_id["s-ahead"]["ahead_of_published"] == 1000
        assert by_id["s-ok"]["ahead_of_published"] is None and by_id["s-behind"]["ahead_of_published"] is None
        assert status["staleness"]["ahead"] == 1000 and status["staleness"]["ahead_samplers"] == ["s-ahead"]
        vs.publish_next(rec(version=11))  # unsigned: refused, the last trusted one is shown
        before = refused("admin", "marker", "unsigned")
        status = (await client.get("/status")).json()
        status = (await client.get("/status")).json()
        assert status["policy"]["version"] == 10
    assert refused("admin", "marker", "unsigned") == before + 1
    assert [e.params["version"] for e in audits(admin.store)] == [11]


def test_eval_and_export_refuse_an_unsigned_or_forged_policy_with_an_audit_entry(tmp_path: Path) -> None:
    settings = signed_settings(tmp_path)
    vs = VersionedStore(open_store(settings), RUN, "policy")
    weights = loadable(settings, 0)
    good = publish(vs, weights, 0, signer())
    record, blob = load_trusted(settings, vs, None)
    assert record == good and blob == weights
    forged = VersionRecord(**{**good.__dict__, "version": 1000})
    vs.publish_next(forged)  # the signature copied from version 0
    with pytest.raises(SignatureRefused, match="bad_signature"):
        evaluate(settings, vs, None, 1)
    with pytest.raises(SignatureRefused, match="bad_signature"):
        export_version(settings, vs, None, "safetensors", tmp_path / "out.safetensors")
    with pytest.raises(SignatureRefused, match="bad_signature"):
        load_trusted(settings, vs, 1000)  # by version, from the history
    assert not (tmp_path / "out.safetensors").exists()
    entries = audits(vs.store)
    assert [(e.params["version"], e.params["source"]) for e in entries] == [
        (1000, "marker"), (1000, "marker"), (1000, "history")]
    assert load_trusted(settings, vs, 0)[0] == good  # a signed version is still served


# ---- checkpoints bound to their run ------------------------------------------------------------------
CKPT_EXTRA: dict[str, Any] = {"policy_version": 0, "offsets": {}, "ledger": {}}


def trainer_of(tmp_path: Path, run: str = RUN, *, signing: bool = True) -> Trainer:
    """A trainer of ``run`` on the shared local store (signing on with the trainer's key, or off)."""
    keep = {"keep_checkpoints": 10}  # none pruned meanwhile
    settings = signed_settings(tmp_path, "trainer", trainer=keep) if signing else Settings.model_validate({
        "run": RUN, "store": {"backend": "local", "local_root": str(tmp_path / "store")},
        "env": {"num_envs": 2, "fragment_steps": 4}, "trainer": keep})
    return Trainer(settings.model_copy(update={"run": run}), trainer_id="t", bus=MemoryBus().bus())


async def checkpoint(trainer: Trainer, step: int, seed: int) -> VersionRecord:
    """Write a loadable checkpoint of ``step`` through ``trainer``'s own checkpointing; its record."""
    learner = Learner(trainer.spec, trainer.cfg.model_copy(update={"seed": seed}))
    await trainer.checkpoints.write(step, learner.state_bytes({}), dict(CKPT_EXTRA))
    marker = trainer.checkpoints.store.read_marker()
    assert marker is not None and marker[0].version == step
    return marker[0]


def copy_into(vs: VersionedStore, source: VersionedStore, record: VersionRecord, **changes: Any) -> VersionRecord:
    """``record`` (from ``source``) and its blob copied into ``vs``'s prefix as its newest checkpoint."""
    key, _ = vs.put_blob(source.fetch(record), f"{vs.prefix}/{record.version}/{record.sha256}.pt")
    copied = dataclasses.replace(record, blob=key, **changes)
    current = vs.read_marker()
    vs.publish(copied, None if current is None else current[1])
    return copied


@pytest.mark.parametrize("signing", [True, False], ids=["signing on", "signing off"])
async def test_a_checkpoint_copied_from_another_run_is_refused_at_restore_naming_both_runs(
        tmp_path: Path, signing: bool) -> None:
    ours, theirs = trainer_of(tmp_path, signing=signing), trainer_of(tmp_path, "other", signing=signing)
    good = await checkpoint(ours, 3, seed=0)
    assert good.extra["run"] == RUN and (("signature" in good.extra) == signing)
    foreign = await checkpoint(theirs, 9, seed=1)  # validly signed, by the same trainer key, for run "other"
    copy_into(ours.checkpoints.store, theirs.checkpoints.store, foreign)

    restarted = trainer_of(tmp_path, signing=signing)
    restored = await restarted.checkpoints.restore(restarted.learner.restore, fresh_start=False)
    assert restored is not None and restored.step == 3 and restarted.checkpoints.last == 3  # the older good one
    entries = audits(restarted.store, "checkpoint_refused")
    assert len(entries) == 1 and entries[0].actor == "trainer" and entries[0].outcome == "not restored"
    said = entries[0].params["refused"]
    assert "other_run" in said and "'other'" in said and f"'{RUN}'" in said, said
    assert audits(restarted.store, "checkpoint_fallback")[0].params["restored"] == 3

    # Nothing older to fall back to: the start fails with the same reason rather than taking it.
    alone = tmp_path / "alone"
    alone.mkdir()
    lone, other = trainer_of(alone, signing=signing), trainer_of(alone, "other", signing=signing)
    copy_into(lone.checkpoints.store, other.checkpoints.store, await checkpoint(other, 9, seed=1))
    with pytest.raises(RuntimeError, match="no usable checkpoint") as info:
        await lone.checkpoints.restore(lone.learner.restore, fresh_start=False)
    assert "belongs to run 'other', not to this run 'r'" in str(info.value)


async def test_with_signing_on_an_unsigned_or_rebound_checkpoint_is_refused_and_a_signed_one_restores(
        tmp_path: Path) -> None:
    ours, theirs = trainer_of(tmp_path), trainer_of(tmp_path, "other")
    good = await checkpoint(ours, 2, seed=0)
    PolicyVerifier.from_settings(ours.settings).check_checkpoint(good)
    # As written with signing off (or by anyone else with store access): no signature.
    unsigned_writer = trainer_of(tmp_path, signing=False)
    unsigned = await checkpoint(unsigned_writer, 4, seed=1)
    assert "signature" not in unsigned.extra
    # Another run's signed checkpoint claiming this run: its signature no longer matches.
    foreign = await checkpoint(theirs, 6, seed=2)
    copy_into(ours.checkpoints.store, theirs.checkpoints.store, foreign, extra={**foreign.extra, "run": RUN})
    # A checkpoint of this run whose ledger was edited after signing.
    edited = await checkpoint(ours, 8, seed=3)
    vs = ours.checkpoints.store
    current = vs.read_marker()
    assert current is not None
    vs.publish(dataclasses.replace(edited, version=8, extra={**edited.extra, "offsets": {"r.samples:0": 99}}),
               current[1])

    restarted = trainer_of(tmp_path)
    restored = await restarted.checkpoints.restore(restarted.learner.restore, fresh_start=False)
    assert restored is not None and restored.step == 2
    said = [e.params["refused"] for e in audits(restarted.store, "checkpoint_refused")]
    assert [s.split(":")[0:2] for s in said] == [["checkpoint 8", " bad_signature"], ["checkpoint 6", " bad_signature"],
                                                 ["checkpoint 4", " unsigned"]], said


# ---- the local stack's keys ------------------------------------------------------------------------
def test_the_local_stack_generates_keys_per_run_and_gives_each_service_only_its_own(tmp_path: Path) -> None:
    from devstack.config import InfraEndpoints
    from devstack.services import resolve_signing_keys, service_env

    d = resolve_signing_keys(tmp_path, "run-a")
    assert d == tmp_path / "policy-keys" / "run-a"
    public = d / "public" / "public.keys"
    privates = {role: d / role / f"{role}.key" for role in ("trainer", "paramsync")}
    for path in privates.values():
        assert path.stat().st_mode & 0o077 == 0, path
    kept = {p: p.read_text() for p in (public, *privates.values())}
    assert resolve_signing_keys(tmp_path, "run-a") == d  # kept across restarts
    assert {p: p.read_text() for p in kept} == kept
    assert resolve_signing_keys(tmp_path, "run-b") != d  # per run
    assert (tmp_path / "policy-keys" / "run-b" / "public" / "public.keys").read_text() != public.read_text()
    seeds = [read_private_key(p).seed.hex() for p in privates.values()]
    endpoints = InfraEndpoints(kafka_bootstrap="127.0.0.1:1", s3_endpoint="http://127.0.0.1:2", bucket="b",
                               access_key="a", secret_key="s")

    def env(service: str, overrides: dict[str, str] | None = None) -> dict[str, str]:
        return service_env({}, service=service, replica=0, port=1, home=tmp_path, config=tmp_path / "c.yaml",
                           run="run-a", store_backend="local", endpoints=endpoints, admin_token="t" * 40,
                           overrides=overrides or {}, signing=d)

    for service in ("trainer", "sampler", "admin", "paramsync"):
        e = env(service)
        assert e["FLYWHEEL_SIGNING_ENABLED"] == "true" and e["FLYWHEEL_SIGNING_KEYS_FILE"] == str(public)
        assert e.get("FLYWHEEL_SIGNING_PRIVATE_KEY_FILE") == (str(privates[service]) if service in privates
                                                              else None), service
        assert not any(seed in json.dumps(e) for seed in seeds)  # by reference only
        s = load_settings(None, {k: v for k, v in e.items() if k.startswith("FLYWHEEL_SIGNING_")})
        assert startup_problem(service, s) is None, service
    assert "FLYWHEEL_SIGNING_KEYS_FILE" not in env("trainer", {"FLYWHEEL_SIGNING_ENABLED": "false"})


def test_the_local_stack_refuses_an_unreadable_key_directory_naming_it(tmp_path: Path) -> None:
    from devstack.config import StackError
    from devstack.services import resolve_signing_keys

    d = tmp_path / "policy-keys" / "run-a"
    (d / "public").mkdir(parents=True)
    (d / "public" / "public.keys").write_text(f"run-a-1 {PARAMSYNC.seed.hex()}\n")  # an old HMAC key file
    with pytest.raises(StackError, match="2 fields is the shared-secret") as info:
        resolve_signing_keys(tmp_path, "run-a")
    assert str(d) in str(info.value) and PARAMSYNC.seed.hex() not in str(info.value)


def test_eval_and_export_on_the_local_stack_verify_with_its_public_keys_file(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from services.admin.cli import local_settings

    for k in [k for k in os.environ if k.startswith(("AWS_", "FLYWHEEL_"))]:
        monkeypatch.delenv(k)
    path = key_dir(tmp_path)
    (tmp_path / "localstack.json").write_text(json.dumps({"store_backend": "local", "run": RUN,
                                                          "signing_keys_file": str(path)}))
    monkeypatch.setenv("FLYWHEEL_HOME", str(tmp_path))
    signing = local_settings(None).signing
    assert signing.enabled and signing.keys_file == path and signing.private_key_file is None
    monkeypatch.setenv("FLYWHEEL_SIGNING_ENABLED", "false")  # the caller's own choice wins
    assert not local_settings(None).signing.enabled
