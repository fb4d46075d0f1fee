"""Every file in configs/ loads, validates, and names an environment the services can run."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.rl.envs import fragment_spec
from shared.settings import load_settings

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


def test_there_are_configs() -> None:
    assert len(CONFIGS) >= 2


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_loads_and_its_env_is_supported(path: Path) -> None:
    settings = load_settings(path, environ={})
    spec = fragment_spec(settings.env.id, settings.kafka.max_message_bytes)
    assert spec.env_id == settings.env.id and (spec.continuous or spec.num_actions >= 2)
    steps = settings.env.num_envs * settings.env.fragment_steps * settings.trainer.batch_fragments
    assert steps >= settings.trainer.minibatches
