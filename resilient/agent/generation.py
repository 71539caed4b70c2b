"""One generation on one node: start the workers, watch them, report the outcome.

The watch loop runs on the agent's main thread and never waits on the
network: facts that live in the shared store (a verdict, a stop request,
nodes waiting to join) are polled by :class:`PeerWatch` on its own thread,
so a store outage cannot delay hang detection.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from ..events import Emit, EventKind, OutcomeKind
from ..fsutil import write_json_atomic
from ..watchdog.attribution import Suspect, attribute_hang
from ..watchdog.sections import decide_hang
from ..watchdog.stacks import StackCapture, capture, find_py_spy
from .consequences import describe_others, is_collective_error
from .health import assess, probe
from .incidents import (
    Incident,
    describe_failure,
    format_incident,
    publish_incident,
    read_error_file,
    stacks_record,
    unhealthy_incident,
)
from .launcher import Exit, WorkerGroup, WorkerSpec
from .policy import Failure, first_failure
from .rendezvous import Assignment
from .restores import RestoreSummary, summarise_restores
from .rundir import RunDir, heartbeat_socket
from .sweep import Stuck

if TYPE_CHECKING:
    from ..coord.store import ControlStore
    from .accounting import NodeAccounting
    from .config import AgentConfig
    from .shared import SharedFacts
    from .status import StatusPublisher
    from .tracker import RankTracker

STACK_SIGNAL = signal.SIGUSR2
STOP_SIGNAL = signal.SIGUSR1


@dataclass(frozen=True)
class Outcome:
    """How a generation ended on this node."""

    kind: OutcomeKind
    reason: str
    failure: Failure | None = None
    incident: Incident | None = None
    detected_at: float = 0.0
    """Agent clock when the failure was detected."""
    last_progress_at: float = 0.0
    """Agent clock of the failing rank's last sign of progress (its last heartbeat)."""


@dataclass(frozen=True)
class GenerationContext:
    """The pieces of the agent a generation uses, and nothing else."""

    config: AgentConfig
    run_dir: RunDir
    launch_id: str
    clock: Callable[[], float]
    echo_to: IO[str]
    tracker: RankTracker
    accounting: NodeAccounting
    status: StatusPublisher
    shared: SharedFacts
    """The launch's verdict, stop and stop request in the store."""
    emit: Emit
    waiting: Callable[[], int]
    """Nodes waiting to join the run (reads the store: called from PeerWatch's thread only)."""
    stop_requested: Callable[[], str | None]
    """Why this agent was asked to stop gracefully (SIGTERM, the control socket), or None."""
    interrupted: Callable[[], bool]
    """SIGINT: stop now, without a checkpoint."""
    workers_started: Callable[[int, dict[int, int]], None]
    """Record a generation's worker pids (for a later agent's sweep)."""
    workers_stopped: Callable[[int, tuple[Stuck, ...]], None]
    """Report workers of a generation that SIGKILL did not end."""
    restored: Callable[[RestoreSummary], None]
    """Report what this node's ranks of a generation restored (once per generation)."""


class PeerWatch:
    """Polls the shared store once a second on its own thread; the watch loop reads the results."""

    def __init__(self, ctx: GenerationContext, interval_s: float = 1.0) -> None:
        self._ctx = ctx
        self._interval = interval_s
        self.verdict: dict[str, Any] | None = None
        self.stop: dict[str, Any] | None = None
        self.stop_request: dict[str, Any] | None = None
        self.waiting = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="peer-watch", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        ctx = self._ctx
        multi = ctx.config.max_nodes > 1
        while not self._done.wait(self._interval):
            try:
                self.verdict = ctx.shared.verdict()
                self.stop = ctx.shared.stop()
                self.stop_request = ctx.shared.stop_request()
                if multi:
                    self.waiting = ctx.waiting()
            except Exception as e:  # an outage must not end a healthy generation
                ctx.emit(EventKind.STORE_UNREACHABLE, error=f"{type(e).__name__}: {e}")

    def close(self) -> None:
        self._done.set()
        self._thread.join(timeout=30)


def worker_specs(config: AgentConfig, run_dir: RunDir, launch_id: str, a: Assignment, attempt: int,
                 gdir: Path) -> list[WorkerSpec]:
    c = config
    world = a.num_nodes * c.nproc_per_node
    base = dict(c.worker_env)
    if c.nproc_per_node > 1:
        base.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: N processes must not each take every core
    specs = []
    for local in range(c.nproc_per_node):
        rank = a.node_rank * c.nproc_per_node + local
        env = {
            **base,
            "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local),
            "LOCAL_WORLD_SIZE": str(c.nproc_per_node), "GROUP_RANK": str(a.node_rank),
            "GROUP_WORLD_SIZE": str(a.num_nodes), "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world),
            "ROLE_NAME": "default", "MASTER_ADDR": a.master_addr, "MASTER_PORT": str(a.master_port),
            "TORCHELASTIC_RESTART_COUNT": str(attempt), "TORCHELASTIC_MAX_RESTARTS": str(c.restart.max_restarts),
            "TORCHELASTIC_RUN_ID": c.run_id,
            "RESILIENT_RUN_ID": c.run_id, "RESILIENT_LAUNCH_ID": launch_id, "RESILIENT_RUN_DIR": str(c.run_dir),
            "RESILIENT_NODE_ID": c.node_id,
            "RESILIENT_GENERATION": str(a.generation), "RESILIENT_ATTEMPT": str(attempt),
            "RESILIENT_AGENT_SOCKET": heartbeat_socket(run_dir, local),
            "RESILIENT_STACK_FILE": str(gdir / f"rank{rank}.stacks.txt"),
            "RESILIENT_STACK_SIGNAL": str(int(STACK_SIGNAL)),
            "RESILIENT_ERROR_FILE": str(gdir / f"rank{rank}.error.json"),
            "RESILIENT_CONTROL_FILE": str(gdir / "control.json"),
            "RESILIENT_STOP_SIGNAL": str(int(STOP_SIGNAL)),
        }
        if c.fault_plan is not None:
            env["RESILIENT_FAULT_PLAN"] = str(c.fault_plan)
        specs.append(WorkerSpec(local_rank=local, rank=rank, argv=tuple(c.entrypoint), env=env,
                                log_file=gdir / f"rank{rank}.log", echo=c.echo_output))
    return specs


def run_generation(ctx: GenerationContext, a: Assignment, attempt: int, *, restart: bool) -> Outcome:
    """Start this node's workers of generation ``a`` and watch them to the end; ``restart``: after a failure."""
    gdir = ctx.run_dir.generation_dir(a.generation)
    gdir.mkdir(parents=True, exist_ok=True)
    group = WorkerGroup(worker_specs(ctx.config, ctx.run_dir, ctx.launch_id, a, attempt, gdir), ctx.clock, ctx.echo_to)
    pids = {rank: w.pid for rank, w in group.workers.items()}
    ctx.tracker.start_generation(pids, ctx.clock(), a.generation)
    ctx.workers_started(a.generation, pids)
    ctx.accounting.generation_started(a.generation, a.num_nodes * ctx.config.nproc_per_node,
                                      ctx.config.max_nodes * ctx.config.nproc_per_node,
                                      restart=restart, lead_rank=min(pids))
    ctx.status.attach(group, a)
    ctx.emit(EventKind.WORKERS_STARTED, generation=a.generation, attempt=attempt, pids=pids)
    peers = PeerWatch(ctx)
    reported = False

    def report_restores(final: bool) -> None:
        """Once every rank reported its restore (or, at the end, whatever some did), say what they restored."""
        nonlocal reported
        expected, reports = ctx.tracker.restores()
        if not reported and reports and (final or len(reports) >= len(expected)):
            reported = True
            ctx.restored(summarise_restores(a.generation, ctx.config.node_id, expected, reports,
                                            multi_node=a.num_nodes > 1))

    try:
        return _watch(ctx, group, a, gdir, peers, report_restores)
    finally:
        peers.close()
        group.stop(ctx.config.stop_grace_s)
        report_restores(True)
        ctx.status.detach()
        ctx.workers_stopped(a.generation, group.stuck)


def _watch(ctx: GenerationContext, group: WorkerGroup, a: Assignment, gdir: Path, peers: PeerWatch,
           report_restores: Callable[[bool], None]) -> Outcome:
    c = ctx.config
    stop_deadline: float | None = None
    stop_at: int | None = None
    next_health = ctx.clock() + c.health_interval_s
    while True:
        now = ctx.clock()
        report_restores(False)
        failed = [e for e in group.exits() if e.returncode != 0]
        if failed and stop_deadline is None:
            return _failure(ctx, group, a, gdir, now)
        if group.all_exited():
            if stop_deadline is not None:
                note = f"; some workers failed: {[e.returncode for e in failed]}" if failed else ""
                return Outcome(OutcomeKind.PREEMPTED,
                               f"workers stopped at step {stop_at} after committing a checkpoint{note}")
            return Outcome(OutcomeKind.SUCCEEDED, "all workers exited 0")
        if ctx.interrupted():
            return Outcome(OutcomeKind.INTERRUPTED, "SIGINT: workers stopped without a checkpoint")
        if peers.verdict is not None:
            return Outcome(OutcomeKind.VERDICT,
                           f"node {peers.verdict.get('node')} stopped the run: {peers.verdict.get('reason')}")
        if stop_deadline is None and (ctx.stop_requested() or peers.stop or peers.stop_request):
            stop_at = _request_stop(ctx, group, gdir, peers.stop, peers.stop_request)
            stop_deadline = now + c.preempt_grace_s
        if stop_deadline is not None:
            if now > stop_deadline:
                return Outcome(OutcomeKind.PREEMPTED, f"workers did not stop within {c.preempt_grace_s:.0f} s; killed")
        else:
            # A rank that already exited (0: failures were handled above) cannot hang.
            views = {r: v for r, v in ctx.tracker.views().items() if group.workers[r].exit is None}
            hang = decide_hang(views, ctx.tracker.stats, c.sections, now)
            if hang is not None:
                return _hang(ctx, group, a, gdir, hang, now)
            if peers.waiting > 0:
                return Outcome(OutcomeKind.MEMBERSHIP, f"{peers.waiting} node(s) waiting to join the run")
        if now >= next_health:
            next_health = now + c.health_interval_s
            health = assess(probe(list(c.health_paths)), c.health)
            if not health.healthy:
                ctx.emit(EventKind.NODE_UNHEALTHY, reason=health.reason, problems=list(health.problems))
                return Outcome(OutcomeKind.UNHEALTHY, health.reason, incident=unhealthy_incident(
                    c.node_id, a.generation, health.problems, when="while running"))
        time.sleep(c.monitor_interval_s)


def _request_stop(ctx: GenerationContext, group: WorkerGroup, gdir: Path, shared: dict[str, Any] | None,
                  request: dict[str, Any] | None) -> int:
    """Ask every worker to commit at a step that no rank has reached yet, then exit."""
    if shared is not None:
        stop_at, reason = int(shared["stop_at_step"]), str(shared.get("reason", "stop requested by a peer"))
    else:
        views = ctx.tracker.views()
        furthest = max([v.step for v in views.values()] + [ctx.tracker.max_step])
        asked = ctx.stop_requested() or (request and str(request.get("reason", ""))) or "stop requested"
        stop_at, reason = furthest + ctx.config.preempt_margin_steps, asked
        try:
            stop_at = ctx.shared.propose_stop(stop_at, reason)  # another node's earlier step wins
        except Exception as e:  # without the store, this node still stops its own workers cleanly
            ctx.emit(EventKind.STORE_UNREACHABLE, error=f"{type(e).__name__}: {e}")
    write_json_atomic(gdir / "control.json", {"stop_at_step": stop_at, "reason": reason})
    for w in group.running():
        try:
            os.kill(w.pid, STOP_SIGNAL)
        except ProcessLookupError:
            pass
    ctx.emit(EventKind.STOP_REQUESTED, stop_at_step=stop_at, reason=reason, grace_s=ctx.config.preempt_grace_s)
    return stop_at


def _failure(ctx: GenerationContext, group: WorkerGroup, a: Assignment, gdir: Path, now: float) -> Outcome:
    ranks = ctx.tracker.ranks()
    stop_started = ctx.clock()
    group.stop(ctx.config.stop_grace_s)
    exits = [e for e in group.exits() if e.returncode != 0]
    errors = {e.rank: read_error_file(gdir / f"rank{e.rank}.error.json") for e in exits}
    failures = [_as_failure(ctx, e, ranks, caused_by_agent=e.at >= stop_started,
                            consequence=is_collective_error(errors[e.rank])) for e in exits]
    first = first_failure(failures)
    assert first.rank is not None
    info = ranks.get(first.rank)
    returncode = first.exit_code if first.exit_code is not None else -(first.signal or 0)
    # Only collective errors failed here: the death that caused them was elsewhere (another node, the store).
    hint = "a collective error, as a lost peer causes: the cause is on another node" if first.consequence else ""
    summary = describe_failure(first.kind, first.rank, ctx.config.node_id, returncode, first.section, first.step,
                               hint)
    incident = Incident(
        id=f"g{a.generation:04d}-{ctx.config.node_id}", node=ctx.config.node_id, generation=a.generation,
        kind=first.kind, rank=first.rank, pid=info.pid if info else None, section=first.section, step=first.step,
        summary=summary, exit_code=first.exit_code, signal=first.signal, error=errors[first.rank],
        other_failures=describe_others(failures, errors, first),
    )
    ctx.emit(EventKind.WORKER_FAILED, generation=a.generation, rank=first.rank, summary=summary)
    last_progress = info.last_seen if info is not None else first.time
    return Outcome(OutcomeKind.FAILED, summary, first, incident, detected_at=first.time, last_progress_at=last_progress)


def _as_failure(ctx: GenerationContext, e: Exit, ranks: dict[int, Any], *, caused_by_agent: bool,
                consequence: bool) -> Failure:
    info = ranks.get(e.rank)
    return Failure(
        kind="signal" if e.signal else "exit", rank=e.rank, node=ctx.config.node_id,
        exit_code=None if e.signal else e.returncode, signal=e.signal,
        section=info.section if info else None, step=info.step if info else None, time=e.at,
        caused_by_agent=caused_by_agent, consequence=consequence,
    )


def _casualties(ctx: GenerationContext, group: WorkerGroup, gdir: Path, ranks: dict[int, Any],
                first: Failure) -> tuple[str, ...]:
    """One line for each other rank that ended non-zero once the agent stopped the group after ``first``."""
    exits = [e for e in group.exits() if e.returncode != 0 and e.rank != first.rank]
    errors = {e.rank: read_error_file(gdir / f"rank{e.rank}.error.json") for e in exits}
    return describe_others([_as_failure(ctx, e, ranks, caused_by_agent=True,
                                        consequence=is_collective_error(errors[e.rank])) for e in exits],
                           errors, first)


def _hang(ctx: GenerationContext, group: WorkerGroup, a: Assignment, gdir: Path, hang: Any, now: float) -> Outcome:
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
            captures[rank] = capture(w.pid, gdir / f"rank{rank}.stacks.txt", STACK_SIGNAL, py_spy)
    suspects = [Suspect(rank, ranks[rank].section, ranks[rank].step, now - ranks[rank].entered_at,
                        captures[rank].state, captures[rank].text) for rank in captures if rank in ranks]
    culprit = attribute_hang(suspects) if suspects else None
    rank = culprit.rank if culprit else hang.rank
    info = ranks.get(rank)
    section = info.section if info else hang.section
    step = info.step if info else hang.step
    group.stop(ctx.config.stop_grace_s)
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
        other_failures=_casualties(ctx, group, gdir, ranks, failure),
    )
    last_progress = info.entered_at if info is not None else now
    return Outcome(OutcomeKind.FAILED, summary, failure, incident, detected_at=now, last_progress_at=last_progress)


def record_incident(incident: Incident, run_dir: RunDir, store: ControlStore, emit: Emit) -> None:
    """Write the incident file, its event, and its run-wide copy in the store; print it with its consequences."""
    path = publish_incident(incident, run_dir, store, emit)
    emit(EventKind.INCIDENT, path=str(path), **incident.event_fields())
    print(format_incident(incident, path), file=sys.stderr, flush=True)
