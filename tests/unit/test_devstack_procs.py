"""devstack.procs: finding the processes a test session started by the variable they inherited."""

from __future__ import annotations

import os
import subprocess
import time
import uuid

from devstack.procs import is_running, marked, read_environ, terminate


def _sleeper(env: dict[str, str]) -> subprocess.Popen[bytes]:
    # start_new_session: like the stack's detached processes, it leaves our process group
    p = subprocess.Popen(["sleep", "60"], env=env, start_new_session=True)
    # Popen returns once exec has closed the child's descriptors, a moment before the kernel sets up the new
    # image's environment: /proc/<pid>/environ reads empty until then (make test once failed so, under load).
    deadline = time.monotonic() + 10
    while read_environ(p.pid) != env and time.monotonic() < deadline:
        time.sleep(0.01)
    return p


def test_marked_finds_a_detached_process_by_its_inherited_variable_until_it_exits() -> None:
    value = uuid.uuid4().hex
    ours = _sleeper({**os.environ, "FW_TEST_MARK": value})
    other = _sleeper({**os.environ, "FW_TEST_MARK": uuid.uuid4().hex})
    unmarked = _sleeper({k: v for k, v in os.environ.items() if k != "FW_TEST_MARK"})
    try:
        assert marked("FW_TEST_MARK", value) == [ours.pid]
        assert marked("FW_TEST_MARK", value, exclude=[ours.pid]) == []
    finally:
        for p in (ours, other, unmarked):
            terminate(p.pid, 5.0)
    assert not is_running(ours.pid)
    assert marked("FW_TEST_MARK", value) == []
