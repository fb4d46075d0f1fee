"""``trainer.torch_threads: auto`` and ``trainer.precision: auto`` (services/trainer/compute.py): the cores a
process may use (affinity, cgroup quota), the threads left after what is reserved, and the precision rule (bf16
only on a CPU with native bf16 and only when timed at least 1.3x faster). The timed probe itself runs on this
machine's CPU on a small model; its decision is the rule applied to its own figures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from services.trainer.compute import (
    BF16_SPEEDUP,
    cgroup_cpu_limit,
    choose,
    choose_threads,
    cpu_info,
    probe_fragments,
    time_epoch,
    usable_cores,
)
from services.trainer.learner import Learner
from shared.fragment import FragmentSpec
from shared.placement import cpu_list
from shared.settings import Settings, TrainerSettings

MLP_SPEC = FragmentSpec(obs_shape=(4,), num_actions=2, env_id="CartPole-v1")
NATURE_SPEC = FragmentSpec(obs_shape=(84, 84), num_actions=6, env_id="ALE/Pong-v5", obs_dtype="uint8",
                           frame_stack=4)


def _settings(**trainer: object) -> Settings:
    return Settings.model_validate({"run": "r", "store": {"backend": "local", "local_root": "/tmp/unused"},
                                    "env": {"num_envs": 2, "fragment_steps": 8}, "trainer": trainer})


def test_threads_as_set_or_the_free_cores_never_fewer_than_one() -> None:
    assert choose_threads(TrainerSettings(torch_threads=3)) == (3, "trainer.torch_threads as set")
    auto = TrainerSettings(torch_threads="auto")
    assert choose_threads(auto, (2.0, "2 cores"))[0] == 2
    assert choose_threads(TrainerSettings(torch_threads="auto", cores_reserved=0.5), (2.0, "2 cores"))[0] == 1
    threads, why = choose_threads(TrainerSettings(torch_threads="auto", cores_reserved=3), (2.0, "2 cores"))
    assert threads == 1 and "cores_reserved 3" in why and "2 cores" in why  # oversubscribed: still one
    assert choose_threads(TrainerSettings(torch_threads="auto", cores_reserved=1), (7.5, "quota"))[0] == 6
    for bad in ("many", 0, -3):
        with pytest.raises(ValueError, match="torch_threads"):
            TrainerSettings(torch_threads=bad)  # type: ignore[arg-type]


def test_cgroup_quota_v2_takes_the_tightest_of_the_path_and_its_parents(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    proc.write_text("0::/kubepods/pod1/ctr\n")
    for sub, quota in (("kubepods", "max 100000"), ("kubepods/pod1", "150000 100000"),
                       ("kubepods/pod1/ctr", "300000 100000")):
        (tmp_path / "fs" / sub).mkdir(parents=True, exist_ok=True)
        (tmp_path / "fs" / sub / "cpu.max").write_text(quota + "\n")
    assert cgroup_cpu_limit(tmp_path / "fs", proc) == 1.5
    (tmp_path / "fs" / "kubepods/pod1" / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit(tmp_path / "fs", proc) == 3.0
    for sub in ("kubepods", "kubepods/pod1", "kubepods/pod1/ctr"):
        (tmp_path / "fs" / sub / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit(tmp_path / "fs", proc) is None


def test_cgroup_quota_v1_and_the_affinity_cap(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/x\n3:cpu,cpuacct:/docker/abc\n0::/\n")
    d = tmp_path / "fs" / "cpu" / "docker" / "abc"
    d.mkdir(parents=True)
    (d / "cpu.cfs_quota_us").write_text("50000\n")
    (d / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_limit(tmp_path / "fs", proc) == 0.5
    (d / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_limit(tmp_path / "fs", proc) is None
    cores, how = usable_cores(limit=0.5)
    assert cores == 0.5 and "cgroup CPU quota 0.5" in how
    cores, how = usable_cores(limit=10_000.0)  # a quota above the affinity: the affinity counts
    assert cores >= 1 and "affinity" in how


def test_cpu_info_reads_the_model_and_flags(tmp_path: Path) -> None:
    f = tmp_path / "cpuinfo"
    f.write_text("processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu avx2 avx512f avx512_bf16\n\n"
                 "processor\t: 1\nmodel name\t: Some CPU\nflags\t\t: fpu\n")
    assert cpu_info(f) == ("Some CPU", {"fpu", "avx2", "avx512f", "avx512_bf16"})
    assert cpu_info(tmp_path / "absent") == ("unknown", set())


def _choose(precision: str, flags: set[str], rates: tuple[float, float] | None) -> object:
    settings = _settings(precision=precision)
    learner = Learner(MLP_SPEC, settings.trainer)
    calls: list[bool] = []

    def timer(_learner: object, frags: list[object], bf16: bool) -> float:
        calls.append(bf16)
        assert len(frags) == settings.trainer.batch_fragments
        assert rates is not None, "timed although the rule needs no timing"
        return rates[1] if bf16 else rates[0]

    c = choose(settings, learner, MLP_SPEC, (1, "as set"), ("Some CPU", flags), timer)
    return c, calls


def test_precision_rule() -> None:
    native = {"avx512f", "avx512_bf16"}
    c, calls = _choose("fp32", native, None)
    assert c.precision == "fp32" and c.precision_reason == "trainer.precision as set" and not calls
    c, calls = _choose("bf16", set(), None)
    assert c.precision == "bf16" and not calls  # an explicit bf16 is taken as given
    c, calls = _choose("auto", {"avx2"}, None)  # no native bf16: float32, nothing timed
    assert c.precision == "fp32" and "no native bf16" in c.precision_reason and not c.native_bf16 and not calls
    c, calls = _choose("auto", native, (1000.0, 1000.0 * BF16_SPEEDUP))
    assert c.precision == "bf16" and calls == [False, True] and c.native_bf16
    assert c.fp32_samples_per_s == 1000.0 and c.bf16_samples_per_s == 1300.0 and "1.30x" in c.precision_reason
    c, _ = _choose("auto", {"amx_bf16"}, (1000.0, 1290.0))  # faster, not clearly: float32
    assert c.precision == "fp32" and "bf16 needs 1.3x" in c.precision_reason
    assert c.cpu_flags == ["amx_bf16"] and c.cpu_model == "Some CPU"


def test_probe_fragments_have_the_runs_shapes_and_time_an_epoch_without_touching_the_learner() -> None:
    frags = probe_fragments(NATURE_SPEC, 2, steps=4, envs=2)
    assert frags[0].obs.shape == (4, 2, 84, 84) and frags[0].obs.dtype.name == "uint8"
    assert frags[0].obs_history is not None and frags[0].obs_history.shape == (3, 2, 84, 84)
    learner = Learner(NATURE_SPEC, TrainerSettings(minibatches=2))
    before = [p.detach().clone() for p in learner.model.parameters()]
    for bf16 in (False, True):
        rate = time_epoch(learner, frags, bf16, runs=1)
        assert rate > 0
    assert all(torch.equal(a, b) for a, b in zip(before, learner.model.parameters(), strict=True))
    assert learner.counters.updates == 0 and not learner.optimizer.state


def test_the_trainer_reports_its_choice_from_the_settings() -> None:
    # The real rule on this machine's CPU: whatever it chose follows from its own figures.
    settings = _settings(precision="auto", torch_threads="auto")
    learner = Learner(MLP_SPEC, settings.trainer)
    threads = choose_threads(settings.trainer)
    c = choose(settings, learner, MLP_SPEC, threads)
    assert c.threads == threads[0] >= 1 and c.device == "cpu"
    if c.native_bf16:
        assert c.fp32_samples_per_s and c.bf16_samples_per_s
        assert (c.precision == "bf16") == (c.bf16_samples_per_s / c.fp32_samples_per_s >= BF16_SPEEDUP)
    else:
        assert c.precision == "fp32" and c.fp32_samples_per_s is None
    # The CPUs it runs on, as the kernel lists them: this process's affinity (after trainer.dedicated_cores).
    if hasattr(os, "sched_getaffinity"):
        assert c.cpus == cpu_list(os.sched_getaffinity(0))
