"""A generation that goes on after a failure, on one machine: the watch loop's side of in-process recovery.

:mod:`resilient.agent.generation` calls in here, directly or through :mod:`resilient.agent.recover` (which
sends the decisions of a run across machines to :mod:`resilient.agent.cluster_flow` instead):

* :func:`start_spares` with the run's first workers, once the workers of a restart have
  restored (or at its first failure, if that comes sooner), and after each
  promotion, to keep ``--spares`` warm processes (each on a heartbeat socket
  slot no live process uses);
* :func:`continue_locally` when members were lost (exited, or a hung rank the
  agent killed): it takes the one decision on the failure
  (:func:`resilient.agent.decision.decide`, through
  :class:`~resilient.agent.inproc.InProcess`) and either carries out a
  promotion or a shrink, records the incident with that decision and returns
  the generation's new :class:`Assignment`, or returns the decision to
  restart or stop: the generation ends as a failure and the lifecycle carries
  that decision out;
* :func:`follow_locally` on every tick: spares that exited, the members' progress
  through a recovery under way (every member ``rejoined``: the recovery is
  complete; a deadline passed: a failure), a hold for a spare
  (``wait_for_repair``) that must be decided again.

The pieces a run across machines shares (:func:`continue_as`, :func:`grow_boundary`, :func:`joiners_waiting`)
live here too; nothing here imports the cross-machine flow.
"""

from __future__ import annotations

import math
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.events import EventKind
from ..elastic.decide import Action, RecoveryDecision
from ..elastic.observe import FaultKind
from ..worker import standby
from .inproc import ACTING
from .inproc_grow import carry_out_grow, consider_grow
from .inproc_state import Recovering
from .launcher import WorkerGroup, WorkerSpec
from .outcome import Hold, Outcome, settle_s
from .policy import Failure
from .rendezvous import Assignment
from .worker_env import base_env, worker_env

if TYPE_CHECKING:
    from .context import GenerationContext
    from .incidents import Incident


SPARE_FAILURES_TO_GIVE_UP = 2
"""Spares that exit before they are ready, in a row, after which the agent stops starting them."""


def spare_spec(ctx: GenerationContext, a: Assignment, gdir: Path, slot: int, worker_id: str,
               attempt: int) -> WorkerSpec:
    """A spare's process on its own socket slot: it waits for its promotion before the script starts
    (:mod:`resilient.worker.standby`), and the script then starts with the rank it was given.  Its ``LOCAL_RANK``
    is its slot (the device it would use on this node)."""
    c = ctx.config
    assert ctx.inproc is not None
    base = {k: v for k, v in base_env(c).items() if k not in RANK_VARIABLES}
    env = {**base, "LOCAL_RANK": str(slot), "LOCAL_WORLD_SIZE": str(c.nproc_per_node + c.spares),
           **worker_env(c, ctx.run_dir, ctx.launch_id, a.generation, attempt, slot, gdir, worker_id),
           **ctx.inproc.worker_env(worker_id, "spare")}
    return WorkerSpec(local_rank=slot, rank=-1, argv=standby.command(c.entrypoint), env=env,
                      log_file=gdir / f"{worker_id}.log", echo=c.echo_output, worker_id=worker_id, slot=slot,
                      nice=ctx.inproc.spare_nice)


RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                  "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RESILIENT_PROMOTED")
"""What names a process's place in the world: a spare inherits none of them from the agent's environment."""


def start_spares(ctx: GenerationContext, group: WorkerGroup, a: Assignment, gdir: Path) -> None:
    """Start spares until ``--spares`` of them live, each on a free heartbeat socket slot."""
    inp = ctx.inproc
    if inp is None or inp.spare_failures >= SPARE_FAILURES_TO_GIVE_UP or inp.declined is not None:
        return
    c = ctx.config
    # A shrunk world's missing ranks are refilled too (a replacement process, warm like a spare), so that it
    # can grow back; their slots are the ones the lost processes left.
    want = c.spares + (c.nproc_per_node - len(group.workers) if c.shrinkable or c.multi_node else 0)
    slots = set(range(c.nproc_per_node + c.spares))
    while len(group.spares) < want:
        free = sorted(slots - {w.spec.slot for w in group.workers.values()} - {w.spec.slot for w in group.spares.values()})
        if not free:
            return
        worker_id = inp.new_worker_id("spare")
        worker = group.start_spare(spare_spec(ctx, a, gdir, free[0], worker_id, group.attempt))
        inp.spare_started(worker_id, worker.pid, a.generation)


def continue_locally(ctx: GenerationContext, group: WorkerGroup, a: Assignment, gdir: Path, *,
                     lost: dict[int, str], kind: FaultKind, failure: Failure, exit_codes: tuple[int, ...],
                     incident: Incident, detected_at: float, last_progress_at: float,
                     hold: Hold | None = None) -> Assignment | Hold | RecoveryDecision | None:
    """:func:`~resilient.agent.recover.continue_after` on one machine (its answers, or None when no member
    survives): the survivors settle, the ladder decides, and a rung that acts is carried out here."""
    inp = ctx.inproc
    assert inp is not None
    # Members that died since the failure was read (ranks lost together, a moment apart) are lost with it: a dead
    # member is no survivor, whose last heartbeat would be taken for its step.
    gone = {r: (w.worker_id, w.exit.returncode) for r, w in group.workers.items()
            if r not in lost and w.exit is not None and w.exit.returncode != 0}
    if gone:
        lost = {**lost, **{r: worker for r, (worker, _) in gone.items()}}
        exit_codes = (*exit_codes, *(code for _, code in gone.values() if code > 0))
    if not any(r not in lost for r in group.workers):
        return None
    if inp.recovering is not None:  # a failure while the previous recovery was under way: fold it into this one
        inp.abandon_recovery(another_failure=True)
    now = ctx.clock()
    live = [w.worker_id for r, w in group.workers.items() if r not in lost and w.exit is None]
    if (hold is None or hold.settling) and not inp.waiting(a.generation, live):
        started = hold.since if hold is not None else now
        if now - started < settle_s(ctx):
            return hold or Hold(lost, kind, failure.step or 0, exit_codes, failure, incident, detected_at,
                                last_progress_at, now, settling=True)
    if hold is not None and hold.settling:
        hold = None  # settled: the ladder's own hold (wait for repair) starts from its first decision
    ranks = ctx.tracker.ranks()
    left = {r: w.worker_id for r, w in group.workers.items() if r not in lost}
    stateless = inp.stateless_ranks(a.generation, left)
    survivors = {r: ranks[r].step for r in left if r in ranks and r not in stateless}
    # The survivors' view of the step is the fresher one: the lost rank's last heartbeat may still have been
    # queued in its sender when it died or was stopped.
    step = max([*survivors.values(), *([failure.step] if failure.step is not None else [])], default=0)
    if survivors:  # members without state have nothing to agree on: they take the source's, as replacements do
        survivors.update({r: max(survivors.values()) for r in stateless})
    dirty = inp.dirty_ranks(a.generation, left)  # a member without state is never a source either
    decision = inp.decide(group, lost, kind, step, exit_codes, failure, ctx.generations.restarts(), survivors,
                          waiting_since=hold.since if hold is not None else None, dirty=dirty)
    if decision.action is Action.WAIT_FOR_REPAIR:
        if hold is None:
            print(f"resilient: holding for a spare: {decision.reason}", file=sys.stderr, flush=True)
        return hold or Hold(lost, kind, step, exit_codes, failure, incident, detected_at, last_progress_at, now)
    if decision.action not in ACTING:
        return decision
    generation = ctx.generations.next_generation()
    incident = replace(incident, decision={"action": decision.action.value, "reason": decision.reason,
                                           "verdict": None, "delay_s": 0.0, "generation": generation})
    ctx.books.record_incident(incident)
    ctx.accounting.failure(detected_at, last_progress_at, incident.id, incident.kind)
    pids = inp.carry_out(group, decision, lost, generation, detected_at, incident.id)
    return continue_as(ctx, group, a, gdir, generation, pids, decision.action.value, decision.reason)


def continue_as(ctx: GenerationContext, group: WorkerGroup, a: Assignment, gdir: Path, generation: int,
                pids: dict[int, int], action: str, reason: str, *, world_size: int | None = None,
                **fields: Any) -> Assignment:
    """The bookkeeping of a generation formed in process (its members published, the group moved);
    ``world_size``: the whole world's, across machines (this node's members otherwise)."""
    c = ctx.config
    moved = replace(a, generation=generation)
    world = world_size if world_size is not None else len(pids)
    ctx.tracker.start_generation(pids, ctx.clock(), generation, carried=frozenset(pids.values()))
    ctx.books.workers_started(generation, pids)
    if pids:
        ctx.accounting.generation_started(generation, world, c.max_nodes * c.nproc_per_node,
                                          restart=action != "grow", lead_rank=min(pids))
        ctx.accounting.recovered_in_process(action)
        ctx.status.attach(group, moved)
    ctx.emit(EventKind.GENERATION_CONTINUED, generation=generation, previous=a.generation, action=action,
             world_size=world, pids=pids, members={str(r): w.worker_id for r, w in group.workers.items()},
             **fields)
    if pids or world_size is None:
        print(f"resilient: generation {generation}: {reason}", file=sys.stderr, flush=True)
    start_spares(ctx, group, moved, gdir)
    return moved


def follow_locally(ctx: GenerationContext, group: WorkerGroup, a: Assignment, gdir: Path,
                   now: float) -> str | Assignment | Outcome | None:
    """One tick of in-process bookkeeping on this node: spares that exited, a recovery's progress, a retry in
    place or a grow; why the generation must end as a failure, its new assignment, or None."""
    inp = ctx.inproc
    assert inp is not None
    if inp.declined is not None:  # this run recovers by restart only: a spare would hold memory for nothing
        for worker in group.spares.values():
            if worker.exit is None:
                worker.signal(signal.SIGKILL)  # it waits inside resilient.Run(): nothing of it to save
    for worker_id, exit in group.spare_exits():
        group.spares.pop(worker_id)
        inp.spare_gone(worker_id, exit.returncode)
        if inp.declined is not None:
            continue
        log = gdir / f"{worker_id}.log"
        if inp.spare_failures >= SPARE_FAILURES_TO_GIVE_UP:
            print(f"resilient: spare {worker_id} exited with code {exit.returncode} before it was ready, the "
                  f"{inp.spare_failures}th in a row: no more spares in this generation (its log: {log}). A spare "
                  "runs the script up to resilient.Run() and waits there; a script that calls "
                  "init_process_group itself cannot (let Run(ddp=True) create the group)", file=sys.stderr,
                  flush=True)
            continue
        print(f"resilient: spare {worker_id} exited with code {exit.returncode} before it was needed (its log: "
              f"{log}); starting another", file=sys.stderr, flush=True)
        start_spares(ctx, group, a, gdir)
    progress = inp.progress()
    if progress is None:
        if inp.cluster is not None:
            return None
        return _maybe_retry(ctx, group, a, gdir) or _maybe_grow(ctx, group, a, gdir, now)
    recovering, rejoined = progress
    if recovering.rung == "grow" and _finished_before_boundary(ctx, group, recovering, rejoined):
        return None
    if set(rejoined) >= set(recovering.members):
        record = inp.completed(now, rejoined)
        ctx.emit(EventKind.RECOVERED_IN_PROCESS, **record)
        redone = max(0, recovering.step - int(record["resumed_after_step"])) \
            if isinstance(record["resumed_after_step"], int) else None
        if recovering.rung == "grow":
            line = (f"generation {recovering.generation}: grew back to {record['world_size']} ranks at step "
                    f"{recovering.step} in {record['seconds']:.2f} s")
        else:
            line = (f"generation {recovering.generation}: recovered in process ({record['rung']}) "
                    f"{record['seconds']:.2f} s after the failure; {record['world_size']} ranks resume after step "
                    f"{record['resumed_after_step']}, {redone} step(s) re-done")
        inp.last_completed = line
        print(f"resilient: {line}", file=sys.stderr, flush=True)
        if recovering.incident_id is not None:
            ctx.books.recovered(recovering.incident_id, record)
        return None
    if now > recovering.deadline:
        inp.abandon_recovery()
        missing = sorted(set(recovering.members) - set(rejoined))
        return (f"in-process recovery to generation {recovering.generation} did not complete: workers "
                f"{missing} never rejoined")
    return None


def joiners_waiting(group: WorkerGroup, recovering: Recovering, rejoined: Mapping[str, Any]) -> list[int]:
    """The ranks of this node whose workers are a grow's joiners still waiting for its boundary (they hold no
    state yet)."""
    joiners = {spare for _, spare in recovering.promotions}
    return [r for r, w in group.workers.items() if w.worker_id in joiners and w.worker_id not in rejoined]


def _finished_before_boundary(ctx: GenerationContext, group: WorkerGroup, recovering: Recovering,
                              rejoined: Mapping[str, Any]) -> bool:
    """The members of a grow's generation finished the run (every one exited 0) before its boundary: the
    joiners that wait for them hold no state and are stopped, and the grow is forgotten, so that the
    generation ends as the run did instead of waiting out the recovery's deadline."""
    waiting = joiners_waiting(group, recovering, rejoined)
    stayed = [w for r, w in group.workers.items() if r not in waiting]
    if not waiting or not stayed or any(w.exit is None or w.exit.returncode != 0 for w in stayed):
        return False
    assert ctx.inproc is not None
    ctx.inproc.forget_grow(recovering.generation)
    names = sorted(group.workers[r].worker_id for r in waiting)
    for rank in waiting:
        worker = group.retire(rank)
        worker.signal(signal.SIGKILL)  # it waits for the boundary inside resilient.Run(): nothing of it to save
        worker.signal(signal.SIGCONT)
    print(f"resilient: generation {recovering.generation}: the run finished before the grow's boundary at step "
          f"{recovering.step}; its joiners {names} were stopped (they held no state)", file=sys.stderr, flush=True)
    return True


def _maybe_retry(ctx: GenerationContext, group: WorkerGroup, a: Assignment, gdir: Path) -> Assignment | str | None:
    """Every member left the group and waits, none died: a collective failed (a network error); the ladder
    answers it, in place when it can (the same members in a new generation)."""
    from .incidents import Incident  # not at the top: incidents is heavier than this module needs otherwise

    inp = ctx.inproc
    if inp is None or not group.workers or any(w.exit is not None for w in group.workers.values()):
        return None
    reports = inp.waiting_reports(a.generation, [w.worker_id for w in group.workers.values()])
    if reports is None:
        return None
    ranks = ctx.tracker.ranks()
    step = max((int(r.get("step") or 0) for r in reports), default=0)
    error = str(reports[0].get("error") or "")
    now = ctx.clock()
    failure = Failure(kind="collective", time=now, node=ctx.config.node_id, step=step, detail=error[:300])
    summary = f"node {ctx.config.node_id}: every rank's collective failed at step {step}, none died: {error[:300]}"
    incident = Incident(id=f"g{a.generation:04d}-{ctx.config.node_id}", node=ctx.config.node_id,
                        generation=a.generation, kind="collective", rank=None, pid=None, section="step", step=step,
                        summary=summary)
    last = max((i.last_seen for i in ranks.values()), default=now)
    start_spares(ctx, group, a, gdir)
    ended = continue_locally(ctx, group, a, gdir, lost={}, kind=FaultKind.COLLECTIVE_ERROR, failure=failure,
                             exit_codes=(), incident=incident, detected_at=now, last_progress_at=last)
    if isinstance(ended, Assignment):
        return ended
    why = ended.reason if isinstance(ended, RecoveryDecision) else "no member survives"
    return f"every rank's collective failed at step {step} with none dead, and it was not retried in place: {why}"


GROW_LEAD_S = 0.5
"""A grow is scheduled this far ahead of the furthest rank (at its measured step rate), plus GROW_LEAD_STEPS:
every member must see the request at a boundary before the one it names."""
GROW_LEAD_STEPS = 3


@dataclass(frozen=True)
class Boundary:
    """Where a grow would take effect: the step its members join before, and the run's time left after it."""

    at_step: int
    remaining_s: float | None
    """Seconds of training after ``at_step`` at the measured rate, when the run's last step is known (the
    grow's gain is weighed against its cost over them); None when not."""


def grow_boundary(ctx: GenerationContext, group: WorkerGroup, a: Assignment, now: float,
                  lead_s: float) -> Boundary | None:
    """The step a grow is scheduled at: GROW_LEAD_STEPS plus ``lead_s`` (at the step rate measured in this
    generation) ahead of this node's furthest rank.  None until every member has reported in this generation
    (a rank not heard from yet is at step 0 in the tracker, and a rate measured from there is the whole run's
    progress over a fraction of a second) and the rate is measured; None as well when that step is not one the
    run still reaches (its members would finish with the joiners waiting for them)."""
    assert ctx.inproc is not None
    ranks = ctx.tracker.ranks()
    if not group.workers or any(r not in ranks or ranks[r].heartbeats == 0 for r in group.workers):
        return None
    furthest = max(ranks[r].step for r in group.workers)
    rate = ctx.inproc.step_rate(now, furthest, a.generation)
    if rate is None:
        return None  # not measured yet in this generation: a boundary cannot be placed safely
    return place_boundary(furthest, rate, lead_s, ctx.tracker.total_steps)


def place_boundary(furthest: int, rate: float, lead_s: float, total: int | None) -> Boundary | None:
    """GROW_LEAD_STEPS plus ``lead_s`` at ``rate`` steps a second past ``furthest`` (the furthest rank's
    step), if the run (``total`` steps, None: unknown) still reaches it, with the time left after it."""
    at_step = furthest + GROW_LEAD_STEPS + math.ceil(rate * lead_s)
    if total is None:
        return Boundary(at_step, None)
    if at_step >= total:
        return None
    return Boundary(at_step, (total - at_step) / rate if rate > 0 else None)


def _maybe_grow(ctx: GenerationContext, group: WorkerGroup, a: Assignment, gdir: Path,
                now: float) -> Assignment | None:
    """A world below full size grows onto a settled spare at a boundary a little ahead of every rank."""
    inp = ctx.inproc
    if inp is None or len(group.workers) >= ctx.config.nproc_per_node or not group.spares:
        return None
    boundary = grow_boundary(ctx, group, a, now, GROW_LEAD_S)
    if boundary is None:
        return None
    at_step = boundary.at_step
    decision = consider_grow(inp, group, at_step, now, remaining_s=boundary.remaining_s)
    if decision is None:
        return None
    generation = ctx.generations.next_generation()
    pids = carry_out_grow(inp, group, decision, generation, a.generation, at_step, ctx.clock())
    return continue_as(ctx, group, a, gdir, generation, pids, "grow", f"{decision.reason} (at step {at_step})",
                        at_step=at_step)
