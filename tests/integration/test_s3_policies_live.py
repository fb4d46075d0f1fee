"""The S3 policies per role (deploy/minio/flywheel-<role>.json) enforced live by a real S3 server.

The server is versitygw (posix backend, internal IAM), built from its Go module by ``tools/s3-live/build.sh``
into ``.flywheel/cache/s3-live/versitygw``; without that binary every live test here is skipped (the build is
not part of ``make test``). The module starts one gateway on 127.0.0.1 with its data and IAM directories in a
temporary folder, creates one account per role and the bucket, and installs the project's identity policies
as one bucket policy: every statement of ``flywheel-<role>.json``, generated from the file, with the role's
account as its ``Principal`` (versitygw names principals by access key). Then each role's boto3 client sends
the requests of ``tests/unit/test_s3_policies.py`` (the same ``CASES``, the same keys) and the server must
allow the allowed ones and answer ``AccessDenied`` to the denied ones.

versitygw v1.8.0 evaluates the statements as AWS does for this purpose: Principal (by access key), Action and
Resource with ``*``/``?`` wildcards, an explicit Deny wins, and ``Condition`` with ``StringLikeIfExists`` on
``s3:prefix`` (taken from a listing's ``prefix``; no key when there is none). So every case is checked, the
listings a role's Condition denies included. One difference from AWS: versitygw answers a GET of a missing key
with 404 to any caller allowed ``s3:GetObject`` (AWS needs ``s3:ListBucket`` too, else 403), so the unit test's
``list_prefix(None)`` (that existence check) is sent here as a listing without a prefix.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError

from devstack import s3 as infra_s3
from shared.marker import VersionedStore, VersionRecord
from shared.store import S3Store, StoreError
from tests.unit.test_s3_policies import BUCKET, CASES, EVERYTHING, REPO, ROLES, Request, policy_of

BINARY = REPO / ".flywheel" / "cache" / "s3-live" / "versitygw"
BUILD = "tools/s3-live/build.sh"
ROOT_ACCESS, ROOT_SECRET = "flywheel-root", "flywheel-root-dev-s3-secret"
READY_TIMEOUT_S = 30.0
ARN = f"arn:aws:s3:::{BUCKET}"

needs_binary = pytest.mark.skipif(
    not BINARY.is_file(), reason=f"no versitygw binary at {BINARY.relative_to(REPO)}: build it with {BUILD}")


def account(role: str) -> tuple[str, str]:
    """The access key and secret of ``role``'s account (development values, this test only)."""
    return f"flywheel-{role}", f"{role}-dev-s3-secret"


def bucket_policy() -> dict[str, Any]:
    """Every role's identity policy as one bucket policy: each statement as written in
    ``deploy/minio/flywheel-<role>.json``, plus ``Principal`` = that role's account and a ``Sid`` unique across
    roles. Nothing is dropped or changed, ``Condition`` included."""
    statements = []
    for role in ROLES:
        prefix = role.capitalize()
        for statement in policy_of(role)["Statement"]:
            sid = statement["Sid"] if statement["Sid"].startswith(prefix) else prefix + statement["Sid"]
            statements.append({**statement, "Sid": sid, "Principal": {"AWS": [account(role)[0]]}})
    return {"Version": "2012-10-17", "Statement": statements}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass(frozen=True)
class Gateway:
    """A running versitygw with the bucket, an account per role and the bucket policy installed."""

    endpoint: str

    def client(self, role: str | None = None) -> Any:
        """A boto3 client as ``role``'s account; None: as the root account (the bucket's owner, no policy)."""
        access, secret = (ROOT_ACCESS, ROOT_SECRET) if role is None else account(role)
        return infra_s3.client(self.endpoint, access_key=access, secret_key=secret)

    def seed(self) -> None:
        """(Re)write every key the cases touch, as root, so that reads and deletes find them."""
        root = self.client()
        for key in EVERYTHING:
            root.put_object(Bucket=BUCKET, Key=key, Body=b"seed")


def _admin(endpoint: str, *args: str) -> None:
    """Run ``versitygw admin`` (the admin API, signed as root) and fail with its output when it fails."""
    cmd = [str(BINARY), "admin", "--access", ROOT_ACCESS, "--secret", ROOT_SECRET, "--endpoint-url", endpoint, *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, f"versitygw admin {' '.join(args[:1])} failed: {done.stdout}{done.stderr}"


def _wait_ready(proc: subprocess.Popen[bytes], endpoint: str, log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    root = infra_s3.client(endpoint, access_key=ROOT_ACCESS, secret_key=ROOT_SECRET, timeout_s=2.0)
    delay = 0.05
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"versitygw exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            root.list_buckets()
            return
        except Exception as exc:  # not listening yet: retried until the deadline
            if time.monotonic() > deadline:
                raise AssertionError(f"versitygw not ready after {READY_TIMEOUT_S} s: {exc}; "
                                     f"log: {log.read_text()[-2000:]}") from exc
        time.sleep(delay)
        delay = min(delay * 2, 1.0)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    home = tmp_path_factory.mktemp("versitygw")
    data, iam, meta = home / "data", home / "iam", home / "meta"
    data.mkdir()
    iam.mkdir()
    meta.mkdir()
    endpoint = f"http://127.0.0.1:{_free_port()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VGW_", "ROOT_", "ADMIN_"))}
    log = home / "versitygw.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(BINARY), "--port", endpoint.removeprefix("http://"), "--access", ROOT_ACCESS,
             "--secret", ROOT_SECRET, "--iam-dir", str(iam), "--quiet", "posix",
             # metadata (the bucket policy among it) in sidecar files: ext4 keeps at most ~4 KB of xattrs per
             # inode, less than the four roles' policy, and refuses it with ENOSPC
             "--sidecar", str(meta), str(data)],
            stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        _wait_ready(proc, endpoint, log)
        for role in ROLES:  # before the policy: versitygw refuses a policy naming an unknown principal
            access, secret = account(role)
            _admin(endpoint, "create-user", "--access", access, "--secret", secret, "--role", "user")
        gw = Gateway(endpoint)
        root = gw.client()
        root.create_bucket(Bucket=BUCKET)
        root.put_bucket_policy(Bucket=BUCKET, Policy=json.dumps(bucket_policy()))
        yield gw
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _send(s3: Any, req: Request) -> None:
    """Send the S3 call ``req`` stands for as the client's account; a refusal raises ClientError."""
    key = req.resource.removeprefix(f"{ARN}/")
    if req.action == "s3:GetObject":
        s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    elif req.action == "s3:PutObject":
        s3.put_object(Bucket=BUCKET, Key=key, Body=b"live")
    elif req.action == "s3:DeleteObject":
        s3.delete_object(Bucket=BUCKET, Key=key)
    elif req.action == "s3:ListBucket":
        prefix = req.context.get("s3:prefix")
        s3.list_objects_v2(Bucket=BUCKET, **({} if prefix is None else {"Prefix": prefix}))
    else:
        raise AssertionError(f"no S3 call for {req.action}")


def live_verdicts(s3: Any, requests: list[Request]) -> list[tuple[Request, bool]]:
    """Whether the server allowed each request (deletes sent last, so they remove nothing another request
    reads). Only ``AccessDenied`` counts as a refusal; any other error fails the test."""
    verdicts = []
    for req in sorted(requests, key=lambda r: r.action == "s3:DeleteObject"):
        try:
            _send(s3, req)
            verdicts.append((req, True))
        except ClientError as exc:
            if exc.response["Error"]["Code"] != "AccessDenied":
                raise
            verdicts.append((req, False))
    return verdicts


def test_the_bucket_policy_is_every_role_statement_with_its_principal() -> None:
    doc = bucket_policy()
    sids = [s["Sid"] for s in doc["Statement"]]
    assert len(sids) == len(set(sids)), f"Sids repeat: {sids}"
    for role in ROLES:
        mine = [s for s in doc["Statement"] if s["Principal"] == {"AWS": [account(role)[0]]}]
        strip = [{k: v for k, v in s.items() if k not in ("Sid", "Principal")} for s in mine]
        assert strip == [{k: v for k, v in s.items() if k != "Sid"} for s in policy_of(role)["Statement"]], role


@needs_binary
@pytest.mark.s3
@pytest.mark.parametrize("role", ROLES)
def test_each_role_may_touch_what_it_needs_and_nothing_else_live(gateway: Gateway, role: str) -> None:
    gateway.seed()
    must, must_not = CASES[role]
    verdicts = live_verdicts(gateway.client(role), [*must, *must_not])
    refused = [r for r, ok in verdicts if not ok and r in must]
    assert not refused, f"{role} is refused live what it needs: {refused}"
    granted = [r for r, ok in verdicts if ok and r in must_not]
    assert not granted, f"{role} is allowed live what it must not do: {granted}"


@needs_binary
@pytest.mark.s3
def test_the_services_store_code_under_each_role_live(gateway: Gateway) -> None:
    """The marker protocol of shared/marker.py through S3Store, each writer with its own account."""
    run = f"live-{uuid.uuid4().hex[:8]}"
    store = {role: S3Store(gateway.client(role), BUCKET) for role in ROLES}
    policy = {role: VersionedStore(store[role], run, "policy") for role in ROLES}

    assert policy["sampler"].read_marker() is None, "no marker yet reads as absent, not as an outage"
    assert not store["sampler"].exists(f"{run}/ops/paused.json"), "no pause state yet reads as absent"
    key, sha = policy["trainer"].put_blob(b"weights")  # the trainer writes a candidate's weights
    record = VersionRecord(version=1, blob=key, sha256=sha, size=len(b"weights"), trainer_step=1)
    for role in ("sampler", "trainer", "admin"):
        with pytest.raises(StoreError, match="AccessDenied"):
            policy[role].publish_next(record)
    policy["paramsync"].publish_next(record)
    assert policy["sampler"].load_newer(None) == (record, b"weights")
    with pytest.raises(StoreError, match="AccessDenied"):
        store["sampler"].get(f"{run}/checkpoints/LATEST")
    assert policy["paramsync"].records() == [record]
