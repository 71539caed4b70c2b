"""Structured events: what happened, when, and why.

An :class:`EventLog` keeps events in memory, mirrors them to the ``logging``
module and, when given a path, appends them as JSON lines so that an
operator (and later the agent and the goodput ledger) can read them back.

Every kind of event the code emits is a member of :class:`EventKind`, here
and nowhere else: ``events.jsonl`` is read by people, tests and tools, so a
kind's string is part of the interface and changes only on purpose.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum, unique
from typing import Any, Literal, Protocol, get_args

logger = logging.getLogger("resilient")


@unique
class EventKind(str, Enum):
    """The kind of an event; its value is the ``kind`` string written to ``events.jsonl``."""

    # -- worker side: the training script's Run
    RUN_STARTED = "run_started"  # a Run restored (or started fresh) and is about to train
    RUN_CLOSED = "run_closed"  # Run.close(): the script finished with the run
    AGENT_HOOK_MISSING = "agent_hook_missing"  # under an agent, but a worker hook could not be installed
    CONFIG_CHANGED = "config_changed"  # the restored checkpoint was written under another config
    RESUME_DIVERGED = "resume_diverged"  # the first step after a restore is not where the saving run was (and what moved)
    STOP_REQUESTED = "stop_requested"  # a graceful stop was asked for, at a step (agent: asked; worker: received)
    GRACEFUL_STOP = "graceful_stop"  # the worker reached the stop step, committed and stops
    FAULT_INJECTED = "fault_injected"  # a planned chaos fault fires in this worker
    BATCH_PLANNED = "batch_planned"  # run.micro_batches() split the global batch for this world size (or could not)
    NONFINITE_GRADIENTS = "nonfinite_gradients"  # a gradient held NaN/Inf before the update: not applied, retried
    ATTEMPT_RETRIED = "attempt_retried"  # a step's attempt failed with a peer error, was recovered and is retried
    GROUP_REJOINED = "group_rejoined"  # this worker is in a re-formed group (survivor or promoted spare), state synced
    RECOVERY_GAVE_UP = "recovery_gave_up"  # in-process recovery failed here: the error propagates, the agent restarts
    UNREPRODUCIBLE_RANDOM_STREAMS = "unreproducible_random_streams"  # a replacement cannot draw the lost rank's numbers
    IN_PROCESS_DECLINED = "in_process_declined"  # this run recovers by restart only, and why (said once, at start)
    TORCH_FEATURES_OFF = "torch_features_off"  # private torch APIs this torch lacks: the features that need them are off
    COMM_NOT_TIMED = "comm_not_timed"  # the gradient all-reduce's wait cannot be timed (a straggler may go unseen)
    REPLICA_MISMATCH = "replica_mismatch"  # the replica audit found ranks whose parameters differ from the others'
    # A peer was lost during the replica audit's collective: this step's attempt meets the broken group and recovers
    # it in process (the rank is clean, no update begun); the audit waits for its next boundary.
    REPLICA_AUDIT_INTERRUPTED = "replica_audit_interrupted"

    # -- checkpoints
    CHECKPOINT_COMMITTED = "checkpoint_committed"  # a save's manifest was published: it is the newest checkpoint
    CHECKPOINT_FAILED = "checkpoint_failed"  # a save did not commit (a rank's write or the commit failed)
    CHECKPOINT_STORE_RETRYING = "checkpoint_store_retrying"  # the checkpoint store failed requests; being retried
    CHECKPOINT_CONFLICT = "checkpoint_conflict"  # a checkpoint of that name already exists; never overwritten
    CHECKPOINT_DEFERRED = "checkpoint_deferred"  # a scheduled save fell due while the writer was busy: pending
    CHECKPOINT_DEFERRED_LANDED = "checkpoint_deferred_landed"  # a pending save was taken, at a later step
    CHECKPOINT_CADENCE = "checkpoint_cadence"  # the interval between scheduled saves changed (Young/Daly), and why
    CHECKPOINT_FENCED = "checkpoint_fenced"  # a commit, retention or gc refused: another process holds the fence
    CHECKPOINT_FENCE_CLAIMED = "checkpoint_fence_claimed"  # this process took the location's fence at start
    CHECKPOINT_GARBAGE_COLLECTED = "checkpoint_garbage_collected"  # staging/trash left by dead writers removed
    CHECKPOINT_RETENTION = "checkpoint_retention"  # old checkpoints deleted by the retention policy
    CHECKPOINT_RETENTION_FAILED = "checkpoint_retention_failed"  # retention could not delete; kept for next time
    CHECKPOINT_RESTORED = "checkpoint_restored"  # training state was loaded from a verified checkpoint
    CHECKPOINT_RESHARDED = "checkpoint_resharded"  # the restored checkpoint was saved on another world size
    CHECKPOINT_FALLBACK = "checkpoint_fallback"  # newer checkpoints failed verification; an older one was used
    MEMORY_TIER_RESTORED = "memory_tier_restored"  # the state came from the node's memory tier, newer than any commit
    MEMORY_TIER_FALLBACK = "memory_tier_fallback"  # the memory tier's newest common step failed somewhere: durable tier
    MEMORY_TIER_OFF = "memory_tier_off"  # this rank saves nothing in the memory tier (no room, or why not)
    MEMORY_CADENCE = "memory_cadence"  # the memory tier's interval changed, with the measured costs that chose it
    MEMORY_TIER_FOUND = "memory_tier_found"  # an agent found its killed predecessor's memory tier, and what it holds
    MEMORY_TIER_RELEASED = "memory_tier_released"  # the run ended on this node: its memory tier was removed
    MEMORY_TIER_SWEPT = "memory_tier_swept"  # memory tiers of dead agents whose run directory is gone were removed
    MEMORY_REPLICA_HELD = "memory_replica_held"  # this node keeps a copy of a new predecessor's pinned memory steps
    MEMORY_REPLICA_STAGED = "memory_replica_staged"  # before a generation: ranks' memory state fetched from peers
    MEMORY_REPLICA_FAILED = "memory_replica_failed"  # copying a peer's memory tier failed (said once per cause)
    CHECKPOINT_QUARANTINED = "checkpoint_quarantined"  # a corrupt checkpoint was moved out of the committed set
    CHECKPOINT_QUARANTINE_FAILED = "checkpoint_quarantine_failed"  # a corrupt checkpoint could not be moved

    # -- the node agent: its life and its launch
    AGENT_STARTED = "agent_started"  # the agent starts supervising this node
    AGENT_FINISHED = "agent_finished"  # the agent ends, with its verdict and exit code
    LEFTOVERS_SWEPT = "leftovers_swept"  # an earlier agent's workers were killed at start
    PREVIOUS_AGENT_LOST = "previous_agent_lost"  # the node's earlier agent died without ending; this one replaces it
    LAUNCH_JOINED = "launch_joined"  # the agent created, joined or replaced the run's launch record
    TOKEN_MISMATCH = "token_mismatch"  # this agent's token is not the run's: it stops
    METRICS_LISTENING = "metrics_listening"  # the /metrics endpoint is up
    STOP_REQUEST_RECEIVED = "stop_request_received"  # the control socket asked for a graceful stop

    # -- generations
    RENDEZVOUS_JOINED = "rendezvous_joined"  # a rendezvous round completed: this node's generation and rank
    RENDEZVOUS_FAILED = "rendezvous_failed"  # the rendezvous could not complete: the agent stops
    RENDEZVOUS_CLOSE_FAILED = "rendezvous_close_failed"  # closing it after a verdict failed (the verdict key stands)
    WORKERS_STARTED = "workers_started"  # this node's workers of a generation are running
    WORKER_FAILED = "worker_failed"  # a worker exited non-zero or by a signal
    HANG_DETECTED = "hang_detected"  # a rank overran its section timeout
    STALE_HEARTBEAT = "stale_heartbeat"  # a heartbeat from an earlier generation's process, ignored
    MEMBERSHIP_CHANGED = "membership_changed"  # nodes wait to join: a new round, not counted as a failure
    RESTART = "restart"  # the policy restarts the group after a failure (counted against the budget)
    INCIDENT = "incident"  # an incident file was written (failure, hang, lost node, unhealthy node)
    NODE_LOST = "node_lost"  # a peer was judged lost: its probes unanswered, or its presence lease expired
    PEER_UNANSWERED = "peer_unanswered"  # this agent's probes of a peer failed: it accuses the peer in the store
    PEER_ANSWERS_AGAIN = "peer_answers_again"  # a peer this agent accused answers its probes again
    PEER_CONNECTIONS_SEVERED = "peer_connections_severed"  # this node's workers' connections to a lost node shut
    NODE_UNHEALTHY = "node_unhealthy"  # a health check failed, or workers SIGKILL did not end
    STUCK_WORKERS_GONE = "stuck_workers_gone"  # workers SIGKILL had not ended are gone at last
    RESTORED = "restored"  # a generation's ranks on this node reported what they restored (or a fresh start)

    # -- stragglers and slowdowns (resilient.watchdog.straggler, resilient.watchdog.slowdown)
    STRAGGLER_FLAGGED = "straggler_flagged"  # a rank is persistently slower than its peers in a section
    STRAGGLER_CLEARED = "straggler_cleared"  # a flagged rank is back in line with its peers
    SLOWDOWN_BEGAN = "slowdown_began"  # the job's step time rose above its own baseline: cause and host telemetry
    SLOWDOWN_ENDED = "slowdown_ended"  # it is back at the baseline: what the slowdown cost
    STRAGGLER_DECIDED = "straggler_decided"  # a persistent straggler weighed: kept, swapped for a spare, or dropped
    DETECTORS_CHANGED = "detectors_changed"  # a detector's settings were changed on the running job
    DETECTOR_FAILED = "detector_failed"  # straggler/slowdown detection raised: reported, training goes on

    # -- node quarantine (resilient.coord.quarantine, resilient.agent.quarantine_gate)
    NODE_QUARANTINED = "node_quarantined"  # this node got a quarantine record: reason, evidence, offence, expiry
    QUARANTINE_HELD = "quarantine_held"  # this node stays out of the rendezvous while its record stands
    QUARANTINE_SKIPPED = "quarantine_skipped"  # a persistent straggler's node stays: the run cannot go on without it
    BURN_IN_PASSED = "burn_in_passed"  # the node's burn-in reached the fleet's numbers: it may join
    BURN_IN_FAILED = "burn_in_failed"  # it did not: a new offence, with twice the expiry

    # -- in-process recovery (the recovery ladder's rungs above a restart)
    RECOVERY_DECIDED = "recovery_decided"  # the ladder's answer to a failure: its rung, reason and numbers
    GENERATION_CONTINUED = "generation_continued"  # a new generation formed in process (promotion or shrink)
    RECOVERED_IN_PROCESS = "recovered_in_process"  # every member rejoined the new generation: where they resume
    RECOVERY_ABANDONED = "recovery_abandoned"  # a worker could not recover in process (it exits: a restart follows)
    SPARE_STARTED = "spare_started"  # a spare process started (it runs the script up to resilient.Run())
    SPARE_PRIORITY = "spare_priority"  # spares cannot start at a lower priority here, or a promoted one kept it
    SPARE_READY = "spare_ready"  # a spare is warm (model built, checkpoint read) and waits for a rank
    SPARE_LOST = "spare_lost"  # a spare exited before it was promoted
    SPARE_NODE_JOINED = "spare_node_joined"  # a --role spare agent starts its warm workers for a generation
    SPARE_NODE_TAKES_PLACE = "spare_node_takes_place"  # a spare node joins a restart in a lost node's place
    FORK_SERVER_UNAVAILABLE = "fork_server_unavailable"  # workers start the plain way, and why (once per agent)

    # -- the agent's own I/O
    STORE_UNREACHABLE = "store_unreachable"  # a control-store read or write failed; the agent carries on
    WATCH_RESTARTED = "watch_restarted"  # a store watch's thread hit an unexpected error: read again, it goes on
    THREAD_RESTARTED = "thread_restarted"  # an agent thread's loop raised (traceback attached): started again
    AGENT_THREAD_FAILED = "agent_thread_failed"  # an agent thread kept raising: the agent stops the run
    STORE_OUTAGE_START = "store_outage_start"  # the etcd client started retrying an unreachable cluster
    STORE_OUTAGE_END = "store_outage_end"  # etcd answered again after an outage
    FORGED_KEY = "forged_key"  # a store entry without a valid token proof was ignored (it names the key)
    STATUS_WRITE_FAILED = "status_write_failed"  # status.json could not be written
    LEDGER_WRITE_FAILED = "ledger_write_failed"  # ledger.json could not be saved

    def __str__(self) -> str:
        # The plain string everywhere text is made (logs, f-strings), on every Python version.
        return self.value


@unique
class OutcomeKind(Enum):
    """How a generation ended on this node; the value is the name the ledger and logs use."""

    SUCCEEDED = "succeeded"  # every worker exited 0: the run is done
    FAILED = "failed"  # a worker failed or hung: the restart policy decides
    MEMBERSHIP = "membership"  # nodes wait to join: a new round, not a failure
    PREEMPTED = "preempted"  # a graceful stop (SIGTERM, `resilient stop`): workers committed and exited
    INTERRUPTED = "interrupted"  # SIGINT: workers stopped without a checkpoint
    VERDICT = "verdict"  # another node published a verdict that stops the launch
    UNHEALTHY = "unhealthy"  # this node failed a health check while running
    QUARANTINED = "quarantined"  # this node got a quarantine record while running: it leaves the generation

    @property
    def restarts_workers(self) -> bool:
        """Whether the next generation after this outcome is a restart (recovery, in the ledger's terms)."""
        return self in (OutcomeKind.FAILED, OutcomeKind.MEMBERSHIP)


FailureKind = Literal["exit", "signal", "hang", "node_lost", "unhealthy", "collective", "straggler", "slowdown",
                      "replica_mismatch"]
"""What an incident was: a non-zero exit, a death by signal, a hang, a lost peer node, an unhealthy node, a rank
slower than its peers, the whole job slower than its own baseline, replicas whose parameters differ."""
FAILURE_KINDS: tuple[FailureKind, ...] = get_args(FailureKind)


_WARNING_KINDS = frozenset(
    {
        EventKind.NONFINITE_GRADIENTS,
        EventKind.CHECKPOINT_FAILED,
        EventKind.CHECKPOINT_STORE_RETRYING,
        EventKind.CHECKPOINT_QUARANTINED,
        EventKind.CHECKPOINT_FALLBACK,
        EventKind.MEMORY_TIER_FALLBACK,
        EventKind.MEMORY_TIER_OFF,
        EventKind.MEMORY_REPLICA_FAILED,
        EventKind.CHECKPOINT_CONFLICT,
        EventKind.CHECKPOINT_FENCED,
    }
)


@dataclass(frozen=True)
class Event:
    """One thing that happened to the run."""

    kind: str
    """The kind's string (an :class:`EventKind` value), as written to ``events.jsonl``."""
    wall_time: float
    fields: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({"kind": self.kind, "time": self.wall_time, **self.fields}, default=str)


class Emit(Protocol):
    """What components that report events are given: ``emit(kind, **fields)``."""

    def __call__(self, kind: EventKind, **fields: Any) -> object: ...


class EventLog:
    """Thread-safe, append-only event record."""

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self._path = os.fspath(path) if path is not None else None
        self._events: list[Event] = []
        self._lock = threading.Lock()

    @property
    def path(self) -> str | None:
        """The file the events are appended to (None: kept in memory only)."""
        return self._path

    def emit(self, kind: EventKind, **fields: Any) -> Event:
        event = Event(kind=str(kind), wall_time=time.time(), fields=fields)
        with self._lock:
            self._events.append(event)
            if self._path is not None:
                os.makedirs(os.path.dirname(self._path) or ".", exist_ok=True)
                with open(self._path, "a", encoding="utf-8") as f:
                    f.write(event.to_json() + "\n")
        level = logging.WARNING if kind in _WARNING_KINDS else logging.INFO
        logger.log(level, "%s %s", event.kind, fields)
        return event

    def of_kind(self, kind: str) -> list[Event]:
        with self._lock:
            return [e for e in self._events if e.kind == kind]

    def all(self) -> list[Event]:
        with self._lock:
            return list(self._events)


FORWARDED = frozenset({
    EventKind.CHECKPOINT_FAILED, EventKind.CHECKPOINT_CONFLICT, EventKind.CHECKPOINT_FENCED,
    EventKind.CHECKPOINT_FALLBACK, EventKind.MEMORY_TIER_FALLBACK, EventKind.MEMORY_TIER_OFF,
    EventKind.MEMORY_TIER_RESTORED, EventKind.MEMORY_CADENCE, EventKind.CHECKPOINT_CADENCE,
    EventKind.CHECKPOINT_QUARANTINED,
    EventKind.CHECKPOINT_QUARANTINE_FAILED,
    EventKind.CHECKPOINT_RETENTION_FAILED, EventKind.NONFINITE_GRADIENTS, EventKind.CHECKPOINT_STORE_RETRYING,
    EventKind.UNREPRODUCIBLE_RANDOM_STREAMS, EventKind.IN_PROCESS_DECLINED, EventKind.TORCH_FEATURES_OFF,
    EventKind.COMM_NOT_TIMED, EventKind.CONFIG_CHANGED, EventKind.RESUME_DIVERGED,
})
"""What a worker's Run also writes into its agent's run-level event log: checkpoints gone wrong, gradients
that were not finite, a resume under another config or not where the saving run was, and what its recovery
cannot do (random streams a replacement cannot reproduce, in-process recovery declined, torch features off,
communication it cannot time), which whoever reads the run's events (an operator, a drill's score) must see
without opening every rank's log."""


class ForwardingLog(EventLog):
    """A Run's event log under an agent: every event goes to ``inner`` as before; the kinds in :data:`FORWARDED`
    are also appended to ``agent`` (the run directory's ``events.jsonl``) with the fields of ``where()`` (the
    rank and node), so the run's own record shows them."""

    def __init__(self, inner: EventLog, agent: EventLog, where: Callable[[], dict[str, Any]]) -> None:
        super().__init__(inner.path)
        self._inner, self._agent, self._where = inner, agent, where

    @property
    def path(self) -> str | None:
        return self._inner.path

    def emit(self, kind: EventKind, **fields: Any) -> Event:
        event = self._inner.emit(kind, **fields)
        if kind in FORWARDED:
            try:
                self._agent.emit(kind, **{**self._where(), **fields})
            except OSError as e:  # the run directory went away: the Run's own log still has the event
                logger.warning("could not forward %s to the agent's event log: %s", kind, e)
        return event

    def of_kind(self, kind: str) -> list[Event]:
        return self._inner.of_kind(kind)

    def all(self) -> list[Event]:
        return self._inner.all()
