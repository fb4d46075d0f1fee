"""devstack's optional SASL_PLAINTEXT (SCRAM-SHA-512) listener: off by default, configured when asked for."""

from __future__ import annotations

from pathlib import Path

import pytest

from devstack import kafka
from devstack.config import KAFKA_SASL_PASSWORD, KAFKA_SASL_USERNAME, InfraConfig, StackError
from shared.settings import load_settings


def _props(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key] = value
    return out


def test_off_by_default(tmp_path: Path) -> None:
    cfg = InfraConfig.resolve(home=tmp_path, kafka_port=19492, controller_port=19493, s3_port=19400)
    assert cfg.kafka_sasl_port is None and cfg.endpoints.kafka_sasl_bootstrap is None
    text = kafka.server_properties(cfg)
    assert "sasl" not in text.lower()
    props = _props(text)
    assert props["listeners"] == "PLAINTEXT://127.0.0.1:19492,CONTROLLER://127.0.0.1:19493"
    assert props["listener.security.protocol.map"] == "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT"
    assert not any(a.startswith("-Dflywheel.infra.sasl_port=") for a in kafka.command(cfg, "java", tmp_path))
    with pytest.raises(StackError, match="no SASL listener"):
        cfg.endpoints.kafka_sasl_env()


def test_sasl_listener_beside_plaintext(tmp_path: Path) -> None:
    cfg = InfraConfig.resolve(tmp_path, 19492, 19493, 19400, kafka_sasl_port=19494)
    props = _props(kafka.server_properties(cfg))
    assert props["listeners"] == ("PLAINTEXT://127.0.0.1:19492,CONTROLLER://127.0.0.1:19493,"
                                  "SASL_PLAINTEXT://127.0.0.1:19494")
    assert props["advertised.listeners"] == "PLAINTEXT://127.0.0.1:19492,SASL_PLAINTEXT://127.0.0.1:19494"
    assert props["listener.security.protocol.map"] == ("PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT,"
                                                       "SASL_PLAINTEXT:SASL_PLAINTEXT")
    # The controller and inter-broker traffic stay PLAINTEXT.
    assert props["controller.listener.names"] == "CONTROLLER" and props["inter.broker.listener.name"] == "PLAINTEXT"
    assert props["sasl.enabled.mechanisms"] == "SCRAM-SHA-512"
    assert props["listener.name.sasl_plaintext.scram-sha-512.sasl.jaas.config"] == (
        "org.apache.kafka.common.security.scram.ScramLoginModule required;")
    assert KAFKA_SASL_PASSWORD not in kafka.server_properties(cfg), "SCRAM credentials live in the metadata log"

    args = kafka.command(cfg, "java", tmp_path)
    assert kafka.running_ports(args) == (19492, 19493) and kafka.running_sasl_port(args) == 19494
    assert KAFKA_SASL_PASSWORD not in " ".join(args)


def test_endpoints_point_settings_at_the_sasl_listener(tmp_path: Path) -> None:
    ep = InfraConfig.resolve(tmp_path, 19492, 19493, 19400, kafka_sasl_port=19494).endpoints
    assert ep.kafka_sasl_bootstrap == "127.0.0.1:19494" and ep.kafka_bootstrap == "127.0.0.1:19492"
    assert "FLYWHEEL_KAFKA_SECURITY_PROTOCOL" not in ep.as_env(), "the default stack env stays PLAINTEXT"
    assert KAFKA_SASL_PASSWORD not in repr(ep)
    k = load_settings(environ=ep.kafka_sasl_env()).kafka
    assert (k.bootstrap, k.security_protocol, k.sasl_mechanism, k.sasl_username) == (
        "127.0.0.1:19494", "SASL_PLAINTEXT", "SCRAM-SHA-512", KAFKA_SASL_USERNAME)
    assert k.sasl_password is not None and k.sasl_password.get_secret_value() == KAFKA_SASL_PASSWORD


def test_sasl_port_must_differ(tmp_path: Path) -> None:
    with pytest.raises(StackError, match="must differ"):
        InfraConfig.resolve(tmp_path, 19492, 19493, 19400, kafka_sasl_port=19493)
    with pytest.raises(StackError, match="outside"):
        InfraConfig.resolve(tmp_path, 19492, 19493, 19400, kafka_sasl_port=70000)


def test_a_storage_formatted_without_the_user_is_refused(tmp_path: Path) -> None:
    cfg = InfraConfig.resolve(tmp_path, 19492, 19493, 19400, kafka_sasl_port=19494)
    cfg.kafka_data_dir.mkdir(parents=True)
    (cfg.kafka_data_dir / "meta.properties").write_text("node.id=1\n")  # formatted earlier, without SASL
    with pytest.raises(StackError, match="formatted without the SCRAM user 'flywheel'"):
        kafka.prepare(cfg, "java", tmp_path, progress=lambda _msg: None)
