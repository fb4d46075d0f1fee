from pathlib import Path

import pytest

from shared.settings import ConfigError, Settings, load_settings

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_config_file_loads(path: Path) -> None:
    s = load_settings(path, environ={})
    assert isinstance(s, Settings)
    assert s.redacted()["run"] == s.run


def test_there_are_config_files() -> None:
    assert CONFIGS, "configs/ holds no YAML file"


def test_env_overrides_yaml(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("run: a\ntrainer:\n  max_staleness: 2\nkafka:\n  bootstrap: host:1\n")
    s = load_settings(cfg, environ={"FLYWHEEL_TRAINER_MAX_STALENESS": "7", "FLYWHEEL_RUN": "b"})
    assert s.trainer.max_staleness == 7
    assert s.run == "b"
    assert s.kafka.bootstrap == "host:1"


def test_an_optional_setting_is_unset_from_the_environment(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("trainer:\n  target_kl: 0.02\n")
    assert load_settings(cfg, environ={}).trainer.target_kl == 0.02
    assert load_settings(cfg, environ={"FLYWHEEL_TRAINER_TARGET_KL": "none"}).trainer.target_kl is None
    assert load_settings(cfg, environ={"FLYWHEEL_TRAINER_TARGET_KL": "NULL"}).trainer.target_kl is None
    # Only optional settings: "none" for a required number is still a clear error naming the field.
    with pytest.raises(ConfigError, match="max_staleness"):
        load_settings(cfg, environ={"FLYWHEEL_TRAINER_MAX_STALENESS": "none"})


def test_infra_env_names_map_to_fields() -> None:
    s = load_settings(None, environ={"FLYWHEEL_KAFKA_BOOTSTRAP": "127.0.0.1:19092",
                                     "FLYWHEEL_S3_ENDPOINT": "http://127.0.0.1:19000"})
    assert s.kafka.bootstrap == "127.0.0.1:19092"
    assert s.s3.endpoint == "http://127.0.0.1:19000"


def test_unknown_yaml_key_is_rejected(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("trainer:\n  max_stalenes: 2\n")
    with pytest.raises(ConfigError, match=r"trainer\.max_stalenes"):
        load_settings(cfg, environ={})


def test_unknown_env_key_is_rejected() -> None:
    with pytest.raises(ConfigError, match="FLYWHEEL_TRAINER_MAX_STALENES"):
        load_settings(None, environ={"FLYWHEEL_TRAINER_MAX_STALENES": "1"})
    with pytest.raises(ConfigError, match="FLYWHEEL_NOPE_X"):
        load_settings(None, environ={"FLYWHEEL_NOPE_X": "1"})


def test_invalid_value_names_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"env\.num_envs"):
        load_settings(None, environ={"FLYWHEEL_ENV_NUM_ENVS": "0"})
    with pytest.raises(ConfigError, match=r"s3\.endpoint"):
        load_settings(None, environ={"FLYWHEEL_S3_ENDPOINT": "ftp://x"})
    with pytest.raises(ConfigError, match=r"run"):
        load_settings(None, environ={"FLYWHEEL_RUN": "bad name!"})


def test_missing_or_broken_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_settings(tmp_path / "absent.yaml", environ={})
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_settings(bad, environ={})


def test_secret_is_redacted() -> None:
    s = load_settings(None, environ={"FLYWHEEL_ADMIN_TOKEN": "sekrit"})
    assert s.admin.token is not None and s.admin.token.get_secret_value() == "sekrit"
    assert "sekrit" not in str(s.redacted())


def test_config_errors_never_echo_secrets() -> None:
    env = {"FLYWHEEL_ADMIN_TOKEN": "s3cr3t-token-value-0123456789abcdef", "FLYWHEEL_TRAINER_MINIBATCHES": "100000",
           "FLYWHEEL_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT", "FLYWHEEL_KAFKA_SASL_USERNAME": "u",
           "FLYWHEEL_KAFKA_SASL_PASSWORD": "hunter2-password"}
    with pytest.raises(ConfigError) as err:
        load_settings(None, environ=env)
    text = str(err.value)
    assert "trainer.minibatches" in text or "minibatches" in text
    assert "hunter2-password" not in text and "s3cr3t-token-value" not in text
