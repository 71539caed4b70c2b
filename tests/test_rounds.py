"""The launch's rendezvous across machines: rounds formed by one etcd transaction each.

The protocol's safety (one result per round, members whose joins stood when
it formed, generations that only grow) is checked by a hypothesis state
machine over the in-memory etcd model with lost, unanswered, repeated and
delayed requests, leases that expire and counters moved by other writers.
The agent's side (:class:`EtcdRendezvous`: who closes a round, when, who
waits, closing, timeouts, the load at rest) runs against a real etcd.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from resilient.agent.rendezvous import MASTER_PORTS_FROM, EtcdRendezvous, RendezvousTimeouts, ephemeral_ports, free_port
from resilient.coord.etcd import EtcdClient, EtcdConfig
from resilient.coord.proof import Seal
from resilient.coord.rounds import (
    RendezvousClosedError,
    RendezvousTimeoutError,
    Round,
    RoundKeys,
    RoundStore,
    order_members,
    ready_to_close,
)
from resilient.coord.store import ControlStoreError, Entry
from resilient.coord.txn import Put, Txn, TxnResult

from .etcd_model import EtcdModel, Flaky
from .etcd_server import EtcdServer

SPACE = "/resilient/r/rdzv/L/"
COUNTER = "/resilient/r/generation"
TOKEN = "t" * 32
SEAL = Seal(TOKEN, "/resilient/r/")


def decoded(entry: Entry | None) -> dict[str, Any]:
    """A stored value whose proof must hold."""
    assert entry is not None
    value = SEAL.open(entry)
    assert value is not None, f"{entry.key} holds no signed value"
    return value


# ---------------------------------------------------------------- the pure parts
def test_ready_to_close_by_table() -> None:
    rows = [
        # joined, min, max, previous joined, min for s, last call -> closes
        (3, 2, 3, False, None, 1.0, True),  # full
        (1, 2, 3, True, None, 1.0, False),  # below the minimum, whoever joined
        (2, 2, 3, True, 0.0, 30.0, True),  # every live node of the last round is back: no last call
        (2, 2, 3, False, 0.5, 1.0, False),  # in the last call
        (2, 2, 3, False, 1.0, 1.0, True),  # the last call is over
        (2, 2, 3, False, None, 1.0, False),
    ]
    for joined, lo, hi, prev, since, last, closes in rows:
        why = ready_to_close(joined, min_nodes=lo, max_nodes=hi, previous_joined=prev, min_for_s=since,
                             last_call_s=last)
        assert (why is not None) == closes, (joined, lo, hi, prev, since, last, why)


def _entry(node: str, revision: int) -> Entry:
    return Entry(key=f"{SPACE}j/00000001/{node}", value=b"{}", mod_revision=revision, create_revision=revision,
                 version=1, lease=0)


def test_members_keep_their_ranks_and_newcomers_follow_in_natural_order() -> None:
    joins = {n: _entry(n, r) for n, r in (("c", 5), ("a", 9), ("z", 3), ("b", 7))}
    assert order_members(joins, ("b", "x", "a"), 4) == ("b", "a", "c", "z")
    assert order_members(joins, ("b", "x", "a"), 3) == ("b", "a", "z")  # the latest newcomer waits for room
    nodes = {f"node-{i}": _entry(f"node-{i}", 20 - i) for i in (0, 1, 2, 10, 11)}
    assert order_members(nodes, (), 8) == ("node-0", "node-1", "node-2", "node-10", "node-11")


# ---------------------------------------------------------------- the protocol, by property
class CheckedModel(EtcdModel):
    """The model, checking as each round's result lands that every member's join stands at that revision."""

    def __init__(self, clock: Callable[[], float]) -> None:
        super().__init__(clock)
        self.violations: list[str] = []

    def txn(self, txn: Txn) -> TxnResult:
        keys = RoundKeys(SPACE)
        with self._lock:
            self._expire()
            ok = all(c.holds(self._data.get(c.key)) for c in txn.compare)
            for op in txn.success if ok else ():
                if isinstance(op, Put) and op.key.startswith(keys.out + "r/"):
                    opened = SEAL.open(Entry(op.key, op.value, 0, 0))
                    assert opened is not None, f"{op.key} was written unsigned"
                    formed = Round.of(opened)
                    missing = [m for m in formed.members if keys.join(formed.number, m) not in self._data]
                    if missing:
                        self.violations.append(f"round {formed.number} formed with {missing} not joined")
        return super().txn(txn)


NODES = ("n0", "n1", "n2", "n3")


class Rounds(RuleBasedStateMachine):
    """Four agents joining and forming rounds (min 2, max 3) through a flaky network."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.model = CheckedModel(lambda: self.now)
        self.net = Flaky(self.model)
        self.store = RoundStore(self.net, SPACE, COUNTER, SEAL)  # type: ignore[arg-type]
        self.leases = {n: self.model.lease_grant(5) for n in NODES}
        self.joined: dict[str, int] = {}
        self.first_seen: dict[int, bytes] = {}
        self.decided: set[int] = set()
        """Generations numbered by in-process decisions (never a round's too)."""
        self.taken: dict[str, int] = {}
        """The newest round each node learned it is a member of."""

    def _try(self, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except ControlStoreError:
            return None

    @rule(node=st.sampled_from(NODES), fault=st.sampled_from([None, None, "lost", "unanswered", "retried",
                                                             "delayed"]), skip=st.integers(0, 1))
    def join(self, node: str, fault: str | None, skip: int) -> None:
        """Its read of the open round or its join (``skip``) meets ``fault``."""
        self.net.next_fault, self.net.skip = fault, skip
        n = self._try(lambda: self.store.join(node, {"addr": "h-" + node, "port": 1}, self.leases[node]))
        if n is not None:
            self.joined[node] = n

    @rule(node=st.sampled_from(NODES), limit=st.integers(1, 3),
          fault=st.sampled_from([None, "delayed", "delayed", "lost", "unanswered", "retried"]))
    def form(self, node: str, limit: int, fault: str | None) -> None:
        """Any agent may try to form the round it joined, with any view of who is live, its commit meeting
        ``fault``: the transaction alone must keep the result whole."""
        n = self.joined.get(node)
        if n is None:
            return
        self.net.next_fault, self.net.skip = fault, 1
        live = set(NODES[:limit + 1]) | {node}
        joins = {RoundKeys.node_of(e.key): e for e in self.model.get_prefix(self.store.keys.joins(n))
                 if RoundKeys.node_of(e.key) in live}
        previous = self.model.get(self.store.keys.result(n - 1))
        before = Round.of(decoded(previous)).members if previous is not None else ()
        formed = self._try(lambda: self.store.form(n, joins, before, 3))
        if formed is not None:
            assert formed.number == n
            stored = self.model.get(self.store.keys.result(n))
            assert Round.of(decoded(stored)) == formed
            if node in formed.members:
                self.taken[node] = n

    @rule()
    def deliver(self) -> None:
        self.net.deliver()

    @rule(node=st.sampled_from(NODES))
    def node_dies(self, node: str) -> None:
        """Its lease expires (its joins go with it); it comes back on a new one and must join again."""
        self.model.expire_lease(self.leases[node])
        self.leases[node] = self.model.lease_grant(5)
        self.joined.pop(node, None)

    @rule()
    def decision_in_process(self) -> None:
        """Another agent's in-process decision moves the run's generation counter."""
        entry = self.model.get(COUNTER)
        issued = (decoded(entry)["generation"] if entry is not None else 0) + 1
        self.model.put(COUNTER, SEAL.seal(COUNTER, {"generation": issued}))
        self.decided.add(issued)

    @invariant()
    def one_result_per_round_and_generations_grow(self) -> None:
        assert self.model.violations == []
        results = {int(e.key.rsplit("/", 1)[1]): e for e in self.model.get_prefix(self.store.keys.out + "r/")}
        for n, e in results.items():
            assert self.first_seen.setdefault(n, e.value) == e.value, f"round {n}'s result was rewritten"
            assert e.version == 1
            formed = Round.of(decoded(e))
            assert 1 <= len(formed.members) <= 3 and len(set(formed.members)) == len(formed.members)
            assert formed.master_addr == "h-" + formed.members[0]
        rounds = sorted((Round.of(decoded(e)) for e in results.values()), key=lambda r: r.number)
        gens = [r.generation for r in rounds]
        assert gens == sorted(set(gens)), f"generations {gens} do not grow"
        assert not set(gens) & self.decided, f"a round numbered a generation a decision had taken: {gens}"
        counter = self.model.get(COUNTER)
        if rounds:
            assert decoded(counter)["generation"] >= max(gens)
        open_round = self.model.get(self.store.keys.round)
        formed_numbers = sorted(results)
        if formed_numbers:
            assert decoded(open_round)["round"] == max(formed_numbers) + 1


Rounds.TestCase.settings = settings(max_examples=500, stateful_step_count=30, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])
TestRounds = Rounds.TestCase


@pytest.mark.parametrize("between", ["member_dies", "decision", "another_closer_forms", "nothing"])
def test_a_commit_delivered_late_applies_only_if_nothing_it_compared_moved(between: str) -> None:
    """A closer's commit is held up in the network while the world moves on, then arrives."""
    m = Rounds()
    m.join("n0", None, 0)
    m.join("n1", None, 0)
    m.form("n0", 3, "delayed")
    assert m.net.pending and m.model.get(m.store.keys.result(0)) is None
    if between == "member_dies":
        m.node_dies("n1")
    elif between == "decision":
        m.decision_in_process()
    elif between == "another_closer_forms":
        m.form("n1", 1, None)  # sees only n1 and n0 live: forms ("n0", "n1") itself
    formed_before = m.model.get(m.store.keys.result(0))
    m.deliver()
    m.one_result_per_round_and_generations_grow()
    after = m.model.get(m.store.keys.result(0))
    if between == "nothing":
        assert Round.of(decoded(after)).members == ("n0", "n1")
    elif between == "another_closer_forms":
        assert after == formed_before
    else:
        assert after is None, f"the late commit applied after {between}"


def test_a_commit_whose_answer_was_lost_is_found_on_the_retry() -> None:
    m = Rounds()
    m.join("n0", None, 0)
    m.form("n0", 1, "unanswered")
    assert m.model.get(m.store.keys.result(0)) is not None  # it landed; the closer does not know
    again = m.store.form(0, {}, (), 3)
    assert again is not None and again.members == ("n0",)
    m.one_result_per_round_and_generations_grow()


# ---------------------------------------------------------------- the agent's side, on a real etcd
class CountingClient(EtcdClient):
    """Counts the requests it sends (a watch stream opened counts as one)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.requests = 0

    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self.requests += 1
        return super().call(path, body)

    def stream(self, *args: Any, **kwargs: Any) -> Any:
        self.requests += 1
        return super().stream(*args, **kwargs)


class Cluster:
    """Rendezvous objects of several nodes in one process, each with its own client and presence lease;
    ``live`` is what the presence of every node says (a node removed from it was judged lost)."""

    def __init__(self, server: EtcdServer, run_id: str, *, min_nodes: int, max_nodes: int,
                 last_call_s: float = 30.0, join_s: float = 60.0) -> None:
        self.space = f"/resilient/{run_id}/rdzv/L/"
        self.counter = f"/resilient/{run_id}/generation"
        self.seal = Seal(TOKEN, f"/resilient/{run_id}/", on_rejected=lambda key, why: self.forged.append(key))
        self.renewed: list[str] = []
        """The nodes whose lease was renewed into a new one because a join named an expired one."""
        self.forged: list[str] = []
        """The keys whose values were rejected (each revision once)."""
        self.url = server.url
        self.live: set[str] = set()
        self.kw = {"min_nodes": min_nodes, "max_nodes": max_nodes,
                   "timeouts": RendezvousTimeouts(join_s=join_s, last_call_s=last_call_s)}
        self.made: list[EtcdRendezvous] = []
        self.clients: dict[str, CountingClient] = {}
        self.leases: dict[str, int] = {}

    def renew(self, name: str) -> int:
        """What a node's presence does when asked to renew a lease etcd no longer knows: take a new one."""
        client = self.clients[name]
        if client.lease_keepalive(self.leases[name]) <= 0:
            self.leases[name] = client.lease_grant(60)
            self.renewed.append(name)
        return self.leases[name]

    def node(self, name: str, **timeouts: float) -> EtcdRendezvous:
        client = CountingClient(EtcdConfig.from_url(self.url))
        self.leases[name] = client.lease_grant(60)
        self.clients[name] = client
        self.live.add(name)
        kw = dict(self.kw)
        if timeouts:
            kw["timeouts"] = RendezvousTimeouts(**{"join_s": 60.0, "last_call_s": 30.0, **timeouts})
        r = EtcdRendezvous(client, self.space, self.counter, name, "127.0.0.1", lease=lambda: self.leases[name],
                           live=lambda: frozenset(self.live), seal=self.seal,
                           renew_lease=lambda: self.renew(name), **kw)  # type: ignore[arg-type]
        self.made.append(r)
        return r

    def result(self, n: int) -> Round:
        formed = self.store().result(n)
        assert formed is not None, f"round {n} has no result"
        return formed

    def store(self, node: str | None = None) -> RoundStore:
        client = self.clients[node] if node is not None else next(iter(self.clients.values()))
        return RoundStore(client, self.space, self.counter, self.seal)

    def close(self) -> None:
        for r in self.made:
            r.leave()


def together(*calls: Callable[[], Any], timeout: float = 30.0) -> list[Any]:
    """Run the calls on threads at once; their results in order (an exception is returned, not raised)."""
    results: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except Exception as e:  # noqa: BLE001  returned to the test
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a rendezvous call did not return"
    return results


@pytest.fixture
def cluster_factory(etcd_server: EtcdServer, etcd_run_id: str) -> Any:
    made: list[Cluster] = []

    def make(**kw: Any) -> Cluster:
        c = Cluster(etcd_server, etcd_run_id, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def _reasons(*nodes: EtcdRendezvous) -> dict[int, str]:
    return {n: why for r in nodes for n, why in r.formed}


def test_a_full_round_forms_then_restarts_form_at_once_without_the_lost_node(cluster_factory: Any) -> None:
    """Four nodes fill the run's largest round.  One is judged lost (its presence lease still runs): the next
    round forms of the three others as soon as they joined, not after the 30 s last call, and again when they
    restart; members keep their order and each round starts the next generation."""
    c = cluster_factory(min_nodes=2, max_nodes=4, last_call_s=30.0)
    nodes = [c.node(n) for n in ("a", "b", "d", "e")]
    first = together(*(r.next for r in nodes))
    assert all(not isinstance(x, Exception) for x in first), first
    assert sorted(x.node_rank for x in first) == [0, 1, 2, 3] and {x.num_nodes for x in first} == {4}
    assert len({(x.generation, x.master_addr, x.master_port) for x in first}) == 1
    assert c.result(0).members == tuple(sorted("abde", key=lambda n: first["abde".index(n)].node_rank))
    assert "the most the run takes" in _reasons(*nodes)[0]
    c.live.discard("e")
    second = together(*(r.next for r in nodes[:3]))
    assert all(not isinstance(x, Exception) for x in second), second
    assert c.result(1).members == tuple(m for m in c.result(0).members if m != "e")
    assert {x.generation for x in second} == {first[0].generation + 1}
    assert {x.num_nodes for x in second} == {3}
    third = together(*(r.next for r in nodes[:3]))
    assert [x.node_rank for x in third] == [x.node_rank for x in second]
    assert {x.generation for x in third} == {first[0].generation + 2}
    reasons = _reasons(*nodes)
    assert reasons[1] == reasons[2] == "every live node of the previous round joined", reasons
    assert c.result(2).master_addr == "127.0.0.1"


def test_a_closer_that_dies_is_replaced(cluster_factory: Any) -> None:
    """The lost node joined the next round first (it would form it), then died: the others form it."""
    c = cluster_factory(min_nodes=2, max_nodes=3, last_call_s=30.0)
    a, b, lost = c.node("a"), c.node("b"), c.node("lost")
    first = together(a.next, b.next, lost.next)
    assert {x.num_nodes for x in first} == {3}
    store = c.store("lost")
    n = store.join("lost", {"addr": "127.0.0.1", "port": 1}, c.clients["lost"].lease_grant(60))
    assert n == 1 and store.closer(n, frozenset(c.live)) == "lost"
    c.live.discard("lost")
    second = together(a.next, b.next)
    assert all(not isinstance(x, Exception) for x in second), second
    assert c.result(1).members == tuple(m for m in c.result(0).members if m != "lost")
    assert _reasons(a, b)[1] == "every live node of the previous round joined"


def test_a_join_that_lapsed_with_its_lease_is_made_again_on_the_new_one(cluster_factory: Any) -> None:
    """An etcd outage outlived a node's presence lease while it waited in a round: presence moved to a new
    lease, the old one took the join with it; the node joins again and the round forms with it."""
    c = cluster_factory(min_nodes=2, max_nodes=2)
    a, b = c.node("a"), c.node("b")
    placed: list[Any] = []
    t = threading.Thread(target=lambda: placed.append(a.next()))
    t.start()
    client = c.clients["a"]
    keys = RoundKeys(c.space)
    _until(lambda: client.get(keys.join(0, "a")) is not None)
    client.lease_revoke(c.leases["a"])
    c.leases["a"] = client.lease_grant(60)
    [mine] = together(b.next)
    t.join(30)
    assert not t.is_alive() and placed, "the node whose join lapsed was never placed"
    assert {mine.num_nodes, placed[0].num_nodes} == {2}
    rejoined = client.get(keys.join(0, "a"))
    assert rejoined is not None and rejoined.lease == c.leases["a"]


def test_a_round_of_more_nodes_than_etcd_compares_in_one_transaction_forms(etcd_server: EtcdServer,
                                                                            etcd_run_id: str) -> None:
    """etcd refuses a transaction of over 128 comparisons: a round of 300 nodes still forms, in one."""
    client = EtcdClient(EtcdConfig.from_url(etcd_server.url))
    store = RoundStore(client, f"/resilient/{etcd_run_id}/rdzv/L/", f"/resilient/{etcd_run_id}/generation",
                       Seal(TOKEN, f"/resilient/{etcd_run_id}/"))
    lease = client.lease_grant(60)
    nodes = [f"node-{i}" for i in range(300)]
    for node in nodes:
        assert store.join(node, {"addr": "10.0.0.1", "port": 29500}, lease) == 0
    joins = {RoundKeys.node_of(e.key): e for e in client.get_prefix(store.keys.joins(0))}
    formed = store.form(0, joins, (), 1000)
    assert formed is not None and formed.members == tuple(nodes) and formed.generation == 1
    assert store.result(0) == formed and store.open_round()[0] == 1


def test_a_late_node_waits_and_is_let_in(cluster_factory: Any) -> None:
    c = cluster_factory(min_nodes=2, max_nodes=3, last_call_s=0.3)
    a, b = c.node("a"), c.node("b")
    first = together(a.next, b.next)
    assert {x.num_nodes for x in first} == {2}
    assert a.num_nodes_waiting() == 0 and b.num_nodes_waiting() == 0
    late = c.node("late")
    result: list[Any] = []
    t = threading.Thread(target=lambda: result.append(late.next()))
    t.start()
    _until(lambda: a.num_nodes_waiting() == 1 and b.num_nodes_waiting() == 1)
    again = together(a.next, b.next)  # the members restart to let it in
    t.join(30)
    assert not t.is_alive()
    assert [x.node_rank for x in again] == [x.node_rank for x in first]
    assert result[0].node_rank == 2 and {x.num_nodes for x in [*again, *result]} == {3}
    assert c.result(1).members[2] == "late"
    assert a.num_nodes_waiting() == 0


def test_a_full_round_is_not_restarted_for_a_node_it_has_no_room_for(cluster_factory: Any) -> None:
    c = cluster_factory(min_nodes=2, max_nodes=2)
    a, b = c.node("a"), c.node("b")
    together(a.next, b.next)
    extra = c.node("extra", join_s=1.5)
    client = c.clients["a"]
    out = together(extra.next, lambda: _until(lambda: client.get(RoundKeys(c.space).waiting) is not None))
    assert isinstance(out[0], RendezvousTimeoutError), out
    assert "--rdzv-join-timeout" in str(out[0])
    waiting = c.seal.open(client.get(RoundKeys(c.space).waiting))  # type: ignore[arg-type]
    assert waiting == {"round": 1, "members": False, "new": True}
    assert a.num_nodes_waiting() == 0 and b.num_nodes_waiting() == 0
    assert client.get_prefix(RoundKeys(c.space).joins(1)) == []  # the timed-out join was withdrawn


def test_closing_ends_every_wait_and_a_running_round_costs_no_request(cluster_factory: Any) -> None:
    c = cluster_factory(min_nodes=2, max_nodes=2)
    a, b = c.node("a"), c.node("b")
    together(a.next, b.next)
    client = c.clients["a"]
    before = client.requests
    for _ in range(200):  # what the agent asks every second while its generation runs
        assert a.num_nodes_waiting() == 0
        time.sleep(0.01)
    assert client.requests == before, "asking who waits cost a request: it must read the watched copy"
    c.kw["timeouts"] = RendezvousTimeouts(join_s=60.0, last_call_s=30.0)
    lone = c.node("lone", join_s=60.0)
    waits = together(lone.next, lambda: (time.sleep(0.3), a.close()))
    assert isinstance(waits[0], RendezvousClosedError), waits
    assert b.is_closed()
    assert isinstance(together(b.next)[0], RendezvousClosedError)


def _until(check: Callable[[], bool], timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if check():
            return True
        time.sleep(0.02)
    raise AssertionError("the condition never held")


def test_forged_rendezvous_keys_direct_no_worker_close_nothing_and_are_reported(cluster_factory: Any) -> None:
    """A writer without the run token puts, with plain etcd puts, before the nodes come: ``out/closed``, a result
    for the round they will join naming its own master address, a join of a node that does not exist, a
    ``round`` and a counter of its choosing.  The round forms of the two real nodes, with their address, as the
    launch's first generation; then forged ``closed`` and next result again: the next round forms the same way.
    Every forged key is reported."""
    c = cluster_factory(min_nodes=2, max_nodes=3, last_call_s=0.3)
    a, b = c.node("a"), c.node("b")
    raw = c.clients["a"]
    keys = RoundKeys(c.space)
    planted = {keys.closed: b"closed by nobody", keys.result(0): Round(0, 50, ("a", "b"), "10.6.6.6", 1).body(),
               keys.join(0, "evil"): {"addr": "10.6.6.6", "port": 1, "node": "evil"}, keys.round: b"7",
               c.counter: {"generation": 98}}
    for key, value in planted.items():
        raw.put(key, value if isinstance(value, bytes) else json.dumps({"body": value, "proof": "0" * 64}).encode())
    c.live.add("evil")  # even taken for alive, its forged join makes it no member
    first = together(a.next, b.next)
    assert all(not isinstance(x, Exception) for x in first), first
    assert {(x.generation, x.num_nodes, x.master_addr) for x in first} == {(1, 2, "127.0.0.1")}, first
    assert c.result(0).members == ("a", "b")
    assert set(planted) <= set(c.forged), c.forged
    for key in (keys.closed, keys.result(1)):
        raw.put(key, json.dumps({"body": {"why": "x"} if key == keys.closed else
                                 Round(1, 60, ("a", "b"), "10.6.6.6", 1).body(), "proof": "1" * 64}).encode())
    assert not a.is_closed() and not b.is_closed()
    second = together(a.next, b.next)
    assert all(not isinstance(x, Exception) for x in second), second
    assert {(x.generation, x.master_addr) for x in second} == {(2, "127.0.0.1")}, second
    assert {keys.closed, keys.result(1)} <= set(c.forged)
    # The control: a signed ``closed`` does close it.
    raw.put(keys.closed, c.seal.seal(keys.closed, {"why": "closed with the token"}))
    _until(lambda: a.is_closed() and b.is_closed())


def test_a_node_whose_lease_expired_unnoticed_joins_on_a_new_one(cluster_factory: Any) -> None:
    """A partition outlived node b's lease, and b joins the next round before its presence noticed (it renews
    every few seconds): etcd refuses the join as naming an unknown lease.  b renews (a new lease) and joins; the
    round forms with both, where b used to give up with rendezvous_failed."""
    c = cluster_factory(min_nodes=2, max_nodes=2)
    a, b = c.node("a"), c.node("b")
    together(a.next, b.next)
    c.clients["b"].lease_revoke(c.leases["b"])  # expired, as far as etcd knows; b's presence has not noticed
    second = together(a.next, b.next)
    assert all(not isinstance(x, Exception) for x in second), second
    assert {x.num_nodes for x in second} == {2} and c.renewed == ["b"]
    joined = c.clients["b"].get(RoundKeys(c.space).join(1, "b"))
    assert joined is None or joined.lease == c.leases["b"]


def test_the_master_port_is_chosen_below_the_kernels_ephemeral_range(tmp_path: Path) -> None:
    """A port from the ephemeral range can be handed to any process's outgoing connection before the rank-0 worker
    binds it; one below it only to an explicit bind.  A taken candidate is passed over."""
    low, high = ephemeral_ports()
    assert low > MASTER_PORTS_FROM, (low, high)
    ports = {free_port("127.0.0.1") for _ in range(20)}
    assert all(MASTER_PORTS_FROM <= p < low for p in ports), sorted(ports)
    assert len(ports) > 1, "the same port every time: two agents on one host would collide"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", free_port("127.0.0.1")))
        busy = taken.getsockname()[1]
        assert all(free_port("127.0.0.1") != busy for _ in range(50))
    custom = tmp_path / "range"
    custom.write_text("40000\t50000\n")
    assert ephemeral_ports(str(custom)) == (40000, 50000)
    assert ephemeral_ports(str(tmp_path / "absent")) == (32768, 60999)
