"""What the agent knows about its ranks, from their heartbeats.

Heartbeats arrive on the receiver's thread; the supervisor reads on its own.
The tracker keeps, per rank of the current generation, the section it is in
and since when (the agent's clock, at receipt), feeds finished section
durations into the calibration statistics, and remembers the newest
committed checkpoint step any worker has reported.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, replace

from ..watchdog.sections import RankView, SectionStats, observe
from .heartbeat import Heartbeat


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


class RankTracker:
    """Thread-safe table of ranks for the running generation plus calibration statistics."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ranks: dict[int, RankInfo] = {}
        self._pids: dict[int, int] = {}
        self.stats = SectionStats()
        self.committed_step: int | None = None
        self.checkpoint_location: str | None = None
        self.max_step = 0

    def start_generation(self, pids: Mapping[int, int], now: float) -> None:
        """Forget the old ranks; the new ones are in "init" since ``now``."""
        with self._lock:
            self._pids = dict(pids)
            self._ranks = {r: RankInfo(r, pid, "init", 0, now, now) for r, pid in pids.items()}

    def on_heartbeat(self, hb: Heartbeat, received_at: float) -> bool:
        """Take one heartbeat; False when it comes from a worker of an earlier generation."""
        with self._lock:
            if self._pids.get(hb.rank) != hb.pid:
                return False  # a worker of an earlier generation, still shutting down
            if hb.checkpoint:
                self.checkpoint_location = hb.checkpoint
            if hb.committed_step is not None and (self.committed_step is None
                                                  or hb.committed_step > self.committed_step):
                self.committed_step = hb.committed_step
            self.max_step = max(self.max_step, hb.step)
            old = self._ranks.get(hb.rank)
            if old is None:
                return False
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

    def ranks(self) -> dict[int, RankInfo]:
        with self._lock:
            return dict(self._ranks)

    def views(self) -> dict[int, RankView]:
        """The ranks as the hang policy sees them (ranks that said goodbye are not watched)."""
        with self._lock:
            return {r: RankView(section=i.section, step=i.step, entered_at=i.entered_at, pid=i.pid)
                    for r, i in self._ranks.items() if i.section != "exiting"}
