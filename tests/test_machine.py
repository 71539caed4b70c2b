"""The generation's state machine (``resilient/agent/machine.py``) by table, by property, and against its diagram.

The transition and settle functions are pure: each row below is a state, what
one pass observed (or what the ladder answered to a command), and the phase,
commands and outcome that must follow.  A property test drives whole passes
(a transition, then an answer of every kind to each command) from any state
and checks every change of phase is one of ``EDGES``; the rows together make
every one of ``EDGES``; and the diagram in ``docs/architecture.md`` draws
exactly ``EDGES``.
"""

from __future__ import annotations

import signal
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from resilient.agent.health import DiskObservation, HealthConfig, HealthObservation
from resilient.agent.incidents import Incident
from resilient.agent.machine import (
    EDGES,
    Adopt,
    AnswerFailure,
    AnswerHang,
    CloseSlowness,
    EndUnhealthy,
    Evict,
    Failed,
    FailRecovery,
    Moved,
    Observation,
    Phase,
    RecoveryFailed,
    RequestStop,
    ResumeHold,
    Settings,
    Step,
    StopOnFailure,
    WatchState,
    settle,
    transition,
)
from resilient.agent.outcome import Hold, Outcome
from resilient.agent.policy import Failure
from resilient.agent.rendezvous import Assignment
from resilient.elastic.observe import FaultKind
from resilient.core.events import OutcomeKind
from resilient.watchdog.sections import RankView, SectionTimeouts

from .helpers import assert_diagram_is_the_code_s

GiB = 1 << 30
CFG = Settings(preempt_grace_s=30.0, health_interval_s=10.0, health=HealthConfig(),
               sections=SectionTimeouts(explicit={"step": 5.0}))
NOW = 100.0
NEXT = Assignment(node_rank=0, num_nodes=1, generation=4, master_addr="127.0.0.1", master_port=1)


def _hold(*lost: int) -> Hold:
    failure = Failure(kind="exit", time=NOW, rank=lost[0], node="n0", exit_code=1, step=3)
    incident = Incident(id="g0003-n0", node="n0", generation=3, kind="exit", rank=lost[0], pid=None, section="step",
                        step=3, summary="rank exited 1")
    return Hold({r: f"w{r}" for r in lost}, FaultKind.CRASH, 3, (1,), failure, incident, NOW, NOW, NOW)


def _state(phase: Phase, **fields: Any) -> WatchState:
    if phase is Phase.HOLDING:
        fields.setdefault("hold", _hold(1))
    if phase is Phase.STOPPING:
        fields.setdefault("stop_deadline", NOW + 30)
        fields.setdefault("stop_at", 12)
    return WatchState(phase=phase, next_health=NOW + 5, **fields)


def _health(available: int) -> HealthObservation:
    return HealthObservation(memory_available_bytes=available, memory_total_bytes=64 * GiB, disks=(
        DiskObservation(path="/ckpt", measured_at="/", free_bytes=100 * GiB, total_bytes=200 * GiB),),
        load_avg_1m=None, cpu_count=2, gpus=(), gpu_note=None)


def _obs(**fields: Any) -> Observation:
    return Observation(now=NOW, **fields)


RUNNING_FOR_LONG = {0: RankView(section="step", step=7, entered_at=NOW - 60, pid=11)}

# (what, state, observation, phase after, commands after, outcome kind after)
ROWS: list[tuple[str, WatchState, Observation, Phase, tuple[type, ...], OutcomeKind | None]] = [
    ("nothing happens", _state(Phase.RUNNING), _obs(), Phase.RUNNING, (), None),
    ("the generation moved on in process", _state(Phase.RUNNING), _obs(news=Moved(NEXT)), Phase.RECOVERING,
     (Adopt,), None),
    ("a recovery under way goes on", _state(Phase.RECOVERING), _obs(recovering=True), Phase.RECOVERING, (), None),
    ("every member rejoined", _state(Phase.RECOVERING), _obs(recovering=False), Phase.RUNNING, (), None),
    ("the recovery cannot complete", _state(Phase.RECOVERING), _obs(news=RecoveryFailed("w2 never rejoined"),
                                                                     recovering=True),
     Phase.RECOVERING, (FailRecovery,), None),
    ("the recovery's bookkeeping ends it", _state(Phase.RUNNING),
     _obs(news=Outcome(OutcomeKind.MEMBERSHIP, "decided restart")), Phase.ENDED, (), OutcomeKind.MEMBERSHIP),
    ("a member exited non-zero", _state(Phase.RUNNING), _obs(failed=(Failed(1, 1),)), Phase.RUNNING,
     (AnswerFailure,), None),
    ("members and agent got SIGTERM together", _state(Phase.RUNNING),
     _obs(failed=(Failed(1, -signal.SIGTERM),), signalled_together=True), Phase.ENDED, (), OutcomeKind.PREEMPTED),
    ("a held member's exit is asked about again", _state(Phase.HOLDING), _obs(failed=(Failed(1, 1),)),
     Phase.HOLDING, (ResumeHold,), None),
    ("a member beyond the hold failed", _state(Phase.HOLDING), _obs(failed=(Failed(1, 1), Failed(0, -9))),
     Phase.HOLDING, (AnswerFailure,), None),
    ("a hold is no scheduler's stop", _state(Phase.HOLDING),
     _obs(failed=(Failed(1, 1), Failed(0, -signal.SIGTERM)), signalled_together=True), Phase.HOLDING,
     (AnswerFailure,), None),
    ("every worker exited 0", _state(Phase.RUNNING), _obs(all_exited=True), Phase.ENDED, (CloseSlowness,),
     OutcomeKind.SUCCEEDED),
    ("stopped workers exited", _state(Phase.STOPPING), _obs(all_exited=True, failed=(Failed(0, 1),)), Phase.ENDED,
     (CloseSlowness,), OutcomeKind.PREEMPTED),
    ("a failure while stopping is no failure", _state(Phase.STOPPING), _obs(failed=(Failed(0, 1),)),
     Phase.STOPPING, (), None),
    ("workers that do not stop in time", _state(Phase.STOPPING, stop_deadline=NOW - 1), _obs(), Phase.ENDED, (),
     OutcomeKind.PREEMPTED),
    ("only spares here, the run ended elsewhere", _state(Phase.RUNNING),
     _obs(across_machines=True, members_here=False, all_exited=True, run_ended=True), Phase.ENDED, (),
     OutcomeKind.SUCCEEDED),
    ("only spares here, the run goes on", _state(Phase.RUNNING),
     _obs(across_machines=True, members_here=False, all_exited=True), Phase.RUNNING, (), None),
    ("SIGINT", _state(Phase.HOLDING), _obs(interrupted=True), Phase.ENDED, (), OutcomeKind.INTERRUPTED),
    ("another node's verdict", _state(Phase.RECOVERING), _obs(verdict={"node": "n3", "reason": "crash loop"},
                                                               recovering=True),
     Phase.ENDED, (), OutcomeKind.VERDICT),
    ("a quarantine record", _state(Phase.RUNNING), _obs(quarantined="n0 quarantined"), Phase.ENDED, (),
     OutcomeKind.QUARANTINED),
    ("a quarantine record while stopping", _state(Phase.STOPPING), _obs(quarantined="n0 quarantined"),
     Phase.STOPPING, (), None),
    ("a stop asked for", _state(Phase.RUNNING), _obs(stop_asked=True), Phase.STOPPING, (RequestStop,), None),
    ("a stop asked for while holding", _state(Phase.HOLDING), _obs(stop_asked=True), Phase.STOPPING,
     (RequestStop,), None),
    ("a stop asked for during a recovery", _state(Phase.RECOVERING), _obs(stop_asked=True, recovering=True),
     Phase.STOPPING, (RequestStop,), None),
    ("a rank past its section's timeout", _state(Phase.RUNNING), _obs(views=RUNNING_FOR_LONG), Phase.RUNNING,
     (AnswerHang,), None),
    ("a rank that waits for the next generation is not hung", _state(Phase.RUNNING),
     _obs(views=RUNNING_FOR_LONG, waiting_members=(0,)), Phase.RUNNING, (), None),
    ("no hang is answered while members are held", _state(Phase.HOLDING), _obs(views=RUNNING_FOR_LONG),
     Phase.HOLDING, (), None),
    ("a node waits to join", _state(Phase.RUNNING), _obs(waiting_nodes=1), Phase.ENDED, (), OutcomeKind.MEMBERSHIP),
    ("the health probe finds too little memory", _state(Phase.RUNNING), _obs(health=_health(GiB // 4)),
     Phase.RUNNING, (EndUnhealthy,), None),
    ("a stop and an unhealthy node on one pass", _state(Phase.RUNNING), _obs(stop_asked=True,
                                                                              health=_health(GiB // 4)),
     Phase.STOPPING, (RequestStop, EndUnhealthy), None),
    ("a persistent straggler", _state(Phase.RUNNING), _obs(straggler={"rank": 1}), Phase.RUNNING, (Evict,), None),
    ("no straggler is weighed while members are held", _state(Phase.HOLDING), _obs(straggler={"rank": 1}),
     Phase.HOLDING, (), None),
]

# (what, the plan the command came from, the command, its answer, phase after, commands after, outcome after)
SETTLES: list[tuple[str, WatchState, Any, Any, Phase, tuple[type, ...], OutcomeKind | None]] = [
    ("the ladder recovered in process", _state(Phase.RUNNING), AnswerFailure(), NEXT, Phase.RECOVERING, (Adopt,),
     None),
    ("the ladder holds", _state(Phase.RUNNING), AnswerFailure(), _hold(1), Phase.HOLDING, (), None),
    ("a failure during a recovery held", _state(Phase.RECOVERING), AnswerFailure(), _hold(2), Phase.HOLDING, (),
     None),
    ("a hang answered by a restart", _state(Phase.RUNNING),
     AnswerHang(hang=None),  # type: ignore[arg-type]
     Outcome(OutcomeKind.FAILED, "hung"), Phase.ENDED, (), OutcomeKind.FAILED),
    ("a hold resolved", _state(Phase.HOLDING), ResumeHold(_hold(1)), NEXT, Phase.RECOVERING, (Adopt,), None),
    ("a hold still held", _state(Phase.HOLDING), ResumeHold(_hold(1)), _hold(1), Phase.HOLDING, (), None),
    ("a hold answered restart", _state(Phase.HOLDING), ResumeHold(_hold(1)), None, Phase.HOLDING,
     (StopOnFailure,), None),
    ("the group stopped after a failure", _state(Phase.HOLDING), StopOnFailure(None),
     Outcome(OutcomeKind.FAILED, "exit 1"), Phase.ENDED, (), OutcomeKind.FAILED),
    ("a failed recovery ends the generation", _state(Phase.RECOVERING), FailRecovery("never rejoined"),
     Outcome(OutcomeKind.FAILED, "never rejoined"), Phase.ENDED, (), OutcomeKind.FAILED),
    ("the workers commit at the agreed step", _state(Phase.STOPPING, stop_at=None), RequestStop(), 17,
     Phase.STOPPING, (), None),
    ("a straggler not worth replacing", _state(Phase.RUNNING), Evict({"rank": 1}), None, Phase.RUNNING, (), None),
    ("an unhealthy node", _state(Phase.STOPPING), EndUnhealthy("low memory", ()),
     Outcome(OutcomeKind.UNHEALTHY, "low memory"), Phase.ENDED, (), OutcomeKind.UNHEALTHY),
]


def _kinds(step: Step) -> tuple[type, ...]:
    return tuple(type(c) for c in step.commands)


@pytest.mark.parametrize("what,state,observed,phase,commands,outcome", ROWS, ids=[r[0] for r in ROWS])
def test_transition_by_table(what: str, state: WatchState, observed: Observation, phase: Phase,
                             commands: tuple[type, ...], outcome: OutcomeKind | None) -> None:
    step = transition(state, observed, CFG)
    assert step.state.phase is phase, step
    assert _kinds(step) == commands, step
    assert (step.state.outcome.kind if step.state.outcome is not None else None) is outcome, step
    if phase is Phase.ENDED or commands:
        assert step.reason, "a decision without its reason"
    if observed.health is not None:
        assert step.state.next_health == NOW + CFG.health_interval_s
    if RequestStop in commands and state.phase is not Phase.STOPPING:
        assert step.state.stop_deadline == NOW + CFG.preempt_grace_s


@pytest.mark.parametrize("what,state,command,answer,phase,commands,outcome", SETTLES, ids=[r[0] for r in SETTLES])
def test_settle_by_table(what: str, state: WatchState, command: Any, answer: Any, phase: Phase,
                         commands: tuple[type, ...], outcome: OutcomeKind | None) -> None:
    rest = Step(state, (CloseSlowness(),))
    step = settle(rest, command, answer)
    assert step.state.phase is phase, step
    if isinstance(command, (RequestStop, Evict)):  # the pass goes on with the commands still to carry out
        assert _kinds(step) == (CloseSlowness,), step
    else:
        assert _kinds(step) == commands, step
    assert (step.state.outcome.kind if step.state.outcome is not None else None) is outcome, step
    if isinstance(command, RequestStop):
        assert step.state.stop_at == answer
    if isinstance(answer, Hold):
        assert step.state.hold is answer


def test_the_table_makes_every_edge_and_no_other() -> None:
    made = set()
    for _, state, observed, *_ in ROWS:
        made.add((state.phase, transition(state, observed, CFG).state.phase))
    for _, state, command, answer, *_ in SETTLES:
        made.add((state.phase, settle(Step(state), command, answer).state.phase))
    changes = {(a, b) for a, b in made if a is not b}
    assert changes == EDGES, (sorted(EDGES - changes, key=str), sorted(changes - EDGES, key=str))


LADDER = [NEXT, _hold(1), _hold(0, 1), Outcome(OutcomeKind.FAILED, "exit 1")]
ANSWERS: dict[type, list[Any]] = {
    Adopt: [None], CloseSlowness: [None], AnswerFailure: LADDER, AnswerHang: LADDER, Evict: [*LADDER, None],
    ResumeHold: [NEXT, _hold(1), None], StopOnFailure: [LADDER[-1]], FailRecovery: [LADDER[-1]],
    EndUnhealthy: [Outcome(OutcomeKind.UNHEALTHY, "low memory")], RequestStop: [17],
}
"""What each command's executor can answer (the ladder's new assignment, a hold, an outcome; a restart or stop
decision to ResumeHold, None here; the agreed stop step)."""
observations = st.builds(
    Observation, now=st.floats(0, 300), failed=st.lists(st.builds(Failed, st.integers(0, 2),
                                                                   st.sampled_from([1, -9, -signal.SIGTERM])),
                                                         max_size=2).map(tuple),
    all_exited=st.booleans(), members_here=st.booleans(), signalled_together=st.booleans(),
    views=st.sampled_from([{}, RUNNING_FOR_LONG]), waiting_members=st.sampled_from([(), (0,)]),
    across_machines=st.booleans(), verdict=st.sampled_from([None, {"node": "n1", "reason": "stop"}]),
    quarantined=st.sampled_from([None, "quarantined"]), waiting_nodes=st.integers(0, 1), run_ended=st.booleans(),
    straggler=st.sampled_from([None, {"rank": 1}]),
    news=st.sampled_from([None, Moved(NEXT), RecoveryFailed("late"), Outcome(OutcomeKind.SUCCEEDED, "done")]),
    recovering=st.booleans(), interrupted=st.booleans(), stop_asked=st.booleans(),
    health=st.sampled_from([None, _health(GiB // 4), _health(32 * GiB)]))
states = st.builds(_state, st.sampled_from([p for p in Phase if p is not Phase.ENDED]))


@settings(max_examples=400, deadline=None)
@given(state=states, observed=observations, data=st.data())
def test_every_pass_changes_phase_only_along_an_edge(state: WatchState, observed: Observation,
                                                     data: st.DataObject) -> None:
    """A whole pass, as the executor runs it: the transition, then each command answered (any answer its
    executor can give), until no command is left; the phase it started in and the one it ends in are an edge."""
    plan = transition(state, observed, CFG)
    for _ in range(8):
        if not plan.commands:
            break
        command, rest = plan.commands[0], replace(plan, commands=plan.commands[1:])
        plan = settle(rest, command, data.draw(st.sampled_from(ANSWERS[type(command)])))
    assert not plan.commands, "a pass that never ends"
    start, end = state.phase, plan.state.phase
    assert start is end or (start, end) in EDGES, (start, end, observed)
    assert (end is Phase.ENDED) == (plan.state.outcome is not None)
    if end is Phase.HOLDING:
        assert plan.state.hold is not None
    if end is Phase.STOPPING:
        assert plan.state.stop_deadline is not None


def test_the_diagram_in_the_architecture_is_the_code_s() -> None:
    assert_diagram_is_the_code_s("The generation's state machine", Phase, EDGES)
