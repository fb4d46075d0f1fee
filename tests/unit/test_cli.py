"""The ``flywheel`` CLI against a stub of the admin API: the request each subcommand makes (method,
path, body, bearer token), what it prints, its errors and exit codes; and, as a real process, in a pipe."""

from __future__ import annotations

import io
import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.admin import cli
from services.admin.cli_format import Style, render_status

REPO = Path(__file__).resolve().parents[2]
TOKEN = "t" * 40
NOW = time.time()

STATUS: dict[str, Any] = {
    "run": "cartpole",
    "policy": {"version": 412, "sha256": "ab" * 32, "published_at": NOW - 3},
    "trainer": {"alive": True, "step": 410, "updates": 410, "samples_trained": 209920, "samples_per_s": 3231.9,
                "last_update_at": NOW - 1, "policy_version": 412, "published_version": 412,
                "stalled": {"since": NOW - 30, "reason": "all 37 fragments since the last update were dropped as "
                                                         "stale (reference version 412)"}},
    "samplers": [
        {"id": "sampler-0", "alive": True, "policy_version": 411, "steps_per_s": 1552.2, "last_seen": NOW - 0.5,
         "paused": False, "paused_since": None},
        {"id": "sampler-1", "alive": True, "policy_version": 410, "steps_per_s": 0.0, "last_seen": NOW - 0.7,
         "paused": True, "paused_since": NOW - 45},
    ],
    "backlog": {"records": 8, "per_partition": {"0": 2, "1": 3, "10": 1, "2": 2}},
    "sync": {"latency_p50_s": 0.18, "latency_p95_s": 0.69},
    "staleness": {"mean": 4.3, "max": 8, "p95": 7.0, "dropped_fraction": 0.012},
    "episode_return": {"mean": 500.0, "count": 100},
    "services": {
        "trainer": {"alive": True, "state": "ok", "reasons": {}, "restarts": 1},
        "paramsync": {"alive": True, "state": "degraded", "reasons": {"store": "move marker failed: timeout"},
                      "restarts": 0},
        "sampler:sampler-0": {"alive": False, "state": "down", "reasons": {}, "restarts": 2},
    },
}


class Stub:
    """An admin API: ``routes[(method, path)]`` is ``(status, json body)``, a callable, or an exception."""

    def __init__(self, routes: dict[tuple[str, str], Any]) -> None:
        self.routes = routes
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        route = self.routes.get((request.method, request.url.path), (404, {"detail": "Not Found"}))
        if callable(route):
            route = route(request)
        if isinstance(route, Exception):
            raise route
        status, body = route
        if isinstance(body, str):
            return httpx.Response(status, text=body)
        return httpx.Response(status, json=body)

    @property
    def last(self) -> httpx.Request:
        return self.requests[-1]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No FLYWHEEL_* from the outside; FLYWHEEL_HOME is an empty temporary directory."""
    for key in list(os.environ):
        if key.startswith("FLYWHEEL_") or key == "NO_COLOR":
            monkeypatch.delenv(key)
    monkeypatch.setenv("FLYWHEEL_HOME", str(tmp_path))
    return tmp_path


def run(capsys: pytest.CaptureFixture[str], argv: list[str], routes: dict[tuple[str, str], Any],
        sleep: Callable[[float], None] = time.sleep) -> tuple[int, str, str, Stub]:
    stub = Stub(routes)
    code = cli.main(["--url", "http://admin.test", *argv], transport=httpx.MockTransport(stub), sleep=sleep)
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return code, captured.out, captured.err, stub


def body(request: httpx.Request) -> Any:
    return json.loads(request.content)


# ---- status ------------------------------------------------------------------------------------
TIME_KEYS = {"published_at", "last_update_at", "since", "last_seen", "paused_since", "at"}


def fresh(doc: Any, delta: float | None = None) -> Any:
    """``doc`` with its times moved to now: NOW is taken at import, maybe minutes before the test runs."""
    delta = time.time() - NOW if delta is None else delta
    if isinstance(doc, dict):
        return {k: (v + delta if k in TIME_KEYS and isinstance(v, float) else fresh(v, delta)) for k, v in doc.items()}
    if isinstance(doc, list):
        return [fresh(v, delta) for v in doc]
    return doc


def test_status_in_words(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _, stub = run(capsys, ["status"], {("GET", "/status"): (200, fresh(STATUS))})
    assert code == 0 and stub.last.method == "GET" and stub.last.url.path == "/status"
    assert "authorization" not in stub.last.headers  # reading needs no token
    # Ages depend on when the test runs (NOW is taken at import): check their shape, not their value.
    assert re.search(r"policy     v412  sha256 abababababab  published \d+\.\ds ago", out), out
    assert re.search(r"STALLED since \d+\.", out) and re.search(r"paused \d+\.", out)
    for text in ["run        cartpole",
                 "trainer    alive  updates 410  weights v412  3232 steps/s  209920 steps trained",
                 "all 37 fragments since the last update were dropped as stale",
                 "samplers   2 alive, 1 paused",
                 "backlog    8 records  (p0 2, p1 3, p2 2, p10 1)", "sync       p50 0.18s  p95 0.69s",
                 "staleness  mean 4.3  p95 7  max 8 versions  dropped 1.2%",
                 "return     mean 500.0 over 100 episodes",
                 "paramsync          degraded  0 restarts", "    store: move marker failed: timeout",
                 "trainer            ok        1 restart", "sampler:sampler-0  down      2 restarts"]:
        assert text in out, text
    s0, s1 = (next(x for x in out.splitlines() if x.startswith(f"  sampler-{i} ")) for i in (0, 1))
    assert "alive" in s0 and "v411" in s0 and "1552 steps/s" in s0 and "paused" not in s0
    assert "paused" in s1 and "v410" in s1
    assert "\x1b" not in out  # not a terminal: no colour


def test_status_of_an_older_server_and_a_fresh_run(capsys: pytest.CaptureFixture[str]) -> None:
    fresh = {"run": "r", "policy": {"version": None, "sha256": None, "published_at": None},
             "trainer": {"alive": False, "step": 0, "updates": 0, "samples_trained": 0, "samples_per_s": 0.0,
                         "last_update_at": None, "policy_version": None},
             "samplers": [{"id": "s", "alive": True, "policy_version": None, "steps_per_s": 0.0, "last_seen": NOW}],
             "backlog": {"records": None, "per_partition": {}}, "sync": {"latency_p50_s": None, "latency_p95_s": None},
             "staleness": {"mean": None, "max": None}, "episode_return": {"mean": None, "count": 0}}
    code, out, _, _ = run(capsys, ["status"], {("GET", "/status"): (200, fresh)})
    assert code == 0 and "trainer    DOWN" in out and "policy     v-" in out and "published never" in out
    assert "backlog    - records" in out and "dropped -" in out and "services" not in out


def test_status_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _, _ = run(capsys, ["status", "--json"], {("GET", "/status"): (200, STATUS)})
    assert code == 0 and json.loads(out) == STATUS


def test_colour_only_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert "\x1b[" in render_status(STATUS, style=Style(True))
    assert "\x1b[" not in render_status(STATUS)
    assert Style.for_stream(Tty()).color and not Style.for_stream(io.StringIO()).color
    monkeypatch.setenv("NO_COLOR", "1")
    assert not Style.for_stream(Tty()).color


def test_status_watch_redraws_until_ctrl_c_and_rides_out_errors(capsys: pytest.CaptureFixture[str]) -> None:
    answers = iter([(200, STATUS), httpx.ConnectError("Connection refused"), (200, STATUS)])
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        if len(slept) == 3:
            raise KeyboardInterrupt

    code, out, err, stub = run(capsys, ["status", "--watch", "0.5"], {("GET", "/status"): lambda r: next(answers)},
                               sleep=sleep)
    assert code == 0 and err == "" and slept == [0.5, 0.5, 0.5] and len(stub.requests) == 3
    assert out.count("run        cartpole") == 2 and out.count("--- ") == 3
    assert "cannot reach the admin API at http://admin.test" in out


def test_status_watch_defaults_to_2_s_and_json_is_one_document_a_line(capsys: pytest.CaptureFixture[str]) -> None:
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        if len(slept) == 2:
            raise KeyboardInterrupt

    code, out, _, _ = run(capsys, ["status", "--watch", "--json"], {("GET", "/status"): (200, STATUS)}, sleep=sleep)
    assert code == 0 and slept == [2.0, 2.0]
    assert [json.loads(x) for x in out.splitlines()] == [STATUS, STATUS]


# ---- actions -----------------------------------------------------------------------------------
def test_sync_sends_the_token_and_waits(capsys: pytest.CaptureFixture[str]) -> None:
    answer = {"request_id": "r1", "policy_version": 7, "synced": True, "waited_s": 0.3,
              "samplers": {"sampler-0": 7, "sampler-1": 7}}
    code, out, _, stub = run(capsys, ["--token", TOKEN, "sync", "--wait", "5"],
                             {("POST", "/policy/sync"): (202, answer)})
    assert code == 0 and stub.last.url.params["wait_s"] == "5.0"
    assert stub.last.headers["authorization"] == f"Bearer {TOKEN}"
    assert out.splitlines() == ["sync to version 7: all live samplers on it (0.3 s)", "  sampler-0: v7",
                                "  sampler-1: v7"]
    code, out, _, _ = run(capsys, ["--token", TOKEN, "sync"],
                          {("POST", "/policy/sync"): (202, {**answer, "synced": False, "samplers": {"s": 6}})})
    assert code == 1 and "NOT all samplers reached it in time" in out


@pytest.mark.parametrize("action", ["pause", "resume"])
def test_pause_and_resume_all_or_one(capsys: pytest.CaptureFixture[str], action: str) -> None:
    def answer(r: httpx.Request) -> tuple[int, dict[str, Any]]:
        return 202, {"request_id": "r2", "action": action, "sampler": body(r).get("sampler")}

    routes = {("POST", f"/samplers/{action}"): answer}
    code, out, _, stub = run(capsys, ["--token", TOKEN, action], routes)
    assert code == 0 and body(stub.last) == {} and stub.last.headers["authorization"] == f"Bearer {TOKEN}"
    assert out.strip() == f"{action} requested for every sampler (request r2)"
    code, out, _, stub = run(capsys, ["--token", TOKEN, action, "sampler-1"], routes)
    assert code == 0 and body(stub.last) == {"sampler": "sampler-1"}
    assert out.strip() == f"{action} requested for sampler sampler-1 (request r2)"


KAFKA_PENDING = "stored; control command not acknowledged by Kafka within 3.0 s: 4 attempts, last: " \
                "KafkaConnectionError: Unable to bootstrap from [('10.0.0.5', 9092)]"


@pytest.mark.parametrize("action", ["pause", "resume"])
def test_pause_and_resume_stored_but_not_acknowledged_exit_3(capsys: pytest.CaptureFixture[str], action: str) -> None:
    answer = {"request_id": "r4", "action": action, "sampler": None, "status": "pending", "reason": KAFKA_PENDING,
              "command_sent": False}
    code, out, err, _ = run(capsys, ["--token", TOKEN, action], {("POST", f"/samplers/{action}"): (202, answer)})
    assert code == cli.EXIT_PENDING == 3 and err == ""
    assert out.strip() == (f"{action} requested for every sampler (request r4): pending: {KAFKA_PENDING}; samplers "
                           "apply it from the store at their next poll; admin keeps sending the command until Kafka "
                           "takes it (flywheel audit shows when: command_sent)")
    sent = {**answer, "status": "sent", "reason": None, "command_sent": True}
    code, out, _, _ = run(capsys, ["--token", TOKEN, action], {("POST", f"/samplers/{action}"): (202, sent)})
    assert code == 0 and out.strip() == f"{action} requested for every sampler (request r4)"


def test_token_from_env_then_home_file_else_none(capsys: pytest.CaptureFixture[str], clean_env: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    routes = {("POST", "/samplers/pause"): (202, {"request_id": "r", "action": "pause", "sampler": None})}
    run(capsys, ["pause"], routes)
    assert "authorization" not in run(capsys, ["pause"], routes)[3].last.headers
    (clean_env / "admin-token").write_text("from-the-file\n")
    assert run(capsys, ["pause"], routes)[3].last.headers["authorization"] == "Bearer from-the-file"
    monkeypatch.setenv("FLYWHEEL_ADMIN_TOKEN", "from-the-env")
    assert run(capsys, ["pause"], routes)[3].last.headers["authorization"] == "Bearer from-the-env"
    assert run(capsys, ["--token", "from-arg", "pause"], routes)[3].last.headers["authorization"] == "Bearer from-arg"


def test_versions(capsys: pytest.CaptureFixture[str]) -> None:
    versions = {"current": 9, "versions": [
        {"version": 8, "sha256": "cd" * 32, "published_at": NOW - 100, "trainer_step": 80, "rollback_of": None,
         "return_mean": 180.25},
        {"version": 9, "sha256": "ef" * 32, "published_at": NOW - 10, "trainer_step": 90, "rollback_of": 7,
         "return_mean": None}]}
    code, out, _, stub = run(capsys, ["versions"], {("GET", "/policy/versions"): (200, versions)})
    assert code == 0 and stub.last.method == "GET"
    lines = out.splitlines()
    assert lines[0].split() == ["version", "published", "step", "sha256", "return"]
    assert lines[1].startswith("*       9 ") and "efefefefefef" in lines[1] and lines[1].endswith("rollback of v7")
    assert lines[2].startswith("        8 ") and "180.2" in lines[2] and "cdcdcdcdcdcd" in lines[2]
    code, out, _, _ = run(capsys, ["versions"], {("GET", "/policy/versions"): (200, {"current": None,
                                                                                      "versions": []})})
    assert code == 0 and out.strip() == "no policy has been published yet"


def test_rollback(capsys: pytest.CaptureFixture[str]) -> None:
    routes = {("POST", "/policy/rollback"): (202, {"request_id": "r3", "version": 7, "new_version": 10})}
    code, out, _, stub = run(capsys, ["--token", TOKEN, "rollback", "7"], routes)
    assert code == 0 and body(stub.last) == {"version": 7} and stub.last.headers["authorization"] == f"Bearer {TOKEN}"
    assert out.strip() == "rollback to v7 requested (request r3): published as v10"
    pending = {"request_id": "r5", "version": 7, "status": "pending", "new_version": None, "command_sent": False,
               "reason": f"paramsync not running; {KAFKA_PENDING}"}
    code, out, _, _ = run(capsys, ["--token", TOKEN, "rollback", "7"], {("POST", "/policy/rollback"): (202, pending)})
    assert code == 3 and out.strip() == (f"rollback to v7 requested (request r5): pending: paramsync not running; "
                                         f"{KAFKA_PENDING}; paramsync applies it when it runs (flywheel versions "
                                         "lists pending rollbacks)")


# ---- config ------------------------------------------------------------------------------------
CONFIG = {"revision": 3, "settings": {"sampler.max_backlog": 6, "trainer.learning_rate": 0.001,
                                      "trainer.note": "x"}, "at": NOW, "actor": "operator"}


def test_config_get(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _, _ = run(capsys, ["config", "get"], {("GET", "/config"): (200, CONFIG)})
    lines = out.splitlines()
    assert code == 0 and lines[0].startswith("revision 3 at ") and lines[0].endswith(" by operator")
    assert lines[1:] == ["  sampler.max_backlog   = 6", "  trainer.learning_rate = 0.001",
                         '  trainer.note          = "x"']
    code, out, _, _ = run(capsys, ["config", "get", "--json"], {("GET", "/config"): (200, CONFIG)})
    assert json.loads(out) == CONFIG


def test_config_set_parses_values_as_json_when_it_can(capsys: pytest.CaptureFixture[str]) -> None:
    answer = {"revision": 4, "settings": {}, "changes": {"sampler.max_backlog": {"old": 6, "new": 10},
                                                         "trainer.note": {"old": "x", "new": "hello world"}}}
    code, out, _, stub = run(capsys, ["--token", TOKEN, "config", "set", "sampler.max_backlog=10", "a=0.5", "b=true",
                                      "c=null", "d=hello world", "e=[1, 2]", "f=NaN", "g=", "h=1e-4", "i=a=b",
                                      'j="7"'],
                             {("PATCH", "/config"): (200, answer)})
    assert code == 0 and stub.last.method == "PATCH" and stub.last.headers["authorization"] == f"Bearer {TOKEN}"
    assert body(stub.last) == {"sampler.max_backlog": 10, "a": 0.5, "b": True, "c": None, "d": "hello world",
                               "e": [1, 2], "f": "NaN", "g": "", "h": 1e-4, "i": "a=b", "j": "7"}
    assert out.splitlines() == ["revision 4", "  sampler.max_backlog: 6 -> 10", '  trainer.note: "x" -> "hello world"']
    code, out, _, _ = run(capsys, ["config", "set", "a=1"],
                          {("PATCH", "/config"): (200, {"revision": 4, "settings": {}, "changes": {}})})
    assert out.strip() == "revision 4: nothing changed"


@pytest.mark.parametrize(("argv", "method", "path"), [(["config", "set", "a=1"], "PATCH", "/config"),
                                                    (["config", "revert", "2"], "POST", "/config/revert")])
def test_config_stored_but_not_acknowledged_exit_3(capsys: pytest.CaptureFixture[str], argv: list[str], method: str,
                                                   path: str) -> None:
    answer = {"revision": 5, "settings": {}, "changes": {"a": {"old": 0, "new": 1}}, "request_id": "c1",
              "status": "pending", "reason": KAFKA_PENDING, "command_sent": False}
    code, out, _, _ = run(capsys, ["--token", TOKEN, *argv], {(method, path): (202, answer)})
    assert code == 3 and out.splitlines() == [
        "revision 5", "  a: 0 -> 1", f"pending: {KAFKA_PENDING}; the services apply revision 5 at their next poll of "
        "the store; admin keeps sending the command until Kafka takes it (flywheel audit shows when: command_sent)"]
    code, _, _, _ = run(capsys, ["--token", TOKEN, *argv], {(method, path): (200, {**answer, "status": "sent"})})
    assert code == 0


def test_config_set_needs_key_value(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["config", "set", "novalue"])
    assert exc.value.code == 2 and "expected KEY=VALUE" in capsys.readouterr().err


def test_config_history_and_revert(capsys: pytest.CaptureFixture[str]) -> None:
    history = {"revisions": [
        {"revision": 0, "settings": {}, "changes": {}, "actor": "system", "at": NOW - 50, "reverted_from": None},
        {"revision": 1, "settings": {}, "changes": {"a": {"old": 1, "new": 2}, "b": {"old": "x", "new": "y"}},
         "actor": "operator", "at": NOW - 40, "reverted_from": None},
        {"revision": 2, "settings": {}, "changes": {"a": {"old": 2, "new": 1}}, "actor": "operator",
         "at": NOW - 30, "reverted_from": 0}]}
    code, out, _, _ = run(capsys, ["config", "history"], {("GET", "/config/history"): (200, history)})
    lines = out.splitlines()
    assert code == 0 and lines[0].startswith("r0  ") and lines[0].endswith("system  (no change)")
    assert lines[1].endswith("operator") and lines[2:4] == ["    a: 1 -> 2", '    b: "x" -> "y"']
    assert lines[4].endswith("operator  (revert to r0)  a: 2 -> 1")
    answer = {"revision": 3, "settings": {}, "changes": {"a": {"old": 1, "new": 2}}}
    code, out, _, stub = run(capsys, ["--token", TOKEN, "config", "revert", "1"],
                             {("POST", "/config/revert"): (200, answer)})
    assert code == 0 and body(stub.last) == {"revision": 1} and stub.last.headers["authorization"] == f"Bearer {TOKEN}"
    assert out.splitlines() == ["revision 3", "  a: 1 -> 2"]


def test_audit(capsys: pytest.CaptureFixture[str]) -> None:
    entries = {"entries": [
        {"at": NOW - 5, "actor": "operator", "action": "pause", "params": {"sampler": "sampler-1"}, "outcome": "ok"},
        {"at": NOW - 1, "actor": "trainer", "action": "candidate_resent", "params": {}, "outcome": "sent"}]}
    code, out, _, stub = run(capsys, ["audit", "--limit", "5"], {("GET", "/audit"): (200, entries)})
    assert code == 0 and stub.last.url.params["limit"] == "5"
    lines = out.splitlines()
    assert lines[0].endswith('operator  pause             ok  sampler="sampler-1"')
    assert lines[1].endswith("trainer   candidate_resent  sent")
    code, out, _, stub = run(capsys, ["audit"], {("GET", "/audit"): (200, {"entries": []})})
    assert "limit" not in stub.last.url.params and out.strip() == "no audit entries"


# ---- errors ------------------------------------------------------------------------------------
def test_401_shows_the_servers_reason(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err, _ = run(capsys, ["--token", "wrong", "sync"],
                            {("POST", "/policy/sync"): (401, {"detail": "missing or wrong bearer token"})})
    assert code == 1 and out == ""
    assert "flywheel: POST /policy/sync: 401 missing or wrong bearer token" in err and "--token" in err


def test_422_shows_each_field_and_message(capsys: pytest.CaptureFixture[str]) -> None:
    detail = [{"type": "greater_than", "loc": ["body", "sampler.max_backlog"], "msg": "Input should be greater than 0",
               "input": -1},
              {"type": "extra_forbidden", "loc": ["body", "nope"], "msg": "Extra inputs are not permitted"},
              {"type": "float_parsing", "loc": ["query", "wait_s"], "msg": "Input should be a valid number"}]
    code, _, err, _ = run(capsys, ["config", "set", "sampler.max_backlog=-1", "nope=1"],
                          {("PATCH", "/config"): (422, {"detail": detail})})
    assert code == 1
    assert err.splitlines() == ["flywheel: PATCH /config: 422 sampler.max_backlog: Input should be greater than 0",
                                "nope: Extra inputs are not permitted", "wait_s: Input should be a valid number"]


@pytest.mark.parametrize(("status", "answer", "shown"), [
    (409, {"detail": "no policy has been published yet"}, "409 no policy has been published yet"),
    (503, {"detail": "could not send the sync command, Kafka is unreachable"}, "503 could not send the sync"),
    (500, "Internal Server Error", "500 Internal Server Error"),
    (404, {"detail": "Not Found"}, "404 Not Found"),
])
def test_other_errors_exit_1_with_the_reason(capsys: pytest.CaptureFixture[str], status: int, answer: Any,
                                             shown: str) -> None:
    code, _, err, _ = run(capsys, ["sync"], {("POST", "/policy/sync"): (status, answer)})
    assert code == 1 and shown in err


def test_an_answer_that_is_not_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err, _ = run(capsys, ["status"], {("GET", "/status"): (200, "<html>a proxy</html>")})
    assert code == 1 and "not JSON" in err


def test_connection_refused_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["--url", "http://127.0.0.1:9", "versions"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("flywheel: cannot reach the admin API at http://127.0.0.1:9")
    assert "Traceback" not in err
    code, _, err, _ = run(capsys, ["status"], {("GET", "/status"): httpx.ReadTimeout("slow")})
    assert code == 2 and "did not answer in time" in err


# ---- trace -------------------------------------------------------------------------------------
SID = "5f0c8e2a9d7b4c61a3e2f10b8c9d7e6a"


def _log(event: str, t: float, service: str, **kw: Any) -> str:
    ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t * 1e6) % 1000000:06d}Z"
    return json.dumps({"service": service, "run": "cartpole", "event": event, "level": "info", "timestamp": ts, **kw})


def _sample_lines() -> dict[str, list[str]]:
    frag = {"sample_id": SID, "sampler_id": "sampler-0", "policy_version": 3, "partition": 1, "offset": 40}
    return {
        "sampler-0": [_log("config_resolved", NOW, "sampler"), _log("fragment_produced", NOW + 1, "sampler", steps=64,
                                                                     episodes=2, **frag)],
        "trainer": [_log("config_resolved", NOW, "trainer"), _log("fragment_consumed", NOW + 2, "trainer", **frag),
                    _log("config_resolved", NOW + 5, "trainer"), _log("fragment_consumed", NOW + 6, "trainer", **frag),
                    _log("fragment_trained", NOW + 7, "trainer", update=4, staleness=1, **frag),
                    _log("update_done", NOW + 7.1, "trainer", update=4, policy_loss=-0.02, value_loss=0.4)],
    }


def test_trace_from_the_log_directory(capsys: pytest.CaptureFixture[str], clean_env: Path) -> None:
    logs = clean_env / "logs"
    logs.mkdir()
    for name, lines in _sample_lines().items():
        (logs / f"{name}.log").write_text("\n".join(lines) + "\n")
    code, out, _, stub = run(capsys, ["trace", SID], {})
    assert code == 0 and stub.requests == []
    lines = out.splitlines()
    assert lines[0] == f"sample {SID}: trained"
    assert "+0.000s  sampler-0  produced by sampler-0 with policy v3, partition 1, offset 40" in lines[1]
    assert "+1.000s  trainer    consumed from partition 1, offset 40" in lines[2]
    assert lines[3].startswith("---- ") and lines[3].endswith("trainer restarted (run 2) ----")
    assert "+5.000s  trainer    consumed from partition 1" in lines[4]
    assert "+6.000s  trainer    trained in update 4, staleness 1 (policy_loss -0.02, value_loss 0.4)" in lines[5]
    code, out, _, _ = run(capsys, ["trace", SID, "--json"], {})
    result = json.loads(out)
    assert result["outcome"] == "trained" and [s["kind"] for s in result["steps"]] == [
        "produced", "consumed", "restart", "consumed", "trained"]


def test_trace_from_a_file_and_from_compose_logs_on_stdin(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    lines = _sample_lines()
    file = tmp_path / "trainer.log"
    file.write_text("\n".join(lines["trainer"]) + "\n")
    code, out, _, _ = run(capsys, ["trace", SID, str(file)], {})
    assert code == 0 and "produced" not in out and "trained in update 4" in out
    compose = [f"sampler-1  | {x}" for x in lines["sampler-0"]] + [f"trainer-1  | {x}" for x in lines["trainer"]]
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(["Attaching to trainer-1, sampler-1", *compose]) + "\n"))
    code, out, _, _ = run(capsys, ["trace", SID, "-"], {})
    assert code == 0 and "sampler-1  produced by sampler-0" in out and "trainer-1 restarted (run 2)" in out


def test_trace_not_found_and_no_logs(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "trainer.log").write_text("\n".join(_sample_lines()["trainer"]) + "\n")
    code, out, err, _ = run(capsys, ["trace", "f" * 32, "--logs", str(tmp_path)], {})
    assert code == 1 and out == "" and f"no log line mentions sample {'f' * 32} in {tmp_path}" in err
    code, _, err, _ = run(capsys, ["trace", SID, "--logs", str(tmp_path / "nope")], {})
    assert code == 1 and "no logs at" in err
    code, _, err, _ = run(capsys, ["trace", SID, "x.log", "--logs", str(tmp_path)], {})
    assert code == 2 and "not both" in err


# ---- a real process, a real server, a real pipe ------------------------------------------------
@pytest.fixture
def server() -> Iterator[tuple[str, dict[str, Any]]]:
    """A tiny HTTP server answering GET with ``answers[path]`` as JSON, in a thread."""
    answers: dict[str, Any] = {}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            data = json.dumps(answers.get(self.path.split("?")[0], {"detail": "Not Found"})).encode()
            self.send_response(200 if self.path.split("?")[0] in answers else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            try:
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                pass

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
            return

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", answers
    finally:
        httpd.shutdown()
        httpd.server_close()


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}


@pytest.mark.parametrize(("args", "first"), [(["status"], "run       "), (["status", "--watch", "0.05"], "--- "),
                                             (["config", "get"], "revision 3")],
                         ids=["status", "status-watch", "large-config-get"])
def test_in_a_pipe_to_head_no_traceback(server: tuple[str, dict[str, Any]], tmp_path: Path, args: list[str],
                                        first: str) -> None:
    url, answers = server
    answers["/status"] = STATUS
    answers["/config"] = {**CONFIG, "settings": {f"key.number_{i}": "v" * 40 for i in range(4000)}}  # > a pipe buffer
    err = tmp_path / "stderr"
    cmd = f"{sys.executable} -m services.admin.cli --url {url} {' '.join(args)} 2>{err} | head -c 10; " \
          f"echo \" rc=${{PIPESTATUS[0]}}\""
    proc = subprocess.run(["bash", "-c", cmd], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=60)
    assert proc.stdout.startswith(first), proc.stdout
    assert err.read_text() == ""
    rc = int(proc.stdout.rsplit("rc=", 1)[1])
    # A small answer may fit in the pipe before head exits (0); a long one or a watch meets the closed pipe.
    assert rc in ((0, cli.EXIT_BROKEN_PIPE) if args == ["status"] else (cli.EXIT_BROKEN_PIPE,))


def test_watch_on_a_terminal_redraws_in_colour_and_ctrl_c_ends_it_quietly(server: tuple[str, dict[str, Any]]) -> None:
    url, answers = server
    answers["/status"] = STATUS
    master, slave = pty.openpty()
    # SIGINT back to its default in the child: a test run started in the background by a shell without job
    # control inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler (what a user's
    # terminal would not do).
    proc = subprocess.Popen([sys.executable, "-m", "services.admin.cli", "--url", url, "status", "--watch", "0.1"],
                            cwd=REPO, env={**_env(), "TERM": "xterm"}, stdin=subprocess.DEVNULL, stdout=slave,
                            stderr=slave, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    os.close(slave)
    seen = b""
    deadline = time.monotonic() + 30
    try:
        while seen.count(b"run        cartpole") < 2 and time.monotonic() < deadline:
            if select.select([master], [], [], 0.5)[0]:
                seen += os.read(master, 65536)
        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends
        # Keep reading while it exits, as a terminal does: a full pty buffer would block its last writes.
        deadline = time.monotonic() + 30
        closed = False
        while not closed and time.monotonic() < deadline and (proc.poll() is None or
                                                              select.select([master], [], [], 0.2)[0]):
            if select.select([master], [], [], 0.2)[0]:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # the terminal's other end closed
                    chunk = b""
                closed = not chunk
                seen += chunk
        assert proc.wait(timeout=5) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    assert seen.count(b"\x1b[H\x1b[2J") >= 2 and b"\x1b[32malive" in seen
    assert b"Traceback" not in seen and b"KeyboardInterrupt" not in seen


def test_entry_point_help_is_fast_and_light() -> None:
    code = "import sys, services.admin.cli; print(sorted(m for m in ('torch', 'aiokafka', 'fastapi', 'gymnasium') " \
           "if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=60)
    assert proc.stdout.strip() == "[]", proc.stderr
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "services.admin.cli", "--help"], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "trace" in proc.stdout and time.monotonic() - t0 < 5


def test_status_names_the_trainers_compute_choice_and_a_loss(capsys: pytest.CaptureFixture[str]) -> None:
    doc = fresh(STATUS)
    doc["trainer"].update({
        "records_lost": 17, "records_lost_partitions": [0, 3], "learner_busy_fraction": 0.92,
        "compute": {"precision": "bf16", "threads": 2, "device": "cpu",
                    "precision_reason": "auto: ... (1.41x) with 2 thread(s): bf16, at least 1.3x faster"}})
    code, out, _, _ = run(capsys, ["status"], {("GET", "/status"): (200, doc)})
    assert code == 0
    assert "bf16, 2 thread(s) on cpu, learner busy 92% of the last minute (auto: ... (1.41x)" in out, out
    assert "LOST 17 record(s) left the log before training, partitions 0, 3 (flywheel verify names them)" in out, out
    doc["trainer"]["compute"]["cpus"] = "0"  # pinned by trainer.dedicated_cores
    code, out, _, _ = run(capsys, ["status"], {("GET", "/status"): (200, doc)})
    assert "bf16, 2 thread(s) on cpu (CPUs 0), learner busy 92%" in out, out
    code, out, _, _ = run(capsys, ["status"], {("GET", "/status"): (200, fresh(STATUS))})
    assert code == 0 and "LOST" not in out and "thread(s) on" not in out  # an older server: neither line
