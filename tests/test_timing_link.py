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
from resilient.core.events import EventKind

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
    said: list[tuple[EventKind, dict[str, Any]]] = []
    scorer = TimingLink("127.0.0.1", TOKEN, lambda kind, **fields: said.append((kind, fields)))
    node = TimingLink("127.0.0.1", TOKEN, lambda kind, **fields: None)
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
    assert [(kind, fields["key"]) for kind, fields in said] == [(EventKind.FORGED_KEY, "timing/L1/n1")]
    assert "wrong proof" in said[0][1]["problem"]
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
