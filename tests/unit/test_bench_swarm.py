"""The swarm figure's accounting (bench/figures/swarm.py) and its client's adoption record (bench/swarm_client.py)."""

from __future__ import annotations

import math

import numpy as np

from bench.figures.swarm import credits_read, histogram, histogram_window, partitions_for, sync_latencies
from bench.swarm_client import Adoptions, identity_ids, synthetic_fragment
from shared.credits import shard_of
from shared.fragment import decode_fragment, encode_fragment
from shared.rl.envs import fragment_spec
from shared.settings import load_settings


def test_partitions_old_one_new_per_sixteen() -> None:
    assert partitions_for("old", 1000) == 1
    assert partitions_for("new", 1000) == 64
    assert partitions_for("new", 256) == 16
    assert partitions_for("new", 8) == 1


def test_credits_read_one_partition_every_sampler_reads_all() -> None:
    ids = identity_ids(0, 10)
    r = credits_read({0: 500.0}, ids, 1)
    assert r["per_sampler_mean"] == 500.0
    assert r["per_sampler_max"] == 500.0
    assert r["fleet"] == 5000.0


def test_credits_read_each_sampler_reads_its_own_partition() -> None:
    ids = identity_ids(0, 40)
    parts = 4
    per_part = {p: 100.0 * (p + 1) for p in range(parts)}
    readers = [shard_of(i, parts) for i in ids]
    r = credits_read(per_part, ids, parts)
    assert math.isclose(r["fleet"], sum(per_part[p] for p in readers))
    assert math.isclose(r["per_sampler_mean"], r["fleet"] / len(ids))
    assert r["per_sampler_max"] == max(per_part[p] for p in set(readers))


def test_adoptions_count_skipped_versions_as_reached() -> None:
    a = Adoptions()
    a.note(None, 3, 10.0)  # first policy: acts on 3 (versions before it are not counted)
    a.note(3, 5, 11.0)  # skipped to 5: now on 4 and 5 as well
    a.note(None, 5, 12.0)  # a second identity, straight to 5
    d = a.as_dict()
    assert sorted(d) == ["3", "4", "5"]
    assert d["3"] == [1, 10.0, 10.0]
    assert d["5"] == [2, 11.0, 12.0]


def test_sync_latencies_need_every_identity() -> None:
    published = {4: 100.0, 5: 101.0, 6: 200.0}
    procs: list[dict[str, list[float]]] = [{"4": [2, 100.1, 100.3], "5": [2, 101.2, 101.5]},
                                           {"4": [1, 100.2, 100.4], "5": [0, 0, 0]}]
    lat, missed = sync_latencies(published, procs, identities=3, t0=99.0, t1=150.0)
    assert len(lat) == 1 and math.isclose(lat[0], 0.4)
    assert missed == 1  # version 5 reached 2 of 3; version 6 is outside the window


def test_histogram_window_mean_and_max_bucket() -> None:
    def page(counts: list[int], total: float) -> str:
        lines = ["# HELP h x", "# TYPE h histogram"]
        cum = 0
        for le, c in zip(["0.0", "1.0", "2.0", "4.0", "+Inf"], counts, strict=True):
            cum += c
            lines.append(f'h_bucket{{le="{le}"}} {cum}')
        lines += [f"h_sum {total}", f"h_count {cum}"]
        return "\n".join(lines) + "\n"

    a = histogram(page([1, 0, 0, 0, 0], 0.0), "h")
    b = histogram(page([1, 2, 3, 0, 0], 8.0), "h")  # 2 at lag 1 and 3 at lag 2 since a
    w = histogram_window(a, b)
    assert w["n"] == 5
    assert math.isclose(w["mean"], 8.0 / 5)
    assert w["max_le"] == 2.0
    assert math.isnan(histogram_window(b, b)["mean"])


def test_synthetic_fragment_decodes_as_cartpole() -> None:
    settings = load_settings("configs/cartpole.yaml")
    frag = synthetic_fragment(settings, "swarm-7", 3, np.random.default_rng(0))
    headers, payload = encode_fragment(frag)
    back = decode_fragment(headers, payload, fragment_spec("CartPole-v1", max_bytes=1 << 20))
    assert back.sampler_id == "swarm-7" and back.policy_version == 3
    assert back.steps == settings.env.fragment_steps * settings.env.num_envs



def test_own_readers_give_each_identity_its_shard_and_the_policy_topic() -> None:
    """``--readers own``: three consumers per identity, its credits tail on its own shard only; ``shared``: two per
    process, the credits tail on the shards of its identities. A grant reaches only the gates it is handed."""
    import asyncio

    import pytest
    from aiokafka import TopicPartition

    from bench.swarm_client import Swarm
    from shared.bus import Record
    from shared.messages import CreditGrant

    settings = load_settings("configs/cartpole.yaml")
    settings = settings.model_copy(update={"kafka": settings.kafka.model_copy(update={"credits_partitions": 4})})
    ids = identity_ids(0, 8)

    async def build(readers: str) -> Swarm:
        swarm = Swarm(settings, ids, 0.02, readers)
        await swarm.close()  # its clients were never started: closing them only releases them
        return swarm

    own = asyncio.run(build("own"))
    credits = own.topics.credits
    assert len(own.readers) == 24
    assert [tail.tps for name, tail, _ in own.readers if name.startswith("credits:")] == [  # type: ignore[attr-defined]
        [TopicPartition(credits, shard_of(i, 4))] for i in ids]
    assert all(len(tail.tps) == 1 for _, tail, _ in own.readers)  # type: ignore[attr-defined]  # as a sampler's
    shared = asyncio.run(build("shared"))
    assert [name for name, _, _ in shared.readers] == ["credits", "policy"]
    assert {tp.partition for tp in shared.readers[0][1].tps} == {shard_of(i, 4) for i in ids}  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="shared or own"):
        asyncio.run(build("every"))
    # A grant read by swarm-0's own reader reaches swarm-0's gate and no other identity's of that shard.
    _, _, handler = next(r for r in own.readers if r[0] == "credits:swarm-0")
    gates = {i.id: i.gate for i in own.identities}
    grant = CreditGrant(trainer="t", window=0, consumed={}, limits={g.key: 3 for g in gates.values()},
                        shard=shard_of("swarm-0", 4), shards=4)
    handler(Record(TopicPartition(credits, shard_of("swarm-0", 4)), 0, None, grant.to_bytes(), []))
    assert [sid for sid, g in gates.items() if g.known] == ["swarm-0"]


def test_a_run_whose_identities_sent_nothing_is_not_reported_as_the_swarms_lag() -> None:
    """own-1000 once trained only the real sampler's fragments: its headline must say it did not run as a swarm
    (meets False), not show the real sampler's lag as the swarm's within max_staleness."""
    from bench.figures.swarm import headline_rows, swarm_ran

    def run(samplers: int, fragments: int, bps: float) -> dict[str, object]:
        return {"samplers": samplers, "credits_bps_per_sampler": bps, "lag": {"mean": 1.5, "max_le": 4.0},
                "sync_s": {"p50": 0.1, "p99": 0.4, "versions": 9, "versions_not_reached": 0},
                "cores": {"brokers": 0.5},
                "swarm": [{"fragments": fragments, "without_policy": 0 if fragments else samplers // 2}] * 2}

    res = {"new-256": run(256, 40, 1000.0), "new-1000": run(1000, 90, 1100.0),
           "own-256": run(256, 30, 2000.0), "own-1000": run(1000, 0, 400.0)}
    assert swarm_ran(res["own-256"]) and not swarm_ran(res["own-1000"])
    rows = {r.metric: r for r in headline_rows(res, (256, 1000), ("new", "own"), 8)}
    assert rows["new design: credits B/s per sampler, 1000 / 256"].meets is True
    assert "own-1000: lag at training time mean / max bucket" not in rows
    assert rows["own-1000: did not run as a swarm"].meets is False
    assert "1000 of 1000" in rows["own-1000: did not run as a swarm"].value
    assert rows["own-256: lag at training time mean / max bucket"].meets is True
