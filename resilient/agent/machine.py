"""A generation's watch loop as a state machine: typed inputs, one pure transition function, typed commands.

:func:`transition` takes the loop's state and what it observed on one pass
(:class:`Observation`: workers that exited, the ranks' heartbeats and
sections, the store's facts as the watches hold them, the in-process
recovery's news, the health probe when its timer is due, an operator's stop
or interrupt) and returns the next state and the commands to carry out, with
the reason.  Every decision of the loop, and its reason string, is taken
here or in the pure policies it calls (:func:`~resilient.watchdog.sections.decide_hang`,
:func:`~resilient.agent.health.assess`).  Some commands ask the recovery
ladder (:mod:`resilient.agent.continuation`, :mod:`resilient.agent.failures`,
:mod:`resilient.agent.eviction`); what it answers comes back through
:func:`settle`, also pure.  The executor is :func:`resilient.agent.generation._watch`:
it observes, calls these two functions and carries out the commands.

The phases and the changes between them are :data:`EDGES`; the diagram in
``docs/architecture.md`` ("The generation's state machine") is checked
against it by a test.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

from ..core.events import OutcomeKind
from ..watchdog.sections import HangDecision, RankView, SectionStats, SectionTimeouts, decide_hang
from .health import HealthConfig, HealthObservation, assess
from .outcome import Hold, Outcome
from .rendezvous import Assignment


class Phase(Enum):
    """Where a generation's watch loop is."""

    RUNNING = "running"
    """Every member trains; nothing is being decided."""
    RECOVERING = "recovering"
    """A generation formed in process (a spare promoted, a shrink, a retry, a grow): its members are rejoining."""
    HOLDING = "holding"
    """Members were lost and the ladder has not acted yet (survivors settling, or waiting for a spare)."""
    STOPPING = "stopping"
    """A graceful stop was asked for: the workers commit at an agreed step and exit."""
    ENDED = "ended"
    """The generation is over on this node (:attr:`WatchState.outcome` says how)."""


EDGES: frozenset[tuple[Phase, Phase]] = frozenset({
    (Phase.RUNNING, Phase.RECOVERING), (Phase.RUNNING, Phase.HOLDING), (Phase.RUNNING, Phase.STOPPING),
    (Phase.RUNNING, Phase.ENDED),
    (Phase.RECOVERING, Phase.RUNNING), (Phase.RECOVERING, Phase.HOLDING), (Phase.RECOVERING, Phase.STOPPING),
    (Phase.RECOVERING, Phase.ENDED),
    (Phase.HOLDING, Phase.RECOVERING), (Phase.HOLDING, Phase.STOPPING), (Phase.HOLDING, Phase.ENDED),
    (Phase.STOPPING, Phase.ENDED),
})
"""Every change of phase :func:`transition` and :func:`settle` can make (staying in a phase is not one)."""


@dataclass(frozen=True)
class WatchState:
    phase: Phase
    next_health: float
    """Agent clock at which the health probe is next due."""
    hold: Hold | None = None
    """Members lost with no rung acted on yet (phase HOLDING)."""
    stop_deadline: float | None = None
    """Phase STOPPING: the workers are killed if they have not exited by then."""
    stop_at: int | None = None
    """Phase STOPPING: the step the workers commit at."""
    outcome: Outcome | None = None
    """Phase ENDED: how the generation ended."""


@dataclass(frozen=True)
class Settings:
    """What of the agent's configuration the transition needs."""

    preempt_grace_s: float
    health_interval_s: float
    health: HealthConfig
    sections: SectionTimeouts


# ------------------------------------------------------------------ inputs
@dataclass(frozen=True)
class Failed:
    """A member that exited non-zero (a worker exited)."""

    rank: int
    returncode: int

    @property
    def signal(self) -> int | None:
        return -self.returncode if self.returncode < 0 else None


@dataclass(frozen=True)
class Moved:
    """News of the in-process recovery: the generation went on as ``assignment`` (grew back, or a decision taken
    across machines was carried out)."""

    assignment: Assignment


@dataclass(frozen=True)
class RecoveryFailed:
    """News of the in-process recovery: it cannot complete (``problem`` says why)."""

    problem: str


News = Moved | RecoveryFailed | Outcome
"""What the in-process bookkeeping reported on this pass (an :class:`Outcome`: the generation ends so)."""


@dataclass(frozen=True)
class Observation:
    """One pass of the watch loop, in the kinds of input the loop has.

    * a timer: ``now``; ``health`` (probed when :attr:`WatchState.next_health` was due);
    * workers that exited: ``failed``, ``all_exited``, ``members_here``, ``signalled_together``;
    * heartbeats and section reports: ``views`` (running members), ``stats``, ``waiting_members``,
      ``sections`` (the timeouts for the reported checkpoint location);
    * the store, as the watches hold it: ``verdict``, ``quarantined``, ``waiting_nodes``, ``run_ended``,
      ``straggler`` (a persistent straggler flagged from the peers' timing);
    * the in-process recovery: ``news``, ``recovering``;
    * an operator: ``interrupted`` (SIGINT), ``stop_asked`` (SIGTERM, the control socket, a peer's stop).
    """

    now: float
    failed: tuple[Failed, ...] = ()
    all_exited: bool = False
    members_here: bool = True
    signalled_together: bool = False
    """Every failed member died of SIGTERM and this agent got SIGTERM with them (a scheduler ending the job)."""
    views: Mapping[int, RankView] = field(default_factory=dict)
    stats: SectionStats = field(default_factory=SectionStats)
    waiting_members: Collection[int] = ()
    """Running members that left their group and wait for the next generation (not hung)."""
    sections: SectionTimeouts | None = None
    across_machines: bool = False
    verdict: Mapping[str, Any] | None = None
    quarantined: str | None = None
    waiting_nodes: int = 0
    run_ended: bool = False
    straggler: Mapping[str, Any] | None = None
    news: News | None = None
    recovering: bool = False
    interrupted: bool = False
    stop_asked: bool = False
    health: HealthObservation | None = None


# ------------------------------------------------------------------ commands
@dataclass(frozen=True)
class Adopt:
    """Go on as ``assignment`` (the generation moved on in process)."""

    assignment: Assignment


@dataclass(frozen=True)
class AnswerFailure:
    """Members exited non-zero: ask the ladder (recover in process, or stop the group and end)."""


@dataclass(frozen=True)
class ResumeHold:
    """Members lost earlier are still undecided: ask the ladder again."""

    hold: Hold


@dataclass(frozen=True)
class StopOnFailure:
    """The ladder answered restart or stop (``ladder``, None: not on offer): stop the group, end as a failure."""

    ladder: Any


@dataclass(frozen=True)
class AnswerHang:
    """A rank overran its section's timeout: capture stacks, attribute, and ask the ladder."""

    hang: HangDecision


@dataclass(frozen=True)
class FailRecovery:
    """The in-process recovery did not complete: stop the group, end as a failure naming ``problem``."""

    problem: str


@dataclass(frozen=True)
class EndUnhealthy:
    """This node failed its health check while running: say so and end the generation."""

    reason: str
    problems: tuple[str, ...]


@dataclass(frozen=True)
class RequestStop:
    """Ask every worker to commit at a step no rank has reached, then exit."""


@dataclass(frozen=True)
class CloseSlowness:
    """The workers exited: score their last windows; a slowdown in progress ends with the run."""


@dataclass(frozen=True)
class Evict:
    """A persistent straggler: replace or drop it when that pays (the ladder weighs it)."""

    flag: Mapping[str, Any]


Command = (Adopt | AnswerFailure | ResumeHold | StopOnFailure | AnswerHang | FailRecovery | EndUnhealthy
           | RequestStop | CloseSlowness | Evict)


@dataclass(frozen=True)
class Step:
    state: WatchState
    commands: tuple[Command, ...] = ()
    reason: str = ""
    pause: bool = True
    """Wait a monitor interval before the next pass (False: look again at once)."""


def _end(s: WatchState, outcome: Outcome, *commands: Command) -> Step:
    return Step(replace(s, phase=Phase.ENDED, outcome=outcome), commands, outcome.reason, pause=False)


def _live(s: WatchState, recovering: bool) -> Phase:
    """The phase of a generation going on: HOLDING while a hold lasts, else whether a recovery is under way."""
    if s.hold is not None:
        return Phase.HOLDING
    return Phase.RECOVERING if recovering else Phase.RUNNING


def transition(s: WatchState, o: Observation, cfg: Settings) -> Step:
    """The next state and commands after observing ``o`` in state ``s`` (see the module doc)."""
    assert s.phase is not Phase.ENDED, "an ended generation observes nothing"
    stopping = s.phase is Phase.STOPPING
    if not stopping:
        s = replace(s, phase=_live(s, o.recovering))
    if o.news is not None and not stopping:
        if isinstance(o.news, Outcome):
            return _end(s, o.news)
        if isinstance(o.news, RecoveryFailed):
            return Step(s, (FailRecovery(o.news.problem),), o.news.problem, pause=False)
        return Step(replace(s, phase=Phase.RECOVERING, hold=None), (Adopt(o.news.assignment),),
                    f"generation {o.news.assignment.generation} formed in process", pause=False)
    if o.failed and not stopping:
        ranks = {f.rank for f in o.failed}
        if s.hold is not None and ranks <= set(s.hold.lost):
            return Step(s, (ResumeHold(s.hold),), f"ranks {sorted(ranks)} lost earlier are still undecided",
                        pause=False)
        if s.hold is None and o.signalled_together:
            return _end(s, Outcome(OutcomeKind.PREEMPTED, "the workers and this agent got SIGTERM together (a "
                                                          "scheduler ending the job: a preemption or requeue); no "
                                                          "checkpoint was taken, the next launch resumes from the "
                                                          "newest commit"))
        return Step(s, (AnswerFailure(),), f"ranks {sorted(ranks)} exited non-zero", pause=False)
    if o.across_machines and not o.members_here and not stopping:
        if o.run_ended:  # only spares here: the run ends elsewhere
            return _end(s, Outcome(OutcomeKind.SUCCEEDED, "the run ended on the nodes that held its ranks"))
    elif o.all_exited:
        if stopping:
            note = f"; some workers failed: {[f.returncode for f in o.failed]}" if o.failed else ""
            return _end(s, Outcome(OutcomeKind.PREEMPTED,
                                   f"workers stopped at step {s.stop_at} after committing a checkpoint{note}"),
                        CloseSlowness())
        return _end(s, Outcome(OutcomeKind.SUCCEEDED, "all workers exited 0"), CloseSlowness())
    if o.interrupted:
        return _end(s, Outcome(OutcomeKind.INTERRUPTED, "SIGINT: workers stopped without a checkpoint"))
    if o.verdict is not None:
        return _end(s, Outcome(OutcomeKind.VERDICT,
                               f"node {o.verdict.get('node')} stopped the run: {o.verdict.get('reason')}"))
    if o.quarantined is not None and not stopping:
        return _end(s, Outcome(OutcomeKind.QUARANTINED, f"{o.quarantined}: it leaves the run"))
    commands: list[Command] = []
    reason = ""
    if not stopping and o.stop_asked:
        s = replace(s, phase=Phase.STOPPING, stop_deadline=o.now + cfg.preempt_grace_s)
        stopping = True
        commands.append(RequestStop())
        reason = "a stop was asked for"
    if stopping:
        assert s.stop_deadline is not None
        if o.now > s.stop_deadline:
            return _end(s, Outcome(OutcomeKind.PREEMPTED,
                                   f"workers did not stop within {cfg.preempt_grace_s:.0f} s; killed"))
    else:
        views = {r: v for r, v in o.views.items() if r not in set(o.waiting_members)}
        hang = decide_hang(views, o.stats, o.sections or cfg.sections, o.now)
        if hang is not None and s.hold is None:
            return Step(s, (AnswerHang(hang),), hang.reason, pause=False)
        if o.waiting_nodes > 0:
            return _end(s, Outcome(OutcomeKind.MEMBERSHIP, f"{o.waiting_nodes} node(s) waiting to join the run"))
    if o.health is not None:
        s = replace(s, next_health=o.now + cfg.health_interval_s)
        health = assess(o.health, cfg.health)
        if not health.healthy:
            return Step(s, (*commands, EndUnhealthy(health.reason, tuple(health.problems))), health.reason,
                        pause=False)
    if not stopping and o.straggler is not None and s.hold is None:
        commands.append(Evict(o.straggler))
        reason = reason or "a persistent straggler"
    return Step(s, tuple(commands), reason)


def settle(plan: Step, command: Command, answer: Any) -> Step:
    """What the ladder (or the executor) answered to ``command``, carried out from ``plan`` (its state, and the
    commands still to carry out): the plan from here on.  A generation formed in process is RECOVERING until the
    next pass observes that every member rejoined."""
    s = plan.state
    if s.phase is Phase.ENDED:
        return plan  # what follows an end only tidies up (CloseSlowness)
    if isinstance(answer, Outcome):
        return _end(s, answer)
    if isinstance(answer, Assignment):
        return Step(replace(s, phase=Phase.RECOVERING, hold=None), (Adopt(answer),),
                    f"generation {answer.generation} formed in process", pause=False)
    if isinstance(command, ResumeHold):
        if isinstance(answer, Hold):
            return Step(replace(s, phase=Phase.HOLDING, hold=answer), (), "the ladder still holds")
        return Step(s, (StopOnFailure(answer),), "the ladder answered restart or stop", pause=False)
    if isinstance(answer, Hold):
        return Step(replace(s, phase=Phase.HOLDING, hold=answer), (), "members lost; the ladder holds", pause=False)
    if isinstance(command, RequestStop) and isinstance(answer, int):
        return replace(plan, state=replace(s, stop_at=answer))
    return plan

