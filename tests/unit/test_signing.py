"""Signed policies (docs/security.md, "Signed policies"): HMAC-SHA256 over a policy's claims, keys by reference
with rotation, the start-up checks, paramsync signing what it publishes, and every reader refusing what is
unsigned or badly signed: a sampler (announcements and the marker), the trainer's announcement reader (a forged
version never becomes "published"), the admin's /status, ``eval`` and ``export``. A refusal is not acted on,
is logged, counted and, where the reader may write the audit trail, audited. Also: /status reports a behaviour
version ahead of the published one.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiokafka import TopicPartition

from services.admin.app import create_app
from services.admin.evaluate import evaluate, load_trusted
from services.admin.export import export_version
from services.admin.state import AdminState
from services.paramsync.rollbacks import republish
from services.paramsync.service import Paramsync
from services.sampler.service import Sampler
from services.trainer.learner import Learner
from services.trainer.service import Trainer
from shared.bus import MemoryBus, Record
from shared.kafka import Topics
from shared.keyfile import parse_keys
from shared.marker import VersionedStore, VersionRecord
from shared.messages import KEY_ANNOUNCE, KEY_CANDIDATE, PolicyMessage, SamplerBeat
from shared.rl.envs import fragment_spec
from shared.rollback import RollbackRequest
from shared.runtime import AuditLog
from shared.settings import ConfigError, Settings, load_settings
from shared.signing import (
    REFUSED,
    KeyRing,
    PolicySigner,
    PolicyVerifier,
    SignatureRefused,
    startup_problem,
)
from shared.store import open_store
from tests.services import running, until

RUN = "r"
T = Topics.for_run(RUN)
K1, K2 = secrets.token_bytes(32), secrets.token_bytes(32)


def rec(version: int = 3, sha: str = "ab" * 32, **extra: Any) -> VersionRecord:
    return VersionRecord(version=version, blob=f"{RUN}/policy/blobs/{sha}.safetensors", sha256=sha, size=100,
                         trainer_step=7, created_at=1.0, extra=dict(extra))


def signer(*, key: bytes = K1, key_id: str = "k1", run: str = RUN) -> PolicySigner:
    return PolicySigner(run, KeyRing({key_id: key}, key_id))


def verifier(keys: dict[str, bytes] | None = None, run: str = RUN) -> PolicyVerifier:
    return PolicyVerifier(run, KeyRing(keys or {"k1": K1}))


def refused_reason(check: Callable[[], None]) -> str:
    with pytest.raises(SignatureRefused) as info:
        check()
    return info.value.reason


# ---- sign and verify ----------------------------------------------------------------------------
def test_a_signed_record_and_its_announcement_verify() -> None:
    signed = signer().sign_record(rec(lineage=2, rollback_of=1))
    v = verifier()
    v.check_record(signed)
    msg = PolicyMessage.of("announce", signed)
    assert msg.key_id == "k1" and msg.signature == signed.extra["signature"]["hmac"]
    v.check_message(msg)
    v.check_message(PolicyMessage.model_validate_json(msg.to_bytes()))  # survives the wire
    v.check_record(PolicyMessage.model_validate_json(msg.to_bytes()).record())  # a sampler installs msg.record()
    v.check_message(signer().sign_message(PolicyMessage.of("announce", rec())))


def test_a_changed_version_digest_size_run_or_lineage_is_refused() -> None:
    signed = signer().sign_record(rec(lineage=2, rollback_of=1))
    v = verifier()
    for changed in ({"version": 1003}, {"sha256": "cd" * 32}, {"size": 101}, {"trainer_step": 8}):
        forged = VersionRecord(**{**signed.__dict__, **changed})
        assert refused_reason(lambda f=forged: v.check_record(f)) == "bad_signature", changed
    for extra in ({"lineage": 3}, {"rollback_of": 2}, {"rollback_of": None}):
        forged = VersionRecord(**{**signed.__dict__, "extra": {**signed.extra, **extra}})
        assert refused_reason(lambda f=forged: v.check_record(f)) == "bad_signature", extra
    msg = PolicyMessage.of("announce", signed)
    assert refused_reason(lambda: v.check_message(msg.model_copy(update={"version": msg.version + 1000}))) \
        == "bad_signature"
    assert refused_reason(lambda: verifier(run="other").check_record(signed)) == "bad_signature"  # per run


def test_a_wrong_key_a_missing_signature_and_a_removed_key_are_refused() -> None:
    v = verifier()
    assert refused_reason(lambda: v.check_record(signer(key=K2).sign_record(rec()))) == "bad_signature"
    assert refused_reason(lambda: v.check_record(rec())) == "unsigned"
    assert refused_reason(lambda: v.check_message(PolicyMessage.of("announce", rec()))) == "unsigned"
    half = PolicyMessage.of("announce", signer().sign_record(rec())).model_copy(update={"signature": None})
    assert refused_reason(lambda: v.check_message(half)) == "unsigned"
    # k1 rotated out: what it signed is refused by readers that no longer list it.
    assert refused_reason(lambda: verifier({"k2": K2}).check_record(signer().sign_record(rec()))) == "unknown_key"


def test_rotation_signs_with_the_current_key_and_verifies_with_every_listed_one() -> None:
    both = verifier({"k1": K1, "k2": K2})
    old = signer().sign_record(rec(version=1))
    new = signer(key=K2, key_id="k2").sign_record(rec(version=2))
    both.check_record(old)
    both.check_record(new)
    assert new.extra["signature"]["key_id"] == "k2"


def test_signing_off_checks_nothing() -> None:
    PolicyVerifier(RUN, None).check_record(rec())
    PolicyVerifier(RUN, None).check_message(PolicyMessage.of("announce", rec()))


def test_candidates_and_unsigned_announcements_encode_as_before() -> None:
    assert "key_id" not in json.loads(PolicyMessage.of("announce", rec()).to_bytes())
    signed = signer().sign_record(rec())
    assert "signature" not in json.loads(PolicyMessage.of("candidate", signed).to_bytes())


# ---- keys by reference, start-up ------------------------------------------------------------------
def key_file(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "keys"
    path.write_text("\n".join(["# comment", "", *lines]) + "\n")
    return path


def test_the_keys_file_lists_ids_and_hex_secrets_and_its_errors_never_echo_a_secret(tmp_path: Path) -> None:
    assert parse_keys(f"k1 {K1.hex()}\nk2 {K2.hex()}\n") == {"k1": K1, "k2": K2}
    short = secrets.token_hex(8)
    for text, says in ((f"k1 {short}", "at least 32"), ("k1 zz", "not hex"), ("", "no key"),
                       (f"k1 {K1.hex()}\nk1 {K2.hex()}", "twice"), (f"k1 {K1.hex()} extra", "2 fields"),
                       (f"k/1 {K1.hex()}", "key id")):
        with pytest.raises(ValueError, match=says) as info:
            parse_keys(text)
        said = str(info.value)
        assert "signing.keys_file" in said and short not in said and K1.hex() not in said


def test_settings_name_the_field_when_signing_is_on_without_usable_keys(tmp_path: Path) -> None:
    good = key_file(tmp_path, f"k1 {K1.hex()}")
    env = {"FLYWHEEL_SIGNING_ENABLED": "true"}
    cases = [({}, "signing.keys_file is required"),
             ({"FLYWHEEL_SIGNING_KEYS_FILE": str(tmp_path / "absent")}, "signing.keys_file cannot be read"),
             ({"FLYWHEEL_SIGNING_KEYS_FILE": str(good), "FLYWHEEL_SIGNING_KEY_ID": "k9"},
              "signing.key_id 'k9' is not in")]
    for extra, says in cases:
        with pytest.raises(ConfigError, match=says):
            load_settings(None, {**env, **extra})
    with pytest.raises(ConfigError, match="signing.keys_file is set but signing.enabled=false"):
        load_settings(None, {"FLYWHEEL_SIGNING_KEYS_FILE": str(good)})
    s = load_settings(None, {**env, "FLYWHEEL_SIGNING_KEYS_FILE": str(good)})
    assert startup_problem("sampler", s) is None and startup_problem("trainer", s) is None
    assert "signing.key_id is required by paramsync" in str(startup_problem("paramsync", s))
    with pytest.raises(ValueError, match="signing.key_id is required by paramsync"):
        PolicySigner.from_settings(s)
    assert K1.hex() not in repr(KeyRing({"k1": K1}))


def test_paramsync_without_its_key_exits_2_at_start_naming_the_field(tmp_path: Path) -> None:
    good = key_file(tmp_path, f"k1 {K1.hex()}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    env.update(FLYWHEEL_SIGNING_ENABLED="true", FLYWHEEL_SIGNING_KEYS_FILE=str(good))
    proc = subprocess.run([sys.executable, "-m", "services.paramsync"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "signing.key_id is required by paramsync" in proc.stderr


# ---- the services on the in-memory bus ----------------------------------------------------------
def signed_settings(tmp_path: Path, *, key_id: str | None = "k1", **sections: Any) -> Settings:
    path = tmp_path / "policy.keys"
    if not path.exists():
        path.write_text(f"k1 {K1.hex()}\n")
    return Settings.model_validate({
        "run": RUN, "store": {"backend": "local", "local_root": str(tmp_path / "store")},
        "env": {"num_envs": 2, "fragment_steps": 4},
        "signing": {"enabled": True, "keys_file": str(path), "key_id": key_id}, **sections})


def loadable(settings: Settings, seed: int) -> bytes:
    spec = fragment_spec(settings.env.id, 1 << 20)
    return Learner(spec, settings.trainer.model_copy(update={"seed": seed})).weights()


def publish(vs: VersionedStore, data: bytes, version: int, sign: PolicySigner | None) -> VersionRecord:
    key, sha = vs.put_blob(data)
    record = VersionRecord(version=version, blob=key, sha256=sha, size=len(data), trainer_step=version)
    record = sign.sign_record(record) if sign is not None else record
    vs.publish_next(record)
    return record


def refused(role: str, source: str, reason: str) -> float:
    return REFUSED.labels(role=role, source=source, reason=reason)._value.get()  # type: ignore[no-any-return]


def audits(store: Any, action: str = "policy_signature_refused") -> list[Any]:
    return [e for e in AuditLog(store, RUN).entries() if e.action == action]


async def test_paramsync_signs_the_marker_history_and_announcements_and_a_rollback(tmp_path: Path) -> None:
    mem = MemoryBus()
    settings = signed_settings(tmp_path, paramsync={"heartbeat_interval_s": 0.1, "reannounce_interval_s": 0.3})
    svc = Paramsync(settings, bus=mem.bus())
    vs = VersionedStore(svc.policies.store, RUN, "policy")
    v = PolicyVerifier.from_settings(settings)
    data = loadable(settings, 0)
    key, sha = vs.put_blob(data)
    candidate = VersionRecord(version=0, blob=key, sha256=sha, size=len(data), trainer_step=0)

    def announced() -> list[PolicyMessage]:
        msgs = [PolicyMessage.model_validate_json(r.value or b"") for r in mem.records(T.policy)]
        return [m for m in msgs if m.type == "announce"]

    async with running(svc) as task:
        mem.append(T.policy, PolicyMessage.of("candidate", candidate).to_bytes(), key=KEY_CANDIDATE)
        await until(lambda: len(announced()) >= 2, task)  # the announcement and a re-announcement
    marker = vs.read_marker()
    assert marker is not None
    v.check_record(marker[0])
    v.check_record(vs.records()[0])
    for msg in announced():
        v.check_message(msg)
    assert svc.signer is not None
    publish(vs, loadable(settings, 1), 1, svc.signer)
    request = RollbackRequest(request_id="r1", version=0, requested_at=1.0)
    back = republish(vs, svc.model, request, svc.signer.sign_record)
    v.check_record(back)
    assert back.extra["rollback_of"] == 0 and back.extra["lineage"] == back.version == 2


async def test_a_sampler_never_adopts_a_forged_announcement_nor_an_unsigned_marker(tmp_path: Path) -> None:
    mem = MemoryBus()
    settings = signed_settings(tmp_path, key_id=None, sampler={"sync_interval_s": 0.2, "heartbeat_interval_s": 0.1,
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
    before_marker = refused("sampler", "marker", "unsigned")
    mem.append(T.policy, PolicyMessage.of("announce", publish(vs, v0, 0, sign)).with_inline(v0).to_bytes(),
               key=KEY_ANNOUNCE)
    async with running(sampler) as task:
        await until(lambda: sampler.worker.policy_version == 0, task)
        # The measured attack: the newest announcement, its version raised by 1,000, written back as it was.
        newest = PolicyMessage.model_validate_json(mem.records(T.policy)[-1].value or b"")
        mem.append(T.policy, newest.model_copy(update={"version": newest.version + 1000}).to_bytes(), key=KEY_ANNOUNCE)
        await until(lambda: refused("sampler", "announcement", "bad_signature") > before_ann, task)
        # An unsigned marker (someone with store write access) is not adopted either.
        publish(vs, v1, 5, None)
        await until(lambda: refused("sampler", "marker", "unsigned") > before_marker, task)
        await asyncio.sleep(0.5)  # several marker polls: counted and logged once
        assert refused("sampler", "marker", "unsigned") == before_marker + 1
        assert sampler.worker.policy_version == 0
        real = sign.sign_record(VersionRecord(version=6, blob=vs.put_blob(v1)[0], sha256=vs.put_blob(v1)[1],
                                              size=len(v1), trainer_step=6))
        vs.publish_next(real)  # paramsync's next version: adopted at once
        mem.append(T.policy, PolicyMessage.of("announce", real).with_inline(v1).to_bytes(), key=KEY_ANNOUNCE)
        await until(lambda: sampler.worker.policy_version == 6, task)
    assert installed == [0, 6]


async def test_the_trainer_takes_only_a_signed_announcement_or_marker_as_published_and_audits_a_forgery(
        tmp_path: Path) -> None:
    mem = MemoryBus()
    settings = signed_settings(tmp_path, key_id=None)
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
    assert trainer.intake.published == 3  # the staleness reference never moved to a forged version
    assert trainer.pending_rollback is None  # nor is a forged rollback followed
    entries = audits(trainer.store)
    assert [(e.params["version"], e.params["reason"], e.params["source"]) for e in entries] == [
        (1003, "bad_signature", "announcement"), (2000, "unsigned", "announcement")]
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
    settings = signed_settings(tmp_path, key_id=None, admin={"insecure_dev": True})
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
    settings = signed_settings(tmp_path, key_id=None)
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


# ---- the local stack's key -------------------------------------------------------------------------
def test_the_local_stack_generates_a_key_per_run_and_passes_it_by_reference(tmp_path: Path) -> None:
    from devstack.config import InfraEndpoints
    from devstack.services import resolve_signing_keys, service_env

    path, key_id = resolve_signing_keys(tmp_path, "run-a")
    assert path == tmp_path / "policy-keys" / "run-a.keys" and key_id == "run-a-1"
    assert path.stat().st_mode & 0o077 == 0
    assert resolve_signing_keys(tmp_path, "run-a") == (path, key_id)  # kept across restarts
    secret = parse_keys(path.read_text())[key_id]
    assert resolve_signing_keys(tmp_path, "run-b")[0].read_text() != path.read_text()  # per run
    endpoints = InfraEndpoints(kafka_bootstrap="127.0.0.1:1", s3_endpoint="http://127.0.0.1:2", bucket="b",
                               access_key="a", secret_key="s")

    def env(service: str, overrides: dict[str, str] | None = None) -> dict[str, str]:
        return service_env({}, service=service, replica=0, port=1, home=tmp_path, config=tmp_path / "c.yaml",
                           run="run-a", store_backend="local", endpoints=endpoints, admin_token="t" * 40,
                           overrides=overrides or {}, signing=(path, key_id))

    for service in ("trainer", "sampler", "admin", "paramsync"):
        e = env(service)
        assert e["FLYWHEEL_SIGNING_ENABLED"] == "true" and e["FLYWHEEL_SIGNING_KEYS_FILE"] == str(path)
        assert ("FLYWHEEL_SIGNING_KEY_ID" in e) == (service == "paramsync")
        assert secret.hex() not in json.dumps(e)  # by reference only
        s = load_settings(None, {k: v for k, v in e.items() if k.startswith("FLYWHEEL_SIGNING_")})
        assert startup_problem(service, s) is None
    assert "FLYWHEEL_SIGNING_KEYS_FILE" not in env("trainer", {"FLYWHEEL_SIGNING_ENABLED": "false"})


def test_eval_and_export_on_the_local_stack_verify_with_its_keys_file(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from services.admin.cli import local_settings

    for k in [k for k in os.environ if k.startswith(("AWS_", "FLYWHEEL_"))]:
        monkeypatch.delenv(k)
    path = key_file(tmp_path, f"r-1 {K1.hex()}")
    (tmp_path / "localstack.json").write_text(json.dumps({"store_backend": "local", "run": RUN,
                                                          "signing_keys_file": str(path)}))
    monkeypatch.setenv("FLYWHEEL_HOME", str(tmp_path))
    signing = local_settings(None).signing
    assert signing.enabled and signing.keys_file == path and signing.key_id is None
    monkeypatch.setenv("FLYWHEEL_SIGNING_ENABLED", "false")  # the caller's own choice wins
    assert not local_settings(None).signing.enabled
