"""The node agent: rendezvous, start the workers, watch them, decide, repeat.

Composed, not inherited: the decisions come from pure policies
(:func:`~resilient.agent.policy.decide_restart`,
:func:`~resilient.watchdog.sections.decide_hang`,
:func:`~resilient.agent.health.assess`), the processes from
:class:`~resilient.agent.launcher.WorkerGroup`, membership from
:class:`~resilient.agent.rendezvous.Rendezvous`, and shared facts (the
restart budget, the verdict, a stop request) from the control store, so
that every node of a run counts and decides the same way.  Those facts
belong to this submission's launch (:mod:`resilient.coord.launch`) and carry
the run token's proof (:mod:`resilient.coord.proof`); the generation counter
and incidents belong to the run.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

from ..coord.launch import begin_launch
from ..coord.proof import SignedStore
from ..coord.store import ControlStoreError
from ..events import EventLog
from ..exitcodes import EXIT_CONFIG, EXIT_PREEMPTED_AGENT, EXIT_STOPPED, EXIT_UNHEALTHY
from ..metrics.ledger import LedgerConfig
from ..worker.protocol import Heartbeat
from . import generation as gen_mod
from .accounting import NodeAccounting
from .config import AgentConfig
from .control import ControlServer
from .generation import GenerationContext, Outcome
from .health import assess, probe
from .heartbeat import HeartbeatReceiver
from .incidents import Incident, stuck_incident, unhealthy_incident
from .policy import Action, History, decide_restart
from .rendezvous import Rendezvous, embedded_rendezvous, etcd_rendezvous
from .rundir import RunDir, read_token
from .shared import SharedFacts
from .status import StatusPublisher
from .sweep import GIVE_UP_AFTER_S, NodeProcesses, Stuck
from .tracker import HeartbeatIntake, RankTracker


@dataclass(frozen=True)
class AgentResult:
    """How the agent ended."""

    exit_code: int
    verdict: str
    """"succeeded", "preempted", "budget_exhausted", "crash_loop", "do_not_restart", "unhealthy", ..."""
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
        # Before anything else touches the node directory: refuse if an earlier agent still runs there,
        # and kill what an earlier (SIGKILLed) agent left behind.
        self.processes = NodeProcesses(self.run_dir.node_dir)
        swept = self.processes.claim()
        if swept.killed:
            self.emit("leftovers_swept", previous_agent=swept.previous_agent, pids=list(swept.killed),
                      stuck=[s.describe() for s in swept.stuck])
        self._stuck: tuple[Stuck, ...] = swept.stuck
        self.tracker = RankTracker(on_stale=self._on_stale_heartbeat)
        self.control = self._control_store()
        self.signed = SignedStore(self.control, self.token, on_rejected=self._on_rejected_write)
        self.shared: SharedFacts | None = None
        self._presence: Any = None
        self._launch_retried = False
        self._generation = 0
        """This launch's shared facts; set once the agent has joined a launch."""
        self._restarts_used_cached = 0
        self._peak_flops: float | None = None
        self.stop_requested: str | None = None
        """Set (from a signal handler or another thread) to ask for a graceful stop."""
        self.interrupted = False
        self._receivers: list[HeartbeatReceiver] = []
        self.rendezvous: Rendezvous | None = None
        self.accounting = NodeAccounting(self.run_dir.node_dir / "ledger.json",
                                         LedgerConfig(ideal_step_s=config.ideal_step_s))
        if config.store_url is None and self.accounting.resumed:
            # The embedded store lives in this process: continue the generation numbers of the agent that
            # ran before on this run directory, so incident ids and logs do not collide.
            self.control.put("generation", str(self.accounting.ledger.generation).encode())
        self.metrics: Any = None
        self.last_outcome: str | None = None
        """How the previous generation ended ("failed", "membership", ...); None before the first."""
        self.status = StatusPublisher(
            config, status_file=self.run_dir.status_file, control_socket=self.run_dir.socket_path("control.sock"),
            tracker=self.tracker, accounting=self.accounting, restarts_used=lambda: self._restarts_used_cached,
            refresh_restarts=self.restarts_used, store_put=self.control.put if config.store_url is not None else None,
            emit=self.emit, clock=clock)

    # ------------------------------------------------------------ plumbing
    def emit(self, kind: str, **fields: Any) -> None:
        self.events.emit(kind, node=self.config.node_id, **fields)

    def _control_store(self) -> Any:
        if self.config.store_url is None:
            from ..coord.store import MemoryControlStore

            return MemoryControlStore()
        from ..coord.etcd import EtcdClient, EtcdConfig
        from ..coord.store import EtcdControlStore

        etcd = EtcdConfig.from_url(self.config.store_url, **self.config.etcd_options)  # type: ignore[arg-type]
        self._etcd_config = etcd
        client = EtcdClient(etcd, on_outage=lambda event, detail: self.emit(f"store_outage_{event}", detail=detail))
        self._etcd_client = client
        return EtcdControlStore(client, f"/resilient/{self.config.run_id}/")

    def install_signal_handlers(self) -> None:
        """SIGTERM: commit a checkpoint and stop gracefully.  SIGINT: stop now."""

        def on_term(signum: int, frame: object) -> None:
            self.stop_requested = f"signal {signal.Signals(signum).name}"

        def on_int(signum: int, frame: object) -> None:
            self.interrupted = True

        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGINT, on_int)

    def _on_stale_heartbeat(self, hb: Heartbeat, current: int | None) -> None:
        self.emit("stale_heartbeat", pid=hb.pid, rank=hb.rank, generation=hb.generation, current_generation=current,
                  reason="not from this generation's worker: ignored by hang detection and the ledger")

    def workers_started(self, generation: int, pids: dict[int, int]) -> None:
        """Record the new workers for a later agent's sweep."""
        self.processes.record_workers(generation, pids)

    def workers_stopped(self, generation: int, stuck: tuple[Stuck, ...]) -> None:
        """After a generation's workers were stopped: report any that SIGKILL did not end."""
        self.processes.workers_stopped(generation, stuck)
        if stuck:
            self._stuck = stuck
            self.record_incident(stuck_incident(self.config.node_id, generation, stuck,
                                                         after="after stopping the workers", wait_s=GIVE_UP_AFTER_S))

    def _await_stuck(self, generation: int) -> AgentResult | None:
        """No new workers beside ones SIGKILL did not end: wait for them, or stop with ``unhealthy``."""
        stuck, self._stuck = self._stuck, ()
        if not stuck:
            return None
        self.status.phase = "waiting for stuck workers to end"
        left = self.processes.wait_stuck(stuck, GIVE_UP_AFTER_S)
        if not left:
            self.emit("stuck_workers_gone", pids=[s.pid for s in stuck])
            return None
        reason = (f"{'; '.join(s.describe() for s in left)} after waiting {GIVE_UP_AFTER_S:.0f} s: the node needs "
                  "attention (a hung filesystem or driver); no new workers start beside it")
        self.emit("node_unhealthy", reason=reason, problems=[s.describe() for s in left])
        return self._finish(EXIT_UNHEALTHY, "unhealthy", reason, generation)

    def node_view(self) -> Any:
        """What a metrics scrape reports, computed now from the ledger and the agent's counters."""
        from ..metrics.exporter import NodeView
        from .accounting import job_mfu

        acc, a = self.accounting, self.accounting.account()
        c = self.config
        return NodeView(
            run_id=c.run_id, node=c.node_id, now=acc.now(), account=a,
            restarts_by_reason=dict(acc.restarts_by_reason), hangs=acc.hangs,
            incidents_by_kind=dict(acc.incidents_by_kind), restarts_used=self._restarts_used_cached,
            restart_budget=c.restart.max_restarts, generation=a.generation or 0, world_size=a.world_size or 0,
            full_world_size=c.max_nodes * c.nproc_per_node, checkpoint_duration_s=acc.checkpoint_duration_s,
            checkpoint_bytes=acc.checkpoint_bytes, checkpoint_failures=acc.checkpoint_failures,
            stall_threshold_s=c.stall_alert_after_s, goodput_objective=c.goodput_objective,
            flops_per_step=c.flops_per_step,
            peak_flops=self._peak_flops * c.nproc_per_node if self._peak_flops is not None else None,
            mfu=job_mfu(a, c.flops_per_step, self._peak_flops),
        )

    def _start_metrics(self) -> None:
        from ..metrics.exporter import MetricsServer
        from .accounting import device_peak_flops

        c = self.config
        self._peak_flops = device_peak_flops(c.peak_flops_per_device)
        if c.metrics_port is None:
            return
        self.metrics = MetricsServer(self.node_view, addr=c.metrics_addr, port=c.metrics_port)
        self.emit("metrics_listening", port=self.metrics.port, url=self.metrics.url)
        print(f"resilient: metrics for node {c.node_id} at {self.metrics.url}", file=sys.stderr, flush=True)

    def _on_rejected_write(self, key: str, problem: str) -> None:
        self.emit("store_write_rejected", key=key, problem=problem,
                  hint="only holders of the run token may change the run; this entry is ignored")

    def _on_stop_request(self, reason: str) -> None:
        self.emit("stop_request_received", reason=reason)
        self.stop_requested = reason

    def _make_rendezvous(self) -> Rendezvous:
        c = self.config
        if c.store_url is None:
            return embedded_rendezvous(c.run_id, self.control, c.rendezvous, c.local_addr)
        assert self.shared is not None, "join a launch before its rendezvous"
        return etcd_rendezvous(self._etcd_config, c.run_id, self.control, c.min_nodes, c.max_nodes, c.rendezvous,
                               c.local_addr, self.shared.launch_id)

    def _join_launch(self) -> str | None:
        """Check the token against the run's and agree on the launch; returns a problem, or None."""
        c = self.config
        problem = self.signed.check_fingerprint()
        if problem is not None:
            token_file = c.token_file or self.run_dir.token_file
            return (f"{problem}: {token_file} does not match the token the run's first agent published. Copy "
                    "<run_dir>/token from that node to every node (or pass --token-file FILE with it); if no "
                    f"agent of run {c.run_id} holds that token any more, delete key "
                    f"/resilient/{c.run_id}/token_fingerprint")
        decision = begin_launch(self.signed, c.launch_id)
        self.shared = SharedFacts(self.signed, decision.launch_id, c.node_id, c.restart.budget_scope)
        self.emit("launch_joined", launch_id=decision.launch_id, action=decision.action, reason=decision.reason)
        if c.store_url is not None:
            from ..coord.presence import Presence

            self._presence = Presence(
                self._etcd_client, f"/resilient/{c.run_id}/{self.shared.prefix}nodes/", c.node_id, self._node_lost,
                lambda error: self.emit("store_unreachable", error=error))
            self._presence.start()
        return None

    def _stale_launch(self, generation: int) -> bool:
        """The joined launch's rendezvous was closed before this agent ran anything in it: the launch is over.

        A submission that ended without marking its launch (SIGINT, a node that stepped out) leaves a
        closed rendezvous behind; the next submission then ends that launch and starts a new one, once.
        """
        if generation != 0 or self._launch_retried or self.config.launch_id is not None or self.shared is None:
            return False
        self._launch_retried = True
        self.shared.end("its rendezvous was closed")
        if self.rendezvous is not None:
            self.rendezvous.shutdown()
        if self._presence is not None:
            self._presence.leave()
        if self._join_launch() is not None:
            return False
        self.rendezvous = self._make_rendezvous()
        return True

    def _node_lost(self, node: str) -> None:
        """A peer's presence lease expired: record a node_lost incident (once per node and generation)."""

        generation = self._generation
        summary = (f"node {node} was lost: its agent's presence lease in the store expired "
                   f"(seen by node {self.config.node_id} in generation {generation})")
        incident = Incident(id=f"g{generation:04d}-{node}-lost", node=node, generation=generation, kind="node_lost",
                            rank=None, pid=None, section=None, step=None, summary=summary)
        self.emit("node_lost", lost_node=node, generation=generation)
        self.record_incident(incident)

    def generation_context(self) -> GenerationContext:
        """The pieces of this agent a generation works with."""
        assert self.shared is not None
        rendezvous = self.rendezvous
        return GenerationContext(
            config=self.config, run_dir=self.run_dir, launch_id=self.shared.launch_id, clock=self.clock,
            echo_to=self.echo_to, tracker=self.tracker, accounting=self.accounting, status=self.status,
            shared=self.shared, emit=self.emit,
            waiting=(lambda: rendezvous.num_nodes_waiting()) if rendezvous is not None else (lambda: 0),
            stop_requested=lambda: self.stop_requested, interrupted=lambda: self.interrupted,
            workers_started=self.workers_started, workers_stopped=self.workers_stopped,
        )

    def record_incident(self, incident: Incident) -> None:
        gen_mod.record_incident(incident, self.run_dir, self.control, self.emit)

    # ------------------------------------------------------------ the loop
    def run(self) -> AgentResult:
        c = self.config
        self.emit("agent_started", run_id=c.run_id, nproc_per_node=c.nproc_per_node, nnodes=[c.min_nodes, c.max_nodes],
                  store=c.store_url or "embedded", entrypoint=list(c.entrypoint))
        # One socket per local rank: a unix datagram queue holds only a few messages
        # (net.unix.max_dgram_qlen, 10 here), so ranks sharing one would lose heartbeats.
        intake = HeartbeatIntake(self.tracker, self.accounting)
        self._receivers = [HeartbeatReceiver(heartbeat_socket(self.run_dir, local), intake, clock=self.clock)
                           for local in range(c.nproc_per_node)]
        self.accounting.apply("agent_started")
        self._start_metrics()
        if self.metrics is not None:
            self.status.metrics_url = self.metrics.url
        self.status.start()
        if self._stuck:  # found by the sweep at start
            self.record_incident(stuck_incident(c.node_id, self.accounting.ledger.generation or 0,
                                                         self._stuck, after="after sweeping an earlier agent's "
                                                         "workers", wait_s=GIVE_UP_AFTER_S))
        control = ControlServer(self.run_dir.socket_path("control.sock"), self.token, self.status.snapshot,
                                self._on_stop_request)
        generation = 0
        try:
            problem = self._join_launch()
            if problem is not None:
                self.emit("token_mismatch", reason=problem)
                return self._finish(EXIT_CONFIG, "token_mismatch", problem, generation)
            self.rendezvous = self._make_rendezvous()
            while True:
                verdict = self.shared_verdict()
                if verdict is not None:
                    return self._finish(verdict["exit_code"], verdict["verdict"], verdict["reason"], generation)
                gave_up = self._await_stuck(generation)
                if gave_up is not None:
                    return gave_up
                health = assess(probe(list(c.health_paths)), c.health)
                if not health.healthy:
                    self.emit("node_unhealthy", reason=health.reason, problems=list(health.problems))
                    self.record_incident(unhealthy_incident(c.node_id, generation, health.problems,
                                                                     when="before starting workers"))
                    return self._finish(EXIT_UNHEALTHY, "unhealthy", health.reason, generation)
                if self.stop_requested or self.interrupted:
                    return self._finish(EXIT_PREEMPTED_AGENT, "preempted", "stopped before workers started",
                                        generation)
                self.status.phase = "rendezvous"
                try:
                    assignment = self.rendezvous.next()
                except Exception as e:  # torch raises RendezvousClosedError, RendezvousTimeoutError, ...
                    verdict = self.shared_verdict()
                    if verdict is not None:
                        return self._finish(verdict["exit_code"], verdict["verdict"], verdict["reason"], generation)
                    if type(e).__name__ == "RendezvousClosedError" and self._stale_launch(generation):
                        continue
                    self.emit("rendezvous_failed", error=f"{type(e).__name__}: {e}")
                    return self._finish(EXIT_STOPPED, "rendezvous_failed", f"{type(e).__name__}: {e}", generation)
                generation = self._generation = assignment.generation
                self.emit("rendezvous_joined", generation=generation, node_rank=assignment.node_rank,
                          num_nodes=assignment.num_nodes, master=f"{assignment.master_addr}:{assignment.master_port}")
                outcome = gen_mod.run_generation(self.generation_context(), assignment, self.restarts_used(),
                                                 restart=self.last_outcome in ("failed", "membership"))
                result = self._after(outcome, generation)
                if result is not None:
                    return result
        finally:
            control.close()
            self.accounting.apply("finished")
            self.status.stop()
            self.accounting.save()
            if self.metrics is not None:
                self.metrics.close()
            for receiver in self._receivers:
                receiver.close()
            if self.rendezvous is not None:
                self.rendezvous.shutdown()
            if self._presence is not None:
                self._presence.leave()
            self.processes.release()

    def _after(self, outcome: Outcome, generation: int) -> AgentResult | None:
        """Turn a generation's outcome into the next move; None means: next round."""
        self.last_outcome = outcome.kind
        self.accounting.apply("generation_ended", outcome.kind)
        if outcome.kind == "succeeded":
            return self._finish(0, "succeeded", "all workers exited 0", generation)
        if outcome.kind == "preempted":
            return self._finish(EXIT_PREEMPTED_AGENT, "preempted", outcome.reason, generation)
        if outcome.kind == "interrupted":
            return self._finish(130, "interrupted", outcome.reason, generation)
        if outcome.kind == "verdict":
            v = self.shared_verdict() or {"exit_code": EXIT_STOPPED, "verdict": "stopped", "reason": outcome.reason}
            return self._finish(v["exit_code"], v["verdict"], v["reason"], generation)
        if outcome.kind == "unhealthy":
            if outcome.incident is not None:
                self.record_incident(outcome.incident)
            return self._finish(EXIT_UNHEALTHY, "unhealthy", outcome.reason, generation)
        if outcome.kind == "membership":
            self.emit("membership_changed", generation=generation, reason=outcome.reason)
            self.accounting.restarted("membership")
            return None
        assert outcome.kind == "failed" and outcome.failure is not None and outcome.incident is not None
        history = self._history(exclude_generation=generation)
        decision = decide_restart(outcome.failure, history, self.config.restart, self.clock())
        incident = outcome.incident.with_decision(decision)
        self.record_incident(incident)
        self.accounting.failure(outcome.detected_at, outcome.last_progress_at, incident.id, incident.kind)
        if decision.action is Action.STOP:
            code = outcome.failure.exit_code if decision.verdict == "do_not_restart" and outcome.failure.exit_code \
                else EXIT_STOPPED
            self._publish_verdict(decision.verdict or "stopped", decision.reason, code)
            return self._finish(code, decision.verdict or "stopped", decision.reason, generation)
        self._count_restart(generation, decision.reason)
        self.accounting.restarted(outcome.failure.kind)
        self.emit("restart", generation=generation, reason=decision.reason, delay_s=decision.delay_s,
                  restarts_used=self.restarts_used())
        if decision.delay_s > 0:
            time.sleep(decision.delay_s)
        return None

    # ------------------------------------------------ shared facts (store)
    def restarts_used(self) -> int:
        if self.shared is not None:
            self._restarts_used_cached = self.shared.restarts_used()
        return self._restarts_used_cached

    def _history(self, exclude_generation: int | None = None) -> History:
        assert self.shared is not None
        return self.shared.history(self.tracker.committed_step, exclude_generation)

    def _count_restart(self, generation: int, reason: str) -> None:
        assert self.shared is not None
        self.shared.count_restart(generation, reason, self.tracker.committed_step)

    def _publish_verdict(self, verdict: str, reason: str, exit_code: int) -> None:
        assert self.shared is not None
        self.shared.publish_verdict(verdict, reason, exit_code)
        if self.rendezvous is not None:
            try:
                self.rendezvous.close()
            except Exception as e:  # the verdict key still tells the other nodes
                self.emit("rendezvous_close_failed", error=f"{type(e).__name__}: {e}")

    def shared_verdict(self) -> dict[str, Any] | None:
        return self.shared.verdict() if self.shared is not None else None

    def _finish(self, code: int, verdict: str, reason: str, generation: int) -> AgentResult:
        if verdict in ("succeeded", "preempted") and self.shared is not None:
            # The run as a whole ended (every node ends alike): the next submission starts a new launch.
            try:
                self.shared.end(f"{verdict} (node {self.config.node_id})")
            except ControlStoreError as e:
                self.emit("store_unreachable", error=f"{type(e).__name__}: {e}")
        result = AgentResult(code, verdict, reason, generation, self.restarts_used())
        self.status.phase = f"finished: {verdict}"
        self.emit("agent_finished", exit_code=code, verdict=verdict, reason=reason, generation=generation,
                  restarts_used=result.restarts_used)
        return result


def heartbeat_socket(run_dir: RunDir, local_rank: int) -> str:
    """The heartbeat socket of one local rank."""
    return str(run_dir.socket_path(f"hb{local_rank}.sock"))


def run_agent(config: AgentConfig, *, install_signals: bool = True) -> AgentResult:
    """Build an agent, run it to the end and return how it ended."""
    agent = Agent(config)
    if install_signals and threading.current_thread() is threading.main_thread():
        agent.install_signal_handlers()
    return agent.run()
