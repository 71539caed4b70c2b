"""The watch loop's two entry points into in-process recovery, on one machine or across machines.

On one machine the ladder is asked here (:mod:`resilient.agent.continuation`); across machines every agent
reports its losses through the store and one of them decides (:mod:`resilient.agent.cluster_flow`).  Both
build on :mod:`~resilient.agent.continuation`'s pieces; this module, above both, picks one.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..elastic.decide import RecoveryDecision
from ..elastic.observe import FaultKind
from .cluster_flow import report_lost, tick
from .continuation import continue_locally, follow_locally, start_spares
from .launcher import WorkerGroup
from .outcome import Hold, Outcome
from .policy import Failure
from .rendezvous import Assignment

if TYPE_CHECKING:
    from .context import GenerationContext
    from .incidents import Incident


def continue_after(ctx: GenerationContext, group: WorkerGroup, a: Assignment, gdir: Path, *,
                   lost: dict[int, str], kind: FaultKind, failure: Failure, exit_codes: tuple[int, ...],
                   incident: Incident, detected_at: float, last_progress_at: float,
                   hold: Hold | None = None) -> Assignment | Hold | RecoveryDecision | None:
    """Recover in process from losing ``lost`` (rank -> worker id) if the ladder can.

    Returns the new assignment (the generation goes on), a :class:`Hold`
    (decide again on a later tick), the ladder's decision to restart or stop
    (end the generation as a failure; the incident records it), or None when
    in-process recovery is not on offer.
    """
    inp = ctx.inproc
    if inp is None:
        return None
    start_spares(ctx, group, a, gdir)  # a failure before the workers had restored: the spares start now
    if inp.cluster is not None:  # across machines the decision goes through the store
        return hold or report_lost(ctx, group, a, lost=lost, kind=kind, failure=failure, incident=incident,
                                   exit_codes=exit_codes, detected_at=detected_at, last_progress_at=last_progress_at)
    return continue_locally(ctx, group, a, gdir, lost=lost, kind=kind, failure=failure, exit_codes=exit_codes,
                            incident=incident, detected_at=detected_at, last_progress_at=last_progress_at, hold=hold)


def follow(ctx: GenerationContext, group: WorkerGroup, a: Assignment, gdir: Path,
           now: float) -> str | Assignment | Outcome | None:
    """One tick of in-process bookkeeping: why the generation must end as a failure, its new assignment
    (it grew back, or, across machines, a decision was carried out), how it ends otherwise, or None."""
    inp = ctx.inproc
    if inp is None:
        return None
    if inp.cluster is not None:
        moved = tick(ctx, group, a, gdir, now)
        if moved is not None:
            return moved
    return follow_locally(ctx, group, a, gdir, now)
