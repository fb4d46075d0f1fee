"""The EnvPool ceiling's pure parts: its options against Flywheel's Pong preprocessing, a child's output read into
a series, and the child's imports (it runs in EnvPool's own venv, which has numpy and envpool only)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from bench.peers import envpool_raw
from bench.peers.proc import ProcResult, json_events
from shared.rl.envs import default_frame_stack, env_options

REPO = Path(__file__).resolve().parents[2]


def test_settings_match_flywheels_pong_preprocessing() -> None:
    s = envpool_raw.SETTINGS
    kwargs, wrappers = env_options("ALE/Pong-v5")
    assert s["repeat_action_probability"] == kwargs["repeat_action_probability"] == 0.0
    assert len(wrappers) == 1  # AtariPreprocessing, checked against a built env below when ale-py is there
    assert (s["img_height"], s["img_width"], s["gray_scale"]) == (84, 84, True)
    assert (s["frame_skip"], s["noop_max"]) == (4, 30)
    assert s["stack_num"] == default_frame_stack("ALE/Pong-v5") == 4
    assert s["episodic_life"] is False and s["reward_clip"] is False and s["zero_discount_on_life_loss"] is False
    assert s["use_fire_reset"] is False  # EnvPool's default presses FIRE at reset; gymnasium's wrapper does not
    assert s["full_action_space"] is False and s["use_inter_area_resize"] is True
    assert s["max_episode_steps"] * s["frame_skip"] == 108_000  # ALE v5's frames per episode


def test_settings_match_a_built_flywheel_env() -> None:
    pytest.importorskip("ale_py")
    import gymnasium as gym
    from gymnasium.wrappers import AtariPreprocessing

    from shared.rl.envs import register_image_envs

    register_image_envs("ALE/Pong-v5")
    kwargs, wrappers = env_options("ALE/Pong-v5")
    env = wrappers[0](gym.make("ALE/Pong-v5", **kwargs))
    try:
        assert isinstance(env, AtariPreprocessing)
        s = envpool_raw.SETTINGS
        assert (env.noop_max, env.frame_skip, env.screen_size, env.grayscale_obs) == (
            s["noop_max"], s["frame_skip"], (s["img_width"], s["img_height"]), s["gray_scale"])
        assert env.terminal_on_life_loss is s["episodic_life"]
        assert env.observation_space.shape == (s["img_height"], s["img_width"])
        assert env.action_space == gym.spaces.Discrete(6)  # the minimal action set (full_action_space False)
        assert env.spec is not None and env.spec.max_episode_steps is None
        assert env.unwrapped.ale.getInt(  # type: ignore[attr-defined]
            "max_num_frames_per_episode") == s["max_episode_steps"] * s["frame_skip"]
    finally:
        env.close()


def _result(*lines: str, wall_start: float = 1000.0, rc: int | None = 0, timed_out: bool = False) -> ProcResult:
    return ProcResult(lines=[(0.1 * i, line) for i, line in enumerate(lines)], rc=rc, wall_start=wall_start,
                      timed_out=timed_out)


def test_child_output_becomes_a_series_of_stepped_steps() -> None:
    res = _result("A.L.E: Arcade Learning Environment", '{"event": "first_step", "wall": 1001.25}',
                  '{"event": "progress", "t": 1.0, "stepped": 4000}',
                  '{"event": "progress", "t": 2.0, "stepped": 8200}',
                  '{"event": "progress", "t": 2.5, "stepped": 10000}',
                  '{"event": "done", "stepped": 10000, "cores_stepping": 1.95, "envpool": "1.2.5", "numpy": "2.4.6", '
                  '"obs_shape": [8, 4, 84, 84], "obs_dtype": "uint8", "num_actions": 6}')
    run = envpool_raw.run_of(2, res, 1.8, 2, 8)
    assert run.error is None and run.peer == "EnvPool (raw)" and run.seed == 2
    assert run.startup_s == pytest.approx(1.25)
    assert run.series == ((1.0, 4000), (2.0, 8200), (2.5, 10000))
    assert run.extra["cores"] == 1.8 and run.extra["threads"] == 2 and run.extra["num_envs"] == 8
    assert run.extra["settings"] == envpool_raw.SETTINGS and run.extra["settings"] is not envpool_raw.SETTINGS
    assert run.extra["envpool"] == "1.2.5" and run.extra["obs_shape"] == [8, 4, 84, 84]
    assert run.extra["cores_stepping"] == 1.95


def test_child_output_without_done_or_with_a_falling_count_is_an_error() -> None:
    hung = envpool_raw.run_of(1, _result('{"event": "first_step", "wall": 1002.0}', rc=None, timed_out=True), None,
                              2, 8)
    assert hung.error is not None and "timed out" in hung.error and hung.startup_s == pytest.approx(2.0)
    fell = envpool_raw.run_of(1, _result('{"event": "progress", "t": 1.0, "stepped": 800}',
                                         '{"event": "progress", "t": 2.0, "stepped": 400}', '{"event": "done"}'),
                              None, 2, 8)
    assert fell.error is not None and "fell" in fell.error and fell.series == ()
    assert json_events(["{not json", "[1, 2]", '{"event": "x"}']) == [{"event": "x"}]


def test_child_command_runs_this_file_in_the_envpool_venv() -> None:
    cmd = envpool_raw.child_command(3, 20.0, 2)
    assert cmd[0] == str(envpool_raw.VENV / "bin" / "python")
    assert Path(cmd[1]) == REPO / "bench" / "peers" / "envpool_raw.py" and "--child" in cmd
    assert cmd[cmd.index("--num-envs") + 1] == "8" and cmd[cmd.index("--threads") + 1] == "2"
    assert cmd[cmd.index("--seconds") + 1] == "20.0" and cmd[cmd.index("--seed") + 1] == "3"
    with pytest.raises(SystemExit):
        envpool_raw.main(["--child", "--seconds", "0", "--threads", "2"])


def test_the_child_imports_only_the_standard_library_at_top_level() -> None:
    """EnvPool's venv has no Flywheel packages: a top-level import of one would break the child."""
    tree = ast.parse(Path(envpool_raw.__file__).read_text())
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.If):  # ``if TYPE_CHECKING:`` imports never run
            continue
        if isinstance(node, ast.Import):
            names += [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            names.append(node.module.split(".")[0])
    assert names and all(n in sys.stdlib_module_names or n == "__future__" for n in names), names
