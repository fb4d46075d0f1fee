"""An S3-compatible endpoint for the local stack (moto's server; objects live in memory only)."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path
from typing import Any

from devstack.config import HEALTHCHECK_KEY, S3_ACCESS_KEY, S3_REGION, S3_SECRET_KEY, InfraConfig, StackError
from devstack.procs import Proc, read_cmdline

NAME = "s3"


def proc(cfg: InfraConfig) -> Proc:
    return Proc(cfg.home, NAME)


def moto_server_path() -> Path:
    """`moto_server` from the virtual environment that runs this interpreter."""
    path = Path(sys.executable).parent / "moto_server"
    if not path.is_file():
        raise StackError(
            f"{path} not found: the S3 server comes from `moto[server]` in this virtual environment "
            f"({sys.prefix}); install the test extra, e.g. `pip install -e '.[test]'`"
        )
    return path


def command(cfg: InfraConfig) -> list[str]:
    """moto's server on 127.0.0.1 (on its own host's address in the multi-host stack)."""
    return [sys.executable, str(moto_server_path()), "-H", cfg.host(NAME), "-p", str(cfg.s3_port)]


def running_port(args: list[str]) -> int | None:
    for flag, value in zip(args, args[1:], strict=False):
        if flag in ("-p", "--port") and value.isdigit():
            return int(value)
    return None


def check_port(cfg: InfraConfig, pid: int) -> None:
    """A reused S3 server must listen where this call expects it."""
    port = running_port(read_cmdline(pid) or [])
    if port != cfg.s3_port:
        raise StackError(
            f"our S3 server in {cfg.home} (pid {pid}) already runs on port {port}, not {cfg.s3_port}; "
            f"run `python -m devstack infra-down --home {cfg.home}` first or use the same port"
        )


def client(
    endpoint: str,
    *,
    access_key: str = S3_ACCESS_KEY,
    secret_key: str = S3_SECRET_KEY,
    region: str = S3_REGION,
    timeout_s: float = 10.0,
    retries: int = 1,
) -> Any:
    """A boto3 S3 client for an S3-compatible endpoint (path-style addressing)."""
    import boto3
    from botocore.config import Config

    config = Config(
        s3={"addressing_style": "path"},
        connect_timeout=min(timeout_s, 5.0),
        read_timeout=timeout_s,
        retries={"max_attempts": retries, "mode": "standard"},
    )
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=access_key,
        aws_secret_access_key=secret_key,
        region_name=region,
        config=config,
    )


def ensure_bucket(s3: Any, bucket: str) -> None:
    """Create `bucket` unless it exists already (idempotent)."""
    from botocore.exceptions import ClientError

    try:
        s3.create_bucket(Bucket=bucket)
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
            raise


def roundtrip(
    endpoint: str,
    bucket: str,
    *,
    access_key: str = S3_ACCESS_KEY,
    secret_key: str = S3_SECRET_KEY,
    region: str = S3_REGION,
    timeout_s: float = 10.0,
) -> None:
    """Create the bucket if needed, then put and get back one small object."""
    s3 = client(endpoint, access_key=access_key, secret_key=secret_key, region=region, timeout_s=timeout_s)
    ensure_bucket(s3, bucket)
    body = uuid.uuid4().hex.encode()
    s3.put_object(Bucket=bucket, Key=HEALTHCHECK_KEY, Body=body)
    got = s3.get_object(Bucket=bucket, Key=HEALTHCHECK_KEY)["Body"].read()
    if got != body:
        raise StackError(f"S3 health-check read back {got!r}, expected {body!r}")
