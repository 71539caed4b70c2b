"""Acting on a persistent straggler on this node: weigh it (:func:`~resilient.elastic.evict.decide_eviction`),
and when replacing or dropping it costs less than keeping it, end its process and let the ladder recover.

The watch loop hands over each straggler flag that stood ``EvictConfig.after_windows`` windows (and again
every as many windows while it stands).  The ladder is asked first what it would do on losing the rank
(:meth:`~resilient.agent.inproc.InProcess.preview`, reported nowhere): only a promotion or a shrink in
process is an option, so a rank is never ended for a restart, a hold for a spare that is not there, or a
stop.  The case is built from this window's numbers (the rank's and its peers' seconds per step, the job's
step, the steps left) and the ladder's answer; every decision is a ``straggler_decided`` event with its
reason.  To act, the agent SIGKILLs the rank's process and hands the loss to the ladder, as for a hung
rank; the incident (kind ``straggler``) carries the decision and, once done, how the recovery completed.
Across machines the ladder is asked over every node's members and the pool's spares in the store
(:func:`~resilient.agent.cluster_decide.preview`), and the eviction goes through the store like any lost
member: the agent that wins the generation's claim decides, as for a crash.
"""

from __future__ import annotations

import signal
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..coord.store import ControlStoreError
from ..core.events import EventKind, OutcomeKind
from ..elastic.decide import Action
from ..elastic.evict import StragglerCase, decide_eviction
from ..elastic.observe import FaultKind
from .cluster_decide import preview
from .incidents import Incident
from .launcher import WorkerGroup
from .outcome import Hold, Outcome
from .policy import Failure
from .recover import continue_after
from .rendezvous import Assignment

if TYPE_CHECKING:
    from .context import GenerationContext


def weigh_straggler(ctx: GenerationContext, group: WorkerGroup, a: Assignment, gdir: Path, flag: dict[str, Any],
                    now: float) -> Assignment | Hold | Outcome | None:
    """Decide on a persistent straggler of this node and carry it out.  None: kept (or no longer there); else
    what became of its eviction: the generation going on (an assignment, or a hold), or ended (an outcome,
    when the ladder answered restart or stop after all)."""
    rank = int(flag["rank"])
    worker = group.workers.get(rank)
    inproc, slowness = ctx.inproc, ctx.slowness
    if flag.get("generation") != a.generation or worker is None or worker.exit is not None or inproc is None \
            or slowness is None:
        return None
    info = ctx.tracker.ranks().get(rank)
    section, step = (info.section, info.step) if info is not None else (None, None)
    failure = Failure(kind="straggler", rank=rank, node=ctx.config.node_id, section=section, step=step, time=now)
    ranks = ctx.tracker.ranks()
    survivors = {r: ranks[r].step for r in group.workers if r != rank and r in ranks}
    at = max([*survivors.values(), *([step] if step is not None else [])], default=0)
    lost = {rank: worker.worker_id}
    if inproc.cluster is not None:  # across machines: the ladder over every node's members and the pool's spares
        try:
            ladder, world, opted = preview(ctx, a, lost, FaultKind.STRAGGLER, replace(failure, step=at))
        except ControlStoreError as e:  # weighed again at the flag's next due window
            ctx.emit(EventKind.STORE_UNREACHABLE, error=f"{type(e).__name__}: {e}")
            return None
    else:
        ladder = inproc.preview(group, lost, FaultKind.STRAGGLER, at, (), failure, ctx.generations.restarts(),
                                survivors)
        world, opted = len(group.workers), inproc.opted_in([w.worker_id for w in group.workers.values()])
    case = StragglerCase(
        rank=rank, section=str(flag["section"]), rank_s=float(flag["rank_s"]), peers_s=float(flag["peers_s"]),
        step_s=float(flag["job_step_s"]), world=world, remaining_steps=flag.get("remaining_steps"),
        spares_ready=len(ladder.promotions) if ladder.action is Action.PROMOTE_SPARE else 0,
        can_shrink=ladder.action is Action.SHRINK, evictions_done=slowness.evictions_done, opted_in=opted,
        ladder=f"the ladder would {ladder.action.value}: {ladder.reason}")
    decision = decide_eviction(case, inproc.costs(), ctx.config.evict)
    ctx.emit(EventKind.STRAGGLER_DECIDED, generation=a.generation, rank=rank, section=case.section,
             action=decision.action, reason=decision.reason, lost_s=round(decision.lost_s, 6),
             remaining_steps=decision.remaining_steps, saved_s=round(decision.saved_s, 3),
             cost_s=round(decision.cost_s, 3), ladder=ladder.action.value)
    if decision.action == "keep":
        return None
    slowness.evictions_done += 1
    failure = replace(failure, detail=decision.reason)
    incident = Incident(
        id=f"g{a.generation:04d}-{ctx.config.node_id}-evict-r{rank}", node=ctx.config.node_id,
        generation=a.generation, kind="straggler", rank=rank, pid=worker.pid, section=section, step=step,
        summary=decision.reason, performance={**flag, "decision": decision.action, "saved_s": decision.saved_s,
                                              "cost_s": decision.cost_s})
    last_progress = info.last_seen if info is not None else now
    worker.signal(signal.SIGKILL)
    try:
        worker.proc.wait(timeout=ctx.config.stop_grace_s)
    except subprocess.TimeoutExpired:  # SIGKILL did not end it: the group stop reports it as stuck
        group.stop(ctx.config.stop_grace_s)
        return Outcome(OutcomeKind.FAILED, failure.describe(), failure, incident, detected_at=now,
                       last_progress_at=last_progress)
    ended = continue_after(ctx, group, a, gdir, lost=lost, kind=FaultKind.STRAGGLER,
                           failure=failure, exit_codes=(), incident=incident, detected_at=now,
                           last_progress_at=last_progress)
    if isinstance(ended, (Assignment, Hold)):
        return ended
    # Restart or stop after all (the spare was lost meanwhile): end the generation on this failure, as a hang does.
    group.stop(ctx.config.stop_grace_s)
    return Outcome(OutcomeKind.FAILED, failure.describe(), failure,
                   replace(incident, ladder=ended.to_event() if ended is not None else None),
                   detected_at=now, last_progress_at=last_progress, decision=ended)
