"""What the workers' Runs tell the agent to say: on its console, in ``resilient status``, in its ledger.

A Run sends a ``notice`` heartbeat (:mod:`resilient.worker.protocol`) when it
finds something an operator must see without opening a rank's log:

- ``config_changed``: the checkpoint it restored was written under another
  config; the console names the keys that changed (once per checkpoint);
- ``resume_diverged``: the first step after its restore was not where the
  saving run had been (:mod:`resilient.run.resume`).  A run that stops on it
  is reported by its incident; one that accepts it (``--resume-check
  accept``) is said here and recorded in the ledger, whose report then says
  from which step the run is not the one that never stopped;
- ``integration``: what the script lets each rung of recovery do
  (:mod:`resilient.run.integration`), said once per run by the lowest rank.

Notices arrive on the receivers' threads; :meth:`Notices.view` is what
``status.json`` shows.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import IO, Any

from ..core.events import Emit, EventKind
from .integration import Offers, describe

MAX_KEPT = 20
"""Notices of each kind kept for ``resilient status`` (the newest)."""


class Notices:
    """The notices this node's workers sent: said once each, kept for status, the accepted divergences ledgered."""

    def __init__(self, emit: Emit, resume_accepted: Callable[[int], None], offers: Offers, *,
                 console: IO[str] | None = None) -> None:
        self._emit = emit
        self._offers = offers
        """What this agent offers a run: the integration line weighs the script's facts against it."""
        self._resume_accepted = resume_accepted
        """Records an accepted diverged resume at a step in the node's ledger."""
        self._console = console
        self._lock = threading.Lock()
        self._said: set[tuple[Any, ...]] = set()
        self._kept: dict[str, list[dict[str, Any]]] = {}
        self.integration: dict[str, Any] | None = None
        """The newest ``integration`` notice (the rungs this run's script allows), for status."""

    def take(self, rank: int, generation: int | None, notice: dict[str, Any]) -> None:
        """One notice from ``rank`` (receiver thread)."""
        kind = str(notice.get("kind"))
        entry = {**notice, "rank": rank, "generation": generation}
        if kind == "integration":
            entry["line"] = describe(notice, self._offers)
        with self._lock:
            kept = self._kept.setdefault(kind, [])
            kept.append(entry)
            del kept[:-MAX_KEPT]
            key = self._once_key(kind, entry)
            first = key not in self._said
            self._said.add(key)
            if kind == "integration":
                self.integration = entry
        if kind == EventKind.RESUME_DIVERGED.value and notice.get("accepted") and first:
            self._resume_accepted(int(notice.get("step") or 0))
        if first:
            line = say(kind, entry)
            if line is not None:
                print(f"resilient: {line}", file=self._console or sys.stderr, flush=True)

    @staticmethod
    def _once_key(kind: str, entry: dict[str, Any]) -> tuple[Any, ...]:
        """Notices said once: a config change per checkpoint, a diverged resume per generation and rank, the
        integration once per run."""
        if kind == EventKind.CONFIG_CHANGED.value:
            return (kind, entry.get("checkpoint"))
        if kind == "integration":
            return (kind,)
        return (kind, entry.get("generation"), entry.get("rank"))

    def view(self) -> dict[str, Any]:
        with self._lock:
            return {kind: list(entries) for kind, entries in self._kept.items()}


def say(kind: str, notice: dict[str, Any]) -> str | None:
    """The console line for a notice; None for one the console does not show (a stopping divergence: its
    incident says it)."""
    rank = notice.get("rank")
    if kind == EventKind.CONFIG_CHANGED.value:
        changed = notice.get("changed") or {}
        what = ", ".join(f"{k} {v[0]!r} -> {v[1]!r}" for k, v in sorted(changed.items())) if changed else \
            "its config digest differs"
        return (f"rank {rank} resumed from {notice.get('checkpoint')}, which was saved under another config: {what} "
                "(config_changed)")
    if kind == EventKind.RESUME_DIVERGED.value:
        if not notice.get("accepted"):
            return None
        return (f"rank {rank} resumed from {notice.get('checkpoint')} at step {notice.get('step')} elsewhere than the "
                f"saving run was: {', '.join(notice.get('moved') or [])} moved; accepted (--resume-check accept): "
                "from this step the run is not the one that never stopped (resume_diverged)")
    if kind == "integration":
        return str(notice.get("line")) if notice.get("line") else None
    return None
