"""Flywheel's four services as processes: their names, command line, environment and admin token."""

from __future__ import annotations

import importlib
import os
import secrets
import shlex
import stat
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

from devstack.config import InfraEndpoints, StackError
from shared.keyfile import ROLES, private_key_path, public_keys_path
from shared.rl.envs import EnvPackageMissing, missing_extra
from shared.rl.extras import install_command
from shared.settings import ConfigError, load_settings

HOST = "127.0.0.1"
SERVICES = ("trainer", "paramsync", "admin", "sampler")
START_ORDER = ("trainer", "paramsync", "admin", "sampler")
STOP_ORDER = ("sampler", "admin", "paramsync", "trainer")  # trainer last: it commits what it trained
TOKEN_ENV = "FLYWHEEL_ADMIN_TOKEN"
TOKEN_FILE = "admin-token"
SAMPLER_KEYS_DIR = "sampler-keys"
"""``<home>/sampler-keys/<sampler id>.key``: each sampler slot's identity key (``shared.identity``)."""
SIGNING_DIR = "policy-keys"
"""``<home>/policy-keys/<run>/``: the run's signing keys (docs/security.md, "Signed policies"), as
``flywheel keys init`` lays them out: ``trainer/trainer.key``, ``paramsync/paramsync.key``, ``public/public.keys``."""
SIGNING_ENV = ("FLYWHEEL_SIGNING_ENABLED", "FLYWHEEL_SIGNING_KEYS_FILE", "FLYWHEEL_SIGNING_PRIVATE_KEY_FILE")


REPLICATED = ("sampler", "trainer")
"""Services with replicas: samplers, and trainer ranks (``trainer`` is rank 0, ``trainer-<r>`` rank r)."""


def proc_key(service: str, replica: int = 0) -> str:
    """``trainer`` (rank 0), ``trainer-<r>``, ``paramsync``, ``admin``, or ``sampler-<i>``: the process's name
    (pid file, log, pids())."""
    if service not in SERVICES:
        raise StackError(f"unknown service {service!r}; expected one of {', '.join(SERVICES)}")
    if replica < 0 or (service not in REPLICATED and replica != 0):
        raise StackError(f"{service} has no replica {replica} (only samplers and trainer ranks are replicated)")
    if service == "sampler":
        return f"sampler-{replica}"
    return f"trainer-{replica}" if service == "trainer" and replica else service


def parse_key(key: str) -> tuple[str, int]:
    """The inverse of :func:`proc_key`: ``sampler-1`` -> (``sampler``, 1); ``sampler`` -> (``sampler``, 0);
    ``trainer-1`` -> (``trainer``, 1)."""
    service, _, index = key.partition("-")
    if service in REPLICATED and index:
        if not index.isdigit() or (service == "trainer" and int(index) == 0):
            raise StackError(f"bad {service} name {key!r}; expected {service}-<index>, e.g. {service}-1")
        return service, int(index)
    proc_key(service)  # validates the name
    return service, 0


def service_command(service: str) -> list[str]:
    """``<this python> -m services.<service>``."""
    return [sys.executable, "-m", f"services.{service}"]


def service_env(
    base: Mapping[str, str],
    *,
    service: str,
    replica: int,
    port: int,
    home: Path,
    config: Path,
    run: str | None,
    store_backend: str,
    endpoints: InfraEndpoints,
    admin_token: str,
    overrides: Mapping[str, str],
    log_max_bytes: int | None = None,
    log_backups: int | None = None,
    signing: Path | None = None,
) -> dict[str, str]:
    """``base`` (os.environ) + endpoints + config, run, store, HTTP, sampler id + ``overrides``.

    ``FLYWHEEL_HOME`` is set last: it marks the process as this stack's (see ``Proc.pid``). The
    admin token goes to the admin only. ``signing`` (the keys directory; :func:`resolve_signing_keys`) turns
    signed policies on: every service verifies with the public keys file, the trainer and paramsync alone are
    given their own private key; unless ``base`` or ``overrides`` set ``FLYWHEEL_SIGNING_*`` themselves.
    """
    env = dict(base)
    env.update(endpoints.as_env())
    env["FLYWHEEL_CONFIG"] = str(config)
    if run:
        env["FLYWHEEL_RUN"] = run
    env["FLYWHEEL_STORE_BACKEND"] = store_backend
    if store_backend == "local":
        env["FLYWHEEL_STORE_LOCAL_ROOT"] = str(home / "store")
    env["FLYWHEEL_HTTP_HOST"] = HOST
    env["FLYWHEEL_HTTP_PORT"] = str(port)
    if service == "sampler":
        env["FLYWHEEL_SAMPLER_ID"] = proc_key(service, replica)
        # Its identity key (docs/security.md, "Sampler identity") outlives the process: a restarted sampler keeps
        # its id's binding at once instead of waiting out sampler.identity_handover_s.
        env.setdefault("FLYWHEEL_SAMPLER_IDENTITY_KEY_FILE",
                       str(home / SAMPLER_KEYS_DIR / f"{proc_key(service, replica)}.key"))
    if service == "admin":
        env[TOKEN_ENV] = admin_token
        env["FLYWHEEL_ADMIN_LOG_DIR"] = str(home / "logs")  # GET /trace/{sample_id} reads them
        # The status page reads /status without a token on this machine's stack (compose and Kubernetes keep
        # reads closed: admin.public_reads false); an exported FLYWHEEL_ADMIN_PUBLIC_READS=false closes them here too.
        env.setdefault("FLYWHEEL_ADMIN_PUBLIC_READS", "true")
    env["PYTHONUNBUFFERED"] = "1"
    # The service writes its JSON lines to logs/<name>.log itself and rotates it between lines, so no
    # line (the per-fragment trace) is lost to rotation; stdout/stderr go to logs/<name>.out.
    env["FLYWHEEL_LOG_FILE"] = str(home / "logs" / f"{proc_key(service, replica)}.log")
    if log_max_bytes is not None:
        env["FLYWHEEL_LOG_MAX_BYTES"] = str(log_max_bytes)
    if log_backups is not None:
        env["FLYWHEEL_LOG_BACKUPS"] = str(log_backups)
    if signing is not None and not any(k in env or k in overrides for k in SIGNING_ENV):
        env["FLYWHEEL_SIGNING_ENABLED"] = "true"
        env["FLYWHEEL_SIGNING_KEYS_FILE"] = str(public_keys_path(signing))
        if service in ROLES:
            env["FLYWHEEL_SIGNING_PRIVATE_KEY_FILE"] = str(private_key_path(signing, service))
    env.update(overrides)
    env["FLYWHEEL_HOME"] = str(home)
    return env


def validate_config(config: Path, env: Mapping[str, str], *, install_extras: bool = False,
                    progress: Callable[[str], None] = print) -> None:
    """Load the settings a service would see, before starting any (no torch import), and check that the env
    can be made here: a package its id needs (:func:`shared.rl.envs.env_extra`) that is missing is installed
    with ``install_extras`` (the project's extra, into this interpreter's environment), else refused in one line
    naming the package and the command."""
    try:
        settings = load_settings(config, environ=env)
    except ConfigError as exc:
        raise StackError(str(exc)) from None
    env_id = settings.env.id
    missing = missing_extra(env_id)
    if missing is not None and install_extras:
        command = install_command(missing[0])
        progress(f"{env_id} needs the '{missing[0]}' extra; installing it: {command}")
        done = subprocess.run(shlex.split(command), capture_output=True, text=True)
        if done.returncode != 0:
            raise StackError(f"installing the '{missing[0]}' extra for {env_id} failed (exit {done.returncode}): "
                             f"{command}\n{(done.stdout + done.stderr)[-2000:]}")
        importlib.invalidate_caches()
        missing = missing_extra(env_id)
    if missing is not None:
        raise StackError(str(EnvPackageMissing(env_id, *missing)))


def resolve_admin_token(home: Path, env: Mapping[str, str]) -> tuple[str, str]:
    """(token, where it comes from): ``env`` / the environment if they set it, else ``<home>/admin-token``.

    The file is created once with a fresh ``secrets.token_hex(32)`` and mode 0600; later calls read it, so
    restarts keep the token. The ``flywheel`` CLI reads the same file. Hex, not ``token_urlsafe``: one of those
    in 64 begins with "-", and ``flywheel --token -x...`` then reads it as an option.
    """
    for source, mapping in (("the stack's env", env), ("$FLYWHEEL_ADMIN_TOKEN", os.environ)):
        value = mapping.get(TOKEN_ENV)
        if value:
            return value, source
    path = home / TOKEN_FILE
    home.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        if stat.S_IMODE(path.stat().st_mode) & 0o077:
            path.chmod(0o600)
        token = path.read_text().strip()
        if not token:
            raise StackError(f"{path} is empty; delete it to generate a new admin token") from None
        return token, str(path)
    token = secrets.token_hex(32)
    with os.fdopen(fd, "w") as fh:
        fh.write(token + "\n")
    return token, str(path)


def resolve_signing_keys(home: Path, run: str) -> Path:
    """The directory of ``run``'s signing keys, ``<home>/policy-keys/<run>/``: the trainer's and paramsync's
    Ed25519 keys (mode 0600) and the public list, generated once (``flywheel keys init``; later calls keep them,
    so restarts keep the keys). Each service gets paths, never a secret: the public list for all, a private key
    for its own role only. Rotation: ``flywheel keys rotate`` (docs/security.md)."""
    from shared.signing import generate_keys

    directory = home / SIGNING_DIR / run
    try:
        generate_keys(directory)
    except ValueError as exc:
        raise StackError(f"{exc}; fix or delete {directory} (new keys are generated)") from None
    return directory
