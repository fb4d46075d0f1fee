"""Sample Factory's Pong peer (bench.peers.sf_atari): its command line, env count, update shape and counts.

Pure logic on sample SF lines and configs; nothing here needs SF's virtualenv."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.peers.sf_atari import (
    CHANGED,
    DOCUMENTED_ARGS,
    ENVS,
    MODES,
    MODULE,
    PEER,
    PEER_ASYNC,
    PINNED,
    ProcStat,
    async_layout,
    command,
    env_count,
    flag,
    frames_per_step,
    peer_name,
    trained_series,
    update_shape,
)
from bench.peers.sf_log import READY, parse

# SF 2.1.1's Atari defaults (sf_examples/atari/atari_params.py) as its config.json records them
ATARI_CFG = {"num_workers": 8, "num_envs_per_worker": 1, "worker_num_splits": 1, "env_frameskip": 4,
             "summaries_use_frameskip": True, "batch_size": 256, "num_batches_per_epoch": 4, "num_epochs": 4,
             "rollout": 128, "async_rl": False}

PONG_LINES = [
    (4.0, "[2026-12-02 03:52:40,001][00123] Using optimizer <class 'torch.optim.adam.Adam'>"),
    (5.5, "[2026-12-02 03:52:41,311][00100] Fps is (10 sec: nan, 60 sec: nan, 300 sec: nan). Total num frames: 0. "
          "Throughput: 0: nan. Samples: 0. Policy #0 lag: (min: -1.0, avg: -1.0, max: -1.0)"),
    (6.0, f"[2026-12-02 03:52:41,800][00100] {READY}"),
    (11.0, "[2026-12-02 03:52:46,311][00100] Fps is (10 sec: nan, 60 sec: nan, 300 sec: nan). Total num frames: 4096. "
           "Throughput: 0: 245.3. Samples: 2048. Policy #0 lag: (min: 0.0, avg: 0.0, max: 0.0)"),
    (16.0, "[2026-12-02 03:52:51,311][00100] Fps is (10 sec: 1638.4, 60 sec: 1638.4, 300 sec: 1638.4). Total num "
           "frames: 12288. Throughput: 0: 409.6. Samples: 4096. Policy #0 lag: (min: 0.0, avg: 0.4, max: 1.0)"),
    (16.0, "[2026-12-02 03:52:51,312][00100] Avg episode reward: [(0, '-20.500')]"),
    (21.0, "[2026-12-02 03:52:56,311][00100] Fps is (10 sec: 1638.4, 60 sec: 1843.2, 300 sec: 1843.2). Total num "
           "frames: 20480. Throughput: 0: 409.6. Samples: 6144. Policy #0 lag: (min: 0.0, avg: 0.5, max: 1.0)"),
]


def test_command_is_the_documented_one_plus_the_pins_and_the_listed_changes_only(tmp_path: Path) -> None:
    cmd = command(3, tmp_path / "td", "pong-seed3", Path("/venv/bin/python"))
    assert cmd[:3] == ["/venv/bin/python", "-m", "sf_examples.atari.train_atari"] and MODULE == cmd[2]
    flags = cmd[3:]
    changed = ["--device=cpu", "--seed=3", "--experiment=pong-seed3", f"--train_dir={tmp_path / 'td'}"]
    pinned = ["--num_workers=8", "--num_envs_per_worker=1", "--worker_num_splits=1",
              "--encoder_conv_architecture=convnet_atari", "--encoder_conv_mlp_layers=512", "--nonlinearity=relu",
              "--use_rnn=False", "--env_frameskip=4", "--env_framestack=4"]
    assert flags == ["--algo=APPO", "--env=atari_pong", *pinned, *changed]
    assert list(DOCUMENTED_ARGS) == ["--algo=APPO", "--env=atari_pong"]
    assert [f.split("=")[0] for f, _ in CHANGED] == [c.split("=")[0] for c in changed]
    assert all(why for _, why in CHANGED) and all(why for *_, why in PINNED)
    assert not any("wandb" in f for f in flags)  # with_wandb stays SF's default, off
    assert len({f.split("=")[0] for f in flags}) == len(flags)  # no option given twice


def test_async_mode_is_the_example_with_async_rl_double_buffering_and_a_worker_per_core(tmp_path: Path) -> None:
    """SF's Atari page's faster settings scaled to the machine: async_rl, 2 splits, workers = cores (SF's
    num_workers default) up to 4, and still 8 envs; the rest of the line is the sync one's."""
    sync = command(3, tmp_path / "td", "x", Path("/p"))
    two = command(3, tmp_path / "td", "x", Path("/p"), "async", cores=2)
    assert [f for f in two if f not in sync] == ["--num_workers=2", "--num_envs_per_worker=4", "--worker_num_splits=2",
                                                 "--async_rl=True"]
    assert [f for f in sync if f not in two] == ["--num_workers=8", "--num_envs_per_worker=1", "--worker_num_splits=1"]
    assert len({f.split("=")[0] for f in two}) == len(two)  # no option given twice
    for cores, workers in ((1, 1), (2, 2), (3, 2), (4, 4), (16, 4)):
        layout = async_layout(cores)
        assert layout["num_workers"] == workers and env_count(layout) == ENVS
    with pytest.raises(ValueError, match="mode must be one of"):
        command(3, tmp_path / "td", "x", Path("/p"), "serial")
    assert {peer_name(m) for m in MODES} == {PEER, PEER_ASYNC}


def test_pinned_env_count_is_flywheels_eight_and_respects_worker_num_splits() -> None:
    pins = {name: value for name, value, _ in PINNED}
    assert env_count(pins) == ENVS == 8 == env_count(ATARI_CFG)
    assert env_count({"num_workers": 2, "num_envs_per_worker": 4, "worker_num_splits": 2}) == 8
    with pytest.raises(ValueError, match="multiple of worker_num_splits"):
        env_count({"num_workers": 8, "num_envs_per_worker": 1, "worker_num_splits": 2})


def test_flag_writes_lists_as_sf_argparse_reads_them() -> None:
    assert flag("encoder_conv_mlp_layers", [512]) == "--encoder_conv_mlp_layers=512"
    assert flag("use_rnn", False) == "--use_rnn=False"


def test_update_shape_is_samples_per_update_and_passes_over_them() -> None:
    assert update_shape(ATARI_CFG) == {"samples_per_update": 1024, "epochs": 4, "minibatch": 256,
                                       "minibatches_per_epoch": 4, "rollout": 128, "async_rl": False}


def test_series_is_trained_frames_over_the_frame_skip_from_ready_on() -> None:
    log = parse(PONG_LINES)
    assert [(r.env_steps, r.samples, r.last100) for r in log.reports] == [
        (0, 0, None), (4096, 2048, None), (12288, 4096, -20.5), (20480, 6144, None)]
    assert log.reports[2].fps == (1638.4, 1638.4, 1638.4) and log.reports[0].fps is not None
    per = frames_per_step(ATARI_CFG)
    assert per == 4 and frames_per_step({**ATARI_CFG, "summaries_use_frameskip": False}) == 1
    # the report before READY is left out; READY itself is (0 s, 0 trained)
    assert trained_series(log, per) == ((0.0, 0), (5.0, 1024), (10.0, 3072), (15.0, 5120))
    assert trained_series(parse(PONG_LINES[:2]), per) == ()


def test_proc_stat_parses_ids_and_cpu_ticks_even_with_spaces_in_the_name() -> None:
    line = ("4242 (sf (w) 1) S 4200 4242 4242 0 -1 4194560 1000 0 0 0 "
            "150 50 30 20 20 0 9 0 12345 100000 2000 18446744073709551615")
    st = ProcStat.parse(line)
    assert (st.pid, st.ppid, st.session, st.ticks) == (4242, 4200, 4242, 150 + 50 + 30 + 20)
