"""The status page and /docs in a real browser (headless Chromium over the DevTools protocol), offline.

The admin app (``create_app``) runs under uvicorn on 127.0.0.1; the API the page calls (``/status``,
``/status/history``, ``/policy/versions``, pause/resume/rollback) is a fake that answers the documented
contract with numbers that change over time and records every POST, so the page is tested without Kafka
or S3. Chromium resolves no host but 127.0.0.1 and has a proxy that refuses everything else, and every
request the page makes is checked to stay on the admin's origin.

Set ``FLYWHEEL_PAGE_SCREENSHOT=docs/status-page.png`` to refresh the screenshot in the docs.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import uvicorn
from fastapi import FastAPI, HTTPException, Request
from websockets.sync.client import connect

from services.admin.app import create_app
from services.admin.state import AdminState
from shared.settings import load_settings

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [
    pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium); none on PATH"),
    pytest.mark.timeout(180),
]
TOKEN = "page-t0ken"
FAKE_PATHS = {"/status", "/status/history", "/policy/versions", "/policy/rollback", "/samplers/pause",
              "/samplers/resume"}


# ---- the fake API behind the page ------------------------------------------------------------
class FakeRun:
    """Answers like a busy run: a return that climbs, versions every 6 s, a degraded paramsync, a paused sampler."""

    def __init__(self) -> None:
        self.t0 = time.time()
        self.samplers = ["sampler-0", "sampler-1", "sampler-2"]
        self.paused: dict[str, float] = {"sampler-2": self.t0 - 240}
        self.calls: list[tuple[str, str | None, Any]] = []
        self.optional = True  # serve /status/history and /policy/versions (else 404, as before they exist)
        self.rolled_back: list[int] = []

    def version(self, at: float) -> int:
        return 40 + int((at - self.t0 + 120) / 6) + len(self.rolled_back)

    def snapshot(self, at: float) -> dict[str, Any]:
        k = at - self.t0 + 120  # two minutes of history before the test starts
        wave = math.sin(k / 7)
        v = self.version(at)
        samplers = []
        for i, sid in enumerate(self.samplers):
            paused = sid in self.paused
            samplers.append({"id": sid, "alive": True, "policy_version": v - (i % 2), "last_seen": at - 0.4 * i,
                             "steps_per_s": 0.0 if paused else round(1480 + 90 * math.sin(k / 5 + i), 1),
                             "paused": paused, "paused_since": self.paused.get(sid)})
        live = sum(not s["paused"] for s in samplers)
        return {
            "at": at, "run": "cartpole-demo",
            "policy": {"version": v, "sha256": f"{v:02x}" * 32, "published_at": at - (k % 6)},
            "trainer": {"alive": True, "step": int(k * 12), "updates": int(k * 12), "samples_trained": int(k * 2900),
                        "samples_per_s": round(1450 * live + 120 * wave, 1), "last_update_at": at - 0.3,
                        "policy_version": v + 1, "published_version": v, "stalled": None},
            "samplers": samplers,
            "backlog": {"records": max(0, int(14 + 10 * wave)), "per_partition": {"0": 5, "1": 4}},
            "sync": {"latency_p50_s": round(0.18 + 0.04 * wave, 3), "latency_p95_s": round(0.62 + 0.1 * wave, 3)},
            "staleness": {"mean": round(2.1 + 0.6 * wave, 2), "max": 6 + int(2 * wave), "p95": round(4.4 + wave, 2),
                          "dropped_fraction": 0.01},
            "episode_return": {"mean": round(500 - 460 * math.exp(-k / 60) + 12 * wave, 1), "count": 100},
            "services": {
                "trainer": {"alive": True, "state": "ok", "reasons": {}, "restarts": 1},
                "paramsync": {"alive": True, "state": "degraded", "restarts": 0,
                              "reasons": {"store": "move marker failed: StoreError: endpoint timed out"}},
                **{f"sampler:{sid}": {"alive": True, "state": "ok", "reasons": {}, "restarts": 0}
                   for sid in self.samplers},
            },
        }

    def api(self) -> FastAPI:
        app = FastAPI()

        def record(request: Request, body: Any) -> None:
            self.calls.append((request.url.path, request.headers.get("authorization"), body))
            if request.headers.get("authorization") != f"Bearer {TOKEN}":
                raise HTTPException(401, "missing or wrong bearer token")

        def optional() -> None:
            if not self.optional:
                raise HTTPException(404, "Not Found")

        @app.get("/status")
        def status() -> dict[str, Any]:
            return self.snapshot(time.time())

        @app.get("/status/history")
        def history() -> dict[str, Any]:  # compact samples, as AdminState.point makes them
            optional()
            points = []
            for i in range(30, 0, -1):
                s = self.snapshot(time.time() - 2 * i)
                points.append({
                    "t": s["at"], "episode_return": s["episode_return"]["mean"],
                    "sampled_steps_per_s": sum(x["steps_per_s"] for x in s["samplers"]),
                    "trained_steps_per_s": s["trainer"]["samples_per_s"], "backlog": s["backlog"]["records"],
                    **{f"staleness_{k}": s["staleness"][k] for k in ("mean", "p95", "max")},
                    "sync_p50_s": s["sync"]["latency_p50_s"], "sync_p95_s": s["sync"]["latency_p95_s"],
                    "policy_version": s["policy"]["version"]})
            return {"points": points}

        @app.get("/policy/versions")
        def versions() -> dict[str, Any]:
            optional()
            v = self.version(time.time())
            return {"current": v, "versions": [
                {"version": n, "sha256": f"{n:02x}" * 32, "published_at": time.time() - 6 * (v - n),
                 "trainer_step": 12 * n, "rollback_of": None, "return_mean": round(500 - 460 * math.exp(-n / 20), 1)}
                for n in range(v - 5, v + 1)]}

        @app.post("/samplers/{action}", status_code=202)
        async def pause_or_resume(action: str, request: Request) -> dict[str, Any]:
            body = await request.json()
            record(request, body)
            who = [body["sampler"]] if body.get("sampler") else self.samplers
            for sid in who:
                if action == "pause":
                    self.paused.setdefault(sid, time.time())
                else:
                    self.paused.pop(sid, None)
            return {"request_id": "r1", "action": action, "sampler": body.get("sampler")}

        @app.post("/policy/rollback", status_code=202)
        async def rollback(request: Request) -> dict[str, Any]:
            body = await request.json()
            record(request, body)
            self.rolled_back.append(body["version"])
            return {"request_id": "r2", "version": body["version"], "new_version": self.version(time.time())}

        return app


@pytest.fixture(scope="module")
def fake() -> FakeRun:
    return FakeRun()


@pytest.fixture(scope="module")
def server(fake: FakeRun) -> Iterator[str]:
    settings = load_settings(None, environ={"FLYWHEEL_RUN": "pages", "FLYWHEEL_ADMIN_TOKEN": TOKEN})
    admin = create_app(cast(AdminState, SimpleNamespace(settings=settings)))  # /, /docs, /static, /openapi.json
    api = fake.api()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        target = api if scope["type"] == "http" and scope["path"] in FAKE_PATHS else admin
        await target(scope, receive, send)

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert srv.started, "uvicorn did not start"
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    srv.should_exit = True
    thread.join(10)
    sock.close()


# ---- a minimal DevTools-protocol client --------------------------------------------------------
class Browser:
    """Headless Chromium with one tab; records every request, failure and console error of that tab."""

    def __init__(self, profile: Path) -> None:
        assert CHROMIUM is not None
        self.proc = subprocess.Popen(
            [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--no-default-browser-check", "--disable-extensions", "--disable-background-networking",
             "--disable-component-update",
             "--disable-sync", "--disable-default-apps", f"--user-data-dir={profile}", "--remote-debugging-port=0",
             "--window-size=1280,800",
             # offline: no name resolves but 127.0.0.1, and whatever is not loopback goes to a proxy that refuses
             "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1", "--proxy-server=http://127.0.0.1:9",
             "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not (port_file.is_file() and len(port_file.read_text().splitlines()) == 2):
            assert self.proc.poll() is None, f"chromium exited with {self.proc.returncode}"
            assert time.monotonic() < deadline, "chromium did not open its DevTools port"
            time.sleep(0.1)
        port, path = port_file.read_text().splitlines()
        self.closing = contextlib.ExitStack()
        self.ws = self.closing.enter_context(connect(f"ws://127.0.0.1:{port}{path}", max_size=None, open_timeout=10))
        self.ids = itertools.count(1)
        self.requests: list[str] = []
        self.failures: list[str] = []
        self.errors: list[str] = []
        target = self.send("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Page", "Network", "Runtime", "Log"):
            self.send(f"{domain}.enable", session=self.session)
        self.send("Emulation.setDeviceMetricsOverride", session=self.session, width=1280, height=800,
                  deviceScaleFactor=1, mobile=False)

    def send(self, method: str, session: str | None = None, timeout: float = 30, **params: Any) -> Any:
        msg_id = next(self.ids)
        msg: dict[str, Any] = {"id": msg_id, "method": method, "params": params}
        if session:
            msg["sessionId"] = session
        self.ws.send(json.dumps(msg))
        deadline = time.monotonic() + timeout
        while True:
            m = json.loads(self.ws.recv(timeout=max(0.01, deadline - time.monotonic())))
            if m.get("id") == msg_id:
                if "error" in m:
                    raise RuntimeError(f"{method}: {m['error']}")
                return m.get("result", {})
            self._event(m)

    def _event(self, m: dict[str, Any]) -> None:
        p = m.get("params", {})
        match m.get("method"):
            case "Network.requestWillBeSent":
                self.requests.append(p["request"]["url"])
            case "Network.loadingFailed":
                self.failures.append(f"{p.get('type')} failed: {p.get('errorText')}")
            case "Network.responseReceived" if p["response"]["status"] >= 400:
                self.failures.append(f"{p['response']['status']} {p['response']['url']}")
            case "Runtime.exceptionThrown":
                self.errors.append(json.dumps(p["exceptionDetails"])[:500])
            case "Log.entryAdded" if p["entry"]["level"] == "error" and p["entry"].get("source") != "network":
                self.errors.append(f"{p['entry'].get('source')}: {p['entry']['text']}")
            case "Runtime.consoleAPICalled" if p["type"] == "error":
                self.errors.append(json.dumps(p["args"])[:500])
            case "Page.javascriptDialogOpening":  # confirm() before a rollback: accept it
                self.ws.send(json.dumps({"id": next(self.ids), "method": "Page.handleJavaScriptDialog",
                                         "sessionId": self.session, "params": {"accept": True}}))

    def open(self, url: str) -> None:
        """Leave the current page (its requests end now), forget what was recorded, then load ``url``."""
        for target in ("about:blank", url):
            self.send("Page.navigate", session=self.session, url=target)
            self.wait_for(f"location.href === {json.dumps(target)} && document.readyState === 'complete'")
            if target == "about:blank":
                self.requests, self.failures, self.errors = [], [], []

    def js(self, expression: str) -> Any:
        r = self.send("Runtime.evaluate", session=self.session, expression=expression, returnByValue=True,
                      awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expression}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 15) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if value := self.js(expression):
                return value
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {expression}")

    def click(self, selector: str) -> None:
        """A real mouse click in the middle of the element."""
        box = self.js(f"(() => {{ const e = document.querySelector({json.dumps(selector)}); e.scrollIntoView();"
                      " const r = e.getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; })()")
        for kind in ("mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", session=self.session, type=kind, x=box[0], y=box[1],
                      button="left", clickCount=1)

    def type(self, selector: str, text: str) -> None:
        self.js(f"document.querySelector({json.dumps(selector)}).focus()")
        self.send("Input.insertText", session=self.session, text=text)

    def screenshot(self, path: Path) -> None:
        self.js("window.scrollTo(0, 0)")
        data = self.send("Page.captureScreenshot", session=self.session, format="png")["data"]
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        try:
            self.send("Browser.close", timeout=5)
        except Exception:
            pass
        self.closing.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the group chromium was started in, nothing else
            self.proc.wait(10)


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    b = Browser(tmp_path_factory.mktemp("chromium-profile"))
    yield b
    b.close()


def assert_offline(browser: Browser, origin: str) -> None:
    assert browser.requests, "the page made no request"
    elsewhere = [u for u in browser.requests if not u.startswith(origin + "/") and not u.startswith("data:")]
    assert not elsewhere, f"requests off the admin's origin: {elsewhere}"


# ---- the tests ---------------------------------------------------------------------------------
def test_status_page_draws_curves_and_round_trips_actions(
    server: str, fake: FakeRun, browser: Browser, tmp_path: Path
) -> None:
    browser.open(server + "/")
    # history first (30 snapshots), then a point every 2 s
    browser.wait_for("window.flywheelPoints && window.flywheelPoints().length >= 30")
    n0 = browser.js("window.flywheelPoints().length")
    browser.wait_for(f"window.flywheelPoints().length >= {n0 + 2}", timeout=10)
    charts = browser.js("Object.fromEntries([...document.querySelectorAll('figure.chart')]"
                        ".map(f => [f.dataset.chart, +f.dataset.points || 0]))")
    assert set(charts) == {"return", "throughput", "backlog", "lag", "sync", "version"}
    assert all(n > 30 for n in charts.values()), charts
    assert browser.js("document.querySelectorAll('figure.chart canvas').length") >= 6
    assert browser.js("document.querySelector('#run').textContent") == "run cartpole-demo"
    rows = browser.js("[...document.querySelectorAll('#samplers tbody tr')].map(r => r.innerText)")
    assert len(rows) == 3 and "paused" in rows[2] and "running" in rows[0], rows
    assert "store: move marker failed" in browser.js("document.querySelector('#services').innerText")
    assert browser.wait_for("document.querySelectorAll('#versions tbody tr').length") == 6
    assert browser.js("document.querySelector('#conn').dataset.state") == "ok"
    shot = Path(os.environ.get("FLYWHEEL_PAGE_SCREENSHOT") or tmp_path / "status-page.png")
    browser.screenshot(shot)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not browser.failures and not browser.errors, (browser.failures, browser.errors)
    assert_offline(browser, server)

    # without a token the server refuses, and the page says so
    browser.click("#pause-all")
    browser.wait_for("document.querySelector('#notice').textContent.includes('wrong or missing token')")
    assert fake.calls[-1] == ("/samplers/pause", None, {})

    # with the token: every sampler pauses, the page shows it
    browser.type("#token", TOKEN)
    browser.click("#pause-all")
    browser.wait_for("document.querySelector('#notice').textContent === 'Pause sent to all samplers.'")
    assert fake.calls[-1] == ("/samplers/pause", f"Bearer {TOKEN}", {})
    browser.wait_for("[...document.querySelectorAll('#samplers tbody tr')].every(r => r.innerText.includes('paused'))")

    # one sampler resumes from its row
    browser.click("#samplers tr[data-sampler='sampler-1'] button")
    browser.wait_for("document.querySelector('#notice').textContent === 'Resume sent to sampler sampler-1.'")
    assert fake.calls[-1] == ("/samplers/resume", f"Bearer {TOKEN}", {"sampler": "sampler-1"})

    # a rollback: confirm() is accepted, the version goes in the body
    oldest = browser.js("+document.querySelector('#versions tbody tr:last-child').dataset.version")
    browser.click("#versions tbody tr:last-child button")
    notice = browser.wait_for("document.querySelector('#notice').textContent.startsWith('Rolled back to version')"
                              " && document.querySelector('#notice').textContent")
    assert notice.startswith(f"Rolled back to version {oldest}: its weights are now version "), notice
    assert fake.calls[-1] == ("/policy/rollback", f"Bearer {TOKEN}", {"version": oldest})
    assert browser.js("sessionStorage.length") == 0  # not remembered unless asked
    assert_offline(browser, server)


def test_status_page_without_history_or_versions(server: str, fake: FakeRun, browser: Browser) -> None:
    fake.optional = False  # an admin without GET /status/history and GET /policy/versions: both 404
    try:
        browser.open(server + "/")
        browser.wait_for("window.flywheelPoints && window.flywheelPoints().length >= 1")
        assert browser.js("window.flywheelPoints().length") < 5  # no history: the page builds its own
        browser.wait_for("window.flywheelPoints().length >= 3", timeout=10)
        browser.wait_for("+document.querySelector('figure[data-chart=return]').dataset.points >= 3")
        note = browser.wait_for("!document.querySelector('#versions-note').hidden"
                                " && document.querySelector('#versions-note').textContent")
        assert "404" in note
        assert not browser.errors, browser.errors
        assert all("/status/history" in f or "/policy/versions" in f for f in browser.failures), browser.failures
        assert_offline(browser, server)
    finally:
        fake.optional = True


def test_docs_renders_swagger_ui_offline(server: str, browser: Browser) -> None:
    browser.open(server + "/docs")
    browser.wait_for("document.querySelectorAll('.swagger-ui .opblock').length >= 3")
    paths = browser.js("[...document.querySelectorAll('.swagger-ui .opblock-summary-path')].map(e => e.innerText)")
    assert {"/status", "/policy/sync", "/healthz"} <= {p.replace("\u200b", "") for p in paths}, paths
    assert browser.js("document.querySelector('.swagger-ui .info .title').innerText").startswith("Flywheel admin")
    assert not browser.failures and not browser.errors, (browser.failures, browser.errors)
    assert_offline(browser, server)
