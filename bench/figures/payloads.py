"""Payloads: what one fragment and one policy weigh on the wire, per config, and what encoding and decoding cost.

For CartPole, Pendulum, MinAtar Breakout and Pong (``configs/*.yaml``, each as its samplers run it): a
``RolloutWorker`` built from the config steps its envs with the config's initial policy (the trainer's freshly
initialised weights, as a run's first version) and makes fragments; each is encoded as the sampler encodes it
(``shared.fragment.encode_fitting`` under ``kafka.max_message_bytes``) without compression and with zstd, and decoded
with full validation as the trainer decodes it (``decode_fragment``). Kafka's producer compression
(``kafka.compression``) applies on top, per batch, and is not counted here. The policy blob is
``weights_to_bytes`` of the same weights: what paramsync publishes and what rides inline on an announcement.

    .venv/bin/python -m bench.figures.payloads           # prints the table (well under a minute)
    .venv/bin/python -m bench.figures.payloads --quick   # fewer fragments and repeats

A config whose env cannot be made here (its extra not installed: ``ale-py`` for Pong, ``minatar`` for MinAtar) is
reported as skipped with the reason, never left out silently.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from bench.report import FigureResult, Row, standalone_main
from bench.stats import timed_median

NAME = "payloads"
TITLE = ("Payloads: bytes per fragment (none / zstd) and per policy blob, encode and decode time, per config, "
         "as the samplers and the trainer encode and decode them.")
TARGET = ("every fragment of every config fits one record under kafka.max_message_bytes with the config's compression "
          "(a config skipped for a missing env extra fails it)")
REPO = Path(__file__).resolve().parents[2]
CONFIGS = ("configs/cartpole.yaml", "configs/pendulum.yaml", "configs/minatar-breakout.yaml", "configs/pong.yaml")
ENCODINGS: tuple[str | None, ...] = (None, "zstd")


def _label(compression: str | None) -> str:
    return compression or "none"


def measure_config(path: str, fragments: int, repeats: int) -> dict[str, Any]:
    """One config's fragments and policy blob; raises what making its env raises (a missing extra)."""
    from services.sampler.rollout import RolloutWorker
    from services.trainer.learner import Learner
    from shared.fragment import decode_fragment, encode_fitting
    from shared.rl.envs import fragment_spec
    from shared.settings import load_settings

    s = load_settings(REPO / path, environ={})
    limit = s.kafka.max_message_bytes
    spec = fragment_spec(s.env.id, limit, frame_stack=s.env.frame_stack)
    learner = Learner(spec, s.trainer)
    blob = learner.weights()
    worker = RolloutWorker.from_settings(s, "payloads-0", seed=1)
    try:
        worker.set_policy(0, blob)
        worker.collect()  # past the resets' first frames
        frags = [worker.collect() for _ in range(fragments)]
    finally:
        worker.close()
    out: dict[str, Any] = {
        "env_id": s.env.id, "fragment_steps": s.env.fragment_steps, "num_envs": s.env.num_envs,
        "env_steps_per_fragment": frags[0].steps, "obs_shape": list(frags[0].obs.shape[2:]),
        "obs_dtype": str(frags[0].obs.dtype), "frame_stack": spec.frame_stack,
        "history_frames": 0 if frags[0].obs_history is None else int(frags[0].obs_history.shape[0]),
        "config_compression": s.sampler.compression, "kafka_compression": s.kafka.compression,
        "max_message_bytes": limit, "policy_blob_bytes": len(blob), "fragments": fragments, "repeats": repeats,
        "encodings": {},
    }
    for compression in ENCODINGS:
        sizes, records, enc_ms, dec_ms = [], [], [], []
        for frag in frags:
            pieces = encode_fitting(frag, limit, compression)
            records.append(len(pieces))
            sizes.append(sum(len(p) for _, _, p in pieces))
            enc_ms.append(1e3 * timed_median(lambda f=frag, c=compression: encode_fitting(f, limit, c), repeats))
            dec_ms.append(1e3 * timed_median(lambda ps=pieces: [decode_fragment(h, p, spec) for _, h, p in ps],
                                             repeats))
        out["encodings"][_label(compression)] = {
            "bytes": sizes, "bytes_median": statistics.median(sizes), "bytes_min": min(sizes), "bytes_max": max(sizes),
            "bytes_per_env_step": statistics.median(sizes) / frags[0].steps,
            "records": records, "encode_ms": statistics.median(enc_ms), "decode_ms": statistics.median(dec_ms)}
    none, zstd = out["encodings"]["none"], out["encodings"]["zstd"]
    out["zstd_ratio"] = none["bytes_median"] / zstd["bytes_median"]
    out["one_record_each"] = all(n == 1 for n in out["encodings"][_label(s.sampler.compression)]["records"])
    return out


def measure(quick: bool = False) -> dict[str, Any]:
    from gymnasium import error as gym_error

    fragments, repeats = (2, 2) if quick else (5, 5)
    results: dict[str, Any] = {"configs": {}, "skipped": {}, "fragments": fragments, "repeats": repeats}
    for path in CONFIGS:
        try:
            results["configs"][path] = measure_config(path, fragments, repeats)
        except (ImportError, gym_error.Error) as exc:  # the env's extra not installed (NamespaceNotFound, ...)
            results["skipped"][path] = f"{type(exc).__name__}: {exc}"
    return results


def _size(b: float) -> str:
    return f"{b / 1e6:.2f} MB" if b >= 1e6 else f"{b / 1e3:.1f} KB"


def table(results: dict[str, Any]) -> str:
    lines = ["| config | fragment | none: bytes, records | zstd: bytes (ratio), records | encode none / zstd ms "
             "| decode none / zstd ms | B per env step (config's) | policy blob |",
             "|---|---|---|---|---|---|---|---|"]
    for path, c in results["configs"].items():
        n, z = c["encodings"]["none"], c["encodings"]["zstd"]
        own = c["encodings"][_label(c["config_compression"])]
        shape = " x ".join(str(d) for d in c["obs_shape"])
        frag = (f"{c['fragment_steps']} steps x {c['num_envs']} envs, {c['obs_dtype']} {shape}"
                + (f" (+{c['history_frames']} history frames)" if c["history_frames"] else ""))
        lines.append(
            f"| {Path(path).name} | {frag} | {n['bytes_median']:,.0f} ({n['bytes_min']:,.0f}-{n['bytes_max']:,.0f}), "
            f"{max(n['records'])} | {z['bytes_median']:,.0f} ({c['zstd_ratio']:.1f}x), {max(z['records'])} "
            f"| {n['encode_ms']:.2f} / {z['encode_ms']:.2f} | {n['decode_ms']:.2f} / {z['decode_ms']:.2f} "
            f"| {own['bytes_per_env_step']:.1f} ({_label(c['config_compression'])}) "
            f"| {c['policy_blob_bytes']:,} B ({_size(c['policy_blob_bytes'])}) |")
    for path, why in results["skipped"].items():
        lines.append(f"| {Path(path).name} | skipped: {why} | | | | | | |")
    lines += ["", "Bytes: median (min-max) over the fragments, the payload only (headers and Kafka's batch "
              "compression not counted); records: how many the sampler would send for one fragment under "
              "`kafka.max_message_bytes` (more than 1: split in time). Times: median of the repeats, median over "
              "the fragments."]
    return "\n".join(lines)


def run(ctx: Any) -> FigureResult:
    results = measure(quick=bool(getattr(ctx, "quick", False)))
    fits = all(c["one_record_each"] for c in results["configs"].values()) and not results["skipped"]
    rows = [Row("every fragment one record with its config's compression", "yes" if fits else "no", TARGET, fits)]
    for path, c in results["configs"].items():
        own = c["encodings"][_label(c["config_compression"])]
        rows.append(Row(f"{Path(path).name}: fragment ({_label(c['config_compression'])}) / policy blob",
                        f"{_size(own['bytes_median'])} / {_size(c['policy_blob_bytes'])}"))
    for path, why in results["skipped"].items():
        rows.append(Row(f"{Path(path).name}: skipped", why.split(":")[0]))
    return FigureResult(
        headline=rows, numbers=results, settings={"configs": list(CONFIGS), "fragments": results["fragments"],
                                                  "repeats": results["repeats"]},
        method=("In one process, no services: per config a RolloutWorker built from it (seed 1) with the trainer's "
                "initial weights makes one fragment to pass the resets, then the measured ones; each is encoded "
                "with `encode_fitting` under the config's `kafka.max_message_bytes` without compression and with "
                "zstd and decoded with `decode_fragment` (full validation), each repeated; the policy blob is "
                "the same weights' bytes."),
        details_md=table(results))


def main() -> None:
    standalone_main("python -m bench.figures.payloads", measure, table)


if __name__ == "__main__":
    main()
