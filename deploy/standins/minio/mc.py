"""The stand-in image's `mc`: the subcommands docker-compose.yml uses, against
the stand-in S3 server. Users and policies are checked for form and recorded, not enforced (moto checks none)."""
import json
import os
import sys
import urllib.request
from pathlib import Path

ALIASES = Path(os.environ.get("HOME", "/tmp")) / ".mc-standin" / "aliases.json"


def aliases() -> dict[str, dict[str, str]]:
    return json.loads(ALIASES.read_text()) if ALIASES.is_file() else {}


def s3_for(alias: str):
    import boto3  # not for `mc ready`: the healthcheck has 5 s, and boto3 takes seconds to import on a busy machine

    a = aliases()[alias]
    return boto3.client("s3", endpoint_url=a["url"], region_name="us-east-1",
                        aws_access_key_id=a["user"], aws_secret_access_key=a["password"])


def main(argv: list[str]) -> int:
    args = [a for a in argv if not a.startswith("--")]
    flags = {a for a in argv if a.startswith("--")}
    if args[:2] == ["alias", "set"] and len(args) == 6:
        ALIASES.parent.mkdir(parents=True, exist_ok=True)
        ALIASES.write_text(json.dumps({**aliases(), args[2]: {"url": args[3], "user": args[4], "password": args[5]}}))
        print(f"Added `{args[2]}` successfully.")
    elif args[:1] == ["ready"]:
        url = "http://127.0.0.1:9000" if args[1:] == ["local"] else aliases()[args[1]]["url"]
        urllib.request.urlopen(f"{url}/moto-api/", timeout=4).read()
        print(f"The cluster '{args[1]}' is ready")
    elif args[:1] == ["mb"] and len(args) == 2:
        alias, _, bucket = args[1].partition("/")
        s3 = s3_for(alias)
        if bucket in {b["Name"] for b in s3.list_buckets().get("Buckets", [])}:
            if "--ignore-existing" not in flags:
                print(f"mc: Bucket `{bucket}` already exists.", file=sys.stderr)
                return 1
        else:
            s3.create_bucket(Bucket=bucket)
        print(f"Bucket created successfully `{args[1]}`.")
    elif args[:3] == ["admin", "policy", "create"] and len(args) == 6:
        json.loads(Path(args[5]).read_text())  # a malformed policy file fails as it would on MinIO
        print(f"Created policy `{args[4]}` successfully. (stand-in: recorded, not enforced)")
    elif args[:3] == ["admin", "user", "add"] and len(args) == 6:
        print(f"Added user `{args[4]}` successfully. (stand-in: recorded, not enforced)")
    elif args[:3] == ["admin", "policy", "attach"] and len(args) == 6 and "--user" in flags:
        print(f"Attached Policies: [{args[4]}] to {args[5]} (stand-in: recorded, not enforced)")
    else:
        print(f"mc stand-in: unsupported: mc {' '.join(argv)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
