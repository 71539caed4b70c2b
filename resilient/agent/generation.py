"""One generation on one node: start the workers, watch them, report the outcome.

The watch loop runs on the agent's main thread and never waits on the
network: facts that live in the shared store (a verdict, a stop request,
nodes waiting to join) are polled by :class:`PeerWatch` on its own thread,
so a store outage cannot delay hang detection.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..coord.store import ControlStoreError
from ..core.events import EventKind, OutcomeKind
from ..core.fsutil import write_json_atomic
from ..watchdog.sections import SectionTimeouts, for_storage
from . import machine
from .context import GenerationContext
from .continuation import start_spares
from .eviction import weigh_straggler
from .failures import (
    end_on_failure,
    end_on_hang,
    recovery_failed,
    stop_on_failure,
)
from .health import probe
from .incidents import (
    unhealthy_incident,
)
from .launcher import WorkerGroup, WorkerSpec
from .outcome import Outcome
from .recover import continue_after, follow
from .rendezvous import Assignment
from .restores import summarise_restores
from .rundir import RunDir
from .worker_env import STOP_SIGNAL, base_env, worker_env

if TYPE_CHECKING:
    from ..coord.quarantine import Standing
    from .config import AgentConfig
    from .inproc import InProcess



class PeerWatch:
    """Reads the shared facts once a second on its own thread (across machines from the agent's watch of the
    launch, no request while they do not change); the watch loop reads the results."""

    def __init__(self, ctx: GenerationContext, interval_s: float = 1.0) -> None:
        self._ctx = ctx
        self._interval = interval_s
        self.verdict: dict[str, Any] | None = None
        self.stop: dict[str, Any] | None = None
        self.stop_request: dict[str, Any] | None = None
        self.waiting = 0
        self.quarantined: Standing | None = None
        """This node's quarantine record, when one was written while the generation runs."""
        self.detectors: dict[str, Any] | None = None
        """Detector changes requested through the store (across machines), for the watch loop to apply."""
        self.ended = False
        """The launch ended (checked across machines only: a node without members learns so here)."""
        self._published: dict[str, Any] | None = None
        self._announced: tuple[str, int] | None = None
        """As the scorer: the timing link's address and the generation it was announced for."""
        self._done = threading.Event()
        self._thread = ctx.threads.run("peer-watch", self._loop, stop=self._done)

    def _loop(self) -> None:
        ctx = self._ctx
        multi = ctx.config.multi_node
        while not self._done.wait(self._interval):
            try:
                self.verdict = ctx.shared.verdict()
                self.stop = ctx.shared.stop()
                self.stop_request = ctx.shared.stop_request()
                if multi:
                    self.waiting = ctx.asked.nodes_waiting()
                    self.ended = ctx.shared.ended()
                    self.detectors = ctx.shared.detectors()
                    self._exchange_timing()
                self.quarantined = ctx.asked.quarantined()
            except (ControlStoreError, OSError) as e:  # an outage must not end a healthy generation (anything else
                ctx.emit(EventKind.STORE_UNREACHABLE, error=f"{type(e).__name__}: {e}")  # is a bug: reported)

    def _exchange_timing(self) -> None:
        """Across machines: send this node's newest windows to the launch's scorer (its timing link, else the
        store); as the scorer, take every node's and publish the flags when they change; otherwise take this
        node's flags from the scorer's."""
        slowness, shared, link = self._ctx.slowness, self._ctx.shared, self._ctx.timing_link
        if slowness is None:
            return
        if link is not None:
            link.follow(shared.launch_id)
        box = slowness.outbox()
        if box is not None and box != self._published and not slowness.scorer:  # the scorer has its own
            if not self._send_to_scorer(box):
                shared.publish_timing(box)
            self._published = box
        if slowness.scorer:
            generation = box.get("generation") if box is not None else None
            if link is not None and isinstance(generation, int) and self._announced != (link.address, generation):
                shared.announce_scorer(link.address, generation)
                self._announced = (link.address, generation)
            slowness.take_peers([*(link.records() if link is not None else ()), *shared.timing()])
            record = slowness.flags_out()
            if record is not None:
                shared.publish_stragglers(record)
        else:
            shared.stop_timing()
            record = shared.stragglers()
            if record is not None:
                slowness.from_scorer(record)

    def _send_to_scorer(self, box: dict[str, Any]) -> bool:
        """This node's windows to the scorer's timing link, as it announced it; False: they go to the store."""
        link, scorer = self._ctx.timing_link, self._ctx.shared.scorer()
        if link is None or scorer is None or scorer.get("node") == self._ctx.config.node_id:
            return False
        return link.send(str(scorer.get("address")), self._ctx.shared.launch_id, box)

    def close(self) -> None:
        self._done.set()
        self._thread.join(timeout=30)


def worker_specs(config: AgentConfig, run_dir: RunDir, launch_id: str, a: Assignment, attempt: int,
                 gdir: Path, inproc: InProcess | None = None, *, resuming: bool = False) -> list[WorkerSpec]:
    """This node's workers of generation ``a``; ``resuming``: not the run's first start (a restart, a later
    launch): their command line ends with ``--restart-args`` and ``RESILIENT_RESUMING=1`` tells the script."""
    c = config
    if c.role == "spare":
        return []  # a spare node's processes are all spares (started by start_spares)
    world = a.num_nodes * c.nproc_per_node
    base = base_env(c)
    specs = []
    for local in range(c.nproc_per_node):
        rank = a.node_rank * c.nproc_per_node + local
        env = {
            **base,
            "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local),
            "LOCAL_WORLD_SIZE": str(c.nproc_per_node), "GROUP_RANK": str(a.node_rank),
            "GROUP_WORLD_SIZE": str(a.num_nodes), "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world),
            "ROLE_NAME": "default", "MASTER_ADDR": a.master_addr, "MASTER_PORT": str(a.master_port),
            "TORCHELASTIC_MAX_RESTARTS": str(c.restart.max_restarts), "RESILIENT_RESUMING": "1" if resuming else "0",
            **worker_env(c, run_dir, launch_id, a.generation, attempt, local, gdir, f"rank{rank}"),
        }
        worker_id = inproc.new_worker_id("worker") if inproc is not None else f"r{rank}"
        if inproc is not None:
            env.update(inproc.worker_env(worker_id, "worker"))
        argv = (*c.entrypoint, *c.restart_args) if resuming else tuple(c.entrypoint)
        specs.append(WorkerSpec(local_rank=local, rank=rank, argv=argv, env=env,
                                log_file=gdir / f"rank{rank}.log", echo=c.echo_output, worker_id=worker_id,
                                slot=local))
    return specs


def past_first_step(restored: dict[int, int], views: dict[int, Any]) -> bool:
    """Whether every rank that restored has completed two steps since (its heartbeat is in a step beyond the restored
    one plus one; the first is often a warm-up: allocations, DDP's buckets): the restart is over, and a spare's
    start-up can no longer delay it."""
    return all(r in views and views[r].step is not None and views[r].step > step + 1 for r, step in restored.items())


def run_generation(ctx: GenerationContext, a: Assignment, attempt: int, *, restart: bool) -> Outcome:
    """Start this node's workers of generation ``a`` and watch them to the end; ``restart``: after a failure."""
    gdir = ctx.run_dir.generation_dir(a.generation)
    gdir.mkdir(parents=True, exist_ok=True)
    # Not the run's first start: a restart, or a later launch of the same run (its ledger was found).
    resuming = restart or attempt > 0 or ctx.accounting.resumed
    specs = worker_specs(ctx.config, ctx.run_dir, ctx.launch_id, a, attempt, gdir, ctx.inproc, resuming=resuming)
    group = WorkerGroup(specs, ctx.clock, ctx.echo_to, spawner=ctx.spawner)
    group.attempt = attempt
    pids = {rank: w.pid for rank, w in group.workers.items()}
    ctx.tracker.start_generation(pids, ctx.clock(), a.generation)
    ctx.books.workers_started(a.generation, pids)
    if pids:
        ctx.accounting.generation_started(a.generation, a.num_nodes * ctx.config.nproc_per_node,
                                          ctx.config.max_nodes * ctx.config.nproc_per_node,
                                          restart=restart, lead_rank=min(pids))
        ctx.status.attach(group, a)
        ctx.emit(EventKind.WORKERS_STARTED, generation=a.generation, attempt=attempt, pids=pids)
    if ctx.inproc is not None:
        ctx.inproc.changed = group.changed  # a worker's recovery report wakes the watch loop too
        if ctx.inproc.cluster is not None:
            from .cluster_flow import start

            start(ctx, group, a)
    if not restart or not group.workers:
        start_spares(ctx, group, a, gdir)  # at the run's start (or on a spare node) beside the workers, niced
    # After a restart they start once every worker has restored and then completed two steps (below), or at the
    # first failure (continue_after): a spare's start-up never takes CPU from a restarting worker's, nor from the
    # restored workers' first step, which is the restart's last part.
    peers = PeerWatch(ctx)
    reported = False
    deferred: dict[int, int] | None = None  # after a restart: each rank's restored step, until the spares start

    def report_restores(final: bool) -> None:
        """Once every rank reported its restore (or, at the end, whatever some did), say what they restored."""
        nonlocal reported, deferred
        expected, reports = ctx.tracker.restores()
        if not reported and reports and (final or len(reports) >= len(expected)):
            reported = True
            ctx.books.restored(summarise_restores(a.generation, ctx.config.node_id, expected, reports,
                                            multi_node=a.num_nodes > 1))
            if not final and restart:
                deferred = {r: int(rep.get("step") or 0) for r, rep in reports.items()}
        if deferred is not None and not final and past_first_step(deferred, ctx.tracker.views()):
            deferred = None
            start_spares(ctx, group, a, gdir)  # the workers are past start-up: now the spares

    try:
        return _watch(ctx, group, a, gdir, peers, report_restores)
    finally:
        peers.close()
        group.stop(ctx.config.stop_grace_s)
        if ctx.inproc is not None:
            ctx.inproc.group_stopped()
        report_restores(True)
        ctx.status.detach()
        ctx.books.workers_stopped(a.generation, group.stuck)


def _watch(ctx: GenerationContext, group: WorkerGroup, a: Assignment, gdir: Path, peers: PeerWatch,
           report_restores: Callable[[bool], None]) -> Outcome:
    """The executor of the generation's state machine (:mod:`resilient.agent.machine`): observe, let
    :func:`~resilient.agent.machine.transition` decide, carry out its commands (feeding what the ladder answers
    to :func:`~resilient.agent.machine.settle`), until the generation ends."""
    c = ctx.config
    cfg = machine.Settings(preempt_grace_s=c.preempt_grace_s, health_interval_s=c.health_interval_s, health=c.health,
                           sections=c.sections)
    state = machine.WatchState(phase=machine.Phase.RUNNING, next_health=ctx.clock() + c.health_interval_s)
    # The checkpoint location the ranks reported, and the section timeouts for it (saves to S3 ride out retries).
    located: tuple[str | None, SectionTimeouts] = (None, c.sections)
    while True:
        report_restores(False)
        if located[0] != ctx.tracker.checkpoint_location:
            located = (ctx.tracker.checkpoint_location, for_storage(c.sections, ctx.tracker.checkpoint_location))
        observed = _observe(ctx, group, a, gdir, peers, state, located[1])
        plan = machine.transition(state, observed, cfg)
        while plan.commands:
            command, rest = plan.commands[0], replace(plan, commands=plan.commands[1:])
            answer = _carry_out(ctx, group, a, gdir, peers, command)
            if isinstance(command, machine.Adopt):
                a = command.assignment
            plan = machine.settle(rest, command, answer)
        state = plan.state
        if state.phase is machine.Phase.ENDED:
            assert state.outcome is not None
            return state.outcome
        if plan.pause:
            group.pause(c.monitor_interval_s)


def _observe(ctx: GenerationContext, group: WorkerGroup, a: Assignment, gdir: Path, peers: PeerWatch,
             state: machine.WatchState, sections: SectionTimeouts) -> machine.Observation:
    """One pass's inputs.  Reading some has effects the loop relies on: the in-process bookkeeping's pass
    (:func:`~resilient.agent.recover.follow`), the slowness watch's scoring, the health probe when due."""
    c = ctx.config
    now = ctx.clock()
    stopping = state.phase is machine.Phase.STOPPING
    settled = group.settled()
    if settled.failed and ctx.settle_heartbeats is not None:
        ctx.settle_heartbeats()  # what the failed workers sent before they died is in the tracker before it is read
    exits = list(settled.failed)
    failed = tuple(machine.Failed(e.rank, e.returncode) for e in exits)
    news = _news(follow(ctx, group, a, gdir, now)) if not stopping else None
    together = False
    if failed and not stopping and news is None and state.hold is None:
        together = _signalled_with_agent(exits, ctx.asked.stop_requested, ctx.clock, c.signalled_together_s)
    running = {r: w for r, w in group.workers.items() if w.exit is None}
    views = {r: v for r, v in ctx.tracker.views().items() if r in running}
    waiting: list[int] = []
    if ctx.inproc is not None:
        # A rank that said it left the group and waits for the next generation is not hung: its wait is bounded
        # by the recovery timeout (then it exits and fails like a crash).  Across machines the decision on a lost
        # node waits for its peers' probes (or, without them, its presence lease).
        gone = ctx.inproc.waiting_now(a.generation, [w.worker_id for w in group.workers.values()])
        waiting = [r for r, w in group.workers.items() if w.worker_id in gone]
    straggler = None
    # From the same reading as ``failed``: a member killed since then is seen on the next pass, as a failure.
    all_exited = settled.all_exited and group.unchanged_since(settled)
    if ctx.slowness is not None and not stopping and not failed and news is None and not all_exited:
        if peers.detectors is not None:
            ctx.slowness.from_store(peers.detectors)
        warming = ctx.inproc is not None and ctx.inproc.warming_spares() > 0
        ctx.slowness.poll(a.generation, list(running), disturbed=warming)
        straggler = ctx.slowness.take_eviction()
    health = probe(list(c.health_paths)) if now >= state.next_health else None
    return machine.Observation(
        now=now, failed=failed, all_exited=all_exited, members_here=bool(group.workers),
        signalled_together=together, views=views, stats=ctx.tracker.stats, waiting_members=waiting,
        sections=sections, across_machines=ctx.inproc is not None and ctx.inproc.cluster is not None,
        verdict=peers.verdict, quarantined=peers.quarantined.describe() if peers.quarantined is not None else None,
        waiting_nodes=peers.waiting, run_ended=peers.ended, straggler=straggler, news=news,
        recovering=ctx.inproc is not None and ctx.inproc.recovering is not None, interrupted=ctx.asked.interrupted(),
        stop_asked=bool(ctx.asked.stop_requested() or peers.stop or peers.stop_request), health=health)


def _news(followed: str | Assignment | Outcome | None) -> machine.News | None:
    if isinstance(followed, str):
        return machine.RecoveryFailed(followed)
    if isinstance(followed, Assignment):
        return machine.Moved(followed)
    return followed


def _carry_out(ctx: GenerationContext, group: WorkerGroup, a: Assignment, gdir: Path, peers: PeerWatch,
               command: machine.Command) -> Any:
    """Carry out one command of the state machine; what it returns goes to :func:`~resilient.agent.machine.settle`."""
    c = ctx.config
    now = ctx.clock()
    match command:
        case machine.Adopt():
            return None
        case machine.AnswerFailure():
            return end_on_failure(ctx, group, a, gdir, now)
        case machine.ResumeHold(hold=hold):
            again = continue_after(ctx, group, a, gdir, lost=hold.lost, kind=hold.kind, failure=hold.failure,
                                   exit_codes=hold.exit_codes, incident=hold.incident, detected_at=hold.detected_at,
                                   last_progress_at=hold.last_progress_at, hold=hold)
            return again
        case machine.StopOnFailure(ladder=ladder):
            return stop_on_failure(ctx, group, a, ctx.tracker.ranks(), ladder)
        case machine.AnswerHang(hang=hang):
            return end_on_hang(ctx, group, a, gdir, hang, now)
        case machine.FailRecovery(problem=problem):
            return recovery_failed(ctx, group, a, problem, now)
        case machine.EndUnhealthy(reason=reason, problems=problems):
            ctx.emit(EventKind.NODE_UNHEALTHY, reason=reason, problems=list(problems))
            return Outcome(OutcomeKind.UNHEALTHY, reason, incident=unhealthy_incident(
                c.node_id, a.generation, problems, when="while running"))
        case machine.RequestStop():
            return _request_stop(ctx, group, gdir, peers.stop, peers.stop_request)
        case machine.CloseSlowness():
            if ctx.slowness is not None:  # the last windows came just before the exits
                ctx.slowness.poll(a.generation, list(group.workers))
                ctx.slowness.run_ended(a.generation)
            return None
        case machine.Evict(flag=flag):
            return weigh_straggler(ctx, group, a, gdir, dict(flag), now)
    raise AssertionError(f"not a command: {command!r}")


SIGNALLED_POLL_S = 0.02
"""How often :func:`_signalled_with_agent` looks for the agent's own SIGTERM while it waits."""


def _signalled_with_agent(failed: list[Any], stop_requested: Callable[[], str | None], clock: Callable[[], float],
                          window_s: float, sleep: Callable[[float], None] = time.sleep) -> bool:
    """Whether every failed worker died of SIGTERM and this agent got SIGTERM too (``stop_requested``), now or
    within ``window_s`` on ``clock`` (``AgentConfig.signalled_together_s``): a scheduler that signals every
    process of the job (Slurm's preemption, ``scontrol requeue``, scancel) is ending it; that is a stop, not a
    failure to restart from.  Waits with ``sleep``, never past the window."""
    if not failed or any(e.signal != signal.SIGTERM for e in failed):
        return False
    deadline = clock() + window_s
    while not stop_requested():
        left = deadline - clock()
        if left <= 0:
            return False
        sleep(min(SIGNALLED_POLL_S, left))
    return True


def _request_stop(ctx: GenerationContext, group: WorkerGroup, gdir: Path, shared: dict[str, Any] | None,
                  request: dict[str, Any] | None) -> int:
    """Ask every worker to commit at a step that no rank has reached yet, then exit."""
    if shared is not None:
        stop_at, reason = int(shared["stop_at_step"]), str(shared.get("reason", "stop requested by a peer"))
    else:
        views = ctx.tracker.views()
        furthest = max([v.step for v in views.values()] + [ctx.tracker.max_step])
        asked = ctx.asked.stop_requested() or (request and str(request.get("reason", ""))) or "stop requested"
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
