"""Named operators (issue 43, item 4): a tokens file of operator names and token hashes, the audit naming the
operator, reads closed unless ``admin.public_reads``. The admin runs in-process on a MemoryBus and a local store."""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.admin import cli
from services.admin.__main__ import admin_token_problem, build
from services.admin.app import create_app
from services.admin.deps import Operators, parse_tokens
from services.admin.state import AdminState
from shared.bus import MemoryBus
from shared.logging import configure_logging
from shared.settings import ConfigError, Settings, load_settings

ALICE, BOB, LEGACY = "alice-token-" + "a" * 40, "bob-token-" + "b" * 40, "legacy-admin-token-" + "c" * 40
WRITES: list[tuple[str, str, Any]] = [
    ("POST", "/samplers/pause", {}), ("POST", "/samplers/resume", {}), ("POST", "/policy/sync", None),
    ("POST", "/policy/rollback", {"version": 1}), ("PATCH", "/config", {"trainer.learning_rate": 0.001}),
    ("POST", "/config/revert", {"revision": 0})]
READS = ["/status", "/status/history", "/policy/versions", "/audit", "/config", "/config/history",
         "/trace/0123456789abcdef0123456789abcdef"]


def sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def tokens_file(tmp_path: Path, text: str | None = None) -> Path:
    path = tmp_path / "operators.tokens"
    path.write_text(text if text is not None else f"# who may operate this run\nalice {sha(ALICE)}\n\n"
                                                  f"bob   {sha(BOB)}  # on call\n")
    return path


def settings(tmp_path: Path, **admin: str) -> Settings:
    env = {"FLYWHEEL_RUN": "ops", "FLYWHEEL_STORE_BACKEND": "local", "FLYWHEEL_STORE_LOCAL_ROOT": str(tmp_path / "s"),
           **{f"FLYWHEEL_ADMIN_{k.upper()}": v for k, v in admin.items()}}
    return load_settings(None, environ=env)


@pytest.fixture
def logs() -> io.StringIO:
    stream = io.StringIO()
    configure_logging("admin", "ops", stream=stream)
    return stream


async def _client(s: Settings) -> AsyncIterator[tuple[httpx.AsyncClient, AdminState]]:
    state = AdminState(s, bus=MemoryBus().bus())
    await state.start()
    try:
        transport = httpx.ASGITransport(app=create_app(state), client=("10.1.2.3", 4567))
        async with httpx.AsyncClient(transport=transport, base_url="http://admin") as client:
            yield client, state
    finally:
        await state.background.stop()
        await state.stop()


@pytest.fixture
async def api(tmp_path: Path, logs: io.StringIO) -> AsyncIterator[tuple[httpx.AsyncClient, AdminState]]:
    """Three operators: alice and bob from the tokens file, ``admin`` from admin.token. Reads closed (default)."""
    async for pair in _client(settings(tmp_path, tokens_file=str(tokens_file(tmp_path)), token=LEGACY)):
        yield pair


@pytest.fixture
async def open_api(tmp_path: Path, logs: io.StringIO) -> AsyncIterator[tuple[httpx.AsyncClient, AdminState]]:
    async for pair in _client(settings(tmp_path, tokens_file=str(tokens_file(tmp_path)), public_reads="true")):
        yield pair


# ---- the audit names the operator ------------------------------------------------------------------
async def test_each_operators_writes_are_audited_and_logged_with_its_own_name(api: Any, logs: io.StringIO) -> None:
    client, _ = api
    assert (await client.post("/samplers/pause", json={}, headers=bearer(ALICE))).status_code == 202
    r = await client.patch("/config", json={"trainer.learning_rate": 0.0007}, headers=bearer(BOB))
    assert r.status_code == 200, r.text
    assert (await client.post("/samplers/resume", json={}, headers=bearer(LEGACY))).status_code == 202
    assert (await client.post("/config/revert", json={"revision": 0}, headers=bearer(ALICE))).status_code == 200
    entries = (await client.get("/audit", headers=bearer(BOB))).json()["entries"]
    assert [(e["actor"], e["action"]) for e in entries] == [
        ("alice", "pause"), ("bob", "config_change"), ("admin", "resume"), ("alice", "config_revert")]
    history = (await client.get("/config/history", headers=bearer(ALICE))).json()["revisions"]
    assert [h["actor"] for h in history] == ["bob", "alice"]
    assert (await client.get("/config", headers=bearer(ALICE))).json()["actor"] == "alice"
    lines = [json.loads(x) for x in logs.getvalue().splitlines()]
    asked = [(x["operator"], x["method"], x["path"]) for x in lines if x["event"] == "operator_request"]
    assert asked == [("alice", "POST", "/samplers/pause"), ("bob", "PATCH", "/config"),
                     ("admin", "POST", "/samplers/resume"), ("alice", "POST", "/config/revert")]
    # The commands go out from admin's sender task, which the first request started: its lines do not carry that
    # request's operator (it sends the others' commands too).
    sent = [x for x in lines if x["event"] == "operator_command_sent"]
    assert len(sent) == 4 and all("operator" not in x for x in sent), sent


async def test_lines_logged_while_a_write_runs_carry_the_operator(api: Any, logs: io.StringIO,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    client, state = api

    def store_down(*_a: Any) -> None:
        raise OSError("store down")

    monkeypatch.setattr(state.audit, "append", store_down)
    r = await client.patch("/config", json={"trainer.learning_rate": 0.0007}, headers=bearer(BOB))
    assert r.status_code == 200, r.text
    await client.get("/status", headers=bearer(ALICE))  # a read: no operator_request line
    lines = [json.loads(x) for x in logs.getvalue().splitlines()]
    failed = [x for x in lines if x["event"] == "audit_write_failed"]
    assert len(failed) == 1 and failed[0]["operator"] == "bob" and failed[0]["actor"] == "bob", failed
    assert [x["operator"] for x in lines if x["event"] == "operator_request"] == ["bob"]
    # the context is the request's: a line logged afterwards does not carry it
    from shared.logging import get_logger

    get_logger().info("after_the_request")
    after = [json.loads(x) for x in logs.getvalue().splitlines() if "after_the_request" in x]
    assert after and "operator" not in after[0]


# ---- writes: 401 without a token, 403 with a wrong one -------------------------------------------------
@pytest.mark.parametrize(("method", "path", "body"), WRITES)
async def test_every_write_needs_an_operators_token(api: Any, method: str, path: str, body: Any) -> None:
    client, _ = api
    r = await client.request(method, path, json=body)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", (path, r.text)
    for wrong in ("nope", ALICE[:-1], sha(ALICE), ALICE + "x"):
        r = await client.request(method, path, json=body, headers=bearer(wrong))
        assert r.status_code == 403, (path, wrong, r.text)
        assert "wrong bearer token" in r.json()["detail"]
    r = await client.request(method, path, json=body, headers=bearer(BOB))
    assert r.status_code not in (401, 403), (path, r.text)


async def test_refused_writes_change_nothing_and_are_audited_as_refused(api: Any) -> None:
    client, state = api
    await client.post("/samplers/pause", json={}, headers=bearer("wrong"))
    await client.patch("/config", json={"trainer.learning_rate": 0.0007})
    assert state.runtime_config.latest() is None
    entries = state.audit.entries(100)
    assert [(e.actor, e.action, e.outcome) for e in entries] == [
        ("anonymous@10.1.2.3", "request_refused", "refused 403"), ("anonymous@10.1.2.3", "request_refused",
                                                                   "refused 401")]
    assert [(e.params["method"], e.params["path"], e.params["reason"], e.params["access"]) for e in entries] == [
        ("POST", "/samplers/pause", "wrong_token", "write"), ("PATCH", "/config", "no_token", "write")]


def _refused_count(reason: str, access: str) -> float:
    from services.admin.refusals import REFUSED

    return REFUSED.labels(reason, access)._value.get()  # type: ignore[no-any-return]


async def test_refusals_are_audited_once_a_window_per_client_and_reason_and_every_one_counted_and_logged(
        api: Any, logs: io.StringIO) -> None:
    """A client without a token cannot make the admin write an audit object per request: the first refusal of each
    (client, reason) a window is audited, the next entry says how many were held back; the metric and the log
    count every one, and no line carries the token."""
    client, state = api
    refusals = client._transport.app.state.request_refusals
    now = [1000.0]
    refusals.clock = lambda: now[0]
    counted = _refused_count("no_token", "read"), _refused_count("wrong_token", "read")
    for _ in range(5):
        assert (await client.get("/status")).status_code == 401
    for _ in range(3):
        assert (await client.get("/audit", headers=bearer("guess-" + "9" * 40))).status_code == 403
    assert [e.params["reason"] for e in state.audit.entries(100)] == ["no_token", "wrong_token"]
    now[0] += refusals.window_s + 1
    assert (await client.get("/config")).status_code == 401
    entries = state.audit.entries(100)
    assert [(e.params["reason"], e.params["held_back_since_last"]) for e in entries] == [
        ("no_token", 0), ("wrong_token", 0), ("no_token", 4)]
    assert (_refused_count("no_token", "read") - counted[0], _refused_count("wrong_token", "read") - counted[1]) == \
        (6, 3)
    lines = [json.loads(x) for x in logs.getvalue().splitlines() if '"request_refused"' in x]
    assert len(lines) == 9 and {x["client"] for x in lines} == {"10.1.2.3"}
    assert "9" * 40 not in logs.getvalue()
    ok = (await client.get("/status", headers=bearer(ALICE))).status_code
    assert ok == 200 and len(state.audit.entries(100)) == 3  # a read with a token is no refusal


async def test_a_refusal_is_answered_even_when_its_audit_entry_cannot_be_written(
        api: Any, logs: io.StringIO, monkeypatch: pytest.MonkeyPatch) -> None:
    client, state = api

    def store_down(*_a: Any) -> None:
        raise OSError("store down")

    monkeypatch.setattr(state.audit, "append", store_down)
    assert (await client.post("/samplers/pause", json={})).status_code == 401
    failed = [json.loads(x) for x in logs.getvalue().splitlines() if "audit_write_failed" in x]
    assert [(x["action"], x["actor"]) for x in failed] == [("request_refused", "anonymous@10.1.2.3")]


def test_the_refusals_remembered_are_bounded_and_the_oldest_go_first() -> None:
    from services.admin.refusals import RequestRefusals

    r = RequestRefusals(window_s=60.0, max_clients=2, clock=lambda: 5.0)
    assert r.note("a", 401, "read", "GET", "/status") is not None
    assert r.note("a", 401, "read", "GET", "/status") is None  # within the window: held back
    assert r.note("b", 401, "read", "GET", "/status") is not None
    assert r.note("c", 403, "read", "GET", "/status") is not None  # a third pair: "a" is forgotten
    again = r.note("a", 401, "read", "GET", "/status")
    assert again is not None and again["held_back_since_last"] == 0


# ---- reads: closed by default, open with admin.public_reads -----------------------------------------
@pytest.mark.parametrize("path", READS)
async def test_reads_are_closed_by_default(api: Any, path: str) -> None:
    client, _ = api
    assert (await client.get(path)).status_code == 401, path
    assert (await client.get(path, headers=bearer("wrong"))).status_code == 403, path
    r = await client.get(path, headers=bearer(ALICE))
    assert r.status_code not in (401, 403), (path, r.text)  # /trace: 404 (no logs here), the others 200
    assert r.status_code == (404 if path.startswith("/trace/") else 200), (path, r.text)


async def test_health_metrics_and_the_pages_stay_open(api: Any) -> None:
    client, _ = api
    for path in ("/healthz", "/metrics", "/", "/docs", "/openapi.json"):
        assert (await client.get(path)).status_code == 200, path


async def test_the_schema_says_which_endpoints_need_a_token(api: Any, open_api: Any) -> None:
    closed = (await api[0].get("/openapi.json")).json()["paths"]
    opened = (await open_api[0].get("/openapi.json")).json()["paths"]
    for path in ("/status", "/audit", "/config"):
        assert closed[path]["get"]["security"] == [{"HTTPBearer": []}]
        assert {"401", "403"} <= set(closed[path]["get"]["responses"])
        assert "security" not in opened[path]["get"] and "401" not in opened[path]["get"]["responses"]
    for paths in (closed, opened):
        assert {"401", "403"} <= set(paths["/samplers/pause"]["post"]["responses"])
        assert paths["/config"]["patch"]["security"] == [{"HTTPBearer": []}]


@pytest.mark.parametrize("path", READS)
async def test_public_reads_open_the_reads_only(open_api: Any, path: str) -> None:
    client, _ = open_api
    r = await client.get(path)
    assert r.status_code == (404 if path.startswith("/trace/") else 200), (path, r.text)


@pytest.mark.parametrize(("method", "path", "body"), WRITES)
async def test_public_reads_leave_writes_closed(open_api: Any, method: str, path: str, body: Any) -> None:
    client, _ = open_api
    assert (await client.request(method, path, json=body)).status_code == 401
    assert (await client.request(method, path, json=body, headers=bearer("wrong"))).status_code == 403


def test_public_reads_are_off_by_default() -> None:
    assert load_settings(None, environ={}).admin.public_reads is False


def test_the_local_stack_opens_the_reads_for_its_status_page(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from devstack import LocalStack
    from devstack.infra import InfraEndpoints

    monkeypatch.delenv("FLYWHEEL_ADMIN_PUBLIC_READS", raising=False)
    stack = LocalStack(tmp_path, infra=InfraEndpoints("127.0.0.1:1", "http://127.0.0.1:2", "flywheel"),
                       progress=lambda _m: None)
    assert stack.service_env("admin")["FLYWHEEL_ADMIN_PUBLIC_READS"] == "true"
    assert "FLYWHEEL_ADMIN_PUBLIC_READS" not in stack.service_env("trainer")
    monkeypatch.setenv("FLYWHEEL_ADMIN_PUBLIC_READS", "false")  # an operator may close them there too
    assert stack.service_env("admin")["FLYWHEEL_ADMIN_PUBLIC_READS"] == "false"


def test_compose_leaves_the_reads_closed() -> None:
    compose = (Path(__file__).resolve().parents[2] / "docker-compose.yml").read_text()
    assert "PUBLIC_READS" not in compose and "public_reads" not in compose


# ---- the tokens file ---------------------------------------------------------------------------------
def test_operators_are_identified_by_their_tokens_hash(tmp_path: Path) -> None:
    ops = Operators.from_settings(settings(tmp_path, tokens_file=str(tokens_file(tmp_path)), token=LEGACY).admin)
    assert ops.names == ["admin", "alice", "bob"]
    assert (ops.identify(ALICE), ops.identify(BOB), ops.identify(LEGACY)) == ("alice", "bob", "admin")
    assert ops.identify("") is None and ops.identify(sha(ALICE)) is None and ops.identify(ALICE.upper()) is None
    only_legacy = Operators.from_settings(settings(tmp_path, token=LEGACY).admin)
    assert only_legacy.names == ["admin"] and only_legacy.identify(ALICE) is None


def test_hashes_are_compared_in_constant_time_with_every_operator(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from services.admin import deps

    calls: list[tuple[bytes, bytes]] = []
    real = deps.hmac.compare_digest
    monkeypatch.setattr(deps.hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
    ops = Operators.from_settings(settings(tmp_path, tokens_file=str(tokens_file(tmp_path))).admin)
    assert ops.identify(ALICE) == "alice"
    assert len(calls) == 2  # bob's hash too, after alice's matched


@pytest.mark.parametrize(("text", "says"), [
    ("alice\n", "line 1: expected '<operator name> <sha256 hex of the token>', got 1 field"),
    (f"alice {'0' * 64} extra\n", "line 1: expected '<operator name> <sha256 hex of the token>', got 3 fields"),
    (f"# c\nalice {'0' * 63}\n", "line 2: operator 'alice': the token hash is not 64 hex digits"),
    (f"alice {'g' * 64}\n", "the token hash is not 64 hex digits"),
    (f"alice {'0' * 64}\nbob {'1' * 64}\nalice {'2' * 64}\n",
     "line 3: operator 'alice' is listed twice (first on line 1)"),
    (f"alice {'0' * 64}\nbob {'0' * 64}\n", "line 2: operator 'bob' has the same token as 'alice'"),
    (f"-alice {'0' * 64}\n", "line 1: the operator name is not"),
    ("", "lists no operator"),
    ("# nobody yet\n\n   \n", "lists no operator"),
], ids=["one-field", "three-fields", "short-hash", "not-hex", "duplicate-name", "duplicate-token", "bad-name",
        "empty", "only-comments"])
def test_tokens_file_errors_name_the_field_and_the_line(tmp_path: Path, text: str, says: str) -> None:
    path = tokens_file(tmp_path, text)
    with pytest.raises(ConfigError) as exc:
        Operators.from_settings(settings(tmp_path, tokens_file=str(path)).admin)
    assert str(exc.value).startswith(f"admin.tokens_file ({path})") and says in str(exc.value), str(exc.value)


def test_a_token_pasted_instead_of_its_hash_is_never_echoed(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_tokens(f"alice {ALICE}\n", "f")
    assert "admin.tokens_file" in str(exc.value) and ALICE not in str(exc.value)


def test_a_missing_file_and_a_clash_with_admin_token_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^admin.tokens_file: cannot read .*nowhere"):
        Operators.from_settings(settings(tmp_path, tokens_file=str(tmp_path / "nowhere")).admin)
    named_admin = tokens_file(tmp_path, f"admin {sha(ALICE)}\n")
    with pytest.raises(ConfigError, match=r"admin.tokens_file lists an operator named 'admin'"):
        Operators.from_settings(settings(tmp_path, tokens_file=str(named_admin), token=LEGACY).admin)
    same = tokens_file(tmp_path, f"carol {sha(LEGACY)}\n")
    with pytest.raises(ConfigError, match=r"admin.tokens_file: operator 'carol' has the token of admin.token"):
        Operators.from_settings(settings(tmp_path, tokens_file=str(same), token=LEGACY).admin)


def test_admin_refuses_to_start_with_a_bad_tokens_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tokens_file(tmp_path, f"alice {ALICE}\n")
    with pytest.raises(SystemExit) as exc:
        build(settings(tmp_path, tokens_file=str(bad)))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("flywheel admin: invalid configuration: admin.tokens_file") and ALICE not in err


def test_a_tokens_file_alone_is_enough_and_one_of_the_two_is_required(tmp_path: Path) -> None:
    assert admin_token_problem(settings(tmp_path, tokens_file=str(tokens_file(tmp_path))).admin) is None
    problem = admin_token_problem(settings(tmp_path).admin)
    assert problem is not None and "admin.token" in problem and "admin.tokens_file" in problem
    assert admin_token_problem(settings(tmp_path, insecure_dev="true").admin) is None


# ---- the token never shows -------------------------------------------------------------------------
async def test_no_token_in_logs_audit_config_or_repr(tmp_path: Path, api: Any, logs: io.StringIO) -> None:
    client, state = api
    await client.post("/samplers/pause", json={}, headers=bearer(ALICE))
    await client.patch("/config", json={"sampler.max_backlog": 5}, headers=bearer(LEGACY))
    await client.post("/samplers/resume", json={}, headers=bearer(BOB + "x"))  # refused
    await client.get("/status", headers=bearer(BOB))
    seen = [logs.getvalue(), json.dumps((await client.get("/audit", headers=bearer(ALICE))).json()),
            (await client.get("/config", headers=bearer(ALICE))).text,
            (await client.get("/config/history", headers=bearer(ALICE))).text,
            repr(state.settings), repr(state.settings.admin), json.dumps(state.settings.redacted()),
            repr(Operators.from_settings(state.settings.admin)), repr(client._transport.app.state.operators)]  # noqa: SLF001
    for text in seen:
        for token in (ALICE, BOB, LEGACY):
            assert token not in text
    assert repr(Operators.from_settings(state.settings.admin)) == "Operators(['admin', 'alice', 'bob'])"
    assert sha(ALICE) not in seen[-1]


def test_insecure_dev_without_operators_names_the_client(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    s = settings(tmp_path, insecure_dev="true", public_reads="false")
    state = AdminState(s, bus=MemoryBus().bus())
    with TestClient(create_app(state)) as c:
        assert c.get("/config/history").status_code == 200  # no operator at all: nothing to check a token against
        r = c.patch("/config", json={"sampler.max_backlog": 3})
        assert r.status_code in (200, 202), r.text
    assert [e.actor for e in state.audit.entries(10)] == ["anonymous@testclient"]


# ---- the CLI -----------------------------------------------------------------------------------------
def test_tokens_add_prints_a_token_once_and_appends_its_hash(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "ops" / "tokens"
    path.parent.mkdir()
    path.write_text("# operators\nalice " + sha(ALICE))  # no final newline
    assert cli.main(["tokens", "add", "carol", "--file", str(path)]) == 0
    token = capsys.readouterr().out.strip()
    assert len(token) >= 43 and not token.startswith("-")
    assert path.read_text() == f"# operators\nalice {sha(ALICE)}\ncarol {sha(token)}\n"
    ops = Operators.from_settings(settings(tmp_path, tokens_file=str(path)).admin)
    assert ops.identify(token) == "carol" and ops.identify(ALICE) == "alice"
    before = path.read_text()
    assert cli.main(["tokens", "add", "carol", "--file", str(path)]) == 1
    captured = capsys.readouterr()
    assert "already in" in captured.err and captured.out == "" and path.read_text() == before


def test_tokens_add_creates_a_private_file_and_refuses_a_bad_name_or_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "new.tokens"
    assert cli.main(["tokens", "add", "dave@example.org", "--file", str(path)]) == 0
    token = capsys.readouterr().out.strip()
    assert path.read_text() == f"dave@example.org {sha(token)}\n" and path.stat().st_mode & 0o077 == 0
    assert cli.main(["tokens", "add", "bad name!", "--file", str(path)]) == 1
    assert "not an operator name" in capsys.readouterr().err
    broken = tokens_file(tmp_path, "alice\n")
    assert cli.main(["tokens", "add", "erin", "--file", str(broken)]) == 1
    assert "admin.tokens_file" in capsys.readouterr().err and broken.read_text() == "alice\n"


def test_the_cli_sends_the_token_on_reads_too(capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization"))
        if request.headers.get("authorization") != f"Bearer {ALICE}":
            return httpx.Response(403, json={"detail": "wrong bearer token: it is no operator's"})
        return httpx.Response(200, json={"entries": []})

    transport = httpx.MockTransport(handler)
    assert cli.main(["--url", "http://admin", "--token", ALICE, "audit"], transport=transport) == 0
    assert seen == [f"Bearer {ALICE}"]
    assert cli.main(["--url", "http://admin", "--token", "wrong", "audit"], transport=transport) == 1
    err = capsys.readouterr().err
    assert "403 wrong bearer token" in err and "--token" in err
