"""``flywheel``: the operator's command line, speaking to the admin API (docs/api.md).

    flywheel status [--watch [S]] [--json]     what the run is doing, in words
    flywheel sync [--wait S]                   every sampler loads the latest policy now
    flywheel pause [ID] / resume [ID]          stop / restart producing (all samplers, or one)
    flywheel versions / rollback V             published policies; republish V's weights
    flywheel config get|set K=V ...|history|revert R
    flywheel audit [--limit N]                 operator and automatic actions
    flywheel trace SAMPLE_ID [FILE|-] [--logs DIR]   one sample's way, from the JSON logs
    flywheel eval [V] --episodes N [--deterministic] [--video DIR]   run a policy version, mean ± std return
    flywheel export [V] --format onnx|safetensors [--out PATH]      write a policy version as a file
    flywheel tokens add NAME --file F          a token for operator NAME (printed once), its hash appended to F

The API address comes from ``--url`` or ``$FLYWHEEL_ADMIN_URL`` (default http://127.0.0.1:8080);
the token from ``--token``, ``$FLYWHEEL_ADMIN_TOKEN`` or the local stack's ``admin-token``
(``$FLYWHEEL_HOME``, else ``./.flywheel`` or ``<repo>/.flywheel``). Exit status: 0 done; 1 the API
refused (its reason is printed), ``sync`` did not get there in time, or ``trace`` found nothing;
2 the API cannot be reached, or a usage error; 3 ``pause``, ``resume``, ``rollback``, ``config set`` or
``config revert`` is stored but pending (it prints ``pending:``, why and what happens next: Kafka did not
acknowledge the control command in time, or paramsync has not applied the rollback yet). Output is
plain text when not on a terminal, and a closed pipe (``flywheel status | head -1``) ends it quietly.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from services.admin import trace
from services.admin.cli_format import (
    Style,
    render_audit,
    render_config,
    render_config_change,
    render_config_history,
    render_pause,
    render_rollback,
    render_status,
    render_sync,
    render_trace,
    render_versions,
)

__all__ = ["main", "render_status"]

DEFAULT_URL = "http://127.0.0.1:8080"
REPO = Path(__file__).resolve().parents[2]
EXIT_BROKEN_PIPE = 141  # what a shell reports for a process killed by SIGPIPE (128 + 13)


# ---- where things are --------------------------------------------------------------------------
def flywheel_home() -> Path:
    """``$FLYWHEEL_HOME``, else ``./.flywheel`` when it exists, else ``<repo>/.flywheel``."""
    if os.environ.get("FLYWHEEL_HOME"):
        return Path(os.environ["FLYWHEEL_HOME"]).expanduser()
    local = Path(".flywheel")
    return local if local.is_dir() else REPO / ".flywheel"


def local_settings(config: str | None) -> Any:
    """Settings for the commands that read the store and Kafka directly (verify, eval, export): the
    environment and ``--config`` as given, with the local stack's (``make up`` without Docker) endpoints,
    store, run, policy signing keys and config file as defaults when ``$FLYWHEEL_HOME/localstack.json`` exists and the
    environment names no store or run of its own. Raises ConfigError naming the field."""
    from shared.settings import load_settings

    home = flywheel_home()
    defaults: dict[str, str] = {}
    stack = home / "localstack.json"
    explicit = any(k.startswith(("FLYWHEEL_STORE_", "FLYWHEEL_S3_")) or k == "FLYWHEEL_RUN" for k in os.environ)
    if stack.is_file() and not explicit:  # an environment that names a store or run means another one
        st = json.loads(stack.read_text())
        if st.get("store_backend") == "local":
            defaults.update(FLYWHEEL_STORE_BACKEND="local", FLYWHEEL_STORE_LOCAL_ROOT=str(home / "store"))
        if st.get("run"):
            defaults["FLYWHEEL_RUN"] = str(st["run"])
        if st.get("signing_keys_file") and not any(k.startswith("FLYWHEEL_SIGNING_") for k in os.environ):
            # The stack signs its policies: eval and export verify them with its key file.
            defaults.update(FLYWHEEL_SIGNING_ENABLED="true", FLYWHEEL_SIGNING_KEYS_FILE=str(st["signing_keys_file"]))
        if st.get("config") and config is None and not os.environ.get("FLYWHEEL_CONFIG"):
            config = str(st["config"])
        infra = home / "infra.env"
        if infra.is_file():
            for line in infra.read_text().splitlines():
                key, sep, value = line.partition("=")
                if sep and not line.startswith("#"):
                    defaults[key.strip()] = value.strip()
                    if key.strip().startswith("AWS_"):  # read by boto3 from the process environment, not settings
                        os.environ.setdefault(key.strip(), value.strip())
    return load_settings(config, {**defaults, **os.environ})


def _token(arg: str | None) -> str | None:
    if arg:
        return arg
    if os.environ.get("FLYWHEEL_ADMIN_TOKEN"):
        return os.environ["FLYWHEEL_ADMIN_TOKEN"]
    path = flywheel_home() / "admin-token"
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


# ---- talking to the API ------------------------------------------------------------------------
class ApiError(Exception):
    """The API answered with an error status; ``str()`` is its reason, one line per problem."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


class Unreachable(Exception):
    """No answer from the API (connection refused, timeout, bad address)."""


def error_reason(r: httpx.Response) -> str:
    """The server's reason: ``detail`` as text, or FastAPI's 422 list as ``field: msg`` lines."""
    try:
        detail = r.json().get("detail")
    except (ValueError, AttributeError):
        detail = None
    if isinstance(detail, str):
        return detail
    if isinstance(detail, list):
        lines = []
        for item in detail:
            if not isinstance(item, dict):
                lines.append(str(item))
                continue
            loc = [str(x) for x in item.get("loc") or []]
            field = ".".join(loc[1:] if len(loc) > 1 and loc[0] in ("body", "query", "path", "header") else loc)
            lines.append(f"{field}: {item.get('msg', '')}" if field else str(item.get("msg", "")))
        return "\n".join(lines)
    if detail is not None:
        return json.dumps(detail)
    return r.text.strip()[:300] or r.reason_phrase


class Api:
    """The admin API over one ``httpx.Client``; every call returns the decoded JSON body."""

    def __init__(self, client: httpx.Client, url: str, token: str | None) -> None:
        self.client, self.url, self.token = client, url, token

    def call(self, method: str, path: str, *, params: dict[str, Any] | None = None, body: Any = None,
             auth: bool = False) -> Any:
        # Every call sends the token when there is one: reads need it too unless the admin has admin.public_reads.
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        try:
            r = self.client.request(method, path, params=params, json=body, headers=headers)
        except httpx.TimeoutException as exc:
            raise Unreachable(f"the admin API at {self.url} did not answer in time ({type(exc).__name__})") from None
        except (httpx.TransportError, httpx.InvalidURL) as exc:
            raise Unreachable(f"cannot reach the admin API at {self.url}: {exc or type(exc).__name__}") from None
        if r.status_code >= 400:
            reason = error_reason(r)
            if r.status_code in (401, 403):
                reason += " (pass --token, set FLYWHEEL_ADMIN_TOKEN, or see <FLYWHEEL_HOME>/admin-token)"
            raise ApiError(r.status_code, f"{method} {path}: {r.status_code} {reason}")
        try:
            return r.json()
        except ValueError:
            raise ApiError(r.status_code, f"{method} {path}: the answer is not JSON: {r.text[:200]!r}") from None


# ---- the subcommands ---------------------------------------------------------------------------
def out(text: str) -> None:
    print(text, flush=True)


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def cmd_status(api: Api, args: argparse.Namespace, sleep: Callable[[float], None]) -> int:
    style = Style.for_stream(sys.stdout)
    if args.watch is None:
        s = api.call("GET", "/status")
        out(json.dumps(s, indent=2) if args.json else render_status(s, style=style))
        return 0
    try:
        while True:
            try:
                s = api.call("GET", "/status")
                text = json.dumps(s) if args.json else render_status(s, style=style)
            except (ApiError, Unreachable) as exc:
                text = f"flywheel: {exc}" if args.json else style.bad(f"flywheel: {exc}")
            if args.json:
                out(text)  # one JSON document a line
            elif _isatty(sys.stdout):  # a terminal: redraw in place
                out(f"\x1b[H\x1b[2J{style.dim(time.strftime('%H:%M:%S'))}  every {args.watch:g}s, Ctrl-C to stop"
                    f"\n{text}")
            else:
                out(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')}\n{text}\n")
            sleep(args.watch)
    except KeyboardInterrupt:
        return 0


def cmd_sync(api: Api, args: argparse.Namespace) -> int:
    body = api.call("POST", "/policy/sync", params={"wait_s": args.wait}, auth=True)
    out(render_sync(body))
    return 1 if body.get("synced") is False else 0


EXIT_PENDING = 3
"""Stored but pending: Kafka did not acknowledge the control command in time (``pause``, ``resume``, ``config
set|revert``, ``rollback``; admin keeps sending it), or paramsync did not apply the rollback in time (down or busy)."""


def done_or_pending(body: dict[str, Any]) -> int:
    return EXIT_PENDING if body.get("status") == "pending" else 0


def cmd_pause(api: Api, args: argparse.Namespace) -> int:
    body = api.call("POST", f"/samplers/{args.command}", body={"sampler": args.sampler} if args.sampler else {},
                    auth=True)
    out(render_pause(body))
    return done_or_pending(body)


def cmd_versions(api: Api, args: argparse.Namespace) -> int:
    body = api.call("GET", "/policy/versions")
    out(json.dumps(body, indent=2) if args.json else render_versions(body))
    return 0


def cmd_rollback(api: Api, args: argparse.Namespace) -> int:
    body = api.call("POST", "/policy/rollback", body={"version": args.version}, auth=True)
    out(render_rollback(body))
    return EXIT_PENDING if body.get("new_version") is None else done_or_pending(body)


def cmd_config(api: Api, args: argparse.Namespace) -> int:
    if args.action == "get":
        body = api.call("GET", "/config")
        out(json.dumps(body, indent=2) if args.json else render_config(body))
    elif args.action == "history":
        body = api.call("GET", "/config/history")
        out(json.dumps(body, indent=2) if args.json else render_config_history(body))
    else:
        body = api.call("PATCH", "/config", body=dict(args.assignments), auth=True) if args.action == "set" else \
            api.call("POST", "/config/revert", body={"revision": args.revision}, auth=True)
        out(render_config_change(body))
        return done_or_pending(body)
    return 0


def cmd_audit(api: Api, args: argparse.Namespace) -> int:
    body = api.call("GET", "/audit", params=None if args.limit is None else {"limit": args.limit})
    out(json.dumps(body, indent=2) if args.json else render_audit(body))
    return 0


def cmd_trace(args: argparse.Namespace) -> int:
    """Reads logs only, no API call: a directory, one file, or ``-`` (stdin: ``docker compose logs``)."""
    if args.file and args.logs:
        print("flywheel: trace takes FILE or --logs DIR, not both", file=sys.stderr)
        return 2
    source = args.file or str(args.logs or flywheel_home() / "logs")
    if source == "-":
        steps = trace.timeline(trace.events_for(args.sample_id, sys.stdin))
    elif Path(source).is_dir():
        steps = trace.timeline(trace.events_for(args.sample_id, trace.log_lines(Path(source))))
    elif Path(source).is_file():
        with open(source, encoding="utf-8", errors="replace") as fh:
            steps = trace.timeline(trace.events_for(args.sample_id, fh))
    else:
        print(f"flywheel: no logs at {source} (pass --logs DIR, a FILE, or - for stdin)", file=sys.stderr)
        return 1
    if not steps:
        print(f"flywheel: no log line mentions sample {args.sample_id} in {source}", file=sys.stderr)
        return 1
    if args.json:
        out(json.dumps(trace.steps_json(args.sample_id, steps), indent=2))
    else:
        out(render_trace(args.sample_id, steps, trace.outcome(steps), Style.for_stream(sys.stdout)))
    return 0


# ---- the command line --------------------------------------------------------------------------
def assignment(text: str) -> tuple[str, Any]:
    """``KEY=VALUE``, the value as JSON when it parses (numbers, true/false, null, ...), else a string."""
    key, eq, raw = text.partition("=")
    if not eq or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")

    def no_constants(name: str) -> Any:
        raise ValueError(name)  # NaN, Infinity: not JSON the server can take; keep them strings

    try:
        parsed: Any = json.loads(raw, parse_constant=no_constants)
    except ValueError:
        parsed = raw
    return key.strip(), parsed


def positive(text: str) -> float:
    x = float(text)
    if not x > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return x


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flywheel", description="Operate a Flywheel run via its admin API.",
                                     epilog="exit status: 0 done, 1 refused by the API or not found, "
                                            "2 the API cannot be reached or bad usage, 3 stored but still "
                                            "pending (pause, resume, config set|revert: Kafka did not acknowledge "
                                            "the command in time; rollback: also paramsync not running or not "
                                            "answering)")
    parser.add_argument("--url", default=os.environ.get("FLYWHEEL_ADMIN_URL", DEFAULT_URL),
                        help=f"admin API (default: $FLYWHEEL_ADMIN_URL or {DEFAULT_URL})")
    parser.add_argument("--token", help="bearer token (default: $FLYWHEEL_ADMIN_TOKEN or $FLYWHEEL_HOME/admin-token)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    st = sub.add_parser("status", help="show the run's status")
    st.add_argument("--watch", nargs="?", type=positive, const=2.0, metavar="SECONDS",
                    help="redraw every SECONDS (default 2) until Ctrl-C")
    st.add_argument("--json", action="store_true", help="print the raw /status JSON (with --watch: one a line)")
    sy = sub.add_parser("sync", help="make every sampler load the latest published policy now")
    sy.add_argument("--wait", type=float, default=2.0, metavar="S",
                    help="seconds to wait for samplers (0: do not wait; default 2)")
    for action, what in (("pause", "stop producing fragments"), ("resume", "produce fragments again")):
        p = sub.add_parser(action, help=f"samplers {what} (all, or one)")
        p.add_argument("sampler", nargs="?", metavar="ID", help="one sampler's id (default: every sampler)")
    vs = sub.add_parser("versions", help="list the published policy versions")
    vs.add_argument("--json", action="store_true")
    rb = sub.add_parser("rollback", help="publish version V's weights again as the newest version")
    rb.add_argument("version", type=int, metavar="V")

    cfg = sub.add_parser("config", help="runtime settings: get, set, history, revert")
    csub = cfg.add_subparsers(dest="action", required=True, metavar="ACTION")
    cget = csub.add_parser("get", help="the current settings and their revision")
    cget.add_argument("--json", action="store_true")
    cset = csub.add_parser("set", help="change settings (values as JSON when they parse, else strings)")
    cset.add_argument("assignments", nargs="+", type=assignment, metavar="KEY=VALUE")
    chist = csub.add_parser("history", help="every revision with its changes")
    chist.add_argument("--json", action="store_true")
    crev = csub.add_parser("revert", help="make revision R's settings current again (a new revision)")
    crev.add_argument("revision", type=int, metavar="R")

    au = sub.add_parser("audit", help="operator and automatic actions, append-only")
    au.add_argument("--limit", type=int, metavar="N", help="at most N entries")
    au.add_argument("--json", action="store_true")

    tr = sub.add_parser("trace", help="one sample's timeline from the services' JSON logs")
    tr.add_argument("sample_id", metavar="SAMPLE_ID")
    tr.add_argument("file", nargs="?", metavar="FILE|-", help="one log file, or - for stdin "
                    "(e.g. docker compose logs --no-color | flywheel trace ID -)")
    tr.add_argument("--logs", type=Path, metavar="DIR",
                    help="directory of *.log and rotated *.log.N (default: $FLYWHEEL_HOME/logs)")
    tr.add_argument("--json", action="store_true", help="the timeline as JSON (as GET /trace/{id})")

    ve = sub.add_parser("verify", help="prove from a checkpoint and the topics that every record is in the model "
                        "exactly once (reads the store and Kafka directly; exit 0 ok, 1 not)")
    ve.add_argument("--checkpoint", type=int, metavar="STEP", help="a kept checkpoint (default: the newest)")
    ve.add_argument("--config", metavar="FILE", help="the run's config file (endpoints also from FLYWHEEL_* env)")
    ve.add_argument("--no-log", action="store_true", help="check the ledger only, without reading the topics")

    ev = sub.add_parser("eval", help="run a policy version in the run's env and print its return, mean ± std "
                        "(reads the store directly; docs/using-a-policy.md)")
    ev.add_argument("version", nargs="?", type=int, metavar="VERSION",
                    help="a kept version (default: the published one)")
    ev.add_argument("--episodes", type=count, default=10, metavar="N", help="episodes to run (default 10)")
    ev.add_argument("--deterministic", action="store_true",
                    help="the most likely action (argmax, or the Gaussian's mean) instead of sampling as samplers do")
    ev.add_argument("--seed", type=int, default=0, metavar="S", help="episode i resets with seed S+i (default 0)")
    ev.add_argument("--video", type=Path, metavar="DIR", help="record every episode into DIR (rgb_array envs)")
    ev.add_argument("--config", metavar="FILE", help="the run's config file (endpoints also from FLYWHEEL_* env)")
    ev.add_argument("--json", action="store_true", help="the per-episode returns and their statistics as JSON")

    ks = sub.add_parser("keys", help="the signing keys: init, rotate, retire (docs/security.md; local files only)")
    ksub = ks.add_subparsers(dest="action", required=True, metavar="ACTION")
    kinit = ksub.add_parser("init", help="make the trainer's and paramsync's keys and the public list, where absent")
    krot = ksub.add_parser("rotate", help="a new key for ROLE; the old one stays listed (both verify) until retired")
    krot.add_argument("role", choices=("trainer", "paramsync"))
    kret = ksub.add_parser("retire", help="remove KEY_ID from the public list: what it signed no longer verifies")
    kret.add_argument("key_id", metavar="KEY_ID")
    for kp in (kinit, krot, kret):
        kp.add_argument("--dir", type=Path, required=True, metavar="DIR",
                        help="DIR/trainer/trainer.key, DIR/paramsync/paramsync.key, DIR/public/public.keys")

    tk = sub.add_parser("tokens", help="named operators of the admin API (admin.tokens_file; local files only)")
    tksub = tk.add_subparsers(dest="action", required=True, metavar="ACTION")
    tadd = tksub.add_parser("add", help="make a token for operator NAME, print it once, append 'NAME <sha256 of "
                            "it>' to FILE (a name already there is refused)")
    tadd.add_argument("name", metavar="NAME", help="the operator's name, as the audit will show it")
    tadd.add_argument("--file", type=Path, required=True, metavar="FILE", help="the tokens file (created if absent)")

    xp = sub.add_parser("export", help="write a policy version as ONNX or safetensors "
                        "(reads the store directly; docs/using-a-policy.md)")
    xp.add_argument("version", nargs="?", type=int, metavar="VERSION",
                    help="a kept version (default: the published one)")
    xp.add_argument("--format", choices=("onnx", "safetensors"), default="onnx", help="default onnx")
    xp.add_argument("--out", type=Path, metavar="PATH", help="file to write (default: ./<run>-v<VERSION>.<format>)")
    xp.add_argument("--config", metavar="FILE", help="the run's config file (endpoints also from FLYWHEEL_* env)")
    return parser


def count(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return n


def cmd_verify(args: argparse.Namespace) -> int:
    from services.admin.verify import verify  # imports Kafka and the store: only for this command
    from shared.settings import ConfigError

    try:
        code, lines = verify(local_settings(args.config), args.checkpoint, read_log=not args.no_log)
    except (ConfigError, LookupError) as exc:
        print(f"flywheel: {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return code


def cmd_keys(args: argparse.Namespace) -> int:
    """``flywheel keys``: exit 1 with the reason when a file is malformed or a key cannot be retired."""
    from shared.signing import generate_keys, retire_key, rotate_key  # cryptography: only for this command

    try:
        if args.action == "init":
            paths = generate_keys(args.dir)
            out("\n".join(f"{name}: {path}" for name, path in paths.items()))
        elif args.action == "rotate":
            old, new = rotate_key(args.dir, args.role)
            out(f"{args.role} key {new} replaces {old}; both verify until 'flywheel keys retire {old}'. Give every "
                f"reader the new public list, then restart the {args.role}")
        else:
            retire_key(args.dir, args.key_id)
            out(f"key {args.key_id} removed from {args.dir / 'public' / 'public.keys'}; restart the readers")
    except (ValueError, OSError) as exc:
        print(f"flywheel: {exc}", file=sys.stderr)
        return 1
    return 0


def new_operator_token() -> str:
    """``secrets.token_urlsafe(32)`` that does not begin with "-" (``flywheel --token -x...`` reads as an option)."""
    import secrets

    while (token := secrets.token_urlsafe(32)).startswith("-"):
        pass
    return token


def cmd_tokens(args: argparse.Namespace) -> int:
    """``flywheel tokens add NAME --file F``: the token on stdout (once; only its hash is kept), the line appended to
    F; exit 1 when NAME is not a valid name, is already in F, or F is malformed or cannot be written."""
    from services.admin.deps import OPERATOR_NAME, parse_tokens, token_sha256  # fastapi: only for this command
    from shared.settings import ConfigError

    path: Path = args.file
    if not OPERATOR_NAME.fullmatch(args.name):
        print(f"flywheel: {args.name!r} is not an operator name: 1-64 letters, digits, '.', '_', '@' or '-', "
              "beginning with a letter or digit", file=sys.stderr)
        return 1
    try:
        text = path.read_text(encoding="utf-8") if path.exists() else ""
        listed: dict[str, str] = {}
        if any(line.split("#", 1)[0].strip() for line in text.splitlines()):
            listed = parse_tokens(text, str(path))
        if args.name in listed:
            print(f"flywheel: operator {args.name!r} is already in {path}; remove its line to give it a new token",
                  file=sys.stderr)
            return 1
        token = new_operator_token()
        line = f"{args.name} {token_sha256(token)}\n"
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        with os.fdopen(fd, "a", encoding="utf-8") as fh:
            fh.write(line if not text or text.endswith("\n") else "\n" + line)
    except (ConfigError, OSError, UnicodeDecodeError) as exc:
        print(f"flywheel: {exc}", file=sys.stderr)
        return 1
    out(token)
    print(f"operator {args.name!r} added to {path}. The token above is shown this once (only its sha256 is kept): "
          "give it to the operator, and restart admin to load the file (admin.tokens_file)", file=sys.stderr)
    return 0


def cmd_policy(args: argparse.Namespace) -> int:
    """``eval`` and ``export``: read the run's policy versions from the store directly, no API call.
    Exit 1 when the version is not there or does not fit the config, 2 for a config error or an unreachable store."""
    from services.admin.evaluate import EvalError, evaluate  # gymnasium, numpy: only for these commands
    from shared.marker import BadPayload, VersionedStore
    from shared.settings import ConfigError
    from shared.signing import SignatureRefused
    from shared.store import StoreError, open_store

    try:
        settings = local_settings(args.config)
        policies = VersionedStore(open_store(settings), settings.run, "policy")
        if args.command == "eval":
            report = evaluate(settings, policies, args.version, args.episodes, deterministic=args.deterministic,
                              seed=args.seed, video_dir=args.video)
            out(json.dumps(report.to_json(), indent=2) if args.json else "\n".join(report.lines()))
            return 0
        from services.admin.export import export_version  # torch and onnx: only for this command

        path, record = export_version(settings, policies, args.version, args.format, args.out)
    except SignatureRefused as exc:  # logged, counted and audited by load_trusted
        print(f"flywheel: refused: the policy's signature does not verify ({exc})", file=sys.stderr)
        return 1
    except (LookupError, EvalError, BadPayload) as exc:
        print(f"flywheel: {exc}", file=sys.stderr)
        return 1
    except (ConfigError, StoreError) as exc:
        print(f"flywheel: {exc}", file=sys.stderr)
        return 2
    out(f"wrote policy version {record.version} of run {settings.run} ({settings.env.id}) as {args.format}: {path}")
    return 0


def run(args: argparse.Namespace, transport: httpx.BaseTransport | None, sleep: Callable[[float], None]) -> int:
    if args.command == "trace":
        return cmd_trace(args)
    if args.command == "verify":
        return cmd_verify(args)
    if args.command == "keys":
        return cmd_keys(args)
    if args.command == "tokens":
        return cmd_tokens(args)
    if args.command in ("eval", "export"):
        return cmd_policy(args)
    timeout = 10.0 + (args.wait if args.command == "sync" else 0.0)
    try:
        with httpx.Client(base_url=args.url, timeout=timeout, transport=transport) as client:
            api = Api(client, args.url, _token(args.token))
            if args.command == "status":
                return cmd_status(api, args, sleep)
            commands: dict[str, Callable[[Api, argparse.Namespace], int]] = {
                "sync": cmd_sync, "pause": cmd_pause, "resume": cmd_pause, "versions": cmd_versions,
                "rollback": cmd_rollback, "config": cmd_config, "audit": cmd_audit}
            return commands[args.command](api, args)
    except ApiError as exc:
        print(f"flywheel: {exc}", file=sys.stderr)
        return 1
    except Unreachable as exc:
        print(f"flywheel: {exc}", file=sys.stderr)
        return 2


def _quiet_stdout() -> None:
    """After a broken pipe: point stdout at /dev/null so the interpreter's last flush cannot fail."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def main(argv: list[str] | None = None, *, transport: httpx.BaseTransport | None = None,
         sleep: Callable[[float], None] = time.sleep) -> int:
    """The ``flywheel`` entry point; ``transport`` and ``sleep`` are for tests."""
    args = build_parser().parse_args(argv)
    try:
        code = run(args, transport, sleep)
        sys.stdout.flush()
        return code
    except BrokenPipeError:  # the reader went away (| head): as quiet as a SIGPIPE, without the signal
        _quiet_stdout()
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
