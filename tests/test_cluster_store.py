"""The launch's recovery keys across machines (``resilient.agent.cluster``) against a real etcd.

What several agents rely on when they recover in process together: one
decider per generation, a spare taken by one decision only, a pool entry
that leaves with its agent's lease, and nothing written without the run
token counted.
"""

from __future__ import annotations

import json
import threading

from resilient.agent.cluster import ClusterStore
from resilient.coord.etcd import EtcdClient, EtcdConfig
from resilient.coord.proof import SignedStore
from resilient.coord.store import EtcdControlStore

TOKEN = "t" * 64
LAUNCH = "launch/l1/"


def _store(url: str, run_id: str, node: str, token: str = TOKEN) -> ClusterStore:
    client = EtcdClient(EtcdConfig.from_url(url))
    signed = SignedStore(EtcdControlStore.for_run(client, run_id), token)
    return ClusterStore(signed, client, f"/resilient/{run_id}/", LAUNCH, node, token)


def test_exactly_one_agent_decides_a_generation_and_a_released_claim_can_be_taken_again(etcd_server,
                                                                                         etcd_run_id) -> None:
    stores = [_store(etcd_server.url, etcd_run_id, f"n{i}") for i in range(4)]
    won: list[str] = []
    barrier = threading.Barrier(len(stores))

    def claim(store: ClusterStore) -> None:
        barrier.wait()
        if store.claim(7, "recover"):
            won.append(store.node)

    threads = [threading.Thread(target=claim, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(won) == 1, won
    assert stores[0].view(7).claim["node"] == won[0]  # type: ignore[index]
    assert not any(s.claim(7, "grow") for s in stores)
    stores[0].release_claim(7)  # the ladder said wait: the next settled agent decides again
    assert stores[1].claim(7, "recover")


def test_a_spare_is_taken_by_one_decision_only(etcd_server, etcd_run_id) -> None:
    owner, a, b = (_store(etcd_server.url, etcd_run_id, n) for n in ("spare0", "n0", "n1"))
    owner.register_spare("spare0.s0", ready_wall=1000.0)
    [seen_a], [seen_b] = a.pool(), b.pool()
    assert (seen_a.worker, seen_a.node, seen_a.claimed) == ("spare0.s0", "spare0", None)
    # Two decisions that read the pool at the same revision: the second compare-and-set fails.
    assert a.claim_spare(seen_a, 5) is True
    assert b.claim_spare(seen_b, 9) is False
    [after] = b.pool()
    assert after.claimed == 5
    owner.close()  # a claimed spare's key stays on its agent's lease: it leaves the pool with its agent
    assert b.pool() == []


def test_spares_are_taken_all_or_none(etcd_server, etcd_run_id) -> None:
    owner, a, b = (_store(etcd_server.url, etcd_run_id, n) for n in ("spare0", "n0", "n1"))
    owner.register_spare("spare0.s0", ready_wall=1.0)
    owner.register_spare("spare0.s1", ready_wall=2.0)
    first, second = sorted(a.pool(), key=lambda p: p.worker)
    assert b.claim_spare(second, 4)  # another decision takes the second spare first
    assert a.claim_spares([first, second], 4) is False
    assert {p.worker: p.claimed for p in b.pool()} == {"spare0.s0": None, "spare0.s1": 4}, \
        "the spare taken before the failed claim was not put back"
    owner.close()


def test_a_pool_entry_leaves_with_its_agents_lease_and_an_unsigned_one_never_counts(etcd_server,
                                                                                  etcd_run_id) -> None:
    owner, reader = _store(etcd_server.url, etcd_run_id, "spare0"), _store(etcd_server.url, etcd_run_id, "n0")
    owner.register_spare("spare0.s0", ready_wall=1.0)
    assert [s.worker for s in reader.pool()] == ["spare0.s0"]
    owner.close()  # revokes the lease, as an agent's death does when it expires
    assert reader.pool() == []
    forger = _store(etcd_server.url, etcd_run_id, "x", token="f" * 64)  # another token: its proofs fail
    forger.register_spare("forged.s0", ready_wall=1.0)
    client = EtcdClient(EtcdConfig.from_url(etcd_server.url))
    client.put(f"/resilient/{etcd_run_id}/{LAUNCH}pool/raw.s0", json.dumps({"worker": "raw.s0"}).encode())
    assert reader.pool() == [], "a spare written without the run token was counted"


def test_a_generation_view_joins_every_nodes_members_and_reports(etcd_server, etcd_run_id) -> None:
    n0, n1 = _store(etcd_server.url, etcd_run_id, "n0"), _store(etcd_server.url, etcd_run_id, "n1")
    n0.publish_node(3, {0: "n0.w0", 1: "n0.w1"}, world_size=3, store="127.0.0.1:1", opted_in=True, batch=None)
    assert not n0.view(3).complete()
    n1.publish_node(3, {2: "n1.w0"}, world_size=3, store="127.0.0.1:2", opted_in=True, batch=None)
    n1.report(3, "lost", "n1.w0", {"rank": 2, "kind": "crash"})
    n0.report(3, "waiting", "n0.w1", {"step": 4})
    view = n1.view(3)
    assert view.complete() and view.world_size() == 3
    assert view.members() == {0: ("n0.w0", "n0"), 1: ("n0.w1", "n0"), 2: ("n1.w0", "n1")}
    assert set(view.lost) == {"n1.w0"} and view.lost["n1.w0"]["node"] == "n1"
    assert set(view.waiting) == {"n0.w1"} and view.decision is None
    n0.decide(3, {"action": "shrink", "generation": 4})
    assert n1.view(3).decision == {"action": "shrink", "generation": 4} and n1.current() == 4
