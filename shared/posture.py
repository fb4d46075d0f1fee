"""Which protections a service runs without (docs/security.md, "Protections turned off").

Every deployment the project ships turns them on where it can; each one that is off here is an explicit setting,
and :func:`protections_off` names it with what it leaves open. Every service logs each one at start
(``protection_off``, a warning), and the admin's ``/status`` lists them (``security.protections_off``), so an
operator sees a weakened stack in the log and on the status page rather than by reading the configuration.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.settings import Settings


@dataclass(frozen=True)
class Off:
    setting: str
    """The setting that turned it off, as ``section.field=value``."""
    leaves: str
    """What it leaves open."""

    def as_dict(self) -> dict[str, str]:
        return {"setting": self.setting, "leaves": self.leaves}


def protections_off(service: str, settings: Settings) -> list[Off]:
    """The protections ``service`` runs without under ``settings``, in a fixed order."""
    out: list[Off] = []
    if not settings.signing.enabled:
        out.append(Off("signing.enabled=false", "candidates, policies and checkpoints are neither signed nor checked: "
                       "a writer of the policy topic or the store can steer every sampler"))
    protocol = settings.kafka.security_protocol
    if protocol == "PLAINTEXT":
        out.append(Off("kafka.security_protocol=PLAINTEXT", "no Kafka authentication: any client that reaches the "
                       "brokers may write and read every topic as any role (no per-role ACLs)"))
    elif protocol == "SASL_PLAINTEXT":
        out.append(Off("kafka.security_protocol=SASL_PLAINTEXT", "Kafka without TLS: the traffic, records included, "
                       "can be read on the network (the SCRAM password is not sent)"))
    if settings.store.backend == "s3" and (settings.s3.endpoint or "").startswith("http://"):
        out.append(Off(f"s3.endpoint={settings.s3.endpoint}", "the object store without TLS: weights and checkpoints "
                       "can be read on the network (digests and signatures still catch an altered one)"))
    if service == "sampler" and not settings.sampler.identity:
        out.append(Off("sampler.identity=false", "this sampler's fragments and heartbeats carry no key: another "
                       "process may use its id"))
    if service == "admin":
        if settings.admin.insecure_dev:
            out.append(Off("admin.insecure_dev=true", "the admin API checks no token where no operator is named: "
                           "anyone who reaches it may pause, roll back and reconfigure the run"))
        if settings.admin.public_reads:
            out.append(Off("admin.public_reads=true", "reads (status, audit, config, traces) need no token"))
    return out
