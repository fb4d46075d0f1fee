"""trainer.dedicated_cores: which CPUs each service pins itself to (shared/placement.py), and that pinning moves
every thread of a process (the services pin in shared.service.run_main, before they build)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from shared.placement import cpu_list, pin, placement
from shared.settings import ConfigError, Settings, load_settings


def settings(**trainer: object) -> Settings:
    return Settings.model_validate({"trainer": trainer})


def test_cpu_list_is_the_kernels_notation() -> None:
    assert cpu_list([0, 1, 2, 5]) == "0-2,5"
    assert cpu_list([3]) == "3"
    assert cpu_list([7, 1, 2, 4, 5]) == "1-2,4-5,7"
    assert cpu_list([]) == ""


def test_zero_pins_nothing() -> None:
    for service in ("trainer", "sampler", "paramsync", "admin"):
        assert placement(service, settings(), [0, 1, 2, 3]).cpus is None


def test_the_trainer_takes_the_first_cpus_and_everyone_else_the_rest() -> None:
    s = settings(dedicated_cores=1)
    assert placement("trainer", s, [0, 1]).cpus == (0,)
    for service in ("sampler", "paramsync", "admin"):
        where = placement(service, s, [0, 1])
        assert where.cpus == (1,), service
        assert "CPU(s) 0 left to the trainer" in where.reason
    # The process's own affinity, not CPU numbers from 0: a stack started under `taskset -c 2,3,5`.
    assert placement("trainer", settings(dedicated_cores=2), [5, 3, 2]).cpus == (2, 3)
    assert placement("sampler", settings(dedicated_cores=2), [5, 3, 2]).cpus == (5,)


def test_each_rank_of_a_group_gets_its_own_share() -> None:
    shares = [placement("trainer", settings(dedicated_cores=2, world_size=2, rank=r), range(6)).cpus for r in (0, 1)]
    assert shares == [(0, 1), (2, 3)]
    assert placement("sampler", settings(dedicated_cores=2, world_size=2, rank=1), range(6)).cpus == (4, 5)


def test_a_host_with_nothing_left_over_pins_nothing_and_says_why() -> None:
    for service in ("trainer", "sampler"):
        where = placement(service, settings(dedicated_cores=2), [0, 1])
        assert where.cpus is None
        assert "would leave none of this process's 2 CPU(s) (0-1)" in where.reason
    assert placement("trainer", settings(dedicated_cores=1, world_size=2), [0, 1]).cpus is None


def test_a_bad_value_fails_naming_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLYWHEEL_TRAINER_DEDICATED_CORES", "-1")
    with pytest.raises(ConfigError, match="trainer.dedicated_cores"):
        load_settings(None)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and at least 2 CPUs")
def test_pin_moves_every_thread_of_the_process() -> None:
    """In a child process with a thread already running: after pin() both the main thread and that thread are on
    the sampler's CPUs, and a thread started later inherits them."""
    code = """
import os, threading, time, json
from shared.placement import pin
from shared.settings import Settings
stop = threading.Event()
early = threading.Thread(target=stop.wait, daemon=True); early.start()
where = pin("sampler", Settings.model_validate({"trainer": {"dedicated_cores": 1}}))
seen = {}
late = threading.Thread(target=lambda: seen.update(late=sorted(os.sched_getaffinity(0)))); late.start(); late.join()
print(json.dumps({"cpus": list(where.cpus), "main": sorted(os.sched_getaffinity(0)),
                  "early": sorted(os.sched_getaffinity(early.native_id)), **seen}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    got = json.loads(out.stdout)
    allowed = sorted(os.sched_getaffinity(0))
    assert got["cpus"] == allowed[1:]
    assert got["main"] == got["early"] == got["late"] == allowed[1:]
    assert allowed[0] not in got["main"]
    assert pin("sampler", settings()).cpus is None  # 0: this process is left alone
