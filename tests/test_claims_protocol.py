"""The one-decider protocol (``resilient.coord.claims``) through the agents' ClusterStore, over a model of etcd.

The property-based machine runs several agents' claims, commits and
releases interleaved at random, with the faults a control plane meets: a
request lost before it applied, one that applied and whose answer was lost,
one the transport sent twice, an agent killed at any point (its lease then
runs out), a live agent's lease expiring (cut off from the store), and the
clock moving on.  After every step it checks what recovery relies on:

* at most one decision per generation, and it never changes once written;
* an agent believes it committed a decision exactly when that decision is
  in the store with its nonce (no outcome left unknown, none misread);
* a spare is promoted by at most one decision, and its pool entry names
  that decision's generation;
* every agent that reads generation G's decision reads the same members;
* a claim never outlives its holder's lease (a dead decider stalls no one
  for longer than the TTL).

The model's semantics are checked against a real etcd at the end of this
file, and the same scenarios run on a real etcd in ``test_cluster_store``.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from resilient.agent.cluster import POOL_TTL_S, ClusterStore
from resilient.coord import claims
from resilient.coord.etcd import EtcdClient, EtcdConfig, EtcdControlStore
from resilient.coord.keyspace import LaunchKeys
from resilient.coord.proof import SignedStore, sign, verify
from resilient.coord.store import ControlStoreError
from resilient.coord.txn import Compare, Delete, Put, Txn

from .etcd_model import EtcdModel, Flaky

TOKEN = "k" * 64
RUN = "model"
ROOT = f"/resilient/{RUN}/"
LAUNCH = "launch/l1/"
KEYS = LaunchKeys("l1")
DECIDERS = ("n0", "n1", "n2")
SPARES = ("s0.a", "s0.b", "s0.c")
FIRST = 5
FAULTS = st.sampled_from([None, None, None, "lost", "unanswered", "retried", "delayed"])


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _agent(model: EtcdModel, node: str) -> tuple[ClusterStore, Flaky]:
    flaky = Flaky(model)
    signed = SignedStore(EtcdControlStore(flaky, ROOT), TOKEN)  # type: ignore[arg-type]
    return ClusterStore(signed, flaky, ROOT, KEYS, node, TOKEN), flaky


class Decisions(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.model = EtcdModel(self.clock)
        self.model.put(ROOT + "generation", sign(TOKEN, "generation", {"generation": FIRST}))
        self.agents = {n: _agent(self.model, n) for n in DECIDERS}
        owner, _ = _agent(self.model, "s0")
        for i, worker in enumerate(SPARES):
            owner.register_spare(worker, ready_wall=float(i))
        self.owner = owner
        self.alive = set(DECIDERS)
        self.died_at: dict[str, float] = {}
        self.held: dict[tuple[str, int], claims.Claim] = {}
        self.prepared: dict[tuple[str, int], tuple[dict, list, int]] = {}
        self.held_on: dict[tuple[str, int], int] = {}  # the lease a claim was taken on
        self.exited: set[str] = set()
        self.believed: dict[int, tuple[str, dict]] = {}  # generation -> (agent, body) of a COMMITTED outcome
        self.first_seen: dict[int, bytes] = {}
        self.read_members: dict[int, list] = {}

    def _decision_entry(self, generation: int):
        return self.model.get(f"{ROOT}{LAUNCH}rec/g{generation}/decision")

    def _counter(self) -> int:
        entry = self.model.get(ROOT + "generation")
        value = verify(TOKEN, "generation", entry.value).value
        assert value is not None, "the counter was written without the run token"
        return int(value["generation"])

    # ------------------------------------------------------------ rules
    @rule(node=st.sampled_from(DECIDERS), ahead=st.sampled_from([0, 0, 0, 1]), fault=FAULTS)
    def claim(self, node: str, ahead: int, fault: str | None) -> None:
        """An agent's tick: clear a claim of its own it does not hold, then claim (mostly the running generation,
        sometimes one already decided)."""
        if node not in self.alive:
            return
        store, flaky = self.agents[node]
        generation = self._counter() - ahead
        if (node, generation) not in self.held:
            store.clear_stale_claim(generation)
        flaky.next_fault = fault
        try:
            held = store.claim(generation, "recover")
        except ControlStoreError:
            return  # in doubt: a create that lands is cleared by this agent's next tick, or goes with its lease
        if held is not None:
            self.held[(node, generation)] = held
            self.held_on[(node, generation)] = store.lease

    @precondition(lambda self: self.held)
    @rule(promote=st.integers(0, 2), pick=st.randoms())
    def prepare(self, promote: int, pick: random.Random) -> None:
        """A holder reads the counter and the pool and decides (its reads may be stale by the time it commits)."""
        node, generation = pick.choice(sorted(self.held))
        store = self.agents[node][0]
        counter, revision = store.counter()
        free = [s for s in store.pool() if s.claimed is None]
        spares = pick.sample(free, min(promote, len(free)))
        if counter != generation:
            body = {"action": "restart", "node": node, "reason": "the counter moved"}
            spares = []
        else:
            body = {"action": "promote_spare", "node": node, "generation": generation + 1,
                    "members": sorted([node, *(s.worker for s in spares)])}
        self.prepared[(node, generation)] = (body, spares, revision)

    @precondition(lambda self: any(k in self.held for k in self.prepared))
    @rule(fault=FAULTS, pick=st.randoms())
    def commit(self, fault: str | None, pick: random.Random) -> None:
        key = pick.choice(sorted(k for k in self.prepared if k in self.held))
        node, generation = key
        body, spares, revision = self.prepared.pop(key)
        store, flaky = self.agents[node]
        flaky.next_fault = fault
        outcome = store.commit(self.held.pop(key), generation, body, spares=spares, counter_revision=revision)
        if outcome is claims.Outcome.COMMITTED:
            assert generation not in self.believed, f"two agents committed generation {generation}"
            self.believed[generation] = (node, body)
            gone = self.exited & set(body.get("members", []))
            assert not gone, f"spares {gone} had left the pool before generation {generation}'s decision promoted them"

    @rule(pick=st.randoms())
    def a_spare_exits(self, pick: random.Random) -> None:
        """A free spare's process ended: its agent takes it out of the pool (its lease lives on)."""
        free = sorted(s.worker for s in self.owner.pool() if s.claimed is None)
        if free:
            worker = pick.choice(free)
            self.owner.unregister_spare(worker)
            self.exited.add(worker)
            self.owner.register_spare(f"s0.r{len(self.exited)}", ready_wall=self.clock.now)  # its replacement

    @rule(node=st.sampled_from(DECIDERS))
    def delayed_requests_arrive(self, node: str) -> None:
        self.agents[node][1].deliver()

    @precondition(lambda self: self.held)
    @rule(pick=st.randoms())
    def release(self, pick: random.Random) -> None:
        key = pick.choice(sorted(self.held))
        self.agents[key[0]][0].release_claim(self.held.pop(key))

    @rule(node=st.sampled_from(DECIDERS))
    def read_decision(self, node: str) -> None:
        store, _ = self.agents[node]
        for generation in range(FIRST, self._counter() + 1):
            decision = store.view(generation).decision
            if decision is not None:
                self.read_members.setdefault(generation, []).append(decision.get("members"))

    @precondition(lambda self: len(self.alive) > 1)
    @rule(node=st.sampled_from(DECIDERS))
    def kill(self, node: str) -> None:
        if node in self.alive:
            self.alive.discard(node)
            self.died_at[node] = self.clock.now
            self.held = {k: v for k, v in self.held.items() if k[0] != node}
            self.prepared = {k: v for k, v in self.prepared.items() if k[0] != node}
            self.agents[node][1].pending.clear()  # its requests in flight died with it

    @rule(node=st.sampled_from(DECIDERS))
    def cut_off_for_longer_than_the_ttl(self, node: str) -> None:
        store = self.agents[node][0]
        lease = store.lease
        if lease:
            self.model.expire_lease(lease)
            store.keep_pool_alive()  # the agent learns its lease is gone and takes a new one on its next write

    @rule(dt=st.floats(0.0, POOL_TTL_S + 1.0))
    def time_passes(self, dt: float) -> None:
        self.clock.now += dt
        for node in self.alive:
            self.agents[node][0].keep_pool_alive()
        self.owner.keep_pool_alive()

    # ------------------------------------------------------------ invariants
    @invariant()
    def one_decision_per_generation_never_rewritten(self) -> None:
        for generation in range(FIRST - 1, self._counter() + 1):
            entry = self._decision_entry(generation)
            if entry is None:
                assert generation not in self.first_seen, f"generation {generation}'s decision disappeared"
                continue
            assert entry.version == 1, f"generation {generation}'s decision was written {entry.version} times"
            assert self.first_seen.setdefault(generation, entry.value) == entry.value

    @invariant()
    def committed_exactly_when_in_the_store(self) -> None:
        for generation in range(FIRST - 1, self._counter() + 1):
            entry = self._decision_entry(generation)
            key = f"{LAUNCH}rec/g{generation}/decision"
            stored = verify(TOKEN, key, entry.value).value if entry is not None else None
            if generation in self.believed:
                node, body = self.believed[generation]
                assert stored is not None and stored["node"] == node and stored.get("members") == body.get("members")
            else:
                assert stored is None, f"generation {generation} was decided ({stored}) with no agent knowing"

    @invariant()
    def a_spare_is_promoted_once_and_its_entry_says_by_whom(self) -> None:
        promoted: dict[str, int] = {}
        for generation, (_, body) in self.believed.items():
            for worker in body.get("members", []):
                if worker.startswith("s0."):
                    assert worker not in promoted, f"spare {worker} promoted by two decisions"
                    promoted[worker] = generation + 1
        for spare in self.owner.pool():
            assert spare.claimed == promoted.get(spare.worker), (spare, promoted)

    @invariant()
    def a_held_claim_is_taken_from_no_one(self) -> None:
        """While its holder's lease lives, a claim stays as its holder wrote it: no other agent removes it."""
        for (node, generation), held in self.held.items():
            lease = self.held_on[(node, generation)]
            if self.agents[node][0].lease != lease:  # its lease expired: the claim went with it
                continue
            entry = self.model.get(held.key)
            assert entry is not None and entry.mod_revision == held.revision, \
                f"{node}'s claim on generation {generation} was removed or replaced while its lease lived"

    @invariant()
    def every_reader_reads_the_same_members(self) -> None:
        for generation, seen in self.read_members.items():
            assert all(m == seen[0] for m in seen), f"generation {generation} was read as {seen}"

    @invariant()
    def a_claim_never_outlives_its_holders_lease(self) -> None:
        for generation in range(FIRST - 1, self._counter() + 1):
            claim = self.agents[DECIDERS[0]][0].view(generation).claim
            if claim is not None and claim["node"] not in self.alive:
                assert self.clock.now - self.died_at[claim["node"]] <= POOL_TTL_S, \
                    f"a dead agent's claim on generation {generation} outlived its lease"


Decisions.TestCase.settings = settings(max_examples=300, stateful_step_count=50, deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow])
test_the_decision_protocol_under_faults = Decisions.TestCase


# ---------------------------------------------------------------- by table


def test_a_comparison_holds_as_etcd_evaluates_it() -> None:
    from resilient.coord.store import Entry

    entry = Entry("k", b"v", mod_revision=7, create_revision=3, version=2)
    assert Compare.absent("k").holds(None) and not Compare.absent("k").holds(entry)
    assert Compare.unchanged("k", 7).holds(entry) and not Compare.unchanged("k", 6).holds(entry)
    assert Compare.unchanged("k", 0).holds(None) and not Compare.unchanged("k", 7).holds(None)
    assert Compare("k", "version", 2).holds(entry) and Compare("k", "value", b"v").holds(entry)
    assert not Compare("k", "value", b"v").holds(None)


def test_why_a_commit_failed_is_read_from_its_own_transaction() -> None:
    from resilient.coord.store import Entry

    held = claims.Claim("c", "mine", revision=10)
    decision = claims.Decision("d", b"x", "dn", counter=Compare.unchanged("g", 4),
                               spares=(Compare.unchanged("p", 6),))

    def nonce(entry: Entry) -> str:
        return entry.value.decode()

    claim_ok = Entry("c", b"mine", 10, 10)
    cases = [
        ({"d": Entry("d", b"dn", 12, 12), "c": claim_ok}, claims.Outcome.COMMITTED),  # a retried commit landed
        ({"d": Entry("d", b"other", 12, 12), "c": None}, claims.Outcome.DECIDED),
        ({"d": None, "c": None}, claims.Outcome.CLAIM_LOST),
        ({"d": None, "c": Entry("c", b"theirs", 11, 11)}, claims.Outcome.CLAIM_LOST),
        ({"d": None, "c": claim_ok, "g": Entry("g", b"6", 9, 1, 5)}, claims.Outcome.COUNTER_MOVED),
        ({"d": None, "c": claim_ok, "g": Entry("g", b"5", 4, 1, 4), "p": None}, claims.Outcome.SPARES_MOVED),
    ]
    for entries, expected in cases:
        assert claims.why_not(entries, held, decision, nonce) is expected, entries


# ---------------------------------------------------------------- the model against etcd


def test_the_model_answers_as_a_real_etcd_does(etcd_server, etcd_run_id) -> None:
    """The same random transactions, leases and deletes on the model and on etcd: the same answers."""
    real = EtcdClient(EtcdConfig.from_url(etcd_server.url))
    clock = Clock()
    model = EtcdModel(clock)
    rng = random.Random(20261202)
    base = f"/resilient/{etcd_run_id}/"
    keys = [base + k for k in ("a", "b", "c")]
    leases = {"real": [real.lease_grant(30)], "model": [model.lease_grant(30)]}

    def shape(entry):
        return None if entry is None else (entry.value, entry.version, entry.create_revision == entry.mod_revision,
                                           bool(entry.lease))

    seen: dict[str, dict[str, int]] = {"real": {}, "model": {}}  # key -> mod revision, per side
    for step in range(120):
        key = rng.choice(keys)
        op = rng.choice(["put", "put_lease", "txn_absent", "txn_unchanged", "delete", "revoke"])
        answers = []
        for side, client in (("real", real), ("model", model)):
            if op == "revoke":
                if leases[side]:
                    client.lease_revoke(leases[side].pop())
                leases[side].append(client.lease_grant(30))
                answers.append("revoked")
                continue
            if op == "delete":
                answers.append(client.txn(Txn((), (Delete(key),), read=(key,))).succeeded)
            else:
                lease = leases[side][-1] if op == "put_lease" else 0
                if op == "txn_absent":
                    compare = (Compare.absent(key),)
                elif op == "txn_unchanged":
                    compare = (Compare.unchanged(key, seen[side].get(key, 0)),)
                else:
                    compare = ()
                result = client.txn(Txn(compare, (Put(key, f"v{step}".encode(), lease),), read=tuple(keys)))
                answers.append((result.succeeded, [shape(result.entries[k]) for k in keys]))
            for k in keys:
                entry = client.get(k)
                seen[side][k] = entry.mod_revision if entry is not None else 0
        assert answers[0] == answers[1], (step, op, answers)
    for side, client in (("real", real), ("model", model)):
        for lease in leases[side]:
            client.lease_revoke(lease)
    with pytest.raises(ControlStoreError):
        real.txn(Txn((), (Put(keys[0], b"x", 12345678),)))  # a lease that does not exist fails the request
    with pytest.raises(ControlStoreError):
        model.txn(Txn((), (Put(keys[0], b"x", 12345678),)))
