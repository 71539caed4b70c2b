"""The recovery decision and the grow-back decision, with made-up failures, spare pools and times.

Pure and fast: no torch, no processes (but one, which checks that the package imports without torch).
Each rule of the ladder has a test asserting on the decision and the numbers in its reason; hypothesis
checks the invariants over random observations and sequences of failures.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from resilient.agent.decision import LadderCase, Restarts, decide
from resilient.agent.policy import Failure, History, RestartConfig
from resilient.elastic.costs import RecoveryCosts, shrink_or_wait
from resilient.elastic.decide import Action, LadderConfig, Promotion, RecoveryDecision
from resilient.elastic.grow import GrowAction, decide_grow
from resilient.elastic.observe import Fault, FaultKind, Membership, Observation, Spare
from resilient.core.errors import ConfigError

NOW = 1000.0
CFG = LadderConfig()
COSTS = RecoveryCosts()
FAILURE = Failure(kind="exit", time=NOW, rank=1, exit_code=1, step=57)
FRESH = Restarts(History(), RestartConfig())
"""No restart used yet: the policy allows one now."""
FRESH_SAYS = ("restart 1 of 3 now after: rank 1 failed with exit 1 at step 57; no commit reported yet (the workers "
              "restore the newest that verifies, if any)")
"""The restart policy's reason under FRESH, which follows the ladder's in a restart's."""
REFUSED = Restarts(History(restarts_used=3), RestartConfig(max_restarts=3))
"""The budget is spent: the policy stops."""


def decide_recovery(obs: Observation, costs: RecoveryCosts, cfg: LadderConfig, now: float, *,
                    restarts: Restarts = FRESH, failure: Failure = FAILURE) -> RecoveryDecision:
    """The one decision on a failure with the ladder on offer, as the agent takes it."""
    return decide(failure, restarts, now, ladder=LadderCase(obs, costs, cfg))


def members(world: int = 4, *, min_size: int = 2, max_size: int | None = None, full: int | None = None,
            feasible: set[int] | None = None, nodes: list[str] | None = None) -> Membership:
    full = world if full is None else full
    return Membership(
        rank_nodes=tuple(nodes or [f"n{r}" for r in range(world)]),
        min_size=min_size, max_size=max_size or full, full_size=full,
        feasible_world_sizes=frozenset(feasible if feasible is not None else range(1, full + 1)),
    )


def spare(sid: str, node: str = "s-node", *, ready_since: float = 0.0, **kw: object) -> Spare:
    return Spare(id=sid, node=node, ready_since=ready_since, **kw)  # type: ignore[arg-type]


def observe(fault: Fault, m: Membership | None = None, *, spares: tuple[Spare, ...] = (), step: int = 56,
            **kw: object) -> Observation:
    """All survivors alive, opted in and agreeing on ``step`` unless told otherwise."""
    m = m or members()
    lost = set(fault.ranks) | ({r for r, n in enumerate(m.rank_nodes) if n in fault.nodes}
                               if fault.kind is FaultKind.NODE_LOST else set())
    fields: dict[str, object] = {
        "survivor_steps": {r: step for r in range(m.world_size) if r not in lost}, "opted_in": True,
    }
    fields.update(kw)
    return Observation(fault=fault, membership=m, spares=spares, **fields)  # type: ignore[arg-type]


def crash(*ranks: int, step: int = 57, **kw: object) -> Fault:
    return Fault(kind=FaultKind.CRASH, step=step, ranks=frozenset(ranks), **kw)  # type: ignore[arg-type]


# --- the exit-code contract ------------------------------------------------------------------------------


@pytest.mark.parametrize("code", [78, 79])
def test_do_not_restart_exit_codes_stop_even_with_a_spare(code: int) -> None:
    d = decide_recovery(observe(crash(1, exit_codes=frozenset({1, code})), spares=(spare("s1"),)), COSTS, CFG, NOW)
    assert (d.action, d.verdict, d.promotions) == (Action.STOP, "do_not_restart", ())
    assert d.reason.startswith(f"stop: rank 1 failed at step 57; exit {code} says by the exit-code contract")


# --- rung 1: in place, and a spare ----------------------------------------------------------------------


def test_collective_error_with_every_rank_alive_retries_in_place() -> None:
    d = decide_recovery(observe(Fault(kind=FaultKind.COLLECTIVE_ERROR, step=57)), COSTS, CFG, NOW)
    assert (d.action, d.world_size, d.step, d.not_before, d.promotions) == (Action.RETRY_IN_PLACE, 4, 57, NOW, ())
    assert d.reason == ("retry step 57 in place: a collective failed at step 57; all 4 ranks alive and agree on "
                        "step 56; re-form among the same members (~0.5 s, a restart ~7.0 s)")


def test_a_warm_spare_takes_the_lost_rank() -> None:
    d = decide_recovery(observe(crash(1), spares=(spare("s1", "n9"),)), RecoveryCosts(spare_s=0.2), CFG, NOW)
    assert (d.action, d.world_size, d.promotions, d.dropped_ranks) == (
        Action.PROMOTE_SPARE, 4, (Promotion(rank=1, spare="s1", node="n9"),), ())
    assert d.reason == ("promote spare s1 (node n9) into rank 1 and retry step 57: rank 1 failed at step 57; "
                        "survivors agree on step 56; re-form in-process (~0.2 s, a restart ~7.0 s)")
    assert dict(d.rank_map(4)) == {0: 0, 1: 1, 2: 2, 3: 3}


def test_spare_choice_skips_unhealthy_cold_claimed_and_those_on_a_lost_node() -> None:
    m = members(4, nodes=["a", "a", "b", "b"])
    pool = (
        spare("sick", "c", healthy=False),
        spare("cold", "c", warm=False),
        spare("taken", "c", claimed=True),
        spare("on-b", "b", ready_since=-50.0),  # the longest ready, but on the lost node
        spare("young", "c", ready_since=20.0),
        spare("old", "d", ready_since=10.0),
    )
    d = decide_recovery(observe(Fault(kind=FaultKind.NODE_LOST, step=57, nodes=frozenset({"b"})), m, spares=pool),
                        COSTS, CFG, NOW)
    assert d.action is Action.PROMOTE_SPARE
    assert d.promotions == (Promotion(rank=2, spare="old", node="d"), Promotion(rank=3, spare="young", node="c"))
    assert "node b was lost at step 57 (ranks 2, 3)" in d.reason


# --- rung 2: shrink, or wait ----------------------------------------------------------------------------


def test_more_losses_than_spares_promotes_the_lowest_and_shrinks_away_the_rest() -> None:
    costs = RecoveryCosts(repair_s=600.0)
    d = decide_recovery(observe(crash(3, 1), spares=(spare("s1", "n9"),)), costs, CFG, NOW)
    assert (d.action, d.world_size, d.promotions, d.dropped_ranks) == (
        Action.SHRINK, 3, (Promotion(rank=1, spare="s1", node="n9"),), (3,))
    assert d.reason == (
        "shrink 4 -> 3 ranks, dropping rank 3, and retry step 57: ranks 1, 3 failed at step 57; no ready spare for "
        "rank 3 (promoting spare s1 (node n9) into rank 1); shrunk work r*max(0, R - d_shrink) = "
        "0.75*max(0, 600.0 - 1.0) = 449.2 s > d_grow 2.0 s")
    assert dict(d.rank_map(4)) == {0: 0, 1: 1, 2: 2}
    assert d.numbers["gain_s"] == pytest.approx(0.75 * 599.0)


def test_a_shrink_closes_up_the_ranks_above_the_dropped_one() -> None:
    d = decide_recovery(observe(crash(1)), COSTS, CFG, NOW)
    assert (d.action, d.dropped_ranks) == (Action.SHRINK, (1,))
    assert dict(d.rank_map(4)) == {0: 0, 2: 1, 3: 2}


def test_unknown_repair_time_counts_as_long_and_shrinks() -> None:
    d = decide_recovery(observe(crash(2)), RecoveryCosts(repair_s=None), CFG, NOW)
    assert (d.action, d.world_size) == (Action.SHRINK, 3)
    assert d.reason.endswith("repair time unknown (treated as long): shrunk work at r=0.75 is unbounded > d_grow 2.0 s")
    event = d.to_event()
    assert event["numbers"]["gain_s"] is None and event["numbers"]["repair_s"] is None
    json.dumps(event, allow_nan=False)


def test_a_short_repair_is_waited_for_rather_than_shrinking() -> None:
    m = members(2, min_size=1)
    d = decide_recovery(observe(crash(1), m), RecoveryCosts(repair_s=3.0), CFG, NOW)
    assert (d.action, d.world_size, d.wait_until, d.promotions) == (Action.WAIT_FOR_REPAIR, 2, NOW + 300.0, ())
    assert d.reason == (
        "wait for repair until t=1300.0 (expected in 3.0 s): rank 1 failed at step 57; no ready spare for rank 1; "
        "shrunk work r*max(0, R - d_shrink) = 0.50*max(0, 3.0 - 1.0) = 1.0 s <= d_grow 2.0 s, so holding beats "
        "shrinking to 1")


def test_a_measured_throughput_fraction_replaces_the_ratio() -> None:
    # 3 of 4 ranks, but the shrunk world measured at 10% of full speed: 0.1 * (20 - 1) = 1.9 s <= 2.0 s.
    d = decide_recovery(observe(crash(3)), RecoveryCosts(repair_s=20.0, throughput_fraction=0.1), CFG, NOW)
    assert d.action is Action.WAIT_FOR_REPAIR
    assert "0.10*max(0, 20.0 - 1.0) = 1.9 s <= d_grow 2.0 s" in d.reason
    assert shrink_or_wait(RecoveryCosts(repair_s=20.0), 3, 4).gain_s == pytest.approx(14.25)


def test_the_wait_is_bounded_then_the_run_shrinks() -> None:
    obs = observe(crash(1), members(2, min_size=1), waiting_since=NOW - 300.0)
    d = decide_recovery(obs, RecoveryCosts(repair_s=3.0), CFG, NOW)
    assert (d.action, d.world_size) == (Action.SHRINK, 1)
    assert d.reason.endswith("= 1.0 s <= d_grow 2.0 s, but the wait bound is spent (300.0 s of max_wait_s=300.0 s)")
    # A repair expected past the bound is not waited for either.
    d = decide_recovery(observe(crash(1), members(2, min_size=1), waiting_since=NOW - 299.0),
                        RecoveryCosts(repair_s=3.0), CFG, NOW)
    assert d.action is Action.SHRINK
    assert "the expected repair in 3.0 s is past the wait bound (1.0 s left of max_wait_s=300.0 s)" in d.reason
    d = decide_recovery(observe(crash(1), members(2, min_size=1)), RecoveryCosts(repair_s=3.0),
                        LadderConfig(max_wait_s=0.0), NOW)
    assert d.action is Action.SHRINK and d.reason.endswith("but waiting for a repair is off (max_wait_s=0)")


@pytest.mark.parametrize(
    ("m", "why"),
    [
        (members(4, min_size=4), "shrinking 4 -> 3 would go below the minimum world size 4"),
        (members(4, feasible={2, 4}), "3 ranks cannot keep the global batch (feasible world sizes: 2, 4)"),
    ],
)
def test_no_shrink_below_min_or_to_an_infeasible_size(m: Membership, why: str) -> None:
    d = decide_recovery(observe(crash(3), m), COSTS, CFG, NOW)
    assert (d.action, d.world_size, d.dropped_ranks) == (Action.RESTART, 4, ())
    assert d.reason == (f"rank 3 failed at step 57; no ready spare for rank 3 and {why}; the repair time is "
                        f"unknown, so no wait; {FRESH_SAYS}")


def test_without_a_shrink_a_lost_node_is_waited_for_and_a_crash_restarts() -> None:
    m = members(4, min_size=4, nodes=["a", "a", "b", "b"])
    lost_node = Fault(kind=FaultKind.NODE_LOST, step=57, nodes=frozenset({"b"}))
    d = decide_recovery(observe(lost_node, m), RecoveryCosts(repair_s=30.0), CFG, NOW)
    assert (d.action, d.wait_until) == (Action.WAIT_FOR_REPAIR, NOW + 300.0)
    assert d.reason.endswith("waiting R + d_spare = 30.0 + 1.0 = 31.0 s < restart 37.0 s")
    # A crashed process on a live node: a restart (7 s) beats waiting 10 s for a new spare.
    d = decide_recovery(observe(crash(3), m), RecoveryCosts(repair_s=10.0), CFG, NOW)
    assert d.action is Action.RESTART
    assert "waiting (11.0 s) is no cheaper than a restart (7.0 s)" in d.reason
    # ...but waiting 3 s for one beats it.
    d = decide_recovery(observe(crash(3), m), RecoveryCosts(repair_s=3.0), CFG, NOW)
    assert d.action is Action.WAIT_FOR_REPAIR
    assert d.reason.endswith("waiting R + d_spare = 3.0 + 1.0 = 4.0 s < restart 7.0 s")


# --- what makes in-process recovery impossible -----------------------------------------------------------


@pytest.mark.parametrize(
    ("fault", "kw", "cfg", "blocker"),
    [
        (crash(1), {"opted_in": False}, CFG,
         "the script did not opt in (Run(ddp=True) with the step under `with run.attempt():`)"),
        (crash(1), {"diverged": frozenset({2})}, CFG, "rank 2 reported diverged in-memory state"),
        (crash(1), {"survivor_steps": {0: 56, 2: 57, 3: 56}}, CFG,
         "survivors disagree on the last completed step (rank 0: 56, rank 2: 57, rank 3: 56)"),
        (crash(1), {"survivor_steps": {0: 56, 2: 56}}, CFG,
         "rank 3 reported no last completed step, so consistency is unknown"),
        (crash(0, 1, 2, 3), {}, CFG, "no survivor holds the replicated state (all 4 ranks lost)"),
        (Fault(kind=FaultKind.UNHEALTHY, step=57, nodes=frozenset({"n2"})), {}, CFG,
         "node n2 is unhealthy and its rank 2 is alive: they must move off it"),
        (crash(1), {"inproc_failures": 1}, CFG,
         "1 in-process recovery of step 57 already failed (max_inproc_retries_per_step=1)"),
        (crash(1), {"inproc_failures": 2}, LadderConfig(max_inproc_retries_per_step=3), None),
        (crash(1), {}, LadderConfig(in_process=False), "in-process recovery is turned off (LadderConfig.in_process=False)"),
    ],
)
def test_in_process_blockers_fall_back_to_restart(fault: Fault, kw: dict[str, object], cfg: LadderConfig,
                                                  blocker: str | None) -> None:
    d = decide_recovery(observe(fault, spares=(spare("s1"),), **kw), COSTS, cfg, NOW)
    if blocker is None:
        assert d.action is Action.PROMOTE_SPARE  # 2 failed recoveries of 3 allowed: still in-process
        return
    assert (d.action, d.promotions, d.world_size) == (Action.RESTART, (), 4)
    assert d.reason == f"in-process recovery impossible: {blocker}; {FRESH_SAYS}"


HSDP = ((0, 2), (1, 3))
"""Sharded state on 4 ranks: 2 replicas of 2 shards (rank 3 holds the same shard as rank 1)."""
FSDP = ((0,), (1,), (2,), (3,))
"""Pure FSDP on 4 ranks: every rank holds a shard no other rank has."""


def test_a_lost_hsdp_rank_with_a_surviving_replica_takes_a_spare_in_process() -> None:
    d = decide_recovery(observe(crash(3), spares=(spare("s1"),), replicas=HSDP), COSTS, CFG, NOW)
    assert (d.action, d.promotions) == (Action.PROMOTE_SPARE, (Promotion(rank=3, spare="s1", node="s-node"),))
    every_rank_alive = Fault(kind=FaultKind.COLLECTIVE_ERROR, step=57)
    assert decide_recovery(observe(every_rank_alive, replicas=FSDP), COSTS, CFG, NOW).action is Action.RETRY_IN_PLACE


@pytest.mark.parametrize(("replicas", "lost", "why"), [
    (FSDP, (1,), "rank 1 (pure FSDP: each shard exists on one rank only)"),
    (HSDP, (1, 3), "ranks 1, 3 (every replica of it was lost)"),
])
def test_a_shard_without_a_surviving_replica_restarts_from_the_newest_commit(
        replicas: tuple[tuple[int, ...], ...], lost: tuple[int, ...], why: str) -> None:
    d = decide_recovery(observe(crash(*lost), spares=(spare("s1"), spare("s2")), replicas=replicas), COSTS, CFG, NOW)
    assert (d.action, d.promotions) == (Action.RESTART, ())
    assert d.reason == (f"in-process recovery impossible: no survivor holds a copy of the sharded state of {why}, so "
                        "only a restart restores it (from the node's memory tier, else the newest commit); "
                        f"{FRESH_SAYS}")


def test_sharded_state_never_shrinks() -> None:
    unsharded = decide_recovery(observe(crash(3)), COSTS, CFG, NOW)
    assert unsharded.action is Action.SHRINK
    d = decide_recovery(observe(crash(3), replicas=HSDP), COSTS, CFG, NOW)
    assert d.action is Action.RESTART
    assert "sharded state cannot be resharded in process, so the run does not shrink to 3 ranks" in d.reason


def test_an_unhealthy_node_whose_ranks_died_is_replaced_in_process() -> None:
    fault = Fault(kind=FaultKind.UNHEALTHY, step=57, ranks=frozenset({2}), nodes=frozenset({"n2"}))
    d = decide_recovery(observe(fault, spares=(spare("on-n2", "n2"), spare("s1", "n9", ready_since=5.0))),
                        COSTS, CFG, NOW)
    assert (d.action, d.promotions) == (Action.PROMOTE_SPARE, (Promotion(rank=2, spare="s1", node="n9"),))


def test_the_restart_policys_backoff_and_refusal_are_kept() -> None:
    later = Restarts(History(restarts_since_progress=1), RestartConfig(backoff_initial_s=2.0))
    d = decide_recovery(observe(crash(1), opted_in=False), COSTS, CFG, NOW, restarts=later)
    assert (d.action, d.not_before, d.numbers["delay_s"], d.delay_s) == (Action.RESTART, NOW + 4.0, 4.0, 4.0)
    assert d.reason.startswith("in-process recovery impossible: the script did not opt in")
    assert "; restart 1 of 3 in 4.0 s after: rank 1 failed with exit 1 at step 57" in d.reason
    d = decide_recovery(observe(crash(1), opted_in=False), COSTS, CFG, NOW, restarts=REFUSED)
    assert (d.action, d.verdict) == (Action.STOP, "budget_exhausted")
    assert d.reason.startswith("stop: in-process recovery impossible: the script did not opt in")
    assert "; and restart budget exhausted: 3 of max_restarts=3 used by the whole launch" in d.reason
    # The same refusal stops a run whose shrink is not allowed, rather than looping.
    d = decide_recovery(observe(crash(3), members(4, min_size=4)), COSTS, CFG, NOW, restarts=REFUSED)
    assert (d.action, d.verdict) == (Action.STOP, "budget_exhausted")


def test_every_decision_is_a_json_event() -> None:
    d = decide_recovery(observe(crash(3, 1), spares=(spare("s1", "n9"),)), RecoveryCosts(repair_s=600.0), CFG, NOW)
    event = json.loads(json.dumps(d.to_event(), allow_nan=False))
    assert event["action"] == "shrink" and event["reason"] == d.reason
    assert event["promotions"] == [{"rank": 1, "spare": "s1", "node": "n9"}]
    assert (event["dropped_ranks"], event["world_size"], event["step"], event["verdict"]) == ([3], 3, 57, None)


# --- growing back ----------------------------------------------------------------------------------------


def grow(m: Membership, pool: tuple[Spare, ...], **kw: object):  # type: ignore[no-untyped-def]
    args: dict[str, object] = {"step": 80, "costs": COSTS, "cfg": CFG, "now": NOW}
    args.update(kw)
    return decide_grow(m, pool, **args)  # type: ignore[arg-type]


def test_grow_back_to_the_full_size_at_the_next_boundary() -> None:
    m = members(3, full=4)
    d = grow(m, (spare("s1", "n3", ready_since=NOW - 60.0),))
    assert (d.action, d.world_size, d.after_step) == (GrowAction.GROW, 4, 80)
    assert d.joiners == (Promotion(rank=3, spare="s1", node="n3"),)
    assert d.reason == "grow 3 -> 4 of 4 ranks after step 80: spare s1 (node n3) as rank 3; re-form at the boundary (~2.0 s)"
    json.dumps(d.to_event(), allow_nan=False)


def test_grow_only_to_a_feasible_size() -> None:
    m = members(2, full=4, feasible={2, 4})
    d = grow(m, (spare("s1", ready_since=0.0),))
    assert (d.action, d.world_size, d.joiners) == (GrowAction.HOLD, 2, ())
    assert d.reason == ("hold at 2 of 4 ranks after step 80: 1 settled spare allows 3..3 ranks, none of them feasible "
                        "for the global batch (feasible world sizes: 2, 4)")
    d = grow(m, (spare("s1", ready_since=0.0), spare("s2", ready_since=1.0), spare("s3", ready_since=2.0)))
    assert (d.action, d.world_size) == (GrowAction.GROW, 4)
    assert [p.spare for p in d.joiners] == ["s1", "s2"] and [p.rank for p in d.joiners] == [2, 3]


def test_grow_waits_for_a_spare_to_settle_and_when_it_does_not_pay() -> None:
    m = members(3, full=4)
    d = grow(m, (spare("s1", ready_since=NOW - 2.0),))
    assert d.action is GrowAction.HOLD
    assert d.reason.endswith("no spare settled yet (s1 ready for 2.0 s; grow_settle_s=5.0 s)")
    d = grow(m, (spare("s1"),), remaining_s=6.0)
    assert d.action is GrowAction.HOLD
    assert d.reason.endswith("growing to 4 gains 1/4 of 6.0 s remaining = 1.5 s of work <= d_grow 2.0 s")
    assert grow(m, (spare("s1"),), remaining_s=10.0).action is GrowAction.GROW
    assert grow(members(4), (spare("s1"),)).reason == "hold at 4 of 4 ranks after step 80: the world is at its full size"
    assert grow(m, (spare("s1", claimed=True),)).reason.endswith("no healthy, warm, unclaimed spare")


# --- invariants --------------------------------------------------------------------------------------------

spares_st = st.lists(
    st.builds(Spare, id=st.sampled_from("abcdefgh"), node=st.sampled_from(["n0", "n1", "n2", "x", "y"]),
              healthy=st.booleans(), warm=st.booleans(), claimed=st.booleans(),
              ready_since=st.one_of(st.none(), st.floats(0, NOW))),
    max_size=6, unique_by=lambda s: s.id,
)


@st.composite
def observations(draw: st.DrawFn) -> Observation:
    world = draw(st.integers(1, 6))
    nodes = [f"n{r // 2}" for r in range(world)]
    min_size = draw(st.integers(1, world))
    feasible = draw(st.sets(st.integers(1, 8), max_size=6))
    m = Membership(rank_nodes=tuple(nodes), min_size=min_size, max_size=max(world, 6), full_size=world,
                   feasible_world_sizes=frozenset(feasible))
    kind = draw(st.sampled_from(FaultKind))
    ranks = frozenset(draw(st.sets(st.integers(0, world - 1), max_size=world)))
    codes = frozenset(draw(st.sets(st.sampled_from([1, 2, 78, 79, 137]), max_size=2)))
    if kind in (FaultKind.CRASH, FaultKind.HANG, FaultKind.STRAGGLER):
        fault = Fault(kind=kind, step=9, ranks=ranks or frozenset({0}), exit_codes=codes)
    elif kind is FaultKind.COLLECTIVE_ERROR:
        fault = Fault(kind=kind, step=9)
    else:
        fault = Fault(kind=kind, step=9, ranks=ranks, nodes=frozenset({draw(st.sampled_from(nodes))}),
                      exit_codes=codes)
    return observe(fault, m, spares=tuple(draw(spares_st)), opted_in=draw(st.booleans()),
                   inproc_failures=draw(st.integers(0, 2)),
                   waiting_since=draw(st.one_of(st.none(), st.floats(NOW - 400, NOW))))


costs_st = st.builds(RecoveryCosts, repair_s=st.one_of(st.none(), st.floats(0, 1000)),
                     throughput_fraction=st.one_of(st.none(), st.floats(0.01, 1)))


@settings(max_examples=400, deadline=None)
@given(obs=observations(), costs=costs_st, refused=st.booleans())
def test_invariants_of_every_decision(obs: Observation, costs: RecoveryCosts, refused: bool) -> None:
    d = decide_recovery(obs, costs, CFG, NOW, restarts=REFUSED if refused else FRESH)
    m = obs.membership
    assert d.reason and "\n" not in d.reason
    json.dumps(d.to_event(), allow_nan=False)
    if obs.fault.exit_codes & {78, 79}:
        assert (d.action, d.verdict) == (Action.STOP, "do_not_restart")
    if not obs.opted_in:
        stops = bool(obs.fault.exit_codes & {78, 79}) or refused
        assert d.action is (Action.STOP if stops else Action.RESTART)
    if refused:
        assert d.action is not Action.RESTART
    chosen = [p.spare for p in d.promotions]
    assert len(chosen) == len(set(chosen)), "a spare was named twice"
    pool = {s.id: s for s in obs.spares}
    for p in d.promotions:
        assert pool[p.spare].usable and pool[p.spare].node not in obs.fault.nodes
        assert p.rank in obs.lost_ranks
    if d.action is Action.SHRINK:
        assert d.world_size >= m.min_size and d.world_size in m.feasible_world_sizes
        assert d.world_size == m.world_size - len(d.dropped_ranks)
        assert set(d.dropped_ranks) | {p.rank for p in d.promotions} == set(obs.lost_ranks)
    else:
        assert d.world_size == m.world_size and not d.dropped_ranks
    if d.action is Action.WAIT_FOR_REPAIR:
        assert d.wait_until is not None and NOW < d.wait_until <= (obs.waiting_since or NOW) + CFG.max_wait_s


@settings(max_examples=200, deadline=None)
@given(pool=spares_st, failures=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), min_size=1, max_size=8))
def test_no_spare_is_promoted_twice_across_a_sequence_of_failures(
    pool: list[Spare], failures: list[tuple[int, int]]
) -> None:
    """The mechanism marks each promoted spare claimed (the store's compare-and-set); the policy never names
    a spare again, whatever the order of failures, shrinks and promotions."""
    m = members(6, min_size=1)
    spares = tuple(pool)
    promoted: list[str] = []
    for a, b in failures:
        lost = {r for r in (a, b) if r < m.world_size} or {0}
        d = decide_recovery(observe(crash(*lost), m, spares=spares), COSTS, CFG, NOW)
        if d.action not in (Action.PROMOTE_SPARE, Action.SHRINK):
            break
        promoted += [p.spare for p in d.promotions]
        taken = {p.spare: p for p in d.promotions}
        spares = tuple(dataclasses.replace(s, claimed=s.claimed or s.id in taken) for s in spares)
        nodes = list(m.rank_nodes)
        for p in d.promotions:
            nodes[p.rank] = p.node
        new_nodes = [nodes[old] for old in sorted(d.rank_map(m.world_size))]
        m = dataclasses.replace(m, rank_nodes=tuple(new_nodes))
        assert m.world_size == d.world_size
    assert len(promoted) == len(set(promoted))


@settings(max_examples=300, deadline=None)
@given(world=st.integers(1, 6), extra=st.integers(0, 4), feasible=st.sets(st.integers(1, 10), max_size=6),
       pool=spares_st, remaining=st.one_of(st.none(), st.floats(0, 100)))
def test_grow_invariants(world: int, extra: int, feasible: set[int], pool: list[Spare], remaining: float | None) -> None:
    m = members(world, min_size=1, full=world + extra, max_size=world + extra + 2, feasible=feasible)
    d = grow(m, tuple(pool), remaining_s=remaining)
    assert d.reason and "\n" not in d.reason
    json.dumps(d.to_event(), allow_nan=False)
    if d.action is GrowAction.HOLD:
        assert (d.world_size, d.joiners) == (world, ())
        return
    assert world < d.world_size <= m.full_size and d.world_size in feasible
    assert [p.rank for p in d.joiners] == list(range(world, d.world_size))
    by_id = {s.id: s for s in pool}
    assert len({p.spare for p in d.joiners}) == len(d.joiners)
    for p in d.joiners:
        s = by_id[p.spare]
        assert s.usable and s.ready_since is not None and NOW - s.ready_since >= CFG.grow_settle_s


# --- bad input, and the import contract --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: RecoveryCosts(shrink_s=-1.0), "RecoveryCosts.shrink_s=-1.0 must be a finite number of seconds"),
        (lambda: RecoveryCosts(throughput_fraction=0.0), "RecoveryCosts.throughput_fraction=0.0 must be in (0, 1]"),
        (lambda: RecoveryCosts(repair_s=math.nan), "RecoveryCosts.repair_s=nan must be >= 0 seconds"),
        (lambda: LadderConfig(max_wait_s=math.inf), "LadderConfig.max_wait_s=inf must be a finite number"),
        (lambda: LadderConfig(max_inproc_retries_per_step=-1), "max_inproc_retries_per_step=-1 must be >= 0"),
    ],
)
def test_bad_config_is_named(make, words: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError) as info:
        make()
    assert words in str(info.value)


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: observe(crash(4)), "Fault names rank 4, outside the world of 4 ranks"),
        (lambda: observe(crash(1), survivor_steps={1: 56}), "survivor_steps has rank 1, which the fault lost"),
        (lambda: observe(crash(1), spares=(spare("s"), spare("s"))), "lists spare id(s) s more than once"),
        (lambda: observe(crash(1), diverged=frozenset({7})), "diverged or dirty name rank 7, outside the world of 4 ranks"),
        (lambda: Fault(kind=FaultKind.COLLECTIVE_ERROR, step=1, ranks=frozenset({1})), "every rank is alive"),
        (lambda: Fault(kind=FaultKind.CRASH, step=1), "a crash Fault needs the ranks that failed"),
        (lambda: members(4, min_size=5, full=4), "1 <= min_size <= full_size <= max_size"),
    ],
)
def test_inconsistent_observations_are_named(make, words: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError) as info:
        make()
    assert words in str(info.value)


def test_a_decision_checks_its_own_shape() -> None:
    with pytest.raises(AssertionError):
        RecoveryDecision(action=Action.STOP, reason="x", step=1, world_size=2, not_before=0.0)


def test_the_decision_imports_without_torch() -> None:
    # The agent imports these; they must not pull torch in, nor reach up into the agent.
    code = ("import sys, resilient.elastic, resilient.elastic.decide, resilient.elastic.grow; "
            "print('torch' in sys.modules, any(m.startswith('resilient.agent') for m in sys.modules))")
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=root,
                         env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}, check=True)
    assert out.stdout.strip() == "False False"
