"""Straggler scoring across machines: three agents with one rank each, one of them (rank 0's) the scorer.

The windows and flags travel as the store carries them, through JSON, as the peer watch passes them: every
agent's :meth:`SlownessWatch.outbox` to the scorer's :meth:`SlownessWatch.take_peers`; the scorer's
:meth:`SlownessWatch.flags_out` to every other agent's :meth:`SlownessWatch.from_scorer`.  Each agent
reports its own ranks alone.
"""

from __future__ import annotations

import json

from resilient.agent.slowness import SlownessWatch
from resilient.agent.windows import OUTBOX_WINDOWS
from resilient.worker.protocol import Heartbeat


def _beat(rank: int, window: int, compute: float, generation: int = 1, world: int | None = 3) -> Heartbeat:
    timing = {"w": window, "n": 5, "step": 0.06, "s": {"compute": compute, "comm": 0.06 - compute,
                                                      "optimizer": 0.002}}
    if world is not None:
        timing["world"] = world
    return Heartbeat(rank=rank, local_rank=0, pid=100 + rank, section="step", step=window * 5, seq=window,
                     kind="timing", generation=generation, timing=timing)


def _agents() -> tuple[dict[str, SlownessWatch], dict[str, list[tuple[str, dict]]]]:
    seen: dict[str, list[tuple[str, dict]]] = {n: [] for n in ("n0", "n1", "n2")}
    watches = {n: SlownessWatch(n, lambda kind, _n=n, **f: seen[_n].append((str(kind), f))) for n in seen}
    return watches, seen


def _exchange(watches: dict[str, SlownessWatch]) -> int:
    """One pass of every agent's peer watch; returns the records the scorer read (its load on the store)."""
    records = [json.loads(json.dumps(box)) for w in watches.values() if (box := w.outbox()) is not None]
    scorers = [w for w in watches.values() if w.scorer]
    assert len(scorers) <= 1, "two agents scored the launch"
    for w in scorers:
        w.take_peers(records)
        flags = w.flags_out()
        if flags is not None:
            for other in watches.values():
                if other is not w:
                    other.from_scorer(json.loads(json.dumps(flags)))
    return len(records) * len(scorers)


def test_one_rank_per_node_is_scored_against_the_other_nodes_and_only_its_own_agent_reports_it():
    watches, seen = _agents()
    node_of = {0: "n0", 1: "n1", 2: "n2"}
    for window in range(40):
        for rank, node in node_of.items():
            watches[node].take(_beat(rank, window, 0.045 if (rank == 1 and window >= 12) else 0.030))
        for rank, node in node_of.items():  # each agent first scores what it has (its own rank: nothing to compare)
            watches[node].poll(1, [rank])
        _exchange(watches)
        for rank, node in node_of.items():
            watches[node].poll(1, [rank])
    flagged = {n: [f for k, f in events if k == "straggler_flagged"] for n, events in seen.items()}
    assert flagged["n0"] == [] and flagged["n2"] == [], flagged
    assert [(f["rank"], f["section"]) for f in flagged["n1"]] == [(1, "compute")]
    assert "rank 1 (node n1) is a straggler in compute" in flagged["n1"][0]["reason"]
    assert 1.4 < flagged["n1"][0]["ratio"] < 1.6
    assert [w.scorer for w in watches.values()] == [True, False, False]
    # The scorer shows every rank's scores, each with its node (the gauges of a rank come from one agent);
    # each agent shows its own standing flags.
    scores = watches["n0"].snapshot()["scores"]
    assert {(s["rank"], s["node"]) for s in scores} == set(node_of.items()), scores
    for rank, node in node_of.items():
        snap = watches[node].snapshot()
        assert snap["scores"] == [] or node == "n0"
        assert [s["rank"] for s in snap["stragglers"]] == ([1] if rank == 1 else [])
    # The rank recovers: its own agent clears it, with the scorer's reason.
    for window in range(40, 120):
        for rank, node in node_of.items():
            watches[node].take(_beat(rank, window, 0.030))
            watches[node].poll(1, [rank])
        _exchange(watches)
    cleared = [f for k, f in seen["n1"] if k == "straggler_cleared"]
    assert [(f["rank"], f["section"]) for f in cleared] == [(1, "compute")], seen["n1"][-3:]
    assert "no longer flagged" not in cleared[0]["reason"]
    assert watches["n1"].snapshot()["stragglers"] == []
    # Alone, an agent with one rank has nobody to compare it with: the same run without the exchange flags nothing.
    alone, alone_seen = _agents()
    for window in range(40):
        for rank, node in node_of.items():
            alone[node].take(_beat(rank, window, 0.045 if (rank == 1 and window >= 12) else 0.030))
            alone[node].poll(1, [rank])
    assert not any(k == "straggler_flagged" for events in alone_seen.values() for k, _ in events)


def test_a_window_missing_on_a_peer_is_skipped_and_the_exchange_survives_a_lagging_peer_and_a_new_generation():
    watches, _ = _agents()
    node_of = {0: "n0", 1: "n1", 2: "n2"}
    for window in range(10):
        for rank, node in node_of.items():
            if not (rank == 2 and window == 4):  # rank 2 never reports window 4
                watches[node].take(_beat(rank, window, 0.030))
            watches[node].poll(1, [rank])
        _exchange(watches)
    for node in watches:
        watches[node].poll(1, [int(node[1])])
    # Every window but 4 was scored by the scorer (window 4 dropped once 5 was complete), and by no other agent.
    assert [w.stragglers._seen for w in watches.values()] == [9, 0, 0]
    box = watches["n2"].outbox()
    assert box is not None and [w["w"] for _, w in box["windows"]] == [0, 1, 2, 3, 5, 6, 7, 8, 9]
    # A box holds the newest OUTBOX_WINDOWS windows: a peer that lags behind by more loses the oldest only.
    lone = SlownessWatch("n3", lambda kind, **f: None)
    for window in range(OUTBOX_WINDOWS + 4):
        lone.take(_beat(3, window, 0.030, world=4))
        lone.poll(1, [3])
    box = lone.outbox()
    assert box is not None and [w["w"] for _, w in box["windows"]] == list(range(4, OUTBOX_WINDOWS + 4))
    # A record of an older generation is ignored once this agent is in a newer one; one ahead waits for it.
    old = watches["n1"].outbox()
    watches["n0"].take(_beat(0, 0, 0.030, generation=2))
    watches["n0"].poll(2, [0])
    watches["n0"].take_peers([old])
    assert all(k[0] == 2 for k in watches["n0"].windows._pending), watches["n0"].windows._pending
    ahead = {"node": "n1", "generation": 3, "windows": [[1, {"w": 0, "n": 5, "step": 0.06, "s": {"compute": 0.03},
                                                              "world": 3}]]}
    watches["n0"].take_peers([ahead])
    assert (3, 0) in watches["n0"].windows._pending
    # Malformed windows from a peer are counted, not filed.
    watches["n0"].take_peers([{"node": "n2", "generation": 2, "windows": [[2, {"w": 1, "n": 0, "step": -1, "s": {}}],
                                                                        "junk"]}])
    assert watches["n0"].windows.malformed == 2


def test_windows_without_a_world_size_are_scored_among_this_nodes_ranks_as_before():
    watch = SlownessWatch("n0", lambda kind, **f: None)
    for window in range(12):
        for rank in range(3):
            watch.take(_beat(rank, window, 0.030, world=None))
        watch.poll(1, [0, 1, 2])
    assert watch.stragglers._seen == 12


def test_windows_that_complete_while_a_spare_of_this_node_warms_up_are_not_scored_for_stragglers():
    """The agent's own spare, importing and building its model, slows whichever rank shares its core: that is
    not the rank's slowness.  The job's slowdown detector still sees those windows."""
    seen: list[str] = []
    watch = SlownessWatch("n0", lambda kind, **f: seen.append(str(kind)))
    for window in range(50):
        for rank in range(3):
            watch.take(_beat(rank, window, 0.045 if (rank == 1 and 12 <= window < 30) else 0.030))
        watch.poll(1, [0, 1, 2], disturbed=12 <= window < 30)
    assert "straggler_flagged" not in seen and watch.disturbed_windows == 18
    assert watch.snapshot()["disturbed_windows"] == 18
    # The slowdown detector went on scoring: its baseline (after 4 + 40 windows) is set by window 50.
    assert watch.slowdowns.baseline_s is not None
    # The same windows undisturbed: flagged.
    again: list[str] = []
    watch = SlownessWatch("n0", lambda kind, **f: again.append(str(kind)))
    for window in range(40):
        for rank in range(3):
            watch.take(_beat(rank, window, 0.045 if (rank == 1 and 12 <= window < 30) else 0.030))
        watch.poll(1, [0, 1, 2])
    assert "straggler_flagged" in again


def test_a_window_a_node_completed_while_its_spare_warmed_up_is_not_scored_by_the_scorer():
    """n1's spare slows n1's rank while it warms up: n1 marks those windows, the scorer leaves them out."""
    watches, seen = _agents()
    node_of = {0: "n0", 1: "n1", 2: "n2"}
    for window in range(40):
        for rank, node in node_of.items():
            watches[node].take(_beat(rank, window, 0.045 if (rank == 1 and window >= 12) else 0.030))
        for rank, node in node_of.items():
            watches[node].poll(1, [rank], disturbed=node == "n1" and window >= 10)
        _exchange(watches)
    assert not any(k == "straggler_flagged" for events in seen.values() for k, _ in events)
    assert watches["n0"].disturbed_windows >= 25


def test_the_scorer_moves_with_rank_0_and_a_new_generation_clears_what_the_old_scorer_raised():
    watches, seen = _agents()
    node_of = {0: "n0", 1: "n1", 2: "n2"}
    for window in range(40):
        for rank, node in node_of.items():
            watches[node].take(_beat(rank, window, 0.045 if rank == 1 and window >= 12 else 0.030))
            watches[node].poll(1, [rank])
        _exchange(watches)
    assert [k for k, _ in seen["n1"]].count("straggler_flagged") == 1
    # Generation 2: n0 is gone, n2 holds rank 0 now (renumbered), n1 rank 1.
    for w in (watches["n1"], watches["n2"]):
        w.poll(2, [1] if w is watches["n1"] else [0])
    assert watches["n2"].scorer and not watches["n1"].scorer
    cleared = [f for k, f in seen["n1"] if k == "straggler_cleared"]
    assert [(f["rank"], f["generation"]) for f in cleared] == [(1, 1)], cleared
    del watches["n0"]
    records = 0
    for window in range(10):
        watches["n1"].take(_beat(1, window, 0.030, generation=2, world=2))
        watches["n2"].take(_beat(0, window, 0.030, generation=2, world=2))
        watches["n1"].poll(2, [1])
        watches["n2"].poll(2, [0])
        records += _exchange(watches)
    watches["n2"].poll(2, [0])
    assert watches["n2"].stragglers._seen == 10 and watches["n1"].stragglers._seen == 0
    assert records == 20  # the scorer alone read the records: one per node per pass
