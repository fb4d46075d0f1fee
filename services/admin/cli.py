"""``flywheel``: the operator's command line, speaking to the admin API.

    flywheel status [--json]        what the run is doing, in words
    flywheel sync [--wait 2]        ask every sampler to load the latest policy now

The API address comes from ``--url`` or ``$FLYWHEEL_ADMIN_URL`` (default http://127.0.0.1:8080);
the token from ``--token``, ``$FLYWHEEL_ADMIN_TOKEN`` or the local stack's ``.flywheel/admin-token``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx

DEFAULT_URL = "http://127.0.0.1:8080"


def _token(arg: str | None) -> str | None:
    if arg:
        return arg
    if os.environ.get("FLYWHEEL_ADMIN_TOKEN"):
        return os.environ["FLYWHEEL_ADMIN_TOKEN"]
    path = Path(os.environ.get("FLYWHEEL_HOME", ".flywheel")) / "admin-token"
    return path.read_text().strip() if path.is_file() else None


def _ago(ts: float | None) -> str:
    if ts is None:
        return "never"
    return f"{max(0.0, time.time() - ts):.1f}s ago"


def render_status(s: dict[str, Any]) -> str:
    p, t, b, sy, st, er = s["policy"], s["trainer"], s["backlog"], s["sync"], s["staleness"], s["episode_return"]

    def fmt(x: Any, spec: str = ".3g") -> str:
        return "-" if x is None else format(x, spec)

    lines = [
        f"run {s['run']}",
        f"policy    version {fmt(p['version'], 'd')}  sha256 {(p['sha256'] or '-')[:12]}"
        f"  published {_ago(p['published_at'])}",
        f"trainer   {'alive' if t['alive'] else 'DOWN'}  updates {t['updates']}  samples trained {t['samples_trained']}"
        f"  ({t['samples_per_s']:.0f}/s)  last update {_ago(t['last_update_at'])}",
        f"backlog   {fmt(b['records'], 'd')} records  {b['per_partition']}",
        f"sync      p50 {fmt(sy['latency_p50_s'])} s  p95 {fmt(sy['latency_p95_s'])} s",
        f"staleness mean {fmt(st['mean'])}  max {fmt(st['max'], 'd')} versions",
        f"return    mean {fmt(er['mean'], '.1f')} over {er['count']} episodes",
        f"samplers  {sum(1 for x in s['samplers'] if x['alive'])} alive",
    ]
    for x in s["samplers"]:
        lines.append(f"  {x['id']:<36} {'alive' if x['alive'] else 'gone '}  v{fmt(x['policy_version'], 'd')}"
                     f"  {x['steps_per_s']:.0f} steps/s  seen {_ago(x['last_seen'])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flywheel", description="Operate a Flywheel run via its admin API.")
    parser.add_argument("--url", default=os.environ.get("FLYWHEEL_ADMIN_URL", DEFAULT_URL))
    parser.add_argument("--token", help="bearer token (default: $FLYWHEEL_ADMIN_TOKEN or .flywheel/admin-token)")
    sub = parser.add_subparsers(dest="command", required=True)
    st = sub.add_parser("status", help="show the run's status")
    st.add_argument("--json", action="store_true", help="print the raw /status JSON")
    sy = sub.add_parser("sync", help="make every sampler load the latest published policy now")
    sy.add_argument("--wait", type=float, default=2.0, help="seconds to wait for samplers (0: do not wait)")
    args = parser.parse_args(argv)
    try:
        with httpx.Client(base_url=args.url, timeout=10 + getattr(args, "wait", 0)) as client:
            if args.command == "status":
                r = client.get("/status")
                r.raise_for_status()
                print(json.dumps(r.json(), indent=2) if args.json else render_status(r.json()))
                return 0
            token = _token(args.token)
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            r = client.post("/policy/sync", params={"wait_s": args.wait}, headers=headers)
            if r.status_code == 401:
                print("flywheel: unauthorized: pass --token or set FLYWHEEL_ADMIN_TOKEN", file=sys.stderr)
                return 1
            r.raise_for_status()
            body = r.json()
            state = {True: "all live samplers on it", False: "NOT all samplers reached it in time", None: "requested"}
            print(f"sync to version {body['policy_version']}: {state[body['synced']]} ({body['waited_s']} s)")
            for sid, v in sorted(body["samplers"].items()):
                print(f"  {sid}: v{v}")
            return 0 if body["synced"] is not False else 1
    except httpx.HTTPError as exc:
        print(f"flywheel: cannot reach the admin API at {args.url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
