"""The node agent's loop: rendezvous, start the workers, watch them, decide, repeat.

Composed, not inherited: the decisions come from pure policies
(:func:`~resilient.agent.decision.decide`,
:func:`~resilient.watchdog.sections.decide_hang`,
:func:`~resilient.agent.health.assess`), one generation's processes and
watch from :mod:`~resilient.agent.generation`, and the rest from one
collaborator per concern:

* :class:`~resilient.agent.coordination.Coordination`: the control store, the
  launch, presence, the rendezvous, and the facts every node shares (the
  restart budget, the verdict);
* :class:`~resilient.agent.bookkeeping.ProcessBookkeeping`: this node's worker
  processes across generations (the sweep, workers SIGKILL did not end);
* :class:`~resilient.agent.reporting.NodeReporting`: ``status.json`` and ``/metrics``.

The order of things (what the agent does at start, how a generation's
:class:`~resilient.agent.outcome.Outcome` turns into the next move, how it
ends) is :mod:`~resilient.agent.lifecycle`'s, a pure state machine; this
module carries out its commands.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import IO, TYPE_CHECKING, Any

from ..coord import keyspace
from ..coord.store import ControlStoreError
from ..core.events import EventKind, EventLog, OutcomeKind
from ..core.exitcodes import AgentVerdict
from ..metrics.ledger import LedgerConfig
from . import generation as gen_mod
from . import lifecycle, severance
from .accounting import NodeAccounting
from .bookkeeping import ProcessBookkeeping
from .config import AgentConfig
from .context import GenerationContext
from .decision import Restarts
from .control import ControlServer
from .coordination import Coordination
from .failure_rate import failure_rate_env
from .forking import Spawner
from .health import assess, probe
from .heartbeat import HeartbeatReceiver
from .incident_book import IncidentBook
from .incidents import Incident, load_incidents, node_lost_incident, publish_incident, unhealthy_incident
from .inproc import InProcess
from .integration import Offers
from .launch_record import write_launch_record
from .launcher import parent_death_signal
from .memory_replica import PUBLISHED_AS
from .memory_tier import NodeMemory
from .notices import Notices
from .outcome import Outcome
from .policy import FailureMark
from .rendezvous import Assignment, RendezvousClosedError
from .reporting import NodeReporting
from .rundir import RunDir, heartbeat_socket, read_token
from .slowness import SlownessWatch
from .tracker import HeartbeatIntake, RankTracker, stale_events
from .worker_env import base_env

if TYPE_CHECKING:
    from ..coord.quarantine import Standing
    from .restores import RestoreSummary
    from .sweep import Stuck

__all__ = ["Agent", "AgentResult", "heartbeat_socket", "run_agent"]


@dataclass(frozen=True)
class AgentResult:
    """How the agent ended."""

    exit_code: int
    verdict: AgentVerdict
    reason: str
    generation: int
    restarts_used: int


class Agent:
    """Supervises this node's workers for one run until it succeeds or a verdict stops it."""

    def __init__(self, config: AgentConfig, *, clock: Callable[[], float] = time.monotonic,
                 echo_to: IO[str] | None = None) -> None:
        self.config = config
        self.clock = clock
        self.echo_to = echo_to if echo_to is not None else sys.stdout
        self.run_dir = RunDir(config.run_dir, config.node_id)
        created = self.run_dir.create()
        self.token = read_token(config.token_file) if config.token_file is not None else created
        self.events = EventLog(self.run_dir.events)
        write_launch_record(self.run_dir, config)  # for an incident's bundle: the command, settings, versions
        # Before anything else touches the node directory: refuse if an earlier agent still runs there,
        # and kill what an earlier (SIGKILLed) agent left behind.
        self.bookkeeping = ProcessBookkeeping(self.run_dir.node_dir, config.node_id, emit=self.emit,
                                              record_incident=self.record_incident)
        self.memory: NodeMemory | None = None
        """This node's memory tier (:mod:`.memory_tier`); None with ``--no-memory-tier``."""
        if config.memory_tier:
            self.memory = NodeMemory(config.memory_root, run_id=config.run_id, node_id=config.node_id,
                                     run_dir=config.run_dir, limit=config.memory_limit, every=config.memory_every,
                                     emit=self.emit, pin_every=config.memory_pin_every if config.memory_replicas else None)
            config = self.config = replace(config, worker_env={**config.worker_env, **self.memory.env()})
        self.tracker = RankTracker(on_stale=stale_events(self.emit))
        self.coordination = Coordination(config, self.run_dir, self.token, emit=self.emit,
                                         on_node_lost=self._node_lost, on_thread_failed=self._thread_failed)
        if self.memory is not None and config.memory_replicas:
            replica = self.memory.replicate(host=config.local_addr, token=self.token, nproc=config.nproc_per_node,
                                            address_of=lambda node: self.coordination.published(node, PUBLISHED_AS),
                                            live=self.coordination.live, threads=self.coordination.threads)
            self.coordination.presence_extra[PUBLISHED_AS] = replica.address
        self._generation = 0
        """The generation this node runs (or ran last); 0 before the first."""
        self.num_nodes = 0
        """Nodes in the generation this node runs (or ran last)."""
        self._quiet = False
        """This node leaves a run that goes on without it (held out by a quarantine, or unhealthy across machines):
        its exit neither ends the launch nor closes the rendezvous."""
        self.stop_requested: str | None = None
        """Set (from a signal handler or another thread) to ask for a graceful stop."""
        self.thread_failure: str | None = None
        """Why the agent stops: one of its threads kept raising (None: none did)."""
        self.interrupted = False
        self._receivers: list[HeartbeatReceiver] = []
        self.accounting = NodeAccounting(self.run_dir.node_dir / "ledger.json",
                                         LedgerConfig(ideal_step_s=config.ideal_step_s))
        if config.store_url is None and self.accounting.resumed:
            # The embedded store lives in this process: continue the generation numbers of the agent that
            # ran before on this run directory, so incident ids and logs do not collide.
            self.coordination.control.put(keyspace.GENERATION, str(self.accounting.ledger.generation).encode())
        self.last_outcome: OutcomeKind | None = None
        """How the previous generation ended; None before the first."""
        self.reporting = NodeReporting(config, self.run_dir, tracker=self.tracker, accounting=self.accounting,
                                       coordination=self.coordination, emit=self.emit, clock=clock)
        self.notices = Notices(self.emit, lambda step: self.accounting.apply("resume_accepted", step),
                               Offers(spares=config.spares, shrinkable=config.shrinkable or config.min_nodes < config.max_nodes,
                                      in_process=config.in_process, restart_args=bool(config.restart_args)))
        """What the workers' Runs asked the agent to say (a config change, a diverged resume, the integration)."""
        self.reporting.status.notices = self.notices.view
        self.incidents = IncidentBook(self.run_dir, self.coordination.signed, self.emit,
                                      counted=self.accounting.incident_recorded,
                                      restore_shown=lambda record: setattr(self.reporting.status, "restore", record))
        self.inproc: InProcess | None = None
        """In-process recovery (``--spares``, ``--nproc-per-node MIN:MAX``); None: restarts only."""
        self._restart_incidents: set[str] = set()
        """The incidents this agent answered by a restart: what they cost is what the ladder weighs a restart at."""
        if config.offers_in_process:
            self.inproc = InProcess(config, self.emit, clock)
            self.inproc.restart_costs = lambda: self.accounting.restart_costs(self._restart_incidents)
            self.reporting.spares_ready = self.inproc.ready_spares
            self.reporting.status.recovery = self.inproc.view
        self.gate = self.coordination.quarantine_gate(self.run_dir.node_dir, self.reporting.status.set_phase)
        """Across machines: the fleet's quarantine as this node obeys it; None on one machine."""
        self.reporting.status.quarantine = self.gate.view if self.gate is not None else None
        if self.memory is not None:
            self.reporting.status.memory = self.memory.view
            self.reporting.memory = self.memory
        self.reporting.slowness = self.slowness = self._slowness_watch()
        self.spawner = Spawner(enabled=config.fork_server,
                               base_env=base_env(config), preload=config.preload,
                               log_file=self.run_dir.node_dir / "forkserver.log",
                               unavailable=lambda reason: self.emit(EventKind.FORK_SERVER_UNAVAILABLE, reason=reason))
        """Starts the workers: forked from a process that has imported torch when it can."""

    def _slowness_watch(self) -> SlownessWatch:
        """Straggler and slowdown detection for this node: its config, its incidents, its ledger's seconds and ideal,
        and (across machines) the quarantine of its node when a straggler flag persists."""
        c, gate = self.config, self.gate

        def publish(incident: Incident) -> None:
            publish_incident(incident, self.run_dir, self.coordination.signed, self.emit)

        return SlownessWatch(
            c.node_id, self.emit, straggler=c.straggler, slowdown=c.slowdown, record=self.record_incident,
            publish=publish, ledger_seconds=lambda: self.accounting.account().seconds,
            freeze_ideal=lambda frozen: self.accounting.apply("freeze_ideal", frozen),
            persistent=None if gate is None else lambda flag: gate.persistent_straggler(
                flag, can_leave=self.num_nodes > c.min_nodes),
            persist_windows=c.quarantine.straggler_windows,
            evict_windows=c.evict.after_windows if c.evict.enabled else 0)

    # ------------------------------------------------------------ plumbing
    def emit(self, kind: EventKind, **fields: Any) -> None:
        self.events.emit(kind, node=self.config.node_id, **fields)

    def install_signal_handlers(self) -> None:
        """SIGTERM: commit a checkpoint and stop gracefully.  SIGINT: stop now."""

        def on_term(signum: int, frame: object) -> None:
            self.stop_requested = f"signal {signal.Signals(signum).name}"

        def on_int(signum: int, frame: object) -> None:
            self.interrupted = True

        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGINT, on_int)

    def _thread_failed(self, name: str, error: str) -> None:
        """A supervised thread kept raising: stop the run gracefully, ending with the ``agent_thread_failed``
        verdict (an agent without that thread would look alive and no longer do its part)."""
        self.thread_failure = f"the agent's {name} thread kept failing ({error})"
        self.stop_requested = self.thread_failure

    def _on_stop_request(self, reason: str) -> None:
        self.emit(EventKind.STOP_REQUEST_RECEIVED, reason=reason)
        self.stop_requested = reason

    def _node_lost(self, node: str, why: str) -> None:
        """A peer was judged lost (:mod:`resilient.coord.liveness`): record a node_lost incident, and end this
        node's workers' connections to it, so that none waits in a collective on a peer that cannot answer."""
        generation = self._generation
        host = self.coordination.peer_host(node)
        # First what frees a blocked collective (local and quick), then what is written down.
        workers = severance.children() + (severance.children(self.spawner.server_pid)
                                          if self.spawner.server_pid is not None else [])
        severed = severance.sever(workers, host, self.config.local_addr) if host is not None else []
        self.emit(EventKind.NODE_LOST, lost_node=node, generation=generation, why=why)
        for cut in severed:
            self.emit(EventKind.PEER_CONNECTIONS_SEVERED, lost_node=node, pid=cut.pid, sockets=cut.sockets,
                      problem=cut.problem)
        self.record_incident(node_lost_incident(node, self.config.node_id, generation, why))

    def record_incident(self, incident: Incident) -> None:
        """Every incident goes through here: its file, event and store copy, and its count in the metrics."""
        self.incidents.record(incident)

    def generation_context(self) -> GenerationContext:
        """The pieces of this agent a generation works with."""
        shared = self.coordination.shared
        assert shared is not None
        return GenerationContext(
            config=self.config, run_dir=self.run_dir, launch_id=shared.launch_id, clock=self.clock,
            echo_to=self.echo_to, tracker=self.tracker, accounting=self.accounting, status=self.reporting.status,
            shared=shared, emit=self.emit, asked=_Asked(self), books=_Books(self), generations=_Generations(self),
            inproc=self.inproc, slowness=self.slowness, spawner=self.spawner,
            settle_heartbeats=self._settle_heartbeats, threads=self.coordination.threads,
            timing_link=self.coordination.timing_link,
        )

    def _settle_heartbeats(self) -> None:
        for receiver in self._receivers:
            receiver.settle()

    def restarts(self) -> Restarts:
        """The run's restart history now (from the store: other generations' restarts) and the policy's bounds."""
        history = self.coordination.history(self.tracker.committed_step, exclude_generation=self._generation)
        return Restarts(history, self.config.restart)

    def next_generation(self) -> int:
        """The run's next generation number, for a generation formed in process (no rendezvous round)."""
        self._generation = self.coordination.next_generation()
        return self._generation

    # ------------------------------------------------------------ the loop
    def run(self) -> AgentResult:
        """Carry out the lifecycle's moves (:mod:`resilient.agent.lifecycle`) until it ends the agent."""
        c = self.config
        self.emit(EventKind.AGENT_STARTED, run_id=c.run_id, nproc_per_node=c.nproc_per_node,
                  nnodes=[c.min_nodes, c.max_nodes], store=c.store_url or "embedded", entrypoint=list(c.entrypoint))
        # One socket per local rank: a unix datagram queue holds only a few messages (10 here), or heartbeats are lost.
        intake = HeartbeatIntake(self.tracker, self.accounting, on_report=self.slowness.take,
                                 on_recovery=self.inproc.on_message if self.inproc is not None else None,
                                 on_notice=lambda hb: self.notices.take(hb.rank, hb.generation, hb.notice or {}))
        # Spares have sockets of their own (slots after the ranks'); a replacement takes a dead process's slot.
        slots = c.nproc_per_node + (c.spares if self.inproc is not None else 0)
        self._receivers = [HeartbeatReceiver(heartbeat_socket(self.run_dir, slot), intake, clock=self.clock,
                                             threads=self.coordination.threads) for slot in range(slots)]
        self.accounting.apply("agent_started")
        self.reporting.start()
        self.bookkeeping.report_swept(self.accounting.ledger.generation or 0)
        control = ControlServer(self.run_dir.socket_path("control.sock"), self.token, self.reporting.status.snapshot,
                                self._on_stop_request, self.slowness, threads=self.coordination.threads)
        try:
            move = lifecycle.begin(spare=c.role == "spare", policy=c.restart)
            while True:
                answer: Any = None
                for command in move.commands:
                    answer = self._carry_out(command)
                if isinstance(answer, AgentResult):
                    return answer
                move = lifecycle.next_move(move.life, answer)
        finally:
            control.close()
            self.accounting.apply("finished")
            self.reporting.stop()
            for receiver in self._receivers:
                receiver.close()
            self.run_dir.remove_socket_dir()
            if self.inproc is not None:
                self.inproc.leave_launch()
                self.inproc.close()
            if self.memory is not None and self.memory.replication is not None:
                self.memory.replication.close()
            self.coordination.close(leave_run_open=self._quiet)
            if self.gate is not None:
                self.gate.close()
            self.spawner.close()
            self.bookkeeping.release()

    def _carry_out(self, command: lifecycle.Command) -> Any:
        """Carry out one command of the lifecycle; what it returns is the next event (or, at the end, the result)."""
        match command:
            case lifecycle.JoinLaunch():
                # From this thread, which starts the workers too: the server dies with it (parent-death signal).
                self.spawner.start(parent_death_signal())
                problem = self.coordination.join_launch()
                if self.memory is not None and self.memory.replication is not None:
                    self.memory.replication.start()
                return lifecycle.LaunchJoined(problem)
            case lifecycle.MakeRendezvous():
                self.coordination.make_rendezvous()
            case lifecycle.FollowLaunch():
                self._attach_cluster()
            case lifecycle.Check():
                return self._check()
            case lifecycle.GiveFailureRate():
                self._give_failure_rate()
            case lifecycle.Rendezvous():
                return self._rendezvous()
            case lifecycle.AwaitGeneration():
                return self._await_generation()
            case lifecycle.RunGeneration(assignment=a, restart=restart):
                return self._run_generation(a, restart)
            case lifecycle.TakePlace(outcome=outcome):
                self._take_place(outcome)
            case lifecycle.LeaveRendezvous():
                self.coordination.leave_rendezvous()
            case lifecycle.MembershipChanged(generation=generation, reason=reason):
                self.emit(EventKind.MEMBERSHIP_CHANGED, generation=generation, reason=reason)
                self.accounting.restarted("membership")
            case lifecycle.ReadHistory(outcome=outcome):
                return lifecycle.HistoryRead(outcome, self.restarts().history, self.clock())
            case lifecycle.RecordFailure(outcome=outcome, decision=decision):
                assert outcome.incident is not None
                incident = outcome.incident.with_decision(decision)
                self.record_incident(incident)
                self.accounting.failure(outcome.detected_at, outcome.last_progress_at, incident.id, incident.kind)
            case lifecycle.Restart():
                self._restart(command)
            case lifecycle.PublishVerdict(ending=ending):
                self.coordination.publish_verdict(ending.verdict, ending.reason, ending.code)
            case lifecycle.StepOut(incident=incident, reason=reason):
                self._step_out(incident, reason)
            case lifecycle.Say(kind=kind, fields=fields):
                self.emit(kind, **dict(fields))
            case lifecycle.Finish(ending=ending, generation=generation, from_launch=from_launch):
                published = self.coordination.verdict() if from_launch else None
                return self._finish(lifecycle.Ending.published(published) if published is not None else ending,
                                    generation)
            case _:
                raise AssertionError(f"not a command: {command!r}")
        return None

    def _check(self) -> lifecycle.Checked:
        """The checks before a round, in their order; the first that finds something ends the reading."""
        c = self.config
        verdict = self.coordination.verdict()
        if verdict is not None:
            return lifecycle.Checked(verdict=verdict)
        if self.bookkeeping.has_stuck():
            # No new workers beside ones SIGKILL did not end: wait for them, or stop with ``unhealthy``.
            self.reporting.status.phase = "waiting for stuck workers to end"
            reason = self.bookkeeping.await_stuck()
            if reason is not None:
                return lifecycle.Checked(stuck=reason)
        health = assess(probe(list(c.health_paths)), c.health)
        if not health.healthy:
            self.emit(EventKind.NODE_UNHEALTHY, reason=health.reason, problems=list(health.problems))
            return lifecycle.Checked(unhealthy=unhealthy_incident(c.node_id, self._generation, health.problems,
                                                                  when="before starting workers"),
                                     unhealthy_reason=health.reason)
        stopping = lambda: bool(self.stop_requested or self.interrupted)
        held = self.gate.hold(stopping, self.coordination.run_over, burn_in_at_start=c.quarantine.burn_in_at_start) \
            if self.gate is not None else None
        if held is not None:  # the run goes on (or ended) without this node: leave it as it is
            self._quiet = True
            return lifecycle.Checked(held=held)
        return lifecycle.Checked(stopping=stopping())

    def _rendezvous(self) -> lifecycle.Assigned | lifecycle.RoundFailed:
        rendezvous = self.coordination.rendezvous
        assert rendezvous is not None
        self.reporting.status.phase = "rendezvous"
        try:
            assignment = rendezvous.next()
        except Exception as e:  # RendezvousClosedError, RendezvousTimeoutError, the store's errors
            error = f"{type(e).__name__}: {e}"
            verdict = self.coordination.verdict()
            if verdict is not None:
                return lifecycle.RoundFailed(error, verdict=verdict)
            if not isinstance(e, RendezvousClosedError):
                return lifecycle.RoundFailed(error)
            if self.coordination.stale_launch(self._generation):
                return lifecycle.RoundFailed(error, retried=True)
            return lifecycle.RoundFailed(error, over=self.coordination.run_over() if self._generation > 0 else None)
        self._generation, self.num_nodes = assignment.generation, assignment.num_nodes
        self.emit(EventKind.RENDEZVOUS_JOINED, generation=assignment.generation, node_rank=assignment.node_rank,
                  num_nodes=assignment.num_nodes, master=f"{assignment.master_addr}:{assignment.master_port}")
        self._attach_cluster()
        if self.memory is not None and self.memory.replication is not None:  # a moved rank's memory state
            self.memory.replication.stage(assignment.node_rank, assignment.members, assignment.previous,
                                          assignment.generation)
        return lifecycle.Assigned(assignment)

    def _await_generation(self) -> lifecycle.Opened | lifecycle.Released:
        """A spare node: wait until the run starts a generation after the one this node followed last."""
        assert self.inproc is not None and self.inproc.cluster is not None
        self.reporting.status.phase = "waiting for the run to start a generation"
        while True:
            if self.stop_requested or self.interrupted:
                return lifecycle.Released(stopped=True)
            current = None
            try:
                verdict = self.coordination.verdict()
                if verdict is not None:
                    return lifecycle.Released(verdict=verdict)
                assert self.coordination.shared is not None
                if self.coordination.shared.ended():
                    return lifecycle.Released(ended=True)
                current = self.inproc.cluster.store.current()
            except ControlStoreError as e:  # an outage: keep waiting, as the members do
                self.emit(EventKind.STORE_UNREACHABLE, error=f"{type(e).__name__}: {e}")
            if current is not None and current > self._generation:
                self._generation = current
                return lifecycle.Opened(current)
            time.sleep(0.2)

    def _run_generation(self, assignment: Assignment, restart: bool) -> lifecycle.GenerationEnded:
        outcome = gen_mod.run_generation(self.generation_context(), assignment, self.coordination.restarts_used(),
                                         restart=restart)
        self.last_outcome = outcome.kind
        self.accounting.apply("generation_ended", outcome.kind)
        return lifecycle.GenerationEnded(outcome, self._followed())  # an in-process recovery may have moved it on

    # ------------------------------------------------------------ across machines
    def _attach_cluster(self) -> None:
        """Across machines: follow the joined launch's recovery keys in the store."""
        if self.inproc is not None and self.config.multi_node:
            self.inproc.follow_launch(self.coordination.cluster_store(), self.coordination.threads)

    def _followed(self) -> int:
        """The newest generation this node took part in (across machines another node may have numbered it)."""
        if self.inproc is not None and self.inproc.cluster is not None:
            self._generation = max(self._generation, self.inproc.cluster.following)
        return self._generation

    def _take_place(self, outcome: Outcome) -> None:
        """This spare node takes a lost node's place in the run's restart: from here on it is a node of the run
        (it joins the restart's rendezvous and runs ranks), as the lost node was."""
        self.config = replace(self.config, role="worker")
        self.emit(EventKind.SPARE_NODE_TAKES_PLACE, generation=self._generation, lost_node=outcome.takes_place_of,
                  reason=outcome.reason)
        print(f"resilient: {outcome.reason}", file=sys.stderr, flush=True)

    def _give_failure_rate(self) -> None:
        """``--mtbf``: the failure rate the next generation's workers compute their save interval from."""
        c = self.config
        if c.mtbf_s is None and not c.mtbf_from_history:
            return
        records: list[dict[str, Any]] = []
        if c.mtbf_from_history:
            records = load_incidents(self.run_dir.incidents)
            try:
                records += list(self.coordination.signed.get_prefix(keyspace.INCIDENTS).values())
            except Exception as e:
                self.emit(EventKind.STORE_UNREACHABLE, error=f"{type(e).__name__}: {e}")
        start = self.accounting.ledger.start_t
        env = failure_rate_env(mtbf_s=c.mtbf_s, from_history=c.mtbf_from_history, records=records,
                               exposure_s=self.accounting.now() - start if start is not None else 0.0)
        self.config = replace(c, worker_env={**c.worker_env, **env})

    def _step_out(self, incident: Incident | None, reason: str) -> None:
        """This node is unhealthy: across machines it is quarantined first, so that it burns in to come back."""
        if incident is not None:
            self.record_incident(incident)
        if self.gate is not None:
            self._quiet = True  # the others go on without this node
            self.gate.add(reason=f"unhealthy: {reason}", source="health",
                          evidence={"incident": incident.id if incident is not None else None})

    def _restart(self, command: lifecycle.Restart) -> None:
        outcome, decision, generation = command.outcome, command.decision, command.generation
        assert outcome.failure is not None and outcome.incident is not None
        incident = outcome.incident.with_decision(decision)
        self.incidents.restart_incident = incident
        self._restart_incidents.add(incident.id)
        self.coordination.count_restart(generation, decision.reason, self.tracker.committed_step,
                                        FailureMark.of(outcome.failure))
        self.accounting.restarted(outcome.failure.kind)
        self.emit(EventKind.RESTART, generation=generation, reason=decision.reason, delay_s=decision.delay_s,
                  restarts_used=self.coordination.restarts_used())
        if decision.delay_s > 0:
            time.sleep(decision.delay_s)

    def _finish(self, ending: lifecycle.Ending, generation: int) -> AgentResult:
        ending = lifecycle.final(ending, self.thread_failure)
        self._quiet = self._quiet or ending.quiet
        if ending.verdict in (AgentVerdict.SUCCEEDED, AgentVerdict.PREEMPTED) and not self._quiet:
            self.coordination.end_launch(f"{ending.verdict} (node {self.config.node_id})")
        if self.memory is not None:  # the run ended here: nothing restores from the memory tier again
            self.memory.release(ending.verdict)
        result = AgentResult(ending.code, ending.verdict, ending.reason, generation, self.coordination.restarts_used())
        self.reporting.status.phase = f"finished: {ending.verdict}"
        self.emit(EventKind.AGENT_FINISHED, exit_code=ending.code, verdict=ending.verdict, reason=ending.reason,
                  generation=generation, restarts_used=result.restarts_used)
        return result


class _Asked:
    """What a generation is asked from outside it (:class:`~resilient.agent.context.Asked`), from its agent."""

    def __init__(self, agent: Agent) -> None:
        self._agent = agent

    def stop_requested(self) -> str | None:
        return self._agent.stop_requested

    def interrupted(self) -> bool:
        return self._agent.interrupted

    def nodes_waiting(self) -> int:
        rendezvous = self._agent.coordination.rendezvous
        return rendezvous.num_nodes_waiting() if rendezvous is not None else 0

    def quarantined(self) -> Standing | None:
        gate = self._agent.gate
        return gate.check() if gate is not None else None


class _Books:
    """Where a generation records what happened (:class:`~resilient.agent.context.Books`): its agent's books."""

    def __init__(self, agent: Agent) -> None:
        self._agent = agent

    def workers_started(self, generation: int, pids: dict[int, int]) -> None:
        self._agent.bookkeeping.workers_started(generation, pids)

    def workers_stopped(self, generation: int, stuck: tuple[Stuck, ...]) -> None:
        self._agent.bookkeeping.workers_stopped(generation, stuck)

    def restored(self, summary: RestoreSummary) -> None:
        self._agent.incidents.restored(summary)

    def record_incident(self, incident: Incident) -> None:
        self._agent.incidents.record_open(incident)

    def recovered(self, incident_id: str, record: dict[str, Any]) -> None:
        self._agent.incidents.recovered(incident_id, record)


class _Generations:
    """The run's restarts and generations (:class:`~resilient.agent.context.Generations`), from its agent."""

    def __init__(self, agent: Agent) -> None:
        self._agent = agent

    def restarts(self) -> Restarts:
        return self._agent.restarts()

    def next_generation(self) -> int:
        return self._agent.next_generation()


def run_agent(config: AgentConfig, *, install_signals: bool = True) -> AgentResult:
    """Build an agent, run it to the end and return how it ended."""
    agent = Agent(config)
    if install_signals and threading.current_thread() is threading.main_thread():
        agent.install_signal_handlers()
    return agent.run()
