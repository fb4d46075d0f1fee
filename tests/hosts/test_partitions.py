"""The partition nemesis on the multi-host stack, row by row (after ``test_multihost_stack.py``, on the same
stack): each row cuts links with iptables inside one part's namespace, shows the cut took effect, heals, and checks
the data (``tests/hosts/net.py``). Rows go into ``docs/reliability-network.md``.

Opt-in (see conftest.py): ``make test-partitions`` as root."""

from __future__ import annotations

import subprocess
import time
from typing import Any

import pytest

from devstack import hosts as mh
from tests.faults.liveness import SamplersBack, read_healthz
from tests.hosts.conftest import CHECKPOINT_EVERY
from tests.hosts.net import ADMIN, Net, NetRow, http_rtt, kafka_rtt, reaches, run_py

pytestmark = [pytest.mark.hosts]
S3_PORT = 9000


RANKS_BACK_BOUND_S = 150.0
"""The samplers-back bound of a row that makes the trainer ranks' group re-form: trainer.rank_timeout_s (60 s) for the
hung collective, the re-formed group's restart from its checkpoint, then the default bound's margin."""

def _trainer_restarts(status: dict[str, Any] | None) -> int:
    """How often the supervisor restarted the trainer, from ``/status`` (0 when it says nothing)."""
    return int((((status or {}).get("services") or {}).get("trainer") or {}).get("restarts", 0))


def _row(net: Net, name: str) -> NetRow:
    row = NetRow(name)
    net.rows.append(row)
    return row


@pytest.mark.timeout(900)
def test_leader_of_a_samples_partition_isolated_from_brokers_and_clients(net: Net) -> None:
    """The classic lost-write case: the leader of ``<run>.samples`` partition 0 loses every other broker and every
    client (both ways) for 40 s. With acks=all and min ISR 2 it cannot acknowledge a write alone; the controller
    moves the leadership; every write a sampler saw acknowledged must be on the topic after the heal."""
    topic = f"{net.run_name()}.samples"
    leader, isr = net.leaders(topic)[0]
    assert leader in net.kafka and len(isr) == 3, (leader, isr)
    others = [n for n in net.kafka if n != leader]
    clients = ["trainer", "trainer-1", "sampler-0", "sampler-1", "paramsync", "admin"]
    row = _row(net, f"leader of {topic}[0] isolated from brokers and clients, 40 s")
    host, port = net.broker(leader)

    def happened() -> list[str]:
        row.fault = (f"the leader ({leader}) reaching neither other broker, no client reaching it, the other "
                     "brokers still reaching each other")
        wrong = [f"{leader} still reaches {o}" for o in others if reaches(leader, *net.broker(o))]
        wrong += [f"{c} still reaches {leader}" for c in ("trainer", "sampler-0") if reaches(c, host, port)]
        a, b = others
        return wrong + ([] if reaches(a, *net.broker(b)) else [f"{a} lost {b} too"])

    def moved() -> str | None:
        try:
            now, _ = net.leaders(topic, ask=others)[0]
        except Exception:  # noqa: BLE001 (asked again at the next poll)
            return None
        return f"the controller moved {topic}[0]'s leadership {leader} -> {now}" if now != leader else None

    at_heal, _ = net.partition(row, leader, [*others, *clients], 40.0, happened=happened, extra_detect=moved)
    assert any("moved" in n for n in row.notes), f"the leadership never moved off the isolated {leader}"
    # The operator's signal for it: admin describes the run topics; the ISRs shrank when the controller fenced
    # the leader, so /status shows services.kafka degraded naming the partitions, and the gauge behind
    # FlywheelKafkaUnderReplicated went above 0 (the alert pending: its for: is 5 min, the cut 40 s).
    seen = row.first_seen.get("kafka")
    assert seen is not None and "replicas in sync" in seen[1], f"no under-replication in /status: {row.first_seen}"
    row.notes.append(f"/status services.kafka degraded after {seen[0]:.1f} s: {seen[1][:200]}")
    net.check(row, at_heal or 0, CHECKPOINT_EVERY)
    assert row.watch is not None
    keys = [a.key for a in row.watch.new() if a.name == "FlywheelKafkaUnderReplicated"]
    assert f"FlywheelKafkaUnderReplicated{{{topic}}}" in keys, f"the alert never went pending: {row.alerts}"


@pytest.mark.timeout(900)
def test_trainer_ranks_cut_from_each_other_only(net: Net) -> None:
    """Rank 0 and rank 1 lose each other (both still reach every broker) for 75 s, past trainer.rank_timeout_s
    (60 s): the group must not train split-brained. The collective waits, the trainer shows degraded naming it,
    at the timeout both ranks stop and restart from rank 0's checkpoint, and re-form once healed; no fragment
    trained twice, one lineage of weights (equal digests)."""
    before = net.status() or {}
    restarts0 = _trainer_restarts(before)
    row = _row(net, "trainer rank 0 and rank 1 cut from each other, 75 s (past rank_timeout_s 60 s)")
    rank1_http = net.http_port("trainer-1")

    def happened() -> list[str]:
        row.fault = "rank 0 not reaching rank 1's host, both ranks still reaching every broker"
        wrong = ["rank 0 still reaches rank 1"] if reaches("trainer", mh.address("trainer-1"), rank1_http) else []
        return wrong + [f"{r} lost {h}" for r in ("trainer", "trainer-1") for h, p in net.bootstrap()
                        if not reaches(r, h, p)]

    at_heal, _ = net.partition(row, "trainer", ["trainer-1"], 75.0, happened=happened)
    after = net.status() or {}
    ranks = (after.get("trainer") or {}).get("ranks") or []
    restarts1 = _trainer_restarts(after)
    row.notes.append(f"trainer restarts {restarts0} -> {restarts1}")
    assert "ranks" in row.detected or "trainer" in row.detected, f"the trainer never showed the split: {row.detected}"
    net.check(row, at_heal or 0, CHECKPOINT_EVERY)
    assert len(ranks) == 2
    _one_lineage(net, row)


def _one_lineage(net: Net, row: NetRow) -> None:
    """One lineage of weights: the ranks' digests, taken at the same update, agree (heartbeats may straddle one)."""
    ranks: list[dict[str, Any]] = []
    for _ in range(20):
        ranks = (net.status() or {})["trainer"]["ranks"]
        if len(ranks) == 2 and ranks[0]["digest_update"] is not None \
                and ranks[0]["digest_update"] == ranks[1]["digest_update"]:
            break
        time.sleep(1)
    assert len(ranks) == 2 and ranks[0]["digest_update"] == ranks[1]["digest_update"], ranks
    assert ranks[0]["weights_digest"] == ranks[1]["weights_digest"], f"the ranks' weights diverged: {ranks}"
    row.notes.append(f"both ranks' weights digest {ranks[0]['weights_digest']} at update {ranks[0]['digest_update']}")


@pytest.mark.timeout(600)
def test_paramsync_cut_from_s3(net: Net) -> None:
    row = _row(net, "paramsync cut from S3, 30 s")
    s3 = mh.address("s3")

    def happened() -> list[str]:
        row.fault = "paramsync not reaching the S3 server, the trainer still reaching it"
        return (["paramsync still reaches S3"] if reaches("paramsync", s3, S3_PORT) else []) + \
            ([] if reaches("trainer", s3, S3_PORT) else ["the trainer lost S3 too"])

    at_heal, _ = net.partition(row, "paramsync", ["s3"], 30.0, happened=happened)
    assert "paramsync" in row.detected, row.detected
    net.check(row, at_heal or 0, CHECKPOINT_EVERY)


@pytest.mark.timeout(600)
def test_paramsync_cut_from_kafka(net: Net) -> None:
    row = _row(net, "paramsync cut from every broker, 30 s")

    def happened() -> list[str]:
        row.fault = "paramsync reaching no broker"
        return [f"paramsync still reaches {h}" for h, p in net.bootstrap() if reaches("paramsync", h, p)]

    at_heal, _ = net.partition(row, "paramsync", net.kafka, 30.0, happened=happened)
    assert "paramsync" in row.detected, row.detected
    net.check(row, at_heal or 0, CHECKPOINT_EVERY)


CLI_TIMEOUT_S = 10.0
"""The ``flywheel`` CLI's HTTP timeout for ``pause`` (services/admin/cli.py: 10 s but for ``sync``)."""


def _flywheel(net: Net, *args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    """``flywheel <args>`` against admin from the root namespace, as an operator runs it; and how long it took."""
    t0 = time.monotonic()
    out = run_py(net.home, "-m", "services.admin.cli", "--url", ADMIN, *args, timeout=120, check=False)
    return out, time.monotonic() - t0


def _sampler_status(net: Net, sid: str) -> dict[str, Any]:
    return next((x for x in (net.status() or {}).get("samplers") or [] if x.get("id") == sid), {})


@pytest.mark.timeout(600)
def test_pause_asked_while_admin_is_cut_from_kafka(net: Net) -> None:
    """Admin loses every broker for 30 s and an operator pauses sampler-1 meanwhile: the pause is stored (the store
    is reachable) but its command cannot go out through Kafka, so ``flywheel pause`` answers within the CLI's
    timeout with exit 3 and ``pending`` (not exit 2, "did not answer in time"); the sampler applies the stored
    pause by itself and is paused once healed (``/status`` says so and it produces nothing), while sampler-0 goes
    on; after the row, ``flywheel resume`` and sampler-1 produces again."""
    row = _row(net, "admin cut from every broker, 30 s; flywheel pause sampler-1 asked during the cut")
    target = "sampler-1"
    sid = str(read_healthz(net.sampler_urls()[target]).get("id") or target)
    asked: dict[str, Any] = {}

    def happened() -> list[str]:
        row.fault = "admin reaching no broker, sampler-1 still reaching all"
        return [f"admin still reaches {h}" for h, p in net.bootstrap() if reaches("admin", h, p)] + \
            [f"sampler-1 lost {h}" for h, p in net.bootstrap() if not reaches("sampler-1", h, p)]

    def pause() -> None:
        out, took = _flywheel(net, "pause", sid)
        asked.update(code=out.returncode, out=(out.stdout + out.stderr).strip(), took=round(took, 1))
        print(f"[{row.name}] flywheel pause {sid} during the cut: exit {out.returncode} after {took:.1f} s: "
              f"{asked['out'][-500:]}")

    try:
        at_heal, _ = net.partition(row, "admin", net.kafka, 30.0, happened=happened, during=pause,
                                   paused={target: "paused by the row (flywheel pause during the cut)"})
        row.notes.append(f"flywheel pause {sid} during the cut: exit {asked.get('code')} after {asked.get('took')} s "
                         f"({str(asked.get('out'))[:200]})")
        assert asked.get("code") == 3, f"want exit 3 (pending) while admin cannot reach Kafka: {asked}"
        assert "pending" in str(asked.get("out")), f"the CLI did not say the pause is pending: {asked}"
        # Exit 3 is an answer from the API: the CLI did not give up at its timeout (that is exit 2).
        assert float(asked["took"]) < CLI_TIMEOUT_S + 10, f"the CLI took {asked['took']} s"
        # After the heal the sampler is paused: /status says so (its heartbeats) and its count stops.
        deadline = time.monotonic() + 60
        while not _sampler_status(net, sid).get("paused"):
            assert time.monotonic() < deadline, f"{sid} not paused 60 s after the heal: {_sampler_status(net, sid)}"
            time.sleep(2)
        first = read_healthz(net.sampler_urls()[target]).get("fragments")
        time.sleep(5)
        still = read_healthz(net.sampler_urls()[target]).get("fragments")
        assert first == still, f"{sid} is shown paused but produced {first} -> {still} fragments in 5 s"
        row.notes.append(f"{sid} paused after the heal (/status paused; fragments {first} -> {still} over 5 s)")
        net.check(row, at_heal or 0, CHECKPOINT_EVERY)
    finally:  # never leave a sampler paused for the rows after this one
        out, _ = _flywheel(net, "resume", sid)
        print(f"[{row.name}] flywheel resume {sid}: exit {out.returncode}: {(out.stdout + out.stderr).strip()[-300:]}")
    assert out.returncode == 0, out.stdout + out.stderr
    back = SamplersBack({target: net.sampler_urls()[target]}).result()
    row.samplers += f"; after flywheel resume: {back.cell()}"
    row.notes.append(f"resumed after the row: {back.cell()}")
    assert back.ok, f"{sid} did not produce again after flywheel resume: {back.cell()}"


@pytest.mark.timeout(600)
def test_sampler_cut_from_every_broker_mid_send(net: Net) -> None:
    """A sampler producing all the time loses every broker for 30 s: a fragment whose send was under way is either
    on the topic once, or resent and refused as a duplicate, never trained twice; sends that failed are counted
    at the sampler (never acknowledged, so never data)."""
    row = _row(net, "sampler-0 cut from every broker mid-send, 30 s")

    def happened() -> list[str]:
        row.fault = "sampler-0 reaching no broker, sampler-1 still reaching all"
        return [f"sampler-0 still reaches {h}" for h, p in net.bootstrap() if reaches("sampler-0", h, p)] + \
            [f"sampler-1 lost {h}" for h, p in net.bootstrap() if not reaches("sampler-1", h, p)]

    at_heal, _ = net.partition(row, "sampler-0", net.kafka, 30.0, happened=happened)
    assert "sampler-0" in row.detected, row.detected
    net.check(row, at_heal or 0, CHECKPOINT_EVERY)


@pytest.mark.timeout(600)
def test_one_way_trainer_hears_nothing_from_the_brokers(net: Net) -> None:
    """Rank 0's packets reach the brokers, theirs never reach it, for 30 s: the brokers act on its requests (a
    fetch, an offset commit, a group heartbeat) and it never hears the reply."""
    row = _row(net, "one-way: rank 0 hears nothing from the brokers (its packets still arrive), 30 s")

    def happened() -> list[str]:
        row.fault = "rank 0's connections to every broker failing (replies dropped), rank 1's succeeding"
        return [f"rank 0 still connects to {h}" for h, p in net.bootstrap() if reaches("trainer", h, p)] + \
            [f"rank 1 lost {h}" for h, p in net.bootstrap() if not reaches("trainer-1", h, p)]

    at_heal, _ = net.partition(row, "trainer", net.kafka, 30.0, direction="in", happened=happened)
    net.check(row, at_heal or 0, CHECKPOINT_EVERY)


@pytest.mark.timeout(600)
def test_one_way_broker_cannot_send_to_the_other_brokers(net: Net) -> None:
    """kafka-2's packets to the other two brokers are dropped, theirs reach it, for 30 s: its replica fetches and
    controller heartbeats go unanswered (their requests never arrive), while it still hears them."""
    row = _row(net, "one-way: kafka-2 cannot send to the other brokers (theirs still arrive), 30 s")
    others = [n for n in net.kafka if n != "kafka-2"]

    def happened() -> list[str]:
        row.fault = "kafka-2 opening no connection to the other brokers, clients still reaching kafka-2"
        return [f"kafka-2 still reaches {o}" for o in others if reaches("kafka-2", *net.broker(o))] + \
            ([] if reaches("sampler-1", *net.broker("kafka-2")) else ["sampler-1 lost kafka-2"])

    at_heal, _ = net.partition(row, "kafka-2", others, 30.0, direction="out", happened=happened)
    net.check(row, at_heal or 0, CHECKPOINT_EVERY)


MAX_STALENESS = 8  # configs/cartpole.yaml trainer.max_staleness


@pytest.mark.timeout(600)
def test_slow_links_between_the_samplers_and_the_brokers(net: Net) -> None:
    """Both samplers' links to every broker get +100 ms each way and 256 kB/s a direction per connection for 45 s:
    training goes on, the lag at training stays within max_staleness, and the cost is measured."""
    row = _row(net, "slow links: both samplers to every broker, +100 ms each way, 256 kB/s, 45 s")
    kafka_host, kafka_port = net.broker("kafka")
    base = kafka_rtt("sampler-0", kafka_host, kafka_port)
    slowed: list[float] = []

    def happened() -> list[str]:
        slowed.append(kafka_rtt("sampler-0", kafka_host, kafka_port))
        direct = kafka_rtt("trainer", kafka_host, kafka_port)
        row.fault = (f"a Kafka request's round trip from sampler-0 {base * 1000:.1f} ms before, "
                     f"{slowed[0] * 1000:.0f} ms through the proxy (rank 0's, not slowed: {direct * 1000:.1f} ms)")
        return [] if slowed[0] >= 0.2 > direct else [f"round trips {slowed[0]:.3f} s slowed, {direct:.3f} s direct"]

    links = {s: list(net.kafka) for s in ("sampler-0", "sampler-1")}
    before, during, at_heal = net.slowdown(row, links, 45.0, delay_ms=100, rate_kbps=256, happened=happened)
    after = kafka_rtt("sampler-0", kafka_host, kafka_port)
    relayed = sum(f.read_text().count("connection") for f in net.logs.glob("slowlink-sampler-*.log"))
    row.during = (f"before: {before}; slowed: {during}")
    row.notes.append(f"{relayed} connection(s) relayed by the proxies; round trip after the heal {after * 1000:.1f} ms")
    assert relayed >= 2, "no client connection went through the slow-link proxies"
    assert during["updates_per_s"] and during["updates_per_s"] > 0, f"training stopped on the slow link: {during}"
    assert during["staleness_max"] <= MAX_STALENESS, during
    assert after < 0.1, f"the round trip stayed slow after the heal: {after:.3f} s"
    net.check(row, at_heal, CHECKPOINT_EVERY)


@pytest.mark.timeout(900)
def test_slow_link_between_the_trainer_ranks(net: Net) -> None:
    """Rank 0's and rank 1's links to each other get +20 ms each way (a 40 ms round trip) for 150 s. The proxies
    take new connections only, so the tool resets the open ones: the group fails its next collective, restarts
    from rank 0's checkpoint and re-forms through the proxies. Then it trains on, slower (each collective waits
    its round trips: one all-reduce a minibatch step, a few an update), the lag at training stays within
    max_staleness, and after the heal the data is exact and the weights one lineage."""
    row = _row(net, "slow link between the trainer ranks: +20 ms each way, 150 s")
    rank1, rank1_http = mh.address("trainer-1"), net.http_port("trainer-1")
    base = http_rtt("trainer", rank1, rank1_http)
    restarts0 = _trainer_restarts(net.status())
    reformed: list[float] = []

    def happened() -> list[str]:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 30:  # the reset connections fail the group's next collective
            if _trainer_restarts(net.status()) > restarts0:
                break
            time.sleep(1)
        net.settle(timeout_s=240)  # re-formed through the proxies and training
        reformed.append(time.monotonic() - t0)
        slowed = http_rtt("trainer", rank1, rank1_http)
        row.fault = (f"a GET /healthz round trip from rank 0 to rank 1 {base * 1000:.1f} ms before, "
                     f"{slowed * 1000:.0f} ms through the proxy; the group re-formed and trained again "
                     f"{reformed[0]:.0f} s after the links were slowed")
        return [] if slowed >= 0.04 > base else [f"round trips {slowed:.3f} s slowed, {base:.3f} s before"]

    links = {"trainer": ["trainer-1"], "trainer-1": ["trainer"]}
    # A collective the slow link left hanging ends only at trainer.rank_timeout_s (60 s), and the re-formed group
    # reads from its checkpoint first: the samplers' credits move again after that, not within the default bound.
    before, during, at_heal = net.slowdown(row, links, 150.0, delay_ms=20, rate_kbps=0, happened=happened,
                                           back_bound_s=RANKS_BACK_BOUND_S)
    after = http_rtt("trainer", rank1, rank1_http)
    relayed = sum(f.read_text().count("connection") for f in net.logs.glob("slowlink-trainer*.log"))
    row.during = f"before: {before}; slowed (after the group re-formed): {during}"
    cost = (f"updates/s {before['updates_per_s']} -> {during['updates_per_s']}"
            if before["updates_per_s"] and during["updates_per_s"] is not None else "")
    row.notes.append(f"{relayed} connection(s) relayed by the proxies; {cost}; round trip after the heal "
                     f"{after * 1000:.1f} ms")
    assert relayed >= 2, "no connection between the ranks went through the slow-link proxies"
    assert during["updates_per_s"] and during["updates_per_s"] > 0, f"training stopped on the slow link: {during}"
    assert during["staleness_max"] <= MAX_STALENESS, during
    assert after < 0.04, f"the round trip stayed slow after the heal: {after:.3f} s"
    net.check(row, at_heal, CHECKPOINT_EVERY)
    _one_lineage(net, row)
