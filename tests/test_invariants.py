"""The event-log invariants every test's runs are held to (``tests/invariants.py``) catch what they name."""

from __future__ import annotations

import json
from pathlib import Path

from .invariants import check_event_logs, recovery_violations


def _continued(node: str, generation: int, members: dict[str, str], *, previous: int = 1, action: str = "promote_spare",
               decided_by: str | None = "n0") -> dict:
    return {"kind": "generation_continued", "node": node, "generation": generation, "previous": previous,
            "action": action, "members": members, **({"decided_by": decided_by} if decided_by else {})}


def _started(node: str, generation: int, pids: dict[str, int]) -> dict:
    return {"kind": "workers_started", "node": node, "generation": generation, "attempt": 0, "pids": pids}


GOOD = [
    _started("n0", 1, {"0": 10}), _started("n1", 1, {"1": 11}), _started("n2", 1, {"2": 12}),
    # n2 lost; the spare node's spare takes rank 2; every node applies generation 2 once, with its own members
    _continued("n0", 2, {"0": "n0.w0"}), _continued("n1", 2, {"1": "n1.w0"}), _continued("spare0", 2, {"2": "spare0.s0"}),
    # a shrink renumbers: rank 1's worker moves, the spare keeps going
    _continued("n0", 3, {"0": "n0.w0"}, previous=2, action="shrink"),
    _continued("spare0", 3, {"1": "spare0.s0"}, previous=2, action="shrink"),
    # then a restart's round
    _started("n0", 4, {"0": 20}), _started("spare0", 4, {"1": 21}),
]


def test_a_run_that_kept_every_invariant_has_no_violation() -> None:
    assert recovery_violations(GOOD) == []
    assert recovery_violations([]) == []


def test_two_decisions_for_one_generation_are_a_violation() -> None:
    two = GOOD + [_continued("n1", 3, {"1": "n1.w0"}, previous=2, action="promote_spare", decided_by="n1")]
    found = recovery_violations(two)
    assert any(p.startswith("generation 3 was formed by 2 decisions") for p in found), found


def test_a_node_applying_a_generation_twice_is_a_violation() -> None:
    found = recovery_violations(GOOD + [_continued("n0", 2, {"0": "n0.w0"})])
    assert found == ["node n0 applied generation 2 2 times"], found


def test_a_spare_in_two_places_is_a_violation() -> None:
    found = recovery_violations(GOOD[:3] + [_continued("n0", 2, {"0": "n0.w0", "2": "spare0.s0"}),
                                            _continued("spare0", 2, {"1": "spare0.s0"})])
    assert found == ["generation 2: worker spare0.s0 holds ranks ['1', '2']"], found


def test_a_rank_held_by_two_workers_is_a_violation() -> None:
    found = recovery_violations(GOOD[:3] + [_continued("n1", 2, {"1": "n1.w0"}),
                                            _continued("spare0", 2, {"1": "spare0.s0"})])
    assert found == ["generation 2: rank 1 held by [\"('n1', 'n1.w0')\", \"('spare0', 'spare0.s0')\"]"], found


def test_a_round_that_starts_a_rank_on_two_nodes_or_reuses_an_in_process_generation_is_a_violation() -> None:
    found = recovery_violations(GOOD + [_started("n1", 4, {"1": 30})])
    assert found == ["generation 4: rank 1 held by [\"('n1', 'n1:30')\", \"('spare0', 'spare0:21')\"]"], found
    found = recovery_violations(GOOD + [_started("n1", 3, {"1": 31})])
    assert "generation 3 was formed both by a round and in process" in found, found


def test_every_log_under_a_directory_is_read_and_named(tmp_path_factory) -> None:
    root = tmp_path_factory.mktemp("logs")  # not tmp_path: the suite's own check would read the bad log
    good, bad = root / "a" / "run", root / "b" / "run"
    for d, rows in ((good, GOOD), (bad, GOOD + [_continued("n0", 2, {"0": "n0.w0"})])):
        d.mkdir(parents=True)
        (d / "events.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"kind": "torn')
    assert check_event_logs(root) == [f"{bad / 'events.jsonl'}: node n0 applied generation 2 2 times"]
