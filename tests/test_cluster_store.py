"""The launch's recovery keys across machines (``resilient.agent.cluster``) against a real etcd.

What several agents rely on when they recover in process together: one
decider per generation, whose claim goes with its lease; a decision
committed with its spares and the generation counter in one transaction
(all or nothing), a commit in doubt settled; a spare taken by one decision
only; a pool entry that leaves with its agent's lease; nothing written
without the run token counted.  The same protocol under random faults, on
a model of etcd, is ``test_claims_protocol``.
"""

from __future__ import annotations

import json
import threading

from resilient.agent.cluster import ClusterStore
from resilient.coord import claims
from resilient.coord.etcd import EtcdClient, EtcdConfig, EtcdControlStore
from resilient.coord.keyspace import LaunchKeys
from resilient.coord.proof import SignedStore, sign
from resilient.coord.store import StoreUnavailableError

TOKEN = "t" * 64
LAUNCH = "launch/l1/"
KEYS = LaunchKeys("l1")


def _store(url: str, run_id: str, node: str, token: str = TOKEN, client=None) -> ClusterStore:
    client = client or EtcdClient(EtcdConfig.from_url(url))
    signed = SignedStore(EtcdControlStore.for_run(client, run_id), token)
    return ClusterStore(signed, client, f"/resilient/{run_id}/", KEYS, node, token)


def _counter(url: str, run_id: str, value: int) -> None:
    EtcdClient(EtcdConfig.from_url(url)).put(f"/resilient/{run_id}/generation",
                                             sign(TOKEN, "generation", {"generation": value}))


def _promote(store: ClusterStore, generation: int, spares: list) -> dict:
    return {"action": "promote_spare", "node": store.node, "generation": generation + 1,
            "members": [s.worker for s in spares]}


class _Answerless:
    """Once armed, the store applies (``applies=True``) or never sees the next transaction, and its answer is
    lost."""

    def __init__(self, client: EtcdClient, applies: bool) -> None:
        self.client, self.applies, self.armed, self.sent = client, applies, False, []

    def txn(self, txn):
        if self.armed:
            self.armed = False
            self.sent.append(txn)
            if self.applies:
                self.client.txn(txn)
            raise StoreUnavailableError("the answer was lost")
        return self.client.txn(txn)

    def __getattr__(self, name):
        return getattr(self.client, name)


def test_exactly_one_agent_decides_a_generation_and_a_released_claim_can_be_taken_again(etcd_server,
                                                                                         etcd_run_id) -> None:
    stores = [_store(etcd_server.url, etcd_run_id, f"n{i}") for i in range(4)]
    won: list = []
    barrier = threading.Barrier(len(stores))

    def claim(store: ClusterStore) -> None:
        barrier.wait()
        held = store.claim(7, "recover")
        if held is not None:
            won.append((store, held))

    threads = [threading.Thread(target=claim, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(won) == 1, won
    (winner, held), = won
    assert stores[0].view(7).claim["node"] == winner.node  # type: ignore[index]
    assert not any(s.claim(7, "grow") for s in stores)
    assert winner.release_claim(held)  # the ladder said wait: the next settled agent decides again
    assert stores[1].claim(7, "recover") is not None


def test_a_deciders_claim_goes_with_its_lease_and_its_stale_release_removes_no_one_elses(etcd_server,
                                                                                      etcd_run_id) -> None:
    a, b = _store(etcd_server.url, etcd_run_id, "n0"), _store(etcd_server.url, etcd_run_id, "n1")
    stale = a.claim(7, "recover")
    assert stale is not None and b.claim(7, "recover") is None
    a.close()  # the decider died (its lease revoked, as its expiry would): the claim goes with it
    assert b.view(7).claim is None
    held = b.claim(7, "recover")
    assert held is not None
    assert a.release_claim(stale) is False, "a stale holder removed another agent's claim"
    assert b.view(7).claim["node"] == "n1"  # type: ignore[index]
    assert b.commit(stale, 7, {"action": "restart", "node": "n0", "reason": "x"}) is claims.Outcome.CLAIM_LOST
    assert b.view(7).decision is None
    b.close()


def test_a_decision_commits_with_its_spares_and_the_counter_all_or_nothing(etcd_server, etcd_run_id) -> None:
    owner, a, b = (_store(etcd_server.url, etcd_run_id, n) for n in ("spare0", "n0", "n1"))
    _counter(etcd_server.url, etcd_run_id, 5)
    owner.register_spare("spare0.s0", ready_wall=1.0)
    owner.register_spare("spare0.s1", ready_wall=2.0)
    first, second = sorted(a.pool(), key=lambda p: p.worker)
    held = a.claim(5, "recover")
    assert held is not None
    counter, revision = a.counter()
    assert counter == 5
    owner.unregister_spare("spare0.s1")  # the second spare's process ended after the decider read the pool
    outcome = a.commit(held, 5, _promote(a, 5, [first, second]), spares=[first, second], counter_revision=revision)
    assert outcome is claims.Outcome.SPARES_MOVED
    assert a.view(5).decision is None and a.current() is None and a.counter() == (5, revision)
    assert {p.worker: p.claimed for p in a.pool()} == {"spare0.s0": None}, "half a decision was written"
    assert a.commit(held, 5, _promote(a, 5, [first]), spares=[first], counter_revision=revision) \
        is claims.Outcome.COMMITTED
    assert b.view(5).decision["members"] == ["spare0.s0"] and b.current() == 6  # type: ignore[index]
    assert b.counter()[0] == 6 and [(p.worker, p.claimed) for p in b.pool()] == [("spare0.s0", 6)]
    # The next generation's decider read the pool before that commit: the spare is not promoted twice.
    held6 = b.claim(6, "recover")
    assert held6 is not None
    _, revision6 = b.counter()
    assert b.commit(held6, 6, _promote(b, 6, [first]), spares=[first], counter_revision=revision6) \
        is claims.Outcome.SPARES_MOVED
    assert b.view(6).decision is None and b.counter()[0] == 6
    # A restart moved the counter after the decider read it: nothing applies.
    _counter(etcd_server.url, etcd_run_id, 9)
    assert b.commit(held6, 6, _promote(b, 6, []), counter_revision=revision6) is claims.Outcome.COUNTER_MOVED
    assert b.view(6).decision is None and b.current() == 6
    owner.close()


def test_a_commit_in_doubt_is_settled_by_withdrawing_the_claim(etcd_server, etcd_run_id) -> None:
    real = EtcdClient(EtcdConfig.from_url(etcd_server.url))
    for applies, expected in ((True, claims.Outcome.COMMITTED), (False, claims.Outcome.WITHDRAWN)):
        _counter(etcd_server.url, etcd_run_id, 3)
        flaky = _Answerless(real, applies)  # the network between this agent and etcd
        store = _store(etcd_server.url, etcd_run_id, "n0", client=flaky)
        held = store.claim(3, "recover")
        assert held is not None
        _, revision = store.counter()
        flaky.armed = True
        outcome = store.commit(held, 3, _promote(store, 3, []), counter_revision=revision)
        assert outcome is expected, applies
        view = store.view(3)
        if applies:
            assert view.decision is not None and store.counter()[0] == 4
            real.delete(f"/resilient/{etcd_run_id}/{LAUNCH}rec/g3/decision")
        else:
            assert view.decision is None and view.claim is None and store.counter()[0] == 3
            # The lost commit arrives late: it can never apply, its claim's revision is gone.
            assert real.txn(flaky.sent[0]).succeeded is False
            assert store.view(3).decision is None
        store.close()


def test_a_claim_of_this_agent_that_it_does_not_hold_is_cleared_and_no_one_elses(etcd_server, etcd_run_id) -> None:
    a, b = _store(etcd_server.url, etcd_run_id, "n0"), _store(etcd_server.url, etcd_run_id, "n1")
    assert a.claim(4, "recover") is not None  # created, its answer lost: the agent does not know it holds it
    assert b.clear_stale_claim(4) is False and b.view(4).claim["node"] == "n0"  # type: ignore[index]
    assert a.clear_stale_claim(4) is True and a.view(4).claim is None
    assert b.claim(4, "recover") is not None
    a.close()
    b.close()


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


def test_what_every_node_writes_is_read_by_one_agent_and_the_first_report_marks_the_generation_failed_once(
        etcd_server, etcd_run_id) -> None:
    """Every node publishes its members and every survivor its wait: kept out of the keys every agent watches (N
    agents told of N writes is N² events), read whole by the one agent that needs them; the first report of a
    generation marks it failed, naming its collector, created once."""
    n0, n1 = _store(etcd_server.url, etcd_run_id, "n0"), _store(etcd_server.url, etcd_run_id, "n1")
    client = EtcdClient(EtcdConfig.from_url(etcd_server.url))
    watched = f"/resilient/{etcd_run_id}/launch"
    assert not n0.view_of(5, {}).failing()
    for store, ranks in ((n0, {0: "n0.w0", 1: "n0.w1"}), (n1, {2: "n1.w0"})):
        store.publish_node(5, ranks, world_size=3, store="127.0.0.1:1", opted_in=True, batch=None)
    n0.report(5, "waiting", "n0.w0", {"rank": 0, "step": 11})
    mark = client.get(f"{watched}/l1/rec/g5/failed")
    assert mark is not None
    n0.report(5, "waiting", "n0.w1", {"rank": 1, "step": 11})
    n1.report(5, "waiting", "n1.w0", {"rank": 2, "step": 11})
    assert client.get(f"{watched}/l1/rec/g5/failed").mod_revision == mark.mod_revision, "marked again"
    assert not [e.key for e in client.get_prefix(watched) if "/waiting/" in e.key or "/node/" in e.key]
    # As the watch holds them: failed (by n0, which collects), neither nodes nor waits; read whole: both.
    watched_view = n1.view_of(5, n1.signed.get_prefix(f"{LAUNCH}rec/g5/"))
    assert watched_view.failed_by == "n0" and watched_view.failing()
    assert watched_view.waiting == {} and watched_view.nodes == {}
    full = n1.reports(watched_view)
    assert set(full.waiting) == {"n0.w0", "n0.w1", "n1.w0"} and full.waiting["n1.w0"]["step"] == 11
    assert full.complete() and full.members()[2] == ("n1.w0", "n1") and full.failed_by == "n0"
    assert n1.view(5) == full
    assert n1.reports(n1.view_of(4, {})).waiting == {}
    # A wait written without the run token is not one.
    client.put(f"/resilient/{etcd_run_id}/reports/{LAUNCH}g5/waiting/x.w0", json.dumps({"step": 1}).encode())
    assert "x.w0" not in n0.view(5).waiting


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
    _counter(etcd_server.url, etcd_run_id, 3)
    held = n0.claim(3, "recover")
    assert held is not None
    outcome = n0.commit(held, 3, {"action": "shrink", "generation": 4}, counter_revision=n0.counter()[1])
    assert outcome is claims.Outcome.COMMITTED
    decision = n1.view(3).decision
    assert decision is not None and decision["action"] == "shrink" and decision["generation"] == 4
    assert n1.current() == 4


def test_a_node_cut_off_from_the_store_has_no_turn_to_collect(etcd_server, etcd_run_id) -> None:
    """A node whose presence key is gone while its peers still reach it (vouched for: alive) is cut off from the
    store: it cannot read the reports or commit a decision, so the next node collects at once."""
    from resilient.agent.cluster import collectors
    from resilient.coord.store import Entry

    n0 = _store(etcd_server.url, etcd_run_id, "n0")

    def presence(node: str, state: str) -> Entry:
        return Entry(f"{LAUNCH}nodes/{node}", sign(TOKEN, f"{LAUNCH}nodes/{node}", {"state": state}), 1, 1)

    keys = [presence("n0", "running"), presence("n2", "running"), presence("n3", "left"),
            Entry(f"{LAUNCH}suspect/n1/n0", b"{}", 1, 1),
            Entry(f"{LAUNCH}nodes/n4", json.dumps({"state": "running"}).encode(), 1, 1)]  # forged: nobody
    running = n0.running_of(keys)
    assert running == {"n0", "n2"}
    live = {"n0", "n1", "n2"}  # n1 is vouched for: alive, its presence key gone with its lease
    assert collectors("n1", running & live, "n2") == ["n0", "n2"]
    assert collectors("n1", live, "n2")[0] == "n1", "without the store's view n1 would keep its turn"


def test_a_forged_decision_or_counter_blocks_no_recovery_and_is_reported(etcd_server, etcd_run_id) -> None:
    """A writer without the run token puts a decision for the generation being recovered (today's agents would
    take it for another decider's and wait for it forever) and a counter of its choosing.  The decider commits
    over the forged decision, every reader sees only the real one, the forged counter reads as the launch's
    current generation, and each forged key is reported."""
    rejected: list[str] = []
    client = EtcdClient(EtcdConfig.from_url(etcd_server.url))
    signed = SignedStore(EtcdControlStore.for_run(client, etcd_run_id), TOKEN,
                         on_rejected=lambda key, _why: rejected.append(key))
    a = ClusterStore(signed, client, f"/resilient/{etcd_run_id}/", KEYS, "n0", TOKEN)
    b = _store(etcd_server.url, etcd_run_id, "n1")
    _counter(etcd_server.url, etcd_run_id, 3)
    a.set_current(3)
    root = f"/resilient/{etcd_run_id}/"
    client.put(f"{root}{LAUNCH}rec/g3/decision", json.dumps({"action": "stop", "node": "evil"}).encode())
    client.put(f"{root}generation", b"41")
    assert a.view(3).decision is None and b.view(3).decision is None
    assert a.counter()[0] == 3, "a forged counter reads as the launch's current generation"
    held = a.claim(3, "recover")
    assert held is not None
    # With a forged decision there, a commit that fails on something else says what: the counter moved.
    stale = a.counter()[1]
    _counter(etcd_server.url, etcd_run_id, 3)
    assert a.commit(held, 3, {"action": "shrink", "generation": 4}, counter_revision=stale) \
        is claims.Outcome.COUNTER_MOVED
    outcome = a.commit(held, 3, {"action": "shrink", "generation": 4}, counter_revision=a.counter()[1])
    assert outcome is claims.Outcome.COMMITTED
    decision = b.view(3).decision
    assert decision is not None and decision["action"] == "shrink" and decision["generation"] == 4
    assert b.counter()[0] == 4 and b.current() == 4
    assert {f"{LAUNCH}rec/g3/decision", "generation"} <= set(rejected), rejected
    # A decision copied from another generation does not verify under this one's key.
    copied = client.get(f"{root}{LAUNCH}rec/g3/decision")
    assert copied is not None
    client.put(f"{root}{LAUNCH}rec/g4/decision", copied.value)
    assert b.view(4).decision is None
    a.close()
    b.close()
