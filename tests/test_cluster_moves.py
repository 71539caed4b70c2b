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
        for claim in (None, "n0", "n1"):
            for waited in (1.0, 100.0):
                f = facts(**dict(zip(flags, values)), claim=claim, involved_for_s=waited)
                moves, _ = next_moves(f)
                assert Move.DECIDE not in moves or claim is None, f
                ending = f.joiners_only and f.launch_ended
                assert (Move.APPLY in moves) == (f.current and f.decided and not ending), f
                assert (Move.ABANDON in moves) == (f.current and f.forming_failed and not ending), f
                assert len([m for m in moves if m is not Move.ABANDON]) <= 1, f
                assert Move.ABANDON not in moves or moves[0] is Move.ABANDON, f
