"""Object storage: one small interface, an S3 implementation and a local-directory twin.

Both support conditional writes, the primitive the marker protocol (:mod:`shared.marker`) needs:
``if_none_match=True`` creates only when the key is absent, ``if_match=etag`` replaces only the
version that was read. A lost race raises :class:`PreconditionFailed`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from shared.settings import Settings


class StoreError(RuntimeError):
    """The object store could not be used (unreachable, no bucket, no permission)."""


class PreconditionFailed(StoreError):
    """A conditional write lost: the key exists (if_none_match) or changed (if_match)."""


@dataclass(frozen=True)
class StoredObject:
    data: bytes
    etag: str


class ObjectStore(Protocol):
    """Keys are ``/``-separated paths inside one bucket (or directory)."""

    def get(self, key: str) -> StoredObject | None:
        """The object, or None when the key does not exist."""
        ...

    def put(self, key: str, data: bytes, *, if_none_match: bool = False, if_match: str | None = None) -> str:
        """Write ``data``; return its etag. Raise PreconditionFailed when a condition fails."""
        ...

    def exists(self, key: str) -> bool: ...

    def delete(self, key: str) -> None: ...

    def list(self, prefix: str) -> list[str]:
        """Keys starting with ``prefix``, sorted."""
        ...


class S3Store:
    """An S3 bucket through boto3 (AWS, MinIO, moto, any S3 API with conditional writes)."""

    def __init__(self, client: Any, bucket: str) -> None:
        self._s3 = client
        self.bucket = bucket

    def _code(self, exc: Exception) -> str:
        response = getattr(exc, "response", None) or {}  # some botocore errors carry response=None
        return str((response.get("Error") or {}).get("Code", ""))

    def get(self, key: str) -> StoredObject | None:
        try:
            resp = self._s3.get_object(Bucket=self.bucket, Key=key)
            # Reading the body is network I/O too: a dropped connection here must not escape raw.
            return StoredObject(resp["Body"].read(), resp["ETag"])
        except self._s3.exceptions.NoSuchKey:
            return None
        except Exception as exc:
            if self._code(exc) in ("NoSuchKey", "404"):
                return None
            raise StoreError(f"get s3://{self.bucket}/{key} failed: {exc}") from exc

    def put(self, key: str, data: bytes, *, if_none_match: bool = False, if_match: str | None = None) -> str:
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": key, "Body": data}
        if if_none_match:
            kwargs["IfNoneMatch"] = "*"
        if if_match is not None:
            kwargs["IfMatch"] = if_match
        try:
            resp = self._s3.put_object(**kwargs)
        except Exception as exc:
            if self._code(exc) in ("PreconditionFailed", "ConditionalRequestConflict", "412", "409"):
                raise PreconditionFailed(f"conditional put of s3://{self.bucket}/{key} lost: {exc}") from exc
            raise StoreError(f"put s3://{self.bucket}/{key} failed: {exc}") from exc
        return str(resp["ETag"])

    def exists(self, key: str) -> bool:
        try:
            self._s3.head_object(Bucket=self.bucket, Key=key)
        except Exception as exc:
            if self._code(exc) in ("404", "NoSuchKey", "NotFound"):
                return False
            raise StoreError(f"head s3://{self.bucket}/{key} failed: {exc}") from exc
        return True

    def delete(self, key: str) -> None:
        try:
            self._s3.delete_object(Bucket=self.bucket, Key=key)
        except Exception as exc:
            raise StoreError(f"delete s3://{self.bucket}/{key} failed: {exc}") from exc

    def list(self, prefix: str) -> list[str]:
        keys: list[str] = []
        try:
            for page in self._s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
                keys.extend(obj["Key"] for obj in page.get("Contents", []))
        except Exception as exc:
            raise StoreError(f"list s3://{self.bucket}/{prefix} failed: {exc}") from exc
        return sorted(keys)


class LocalDirStore:
    """The same interface on a directory: atomic renames, and an flock for conditional writes.

    Safe across processes on one machine. Etags are the sha256 of the content.
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock_path = self.root / ".lock"

    def _path(self, key: str) -> Path:
        p = (self.root / key).resolve()
        if self.root.resolve() not in p.parents:
            raise StoreError(f"key escapes the store root: {key!r}")
        return p

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self._lock_path, "a+") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    @staticmethod
    def _etag(data: bytes) -> str:
        return '"' + hashlib.sha256(data).hexdigest() + '"'

    def get(self, key: str) -> StoredObject | None:
        try:
            data = self._path(key).read_bytes()
        except FileNotFoundError:
            return None
        return StoredObject(data, self._etag(data))

    def put(self, key: str, data: bytes, *, if_none_match: bool = False, if_match: str | None = None) -> str:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        with self._locked():
            if if_none_match or if_match is not None:
                current = self.get(key)
                if if_none_match and current is not None:
                    raise PreconditionFailed(f"{key} already exists")
                if if_match is not None and (current is None or current.etag != if_match):
                    raise PreconditionFailed(f"{key} changed since it was read (etag mismatch)")
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
            try:
                with os.fdopen(fd, "wb") as fh:
                    fh.write(data)
                    fh.flush()
                    os.fsync(fh.fileno())
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                raise
        return self._etag(data)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path(key).unlink()

    def list(self, prefix: str) -> list[str]:
        out = []
        for p in self.root.rglob("*"):
            if p.is_file() and not p.name.startswith("."):
                key = p.relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    out.append(key)
        return sorted(out)


def s3_client(settings: Settings) -> Any:
    """A boto3 S3 client for the configured endpoint (credentials from the environment)."""
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=settings.s3.endpoint,
        region_name=settings.s3.region,
        # Few, short attempts: callers retry with backoff (shared.retry) and report themselves degraded;
        # boto's own long retry chains would block them for minutes on a refused endpoint.
        config=Config(retries={"max_attempts": 2, "mode": "standard"}, connect_timeout=3, read_timeout=20),
    )


def open_store(settings: Settings) -> ObjectStore:
    """The object store the settings name."""
    if settings.store.backend == "local":
        return LocalDirStore(settings.store.local_root)
    return S3Store(s3_client(settings), settings.s3.bucket)
