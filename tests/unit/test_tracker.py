from services.paramsync.tracker import SyncTracker
from shared.service import percentile


def test_latency_waits_for_every_live_sampler() -> None:
    t = SyncTracker(sampler_timeout_s=10)
    t.heartbeat("a", 0, at=0.0)
    t.heartbeat("b", 0, at=0.0)
    t.published(1, at=1.0)
    assert t.heartbeat("a", 1, at=1.2) == []
    assert t.heartbeat("b", 1, at=1.5) == [(1, 0.5)]
    assert t.p(0.5) == 0.5


def test_dead_samplers_do_not_block() -> None:
    t = SyncTracker(sampler_timeout_s=2)
    t.heartbeat("gone", 0, at=0.0)
    t.heartbeat("a", 0, at=5.0)
    t.published(1, at=5.0)
    done = t.heartbeat("a", 1, at=5.3)
    assert [v for v, _ in done] == [1] and abs(done[0][1] - 0.3) < 1e-9


def test_newer_version_settles_older_ones() -> None:
    t = SyncTracker(sampler_timeout_s=10)
    t.published(1, at=0.0)
    t.published(2, at=1.0)
    done = t.heartbeat("a", 2, at=1.5)
    assert [v for v, _ in done] == [1, 2]


def test_percentile() -> None:
    assert percentile([], 0.5) is None
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert percentile([5.0], 0.95) == 5.0


def test_sampler_seeds_differ_per_sampler_and_repeat_per_id() -> None:
    from services.sampler.service import sampler_seed

    assert sampler_seed(None, "a") is None
    assert sampler_seed(1, "sampler-0") == sampler_seed(1, "sampler-0")
    assert sampler_seed(1, "sampler-0") != sampler_seed(1, "sampler-1")
    assert sampler_seed(1, "sampler-0") != sampler_seed(2, "sampler-0")


def test_silent_samplers_are_forgotten_after_ten_timeouts() -> None:
    t = SyncTracker(sampler_timeout_s=2)
    t.heartbeat("old", 0, at=0.0)
    t.heartbeat("a", 0, at=0.0)
    assert t.forget(20.0) == []  # 10 x timeout: not yet
    assert set(t.samplers) == {"old", "a"} and t.live(20.0) == {}
    t.heartbeat("a", 1, at=20.5)  # a heartbeat forgets the long-silent ones too
    assert set(t.samplers) == {"a"}
    assert t.forget(41.0) == ["a"] and t.samplers == {}


def test_sampler_churn_keeps_the_tracker_bounded() -> None:
    t = SyncTracker(sampler_timeout_s=1)
    for i in range(10_000):  # a sampler restarting under a new id every second
        t.heartbeat(f"s-{i}", i, at=float(i))
    assert len(t.samplers) <= 11
