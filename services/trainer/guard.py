"""The automatic rollback guard's decisions: when to roll back, to which version, and what to change.

Pure: no I/O, no torch; the clock and every input are passed in. The trainer calls
:meth:`RollbackGuard.observe_update` after every update, :meth:`RollbackGuard.note_config_revision` when
its runtime applier applies a revision, asks :meth:`RollbackGuard.decide`, carries a decision out (the
operator's rollback path, then the remedy), audits it as ``auto_rollback`` with the decision's evidence,
and reports it done with :meth:`RollbackGuard.rolled_back`. Settings: ``trainer.guard.*``
(:class:`shared.settings.GuardSettings`).

What triggers a rollback (``reason``):

- ``return_fall``: once ``min_episodes`` episodes have been seen since the guard started (or since its
  last rollback), the *best* is the highest last-100 mean observed after a healthy update. The run has
  *fallen* while the mean is more than ``drop`` (absolute, in return units) below the best; a fall
  triggers when every observation for ``window`` episodes since it began was fallen (one observation
  back within ``drop`` ends it).
- ``explosion``: ``explode_updates`` consecutive updates that refused a non-finite step
  (``skipped_steps``), or whose loss (the value loss, or the absolute policy loss) or gradient norm is
  not finite or exceeds ``explode_loss`` / ``explode_grad_norm``. It takes precedence over a fall.

What it restores (``to_version``): the newest version that *held the best* before the cause. A version
holds the best when it was the model version after a healthy update, at least ``min_episodes`` into
the tracked period, while the last-100 mean was at least ``best - hold_tolerance`` (the best including
that observation, so a version that held a lower best before the run improved no longer counts).
"Before the cause" is: before the blamed config revision was noted (when that holder still holds the
best), else at least ``settle_updates`` updates before the fall or the explosion began (or, when no
holder is that old, the oldest one left). The mean lags the weights: samplers act on versions up to the
staleness bound old, and the episodes they had in progress finish and count only later, so the versions
observed just before a fall shows still look good (in process, ``trainer.learning_rate=1.0`` on solved
CartPole at lag 2: the mean stayed 500 for three updates of broken weights, then 42 short episodes
arrived in one update, so the margin is counted in updates, not episodes). Cutting at the change skips
them exactly; without a change to cut at, the margin skips them. An explosion
before any version held a best restores the version of the last healthy update before the streak
(none: no decision).

What it changes (``remedy``): ``revert_config`` when a runtime config revision that changed keys
was noted before the fall (or explosion) began and at most ``blame_episodes`` episodes before it,
counted to the observation before the one that showed it, since one update can bring a broken policy's short
episodes by the hundred (``revert_revision`` is the earliest such revision: the shell makes the settings before it
current again); else ``lower_lr`` (multiply the learning rate by ``lr_factor``). Revisions the guard's own
remedies write are noted with ``automatic=True`` and never blamed.

Why it cannot loop: after a rollback nothing is decided for ``cooldown_s``; the best, the holders,
the fall, the explosion streak and the noted revisions are all forgotten, and the best only counts
again ``min_episodes`` episodes later (so it is a mean of the restored policy's episodes); at most
``max_per_hour`` rollbacks happen in any hour: a trigger beyond that yields one ``exhausted`` decision
(the shell pages) and then nothing until the oldest of those rollbacks is an hour old.

Published versions are pruned (``paramsync.keep_versions``): :meth:`RollbackGuard.restorable_versions`
names every version a decision could restore, so the shell keeps their weights.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from shared.settings import GuardSettings

HOUR_S = 3600.0


class UpdateSignals(Protocol):
    """What the guard reads from an update's stats (:class:`services.trainer.update.UpdateStats` has
    these). A ``grad_norm`` attribute (the gradient norm before clipping), where the stats have one, is
    read too."""

    @property
    def policy_loss(self) -> float: ...

    @property
    def value_loss(self) -> float: ...

    @property
    def skipped_steps(self) -> int: ...


def _num(x: float) -> float | str:
    """JSON-safe: non-finite floats as their name (``nan``, ``inf``)."""
    return x if math.isfinite(x) else str(x)


def explosion_causes(stats: UpdateSignals, cfg: GuardSettings) -> dict[str, float | str]:
    """Why an update counts as exploding (empty: it is healthy), as evidence for an audit record."""
    causes: dict[str, float | str] = {}
    if stats.skipped_steps > 0:
        causes["skipped_steps"] = stats.skipped_steps
    for name in ("policy_loss", "value_loss"):
        value = float(getattr(stats, name))
        if not math.isfinite(value) or abs(value) > cfg.explode_loss:
            causes[name] = _num(value)
    grad_norm = getattr(stats, "grad_norm", None)
    if grad_norm is not None and (not math.isfinite(float(grad_norm)) or float(grad_norm) > cfg.explode_grad_norm):
        causes["grad_norm"] = _num(float(grad_norm))
    return causes


@dataclass(frozen=True)
class Holder:
    """A version that held the best: the model version when the last-100 mean was ``mean``."""

    version: int
    mean: float
    update: int
    """The guard's count of observed updates when it was observed."""
    episodes: int = 0
    """Episodes seen when it was observed (its mean covers the ``return_window`` episodes before)."""


@dataclass(frozen=True)
class NotedRevision:
    """A runtime config revision that may be blamed for a fall (or an explosion) that begins later."""

    revision: int
    changed_keys: tuple[str, ...]
    episodes: int
    """Episodes seen when it was noted."""
    seq: int
    """Order among the guard's inputs (times may tie)."""
    holder: Holder | None
    """The newest holder when it was noted: the last version trained without it."""
    update: int = 0
    """The guard's count of observed updates when it was noted."""


@dataclass(frozen=True)
class Decision:
    """What the guard asks the trainer to do. ``to_version`` and ``remedy`` are set iff ``action`` is
    ``rollback``; ``revert_revision`` iff ``remedy`` is ``revert_config``; ``lr_factor`` is 1.0 unless
    ``remedy`` is ``lower_lr``. ``evidence`` is JSON-safe, for the ``auto_rollback`` audit record."""

    action: Literal["rollback", "exhausted"]
    reason: Literal["return_fall", "explosion"]
    to_version: int | None
    remedy: Literal["revert_config", "lower_lr"] | None
    revert_revision: int | None
    lr_factor: float
    evidence: dict[str, Any]


@dataclass(frozen=True)
class _Trigger:
    reason: Literal["return_fall", "explosion"]
    seq: int
    """When the fall or the streak began (the first observation of it)."""
    episodes: int
    holder: Holder | None
    """The holder a rollback for it restores: the newest one observed ``settle_updates`` before it began."""
    fallback: int | None
    """Explosions only: the last healthy update's version before the streak."""
    since: int
    """Episodes seen at the observation before the one that showed it: where blame is counted from. The
    update that shows a fall may bring a broken policy's short episodes by the hundred at once (CartPole at
    lr 1.0, 512 env steps an update, episodes of about 9 steps), and counting from after them would put the
    change that caused it outside ``blame_episodes`` (the likely cause of a failed fault-suite guard row)."""


class RollbackGuard:
    """Tracks the best last-100 return, falls, explosions and config revisions; decides rollbacks.

    Invariants: ``episodes_seen`` never decreases (a ValueError says so); a time earlier than one already
    seen is taken as that one; at most ``max_per_hour`` rollbacks are recorded in any hour; nothing is
    decided before ``cooldown_s`` has passed since the last rollback or when ``enabled`` is false.
    """

    def __init__(self, settings: GuardSettings, return_window: int = 100) -> None:
        self.cfg = settings
        self.return_window = return_window
        """Episodes the observed mean covers (the learner's ``trainer.return_window``, the last-100)."""
        self._now = -math.inf
        self._seq = 0
        self._updates = 0
        self._episodes: int | None = None
        self._mean: float | None = None
        self._version: int | None = None
        self._rollbacks: deque[float] = deque()
        self._cooldown_until = -math.inf
        self._exhausted_said = False
        self._last_healthy: int | None = None
        self._reset(None)

    def _reset(self, base_episodes: int | None) -> None:
        """Forget the tracked period: the best is tracked anew from ``base_episodes`` on."""
        self._base = base_episodes
        self.best: float | None = None
        self.best_version: int | None = None
        self._holders: deque[Holder] = deque()
        """Versions that hold the best, oldest first: from the newest one observed ``settle_updates``
        before now (or the oldest left) on; a rise of the best drops those that no longer hold it."""
        self._fall: _Trigger | None = None
        self._explosion: _Trigger | None = None
        self._explosions = 0
        self._causes: dict[str, float | str] = {}
        self._revisions: list[NotedRevision] = []

    def _tick(self, now: float) -> float:
        if math.isnan(now):
            raise ValueError(f"guard: the time must be a number, got {now=}")
        self._now = max(self._now, now)
        self._seq += 1
        return self._now

    # ---- inputs ----

    def observe_update(self, now: float, policy_version: int, last100_mean: float | None, episodes_seen: int,
                       stats: UpdateSignals) -> bool:
        """Record an update that produced ``policy_version``, with the learner's last-100 mean return (None:
        no episode yet) and the episodes it has counted so far. True when this version now holds the best
        (the shell keeps its weights: it is what a rollback would restore)."""
        if policy_version < 0 or episodes_seen < 0:
            raise ValueError(f"guard: negative input, got {policy_version=}, {episodes_seen=}")
        if self._episodes is not None and episodes_seen < self._episodes:
            raise ValueError(f"guard: episodes_seen went back from {self._episodes} to {episodes_seen} "
                             "(it must count every episode since the trainer started)")
        if last100_mean is not None and not math.isfinite(last100_mean):
            raise ValueError(f"guard: the last-100 mean must be finite, got {last100_mean=}")
        self._tick(now)
        self._updates += 1
        since = episodes_seen if self._episodes is None else self._episodes
        self._episodes, self._mean, self._version = episodes_seen, last100_mean, policy_version
        causes = explosion_causes(stats, self.cfg)
        if causes:
            if self._explosions == 0:
                self._explosion = _Trigger("explosion", self._seq, episodes_seen, self._settled(),
                                           self._last_healthy, since)
            self._explosions += 1
            self._causes = causes
        else:
            self._explosions, self._explosion, self._causes = 0, None, {}
            self._last_healthy = policy_version
        if self._base is None:
            self._base = episodes_seen
        holds = self._track_returns(policy_version, last100_mean, episodes_seen, since, healthy=not causes)
        self._prune_revisions()
        return holds

    def _track_returns(self, version: int, mean: float | None, episodes: int, since: int, healthy: bool) -> bool:
        assert self._base is not None
        if mean is None or episodes - self._base < self.cfg.min_episodes:
            return False
        if healthy and (self.best is None or mean > self.best):
            self.best, self.best_version = mean, version
            floor = mean - self.cfg.hold_tolerance
            self._holders = deque(h for h in self._holders if h.mean >= floor)
        if self.best is None:
            return False
        if mean < self.best - self.cfg.drop:
            if self._fall is None:
                self._fall = _Trigger("return_fall", self._seq, episodes, self._settled(), None, since)
        else:
            self._fall = None
        if healthy and mean >= self.best - self.cfg.hold_tolerance:
            self._holders.append(Holder(version, mean, self._updates, episodes))
            while len(self._holders) > 1 and self._holders[1].update <= self._updates - self.cfg.settle_updates:
                self._holders.popleft()  # a newer one is settled: no trigger from now on restores this one
            return True
        return False

    def _settled(self) -> Holder | None:
        """The newest holder observed at least ``settle_updates`` updates ago (none: the oldest)."""
        settled = [h for h in self._holders if h.update <= self._updates - self.cfg.settle_updates]
        return settled[-1] if settled else (self._holders[0] if self._holders else None)

    def note_config_revision(self, now: float, revision: int, changed_keys: Iterable[str],
                             automatic: bool = False) -> None:
        """A runtime config revision was applied. ``automatic``: written by the guard's own remedy (never
        blamed). A revision that changed nothing, or one already noted, is ignored."""
        self._tick(now)
        keys = tuple(sorted(changed_keys))
        if automatic or not keys or any(r.revision >= revision for r in self._revisions):
            return
        newest = self._holders[-1] if self._holders else None
        self._revisions.append(NotedRevision(revision, keys, self._episodes or 0, self._seq, newest, self._updates))

    def _prune_revisions(self) -> None:
        """Drop revisions that no fall or explosion, now or later, could be blamed on."""
        starts = [t.since for t in (self._fall, self._explosion) if t is not None]
        ref = min([*starts, self._episodes or 0])
        self._revisions = [r for r in self._revisions if ref - r.episodes <= self.cfg.blame_episodes]

    # ---- decisions ----

    def _trigger(self) -> _Trigger | None:
        if self._explosion is not None and self._explosions >= self.cfg.explode_updates:
            return self._explosion
        if self._fall is not None and (self._episodes or 0) - self._fall.episodes >= self.cfg.window:
            return self._fall
        return None

    def rollbacks_last_hour(self, now: float) -> int:
        while self._rollbacks and self._rollbacks[0] <= now - HOUR_S:
            self._rollbacks.popleft()
        return len(self._rollbacks)

    def decide(self, now: float) -> Decision | None:
        """A rollback to carry out now, one ``exhausted`` decision when the hour's rollbacks are spent (then
        None until one of them is an hour old), or None. Asking again before :meth:`rolled_back` returns
        the same rollback."""
        now = self._tick(now)
        if not self.cfg.enabled or now < self._cooldown_until:
            return None
        trigger = self._trigger()
        if trigger is None:
            return None
        spent = self.rollbacks_last_hour(now) >= self.cfg.max_per_hour
        decision = self._rollback(trigger, now)
        if not spent:
            self._exhausted_said = False
            return decision
        if self._exhausted_said:
            return None
        self._exhausted_said = True
        evidence = {**(decision.evidence if decision else self._evidence(trigger, None, None, now)),
                    "max_per_hour": self.cfg.max_per_hour}
        return Decision("exhausted", trigger.reason, None, None, None, 1.0, evidence)

    def _rollback(self, trigger: _Trigger, now: float) -> Decision | None:
        culprit = next((r for r in self._revisions
                        if r.seq < trigger.seq and trigger.since - r.episodes <= self.cfg.blame_episodes), None)
        target = trigger.holder
        if culprit is not None and culprit.holder is not None:
            # A version observed after the blamed revision restores only when its mean was made by episodes
            # played after the revision: the mean lags the weights by return_window episodes, so versions
            # trained under a harmful change post the old policy's returns (and new bests) for a while, and
            # restoring such a version does not bring the return back (docs/operations.md, the rollback guard).
            lagging = target is None or (target.update > culprit.update
                                         and target.episodes - culprit.episodes < self.return_window)
            if lagging or self._still_holds(culprit.holder):
                target = culprit.holder
        to_version = target.version if target is not None else trigger.fallback
        if to_version is None:
            return None
        evidence = self._evidence(trigger, target, culprit, now)
        evidence["to_version"] = to_version
        if culprit is not None:
            return Decision("rollback", trigger.reason, to_version, "revert_config", culprit.revision, 1.0, evidence)
        return Decision("rollback", trigger.reason, to_version, "lower_lr", None, self.cfg.lr_factor, evidence)

    def _still_holds(self, holder: Holder) -> bool:
        return self.best is not None and holder.mean >= self.best - self.cfg.hold_tolerance

    def _evidence(self, trigger: _Trigger, target: Holder | None, culprit: NotedRevision | None,
                  now: float) -> dict[str, Any]:
        episodes = self._episodes or 0
        return {
            "reason": trigger.reason,
            "best": self.best,
            "best_version": self.best_version,
            "to_version_mean": None if target is None else target.mean,
            "mean": self._mean,
            "policy_version": self._version,
            "drop": None if self.best is None or self._mean is None else self.best - self._mean,
            "drop_threshold": self.cfg.drop,
            "episodes_fallen": None if self._fall is None else episodes - self._fall.episodes,
            "window": self.cfg.window,
            "explosions": self._explosions,
            "explode_updates": self.cfg.explode_updates,
            "explosion_causes": dict(self._causes),
            "revision": None if culprit is None else culprit.revision,
            "changed_keys": [] if culprit is None else list(culprit.changed_keys),
            "episodes_seen": episodes,
            "rollbacks_last_hour": self.rollbacks_last_hour(now),
        }

    def rolled_back(self, now: float, decision: Decision) -> None:
        """The trainer carried ``decision`` out: the cooldown starts and the best is tracked anew from the
        restored version (the episodes seen so far do not count towards ``min_episodes``)."""
        if decision.action != "rollback" or decision.to_version is None:
            raise ValueError(f"guard: only a rollback decision can be carried out, got {decision.action=}")
        now = self._tick(now)
        self._rollbacks.append(now)
        self._cooldown_until = now + self.cfg.cooldown_s
        self._exhausted_said = False
        self._last_healthy = decision.to_version
        self._reset(self._episodes)

    def followed(self, version: int) -> None:
        """The trainer now runs ``version``'s weights after a rollback (the guard's own, carried out, or an
        operator's). Versions it observed above ``version`` were trained from abandoned weights, and the trainer
        numbers its next candidates from ``version`` on, so they must never be restored: the best is tracked
        anew from here (no cooldown starts: that belongs to the guard's own decisions)."""
        if version < 0:
            raise ValueError(f"guard: negative version, got {version=}")
        self._last_healthy = version
        self._reset(self._episodes)

    def restorable_versions(self) -> frozenset[int]:
        """Every version a decision could restore, now or from the state so far: the shell keeps their
        weights (published versions are pruned after ``paramsync.keep_versions``)."""
        holders = [*self._holders, *(r.holder for r in self._revisions)]
        holders += [t.holder for t in (self._fall, self._explosion) if t is not None]
        versions = {h.version for h in holders if h is not None}
        if self._explosion is not None and self._explosion.fallback is not None:
            versions.add(self._explosion.fallback)
        if self._last_healthy is not None:
            versions.add(self._last_healthy)
        return frozenset(versions)
