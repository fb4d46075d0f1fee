import io
import json
import logging

from shared.logging import configure_logging, fragment_context, get_logger


def test_json_lines_carry_service_run_and_fragment_identity() -> None:
    buf = io.StringIO()
    configure_logging("trainer", "run-x", stream=buf)
    log = get_logger()
    with fragment_context("abc123", "sampler-0", 7, partition=2, offset=41):
        log.info("fragment_trained", update=3)
    log.info("after")
    logging.getLogger("aiokafka").warning("from a library")
    lines = [json.loads(x) for x in buf.getvalue().splitlines()]
    assert lines[0]["event"] == "fragment_trained"
    assert {k: lines[0][k] for k in ("service", "run", "sample_id", "sampler_id", "policy_version", "partition",
                                     "offset", "update")} == {
        "service": "trainer", "run": "run-x", "sample_id": "abc123", "sampler_id": "sampler-0",
        "policy_version": 7, "partition": 2, "offset": 41, "update": 3}
    assert "sample_id" not in lines[1] and lines[1]["service"] == "trainer"
    assert lines[2]["event"] == "from a library" and lines[2]["level"] == "warning"
