"""Kafka ACLs per role: what each service's SASL user may do on one run's topics and groups (docs/security.md).

The rules are data (:func:`role_acls`); :func:`create_acls` writes them to a cluster whose brokers run an
authorizer (``StandardAuthorizer`` on KRaft), and :func:`provision_run` is the init step: the run's topics,
then every role's ACLs. It must run as a super user (``super.users``): nothing below grants anyone the right
to create topics or ACLs.

Invariants of :func:`role_acls`:

- every principal is ``User:<role>`` for a role of :data:`ROLES`; every ACL is an ``ALLOW`` (what is not
  allowed is refused, so no ``DENY`` is needed) on the run's own resources only (the topic prefix
  ``<run>.``, the literal topics of :class:`shared.kafka.Topics`, the groups ``<run>.trainer`` and
  ``<run>.paramsync``);
- every role may ``DESCRIBE`` every topic of the run (metadata, end offsets, ``ensure_topics``' listing),
  and no role may ``CREATE`` or ``DELETE`` one: the init step creates the topics;
- only the trainer reads ``<run>.samples`` and joins ``<run>.trainer``; only paramsync joins
  ``<run>.paramsync``; samplers may ``DESCRIBE`` the trainer group (the lag their backlog limit reads)
  but not join it or commit to it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from aiokafka.errors import for_code
from aiokafka.protocol.admin import CreateAclsRequest

from shared.kafka import Topics, ensure_topics, make_admin, trainer_group
from shared.settings import Settings

ROLES = ("sampler", "trainer", "paramsync", "admin")
"""The services, each with its own SASL user named after it."""


class Resource(IntEnum):
    """Kafka's ``ResourceType`` codes (the wire values of the ACL requests)."""

    TOPIC = 2
    GROUP = 3


class Pattern(IntEnum):
    """Kafka's ``PatternType`` codes: the name is the whole resource name, or a prefix of it."""

    LITERAL = 3
    PREFIXED = 4


class Op(IntEnum):
    """Kafka's ``AclOperation`` codes (those Flywheel grants)."""

    READ = 3
    WRITE = 4
    CREATE = 5
    DELETE = 6
    DESCRIBE = 8
    DESCRIBE_CONFIGS = 10


ALLOW = 3
"""Kafka's ``AclPermissionType.ALLOW``."""


@dataclass(frozen=True, order=True)
class Acl:
    """One ALLOW binding: ``principal`` may ``op`` on the resource ``(resource, pattern, name)`` from any host."""

    principal: str
    resource: Resource
    pattern: Pattern
    name: str
    op: Op

    def __str__(self) -> str:
        return f"{self.principal} {self.op.name} {self.resource.name.lower()} {self.pattern.name.lower()}:{self.name}"


def paramsync_group(run: str) -> str:
    """The consumer group paramsync reads candidates with."""
    return f"{run}.paramsync"


def role_acls(run: str) -> dict[str, list[Acl]]:
    """Every role's ACLs for ``run`` (sorted), from what each service reads and writes (docs/security.md)."""
    t = Topics.for_run(run)

    def grants(role: str, *rules: tuple[Resource, Pattern, str, tuple[Op, ...]]) -> list[Acl]:
        out = {Acl(f"User:{role}", Resource.TOPIC, Pattern.PREFIXED, f"{run}.", Op.DESCRIBE)}
        for resource, pattern, name, ops in rules:
            out.update(Acl(f"User:{role}", resource, pattern, name, op) for op in ops)
        return sorted(out)

    topic, group, lit = Resource.TOPIC, Resource.GROUP, Pattern.LITERAL
    r, w, d = Op.READ, Op.WRITE, Op.DESCRIBE
    return {
        "sampler": grants(
            "sampler",
            (topic, lit, t.samples, (w,)), (topic, lit, t.heartbeats, (w,)),
            (topic, lit, t.policy, (r,)), (topic, lit, t.control, (r,)), (topic, lit, t.credits, (r,)),
            (group, lit, trainer_group(run), (d,)),  # the trainer's lag, for max_backlog
        ),
        "trainer": grants(
            "trainer",
            (topic, lit, t.samples, (r,)), (topic, lit, t.dlq, (w,)),
            (topic, lit, t.policy, (r, w)),  # candidates out, announcements (rollbacks) in
            (topic, lit, t.heartbeats, (r, w)), (topic, lit, t.credits, (w,)),
            (group, lit, trainer_group(run), (r, d)),
        ),
        "paramsync": grants(
            "paramsync",
            (topic, lit, t.policy, (r, w, Op.DESCRIBE_CONFIGS)),  # candidates in, announcements out; its
            # max.message.bytes caps inline policies (shared.kafka.topic_max_message_bytes)
            (topic, lit, t.heartbeats, (r, w)), (topic, lit, t.control, (r,)),
            (group, lit, paramsync_group(run), (r, d)),
        ),
        "admin": grants(
            "admin",
            (topic, Pattern.PREFIXED, f"{run}.", (r,)),  # heartbeats, `flywheel verify` (samples, dlq)
            (topic, lit, t.control, (w,)),
            (group, Pattern.PREFIXED, f"{run}.", (d,)),  # lag of the run's groups
        ),
    }


class AclError(RuntimeError):
    """The broker refused to create an ACL (not a super user, no authorizer, a bad binding)."""


async def create_acls(settings: Settings, acls: list[Acl], timeout_s: float = 30.0) -> None:
    """Create ``acls`` (idempotent: an existing binding is kept) with ``settings``' Kafka credentials.

    aiokafka 0.14's admin client has no ``create_acls``; this sends Kafka's ``CreateAcls`` request (one
    binding per request, the version negotiated by aiokafka) through the admin client's own connection.
    Raises :class:`AclError` naming the first refused binding with the broker's error, ``TimeoutError``
    after ``timeout_s``.
    """
    admin = make_admin(settings)

    async def _create() -> None:
        await admin.start()
        for acl in acls:
            request = CreateAclsRequest(int(acl.resource), acl.name, int(acl.pattern), acl.principal, "*",
                                        int(acl.op), ALLOW)
            response: Any = await admin._send_request(request)  # noqa: SLF001 - aiokafka has no public create_acls
            for code, message in ((c[0], c[1]) for c in response.creation_responses):
                if code:
                    raise AclError(f"creating the ACL {acl} was refused: {for_code(code).__name__}: {message}")

    try:
        await asyncio.wait_for(_create(), timeout_s)
    finally:
        await admin.close()


async def provision_run(settings: Settings, roles: tuple[str, ...] = ROLES) -> dict[str, list[Acl]]:
    """The init step for ``settings.run``: create its topics, then the ACLs of ``roles``; returns them.

    ``settings`` must carry a super user's credentials. Idempotent, so it runs on every start.
    """
    unknown = sorted(set(roles) - set(ROLES))
    if unknown:
        raise ValueError(f"unknown roles {unknown}; the roles are {', '.join(ROLES)}")
    await ensure_topics(settings)
    wanted = {role: acls for role, acls in role_acls(settings.run).items() if role in roles}
    await create_acls(settings, [acl for acls in wanted.values() for acl in acls])
    return wanted
