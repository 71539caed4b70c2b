"""The agent's incidents after they are recorded: the restart's restore and an in-process recovery appended.

Every incident goes through :meth:`IncidentBook.record` (its file, event,
store copy and count).  The incident a restart answers gets what the next
generation restored (:meth:`restored`); one an in-process recovery answers
gets how that recovery completed (:meth:`recovered`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from ..coord.proof import SignedStore
from ..core.events import Emit, EventKind
from .incidents import Incident, format_incident, publish_incident
from .restores import RestoreSummary
from .rundir import RunDir


def record_incident(incident: Incident, run_dir: RunDir, store: SignedStore, emit: Emit) -> None:
    """Write the incident file, its event, and its run-wide copy in the store; print it with its consequences."""
    path = publish_incident(incident, run_dir, store, emit)
    emit(EventKind.INCIDENT, path=str(path), **incident.event_fields())
    print(format_incident(incident, path), file=sys.stderr, flush=True)


class IncidentBook:
    """Records incidents and appends to them what their recovery did."""

    def __init__(self, run_dir: RunDir, store: SignedStore, emit: Emit, *, counted: Callable[[str], None],
                 restore_shown: Callable[[dict[str, Any]], None]) -> None:
        self._run_dir = run_dir
        self._store = store
        self._emit = emit
        self._counted = counted
        self._restore_shown = restore_shown
        self.restart_incident: Incident | None = None
        """The incident of the failure that the next generation restarts after (it gets the restore appended)."""
        self._open: dict[str, Incident] = {}
        """Incidents an in-process recovery is answering: the record of its completion is appended."""

    def record(self, incident: Incident) -> None:
        """Its file, event and store copy, and its count in the metrics."""
        record_incident(incident, self._run_dir, self._store, self._emit)
        self._counted(incident.kind)

    def record_open(self, incident: Incident) -> None:
        """Record an incident an in-process recovery answers."""
        self._open[incident.id] = incident
        self.record(incident)

    def recovered(self, incident_id: str, record: dict[str, Any]) -> None:
        incident = self._open.pop(incident_id, None)
        if incident is not None:
            publish_incident(incident.with_recovery(record), self._run_dir, self._store, self._emit)

    def restored(self, summary: RestoreSummary) -> None:
        """Say what a generation restored: console, event, status, and the incident whose restart it was."""
        record = summary.record()
        incident, self.restart_incident = self.restart_incident, None
        self._restore_shown(record)
        self._emit(EventKind.RESTORED, incident=incident.id if incident else None,
                   **{k: v for k, v in record.items() if k != "node"})
        print(f"resilient: {summary.line}", file=sys.stderr, flush=True)
        if incident is not None and incident.generation < summary.generation:
            publish_incident(incident.with_restore(record), self._run_dir, self._store, self._emit)
