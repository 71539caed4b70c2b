"""A node agent's life as a state machine: its phases, the edges between them, one pure function.

An agent starts (joins the launch), checks before each round (a published
verdict, workers SIGKILL did not end, health, a quarantine, a stop), joins
the rendezvous (a spare node instead waits for the run's next generation),
runs a generation (whose own watch loop is :mod:`resilient.agent.machine`),
decides what a failed generation leads to, and ends with a
:class:`~resilient.core.exitcodes.AgentVerdict`.  Worker and spare nodes
run this one machine; a spare node that takes a lost node's place becomes a
worker node in it.

:func:`next_move` takes where the agent is (:class:`Life`) and what the last
command found (an event) and returns the next :class:`Move`: the new state
and the commands to carry out, in order; the last command's answer is the
next event.  Every choice of the agent's outer loop is made here.  A
failed generation is carried out as the one decision on its failure
(:func:`~resilient.agent.decision.decide`): the one the generation took with
the ladder on offer, else the one taken here, from the run's restart
history, without the ladder.  The executor is
:meth:`resilient.agent.supervisor.Agent.run`: it carries out the commands
and reads what the store and the node say, never deciding.

The phases and the changes between them are :data:`EDGES`; the diagram in
``docs/architecture.md`` ("The agent's lifecycle") is checked against it by a test.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

from ..core.events import EventKind, OutcomeKind
from ..core.exitcodes import EXIT_CONFIG, EXIT_PREEMPTED_AGENT, EXIT_STOPPED, EXIT_UNHEALTHY, AgentVerdict
from .incidents import Incident
from .outcome import Outcome
from ..elastic.decide import Action, RecoveryDecision
from .decision import Restarts, decide
from .policy import History, RestartConfig
from .rendezvous import Assignment

EXIT_INTERRUPTED = 130
"""SIGINT's conventional exit status."""


class Phase(Enum):
    """Where a node agent is in its life."""

    STARTING = "starting"
    """Joining the run's launch (and checking the run token against it)."""
    CHECKING = "checking"
    """Before a round: a verdict, stuck workers, the node's health, a quarantine, a stop."""
    JOINING = "joining"
    """In the rendezvous: waiting for the round that assigns this node its ranks."""
    SPARE = "spare"
    """A spare node: waiting for the run's next generation to keep warm workers beside."""
    RUNNING = "running"
    """A generation runs on this node (its watch loop is :mod:`resilient.agent.machine`)."""
    DECIDING = "deciding"
    """The generation failed with no decision taken on it: it is taken from the run's restart history."""
    ENDED = "ended"
    """The agent ends with a verdict."""


EDGES: frozenset[tuple[Phase, Phase]] = frozenset({
    (Phase.STARTING, Phase.CHECKING), (Phase.STARTING, Phase.ENDED),
    (Phase.CHECKING, Phase.JOINING), (Phase.CHECKING, Phase.SPARE), (Phase.CHECKING, Phase.ENDED),
    (Phase.JOINING, Phase.RUNNING), (Phase.JOINING, Phase.CHECKING), (Phase.JOINING, Phase.ENDED),
    (Phase.SPARE, Phase.RUNNING), (Phase.SPARE, Phase.ENDED),
    (Phase.RUNNING, Phase.CHECKING), (Phase.RUNNING, Phase.DECIDING), (Phase.RUNNING, Phase.ENDED),
    (Phase.DECIDING, Phase.CHECKING), (Phase.DECIDING, Phase.ENDED),
})
"""Every change of phase :func:`next_move` can make (staying in a phase is not one)."""


@dataclass(frozen=True)
class Ending:
    """How the agent ends: its exit code, verdict and reason; ``quiet``: the run goes on without this node (held
    out by a quarantine, or unhealthy across machines), so its end neither ends the launch nor closes the
    rendezvous."""

    code: int
    verdict: AgentVerdict
    reason: str
    quiet: bool = False

    @classmethod
    def published(cls, record: dict[str, Any]) -> Ending:
        """The ending a node published for the whole launch (``{"exit_code", "verdict", "reason"}``); a verdict
        this version does not know reads as ``stopped``, its word kept in the reason."""
        verdict = AgentVerdict.read(str(record.get("verdict")))
        reason = str(record.get("reason", ""))
        if verdict is None:
            verdict, reason = AgentVerdict.STOPPED, f"{reason} (verdict {record.get('verdict')!r})"
        return cls(int(record.get("exit_code", EXIT_STOPPED)), verdict, reason)

    @classmethod
    def of(cls, code: int, verdict: str, reason: str, *, quiet: bool = False) -> Ending:
        """From the ``(exit code, verdict, reason)`` that the quarantine gate and the run's end hand back."""
        return replace(cls.published({"exit_code": code, "verdict": verdict, "reason": reason}), quiet=quiet)


def final(ending: Ending, thread_failure: str | None) -> Ending:
    """The ending as the agent reports it: a graceful stop that a supervised thread's failure asked for
    (:mod:`resilient.core.supervised`) ends with ``agent_thread_failed``, not as if an operator had asked."""
    if thread_failure is not None and ending.verdict is AgentVerdict.PREEMPTED:
        return replace(ending, code=EXIT_STOPPED, verdict=AgentVerdict.AGENT_THREAD_FAILED, reason=thread_failure)
    return ending


@dataclass(frozen=True)
class Life:
    """Where the agent is: its phase, whether it is (still) a spare node, the generation it ran last, and
    whether its next generation restarts workers after a failure."""

    phase: Phase
    spare: bool
    policy: RestartConfig
    generation: int = 0
    restart: bool = False


# ------------------------------------------------------------------ events: what a command found
@dataclass(frozen=True)
class LaunchJoined:
    problem: str | None
    """Why this agent cannot take part in the launch (its run token differs), or None."""


@dataclass(frozen=True)
class Checked:
    """What the checks before a round found, in their order (the executor stops reading at the first)."""

    verdict: dict[str, Any] | None = None
    """A verdict a node published for the launch."""
    stuck: str | None = None
    """Workers SIGKILL did not end, still there after the wait for them: why the node is unhealthy."""
    unhealthy: Incident | None = None
    """The node's health probe failed (the incident says how)."""
    unhealthy_reason: str = ""
    held: tuple[int, str, str] | None = None
    """The quarantine gate ended the node's wait (exit code, verdict, reason): the run goes on without it."""
    stopping: bool = False
    """A stop or an interrupt was asked for."""


@dataclass(frozen=True)
class Assigned:
    assignment: Assignment


@dataclass(frozen=True)
class RoundFailed:
    """The rendezvous ended without a round for this node."""

    error: str
    verdict: dict[str, Any] | None = None
    """A verdict a node published for the launch (read first)."""
    retried: bool = False
    """The round was closed before this agent ran anything: the stale launch was ended and a new one is ready."""
    over: tuple[int, str, str] | None = None
    """The round was closed because the run ended while this node was out of it: how it ended."""


@dataclass(frozen=True)
class Opened:
    """A spare node: the run started generation ``generation``."""

    generation: int


@dataclass(frozen=True)
class Released:
    """A spare node stopped waiting before a generation needed it."""

    stopped: bool = False
    verdict: dict[str, Any] | None = None
    ended: bool = False
    """The run ended without needing this spare."""


@dataclass(frozen=True)
class GenerationEnded:
    outcome: Outcome
    generation: int
    """The newest generation this node took part in (an in-process recovery may have moved it on)."""


@dataclass(frozen=True)
class HistoryRead:
    """A failed generation: the run's restart history (from the store) and the time, for the decision."""

    outcome: Outcome
    history: History
    now: float


Event = LaunchJoined | Checked | Assigned | RoundFailed | Opened | Released | GenerationEnded | HistoryRead


# ------------------------------------------------------------------ commands
@dataclass(frozen=True)
class JoinLaunch:
    """Start the node's services, join (or start) the run's launch: answers :class:`LaunchJoined`."""


@dataclass(frozen=True)
class MakeRendezvous:
    """Set up this node's rendezvous (a worker node; a spare node once it takes a lost node's place)."""


@dataclass(frozen=True)
class FollowLaunch:
    """Across machines: follow the launch's recovery keys (a spare node from its start)."""


@dataclass(frozen=True)
class Check:
    """The checks before a round: answers :class:`Checked`."""


@dataclass(frozen=True)
class GiveFailureRate:
    """``--mtbf``: hand the next generation's workers the failure rate they pace their saves by."""


@dataclass(frozen=True)
class Rendezvous:
    """Join the next round: answers :class:`Assigned` or :class:`RoundFailed`."""


@dataclass(frozen=True)
class AwaitGeneration:
    """A spare node: wait for the run's next generation: answers :class:`Opened` or :class:`Released`."""


@dataclass(frozen=True)
class RunGeneration:
    """Run this node's part of generation ``assignment`` to its end: answers :class:`GenerationEnded`."""

    assignment: Assignment
    restart: bool
    """After a failure (the workers restore what the failed ones saved)."""


@dataclass(frozen=True)
class TakePlace:
    """A spare node takes a lost node's place in the run's restart: a worker node from here on."""

    outcome: Outcome


@dataclass(frozen=True)
class LeaveRendezvous:
    """Quarantined while running: leave the rendezvous; the next round's check holds the node out."""


@dataclass(frozen=True)
class MembershipChanged:
    """The generation ended for a change of membership (nodes joined or left): count it, go to the next round."""

    generation: int
    reason: str


@dataclass(frozen=True)
class ReadHistory:
    """A failed generation with no decision taken on it: read the run's restart history: answers
    :class:`HistoryRead`."""

    outcome: Outcome


@dataclass(frozen=True)
class RecordFailure:
    """The failed generation's incident, with the decision taken on it, and its cost in the ledger."""

    outcome: Outcome
    decision: RecoveryDecision


@dataclass(frozen=True)
class Restart:
    """Count the restart in the run's budget, say so, wait the policy's delay; the next round restarts workers."""

    outcome: Outcome
    decision: RecoveryDecision
    generation: int


@dataclass(frozen=True)
class PublishVerdict:
    """Tell every node of the launch how the run ends."""

    ending: Ending


@dataclass(frozen=True)
class StepOut:
    """This node is unhealthy: record the incident and, across machines, quarantine the node."""

    incident: Incident | None
    reason: str


@dataclass(frozen=True)
class Say:
    """An event for the log (and what follows it)."""

    kind: EventKind
    fields: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class Finish:
    """End the agent with ``ending``; ``from_launch``: the launch's published verdict wins when there is one."""

    ending: Ending
    generation: int
    from_launch: bool = False


Command = (JoinLaunch | MakeRendezvous | FollowLaunch | Check | GiveFailureRate | Rendezvous | AwaitGeneration
           | RunGeneration | TakePlace | LeaveRendezvous | MembershipChanged | ReadHistory | RecordFailure | Restart
           | PublishVerdict | StepOut | Say | Finish)


@dataclass(frozen=True)
class Move:
    """The next state and the commands that get there, carried out in order."""

    life: Life
    commands: tuple[Command, ...]


def begin(*, spare: bool, policy: RestartConfig) -> Move:
    """The agent's first move."""
    return Move(Life(Phase.STARTING, spare=spare, policy=policy), (JoinLaunch(),))


def _end(life: Life, ending: Ending, *before: Command, from_launch: bool = False) -> Move:
    return Move(replace(life, phase=Phase.ENDED), (*before, Finish(ending, life.generation, from_launch)))


def _check(life: Life, *before: Command) -> Move:
    return Move(replace(life, phase=Phase.CHECKING), (*before, Check()))


def next_move(life: Life, event: Event) -> Move:
    """The agent's next move after ``event`` (what the last command of the previous move answered).  Pure."""
    match life.phase, event:
        case Phase.STARTING, LaunchJoined(problem=problem):
            if problem is not None:
                return _end(life, Ending(EXIT_CONFIG, AgentVerdict.TOKEN_MISMATCH, problem),
                            Say(EventKind.TOKEN_MISMATCH, (("reason", problem),)))
            return _check(life, FollowLaunch() if life.spare else MakeRendezvous())
        case Phase.CHECKING, Checked() as found:
            return _after_checks(life, found)
        case Phase.JOINING, Assigned(assignment=a):
            return Move(replace(life, phase=Phase.RUNNING, generation=a.generation),
                        (RunGeneration(a, restart=life.restart),))
        case Phase.JOINING, RoundFailed() as failed:
            if failed.verdict is not None:
                return _end(life, Ending.published(failed.verdict))
            if failed.retried:
                return _check(life)
            if failed.over is not None:
                return _end(life, Ending.of(*failed.over))
            return _end(life, Ending(EXIT_STOPPED, AgentVerdict.RENDEZVOUS_FAILED, failed.error),
                        Say(EventKind.RENDEZVOUS_FAILED, (("error", failed.error),)))
        case Phase.SPARE, Opened(generation=g):
            a = Assignment(node_rank=-1, num_nodes=0, generation=g, master_addr="", master_port=0)
            return Move(replace(life, phase=Phase.RUNNING, generation=g),
                        (Say(EventKind.SPARE_NODE_JOINED, (("generation", g),)), RunGeneration(a, restart=False)))
        case Phase.SPARE, Released() as released:
            if released.stopped:
                return _end(life, Ending(EXIT_PREEMPTED_AGENT, AgentVerdict.PREEMPTED, "stopped while waiting"))
            if released.verdict is not None:
                return _end(life, Ending.published(released.verdict))
            return _end(life, Ending(0, AgentVerdict.SUCCEEDED, "the run ended before this spare was needed"))
        case Phase.RUNNING, GenerationEnded(outcome=outcome, generation=g):
            return _after_generation(replace(life, generation=g, restart=outcome.kind.restarts_workers), outcome)
        case Phase.DECIDING, HistoryRead(outcome=outcome, history=history, now=now):
            assert outcome.failure is not None
            return _after_failure(life, outcome, decide(outcome.failure, Restarts(history, life.policy), now,
                                                        exit_codes=outcome.exit_codes))
    raise ValueError(f"no move from phase {life.phase.value} on {event!r}")


def _after_checks(life: Life, found: Checked) -> Move:
    if found.verdict is not None:
        return _end(life, Ending.published(found.verdict))
    if found.stuck is not None:
        return _end(life, Ending(EXIT_UNHEALTHY, AgentVerdict.UNHEALTHY, found.stuck))
    if found.unhealthy is not None:
        return _step_out(life, found.unhealthy, found.unhealthy_reason)
    if found.held is not None:
        return _end(life, Ending.of(*found.held, quiet=True))
    if found.stopping:
        return _end(life, Ending(EXIT_PREEMPTED_AGENT, AgentVerdict.PREEMPTED, "stopped before workers started"))
    if life.spare:
        return Move(replace(life, phase=Phase.SPARE), (GiveFailureRate(), AwaitGeneration()))
    return Move(replace(life, phase=Phase.JOINING), (GiveFailureRate(), Rendezvous()))


def _step_out(life: Life, incident: Incident | None, reason: str) -> Move:
    # Across machines the executor quarantines the node (the run goes on without it): its end is quiet there.
    return _end(life, Ending(EXIT_UNHEALTHY, AgentVerdict.UNHEALTHY, reason), StepOut(incident, reason))


def _after_generation(life: Life, outcome: Outcome) -> Move:
    kind = outcome.kind
    if outcome.takes_place_of is not None:
        return _check(replace(life, spare=False), TakePlace(outcome), MakeRendezvous())
    if kind is OutcomeKind.SUCCEEDED:
        return _end(life, Ending(0, AgentVerdict.SUCCEEDED, outcome.reason))
    if kind is OutcomeKind.PREEMPTED:
        return _end(life, Ending(EXIT_PREEMPTED_AGENT, AgentVerdict.PREEMPTED, outcome.reason))
    if kind is OutcomeKind.INTERRUPTED:
        return _end(life, Ending(EXIT_INTERRUPTED, AgentVerdict.INTERRUPTED, outcome.reason))
    if kind is OutcomeKind.VERDICT:
        return _end(life, Ending(EXIT_STOPPED, AgentVerdict.STOPPED, outcome.reason), from_launch=True)
    if kind is OutcomeKind.UNHEALTHY:
        return _step_out(life, outcome.incident, outcome.reason)
    if kind is OutcomeKind.QUARANTINED:  # the next round's check holds the node out until it burns in
        return _check(life, LeaveRendezvous())
    if kind is OutcomeKind.MEMBERSHIP:
        return _check(life, MembershipChanged(life.generation, outcome.reason))
    if kind is OutcomeKind.FAILED and outcome.failure is not None and outcome.incident is not None:
        if outcome.decision is not None:  # taken with the ladder on offer: carried out as it is
            return _after_failure(life, outcome, outcome.decision)
        return Move(replace(life, phase=Phase.DECIDING), (ReadHistory(outcome),))
    raise ValueError(f"a generation cannot end as {kind.value} without its failure and incident: {outcome!r}")


def _after_failure(life: Life, outcome: Outcome, decision: RecoveryDecision) -> Move:
    if decision.action not in (Action.RESTART, Action.STOP):
        raise ValueError(f"a generation that ended as a failure is restarted or stopped, not {decision.action.value}")
    recorded = RecordFailure(outcome, decision)
    if decision.action is Action.STOP:
        verdict = AgentVerdict(decision.verdict or AgentVerdict.STOPPED)
        # A worker that said "do not restart me" with its exit code: the agent exits with that code.
        code = decision.exit_code if verdict is AgentVerdict.DO_NOT_RESTART and decision.exit_code \
            else EXIT_STOPPED
        ending = Ending(code, verdict, decision.reason)
        return _end(life, ending, recorded, PublishVerdict(ending))
    return _check(life, recorded, Restart(outcome, decision, life.generation))
