"""A node's memory tier copied to its ring successor, and staged onto the nodes that run its ranks next.

In process, with real parts: each "node" is a real tier directory in a tmpfs
written by real :class:`MemoryTier` saves, served by its real HTTP server on
loopback, and copied with the run token's signatures.  The restart across
real agents and a lost node is the ``lose-node-memory-replica`` drill.
"""

from __future__ import annotations

import re
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from resilient.agent.config import AgentConfig
from resilient.agent.memory_peers import REPLICAS, PeerTier, common, node_stems, records_in
from resilient.agent.memory_tier import NodeMemory
from resilient.checkpoint import memory as mem
from resilient.cli.status_cmd import render
from resilient.core.errors import ConfigError
from resilient.core.events import EventKind, EventLog

from .test_memory_tier import SHM, payloads, same

TOKEN = "t0ken"


class Node:
    """One node of a 2-rank job (one rank per node): its tier, its rank's writer, its replication."""

    def __init__(self, name: str, base: Path, addresses: dict[str, str], live: set[str], *, limit: int = 1 << 30,
                 token: str = TOKEN, poll_s: float = 0.25) -> None:
        self.name = name
        self.events: list[tuple[EventKind, dict]] = []
        (base / "run").mkdir(exist_ok=True)
        self.memory = NodeMemory(base, run_id="r", node_id=name, run_dir=base / "run", limit=limit, every=None,
                                 emit=lambda kind, **f: self.events.append((kind, f)), pin_every=10)
        self.root = self.memory.path
        self.replication = self.memory.replicate(host="127.0.0.1", token=token, nproc=1, address_of=addresses.get,
                                                 live=lambda: frozenset(live))
        self.replication.poll_s = poll_s
        self.replication.serve()
        addresses[name] = self.replication.address

    def train(self, rank: int, steps: range, *, pin_every: int = 10, world: int = 2, generation: int = 1) -> None:
        """Save ``steps`` as rank ``rank`` (local rank 0: it keeps the node's replicated state too)."""
        writer = mem.MemoryTier(self.root, limit=1 << 30, local_rank=0, events=EventLog(), generation=generation)
        for step in steps:
            writer.save(step, payloads(step, rank), rank=rank, world_size=world, fingerprint="f",
                        counters={"step": step, "samples": 0, "tokens": 0}, pin=step % pin_every == 0)
        writer.close()

    def holdings(self, rank: int, world: int = 2, generation: int = 2) -> list[tuple[int, int]]:
        return mem.MemoryTier(self.root, limit=1 << 30, local_rank=0, events=EventLog(),
                              generation=generation).holdings(rank=rank, world_size=world, fingerprint="f")

    def kinds(self) -> list[EventKind]:
        return [k for k, _ in self.events]


@pytest.fixture
def cluster() -> Iterator[tuple[dict[str, str], set[str], list[Node], Path]]:
    addresses: dict[str, str] = {}
    live: set[str] = set()
    nodes: list[Node] = []
    with tempfile.TemporaryDirectory(dir=SHM, prefix="resilient-replica-test-") as d:
        yield addresses, live, nodes, Path(d)
        for node in nodes:
            node.replication.close()


def make(cluster, name: str, **kw) -> Node:
    addresses, live, nodes, base = cluster
    node = Node(name, base, addresses, live, **kw)
    live.add(name)
    nodes.append(node)
    return node


def trained_pair(cluster, steps: range) -> tuple[Node, Node]:
    """Nodes a and b, in that order, each rank having trained ``steps``."""
    a, b = make(cluster, "a"), make(cluster, "b")
    a.train(0, steps)
    b.train(1, steps)
    for node in (a, b):
        node.replication.follow(("a", "b"))
    return a, b


def test_pinned_steps_stay_while_the_other_slots_turn_over(cluster):
    a = make(cluster, "a")
    a.train(0, range(1, 26))
    assert a.holdings(0) == [(25, 1), (24, 1), (23, 1), (20, 1), (10, 1)]


def test_the_successor_copies_the_newest_pinned_step_verified_and_a_lost_node_is_staged_from_it(cluster):
    a, b = trained_pair(cluster, range(1, 26))
    copy = b.replication.pull()
    assert copy is not None and copy.node == "a" and copy.version == (20, 1)
    assert b.replication.pull() is None  # nothing newer
    assert b.kinds() == [EventKind.MEMORY_REPLICA_HELD]
    held = {stem: [r.step for r in mem.read_records(b.root / REPLICAS / "a", stem)] for stem in node_stems(0, 1)}
    assert held == {"rank00000": [20], "replicated": [20]}
    shown = render({"source": "test", "nodes": [{"node": "b", "memory": b.memory.view()}],
                     "restarts_used": 0, "verdicts": [], "incidents": []}, 5)
    assert "memory replica: pins every 10 steps; a copy of a's step 20 (" in shown
    assert f"serves on {b.replication.address}" in shown

    # a is lost with its tier; c, new, takes the last place: b runs rank 0 (a's), c rank 1 (b's).
    _, live, _, _ = cluster
    live.discard("a")
    a.replication.close()
    c = make(cluster, "c")
    for stale in ("rank00005.0.json", "rank00005.0.shard"):  # a rank b ran long ago: nobody restores it from b
        (b.root / stale).write_bytes(b"old")
    b.replication.stage(0, ("b", "c"), ("a", "b"), generation=2)
    c.replication.stage(1, ("b", "c"), ("a", "b"), generation=2)
    assert not list(b.root.glob("rank00005.*")) and list(b.root.glob("rank00001.*"))  # c fetched rank 1 from b
    [(_, staged_b)] = [e for e in b.events if e[0] == EventKind.MEMORY_REPLICA_STAGED]
    assert staged_b["staged"]["rank00000"]["from"] == "this node's copy" and not staged_b["missing"]
    [(_, staged_c)] = [e for e in c.events if e[0] == EventKind.MEMORY_REPLICA_STAGED]
    assert {s: v["from"] for s, v in staged_c["staged"].items()} == {"rank00001": "b", "replicated": "b"}
    # The newest step both ranks now hold is the pinned one: restored bitwise from the copies.
    common = set(b.holdings(0)) & set(c.holdings(1))
    assert max(common) == (20, 1)
    for node, rank in ((b, 0), (c, 1)):
        replicated, own, counters = mem.MemoryTier(node.root, limit=1 << 30, local_rank=0, events=EventLog(),
                                                   generation=2).load(20, 1, rank)
        want = payloads(20, rank)
        assert same(own, want["rank"]) and counters["step"] == 20
        assert same(replicated, payloads(20, 1)["replicated"])  # b's: b kept its own, c fetched it from b
    # b now copies c's pinned steps; a's copy stays for this round (another node could still be staging from it)
    assert b.replication.pull().node == "c"
    assert {d.name for d in (b.root / REPLICAS).iterdir()} == {"a", "c"}
    # A round of another size (a third node, e, left): the memory tier never restores across world sizes, so b
    # fetches nothing, although c, which ran the rank b runs now, is alive and serving.
    b.replication.stage(1, ("c", "b"), ("b", "c", "e"), generation=3)
    assert [e for e in b.events if e[0] == EventKind.MEMORY_REPLICA_STAGED and e[1]["generation"] == 3] == []


def test_without_a_copy_a_lost_node_is_missing_and_said_so(cluster):
    a, b = make(cluster, "a"), make(cluster, "b")
    a.train(0, range(1, 26))
    b.train(1, range(1, 26))
    _, live, _, _ = cluster
    live.discard("a")
    c = make(cluster, "c")
    b.replication.stage(0, ("b", "c"), ("a", "b"), generation=2)
    [(_, staged)] = [e for e in b.events if e[0] == EventKind.MEMORY_REPLICA_STAGED]
    assert "rank00000" in staged["missing"] and not staged["staged"]
    assert b.holdings(0) == []  # nothing of rank 0 here: the workers' restore falls back to the durable tier
    del c


def test_a_request_not_signed_with_the_run_token_is_refused(cluster):
    a = make(cluster, "a")
    a.train(0, range(1, 11))
    with pytest.raises(OSError, match="403"):
        PeerTier(a.replication.address, "another token").index()
    own, _ = PeerTier(a.replication.address, TOKEN).index()
    assert [r.step for r in own["rank00000"]] == [10, 9, 8, 7]  # the pinned step 10, the turning slots


def test_a_copy_whose_bytes_changed_is_not_kept(cluster):
    a, b = trained_pair(cluster, range(1, 11))
    pinned = next(r for r in mem.read_records(a.root, "rank00000") if r.slot in mem.PINNED)
    shard = a.root / f"rank00000.{pinned.slot}.shard"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="do not match their digest"):
        b.replication.pull()
    assert mem.read_records(b.root / REPLICAS / "a", "rank00000") == []
    assert not list((b.root / REPLICAS / "a").glob("rank00000.*.shard"))


def test_a_node_without_room_for_the_copy_says_so_once_and_keeps_none(cluster):
    a = make(cluster, "a")
    b = make(cluster, "b", limit=4096 * 8, poll_s=0.01)  # b's own saves take up to 6 slots of 2 files
    a.train(0, range(1, 11))
    b.train(1, range(1, 11))
    for node in (a, b):
        node.replication.follow(("a", "b"))
    b.replication.start()
    deadline = time.monotonic() + 10
    while EventKind.MEMORY_REPLICA_FAILED not in b.kinds() and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.2)  # about 20 more passes, each failing the same way: said once
    b.replication.close()
    failed = [f for k, f in b.events if k == EventKind.MEMORY_REPLICA_FAILED]
    assert len(failed) == 1 and "no room" in failed[0]["reason"] and "own saves take up to" in failed[0]["reason"]
    assert b.replication.copy is None


@pytest.mark.parametrize(("fields", "named"), [
    ({"memory_replicas": 1}, "--store etcd://HOST:PORT"),
    ({"memory_replicas": 1, "store_url": "etcd://127.0.0.1:2379", "memory_tier": False}, "drop --no-memory-tier"),
    ({"memory_replicas": 2, "store_url": "etcd://127.0.0.1:2379"}, "must be 0 or 1"),
    ({"memory_replicas": 1, "store_url": "etcd://127.0.0.1:2379", "memory_pin_every": 0}, "--memory-pin-every"),
])
def test_a_copy_that_cannot_be_kept_is_refused_at_start_naming_the_fix(tmp_path, fields, named):
    with pytest.raises(ConfigError, match=re.escape(named)):
        AgentConfig(entrypoint=("train.py",), run_id="r", node_id="n0", run_dir=tmp_path, **fields)
    AgentConfig(entrypoint=("train.py",), run_id="r", node_id="n0", run_dir=tmp_path, memory_replicas=1,
                store_url="etcd://127.0.0.1:2379", max_nodes=2)


def test_a_copy_stopped_midway_never_writes_over_the_newest_step_it_held_whole(cluster):
    """Each pull that stops after its first file (the second one's bytes damaged at the peer) leaves the copy
    with files of different steps; the step held whole before stays whole, and staging takes it."""
    a, b = trained_pair(cluster, range(1, 21))
    assert b.replication.pull().version == (20, 1)

    def damage_replicated(step: int) -> None:
        pinned = next(r for r in mem.read_records(a.root, "replicated") if r.step == step)
        shard = a.root / f"replicated.{pinned.slot}.shard"
        data = bytearray(shard.read_bytes())
        data[-1] ^= 0xFF
        shard.write_bytes(bytes(data))

    copy = b.root / REPLICAS / "a"
    for upto, pin in ((31, 30), (41, 40)):
        a.train(0, range(upto - 10, upto), generation=1)
        damage_replicated(pin)
        with pytest.raises(ValueError, match="do not match their digest"):
            b.replication.pull()  # rank00000 at the new pin copied, the replicated file refused
        assert common(records_in(copy), node_stems(0, 1)) == [(20, 1)], records_in(copy)
    # a is lost; b runs its rank from the copy: the step every file of it holds, 20
    _, live, _, _ = cluster
    live.discard("a")
    c = make(cluster, "c")
    b.replication.stage(0, ("b", "c"), ("a", "b"), generation=2)
    [(_, staged)] = [e for e in b.events if e[0] == EventKind.MEMORY_REPLICA_STAGED]
    assert staged["staged"]["rank00000"]["steps"][0] == 20, staged
    assert (20, 1) in set(b.holdings(0))
    del c


def test_a_look_at_a_peer_waits_for_its_pinned_steps_to_change_not_for_every_save(cluster):
    a = make(cluster, "a")
    a.train(0, range(1, 11))
    peer = PeerTier(a.replication.address, TOKEN)
    peer.index()
    state = peer.pinned
    a.train(0, range(11, 15))  # turning saves only: the pinned steps are as they were
    peer.index(state, 0.3)
    assert peer.pinned == state  # answered when the wait ran out, with nothing pinned changed
    pinning = threading.Thread(target=a.train, args=(0, range(15, 21)))  # step 20 is pinned while the look waits
    pinning.start()
    own, _ = peer.index(state, 10)
    pinning.join()
    assert peer.pinned != state
    assert 20 in [r.step for r in own["rank00000"] if r.slot in mem.PINNED]
