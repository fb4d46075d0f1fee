"""Typed settings: defaults < YAML file in ``configs/`` < ``FLYWHEEL_<SECTION>_<FIELD>`` environment.

One model serves every service. Each section is a frozen pydantic model with ``extra="forbid"``
so an unknown key in YAML fails at start-up, and an unknown ``FLYWHEEL_...`` variable does too.
Environment names are ``FLYWHEEL_`` + section + ``_`` + field, upper case:
``FLYWHEEL_KAFKA_BOOTSTRAP``, ``FLYWHEEL_TRAINER_MAX_STALENESS``, ``FLYWHEEL_RUN``. An optional
setting (one whose default is None) is unset with the value ``none`` or ``null``
(``FLYWHEEL_TRAINER_TARGET_KL=none``).

This module imports neither torch nor gymnasium, so config errors surface in well under a second.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from shared.keyfile import check_pair, read_private_key, read_public_keys

ENV_PREFIX = "FLYWHEEL_"
# Variables with the prefix that are not settings fields.
NON_SETTING_ENV = {"FLYWHEEL_CONFIG", "FLYWHEEL_HOME", "FLYWHEEL_CACHE", "FLYWHEEL_SAMPLER_ID"}
NON_SETTING_ENV_PREFIXES = ("FLYWHEEL_INFRA_", "FLYWHEEL_TEST_", "FLYWHEEL_BENCH_")


class ConfigError(ValueError):
    """The configuration is invalid; the message names the offending field."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


SASL_PROTOCOLS = ("SASL_PLAINTEXT", "SASL_SSL")
SSL_PROTOCOLS = ("SSL", "SASL_SSL")


class KafkaSettings(_Section):
    bootstrap: str = "127.0.0.1:9092"
    """Comma-separated bootstrap servers of the Kafka cluster."""
    samples_partitions: int = Field(4, ge=1, le=1024)
    """Partitions of ``<run>.samples``; at least the number of samplers keeps them fair."""
    credits_partitions: int = Field(1, ge=1, le=1024)
    """Partitions of ``<run>.credits``: the trainer writes one grant per partition holding only the
    samplers hashed to it, and each sampler reads only its own (shared.credits). Size it so a partition
    holds a bounded number of samplers, e.g. samplers / 16 (64 for 1,000 samplers): a sampler then reads
    O(16) counts per grant whatever the swarm's size. Raising it on a running cluster grows the topic
    (where the client may alter it); every service of a run must use the same value."""
    replication_factor: int = Field(1, ge=1, le=16)
    """Replication factor of every run topic (1 on a single broker)."""
    samples_retention_ms: int = Field(6 * 3600 * 1000, ge=60_000)
    """How long unconsumed fragments are kept (``retention.ms`` of the samples topic)."""
    dlq_retention_ms: int = Field(7 * 24 * 3600 * 1000, ge=60_000)
    """Retention of the dead-letter topic."""
    heartbeats_retention_ms: int = Field(3600 * 1000, ge=60_000)
    """Retention of the heartbeats topic."""
    compression: Literal["lz4", "gzip", "zstd", "none"] = "lz4"
    """Producer compression codec."""
    max_message_bytes: int = Field(4 * 1024 * 1024, ge=64 * 1024)
    """Largest fragment accepted (also ``max.message.bytes`` of the samples topic)."""
    request_timeout_ms: int = Field(30_000, ge=1000)
    """Client request timeout."""
    fetch_max_wait_ms: int = Field(50, ge=1, le=10_000)
    """Longest a consumer's fetch waits at the broker for new records. aiokafka keeps one fetch in flight
    per broker: a partition that gets records while a fetch for other, empty partitions waits is served
    only when that fetch returns, so this bounds the delivery delay of fragments, credit grants and
    announcements (Kafka's default 500 ms held 0.4-0.5 s gaps between the trainer's updates)."""
    tail_fetch_max_wait_ms: int = Field(500, ge=1, le=10_000)
    """The same for a group-less reader of one partition (the policy topic's readers, admin's heartbeats): its
    one fetch always asks for that partition, so the broker answers the moment a record
    arrives and a longer wait delays nothing, while an idle reader asks 2 times a second instead of 20 (each
    sampler reads the policy topic: 2,000 fetch requests a second fewer at 1,000 samplers, docs/scaling.md).
    A reader of several partitions (rank 0's reader of every credits partition, paramsync's of heartbeats and
    control) keeps ``fetch_max_wait_ms``: the partition it just read is left out of the fetch already waiting,
    as above. A sampler reads its credits partition, the control topic and the policy topic with one reader
    each: 6 idle fetches a second."""
    sasl_mechanism: Literal["SCRAM-SHA-256", "SCRAM-SHA-512", "PLAIN"] = "SCRAM-SHA-512"
    """SASL mechanism of the ``SASL_*`` protocols (the SCRAM ones never send the password). ``PLAIN`` sends the
    password itself: use it over ``SASL_SSL`` only."""
    sasl_username: str | None = Field(None, min_length=1)
    """SASL user (required by the ``SASL_*`` protocols)."""
    sasl_password: SecretStr | None = None
    """SASL password (required by the ``SASL_*`` protocols). A secret: set it from the environment only
    (``FLYWHEEL_KAFKA_SASL_PASSWORD``), never in a file under ``configs/``; masked in the logged config."""
    ssl_cafile: Path | None = None
    """PEM file of the CA(s) that signed the brokers' certificates (``SSL``, ``SASL_SSL``); unset: the
    system's trusted CAs. Broker host names are always verified."""
    ssl_certfile: Path | None = None
    """PEM file of this client's certificate chain, for brokers that require client authentication (mTLS)."""
    ssl_keyfile: Path | None = None
    """PEM file of the private key of ``ssl_certfile`` (unset: the key is in ``ssl_certfile``)."""
    # Declared after the fields it governs: its validator checks them against it. A model validator would
    # do too, but its error would echo the whole section, password included, in the start-up error.
    security_protocol: Literal["PLAINTEXT", "SASL_PLAINTEXT", "SASL_SSL", "SSL"] = Field(
        "PLAINTEXT", validate_default=True)
    """How every client talks to the brokers: ``PLAINTEXT`` (no TLS, no authentication), ``SASL_PLAINTEXT``
    (SASL authentication, no TLS), ``SASL_SSL`` (both) or ``SSL`` (TLS, optionally with a client certificate).
    The brokers must offer a listener of that protocol at ``bootstrap`` (docs/security.md)."""

    @field_validator("security_protocol")
    @classmethod
    def _security_is_consistent(cls, protocol: str, info: ValidationInfo) -> str:
        given = info.data  # the fields above that validated (a failed one has its own error)
        if protocol in SASL_PROTOCOLS:
            if "sasl_username" in given and given["sasl_username"] is None:
                raise ValueError(f"kafka.sasl_username is required when kafka.security_protocol={protocol!r}")
            password = given.get("sasl_password")
            if "sasl_password" in given and (password is None or not password.get_secret_value()):
                raise ValueError(f"kafka.sasl_password is required when kafka.security_protocol={protocol!r} "
                                 "(set FLYWHEEL_KAFKA_SASL_PASSWORD)")
        else:
            for name in ("sasl_username", "sasl_password"):
                if given.get(name) is not None:
                    raise ValueError(f"kafka.{name} is set but kafka.security_protocol={protocol!r} does not use "
                                     f"SASL (use SASL_PLAINTEXT or SASL_SSL, or unset kafka.{name})")
        files: dict[str, Path | None] = {n: given.get(n) for n in ("ssl_cafile", "ssl_certfile", "ssl_keyfile")}
        if protocol in SSL_PROTOCOLS:
            for name, path in files.items():
                if path is None:
                    continue
                if not path.is_file():
                    raise ValueError(f"kafka.{name} does not exist or is not a file: {str(path)!r}")
                if not os.access(path, os.R_OK):
                    raise ValueError(f"kafka.{name} is not readable by this process: {str(path)!r}")
            if files["ssl_keyfile"] is not None and files["ssl_certfile"] is None:
                raise ValueError("kafka.ssl_keyfile is set without kafka.ssl_certfile (the certificate it belongs to)")
        else:
            for name, path in files.items():
                if path is not None:
                    raise ValueError(f"kafka.{name} is set but kafka.security_protocol={protocol!r} does not use "
                                     f"TLS (use SSL or SASL_SSL, or unset kafka.{name})")
        return protocol


class StoreSettings(_Section):
    backend: Literal["s3", "local"] = "s3"
    """Object store: ``s3`` (any S3 API) or ``local`` (a directory, for single-machine stacks)."""
    local_root: Path = Path(".flywheel/store")
    """Root directory of the ``local`` backend."""


class S3Settings(_Section):
    endpoint: str | None = None
    """S3 endpoint URL (``http://127.0.0.1:9000``); unset means AWS's default endpoint."""
    bucket: str = "flywheel"
    """Bucket holding every run's policies and checkpoints."""
    region: str = "us-east-1"
    """Region passed to the S3 client."""

    @field_validator("endpoint")
    @classmethod
    def _endpoint_is_url(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("http://", "https://")):
            raise ValueError(f"must start with http:// or https://, got {v=}")
        return v


class EnvSettings(_Section):
    id: str = "CartPole-v1"
    """Gymnasium environment id."""
    num_envs: int = Field(8, ge=1, le=4096)
    """Environments stepped together by one sampler (the ``envs`` axis of a fragment)."""
    fragment_steps: int = Field(64, ge=1, le=100_000)
    """Steps per fragment (``T``)."""
    latency_median_ms: float = Field(0.0, ge=0.0)
    """Benchmarks only: median of a log-normal delay added to every env step (0 = none)."""
    latency_sigma: float = Field(1.0, ge=0.0, le=5.0)
    """Benchmarks only: sigma of that log-normal delay."""
    fragment_latency_median_ms: float = Field(0.0, ge=0.0)
    """Benchmarks only: median of a log-normal delay added once per fragment (0 = none), on top of the
    steps: a fragment whose generation time is heavy-tailed as a whole (an LLM rollout, a remote
    simulator), the workload asynchronous training is for."""
    fragment_latency_sigma: float = Field(1.5, ge=0.0, le=5.0)
    """Benchmarks only: sigma of that per-fragment delay (1.5: p99 about 33x the median)."""
    latency_overlap: bool = False
    """Benchmarks only: the envs of a sampler wait out their delays concurrently (as envs in separate
    processes or remote simulators would), so a vector step takes the slowest env's delay, not the sum."""
    frame_stack: int | None = Field(None, ge=1, le=16)
    """Image envs: frames the policy sees per step; None: the env's default (4 for ``ALE/`` games, else 1).
    Fragments carry single frames and the trainer rebuilds the stacks (docs/pixels.md)."""
    backend: Literal["auto", "gymnasium", "envpool"] = "auto"
    """What steps the samplers' envs: ``gymnasium`` (a synchronous gymnasium vector env) or ``envpool`` (EnvPool,
    extra ``envpool``; ``ALE/<Game>-v5`` games only, with the same Atari preprocessing and the same fragments);
    ``auto`` is ``envpool`` where EnvPool is installed and has the game, else ``gymnasium``. An explicit ``envpool``
    that cannot be used stops the sampler at start-up saying why (docs/pixels.md "Env backend")."""


class SamplerSettings(_Section):
    sync_interval_s: float = Field(2.0, gt=0)
    """Fallback: how often the sampler polls the policy marker besides announcements."""
    min_adoption_interval_s: float = Field(1.0, ge=0)
    """Least time between two policy fetches from the object store (versions announced without their
    weights inline, or found only behind the marker); meanwhile the newest known version waits, and it is
    the one fetched when the interval has passed. A version seen only behind the marker also waits this
    long for its announcement, whose inline weights cost no store GET. Inline policies are adopted at once;
    an operator's ``sync`` fetches at once. 0: no limit (docs/policies.md)."""
    max_in_flight: int = Field(8, ge=1)
    """Fragments sent but not yet acknowledged by Kafka before the sampler waits."""
    max_fragments_per_s: float = Field(0.0, ge=0)
    """Cap on the send rate (0 = unlimited)."""
    max_backlog: int = Field(0, ge=0)
    """Flow control: pause producing while the trainer group's lag exceeds this many fragments
    (0 = off). Keeps samplers from filling Kafka with fragments that would only be dropped as stale."""
    backlog_check_interval_s: float = Field(0.5, gt=0)
    """How often the backlog is measured when ``max_backlog`` is on."""
    heartbeat_interval_s: float = Field(1.0, gt=0)
    """Heartbeat period (also sent at once when the policy version changes)."""
    credits: bool = True
    """Credit-based flow control: a sampler keeps at most the window of fragments the trainer grants it
    in flight (sent but not yet consumed by the trainer), so the lag at training time stays within
    ``trainer.max_staleness`` and the learner is never starved (``trainer.flow_window``). Off: only
    ``max_backlog`` (if set) limits production."""
    seed: int | None = None
    """Base seed of the envs and the action sampling, combined with the sampler id so every
    sampler differs (None = random)."""
    compression: Literal["none", "zstd"] = "none"
    """Compress fragment payloads (schema 3; docs/pixels.md has the measured ratio and decode cost)."""
    torch_threads: int = Field(1, ge=1, le=64)
    """Threads of the samplers' torch or onnxruntime inference (``sampler.inference``; numpy uses one)."""
    inference: Literal["auto", "numpy", "torch", "onnx"] = "auto"
    """How samplers run the network: ``numpy`` (the MLP only), ``torch`` (``torch_threads`` threads) or ``onnx``
    (onnxruntime, ``torch_threads`` intra-op threads; discrete actions); ``auto`` is numpy for the MLP and
    onnxruntime for the CNNs, which measured fastest for one action batch at the configs' sizes
    (``bench/figures/sampler_inference.py``, docs/pixels.md "Sampler inference"; the rule:
    ``shared.rl.policy_onnx.resolve_inference``). ``torch`` and ``onnx`` run an MLP only without observation
    normalisation or gSDE."""
    identity: bool = True
    """Sign every fragment and heartbeat with this process's own Ed25519 key, so that readers bind the sampler's id
    to it and refuse another process using the id (docs/security.md, "Sampler identity"). Off: records carry no
    key and claim nothing (logged at start, ``protection_off``)."""
    identity_key_file: Path | None = None
    """Where the sampler keeps its identity key (made there at first start, mode 0600), so that a restart under
    the same id keeps its binding at once. None: a fresh key per process, which takes the id over once the old
    key has been silent for ``identity_handover_s``."""
    identity_handover_s: float = Field(3.0, gt=0)
    """Read by every reader of samplers' records: how long a sampler id's key must be silent before another key
    may take the id (a restart with a fresh key). Samplers beat every ``heartbeat_interval_s``: keep it above
    that."""


class GuardSettings(_Section):
    """The automatic rollback guard (``services/trainer/guard.py`` states the policy): when the last-100
    return falls ``drop`` below its best for ``window`` episodes, or updates explode ``explode_updates``
    times in a row, the trainer rolls back to the newest version that held the best and reverts the
    runtime config change that preceded the fall, or else lowers the learning rate."""

    enabled: bool = False
    """Watch returns and updates and roll back automatically (off: the guard never decides)."""
    drop: float = Field(100.0, gt=0)
    """How far below its best the last-100 mean return must fall to count as fallen, in the env's return
    units (absolute, not a fraction: returns may be negative, as Pendulum's are)."""
    hold_tolerance: float = Field(25.0, ge=0)
    """A policy version *holds the best* when it was the model version while the last-100 mean was at least
    ``best - hold_tolerance``; a rollback restores the newest such version. Smaller than ``drop``."""
    settle_updates: int = Field(8, ge=0)
    """A rollback that no config revision marks the cause of restores the newest version that held the best
    at least this many updates before the fall (or the explosion) began: the last-100 mean lags the weights
    by the samplers' staleness (up to ``max_staleness`` versions) and the episodes then in progress, so the
    versions seen just before a fall shows may already be bad."""
    window: int = Field(20, ge=1)
    """Episodes the fall must persist (every observation below ``best - drop``) before a rollback."""
    min_episodes: int = Field(100, ge=1)
    """Episodes since the guard started (or since its last rollback) before the best counts; at least
    ``trainer.return_window``, so the best is a mean of episodes of the tracked policy only."""
    blame_episodes: int = Field(100, ge=1)
    """A runtime config revision noted at most this many episodes before the fall (or the explosion)
    began is taken for its cause and reverted; the last-100 mean needs about ``return_window`` episodes
    to show a change."""
    explode_updates: int = Field(3, ge=1)
    """Consecutive exploding updates that trigger a rollback: an update explodes when it refused a
    non-finite step, or its loss or gradient norm is not finite or exceeds the limits below."""
    explode_loss: float = Field(1e6, gt=0)
    """An update whose value loss or absolute policy loss exceeds this explodes (the value loss scales with
    the square of the returns: set it well above the largest one an untrained critic sees)."""
    explode_grad_norm: float = Field(1e3, gt=0)
    """An update whose gradient norm (before clipping) exceeds this explodes."""
    lr_factor: float = Field(0.5, gt=0, lt=1)
    """The learning rate is multiplied by this after a rollback no config change explains."""
    max_per_hour: int = Field(3, ge=1)
    """Rollbacks within any hour after which the guard stops trying and pages (``exhausted``) until the
    oldest of them is an hour old."""
    cooldown_s: float = Field(30.0, ge=0)
    """After a rollback no decision for this long; the best is then tracked anew from the restored version."""

    @model_validator(mode="after")
    def _tolerance_below_drop(self) -> GuardSettings:
        if self.hold_tolerance >= self.drop:
            raise ValueError(f"trainer.guard.hold_tolerance must be below trainer.guard.drop, got "
                             f"{self.hold_tolerance=}, {self.drop=}")
        return self


class TrainerSettings(_Section):
    batch_fragments: int = Field(4, ge=1)
    """Fragments per update."""
    batch_timeout_s: float = Field(5.0, gt=0)
    """Train a partial batch when its oldest fragment has waited this long (a quiet topic)."""
    poll_max_records: int = Field(64, ge=1)
    """Bound on records returned by one ``getmany``."""
    max_staleness: int = Field(4, ge=0)
    """Fragments made by a policy more than this many versions old are dropped."""
    publish_every: int = Field(1, ge=1)
    """Publish a policy candidate every N updates."""
    checkpoint_every: int = Field(50, ge=1)
    """Write a full checkpoint every N updates."""
    keep_checkpoints: int = Field(3, ge=1)
    """Checkpoints kept in the object store; older ones are deleted."""
    learning_rate: float = Field(2.5e-4, gt=0)
    learning_rate_end: float | None = Field(None, gt=0)
    """Anneal the learning rate linearly from ``learning_rate`` to this over the first
    ``anneal_env_steps`` trained env steps, then hold it (None = constant). A continuous service has no
    fixed budget to anneal to zero over, as CleanRL does; holding a small rate keeps a solved policy
    from drifting away."""
    anneal_env_steps: int = Field(1_000_000, ge=1)
    """Trained env steps over which ``learning_rate`` anneals to ``learning_rate_end``."""
    gamma: float = Field(0.99, gt=0, le=1)
    gae_lambda: float = Field(0.95, ge=0, le=1)
    clip_coef: float = Field(0.2, gt=0)
    """PPO clip range around the proximal policy."""
    clip_coef_end: float | None = Field(None, gt=0)
    """Anneal the clip range linearly from ``clip_coef`` to this on the learning rate's schedule (over the
    first ``anneal_env_steps`` trained env steps), then hold it (None = constant), as rl-zoo's ``lin_0.2``
    clip range does over its fixed budget: late updates of a solved policy move it less."""
    behaviour_weight_cap: float = Field(5.0, ge=1.0)
    """Upper truncation of the importance weight pi_prox / pi_behaviour (``objective: decoupled`` only)."""
    epochs: int = Field(4, ge=1)
    minibatches: int = Field(4, ge=1)
    ent_coef: float = Field(0.0, ge=0)
    vf_coef: float = Field(0.5, ge=0)
    max_grad_norm: float = Field(0.5, gt=0)
    normalize_advantages: bool = True
    target_kl: float | None = Field(None, gt=0)
    """Stop an update's epochs once the approximate KL to the policy it started from exceeds this
    (None = always run every epoch). Guards against the late-training collapses of many epochs at a
    high learning rate."""
    hidden: int = Field(64, ge=4)
    """Width of the two hidden layers of actor and critic."""
    activation: Literal["tanh", "relu"] = "tanh"
    """The MLP's hidden activation: ``tanh`` (CleanRL's PPO) or ``relu`` (rl-zoo's MuJoCo settings); the samplers'
    policy, ``flywheel eval`` and ``flywheel export`` run the same (a weights blob does not record it). The MLP
    only: an image model (its CNN is ReLU throughout) refuses any value but the default, naming this field."""
    ortho_init: bool = True
    """Orthogonal initialisation of the MLP's layers (CleanRL; gains sqrt 2, 0.01 policy head, 1 value head);
    False leaves PyTorch's default init, as Stable-Baselines3's ``ortho_init=False`` (rl-zoo's MuJoCo settings).
    The MLP only (the CNNs always use orthogonal init)."""
    model: Literal["auto", "mlp", "nature_cnn", "minatar_cnn"] = "auto"
    """The network: ``mlp`` (two layers of ``hidden``, ``activation``), or for image observations a CNN torso shared by
    policy and value (``nature_cnn``: 84x84 Atari frames; ``minatar_cnn``: 10x10 MinAtar frames); ``auto``
    picks a CNN for image observations and the MLP otherwise (docs/pixels.md)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """``auto`` uses CUDA when present."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """Forward passes of the update: ``bf16`` under bf16 autocast (matmuls and convolutions in bfloat16; the
    log-ratios, KL and losses, the weights, gradients and Adam state stay float32), ``fp32`` float32 throughout.
    ``auto``: bf16 on a CUDA device that supports it; on a CPU with native bf16 (``avx512_bf16``/``amx_bf16``) the
    trainer times one update epoch of this run's shapes in both at start and takes bf16 only when it is at least
    1.3x faster; float32 on any other CPU (services/trainer/compute.py). Batches go to a CUDA device through
    pinned memory. bf16 on the CPU is finite and close to fp32 (``tests/unit/test_precision.py``)."""
    seed: int = 1
    group_instance_id: str | None = Field("trainer-0", min_length=1)
    """Kafka static membership (KIP-345) for the trainer's consumer: a restarted trainer with the same
    id takes its partitions back at once instead of waiting for the killed one's session to expire.
    Must be unique per trainer process (two live members with one id fence each other); a cleanly
    stopped static member does not leave the group, so its partitions wait for the session timeout
    (6 s) before another member gets them. None = dynamic membership."""
    torch_threads: Annotated[int, Field(ge=1)] | Literal["auto"] = 1
    """Threads of the update's torch kernels; ``auto``: the cores this process may use (CPU affinity, capped by a
    cgroup CPU quota) less ``cores_reserved``, at least 1 (services/trainer/compute.py)."""
    cores_reserved: float = Field(0.0, ge=0)
    """Cores ``torch_threads: auto`` leaves to what else runs on the trainer's host (samplers, Kafka)."""
    dedicated_cores: int = Field(0, ge=0, le=1024)
    """Where the trainer shares its host with the samplers (the local stack): the trainer pins itself to the first
    this many CPUs it may use (rank r of a group: the r-th such share) and the samplers, paramsync and admin started
    with these settings to the CPUs after the trainers', so no sampler preempts an update. 0: nothing pinned; also
    where the host has no CPU left over (logged). Keep 0 where a container runtime places processes
    (shared/placement.py)."""
    heartbeat_interval_s: float = Field(1.0, gt=0)
    return_window: int = Field(100, ge=1)
    """Episodes in the reported mean return."""
    max_abs_value: float = Field(1e6, gt=0)
    """Largest magnitude accepted in a fragment's observations, rewards and returns; a larger one is
    dead-lettered (``out_of_range``): finite but huge values would turn the weights NaN."""
    stall_after_s: float = Field(30.0, gt=0)
    """Training counts as stalled when records keep arriving but no update happened for this long:
    reported in /status with its reason, the recovery (re-send the candidate, re-read the marker) is
    tried, and ``flywheel_trainer_stalled`` turns 1 for the alert."""
    candidate_resend_s: float = Field(10.0, gt=0)
    """Re-send the newest candidate when it is still not published after this long (paramsync was
    down, or the message was lost with a broker)."""
    flow_window: int | None = Field(None, ge=1)
    """Fragments in flight (produced, not yet consumed by the trainer) that all live samplers together
    may have, split evenly between them (at least one each). None: two versions' worth of batches,
    ``batch_fragments * publish_every * min(2, max(1, max_staleness))``: one batch trains while the next
    waits, so the learner is fed and the lag at training time stays near two versions."""
    normalize_observations: bool = False
    """Normalise observations by running mean and variance that the trainer updates from every trained
    batch and publishes inside the policy's weights blob: a sampler acting on version v normalises
    exactly as version v was trained (samplers keep no statistics of their own)."""
    normalize_rewards: bool = False
    """Scale rewards by the running standard deviation of the discounted return (as Stable-Baselines3's
    ``VecNormalize``); the statistics are the trainer's and are checkpointed."""
    advantage_std_floor: float = Field(0.0, ge=0)
    """Advantage normalisation divides by ``max(std, advantage_std_floor)``: once a task is solved the
    advantages are noise (RMS ~1e-3) that plain normalisation scales up ~200x."""
    separate_grad_clip: bool = False
    """Clip the actor's and the critic's gradients to ``max_grad_norm`` separately (else one joint norm,
    where a large value gradient shrinks the policy's step)."""
    behaviour_weight_mode: Literal["truncate", "mask"] = "truncate"
    """Samples whose importance weight pi_prox / pi_behaviour exceeds ``behaviour_weight_cap``: truncate
    the weight to the cap, or leave them out of the policy loss (AReaL's masking). ``objective: decoupled``
    only."""
    objective: Literal["decoupled", "ppo"] = "decoupled"
    """``decoupled``: clip around the proximal policy (the weights at the update's start) and correct for
    the behaviour policy's lag with a truncated importance weight (AReaL). ``ppo``: plain PPO, clipping
    the ratio to the behaviour policy itself, no importance weight (``behaviour_weight_cap`` and
    ``behaviour_weight_mode`` then do nothing): the forced-staleness benchmark's baseline, and
    ``configs/cartpole.yaml``'s choice, where at the pipeline's ~2 versions of lag it learned faster
    (docs/algorithm.md)."""
    log_std_init: float = 0.0
    """Continuous actions: initial value of the Gaussian policy's log standard deviation parameters."""
    gsde: bool = False
    """Continuous actions: generalized state-dependent exploration (Raffin et al. 2021; Stable-Baselines3's
    ``use_sde``): the action noise is the actor's last hidden features times a random matrix each sampler
    env keeps for ``sde_sample_freq`` steps, so exploration is smooth in time and its scale depends on the
    state; ``log_std`` becomes a ``[hidden, action dims]`` matrix (the weights' shape, so samplers,
    paramsync and checkpoints must agree: a checkpoint of the other kind is refused). Discrete actions:
    refused at start-up."""
    sde_sample_freq: int = Field(4, ge=1)
    """gSDE: env steps a sampler keeps one noise matrix before drawing the next (a new policy version
    draws at once)."""
    fresh_start: bool = False
    """Start from scratch even though a checkpoint exists (the checkpoints are kept). Without it a
    trainer whose checkpoints are all unusable refuses to start rather than silently reset the run."""
    guard: GuardSettings = GuardSettings()
    """The automatic rollback guard (``trainer.guard.*``)."""
    world_size: int = Field(1, ge=1)
    """Data-parallel trainer ranks (docs/architecture.md, "Trainer ranks"): K processes in one consumer
    group, each forming batches from its own partitions, gradients all-reduced every step (gloo on CPU,
    NCCL on CUDA), so every rank holds identical weights. Rank 0 publishes and checkpoints. Start-up
    refuses a samples topic with fewer partitions than ranks."""
    rank: int = Field(0, ge=0)
    """This process's rank, 0 .. world_size - 1 (Kubernetes: the StatefulSet pod index)."""
    rendezvous: str = Field("127.0.0.1:29500", pattern=r"^[A-Za-z0-9.\-\[\]:]+:[0-9]{1,5}$")
    """``host:port`` of rank 0's rendezvous store (torch.distributed TCPStore; rank 0 listens there)."""
    rank_timeout_s: float = Field(60.0, gt=0)
    """A collective (the per-step vote, a gradient all-reduce) waiting longer than this fails the rank;
    the others then fail too and the group restarts from its checkpoint. Also bounds the rendezvous."""

    @model_validator(mode="after")
    def _rank_in_world(self) -> TrainerSettings:
        if self.rank >= self.world_size:
            raise ValueError(f"trainer.rank {self.rank} must be below trainer.world_size {self.world_size}")
        return self


class ParamsyncSettings(_Section):
    keep_versions: int = Field(10, ge=1)
    """Published versions (records and blobs) kept; older ones are deleted."""
    sampler_timeout_s: float = Field(10.0, gt=0)
    """A sampler silent for this long is no longer live."""
    heartbeat_interval_s: float = Field(1.0, gt=0)
    reannounce_interval_s: float = Field(5.0, gt=0)
    """Re-announce the published version this often, so readers that missed an announcement catch up."""
    inline_max_bytes: int = Field(1024 * 1024, ge=0)
    """Policies up to this size ride on their announcements on ``<run>.policy`` (base64, with their sha256), so
    samplers adopt them without a store GET; larger ones are fetched from the store. The encoded announcement
    must also fit ``kafka.max_message_bytes`` (else it goes without them). 0: never inline (docs/policies.md)."""


class SigningSettings(_Section):
    """Signed policies and checkpoints (docs/security.md, "Signed policies"), Ed25519 with one key per role: the
    trainer signs its candidates and checkpoints, paramsync publishes only candidates the trainer signed and signs
    every version record and announcement; samplers, the trainer and the admin refuse what is unsigned or badly
    signed. Every deployment the project ships turns it on (the local stack, compose, Kubernetes); a service
    started with it off says so in its log (``protection_off``) and in ``/status``."""

    keys_file: Path | None = None
    """The public keys: ``<key id> <role> <Ed25519 public key, hex>`` lines (``#`` comments), role ``trainer`` or
    ``paramsync``. Every key listed verifies what its role signs (two per role during a rotation). Required when
    ``enabled``; ``flywheel keys init --dir DIR`` writes it as ``DIR/public/public.keys``."""
    private_key_file: Path | None = None
    """This process's own private key (``<key id> <role> <seed hex>``, one line, listed in ``keys_file`` with the
    same role): required by the trainer and paramsync, refused anywhere else. A reference, never the secret: mount
    it from a secret store, to that one service (mode 0600)."""
    # Declared after the fields it governs: its validator checks them against it (as kafka.security_protocol).
    enabled: bool = Field(False, validate_default=True)
    """Sign (trainer, paramsync) and require signatures (every reader). Off: nothing is signed or checked
    (a checkpoint naming another run is still refused); set it off only deliberately, it is logged."""

    @field_validator("enabled")
    @classmethod
    def _keys_are_usable(cls, enabled: bool, info: ValidationInfo) -> bool:
        given = info.data
        path: Path | None = given.get("keys_file")
        private: Path | None = given.get("private_key_file")
        if not enabled:
            for name, value in (("keys_file", path), ("private_key_file", private)):
                if value is not None:
                    raise ValueError(f"signing.{name} is set but signing.enabled=false: policies would be neither "
                                     f"signed nor checked (set signing.enabled=true, or unset signing.{name})")
            return enabled
        if "keys_file" in given and path is None:
            raise ValueError("signing.keys_file is required when signing.enabled=true (FLYWHEEL_SIGNING_KEYS_FILE: "
                             "'<key id> <role> <public key hex>' lines; flywheel keys init --dir DIR makes one)")
        if path is None:
            return enabled  # keys_file itself failed validation: its own error says why
        keys = read_public_keys(path)
        if private is not None:
            check_pair(read_private_key(private), keys)
        return enabled


class AdminSettings(_Section):
    token: SecretStr | None = None
    """A bearer token of the one operator named ``admin`` (from the environment only: FLYWHEEL_ADMIN_TOKEN).
    May be given with ``tokens_file``; at least one of the two is required unless ``insecure_dev``."""
    tokens_file: Path | None = None
    """Named operators: one ``<name> <sha256 hex of the token>`` a line (``#`` starts a comment, blank lines are
    skipped); ``flywheel tokens add NAME --file F`` makes a token and appends its line. A request's bearer token is
    hashed and compared with every line's hash; the audit names the operator it belongs to. Read at admin's start,
    which refuses a malformed line, a duplicate name or token, a hash that is not 64 hex digits or an empty file,
    naming this field (``services.admin.deps.Operators``)."""
    public_reads: bool = False
    """Whether the read endpoints (``/status``, ``/status/history``, ``/policy/versions``, ``/audit``, ``/config``,
    ``/config/history``, ``/trace/...``) answer without a token. False (the default, compose and Kubernetes): they
    need an operator's token like the writes (401 without one, 403 with a wrong one); the local stack sets it true
    for its status page. ``/healthz`` and ``/metrics`` are always open."""
    insecure_dev: bool = False
    """Allow starting without a token (mutations then unauthenticated). Development only."""
    refresh_interval_s: float = Field(2.0, gt=0)
    """How often backlog (consumer lag) is recomputed."""
    log_dir: Path | None = None
    """Where the services' JSON log files are, when the admin can read them (the local stack sets it):
    serves ``GET /trace/{sample_id}``. None: trace with the CLI from piped logs instead."""


class HttpSettings(_Section):
    host: str = "127.0.0.1"
    """Interface for /healthz and /metrics (and the admin API)."""
    port: int = Field(8000, ge=0, le=65535)
    """Port; 0 picks a free one."""


class LogSettings(_Section):
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    file: Path | None = None
    """Write the JSON lines to this file, rotated by size (None: standard output, where compose's log
    driver caps them). Rotation happens in the process, between lines, so no line is lost or cut."""
    max_bytes: int = Field(20 * 1024 * 1024, ge=64 * 1024)
    """Size at which ``file`` is rotated to ``file.1`` (``file.1`` to ``file.2``, ...)."""
    backups: int = Field(3, ge=1, le=1000)
    """Rotated files kept; the oldest is deleted. The per-fragment lines are the trace ``flywheel trace``
    reads, so keep enough for the window you want to trace."""


class TrackingSettings(_Section):
    """Training curves the trainer writes after every update (``services/trainer/tracking.py``)."""

    tensorboard: bool = True
    """Write TensorBoard scalars (returns, lengths, losses, KL, clip fraction, entropy, explained variance,
    lag, throughput); off: nothing is written."""
    tensorboard_dir: Path | None = None
    """Directory of the event files (``tensorboard --logdir`` it); None: ``<FLYWHEEL_HOME or .flywheel>/tb/<run>``
    (:meth:`log_dir`)."""
    mlflow_uri: str | None = Field(None, min_length=1)
    """MLflow tracking URI (``http://127.0.0.1:5000``, ``file:./mlruns``) to log the same scalars to, under an
    experiment named after the run; None: no MLflow. Needs the ``mlflow`` extra (``pip install -e '.[mlflow]'``)."""

    def log_dir(self, run: str, home: str | None) -> Path:
        """``tensorboard_dir``, else ``<home>/tb/<run>`` with ``home`` the caller's ``$FLYWHEEL_HOME``
        (None or empty: ``.flywheel``, relative to the working directory as ``store.local_root``)."""
        if self.tensorboard_dir is not None:
            return self.tensorboard_dir
        return Path(home or ".flywheel").expanduser() / "tb" / run


class Settings(_Section):
    """Everything a Flywheel process can be configured with."""

    run: str = "default"
    """Run name: prefixes every topic and object-store key, so runs share a cluster."""
    mode: Literal["async", "sync"] = "async"
    """``sync`` is the synchronous baseline used by the benchmarks."""
    kafka: KafkaSettings = KafkaSettings()
    store: StoreSettings = StoreSettings()
    s3: S3Settings = S3Settings()
    env: EnvSettings = EnvSettings()
    sampler: SamplerSettings = SamplerSettings()
    trainer: TrainerSettings = TrainerSettings()
    paramsync: ParamsyncSettings = ParamsyncSettings()
    admin: AdminSettings = AdminSettings()
    http: HttpSettings = HttpSettings()
    log: LogSettings = LogSettings()
    tracking: TrackingSettings = TrackingSettings()
    signing: SigningSettings = SigningSettings()

    @field_validator("run")
    @classmethod
    def _run_is_topic_safe(cls, v: str) -> str:
        ok = v and len(v) <= 100 and all(c.isalnum() or c in "-_" for c in v)
        if not ok:
            raise ValueError(f"must be 1-100 chars of letters, digits, '-' or '_', got {v=}")
        return v

    @model_validator(mode="after")
    def _cross_field(self) -> Settings:
        if self.store.backend == "s3" and not self.s3.bucket:
            raise ValueError(f"s3.bucket is required when store.backend='s3', got {self.s3.bucket=}")
        if self.trainer.minibatches > self.trainer.batch_fragments * self.env.fragment_steps * self.env.num_envs:
            raise ValueError(f"trainer.minibatches exceeds the batch size: {self.trainer.minibatches=}")
        return self

    def redacted(self) -> dict[str, Any]:
        """The resolved config as JSON-safe data with secrets masked, for the start-up log line."""
        data: dict[str, Any] = json.loads(self.model_dump_json())
        if self.admin.token is not None:
            data["admin"]["token"] = "***"
        return data


def _env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    sections = {name for name, f in Settings.model_fields.items() if isinstance(f.default, BaseModel)}
    top = set(Settings.model_fields) - sections
    out: dict[str, Any] = {}
    for key, value in environ.items():
        if not key.startswith(ENV_PREFIX) or key in NON_SETTING_ENV or key.startswith(NON_SETTING_ENV_PREFIXES):
            continue
        rest = key[len(ENV_PREFIX) :].lower()
        if rest in top:
            out[rest] = value
            continue
        section, _, field = rest.partition("_")
        if section not in sections or not field:
            raise ConfigError(f"unknown setting in environment: {key} (no such field)")
        model = Settings.model_fields[section].annotation
        assert isinstance(model, type) and issubclass(model, BaseModel)
        target = out.setdefault(section, {})
        # A nested section (trainer.guard): FLYWHEEL_TRAINER_GUARD_ENABLED -> trainer.guard.enabled.
        nested = [n for n, f in model.model_fields.items() if isinstance(f.default, BaseModel)
                  and field.startswith(n + "_")]
        if field not in model.model_fields and nested:
            sub = nested[0]
            field = field[len(sub) + 1:]
            sub_model = model.model_fields[sub].annotation
            assert isinstance(sub_model, type) and issubclass(sub_model, BaseModel)
            model, target, section = sub_model, target.setdefault(sub, {}), f"{section}.{sub}"
        if field not in model.model_fields:
            raise ConfigError(f"unknown setting in environment: {key} (no field {section}.{field})")
        optional = not model.model_fields[field].is_required() and model.model_fields[field].default is None
        target[field] = None if optional and value.strip().lower() in ("none", "null") else value
    return out


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(merged.get(k), dict):
            merged[k] = _merge(merged[k], v)
        else:
            merged[k] = v
    return merged


def _format_validation(err: ValidationError, source: str) -> str:
    lines = [f"invalid configuration ({source}):"]
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "<root>"
        value = e.get("input")
        # Never echo a secret, nor a whole section (it may hold one): the field name says enough.
        if any(word in field for word in ("password", "token", "secret")):
            shown = "<hidden>"
        elif isinstance(value, (dict, list)):
            shown = f"<{type(value).__name__}>"
        else:
            shown = repr(value)
        lines.append(f"  {field}: {e['msg']} (got {shown})")
    return "\n".join(lines)


def load_settings(path: str | Path | None = None, environ: Mapping[str, str] | None = None) -> Settings:
    """Resolve the settings; raise :class:`ConfigError` naming the field on any problem.

    ``path`` defaults to ``$FLYWHEEL_CONFIG``; with neither, only defaults and environment apply.
    """
    environ = os.environ if environ is None else environ
    path = path if path is not None else environ.get("FLYWHEEL_CONFIG")
    data: dict[str, Any] = {}
    source = "defaults + environment"
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            loaded = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {p} is not valid YAML: {exc}") from exc
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {p} must hold a mapping at the top level")
        data = loaded
        source = f"{p} + environment"
    data = _merge(data, _env_overrides(environ))
    try:
        return Settings.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_validation(exc, source)) from None
