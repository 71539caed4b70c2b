"""The agent's lifecycle (``resilient/agent/lifecycle.py``) by table, by property, and against its diagram.

``next_move`` is pure: the rows below are a state, an event, and the phase,
commands and ending that must follow.  A property test walks whole lives from
the start, answering each move's last command with any event of the kinds it
can answer, and checks that every change of phase is one of ``EDGES``, that
only the last command of a move answers, and that a life ends only by
``Finish``; the walks together reach every one of ``EDGES``; and the diagram in
``docs/architecture.md`` draws exactly ``EDGES``.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from resilient.agent import lifecycle as lc
from resilient.agent.incidents import Incident
from resilient.agent.outcome import Outcome
from resilient.agent.policy import Failure, History, RestartConfig
from resilient.agent.rendezvous import Assignment
from resilient.core.events import EventKind, OutcomeKind
from resilient.core.exitcodes import EXIT_CONFIG, EXIT_STOPPED, EXIT_UNHEALTHY, AgentVerdict
from resilient.elastic.decide import Action, RecoveryDecision

from .helpers import assert_diagram_is_the_code_s

POLICY = RestartConfig(max_restarts=2, crash_loop_restarts=5)
A = Assignment(node_rank=0, num_nodes=2, generation=3, master_addr="10.0.0.1", master_port=29500)


def incident(kind: str = "exit") -> Incident:
    return Incident(id="i1", node="n0", generation=3, kind=kind, rank=0, pid=10, section="step", step=7,  # type: ignore[arg-type]
                    summary="rank 0 failed", wall_time=0.0)


def failed(exit_code: int = 1) -> Outcome:
    return Outcome(OutcomeKind.FAILED, "rank 0 failed", failure=Failure(kind="exit", time=1.0, rank=0, exit_code=exit_code),
                   incident=incident())


def decided(action: Action, **kw: object) -> Outcome:
    """A failed generation whose failure the ladder already decided (restart or stop) while it ran."""
    verdict = kw.pop("verdict", None)
    decision = RecoveryDecision(action=action, reason=f"ladder: {action.value}", step=7, world_size=4, not_before=50.0,
                                verdict=verdict, **kw)  # type: ignore[arg-type]
    return dataclasses.replace(failed(), decision=decision)


def walk(life: lc.Life, *events: lc.Event) -> lc.Move:
    move = lc.Move(life, ())
    for event in events:
        move = lc.next_move(move.life, event)
    return move


def started(spare: bool = False) -> lc.Life:
    return lc.next_move(lc.begin(spare=spare, policy=POLICY).life, lc.LaunchJoined(None)).life


def test_a_worker_node_joins_the_launch_checks_and_joins_the_rendezvous() -> None:
    first = lc.begin(spare=False, policy=POLICY)
    assert first.life.phase is lc.Phase.STARTING and first.commands == (lc.JoinLaunch(),)
    move = lc.next_move(first.life, lc.LaunchJoined(None))
    assert move.life.phase is lc.Phase.CHECKING and move.commands == (lc.MakeRendezvous(), lc.Check())
    move = lc.next_move(move.life, lc.Checked())
    assert move.life.phase is lc.Phase.JOINING and move.commands == (lc.GiveFailureRate(), lc.Rendezvous())
    move = lc.next_move(move.life, lc.Assigned(A))
    assert move.life.phase is lc.Phase.RUNNING and move.life.generation == 3
    assert move.commands == (lc.RunGeneration(A, restart=False),)


def test_a_spare_node_follows_the_launch_and_waits_for_a_generation_in_the_same_machine() -> None:
    move = lc.next_move(lc.begin(spare=True, policy=POLICY).life, lc.LaunchJoined(None))
    assert move.commands == (lc.FollowLaunch(), lc.Check())
    move = lc.next_move(move.life, lc.Checked())
    assert move.life.phase is lc.Phase.SPARE and move.commands == (lc.GiveFailureRate(), lc.AwaitGeneration())
    move = lc.next_move(move.life, lc.Opened(4))
    assert move.life.phase is lc.Phase.RUNNING and move.life.generation == 4
    say, run = move.commands
    assert say == lc.Say(EventKind.SPARE_NODE_JOINED, (("generation", 4),))
    assert isinstance(run, lc.RunGeneration) and run.assignment.node_rank == -1 and not run.restart
    # Its generation ends without it being needed: back to checking, still a spare node.
    move = lc.next_move(move.life, lc.GenerationEnded(Outcome(OutcomeKind.MEMBERSHIP, "grew"), 5))
    assert move.life.phase is lc.Phase.CHECKING and move.life.spare and move.life.generation == 5
    # It takes a lost node's place: a worker node from here on, joining the restart's rendezvous.
    move = lc.next_move(lc.next_move(move.life, lc.Checked()).life, lc.Opened(6))
    took = Outcome(OutcomeKind.FAILED, "n1 lost", takes_place_of="n1")
    move = lc.next_move(move.life, lc.GenerationEnded(took, 6))
    assert move.life.phase is lc.Phase.CHECKING and not move.life.spare and move.life.restart
    assert move.commands == (lc.TakePlace(took), lc.MakeRendezvous(), lc.Check())
    assert lc.next_move(move.life, lc.Checked()).commands == (lc.GiveFailureRate(), lc.Rendezvous())


def test_a_token_that_differs_ends_the_agent_with_exit_78() -> None:
    move = lc.next_move(lc.begin(spare=False, policy=POLICY).life, lc.LaunchJoined("run token differs"))
    assert move.life.phase is lc.Phase.ENDED
    assert move.commands == (lc.Say(EventKind.TOKEN_MISMATCH, (("reason", "run token differs"),)),
                             lc.Finish(lc.Ending(EXIT_CONFIG, AgentVerdict.TOKEN_MISMATCH, "run token differs"), 0))


@pytest.mark.parametrize(("found", "ending", "before"), [
    (lc.Checked(verdict={"exit_code": 80, "verdict": "crash_loop", "reason": "n1: loop"}),
     lc.Ending(80, AgentVerdict.CRASH_LOOP, "n1: loop"), ()),
    (lc.Checked(stuck="pid 7 did not end"), lc.Ending(EXIT_UNHEALTHY, AgentVerdict.UNHEALTHY, "pid 7 did not end"),
     ()),
    (lc.Checked(unhealthy=incident("unhealthy"), unhealthy_reason="disk full"),
     lc.Ending(EXIT_UNHEALTHY, AgentVerdict.UNHEALTHY, "disk full"), (lc.StepOut(incident("unhealthy"), "disk full"),)),
    (lc.Checked(held=(0, "succeeded", "the run ended while this node was held out")),
     lc.Ending(0, AgentVerdict.SUCCEEDED, "the run ended while this node was held out", quiet=True), ()),
    (lc.Checked(stopping=True), lc.Ending(75, AgentVerdict.PREEMPTED, "stopped before workers started"), ()),
])
def test_each_check_before_a_round_ends_the_agent_with_its_verdict(found: lc.Checked, ending: lc.Ending,
                                                                  before: tuple[lc.Command, ...]) -> None:
    move = lc.next_move(started(), found)
    assert move.life.phase is lc.Phase.ENDED
    assert move.commands == (*before, lc.Finish(ending, 0))


def test_a_failed_round_ends_by_the_published_verdict_retries_a_stale_launch_or_fails() -> None:
    joining = lc.next_move(started(), lc.Checked()).life
    published = lc.next_move(joining, lc.RoundFailed("closed", verdict={"exit_code": 80, "verdict": "budget_exhausted",
                                                                         "reason": "3 of 3"}))
    assert published.commands == (lc.Finish(lc.Ending(80, AgentVerdict.BUDGET_EXHAUSTED, "3 of 3"), 0),)
    retried = lc.next_move(joining, lc.RoundFailed("closed", retried=True))
    assert retried.life.phase is lc.Phase.CHECKING and retried.commands == (lc.Check(),)
    over = lc.next_move(joining, lc.RoundFailed("closed", over=(75, "preempted", "stopped by n1")))
    assert over.commands == (lc.Finish(lc.Ending(75, AgentVerdict.PREEMPTED, "stopped by n1"), 0),)
    timeout = lc.next_move(joining, lc.RoundFailed("RendezvousTimeoutError: no round in 600 s"))
    assert timeout.commands[-1] == lc.Finish(lc.Ending(EXIT_STOPPED, AgentVerdict.RENDEZVOUS_FAILED,
                                                       "RendezvousTimeoutError: no round in 600 s"), 0)
    assert timeout.commands[0].kind is EventKind.RENDEZVOUS_FAILED  # type: ignore[union-attr]


def test_a_failed_generation_asks_the_restart_policy_once_and_restarts_within_the_budget() -> None:
    running = lc.next_move(lc.next_move(started(), lc.Checked()).life, lc.Assigned(A)).life
    deciding = lc.next_move(running, lc.GenerationEnded(failed(), 3))
    assert deciding.life.phase is lc.Phase.DECIDING and deciding.commands == (lc.ReadHistory(failed()),)
    again = lc.next_move(deciding.life, lc.HistoryRead(failed(), History(restarts_used=1), 100.0))
    record, restart, check = again.commands
    assert isinstance(record, lc.RecordFailure) and record.decision.reason.startswith("restart 2 of 2")
    assert restart == lc.Restart(failed(), record.decision, 3) and check == lc.Check()
    assert again.life.phase is lc.Phase.CHECKING and again.life.restart
    assert lc.next_move(lc.next_move(again.life, lc.Checked()).life, lc.Assigned(A)).commands == (
        lc.RunGeneration(A, restart=True),)


def test_a_spent_budget_publishes_its_verdict_before_the_agent_ends() -> None:
    deciding = lc.Life(lc.Phase.DECIDING, spare=False, policy=POLICY, generation=3, restart=True)
    move = lc.next_move(deciding, lc.HistoryRead(failed(), History(restarts_used=2), 100.0))
    record, publish, finish = move.commands
    assert isinstance(record, lc.RecordFailure) and isinstance(publish, lc.PublishVerdict)
    assert publish.ending.verdict is AgentVerdict.BUDGET_EXHAUSTED and publish.ending.code == EXIT_STOPPED
    assert finish == lc.Finish(publish.ending, 3)


def test_a_worker_that_says_do_not_restart_me_gives_the_agent_its_exit_code() -> None:
    deciding = lc.Life(lc.Phase.DECIDING, spare=False, policy=POLICY, generation=3)
    move = lc.next_move(deciding, lc.HistoryRead(failed(exit_code=79), History(), 100.0))
    finish = move.commands[-1]
    assert isinstance(finish, lc.Finish)
    assert finish.ending.verdict is AgentVerdict.DO_NOT_RESTART and finish.ending.code == 79


def test_a_peer_s_do_not_restart_code_stops_the_run_though_the_incident_is_about_another_rank() -> None:
    deciding = lc.Life(lc.Phase.DECIDING, spare=False, policy=POLICY, generation=3)
    outcome = dataclasses.replace(failed(exit_code=1), exit_codes=(1, 78))
    finish = lc.next_move(deciding, lc.HistoryRead(outcome, History(), 100.0)).commands[-1]
    assert isinstance(finish, lc.Finish)
    assert (finish.ending.verdict, finish.ending.code) == (AgentVerdict.DO_NOT_RESTART, 78)


def test_a_decision_the_generation_took_is_carried_out_as_it_is_without_a_second() -> None:
    """The ladder's restart (with its delay) or stop is the one decision: no history read, no policy asked again."""
    running = lc.Life(lc.Phase.RUNNING, spare=False, policy=POLICY, generation=3)
    outcome = decided(Action.RESTART, numbers={"delay_s": 2.0})
    move = lc.next_move(running, lc.GenerationEnded(outcome, 3))
    assert move.commands == (lc.RecordFailure(outcome, outcome.decision), lc.Restart(outcome, outcome.decision, 3),
                             lc.Check())
    assert move.life.phase is lc.Phase.CHECKING and outcome.decision is not None and outcome.decision.delay_s == 2.0
    stop = decided(Action.STOP, verdict="do_not_restart", exit_code=78)
    record, publish, finish = lc.next_move(running, lc.GenerationEnded(stop, 3)).commands
    assert isinstance(publish, lc.PublishVerdict) and publish.ending.verdict is AgentVerdict.DO_NOT_RESTART
    assert finish == lc.Finish(lc.Ending(78, AgentVerdict.DO_NOT_RESTART, "ladder: stop"), 3)
    with pytest.raises(ValueError, match="restarted or stopped, not shrink"):
        lc.next_move(running, lc.GenerationEnded(decided(Action.SHRINK), 3))


@pytest.mark.parametrize(("kind", "ending", "from_launch"), [
    (OutcomeKind.SUCCEEDED, lc.Ending(0, AgentVerdict.SUCCEEDED, "why"), False),
    (OutcomeKind.PREEMPTED, lc.Ending(75, AgentVerdict.PREEMPTED, "why"), False),
    (OutcomeKind.INTERRUPTED, lc.Ending(130, AgentVerdict.INTERRUPTED, "why"), False),
    (OutcomeKind.VERDICT, lc.Ending(EXIT_STOPPED, AgentVerdict.STOPPED, "why"), True),
])
def test_a_generation_s_end_that_ends_the_agent(kind: OutcomeKind, ending: lc.Ending, from_launch: bool) -> None:
    running = lc.Life(lc.Phase.RUNNING, spare=False, policy=POLICY, generation=3)
    move = lc.next_move(running, lc.GenerationEnded(Outcome(kind, "why"), 4))
    assert move.life.phase is lc.Phase.ENDED and move.commands == (lc.Finish(ending, 4, from_launch),)


def test_a_quarantine_or_a_membership_change_goes_to_the_next_round() -> None:
    running = lc.Life(lc.Phase.RUNNING, spare=False, policy=POLICY, generation=3)
    held = lc.next_move(running, lc.GenerationEnded(Outcome(OutcomeKind.QUARANTINED, "quarantined"), 3))
    assert held.commands == (lc.LeaveRendezvous(), lc.Check()) and not held.life.restart
    grew = lc.next_move(running, lc.GenerationEnded(Outcome(OutcomeKind.MEMBERSHIP, "n2 joined"), 3))
    assert grew.commands == (lc.MembershipChanged(3, "n2 joined"), lc.Check()) and grew.life.restart


def test_an_event_a_phase_cannot_take_is_refused() -> None:
    with pytest.raises(ValueError, match="no move from phase joining"):
        lc.next_move(lc.Life(lc.Phase.JOINING, spare=False, policy=POLICY), lc.Opened(3))
    with pytest.raises(ValueError, match="without its failure"):
        lc.next_move(lc.Life(lc.Phase.RUNNING, spare=False, policy=POLICY),
                     lc.GenerationEnded(Outcome(OutcomeKind.FAILED, "?"), 1))


def test_the_ending_as_reported() -> None:
    asked = lc.Ending(75, AgentVerdict.PREEMPTED, "SIGTERM")
    assert lc.final(asked, None) == asked
    failed_thread = lc.final(asked, "the agent's presence thread kept failing (boom)")
    assert failed_thread == lc.Ending(EXIT_STOPPED, AgentVerdict.AGENT_THREAD_FAILED,
                                      "the agent's presence thread kept failing (boom)")
    done = lc.Ending(0, AgentVerdict.SUCCEEDED, "done")
    assert lc.final(done, "a thread failed") == done, "only a stop is the one the thread's failure asked for"
    odd = lc.Ending.published({"exit_code": 80, "verdict": "melted", "reason": "n3 says so"})
    assert odd == lc.Ending(80, AgentVerdict.STOPPED, "n3 says so (verdict 'melted')")


# ------------------------------------------------------------------ property: whole lives
OUTCOMES = st.sampled_from([
    Outcome(OutcomeKind.SUCCEEDED, "done"), Outcome(OutcomeKind.PREEMPTED, "stop"),
    Outcome(OutcomeKind.INTERRUPTED, "int"), Outcome(OutcomeKind.VERDICT, "n1"),
    Outcome(OutcomeKind.UNHEALTHY, "disk", incident=incident("unhealthy")),
    Outcome(OutcomeKind.QUARANTINED, "q"), Outcome(OutcomeKind.MEMBERSHIP, "grew"), failed(), failed(79),
    decided(Action.RESTART, numbers={"delay_s": 2.0}), decided(Action.STOP, verdict="crash_loop"),
    Outcome(OutcomeKind.FAILED, "n1 lost", takes_place_of="n1"),
])
VERDICT = {"exit_code": 80, "verdict": "crash_loop", "reason": "loop"}
ANSWERS: dict[type, st.SearchStrategy[lc.Event]] = {
    lc.JoinLaunch: st.sampled_from([lc.LaunchJoined(None), lc.LaunchJoined("token differs")]),
    lc.Check: st.sampled_from([lc.Checked(), lc.Checked(), lc.Checked(verdict=VERDICT), lc.Checked(stuck="pid 7"),
                               lc.Checked(unhealthy=incident("unhealthy"), unhealthy_reason="disk"),
                               lc.Checked(held=(75, "preempted", "held")), lc.Checked(stopping=True)]),
    lc.Rendezvous: st.one_of(st.builds(lc.Assigned, st.just(A)), st.sampled_from([
        lc.RoundFailed("x", verdict=VERDICT), lc.RoundFailed("x", retried=True),
        lc.RoundFailed("x", over=(0, "succeeded", "over")), lc.RoundFailed("timeout")])),
    lc.AwaitGeneration: st.one_of(st.builds(lc.Opened, st.integers(1, 9)), st.sampled_from([
        lc.Released(stopped=True), lc.Released(verdict=VERDICT), lc.Released(ended=True)])),
    lc.RunGeneration: st.builds(lc.GenerationEnded, OUTCOMES, st.integers(1, 9)),
    lc.ReadHistory: st.builds(lambda o, used: lc.HistoryRead(o, History(restarts_used=used), 5.0),
                              st.sampled_from([failed(), failed(79)]), st.integers(0, 3)),
}


@settings(max_examples=300, deadline=None)
@given(spare=st.booleans(), data=st.data())
def test_every_life_changes_phase_only_along_the_edges_and_ends_by_finish(spare: bool, data: st.DataObject) -> None:
    move = lc.begin(spare=spare, policy=POLICY)
    for _ in range(40):
        *effects, last = move.commands
        assert not any(type(c) in ANSWERS or isinstance(c, lc.Finish) for c in effects), move.commands
        if isinstance(last, lc.Finish):
            assert move.life.phase is lc.Phase.ENDED
            return
        assert move.life.phase is not lc.Phase.ENDED
        nxt = lc.next_move(move.life, data.draw(ANSWERS[type(last)]))
        a, b = move.life.phase, nxt.life.phase
        assert a is b or (a, b) in lc.EDGES, (a, b)
        assert nxt.life.spare <= move.life.spare, "a worker node never becomes a spare node"
        move = nxt


def test_the_rows_and_walks_reach_every_edge() -> None:
    seen = set()
    lives = [(lc.begin(spare=s, policy=POLICY), ()) for s in (False, True)]
    for first, _ in lives:  # breadth-first over every answer in ANSWERS' lists, a few moves deep
        frontier = [first]
        for _ in range(6):
            later = []
            for move in frontier:
                last = move.commands[-1]
                if isinstance(last, lc.Finish):
                    continue
                for event in _examples(type(last)):
                    nxt = lc.next_move(move.life, event)
                    if nxt.life.phase is not move.life.phase:
                        seen.add((move.life.phase, nxt.life.phase))
                    later.append(nxt)
            frontier = later[:400]
    assert seen == set(lc.EDGES), sorted(set(lc.EDGES) - seen, key=str)


def _examples(command: type) -> list[lc.Event]:
    fixed = {
        lc.JoinLaunch: [lc.LaunchJoined(None), lc.LaunchJoined("differs")],
        lc.Check: [lc.Checked(), lc.Checked(stopping=True)],
        lc.Rendezvous: [lc.Assigned(A), lc.RoundFailed("x", retried=True), lc.RoundFailed("timeout")],
        lc.AwaitGeneration: [lc.Opened(4), lc.Released(ended=True)],
        lc.RunGeneration: [lc.GenerationEnded(o, 4) for o in (Outcome(OutcomeKind.SUCCEEDED, "done"), failed(),
                                                              Outcome(OutcomeKind.MEMBERSHIP, "grew"))],
        lc.ReadHistory: [lc.HistoryRead(failed(), History(), 1.0), lc.HistoryRead(failed(), History(restarts_used=9), 1.0)],
    }
    return fixed[command]


def test_the_diagram_in_the_architecture_is_the_code_s() -> None:
    assert_diagram_is_the_code_s("The agent's lifecycle", lc.Phase, lc.EDGES)
