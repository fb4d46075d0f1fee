"""The fault suites' own checks, without a stack: the samplers' liveness after a heal (liveness.py), verify's
expected loss after the lost-records row, and the accounting of records deleted on purpose."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.faults import liveness
from tests.faults.accounting import account
from tests.faults.conftest import FaultEnv, lost_line
from tests.faults.liveness import Back, SamplersBack


class _Samplers:
    """Fake samplers' /healthz: ``bodies[name]`` is what GET /<name> answers (None: 503 with no JSON)."""

    def __init__(self) -> None:
        self.bodies: dict[str, dict[str, Any] | None] = {}
        bodies = self.bodies

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                body = bodies.get(self.path.strip("/"))
                data = json.dumps(body).encode() if body is not None else b"down"
                self.send_response(200 if body is not None else 503)
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/{name}"


@pytest.fixture
def samplers(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Samplers]:
    monkeypatch.setattr(liveness, "POLL_S", 0.05)
    s = _Samplers()
    yield s
    s.server.shutdown()


def test_every_sampler_back_with_its_seconds(samplers: _Samplers) -> None:
    samplers.bodies.update({"a": {"fragments": 10}, "b": {"fragments": 0}})  # b: a process restarted at the heal
    watch = SamplersBack({"sampler-0": samplers.url("a"), "sampler-1": samplers.url("b")}, bound_s=5)
    threading.Timer(0.3, lambda: samplers.bodies.update(a={"fragments": 11}, b={"fragments": 1})).start()
    back = watch.result()
    assert back.ok and set(back.seconds) == {"sampler-0", "sampler-1"}
    assert all(0.2 <= s < 2 for s in back.seconds.values()), back.seconds
    assert back.cell().startswith("sampler-0 ") and ", sampler-1 " in back.cell()


def test_a_sampler_that_does_not_produce_fails_naming_it_and_its_reasons(samplers: _Samplers) -> None:
    samplers.bodies.update(a={"fragments": 3}, b={"fragments": 7, "state": "degraded",
                                                  "reasons": {"credits": "waiting 40 s for credits"}})
    watch = SamplersBack({"sampler-0": samplers.url("a"), "sampler-1": samplers.url("b")}, bound_s=0.6)
    threading.Timer(0.2, lambda: samplers.bodies.update(a={"fragments": 4})).start()
    back = watch.result()
    assert not back.ok and set(back.late) == {"sampler-1"} and "sampler-0" in back.seconds
    assert "credits: waiting 40 s for credits" in back.late["sampler-1"]
    with pytest.raises(AssertionError, match=r"sampler-1 did not produce within 1 s.*credits"):
        liveness.assert_back(back, "row")


def test_a_sampler_restarted_counts_from_zero_and_one_that_never_answers_is_not_back(samplers: _Samplers) -> None:
    samplers.bodies.update(a={"fragments": 50}, b=None)
    watch = SamplersBack({"sampler-0": samplers.url("a"), "sampler-1": samplers.url("b")}, bound_s=1.0)
    threading.Timer(0.2, lambda: samplers.bodies.update(a={"fragments": 0})).start()  # killed: a new process
    threading.Timer(0.4, lambda: samplers.bodies.update(a={"fragments": 2})).start()
    back = watch.result()
    assert "sampler-0" in back.seconds and back.seconds["sampler-0"] >= 0.3
    assert "did not answer" in back.late["sampler-1"]


def test_paused_samplers_are_excluded_and_said_so(samplers: _Samplers) -> None:
    samplers.bodies.update(a={"fragments": 1}, b={"fragments": 1})
    watch = SamplersBack({"sampler-0": samplers.url("a"), "sampler-1": samplers.url("b")},
                         paused={"sampler-1": "paused by the row"}, bound_s=2)
    threading.Timer(0.2, lambda: samplers.bodies.update(a={"fragments": 2})).start()
    back = watch.result()
    assert back.ok and back.cell().endswith("sampler-1 paused by the row (excluded)")
    with pytest.raises(AssertionError, match="not among"):
        SamplersBack({"sampler-0": samplers.url("a")}, paused=["sampler-9"])


def test_worst_of_several_heals() -> None:
    a = Back({"sampler-0": 1.0, "sampler-1": 5.0})
    assert a.worst(Back({"sampler-0": 3.0, "sampler-1": 2.0})).cell() == "sampler-0 3.0, sampler-1 5.0"
    assert liveness.not_applicable("samplers stopped") == "n/a: samplers stopped"


VERIFY_OUT = """checkpoint 40 (policy version 41, 2 partition(s) in its ledger)
  run.samples:0 [0, 90): FAILED (trained 80, lost 10)
    - lost before training (left the log untrained): 10 record(s) at [80, 90)
  run.samples:1 [0, 50): ok (trained 50)
verify: FAILED"""


def _env(deleted: dict[int, list[tuple[int, int]]]) -> FaultEnv:
    env = FaultEnv.__new__(FaultEnv)  # only run and deleted are read
    env.run, env.deleted = "run", deleted
    return env


def test_verify_after_the_lost_records_row_names_only_what_was_deleted() -> None:
    assert _env({0: [(80, 90)]}).verify_cell(1, VERIFY_OUT)[0]
    assert _env({0: [(80, 90)]}).verify_cell(0, "verify: ok") == (True, "ok")
    assert not _env({}).verify_cell(1, VERIFY_OUT)[0]  # nothing deleted on purpose: a loss fails
    assert _env({0: [(80, 89)]}).verify_problems(VERIFY_OUT)  # another span than the one deleted
    assert _env({0: [(80, 90)], 1: [(40, 50)]}).verify_problems(VERIFY_OUT) == [
        f"1: not named as lost: {lost_line([(40, 50)])}"]
    other = VERIFY_OUT.replace("verify: FAILED", "    - missing (no outcome): 3\nverify: FAILED")
    assert _env({0: [(80, 90)]}).verify_problems(other) == ["1: missing (no outcome): 3"]


def test_accounting_counts_records_deleted_on_purpose_apart(tmp_path: Path) -> None:
    log = tmp_path / "trainer.log"
    lines = [{"event": "config_resolved", "timestamp": "2026-01-01T00:00:00Z"},
             {"event": "records_lost_before_training", "partition": 0, "from_offset": 2, "to_offset": 5,
              "timestamp": "2026-01-01T00:00:01Z"},
             {"event": "records_lost_before_training", "partition": 1, "from_offset": 0, "to_offset": 1,
              "timestamp": "2026-01-01T00:00:01Z"}]
    log.write_text("".join(json.dumps(x) + "\n" for x in lines))
    acc = account({}, log, {}, {0: [(2, 5)]})
    assert acc.deleted_on_purpose == 3 and acc.lost_before_training == [(1, 0, 1)]
    assert any(p.startswith("lost_before_training: 1") for p in acc.problems())
    assert not account({}, log, {}, {0: [(2, 5)], 1: [(0, 1)]}).problems()
