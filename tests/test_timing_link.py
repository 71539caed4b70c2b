"""The timing link (``resilient/agent/timing_link.py``): real UDP sockets on loopback, real signatures.

A node's windows reach the scorer's link as the signed record the store would hold; a record signed with
another token, or altered, is dropped and reported once as ``forged_key``; another launch's is not kept; a record
too large for one datagram is refused, so that its sender writes it to the store instead."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest

from resilient.agent.timing_link import MAX_RECORD, TimingLink, timing_key
from resilient.coord.proof import sign

TOKEN = "t" * 64


def record(node: str, windows: int = 1, generation: int = 3) -> dict[str, Any]:
    return {"node": node, "generation": generation,
            "windows": [[1, {"window": w, "step": 5 * w, "sections": {"compute": 0.06}}] for w in range(windows)]}


def until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, f"waited 10 s for {what}"
        time.sleep(0.01)


@pytest.fixture
def links():
    said: list[tuple[str, str]] = []
    scorer = TimingLink("127.0.0.1", TOKEN, lambda key, problem: said.append((key, problem)))
    node = TimingLink("127.0.0.1", TOKEN, lambda key, problem: None)
    yield scorer, node, said
    scorer.close()
    node.close()


def test_a_node_s_windows_reach_the_scorer_s_link_and_the_newest_is_kept(links) -> None:
    scorer, node, said = links
    scorer.follow("L1")
    assert node.send(scorer.address, "L1", record("n1", windows=1))
    until(lambda: scorer.received == 1, "the first record")
    assert node.send(scorer.address, "L1", record("n1", windows=2))
    assert node.send(scorer.address, "L1", record("n2"))
    until(lambda: scorer.received == 3, "three records")
    kept = {r["node"]: r for r in scorer.records()}
    assert kept == {"n1": {**record("n1", windows=2), "launch": "L1"}, "n2": {**record("n2"), "launch": "L1"}}
    assert said == []


def test_a_forged_or_altered_record_is_dropped_and_said_once(links) -> None:
    scorer, node, said = links
    scorer.follow("L1")
    body = {**record("n1"), "launch": "L1"}
    forged = sign("f" * 64, timing_key("L1", "n1"), body)  # someone without the run token
    altered = json.loads(sign(TOKEN, timing_key("L1", "n1"), body))
    altered["body"]["windows"][0][1]["sections"]["compute"] = 9.0  # a slower rank 1 than it was
    for data in (forged, forged, json.dumps(altered).encode(), b"not json", b"{}"):
        node._sock.sendto(data, scorer._sock.getsockname())
    until(lambda: scorer.dropped == 5, "five datagrams dropped")
    assert scorer.records() == [] and scorer.received == 0
    assert [key for key, _ in said] == ["timing/L1/n1"]
    assert "wrong proof" in said[0][1] and "a timing datagram" in said[0][1]
    # A proof is bound to its key: n1's record does not pass as n2's.
    stolen = json.loads(sign(TOKEN, timing_key("L1", "n1"), body))
    stolen["body"]["node"] = "n2"
    node._sock.sendto(json.dumps(stolen).encode(), scorer._sock.getsockname())
    until(lambda: scorer.dropped == 6, "the record moved to another node dropped")
    assert scorer.records() == []


def test_another_launch_s_records_are_not_kept_and_a_new_launch_starts_empty(links) -> None:
    scorer, node, _ = links
    scorer.follow("L1")
    assert node.send(scorer.address, "L0", record("n1"))  # a node still in the launch before
    assert node.send(scorer.address, "L1", record("n2"))
    until(lambda: scorer.received == 1, "L1's record")
    assert [r["node"] for r in scorer.records()] == ["n2"]
    scorer.follow("L2")
    assert scorer.records() == []


def test_a_record_too_large_for_a_datagram_or_an_address_that_does_not_parse_is_refused(links) -> None:
    scorer, node, _ = links
    big = record("n1", windows=MAX_RECORD // 40)
    assert len(json.dumps(big)) > MAX_RECORD
    assert not node.send(scorer.address, "L1", big), "it goes to the store instead"
    assert not node.send("no-port-here", "L1", record("n1"))
    assert not node.send(scorer.address, "L1", {"generation": 3}), "a record without its node"


def test_forged_entries_beyond_twenty_a_minute_are_counted_not_each_an_event(tmp_path, monkeypatch) -> None:
    """A writer flooding etcd (or the timing link) with forgeries gets the agent to say so, not to fill its event
    log: 20 ``forged_key`` events a minute, and the first after the minute counts those it left unsaid."""
    from resilient.agent import coordination as coordination_module
    from resilient.agent.config import AgentConfig
    from resilient.agent.coordination import FORGED_EVENTS, Coordination
    from resilient.agent.rundir import RunDir

    config = AgentConfig(entrypoint=("train.py",), run_id="r", node_id="n0", run_dir=tmp_path)
    run_dir = RunDir(tmp_path, "n0")
    said: list[dict[str, Any]] = []
    now = [1000.0]
    monkeypatch.setattr(coordination_module.time, "monotonic", lambda: now[0])
    coordination = Coordination(config, run_dir, run_dir.create(),
                                emit=lambda kind, **fields: said.append({"kind": kind, **fields}),
                                on_node_lost=lambda node, why: None)
    for i in range(FORGED_EVENTS + 7):
        coordination._on_rejected_write(f"launch/L1/nodes/x{i}", "wrong proof")
    assert len(said) == FORGED_EVENTS and [e["unsaid"] for e in said] == [0] * FORGED_EVENTS
    now[0] += 59.0
    coordination._on_rejected_write("launch/L1/nodes/y", "wrong proof")
    assert len(said) == FORGED_EVENTS, "still the same minute"
    now[0] += 1.5
    coordination._on_rejected_write("launch/L1/nodes/z", "wrong proof")
    assert said[-1]["key"] == "launch/L1/nodes/z" and said[-1]["unsaid"] == 8
