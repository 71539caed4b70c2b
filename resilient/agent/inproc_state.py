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
