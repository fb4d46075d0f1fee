"""The Kubernetes cluster overlay's Kafka users, ACLs and topics for one run, generated from :mod:`shared.acl`.

``python -m shared.k8s_acl generate --run NAME`` writes, into an overlay directory (default
``deploy/k8s/overlays/cluster``):

- ``users.yaml``: one Strimzi ``KafkaUser`` per role of :data:`shared.acl.ROLES`, named ``flywheel-<role>``
  (the SASL user that role's pods log in as), SCRAM-SHA-512, with exactly the ACLs :func:`shared.acl.role_acls`
  grants that role for the run, and the run in its annotation ``flywheel.io/run``;
- ``topics.yaml``: one ``KafkaTopic`` per topic of :func:`shared.kafka.topic_specs` (partitions, replicas,
  configs, the Kafka name in ``spec.topicName``) for the run's settings;
- ``run.env``: ``FLYWHEEL_RUN=<run>``, merged into the services' ConfigMap, so the pods use that run.

Every file starts with the command that wrote it. ``check`` re-runs that command for each overlay and fails
when a committed file differs (a hand edit); ``policy`` writes what each role may do, for any run (its names
carry the placeholder ``{run}``), which ``k8s-check -acl-policy`` holds every KafkaUser of every overlay to
(docs/kubernetes.md, "What k8s-check enforces"). ``make k8s-check`` runs both.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from shared.acl import Acl, Pattern, role_acls
from shared.kafka import topic_specs
from shared.settings import load_settings

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OVERLAY = REPO / "deploy" / "k8s" / "overlays" / "cluster"
DEFAULT_CONFIG = "configs/cartpole.yaml"
DEFAULT_REPLICATION = 3
KAFKA_CLUSTER = "flywheel"
"""The Strimzi ``Kafka`` the users and topics belong to (label ``strimzi.io/cluster``; the overlay's kafka.yaml)."""
API_VERSION = "kafka.strimzi.io/v1"
USER_PREFIX = "flywheel-"
RUN_ANNOTATION = "flywheel.io/run"
RUN_PLACEHOLDER = "{run}"
FILES = ("users.yaml", "topics.yaml", "run.env")
COMMAND = "python -m shared.k8s_acl generate"
_PATTERN = {Pattern.LITERAL: "literal", Pattern.PREFIXED: "prefix"}


class GeneratedFilesDiffer(RuntimeError):
    """A committed generated file is not the generator's output (edited by hand, or shared/acl.py changed)."""


def user_name(role: str) -> str:
    """The KafkaUser, and SASL user, of ``role``."""
    return f"{USER_PREFIX}{role}"


def strimzi_acls(acls: Sequence[Acl]) -> list[dict[str, Any]]:
    """``acls`` as Strimzi ``KafkaUser`` ACL rules: one rule per resource, its operations sorted."""
    ops: dict[tuple[str, str, str], set[str]] = {}
    for acl in acls:
        key = (acl.resource.name.lower(), acl.name, _PATTERN[acl.pattern])
        ops.setdefault(key, set()).add("".join(word.capitalize() for word in acl.op.name.split("_")))  # DescribeConfigs
    return [{"resource": {"type": kind, "name": name, "patternType": pattern},
             "operations": sorted(ops[kind, name, pattern])} for kind, name, pattern in sorted(ops)]


def kafka_users(run: str) -> list[dict[str, Any]]:
    """One KafkaUser per role with the ACLs :func:`shared.acl.role_acls` grants it for ``run``."""
    return [{
        "apiVersion": API_VERSION, "kind": "KafkaUser",
        "metadata": {"name": user_name(role), "labels": {"strimzi.io/cluster": KAFKA_CLUSTER},
                     "annotations": {RUN_ANNOTATION: run}},
        "spec": {"authentication": {"type": "scram-sha-512"},
                 "authorization": {"type": "simple", "acls": strimzi_acls(acls)}},
    } for role, acls in role_acls(run).items()]


def object_name(topic: str) -> str:
    """A Kubernetes name (DNS-1123 subdomain) for ``topic``; the topic's own name goes in ``spec.topicName``."""
    name = re.sub(r"[^a-z0-9.-]+", "-", topic.lower()).strip(".-")
    if not name or len(name) > 253:
        raise ValueError(f"no Kubernetes name for topic {topic!r}")
    return name


def kafka_topics(config: str, run: str, replication_factor: int) -> list[dict[str, Any]]:
    """One KafkaTopic per topic :func:`shared.kafka.topic_specs` declares for ``run`` under ``config``."""
    settings = load_settings(REPO / config, environ={"FLYWHEEL_RUN": run,
                                                     "FLYWHEEL_KAFKA_REPLICATION_FACTOR": str(replication_factor)})
    specs = topic_specs(settings)
    names = [object_name(t.name) for t in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"two topics of run {run!r} map to one Kubernetes name: {names}")
    return [{
        "apiVersion": API_VERSION, "kind": "KafkaTopic",
        "metadata": {"name": name, "labels": {"strimzi.io/cluster": KAFKA_CLUSTER},
                     "annotations": {RUN_ANNOTATION: run}},
        "spec": {"topicName": t.name, "partitions": t.num_partitions, "replicas": t.replication_factor,
                 "config": dict(t.topic_configs)},
    } for name, t in zip(names, specs, strict=True)]


def command_line(config: str, run: str, replication_factor: int) -> str:
    return (f"{COMMAND} --config {shlex.quote(config)} --run {shlex.quote(run)} "
            f"--replication-factor {replication_factor}")


def render(config: str, run: str, replication_factor: int) -> dict[str, str]:
    """The generated files' text, by file name."""
    header = (f"# Generated by: {command_line(config, run, replication_factor)}\n"
              "# from shared/acl.py (ACLs per role) and shared/kafka.py (topic_specs). Do not edit:\n"
              "# make k8s-check refuses a copy that differs from the generator's output\n"
              "# (docs/kubernetes.md, \"Kafka users and topics\").\n")

    def docs(objs: list[dict[str, Any]]) -> str:
        body: str = yaml.safe_dump_all(objs, sort_keys=False, explicit_start=True, width=120)
        return header + body

    return {"users.yaml": docs(kafka_users(run)),
            "topics.yaml": docs(kafka_topics(config, run, replication_factor)),
            "run.env": header + f"FLYWHEEL_RUN={run}\n"}


def policy() -> dict[str, Any]:
    """What :func:`shared.acl.role_acls` grants each role, in Strimzi's terms, for any run (``{run}`` in names)."""
    roles: dict[str, list[dict[str, str]]] = {}
    for role, acls in role_acls(RUN_PLACEHOLDER).items():
        for acl in acls:
            if RUN_PLACEHOLDER not in acl.name:  # shared/acl.py's invariant: the run's own resources only
                raise ValueError(f"{acl} names no resource of the run")
        roles[role] = [{"resource": r["resource"]["type"], "patternType": r["resource"]["patternType"],
                        "name": r["resource"]["name"], "operation": op}
                       for r in strimzi_acls(acls) for op in r["operations"]]
    return {"source": "shared/acl.py", "run_placeholder": RUN_PLACEHOLDER, "user_prefix": USER_PREFIX, "roles": roles}


def _generate_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--config", default=DEFAULT_CONFIG, help=f"settings file, relative to the repository "
                        f"(default {DEFAULT_CONFIG}, the one the overlay's pods load)")
    parser.add_argument("--run", default=None, help="the run (default: the config's run)")
    parser.add_argument("--replication-factor", type=int, default=DEFAULT_REPLICATION,
                        help=f"the topics' replication factor (default {DEFAULT_REPLICATION}, the overlay's brokers)")
    return parser


def _resolve_run(config: str, run: str | None) -> str:
    return run if run is not None else load_settings(REPO / config, environ={}).run


def generate(out: Path, config: str, run: str | None, replication_factor: int) -> list[Path]:
    """Write the generated files of ``run`` into ``out``; returns their paths."""
    files = render(config, _resolve_run(config, run), replication_factor)
    out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (out / name).write_text(text)
    return [out / name for name in files]


def check(overlay: Path) -> None:
    """Raise :class:`GeneratedFilesDiffer` unless ``overlay``'s files are the output of the command in its run.env."""
    env = overlay / "run.env"
    first = env.read_text().splitlines()[0] if env.is_file() else ""
    prefix = f"# Generated by: {COMMAND} "
    if not first.startswith(prefix):
        raise GeneratedFilesDiffer(f"{env}: missing, or its first line is not '{prefix}...'; "
                                   f"run {COMMAND} --out {overlay}")
    args = _generate_parser(argparse.ArgumentParser(prog=COMMAND)).parse_args(shlex.split(first[len(prefix):]))
    wanted = render(args.config, _resolve_run(args.config, args.run), args.replication_factor)
    problems = []
    for name, text in wanted.items():
        path = overlay / name
        have = path.read_text() if path.is_file() else ""
        if have != text:
            lines = difflib.unified_diff(have.splitlines(True), text.splitlines(True), f"{path} (committed)",
                                         f"{path} (generated)")
            diff = "".join(list(lines)[:40])
            problems.append(f"{path} differs from the generator's output:\n{diff}")
    if problems:
        again = command_line(args.config, _resolve_run(args.config, args.run), args.replication_factor)
        raise GeneratedFilesDiffer("\n".join(problems) + f"\nregenerate it: {again} --out {overlay}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shared.k8s_acl", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    gen = _generate_parser(sub.add_parser("generate", help="write an overlay's users.yaml, topics.yaml and run.env"))
    gen.add_argument("--out", type=Path, default=DEFAULT_OVERLAY, help="overlay directory (default: cluster)")
    chk = sub.add_parser("check", help="fail when an overlay's generated files differ from the generator's output")
    chk.add_argument("overlays", nargs="*", type=Path, default=[DEFAULT_OVERLAY])
    pol = sub.add_parser("policy", help="write what shared/acl.py grants each role (JSON, for k8s-check -acl-policy)")
    pol.add_argument("--out", type=Path, default=None, help="file (default: stdout)")
    args = parser.parse_args(argv)
    if args.command == "generate":
        for path in generate(args.out, args.config, args.run, args.replication_factor):
            sys.stdout.write(f"wrote {path}\n")
    elif args.command == "check":
        try:
            for overlay in args.overlays:
                check(overlay)
                sys.stdout.write(f"ok  {overlay}: {', '.join(FILES)} are the generator's output\n")
        except GeneratedFilesDiffer as e:
            sys.stderr.write(f"k8s-acl: {e}\n")
            return 1
    else:
        text = json.dumps(policy(), indent=1, sort_keys=True) + "\n"
        if args.out is None:
            sys.stdout.write(text)
        else:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
