"""The peers_mujoco figure's pure parts: rl-zoo's HalfCheetah settings for SB3 and their translation into a
Flywheel config, the cut of an episode curve at the env-step budget, the return and wall time there, and the
verdict against the target."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from bench.figures.peers_mujoco import (
    BudgetRun,
    PeerSummary,
    cut_curve,
    from_curve,
    return_at_budget,
    seconds_to_budget,
    verdict,
    zoo_config,
    zoo_overrides,
)
from bench.peers.proc import by_event, json_events
from bench.peers.sb3_mujoco import ZOO_HALFCHEETAH, zoo_kwargs
from bench.samples import FragmentInfo
from shared.settings import load_settings

REPO = Path(__file__).resolve().parents[2]


def test_zoo_kwargs_are_rl_zoos_halfcheetah_entry() -> None:
    from torch import nn

    # rl-baselines3-zoo hyperparams/ppo.yml, HalfCheetah-v3 (00128b5) / HalfCheetah-v4 (208b6fd), typed here by
    # hand from the zoo file so a changed table fails.
    n_envs, ppo, vecnorm = zoo_kwargs()
    assert n_envs == 1
    assert ppo == {
        "batch_size": 64, "n_steps": 512, "gamma": 0.98, "learning_rate": 2.0633e-05, "ent_coef": 0.000401762,
        "clip_range": 0.1, "n_epochs": 20, "gae_lambda": 0.92, "max_grad_norm": 0.8, "vf_coef": 0.58096,
        "policy_kwargs": {"log_std_init": -2, "ortho_init": False, "activation_fn": nn.ReLU,
                          "net_arch": {"pi": [256, 256], "vf": [256, 256]}},
    }
    # normalize: true -> VecNormalize on observations and rewards, discounting with the algorithm's gamma.
    assert vecnorm == {"norm_obs": True, "norm_reward": True, "gamma": 0.98}
    with pytest.raises(ValueError, match="activation_fn"):
        zoo_kwargs({**ZOO_HALFCHEETAH, "policy_kwargs": {"activation_fn": "NoSuchLayer"}})
    with pytest.raises(ValueError, match="lacks"):
        zoo_kwargs({k: v for k, v in ZOO_HALFCHEETAH.items() if k != "gamma"})


def test_curve_is_cut_at_the_budget_and_the_last_ten_averaged() -> None:
    # 14 episodes of 1,000 steps ending at 1k..14k, returns 1..14; a budget of 12,500 keeps 12 of them.
    curve = [(float(i), 1000 * i, float(i)) for i in range(1, 15)]
    assert [c[1] for c in cut_curve(curve, 12_500)] == [1000 * i for i in range(1, 13)]
    assert cut_curve(curve, 12_000)[-1][1] == 12_000  # an episode ending on the budget's step counts
    assert return_at_budget(curve, 12_500) == pytest.approx(sum(range(3, 13)) / 10)  # episodes 3..12
    assert return_at_budget(curve, 3_000) == pytest.approx(2.0)  # fewer than 10: those there are
    assert return_at_budget(curve, 999) is None


def test_seconds_to_budget_counts_fragment_steps_from_the_first_fragment() -> None:
    frags = [FragmentInfo(100.0 + i, 256, (), f"s{i % 2}", 0) for i in range(6)]  # 256, 512, ..., 1536 steps
    assert seconds_to_budget(frags, 1024) == pytest.approx(3.0)  # the 4th fragment brings 1,024
    assert seconds_to_budget(frags, 1025) == pytest.approx(4.0)
    assert seconds_to_budget(frags, 2000) is None
    assert seconds_to_budget([], 1) is None


def test_a_run_short_of_the_budget_is_a_failure_with_its_partial_return() -> None:
    curve = [(1.0, 1000, 5.0), (2.0, 2000, 7.0)]
    ok = from_curve("p", 1, 2000, 3.0, 2.5, curve, 2000)
    assert ok.error is None and ok.return_at_budget == pytest.approx(6.0) and ok.episodes == 2
    assert ok.steps_per_s == pytest.approx(800.0) and ok.end_to_end_s == pytest.approx(5.5)
    short = from_curve("p", 1, 3000, 3.0, None, curve, 2000)
    assert short.error == "reached 2,000 of 3,000 env steps"
    assert from_curve("p", 1, 3000, 3.0, 2.5, curve, 2000).error == "reached 2,000 of 3,000 env steps"
    assert from_curve("p", 1, 2000, None, None, [], 0, "boom").error == "boom"  # the peer's own reason wins


def _run(ret: float | None, wall: float | None, error: str | None = None) -> BudgetRun:
    return BudgetRun("p", 1, 1000, 1.0, wall, ret, 1, 1000, error)


def test_verdict_needs_both_better_return_and_less_wall_time_and_no_failure() -> None:
    sb3 = PeerSummary.of([_run(1000.0, 400.0), _run(1200.0, 420.0)])
    assert verdict(PeerSummary.of([_run(1300.0, 300.0), _run(1100.0, 310.0)]), sb3) == (True, True)
    assert verdict(PeerSummary.of([_run(900.0, 300.0), _run(1000.0, 310.0)]), sb3) == (False, True)
    assert verdict(PeerSummary.of([_run(1300.0, 500.0), _run(1100.0, 510.0)]), sb3) == (True, False)
    # A failed Flywheel run meets nothing, however good the other was.
    assert verdict(PeerSummary.of([_run(5000.0, 10.0), _run(None, None, "timed out")]), sb3) == (False, False)
    # Nothing to compare with.
    assert verdict(PeerSummary.of([_run(1.0, 1.0)]), PeerSummary.of([_run(None, None, "x")])) == (None, None)


def test_zoo_overrides_give_flywheel_the_zoos_numbers(tmp_path: Path) -> None:
    o = zoo_overrides()
    assert o["env"] == {"num_envs": 1, "fragment_steps": 256}
    tr = o["trainer"]
    # 2 samplers x 256 = 512 env steps an update (n_steps), 512 / 64 = 8 minibatches (batch_size 64).
    assert (tr["batch_fragments"], tr["minibatches"], tr["epochs"]) == (2, 8, 20)
    assert tr["vf_coef"] == pytest.approx(2 * 0.58096)  # Flywheel's value loss is 0.5 x MSE, SB3's MSE
    cfg = load_settings(zoo_config(tmp_path / "zoo.yaml"), environ={})
    base = load_settings(REPO / "configs" / "halfcheetah.yaml", environ={})
    t = cfg.trainer
    assert cfg.env.id == "HalfCheetah-v5" and cfg.env.fragment_steps * 2 == 512 and cfg.env.num_envs == 1
    assert (t.learning_rate, t.clip_coef, t.ent_coef, t.max_grad_norm, t.gamma, t.gae_lambda, t.log_std_init,
            t.hidden, t.activation, t.ortho_init) == (2.0633e-05, 0.1, 0.000401762, 0.8, 0.98, 0.92, -2.0, 256,
                                                      "relu", False)
    assert t.learning_rate_end is None and t.clip_coef_end is None and t.target_kl is None
    assert t.normalize_observations and t.normalize_rewards
    # configs/halfcheetah.yaml already carries the zoo's values (its vf_coef on Flywheel's 0.5 x MSE): the
    # derived config changes nothing in the trainer.
    was = base.trainer.model_dump()
    diff = {k for k, v in t.model_dump().items() if v != was[k]}
    assert diff == set()
    assert yaml.safe_load((tmp_path / "zoo.yaml").read_text())["env"]["id"] == "HalfCheetah-v5"


def test_zoo_overrides_refuse_an_entry_that_does_not_split() -> None:
    with pytest.raises(ValueError, match="split evenly"):
        zoo_overrides({**ZOO_HALFCHEETAH, "n_steps": 511})
    with pytest.raises(ValueError, match="two equal hidden layers"):
        zoo_overrides({**ZOO_HALFCHEETAH,
                       "policy_kwargs": {"log_std_init": -2, "net_arch": {"pi": [256, 128], "vf": [256, 128]}}})
    with pytest.raises(ValueError, match="tanh or relu"):
        zoo_overrides({**ZOO_HALFCHEETAH,
                       "policy_kwargs": {**ZOO_HALFCHEETAH["policy_kwargs"], "activation_fn": "ELU"}})
    plain = zoo_overrides({**ZOO_HALFCHEETAH,
                           "policy_kwargs": {"log_std_init": 0, "net_arch": {"pi": [64, 64], "vf": [64, 64]}}})
    assert (plain["trainer"]["activation"], plain["trainer"]["ortho_init"]) == ("tanh", True)  # SB3's defaults


def test_child_events_are_read_from_mixed_output() -> None:
    lines = ["Using cpu device", '{"event": "learn_start", "wall": 5.0}', "{not json", '{"no": "event"}',
             '{"event": "done", "env_steps": 512}']
    assert by_event(json_events(lines)) == {"learn_start": {"event": "learn_start", "wall": 5.0},
                                   "done": {"event": "done", "env_steps": 512}}
