"""The object store and marker protocol against a real S3 endpoint (moto server or MinIO)."""

from __future__ import annotations

import io

import pytest

from shared.logging import configure_logging
from shared.store import S3Store
from tests import marker_cases as cases

pytestmark = pytest.mark.s3


@pytest.fixture
def store(s3_endpoint) -> S3Store:  # type: ignore[no-untyped-def]
    return S3Store(s3_endpoint.client(), s3_endpoint.bucket)


def test_conditional_writes(store: S3Store, run_name: str) -> None:
    cases.conditional_writes(store, run_name)


def test_publish_and_read(store: S3Store, run_name: str) -> None:
    cases.publish_and_read(store, run_name)


def test_racing_writers_one_wins(store: S3Store, run_name: str) -> None:
    cases.racing_writers_one_wins(store, run_name)


def test_corrupt_or_missing_payload_keeps_previous(store: S3Store, run_name: str) -> None:
    buf = io.StringIO()
    configure_logging("test", run_name, stream=buf)
    cases.corrupt_or_missing_payload_keeps_previous(store, run_name, buf.getvalue)


def test_prune_keeps_newest(store: S3Store, run_name: str) -> None:
    cases.prune_keeps_newest(store, run_name)


def test_list_and_exists(store: S3Store, run_name: str) -> None:
    store.put(f"{run_name}/a/1", b"1")
    store.put(f"{run_name}/a/2", b"2")
    assert store.list(f"{run_name}/a/") == [f"{run_name}/a/1", f"{run_name}/a/2"]
    assert store.exists(f"{run_name}/a/1") and not store.exists(f"{run_name}/a/3")
    store.delete(f"{run_name}/a/1")
    assert not store.exists(f"{run_name}/a/1")
