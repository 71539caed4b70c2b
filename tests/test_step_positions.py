"""Where a fault strikes inside a step, against what the recovery ladder and the state agreement do.

A rank that failed before the optimizer's update holds the step's start (clean); one that failed inside
``optimizer.step()`` holds part of an update, one that failed after it holds the update with the rest of the
step unfinished (both dirty).  Property: over every world size, every rank's position, every set of lost ranks,
spare pool and layout (DDP, HSDP), whatever the ladder decides ends in the uninterrupted run's state, because
an in-process rung only ever copies a clean rank's state and every other rank receives it whole, and with no
clean copy the rung below (the newest commit) is taken with the reason said.  The same runs through real
processes in ``tests/test_step_atomicity.py``.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from resilient.elastic.costs import RecoveryCosts
from resilient.elastic.decide import Action, LadderConfig, decide_recovery
from resilient.elastic.mesh_rebind import ShardLayout
from resilient.elastic.observe import Fault, FaultKind, Membership, Observation, Spare
from resilient.elastic.shard_sync import shard_sources
from resilient.elastic.state_sync import StateSyncError, decide_source

STEP = 7
POSITIONS = ("before", "inside", "after")
IN_PROCESS = (Action.PROMOTE_SPARE, Action.SHRINK, Action.RETRY_IN_PLACE)


def held(position: str) -> tuple[str, int]:
    """What a survivor's memory holds after its attempt was rewound (model and optimizer)."""
    return {"before": ("clean", STEP), "inside": ("partial", STEP), "after": ("clean", STEP + 1)}[position]


@st.composite
def faults(draw: st.DrawFn) -> tuple[Observation, dict[int, str]]:
    sharded = draw(st.booleans())
    world = 4 if sharded else draw(st.integers(2, 5))
    positions = {r: draw(st.sampled_from(POSITIONS)) for r in range(world)}
    network = draw(st.integers(0, 4)) == 0  # a collective error: everyone alive
    lost = frozenset() if network else frozenset(draw(st.sets(st.integers(0, world - 1), min_size=1, max_size=world)))
    spares = [Spare(id=f"s{i}", node="spare", ready_since=0.0) for i in range(draw(st.integers(0, 2)))]
    min_size = draw(st.integers(1, world))
    fault = (Fault(kind=FaultKind.COLLECTIVE_ERROR, step=STEP, detail="injected") if network
             else Fault(kind=FaultKind.CRASH, step=STEP, ranks=lost, exit_codes=frozenset({137})))
    obs = Observation(
        fault=fault,
        membership=Membership(rank_nodes=("n0",) * world, min_size=min_size, max_size=world, full_size=world,
                              feasible_world_sizes=frozenset(range(1, world + 1))),
        spares=spares,
        survivor_steps={r: STEP for r in range(world) if r not in lost},
        dirty=frozenset(r for r in range(world) if r not in lost and positions[r] != "before"),
        opted_in=True, replicas=((0, 2), (1, 3)) if sharded else None,
    )
    return obs, positions


@settings(max_examples=600, deadline=None)
@given(faults())
def test_every_decision_ends_in_the_uninterrupted_state_or_takes_the_rung_below(case) -> None:
    obs, positions = case
    decision = decide_recovery(obs, RecoveryCosts(), LadderConfig(), now=100.0)
    survivors = obs.survivors
    clean = [r for r in survivors if positions[r] == "before"]
    if decision.action not in IN_PROCESS:
        # The rung below: every rank restores the newest commit, the same state the uninterrupted run saved.
        if survivors and not clean:
            assert "dirty" in decision.reason and "newest commit is the only clean copy" in decision.reason
        return
    assert clean, f"{decision.action.value} with no clean survivor: {positions}, lost {sorted(obs.lost_ranks)}"
    mapping = decision.rank_map(obs.membership.world_size)
    old_of = {new: old for old, new in mapping.items()}
    completed: list[int | None] = [None] * decision.world_size  # a promoted spare joins without state
    for old, new in mapping.items():
        if old not in obs.lost_ranks:
            completed[new] = STEP
    dirty = [new for new, old in old_of.items() if old not in obs.lost_ranks and positions[old] != "before"]
    agreement = decide_source(completed, preferred=None, dirty=dirty)
    assert set(agreement.dirty) == set(dirty)
    if obs.replicas is None:
        source_of = {new: agreement.source_rank for new in old_of}
    else:
        layout = ShardLayout(root=None, meshes=(), infos=(), modules=(), replica_dim=0, replicas=obs.replicas)
        by_group = shard_sources(agreement, layout)
        source_of = {new: by_group[group] for group in by_group for new in group}
    for new, source in source_of.items():
        assert positions[old_of[source]] == "before", f"rank {new} took rank {source}'s {positions[old_of[source]]}"
    # Every rank holds its source's state, retries step STEP and so holds what the uninterrupted run holds.
    assert {held(positions[old_of[source]]) for source in source_of.values()} == {("clean", STEP)}


@settings(max_examples=200, deadline=None)
@given(faults())
def test_a_clean_survivor_and_a_ready_spare_for_every_lost_rank_keep_the_fast_path(case) -> None:
    obs, positions = case
    if obs.replicas is not None or not obs.lost_ranks or len(obs.spares) < len(obs.lost_ranks):
        return
    if not any(positions[r] == "before" for r in obs.survivors):
        return
    decision = decide_recovery(obs, RecoveryCosts(), LadderConfig(), now=100.0)
    assert decision.action is Action.PROMOTE_SPARE, decision.reason


def test_a_dirty_rank_is_never_the_source_even_when_the_agent_prefers_it() -> None:
    agreement = decide_source([5, 5, None], preferred=0, dirty=[0])
    assert (agreement.source_rank, agreement.dirty, agreement.replacements) == (1, (0,), (2,))
    assert "the agent's choice, rank 0, failed inside an update" in agreement.reason
    assert "ranks [0] failed inside an update and take the whole state from the source" in agreement.reason
    with pytest.raises(StateSyncError, match=r"no rank holds a clean copy of the state: rank 0 failed inside an "
                                             r"optimizer update \(part of it applied\)"):
        decide_source([5, None], dirty=[0])


def test_the_ladder_says_why_a_dirty_survivor_sends_the_run_to_its_newest_commit() -> None:
    obs = Observation(
        fault=Fault(kind=FaultKind.CRASH, step=4, ranks=frozenset({1}), exit_codes=frozenset({137})),
        membership=Membership(rank_nodes=("n0", "n0"), min_size=1, max_size=2, full_size=2,
                              feasible_world_sizes=frozenset({1, 2})),
        spares=[Spare(id="s2", node="n0", ready_since=0.0)], survivor_steps={0: 4}, dirty=frozenset({0}),
        opted_in=True,
    )
    decision = decide_recovery(obs, RecoveryCosts(), LadderConfig(), now=10.0)
    assert decision.action is Action.RESTART
    assert ("rank 0 is dirty (they failed inside or after optimizer.step() of step 4, part of its update applied "
            "or its step unfinished) and no clean survivor holds the state, so the newest commit is the only "
            "clean copy") in decision.reason
