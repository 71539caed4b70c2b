"""What the agent knows about its ranks, from their heartbeats.

Heartbeats arrive on the receiver's thread; the supervisor reads on its own.
The tracker keeps, per rank of the current generation, the section it is in
and since when (the agent's clock, at receipt), feeds finished section
durations into the calibration statistics, and remembers the newest
committed checkpoint step any worker has reported, and what each rank
reported it restored (a ``restored`` message; the ledger never sees those).

Only heartbeats of the current generation count: one that carries another
generation (or none), or comes from a pid that is not this generation's
worker of that rank, is stale.  Stale heartbeats are counted, reported once
per (pid, generation) through ``on_stale``, and change nothing: neither the
hang timers, nor the calibration, nor (through :class:`HeartbeatIntake`)
the goodput ledger.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ..core.events import Emit, EventKind
from ..watchdog.sections import RankView, SectionStats, observe
from .heartbeat import Heartbeat

if TYPE_CHECKING:
    from .accounting import NodeAccounting


@dataclass(frozen=True)
class RankInfo:
    """The latest known state of one rank."""

    rank: int
    pid: int
    section: str
    step: int
    entered_at: float
    last_seen: float
    heartbeats: int = 0


StaleCallback = Callable[[Heartbeat, "int | None"], None]
"""``on_stale(heartbeat, current_generation)``: called once per stale (pid, generation)."""


def stale_events(emit: Emit) -> StaleCallback:
    """The agent's ``on_stale``: a ``stale_heartbeat`` event for each stale (pid, generation)."""

    def on_stale(hb: Heartbeat, current: int | None) -> None:
        emit(EventKind.STALE_HEARTBEAT, pid=hb.pid, rank=hb.rank, generation=hb.generation, current_generation=current,
             reason="not from this generation's worker: ignored by hang detection and the ledger")

    return on_stale


class RankTracker:
    """Thread-safe table of ranks for the running generation plus calibration statistics."""

    def __init__(self, on_stale: StaleCallback | None = None) -> None:
        self._lock = threading.Lock()
        self._ranks: dict[int, RankInfo] = {}
        self._pids: dict[int, int] = {}
        self._carried: frozenset[int] = frozenset()
        self._previous: int | None = None
        self._generation: int | None = None
        self._on_stale = on_stale
        self._stale_seen: set[tuple[int, int | None]] = set()
        self.stale_heartbeats = 0
        """Heartbeats ignored because they were not from the current generation's workers."""
        self.stats = SectionStats()
        self.committed_step: int | None = None
        self.checkpoint_location: str | None = None
        self.max_step = 0
        self.total_steps: int | None = None
        """The steps the training loop runs in all (``Run.steps(total)``, from the ranks' timing windows);
        None until a window said so, or for a loop without an end."""
        self._restores: dict[int, dict[str, Any]] = {}

    @property
    def generation(self) -> int | None:
        return self._generation

    def start_generation(self, pids: Mapping[int, int], now: float, generation: int,
                         carried: frozenset[int] = frozenset()) -> None:
        """Forget the old ranks; the new ones (rank -> pid of ``generation``) are in "init" since ``now``.

        ``carried``: pids an in-process change kept from the previous generation.  Their heartbeats of the
        previous generation still count when they keep their rank (members of a world that grows go on
        training until the boundary where they join the new generation); other old heartbeats of theirs
        (still queued when a failure struck, or from a rank since renumbered) are stale but not reported.
        """
        with self._lock:
            self._carried = carried
            self._previous = self._generation
            self._generation = generation
            self._pids = dict(pids)
            self._ranks = {r: RankInfo(r, pid, "init", 0, now, now) for r, pid in pids.items()}
            self._restores = {}

    def on_heartbeat(self, hb: Heartbeat, received_at: float) -> bool:
        """Take one heartbeat; False (and nothing changes) when it is stale (see the module docstring)."""
        with self._lock:
            counts = hb.generation == self._generation or (
                hb.pid in self._carried and hb.generation is not None and hb.generation == self._previous)
            if hb.generation is None or not counts or self._pids.get(hb.rank) != hb.pid:
                self.stale_heartbeats += 1
                # A member of this generation carried over from the previous one by an in-process recovery
                # may still have that generation's heartbeats queued: counted, not reported.
                carried = hb.pid in self._carried and hb.generation is not None \
                    and self._generation is not None and hb.generation < self._generation
                first = (hb.pid, hb.generation) not in self._stale_seen and not carried
                self._stale_seen.add((hb.pid, hb.generation))
                current = self._generation
            else:
                return self._take(hb, received_at)
        if first and self._on_stale is not None:
            self._on_stale(hb, current)  # outside the lock: it may log and write events
        return False

    def _take(self, hb: Heartbeat, received_at: float) -> bool:
        """Apply a heartbeat of the current generation (the lock is held)."""
        if hb.checkpoint:
            self.checkpoint_location = hb.checkpoint
        if hb.committed_step is not None and (self.committed_step is None or hb.committed_step > self.committed_step):
            self.committed_step = hb.committed_step
        self.max_step = max(self.max_step, hb.step)
        old = self._ranks.get(hb.rank)
        if old is None:
            return False
        if hb.kind == "restored":  # a report, not a section entry: the hang timers and calibration stay as they are
            if hb.restored is not None:
                self._restores[hb.rank] = dict(hb.restored)
            return True
        if hb.kind == "bye":
            self._ranks[hb.rank] = replace(old, section="exiting", last_seen=received_at,
                                           entered_at=received_at, heartbeats=old.heartbeats + 1)
            return True
        if hb.section != old.section or hb.step != old.step:
            self.stats = observe(self.stats, old.section, max(0.0, received_at - old.entered_at))
            self._ranks[hb.rank] = RankInfo(hb.rank, hb.pid, hb.section, hb.step, received_at, received_at,
                                            old.heartbeats + 1)
        else:
            self._ranks[hb.rank] = replace(old, last_seen=received_at, heartbeats=old.heartbeats + 1)
        return True

    def is_current(self, hb: Heartbeat) -> bool:
        """Whether ``hb`` comes from this generation's worker of its rank (nothing is recorded)."""
        with self._lock:
            return hb.generation is not None and hb.generation == self._generation and self._pids.get(hb.rank) == hb.pid

    def ranks(self) -> dict[int, RankInfo]:
        with self._lock:
            return dict(self._ranks)

    def restores(self) -> tuple[tuple[int, ...], dict[int, dict[str, Any]]]:
        """This generation's ranks, and what each that reported its restore restored (see the protocol)."""
        with self._lock:
            return tuple(sorted(self._pids)), dict(self._restores)

    def views(self) -> dict[int, RankView]:
        """The ranks as the hang policy sees them (ranks that said goodbye are not watched)."""
        with self._lock:
            return {r: RankView(section=i.section, step=i.step, entered_at=i.entered_at, pid=i.pid)
                    for r, i in self._ranks.items() if i.section != "exiting"}


class HeartbeatIntake:
    """The receivers' callback: the tracker decides whether a heartbeat counts, the ledger gets only those."""

    def __init__(self, tracker: RankTracker, accounting: NodeAccounting,
                 on_recovery: Callable[[Heartbeat, float], None] | None = None,
                 on_report: Callable[[Heartbeat], None] | None = None,
                 on_notice: Callable[[Heartbeat], None] | None = None) -> None:
        self.tracker = tracker
        self.accounting = accounting
        self.on_recovery = on_recovery
        """Takes ``recovery`` messages (in-process recovery's reports); they never reach the tracker or ledger."""
        self.on_report = on_report
        """Takes the current workers' ``timing`` (step time by section) and ``audit`` (replica audit) reports;
        not section entries either."""
        self.on_notice = on_notice
        """Takes the current workers' ``notice`` messages (what the agent says on its console and in status)."""

    def __call__(self, hb: Heartbeat, received_at: float) -> None:
        if hb.kind == "recovery":  # from a spare (no rank yet) as much as from a member: not a section entry
            if self.on_recovery is not None:
                self.on_recovery(hb, received_at)
            return
        if hb.kind == "notice":
            if self.on_notice is not None and self.tracker.is_current(hb):
                self.on_notice(hb)
            return
        if hb.kind in ("timing", "audit"):
            if not self.tracker.is_current(hb):
                return
            total = (hb.timing or {}).get("total")
            if isinstance(total, int) and not isinstance(total, bool) and total >= 0:
                self.tracker.total_steps = total
            if self.on_report is not None:
                self.on_report(hb)
            return
        if self.tracker.on_heartbeat(hb, received_at) and hb.kind != "restored":
            self.accounting.heartbeat(received_at, hb.kind, hb.rank, hb.section, hb.step, hb.tokens, hb.samples,
                                      hb.committed_step, hb.save)
