"""How a generation ends on a failure, and what the agent records about it.

A failure here is a member that exited non-zero, or a hang the watch loop
detected.  Where in-process recovery is on offer (:mod:`resilient.agent.continuation`)
the survivors are left running and the ladder is asked first; only when it
answers restart or stop, or nothing survives, is the group stopped and the
generation's :class:`Outcome` returned for the supervisor's restart policy.
"""

from __future__ import annotations

import signal
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.collective import caused_by_peer
from ..core.events import EventKind, OutcomeKind
from ..elastic.decide import RecoveryDecision
from ..elastic.observe import FaultKind
from ..watchdog.attribution import Suspect, attribute_hang
from ..watchdog.stacks import StackCapture, capture, find_py_spy
from .consequences import describe_others, raised_before
from .incidents import (
    Incident,
    describe_failure,
    error_from_output,
    read_error_file,
    stacks_record,
)
from .launcher import Exit, WorkerGroup
from .outcome import Hold, Outcome
from .policy import Failure, first_failure
from .recover import continue_after
from .rendezvous import Assignment
from .worker_env import STACK_SIGNAL

if TYPE_CHECKING:
    from .context import GenerationContext



def error_file(group: WorkerGroup, e: Exit) -> Path:
    """The error file of the process that made exit ``e`` (its own, whatever rank it holds now)."""
    worker = next(w for w in group.everyone() if w.pid == e.pid)
    return Path(worker.spec.env["RESILIENT_ERROR_FILE"])


def worker_error(group: WorkerGroup, e: Exit) -> dict[str, Any] | None:
    """What the process of exit ``e`` raised: its error file, else the last traceback in its output (a script
    without ``resilient.Run`` writes no error file); None when it raised nothing (a signal, a plain exit code)."""
    found = read_error_file(error_file(group, e))
    if found is None and e.returncode > 0:
        worker = next(w for w in group.everyone() if w.pid == e.pid)
        found = error_from_output(worker.spec.log_file)
    return found


def end_on_failure(ctx: GenerationContext, group: WorkerGroup, a: Assignment, gdir: Path,
                   now: float) -> Outcome | Assignment | Hold:
    """Members exited non-zero: recover in process if the ladder can, else stop the group and end the generation."""
    _await_the_rank_that_made_a_nan(ctx, group)
    ranks = ctx.tracker.ranks()
    ladder = None
    if ctx.inproc is not None:
        exits = [e for e in group.exits() if e.returncode != 0]
        incident, first = _exit_incident(ctx, group, a, ranks, exits, stop_started=None)
        info = ranks.get(first.rank) if first.rank is not None else None
        ended = continue_after(
            ctx, group, a, gdir, lost={e.rank: group.workers[e.rank].worker_id for e in exits}, kind=FaultKind.CRASH,
            failure=first, exit_codes=tuple(e.returncode for e in exits if e.returncode > 0), incident=incident,
            detected_at=first.time, last_progress_at=info.last_seen if info is not None else first.time)
        if isinstance(ended, (Assignment, Hold)):
            return ended
        ladder = ended
    return stop_on_failure(ctx, group, a, ranks, ladder)


def stop_on_failure(ctx: GenerationContext, group: WorkerGroup, a: Assignment, ranks: dict[int, Any],
                    ladder: RecoveryDecision | None) -> Outcome:
    """Stop the group after members failed; the generation ends (``ladder``: why it was not recovered in process)."""
    stop_started = ctx.clock()
    group.stop(ctx.config.stop_grace_s)
    exits = [e for e in group.exits() if e.returncode != 0]
    incident, first = _exit_incident(ctx, group, a, ranks, exits, stop_started=stop_started)
    if ladder is not None:
        incident = replace(incident, ladder=ladder.to_event())
    ctx.emit(EventKind.WORKER_FAILED, generation=a.generation, rank=first.rank, summary=incident.summary)
    info = ranks.get(first.rank) if first.rank is not None else None
    last_progress = info.last_seen if info is not None else first.time
    return Outcome(OutcomeKind.FAILED, incident.summary, first, incident, detected_at=first.time,
                   last_progress_at=last_progress, exit_codes=tuple(e.returncode for e in exits if e.returncode > 0),
                   decision=ladder)


PEER_VERDICT_WAIT_S = 2.0
"""How long the agent leaves the rest of a group running when every rank that failed so far raised non-finite
gradients its own backward did not make: the rank whose samples made them reaches the same verdict in the same
step, and stopping it first would leave the incident without its cause."""


def _await_the_rank_that_made_a_nan(ctx: GenerationContext, group: WorkerGroup) -> None:
    deadline = ctx.clock() + PEER_VERDICT_WAIT_S
    while group.running() and ctx.clock() < deadline:
        exits = [e for e in group.exits() if e.returncode != 0]
        if not exits or not all((read_error_file(error_file(group, e)) or {}).get("own_nonfinite") is False
                                for e in exits):
            return
        group.pause(0.05)


def _exit_incident(ctx: GenerationContext, group: WorkerGroup, a: Assignment, ranks: dict[int, Any],
                   exits: list[Exit], *, stop_started: float | None) -> tuple[Incident, Failure]:
    """The incident of members' non-zero exits (``stop_started``: when the agent began stopping the rest)."""
    errors = {e.rank: worker_error(group, e) for e in exits}
    # A rank that exited once the agent was stopping the group is its casualty, unless it had raised an error
    # of its own before that (two ranks raising at once: the one reaped second had failed as early).
    failures = [_as_failure(ctx, e, ranks, caused_by_agent=stop_started is not None and e.at >= stop_started
                            and not raised_before(errors[e.rank], stop_started),
                            consequence=caused_by_peer(errors[e.rank])) for e in exits]
    first = first_failure(failures)
    assert first.rank is not None
    info = ranks.get(first.rank)
    returncode = first.exit_code if first.exit_code is not None else -(first.signal or 0)
    # Only collective errors failed here: the death that caused them was elsewhere (another node, the store).
    hint = "a collective error, as a lost peer causes: the cause is on another node" if first.consequence else ""
    if info is None or not info.heartbeats:
        error = errors[first.rank]
        raised = f"{error['exc_type']}: {str(error['message'])[:200]}; " if error else ""
        hint = f"{raised}no step was reported (no resilient.Run yet), so where in the script is not known" \
            + (f"; {hint}" if hint else "")
    summary = describe_failure(first.kind, first.rank, ctx.config.node_id, returncode, first.section, first.step,
                               hint)
    incident = Incident(
        id=f"g{a.generation:04d}-{ctx.config.node_id}", node=ctx.config.node_id, generation=a.generation,
        kind=first.kind, rank=first.rank, pid=info.pid if info else None, section=first.section, step=first.step,
        summary=summary, exit_code=first.exit_code, signal=first.signal, error=errors[first.rank],
        other_failures=describe_others(failures, errors, first),
    )
    return incident, first


def recovery_failed(ctx: GenerationContext, group: WorkerGroup, a: Assignment, problem: str, now: float) -> Outcome:
    """An in-process recovery did not complete in time: stop the group; the restart path takes over."""
    ranks = ctx.tracker.ranks()
    group.stop(ctx.config.stop_grace_s)
    summary = f"node {ctx.config.node_id}: {problem}"
    failure = Failure(kind="hang", rank=None, node=ctx.config.node_id, time=now, detail=problem)
    exits = [e for e in group.exits() if e.returncode != 0]
    errors = {e.rank: worker_error(group, e) for e in exits}
    incident = Incident(
        id=f"g{a.generation:04d}-{ctx.config.node_id}", node=ctx.config.node_id, generation=a.generation,
        kind="hang", rank=None, pid=None, section="recovery", step=None, summary=summary,
        other_failures=describe_others([_as_failure(ctx, e, ranks, caused_by_agent=True,
                                                    consequence=caused_by_peer(errors[e.rank])) for e in exits],
                                       errors, failure),
    )
    ctx.emit(EventKind.WORKER_FAILED, generation=a.generation, rank=None, summary=summary)
    return Outcome(OutcomeKind.FAILED, summary, failure, incident, detected_at=now, last_progress_at=now)


def _as_failure(ctx: GenerationContext, e: Exit, ranks: dict[int, Any], *, caused_by_agent: bool,
                consequence: bool) -> Failure:
    info = ranks.get(e.rank)
    heard = info is not None and info.heartbeats > 0  # else its place is unknown, not 'init' at step 0
    return Failure(
        kind="signal" if e.signal else "exit", rank=e.rank, node=ctx.config.node_id,
        exit_code=None if e.signal else e.returncode, signal=e.signal,
        section=info.section if heard and info is not None else None,
        step=info.step if heard and info is not None else None, time=e.at,
        caused_by_agent=caused_by_agent, consequence=consequence,
    )


def _casualties(ctx: GenerationContext, group: WorkerGroup, gdir: Path, ranks: dict[int, Any],
                first: Failure) -> tuple[str, ...]:
    """One line for each other rank that ended non-zero once the agent stopped the group after ``first``."""
    exits = [e for e in group.exits() if e.returncode != 0 and e.rank != first.rank]
    errors = {e.rank: worker_error(group, e) for e in exits}
    return describe_others([_as_failure(ctx, e, ranks, caused_by_agent=True,
                                        consequence=caused_by_peer(errors[e.rank])) for e in exits],
                           errors, first)


def end_on_hang(ctx: GenerationContext, group: WorkerGroup, a: Assignment, gdir: Path, hang: Any,
          now: float) -> Outcome | Assignment | Hold:
    ranks = ctx.tracker.ranks()
    ctx.emit(EventKind.HANG_DETECTED, generation=a.generation, rank=hang.rank, section=hang.section, step=hang.step,
               timeout_s=hang.timeout_s, source=hang.source, overrun_s=hang.overrun_s, reason=hang.reason)
    py_spy = find_py_spy()
    # The rank the policy flagged first (its stacks matter most), then its peers.
    order = [hang.rank] + [r for r in sorted(group.workers) if r != hang.rank]
    captures: dict[int, StackCapture] = {}
    for rank in order:
        w = group.workers[rank]
        if w.exit is None:
            captures[rank] = capture(w.pid, Path(w.spec.env["RESILIENT_STACK_FILE"]), STACK_SIGNAL, py_spy)
    suspects = [Suspect(rank, ranks[rank].section, ranks[rank].step, now - ranks[rank].entered_at,
                        captures[rank].state, captures[rank].text) for rank in captures if rank in ranks]
    culprit = attribute_hang(suspects) if suspects else None
    rank = culprit.rank if culprit else hang.rank
    info = ranks.get(rank)
    section = info.section if info else hang.section
    step = info.step if info else hang.step
    summary = describe_failure("hang", rank, ctx.config.node_id, None, section, step,
                               f"no progress for {hang.overrun_s + hang.timeout_s:.1f} s "
                               f"(timeout {hang.timeout_s:.1f} s, {hang.source})")
    failure = Failure(kind="hang", rank=rank, node=ctx.config.node_id, exit_code=None, signal=None,
                      section=section, step=step, time=now, caused_by_agent=False)
    incident = Incident(
        id=f"g{a.generation:04d}-{ctx.config.node_id}", node=ctx.config.node_id, generation=a.generation,
        kind="hang", rank=rank, pid=info.pid if info else None, section=section, step=step, summary=summary,
        hang={"timeout_s": hang.timeout_s, "source": hang.source, "overrun_s": hang.overrun_s,
              "policy_reason": hang.reason, "attribution": culprit.reason if culprit else "only rank overrunning",
              "stack_tool": py_spy or "faulthandler only"},
        stacks=stacks_record(captures),
    )
    last_progress = info.entered_at if info is not None else now
    ladder = None
    others = [w.worker_id for r, w in group.workers.items() if r != rank]
    # Across machines the peers may all be elsewhere: then the hung rank itself must have opted in.
    if ctx.inproc is not None and (others or ctx.inproc.cluster is not None) and \
            ctx.inproc.opted_in(others or [group.workers[rank].worker_id]):
        # Only the hung rank goes: its peers are blocked in a collective with it, and its death releases them.
        culprit_worker = group.workers[rank]
        culprit_worker.signal(signal.SIGKILL)
        culprit_worker.signal(signal.SIGCONT)
        try:
            culprit_worker.proc.wait(timeout=ctx.config.stop_grace_s)
            gone = True
        except subprocess.TimeoutExpired:  # SIGKILL did not end it: the group stop below reports it as stuck
            gone = False
        if gone:
            ended = continue_after(ctx, group, a, gdir, lost={rank: culprit_worker.worker_id}, kind=FaultKind.HANG,
                                   failure=failure, exit_codes=(), incident=incident, detected_at=now,
                                   last_progress_at=last_progress)
            if isinstance(ended, (Assignment, Hold)):
                return ended
            ladder = ended
    group.stop(ctx.config.stop_grace_s)
    incident = replace(incident, other_failures=_casualties(ctx, group, gdir, ranks, failure),
                       ladder=ladder.to_event() if ladder is not None else None)
    return Outcome(OutcomeKind.FAILED, summary, failure, incident, detected_at=now, last_progress_at=last_progress,
                   decision=ladder)


