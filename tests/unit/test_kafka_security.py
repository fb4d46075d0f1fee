"""Kafka security settings: validation with the field named, client_security per protocol, secrets masked.

No broker: the clients are built but never started (tests/integration/test_kafka_sasl.py talks to a real
SASL/SCRAM broker).
"""

from __future__ import annotations

import datetime as dt
import json
import ssl
from pathlib import Path
from typing import Any

import pytest

from shared import kafka as shared_kafka
from shared.kafka import LagProbe, client_security, ensure_topics, make_consumer, make_producer
from shared.settings import ConfigError, Settings, load_settings

PASSWORD = "s3cr3t-scram-password"
SASL_ENV = {
    "FLYWHEEL_KAFKA_BOOTSTRAP": "127.0.0.1:1",
    "FLYWHEEL_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
    "FLYWHEEL_KAFKA_SASL_USERNAME": "flywheel",
    "FLYWHEEL_KAFKA_SASL_PASSWORD": PASSWORD,
}


def load(**env: str) -> Settings:
    return load_settings(environ=env)


def config_error(**env: str) -> str:
    with pytest.raises(ConfigError) as info:
        load(**env)
    return str(info.value)


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A self-signed CA and a client certificate it signed, with the client's key, as PEM files."""
    crypto = pytest.importorskip("cryptography")
    del crypto
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    out = tmp_path_factory.mktemp("tls")
    now = dt.datetime.now(dt.UTC)

    def cert(subject: str, key: Any, issuer: str, issuer_key: Any, ca: bool) -> x509.Certificate:
        return (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=1))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
            .sign(issuer_key, hashes.SHA256())
        )

    ca_key, client_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    files = {"ca": out / "ca.pem", "cert": out / "client.pem", "key": out / "client.key"}
    files["ca"].write_bytes(cert("flywheel-test-ca", ca_key, "flywheel-test-ca", ca_key, True)
                            .public_bytes(serialization.Encoding.PEM))
    files["cert"].write_bytes(cert("flywheel-client", client_key, "flywheel-test-ca", ca_key, False)
                              .public_bytes(serialization.Encoding.PEM))
    files["key"].write_bytes(client_key.private_bytes(serialization.Encoding.PEM,
                                                      serialization.PrivateFormat.PKCS8,
                                                      serialization.NoEncryption()))
    return files


# ---- validation ---------------------------------------------------------------------------------


def test_default_is_plaintext_without_credentials() -> None:
    k = Settings().kafka
    assert (k.security_protocol, k.sasl_mechanism) == ("PLAINTEXT", "SCRAM-SHA-512")
    assert all(v is None for v in (k.sasl_username, k.sasl_password, k.ssl_cafile, k.ssl_certfile, k.ssl_keyfile))


def test_sasl_settings_from_the_environment() -> None:
    k = load(**SASL_ENV, FLYWHEEL_KAFKA_SASL_MECHANISM="SCRAM-SHA-256").kafka
    assert (k.security_protocol, k.sasl_mechanism, k.sasl_username) == ("SASL_PLAINTEXT", "SCRAM-SHA-256", "flywheel")
    assert k.sasl_password is not None and k.sasl_password.get_secret_value() == PASSWORD


def test_sasl_without_username_names_the_field() -> None:
    env = {k: v for k, v in SASL_ENV.items() if k != "FLYWHEEL_KAFKA_SASL_USERNAME"}
    msg = config_error(**env)
    assert "kafka.sasl_username is required" in msg and "SASL_PLAINTEXT" in msg
    assert PASSWORD not in msg, "the error message must not echo the password"


def test_sasl_without_password_names_the_field_and_the_variable() -> None:
    for password in (None, ""):
        env = {k: v for k, v in SASL_ENV.items() if k != "FLYWHEEL_KAFKA_SASL_PASSWORD"}
        if password is not None:
            env["FLYWHEEL_KAFKA_SASL_PASSWORD"] = password
        msg = config_error(**env)
        assert "kafka.sasl_password is required" in msg and "FLYWHEEL_KAFKA_SASL_PASSWORD" in msg


def test_unknown_protocol_and_mechanism_are_rejected() -> None:
    msg = config_error(FLYWHEEL_KAFKA_SECURITY_PROTOCOL="SASL_TLS")
    assert "kafka.security_protocol" in msg and "SASL_TLS" in msg
    msg = config_error(**SASL_ENV, FLYWHEEL_KAFKA_SASL_MECHANISM="GSSAPI")
    assert "kafka.sasl_mechanism" in msg and "GSSAPI" in msg


def test_credentials_without_a_sasl_protocol_are_rejected() -> None:
    msg = config_error(FLYWHEEL_KAFKA_SASL_USERNAME="flywheel")
    assert "kafka.sasl_username is set" in msg and "'PLAINTEXT' does not use SASL" in msg
    msg = config_error(FLYWHEEL_KAFKA_SECURITY_PROTOCOL="SSL", FLYWHEEL_KAFKA_SASL_PASSWORD=PASSWORD)
    assert "kafka.sasl_password is set" in msg
    assert PASSWORD not in msg, "the error message must not echo the password"


def test_missing_ssl_file_names_the_field(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "ca.pem"
    msg = config_error(FLYWHEEL_KAFKA_SECURITY_PROTOCOL="SSL", FLYWHEEL_KAFKA_SSL_CAFILE=str(missing))
    assert "kafka.ssl_cafile does not exist" in msg and str(missing) in msg
    msg = config_error(**SASL_ENV | {"FLYWHEEL_KAFKA_SECURITY_PROTOCOL": "SASL_SSL"},
                       FLYWHEEL_KAFKA_SSL_CERTFILE=str(tmp_path))  # a directory is not a certificate
    assert "kafka.ssl_certfile does not exist or is not a file" in msg


def test_ssl_keyfile_needs_a_certfile(tls_files: dict[str, Path]) -> None:
    msg = config_error(FLYWHEEL_KAFKA_SECURITY_PROTOCOL="SSL", FLYWHEEL_KAFKA_SSL_KEYFILE=str(tls_files["key"]))
    assert "kafka.ssl_keyfile is set without kafka.ssl_certfile" in msg


def test_ssl_files_without_tls_are_rejected(tls_files: dict[str, Path]) -> None:
    msg = config_error(FLYWHEEL_KAFKA_SSL_CAFILE=str(tls_files["ca"]))
    assert "kafka.ssl_cafile is set" in msg and "does not use TLS" in msg


def test_password_is_masked_in_the_logged_config() -> None:
    s = load(**SASL_ENV)
    logged = json.dumps(s.redacted())
    assert PASSWORD not in logged
    assert s.redacted()["kafka"]["sasl_password"] != PASSWORD
    assert s.redacted()["kafka"]["sasl_username"] == "flywheel"
    assert PASSWORD not in repr(s) and PASSWORD not in str(s.kafka)


# ---- client_security ----------------------------------------------------------------------------


def test_client_security_plaintext() -> None:
    assert client_security(Settings()) == {"security_protocol": "PLAINTEXT"}


def test_client_security_sasl_plaintext() -> None:
    assert client_security(load(**SASL_ENV)) == {
        "security_protocol": "SASL_PLAINTEXT",
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_plain_username": "flywheel",
        "sasl_plain_password": PASSWORD,
    }


def test_client_security_ssl_with_client_certificate(tls_files: dict[str, Path]) -> None:
    s = load(FLYWHEEL_KAFKA_SECURITY_PROTOCOL="SSL", FLYWHEEL_KAFKA_SSL_CAFILE=str(tls_files["ca"]),
             FLYWHEEL_KAFKA_SSL_CERTFILE=str(tls_files["cert"]), FLYWHEEL_KAFKA_SSL_KEYFILE=str(tls_files["key"]))
    sec = client_security(s)
    assert set(sec) == {"security_protocol", "ssl_context"} and sec["security_protocol"] == "SSL"
    ctx = sec["ssl_context"]
    assert isinstance(ctx, ssl.SSLContext)
    assert ctx.check_hostname and ctx.verify_mode == ssl.CERT_REQUIRED
    assert [c["subject"] for c in ctx.get_ca_certs()] == [((("commonName", "flywheel-test-ca"),),)]


def test_client_security_sasl_ssl_with_system_cas() -> None:
    sec = client_security(load(**SASL_ENV | {"FLYWHEEL_KAFKA_SECURITY_PROTOCOL": "SASL_SSL"}))
    assert sec["security_protocol"] == "SASL_SSL" and sec["sasl_plain_password"] == PASSWORD
    assert isinstance(sec["ssl_context"], ssl.SSLContext) and sec["ssl_context"].check_hostname


def test_a_key_that_does_not_match_fails_when_the_context_is_built(tls_files: dict[str, Path]) -> None:
    s = load(FLYWHEEL_KAFKA_SECURITY_PROTOCOL="SSL", FLYWHEEL_KAFKA_SSL_CERTFILE=str(tls_files["cert"]),
             FLYWHEEL_KAFKA_SSL_KEYFILE=str(tls_files["ca"]))  # a certificate, not a key
    with pytest.raises(ssl.SSLError):
        client_security(s)


# ---- every client factory applies it ------------------------------------------------------------


def _client_security_of(client: Any) -> tuple[Any, ...]:
    # The AIOKafkaClient under a producer (.client), a consumer or an admin client (._client).
    c = getattr(client, "client", None) or client._client  # noqa: SLF001
    return c._security_protocol, c._sasl_mechanism, c._sasl_plain_username, c._sasl_plain_password


async def test_every_factory_uses_client_security() -> None:
    s = load(**SASL_ENV)
    expected = ("SASL_PLAINTEXT", "SCRAM-SHA-512", "flywheel", PASSWORD)
    producer = make_producer(s)
    consumer = make_consumer(s, "t.samples", group_id="g")
    probe = LagProbe(s)
    try:
        assert _client_security_of(producer) == expected
        assert _client_security_of(consumer) == expected
        assert _client_security_of(probe._probe) == expected  # noqa: SLF001
        assert _client_security_of(probe._admin) == expected  # noqa: SLF001
    finally:
        await producer.stop()
        await consumer.stop()
        await probe.stop()


async def test_ensure_topics_admin_uses_client_security(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    class RecordingAdmin:
        def __init__(self, **kwargs: Any) -> None:
            seen.update(kwargs)

        async def start(self) -> None:
            raise RuntimeError("no broker in a unit test")

    monkeypatch.setattr(shared_kafka, "AIOKafkaAdminClient", RecordingAdmin)
    s = load(**SASL_ENV)
    with pytest.raises(RuntimeError, match="no broker"):
        await ensure_topics(s)
    assert {k: seen[k] for k in client_security(s)} == client_security(s)
