"""Restore falls back to the previous good version; an unreachable store is an error, never "nothing there"."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from shared.marker import BadPayload, VersionedStore, VersionRecord
from shared.retry import is_transient
from shared.store import LocalDirStore, S3Store, StoreError


def _write(vs: VersionedStore, step: int, data: bytes) -> VersionRecord:
    sha = hashlib.sha256(data).hexdigest()
    key, _ = vs.put_blob(data, f"{vs.prefix}/{step}/{sha}.pt")
    rec = VersionRecord(version=step, blob=key, sha256=sha, size=len(data), trainer_step=step)
    current = vs.read_marker()
    vs.publish(rec, None if current is None else current[1])
    return rec


def test_nothing_published_is_none(tmp_path: Path) -> None:
    assert VersionedStore(LocalDirStore(tmp_path), "run", "checkpoints").load_latest_good() is None


def test_falls_back_to_the_previous_good_version(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path)
    vs = VersionedStore(store, "run", "checkpoints")
    _write(vs, 10, b"state-10")
    newest = _write(vs, 20, b"state-20")
    store.put(newest.blob, b"torn write")  # corrupt the newest payload
    rec, data, refused = vs.load_latest_good()  # type: ignore[misc]
    assert rec.version == 10 and data == b"state-10"
    assert len(refused) == 1 and "version 20" in refused[0] and "corrupt" in refused[0]


def test_a_verifier_can_refuse_a_version(tmp_path: Path) -> None:
    vs = VersionedStore(LocalDirStore(tmp_path), "run", "checkpoints")
    _write(vs, 1, b"good")
    _write(vs, 2, b"unloadable")

    def verify(data: bytes) -> None:
        if data == b"unloadable":
            raise ValueError("not a checkpoint")

    rec, _, refused = vs.load_latest_good(verify)  # type: ignore[misc]
    assert rec.version == 1 and "not a checkpoint" in refused[0]


def test_all_versions_bad_is_bad_payload_not_none(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path)
    vs = VersionedStore(store, "run", "checkpoints")
    rec = _write(vs, 5, b"state")
    store.delete(rec.blob)
    with pytest.raises(BadPayload) as err:
        vs.load_latest_good()
    assert not is_transient(err.value)  # a fact about the data: not retried


def test_unreachable_store_raises_a_transient_error() -> None:
    import boto3
    from botocore.config import Config

    client = boto3.client("s3", endpoint_url="http://127.0.0.1:9", region_name="us-east-1",
                          aws_access_key_id="x", aws_secret_access_key="y",
                          config=Config(retries={"max_attempts": 1}, connect_timeout=1, read_timeout=1))
    vs = VersionedStore(S3Store(client, "bucket"), "run", "checkpoints")
    with pytest.raises(StoreError) as err:
        vs.load_latest_good()
    assert is_transient(err.value)


def test_an_error_without_a_response_is_a_store_error() -> None:
    class NoResponse(Exception):
        response = None

    class Client:
        class exceptions:  # noqa: N801 - mimics boto3's client.exceptions
            NoSuchKey = KeyError

        def get_object(self, **_: object) -> None:
            raise NoResponse("connection reset")

    with pytest.raises(StoreError, match="connection reset"):
        S3Store(Client(), "b").get("k")
