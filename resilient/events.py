"""Structured events: what happened, when, and why.

An :class:`EventLog` keeps events in memory, mirrors them to the ``logging``
module and, when given a path, appends them as JSON lines so that an
operator (and later the agent and the goodput ledger) can read them back.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("resilient")

_WARNING_KINDS = frozenset(
    {
        "checkpoint_failed",
        "checkpoint_quarantined",
        "checkpoint_fallback",
        "checkpoint_conflict",
        "checkpoint_fenced",
    }
)


@dataclass(frozen=True)
class Event:
    """One thing that happened to the run."""

    kind: str
    wall_time: float
    fields: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({"kind": self.kind, "time": self.wall_time, **self.fields}, default=str)


class EventLog:
    """Thread-safe, append-only event record."""

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self._path = os.fspath(path) if path is not None else None
        self._events: list[Event] = []
        self._lock = threading.Lock()

    def emit(self, kind: str, **fields: Any) -> Event:
        event = Event(kind=kind, wall_time=time.time(), fields=fields)
        with self._lock:
            self._events.append(event)
            if self._path is not None:
                os.makedirs(os.path.dirname(self._path) or ".", exist_ok=True)
                with open(self._path, "a", encoding="utf-8") as f:
                    f.write(event.to_json() + "\n")
        level = logging.WARNING if kind in _WARNING_KINDS else logging.INFO
        logger.log(level, "%s %s", kind, fields)
        return event

    def of_kind(self, kind: str) -> list[Event]:
        with self._lock:
            return [e for e in self._events if e.kind == kind]

    def all(self) -> list[Event]:
        with self._lock:
            return list(self._events)
