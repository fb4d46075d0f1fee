"""`minio server DIR [--console-address ...]` for the stand-in image: moto's S3 server on :9000, its objects
restored from DIR at start and written back to DIR (one file per object) every second and at SIGTERM."""
import logging
import os
import signal
import sys
import threading
from pathlib import Path

import boto3
from moto.server import ThreadedMotoServer

PORT = 9000


def client():  # moto checks no credentials; these are what the real server's root user would be
    return boto3.client("s3", endpoint_url=f"http://127.0.0.1:{PORT}", region_name="us-east-1",
                        aws_access_key_id=os.environ.get("MINIO_ROOT_USER", "minio"),
                        aws_secret_access_key=os.environ.get("MINIO_ROOT_PASSWORD", "minio123"))


def restore(s3, root: Path) -> int:
    n = 0
    for bucket in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        s3.create_bucket(Bucket=bucket.name)
        for f in sorted(bucket.rglob("*")):
            if f.is_file() and not f.name.startswith(".tmp-"):
                s3.put_object(Bucket=bucket.name, Key=f.relative_to(bucket).as_posix(), Body=f.read_bytes())
                n += 1
    return n


def snapshot(s3, root: Path, seen: dict[tuple[str, str], str]) -> None:
    live: dict[tuple[str, str], str] = {}
    for b in s3.list_buckets().get("Buckets", []):
        (root / b["Name"]).mkdir(exist_ok=True)
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=b["Name"]):
            for obj in page.get("Contents", []):
                live[(b["Name"], obj["Key"])] = obj["ETag"]
    for (bucket, key), etag in live.items():
        if seen.get((bucket, key)) != etag:
            try:
                body = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
            except s3.exceptions.NoSuchKey:
                continue
            path = root / bucket / key
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".tmp-{path.name}")
            tmp.write_bytes(body)
            os.replace(tmp, path)
    for bucket, key in set(seen) - set(live):
        (root / bucket / key).unlink(missing_ok=True)
    seen.clear()
    seen.update(live)


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] != "server":
        print("minio stand-in: usage: minio server DIR [--console-address ADDR]", file=sys.stderr)
        return 2
    root = Path(argv[1])
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # not one access line a second for the snapshots
    server = ThreadedMotoServer(ip_address="0.0.0.0", port=PORT, verbose=False)
    server.start()
    s3 = client()
    print(f"minio stand-in (moto S3 server): restored {restore(s3, root)} object(s) from {root}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    seen: dict[tuple[str, str], str] = {}
    while not stop.wait(1.0):
        try:
            snapshot(s3, root, seen)
        except Exception as exc:  # noqa: BLE001 - keep serving; the next pass retries
            print(f"minio stand-in: snapshot failed: {exc!r}", flush=True)
    snapshot(s3, root, seen)
    print(f"minio stand-in: stopped; {len(seen)} object(s) in {root}", flush=True)
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
