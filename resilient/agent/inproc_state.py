"""What the agent's in-process recovery keeps between ticks (:mod:`resilient.agent.inproc`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Recovering:
    """An in-process recovery under way: a generation published, its members not all rejoined yet."""

    generation: int
    rung: str
    """``retry_in_place``, ``promote_spare``, ``shrink`` (after a failure) or ``grow`` (at a step boundary)."""
    world_size: int
    promotions: tuple[tuple[int, str], ...]
    """(rank, spare id) of each spare that takes a rank."""
    dropped: tuple[int, ...]
    members: Mapping[str, int]
    """Worker id -> new rank."""
    detected_at: float
    """Agent clock when the failure was seen (for a grow: when it was decided)."""
    deadline: float
    incident_id: str | None
    step: int
    """The step whose attempt failed (for a grow: the boundary's step)."""

    def record(self, took: float, reports: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
        """The completed recovery for the event and the incident: ``took`` seconds, the members' ``rejoined``."""
        completed = sorted({int(rep.get("completed", -1)) for rep in reports.values()})
        slowest = max(reports.values(), key=lambda rep: float((rep.get("seconds") or {}).get("total") or 0.0))
        return {
            "rung": self.rung, "generation": self.generation, "world_size": self.world_size,
            "promotions": [{"rank": rank, "spare": spare} for rank, spare in self.promotions],
            "dropped_ranks": list(self.dropped), ("at_step" if self.rung == "grow" else "failed_step"): self.step,
            "resumed_after_step": completed[0] if len(completed) == 1 else completed,
            "seconds": round(took, 6), "slowest": {"worker": slowest.get("worker"), "rank": slowest.get("rank"),
                                                    "seconds": slowest.get("seconds")},
            "incident": self.incident_id,
        }


@dataclass
class SpareState:
    """What the agent knows about one spare process."""

    worker_id: str
    started_at: float
    ready_at: float | None = None


@dataclass
class Reports:
    """Worker ``recovery`` messages, by worker id (written on receiver threads, read under the lock)."""

    ready: dict[str, tuple[float, dict[str, Any]]] = field(default_factory=dict)
    waiting: dict[tuple[int, str], tuple[float, dict[str, Any]]] = field(default_factory=dict)
    """(generation that failed, worker) -> the survivor's report that it left the group and waits."""
    rejoined: dict[tuple[int, str], tuple[float, dict[str, Any]]] = field(default_factory=dict)


def clean_position(report: Mapping[str, Any]) -> bool:
    """Whether a member's ``waiting`` report says it failed before the optimizer's update (its state is the
    step's start, a valid source); one that failed inside or after the update is dirty.  A report without a
    position (a worker of an older version) says nothing against its rank."""
    return report.get("position", "before") == "before"
