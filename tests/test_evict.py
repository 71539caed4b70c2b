"""Acting on a persistent straggler by cost (pure): swap for a spare, shrink without it, or keep it."""

from __future__ import annotations

import pytest

from resilient.elastic.costs import RecoveryCosts
from resilient.elastic.evict import EvictConfig, StragglerCase, decide_eviction
from resilient.core.errors import ConfigError

COSTS = RecoveryCosts(spare_s=1.0, shrink_s=1.0)


def case(**kw) -> StragglerCase:
    base = {"rank": 1, "section": "compute", "rank_s": 0.030, "peers_s": 0.020, "step_s": 0.040, "world": 4,
            "remaining_steps": 500, "spares_ready": 1, "can_shrink": True, "opted_in": True}
    return StragglerCase(**{**base, **kw})


def test_a_spare_replaces_a_straggler_when_the_time_saved_beats_its_cost():
    d = decide_eviction(case(), COSTS, EvictConfig())
    # 10 ms a step over 500 steps is 5 s saved, against 1 s to promote a spare.
    assert d.action == "swap" and d.saved_s == pytest.approx(5.0) and d.cost_s == 1.0
    assert d.reason == ("rank 1 (compute 30.0 ms per step against 20.0) is replaced by a spare: a spare saves "
                        "10.0 ms per step, 5.0 s over 500 steps against 1.0 s to swap")


def test_near_the_end_of_the_run_the_straggler_is_kept():
    d = decide_eviction(case(remaining_steps=150), COSTS, EvictConfig())
    assert d.action == "keep" and "1.5 s over 150 steps against 1.0 s to swap (needs 2x)" in d.reason


def test_with_a_spare_ready_only_the_swap_is_weighed_since_the_ladder_always_promotes_it():
    # A shrink would save more here (a rank three times as slow), but the ladder would promote the spare.
    d = decide_eviction(case(rank_s=0.060, step_s=0.070), COSTS, EvictConfig())
    assert d.action == "swap"


def test_after_max_evictions_on_a_node_the_straggler_is_kept():
    d = decide_eviction(case(evictions_done=3), COSTS, EvictConfig(max_evictions=3))
    assert d.action == "keep" and "3 stragglers were already replaced or dropped on this node" in d.reason


def test_a_loss_larger_than_the_step_is_taken_as_the_whole_step():
    d = decide_eviction(case(rank_s=0.500, peers_s=0.010, step_s=0.040, spares_ready=0), COSTS, EvictConfig())
    assert d.lost_s == 0.040 and d.saved_s <= 0.040 * 500  # a shrink can save at most the whole step


def test_without_a_spare_the_world_shrinks_only_when_the_straggler_is_slower_than_the_shared_out_work():
    # 4 ranks, a step of 40 ms of which 10 ms is waiting for the straggler: 3 ranks would take 40 ms: no gain.
    assert decide_eviction(case(spares_ready=0), COSTS, EvictConfig()).action == "keep"
    # A rank twice as slow (step 60 ms, 30 ms lost): 3 ranks take 40 ms, 20 ms a step saved.
    d = decide_eviction(case(spares_ready=0, rank_s=0.050, step_s=0.060), COSTS, EvictConfig())
    assert d.action == "shrink" and d.saved_s == pytest.approx(0.020 * 500)
    assert "3 ranks step in about 40.0 ms against 60.0" in d.reason and "dropped (the world shrinks)" in d.reason


def test_the_straggler_stays_where_nothing_can_take_its_place_or_acting_is_off():
    kept = decide_eviction(case(spares_ready=0, can_shrink=False, ladder="the ladder would restart: no spare"),
                           COSTS, EvictConfig())
    assert kept.reason.endswith("no spare is ready and the world cannot shrink: the ladder would restart: no spare")
    assert "did not opt into in-process recovery" in decide_eviction(case(opted_in=False), COSTS, EvictConfig()).reason
    assert decide_eviction(case(), COSTS, EvictConfig(enabled=False)).action == "keep"


def test_an_unknown_length_assumes_the_horizon_and_says_so():
    d = decide_eviction(case(remaining_steps=None), COSTS, EvictConfig(horizon_steps=1000))
    assert d.action == "swap" and d.remaining_steps == 1000
    assert "(the script did not say how many steps remain: 1000 assumed)" in d.reason


def test_bad_settings_are_refused():
    with pytest.raises(ConfigError, match="margin=0.5 must be a number >= 1"):
        EvictConfig(margin=0.5)
    with pytest.raises(ConfigError, match="after_windows=0 must be an int >= 1"):
        EvictConfig(after_windows=0)


def _beat(rank: int, window: int, compute: float, generation: int = 1, left: int | None = None):
    from resilient.worker.protocol import Heartbeat

    timing = {"w": window, "n": 5, "step": 0.05, "s": {"compute": compute, "comm": 0.05 - compute}}
    if left is not None:
        timing["left"] = left
    return Heartbeat(rank=rank, local_rank=rank, pid=100 + rank, section="step", step=window * 5, seq=window,
                     kind="timing", generation=generation, timing=timing)


def test_a_standing_flag_is_queued_for_weighing_with_this_windows_numbers_again_while_it_stands_and_not_after_a_new_generation():
    from resilient.agent.slowness import SlownessWatch

    seen: list[str] = []
    watch = SlownessWatch("n0", lambda kind, **f: seen.append(str(kind)), evict_windows=3)
    queued = []
    for w in range(40):
        for rank in range(3):
            compute = 0.040 if (rank == 1 and w >= 12) else 0.020
            watch.take(_beat(rank, w, compute, left=1000 - 5 * (w + 1)))
        watch.poll(1, [0, 1, 2])
        flag = watch.take_eviction()
        if flag is not None:
            queued.append((w, flag))
    assert "straggler_flagged" in seen
    assert len(queued) >= 2, queued  # weighed again every 3 windows while the flag stands
    first_window, first = queued[0]
    assert first["rank"] == 1 and first["section"] == "compute" and first["generation"] == 1
    assert first["windows_flagged"] == 3 and first["rank_s"] == 0.040 and first["peers_s"] == 0.020
    assert first["remaining_steps"] == 1000 - 5 * (first_window + 1)
    assert queued[1][1]["windows_flagged"] == 6
    # Flags queued but not taken before a new generation are dropped: their rank may be someone else's now.
    for w in range(40, 46):  # two more weighings fall due in these six windows
        for rank in range(3):
            watch.take(_beat(rank, w, 0.040 if rank == 1 else 0.020))
        watch.poll(1, [0, 1, 2])
    assert watch.evictions_waiting == 2  # so the drop below is not vacuous
    watch.poll(2, [0, 1, 2])
    assert watch.take_eviction() is None
