"""What one pass of the across-machines recovery flow does, by table (:func:`resilient.agent.cluster_flow.next_moves`)."""

from __future__ import annotations

import pytest

from resilient.agent.cluster_flow import Move, TickFacts, next_moves


def facts(**kw) -> TickFacts:
    return TickFacts(**{"generation": 4, "current": True, "me": "n0", "recovery_timeout_s": 60.0, **kw})


@pytest.mark.parametrize(("given", "moves", "why"), [
    (facts(current=False, decided=True, involved=True), (), "the store's copy is of another generation"),
    (facts(), (), "nothing to do"),
    # A grow's joiners alone here, the run over: end as it did; not while it runs.
    (facts(joiners_only=True, launch_ended=True, decided=True), (Move.END_JOINERS,), "the run ended before"),
    (facts(joiners_only=True, launch_ended=False), (), "nothing to do"),
    (facts(decided=True), (Move.APPLY,), "the generation's decision is in the store"),
    (facts(decided=True, involved=True, claim="n1"), (Move.APPLY,), "decision is in the store"),
    # The generation being formed lost a member: abandon first, then whatever follows.
    (facts(forming_failed=True, decided=True), (Move.ABANDON, Move.APPLY), "was lost or left it; the generation's"),
    (facts(forming_failed=True, involved=True), (Move.ABANDON, Move.DECIDE), "and no claim yet"),
    (facts(forming_failed=True), (Move.ABANDON,), "nothing to do"),
    (facts(members_here=False), (Move.IDLE,), "only spares here"),
    (facts(members_here=False, involved=True, may_grow=True), (Move.IDLE,), "only spares here"),
    (facts(involved=True), (Move.DECIDE,), "a failure of this generation, and no claim yet"),
    # Only the generation's collector reads the survivors' reports and decides; the next in turn a settle later.
    (facts(involved=True, collector="n0"), (Move.DECIDE,), "and no claim yet"),
    (facts(involved=True, collector="n1", collector_turn=1, involved_for_s=4.9), (),
     "node n1 collects the survivors' reports and decides"),
    (facts(involved=True, collector="n1", collector_turn=1, involved_for_s=5.0), (Move.DECIDE,), "and no claim yet"),
    (facts(involved=True, collector="n1", collector_turn=2, involved_for_s=9.0), (), "node n1 collects"),
    (facts(involved=True, collector="n1", collector_turn=2, involved_for_s=10.0), (Move.DECIDE,), "no claim yet"),
    (facts(involved=True, collector="n1", claim="n2"), (), "node n2 is deciding"),
    (facts(involved=True, claim="n0"), (Move.CLEAR_STALE_CLAIM,), "a claim naming this agent"),
    (facts(involved=True, claim="n1", involved_for_s=59.0), (), "node n1 is deciding"),
    (facts(involved=True, claim="n1", involved_for_s=61.0), (Move.GIVE_UP,),
     "node n1 claimed the decision after generation 4 and published none within 60 s"),
    # A failure being answered is never grown over.
    (facts(involved=True, claim="n1", may_grow=True), (), "node n1 is deciding"),
    (facts(may_grow=True), (Move.GROW,), "the world is below its full size"),
])
def test_one_pass_moves(given: TickFacts, moves: tuple[Move, ...], why: str) -> None:
    got, reason = next_moves(given)
    assert got == moves, (given, got, reason)
    assert why in reason, reason


def test_a_claim_is_never_decided_over_and_a_decision_is_always_applied() -> None:
    """Over every combination of the facts: DECIDE only without a claim, never beside APPLY; APPLY exactly when a
    decision is there (and the snapshot current, and not ending as the run did); at most one move that answers the
    pass besides ABANDON, which comes first."""
    import itertools

    flags = ("current", "joiners_only", "launch_ended", "forming_failed", "decided", "members_here", "involved",
             "may_grow")
    for values in itertools.product((False, True), repeat=len(flags)):
        for claim, collector, turn, waited in itertools.product((None, "n0", "n1"), (None, "n0", "n1"), (0, 1, 3),
                                                                (1.0, 100.0)):
            if (collector == "n0") != (turn == 0) and collector is not None:
                continue  # n0 is this node: first in turn exactly when it is the collector
            f = facts(**dict(zip(flags, values)), claim=claim, involved_for_s=waited, collector=collector,
                      collector_turn=turn)
            moves, _ = next_moves(f)
            assert Move.DECIDE not in moves or claim is None, f
            # A node later in turn decides only once every node before it had its settle time; the first always
            # does (some agent decides every failure).
            assert Move.DECIDE not in moves or collector in (None, "n0") or waited >= turn * f.settle_s, f
            answering = f.current and f.involved and f.members_here and not f.decided and claim is None
            if answering and collector in (None, "n0") and not (f.joiners_only and f.launch_ended):
                assert Move.DECIDE in moves, f
            ending = f.joiners_only and f.launch_ended
            assert (Move.APPLY in moves) == (f.current and f.decided and not ending), f
            assert (Move.ABANDON in moves) == (f.current and f.forming_failed and not ending), f
            assert len([m for m in moves if m is not Move.ABANDON]) <= 1, f
            assert Move.ABANDON not in moves or moves[0] is Move.ABANDON, f


def test_the_collectors_of_a_generation_start_with_the_node_that_marked_it_failed() -> None:
    from resilient.agent.cluster import collectors

    assert collectors("n2", {"n0", "n1", "n2", "s0"}, "n1") == ["n2", "n0", "n1", "s0"]
    # A node judged lost has no turn (the next collects at once); a node always counts itself live.
    assert collectors("n2", {"n1", "s0"}, "n0") == ["n0", "n1", "s0"]
    assert collectors(None, {"n1"}, "n0") == ["n0", "n1"]
