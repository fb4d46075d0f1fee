"""The marker protocol on the local-directory twin (the same cases run on real S3 in integration)."""

import io
from pathlib import Path

import pytest

from shared.logging import configure_logging
from shared.store import LocalDirStore, StoreError
from tests import marker_cases as cases


@pytest.fixture
def store(tmp_path: Path) -> LocalDirStore:
    return LocalDirStore(tmp_path / "store")


def test_conditional_writes(store: LocalDirStore) -> None:
    cases.conditional_writes(store, "p")


def test_publish_and_read(store: LocalDirStore) -> None:
    cases.publish_and_read(store, "run")


def test_racing_writers_one_wins(store: LocalDirStore) -> None:
    cases.racing_writers_one_wins(store, "run")


def test_corrupt_or_missing_payload_keeps_previous(store: LocalDirStore) -> None:
    buf = io.StringIO()
    configure_logging("test", "run", stream=buf)
    cases.corrupt_or_missing_payload_keeps_previous(store, "run", buf.getvalue)


def test_prune_keeps_newest(store: LocalDirStore) -> None:
    cases.prune_keeps_newest(store, "run")


def test_keys_cannot_escape_root(store: LocalDirStore) -> None:
    with pytest.raises(StoreError, match="escapes"):
        store.put("../outside", b"x")
