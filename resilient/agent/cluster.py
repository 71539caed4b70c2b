"""In-process recovery across machines: what the agents of a launch share in etcd, and how they agree.

On one machine the agent sees every member and decides alone
(:mod:`resilient.agent.inproc`).  On many, each agent sees only its own
processes, so what the decision needs lives in the launch's key space
under ``rec/`` (every value signed with the run token):

* ``rec/current``: the generation the launch runs now;
* ``rec/g<G>/lost/<worker>``: a member whose process died (written by its
  own agent);
* ``rec/g<G>/failed``: created once, by the first agent that reports a
  loss or relays a wait in ``G``, naming it: every agent's watch learns
  that ``G`` failed (one event each), and that agent is the generation's
  collector (:func:`collectors`);
* under ``reports/<launch>/g<G>/``, outside the launch's watched keys, what
  every node writes in every generation: in a launch of N nodes, N agents
  told of N writes would be N² watch events a generation.  Read whole by
  the one agent that needs them (:meth:`ClusterStore.reports`): the
  collector when it decides, the node holding rank 0 when it grows, a
  spare node taking a lost node's place.

  * ``node/<node>``: the members a node holds in generation ``G`` (rank
    -> worker id), the address of its recovery store, whether every one
    of them opted in (``run.attempt()``), and the batch plan they
    reported;
  * ``waiting/<worker>``: a survivor that left the failed group and waits
    (relayed by its agent from its report, with its step and position);
* ``rec/g<G>/claim``: created where absent, on the claiming agent's lease,
  by the one agent that decides what follows ``G`` (after a failure, or
  to grow): it goes with its holder's lease, and is released only by its
  holder (compared on its revision);
* ``rec/g<G>/decision``: that decision, with the members of generation
  ``G + 1`` (worker, node, old and new rank), the source rank and the
  store the new group forms on;
* ``pool/<worker>``: the spare pool, one key per warm spare on a lease its
  agent keeps alive (a spare whose node dies leaves the pool with its
  lease).

A decision is committed in one transaction with ``rec/current``, the
run's generation counter and the pool keys of the spares it promotes
(:mod:`resilient.coord.claims`): two decisions for one generation, or one
spare promoted twice, cannot both commit.

Each agent then carries out its own part of a decision: its lost members
retire, its spares named in it are promoted, its survivors get their new
ranks, and it publishes their assignments on its own recovery store
(:mod:`resilient.elastic.reform`); the group forms on the deciding
agent's store.  :class:`~resilient.agent.cluster_watch.ClusterWatch`
follows these keys through the agent's etcd watch, so the watch loop never
waits on the network to learn of a decision; writes that decide are made
on the watch loop (a failure is being handled there anyway).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from ..coord import claims
from ..coord.keyspace import GENERATION, LaunchKeys
from ..coord.proof import SignedStore, sign, verify
from ..coord.store import ControlStoreError, Entry
from ..coord.txn import Compare, Put
from ..coord.watch import PrefixWatch

if TYPE_CHECKING:
    from .incidents import Incident
    from .policy import Failure

POOL_TTL_S = 5
"""Seconds a spare's pool key, or a generation's claim, outlives its agent's last renewal."""


@dataclass(frozen=True)
class GenerationView:
    """What the launch's store holds about one generation."""

    generation: int
    nodes: Mapping[str, dict[str, Any]] = field(default_factory=dict)
    """The nodes' members: read from the store (:meth:`ClusterStore.reports`), never held by the watch."""
    waiting: Mapping[str, dict[str, Any]] = field(default_factory=dict)
    """The survivors' waits: read from the store likewise."""
    lost: Mapping[str, dict[str, Any]] = field(default_factory=dict)
    claim: dict[str, Any] | None = None
    decision: dict[str, Any] | None = None
    failed_by: str | None = None
    """The node that marked the generation failed (its collector), or None."""

    def failing(self) -> bool:
        """A failure of this generation is in the store: a member lost, or a survivor waiting."""
        return bool(self.lost or self.failed_by is not None or self.waiting)

    def members(self) -> dict[int, tuple[str, str]]:
        """rank -> (worker id, node) of every member the nodes published."""
        found: dict[int, tuple[str, str]] = {}
        for node, entry in self.nodes.items():
            for rank, worker in (entry.get("ranks") or {}).items():
                found[int(rank)] = (str(worker), node)
        return found

    def world_size(self) -> int | None:
        """The generation's world size, as its nodes declared it (None before any did)."""
        sizes = {int(e["world_size"]) for e in self.nodes.values() if e.get("world_size")}
        return max(sizes) if sizes else None

    def complete(self) -> bool:
        """Every rank of the world has a published member."""
        world = self.world_size()
        return world is not None and sorted(self.members()) == list(range(world))


def collectors(first: str | None, running: Iterable[str], me: str) -> list[str]:
    """The nodes that read a failed generation's reports and decide, in turn: the node that marked it failed
    (``first``), then the other nodes by name, of those whose presence key says running (``me`` always counts;
    a node judged lost, or alive but cut off from the store, has no turn: the next one collects at once).  The
    first collects; each next one also does once it has answered the failure a settle time more (the ones
    before it may be stuck), so that a hold for a repair adds one reader per settle time.  Only nodes answering
    the failure decide."""
    alive = set(running) | {me}
    head = [first] if first is not None and first in alive else []
    return head + sorted(alive - set(head))


IN_PROCESS_ACTIONS = ("retry_in_place", "promote_spare", "shrink")
"""The decisions that answer a failure in process (a grow answers none)."""


def folded_at_step(decisions: Iterable[Mapping[str, Any]], step: int) -> int:
    """Failures folded into a later decision at ``step``, by whichever agents decided: every in-process decision
    at ``step`` after the first answered a failure that came while the one before it formed."""
    return max(0, sum(1 for d in decisions if d.get("action") in IN_PROCESS_ACTIONS and d.get("step") == step) - 1)


@dataclass(frozen=True)
class PoolEntry:
    """One spare of the pool, with the revision a claim must compare against."""

    worker: str
    node: str
    ready_wall: float
    revision: int
    claimed: int | None
    """The generation that took it, or None while it is free."""
    lease: int = 0
    """Its agent's lease (a claim keeps the key on it)."""


class ClusterStore:
    """The launch's recovery keys, read and written by this node's agent (synchronous etcd calls)."""

    def __init__(self, signed: SignedStore, client: Any, root: str, keys: LaunchKeys, node: str,
                 token: str, *, lease: Callable[[], int] | None = None,
                 live: Callable[[], frozenset[str]] | None = None, watch: PrefixWatch | None = None) -> None:
        """``keys``: the launch's keys, relative to ``root``.  ``lease``: the agent's lease, kept alive by its
        owner (the node's presence); without one the store takes a lease of its own and renews it in
        :meth:`keep_pool_alive`.  ``live``: the nodes the presence judges alive (:mod:`resilient.coord.liveness`);
        without it, the nodes whose presence key is there.  ``watch``: the agent's watch of the run's launches,
        which :class:`~resilient.agent.cluster_watch.ClusterWatch` reads."""
        self.signed = signed
        self.client = client
        self.root = root
        """The control store's own prefix (``/resilient/<run>/``), for the writes that need a lease."""
        self.keys = keys
        self.reports_keys = keys.reports()
        """The nodes' reports and the survivors' waits, outside the launch's watched keys (see the module doc)."""
        self.node = node
        self._token = token
        self._lease = 0
        self._lease_source = lease
        self._live = live
        self.watch = watch
        self._lease_lock = threading.Lock()
        self._marked: set[int] = set()
        """Generations this agent marked failed (or found marked)."""
        self.registered: set[str] = set()
        """Spares of this node in the pool under the current lease."""

    @property
    def lease(self) -> int:
        """This agent's lease, which its claims and pool keys live on (0 before the first or after it expired)."""
        with self._lease_lock:
            return self._lease

    # ------------------------------------------------------------ generations
    def _put(self, key: str, value: dict[str, Any]) -> None:
        self.signed.store.put(key, sign(self._token, key, value))

    def publish_node(self, generation: int, ranks: Mapping[int, str], *, world_size: int, store: str,
                     opted_in: bool, batch: dict[str, Any] | None,
                     replicas: list[list[int]] | None = None) -> None:
        """``replicas``: the ranks holding identical shards of a sharded run (None: unsharded)."""
        self._put(self.reports_keys.node(generation, self.node),
                  {"ranks": {str(r): w for r, w in sorted(ranks.items())}, "world_size": world_size, "store": store,
                   "opted_in": opted_in, "batch": batch, "replicas": replicas})

    def set_current(self, generation: int) -> None:
        self._put(self.keys.current(), {"generation": generation, "node": self.node})

    def current(self) -> int | None:
        found = self.signed.get(self.keys.current())
        return int(found["generation"]) if found is not None else None

    def report(self, generation: int, kind: Literal["lost", "waiting"], worker: str, body: Mapping[str, Any]) -> None:
        """``kind``: ``lost`` (this node's member died) or ``waiting`` (it left the failed group).  This agent's
        first report in ``generation`` also marks it failed, unless a peer did first."""
        key = (self.reports_keys.waiting(generation, worker) if kind == "waiting"
               else self.keys.lost(generation, worker))
        self._put(key, {**body, "node": self.node})
        if generation not in self._marked:
            self.signed.put_if_absent(self.keys.failed(generation), {"node": self.node, "at": time.time()})
            self._marked.add(generation)

    def reports(self, view: GenerationView) -> GenerationView:
        """``view`` with its nodes' members and its survivors' waits, read from the store at one revision."""
        nodes: dict[str, dict[str, Any]] = {}
        waiting: dict[str, dict[str, Any]] = {}
        for key, value in self.signed.get_prefix(self.reports_keys.generation(view.generation)).items():
            found = self.reports_keys.report_of(view.generation, key)
            if found is not None:
                (nodes if found[0] == "node" else waiting)[found[1]] = value
        return replace(view, nodes=nodes, waiting=waiting)

    def view(self, generation: int) -> GenerationView:
        """What the store holds about ``generation``, read now (the nodes and the survivors' waits included)."""
        return self.reports(self.view_of(generation, self.signed.get_prefix(self.keys.recovery_of(generation))))

    def view_of(self, generation: int, values: Mapping[str, dict[str, Any]]) -> GenerationView:
        """Generation ``generation`` in verified ``values`` (key -> value, keys under the control store's prefix;
        keys of other generations are ignored): its nodes and waits are not among them (:meth:`reports`)."""
        lost: dict[str, dict[str, Any]] = {}
        claim = decision = None
        failed_by: str | None = None
        for key, value in values.items():
            found = self.keys.recovery_key(generation, key)
            if found is None:
                continue
            kind, worker = found
            if kind == "lost":
                lost[worker] = value
            elif kind == "claim":
                claim = value
            elif kind == "decision":
                decision = value
            else:
                failed_by = str(value.get("node") or "")
        return GenerationView(generation, {}, {}, lost, claim, decision, failed_by)

    def live_nodes(self) -> set[str]:
        """Nodes judged alive (:mod:`resilient.coord.presence`): by the presence's evidence, or by their keys."""
        if self._live is not None:
            return set(self._live())
        return self.live_of(self.signed.store.get_prefix(self.keys.nodes()))

    def live_of(self, entries: Iterable[Entry]) -> set[str]:
        """The nodes alive among presence keys ``entries`` (the presence's judgement when the store has one)."""
        if self._live is not None:
            return set(self._live())
        return self.running_of(entries)

    def running_of(self, entries: Iterable[Entry]) -> set[str]:
        """The nodes whose presence key among ``entries`` says running: alive and reaching the store (a node its
        peers vouch for while its key is gone is alive, but cut off from the store)."""
        found = set()
        for entry in entries:
            value = self.signed.seal.open(entry)  # a forged presence key is nobody
            if value is None:
                continue
            node = self.keys.node_of(entry.key)
            if value.get("state") == "running" and node is not None:
                found.add(node)
        return found

    def _nonce_of(self, key: str) -> claims.NonceOf:
        def nonce_of(entry: Entry) -> str | None:
            value = verify(self._token, key, entry.value).value
            return str(value.get("nonce")) if value is not None and value.get("nonce") else None
        return nonce_of

    def claim(self, generation: int, what: str) -> claims.Claim | None:
        """Take the right to decide what follows ``generation``, on this agent's lease: exactly one caller gets
        it, and it goes with the lease when this agent dies (:mod:`resilient.coord.claims`)."""
        key = self.keys.claim(generation)
        nonce = secrets.token_hex(8)  # a retried create that did land reads back as ours, not as a peer's
        value = sign(self._token, key, {"node": self.node, "what": what, "at": time.time(), "nonce": nonce})
        return claims.claim(self.client, self.root + key, value, nonce, self._agent_lease(), self._nonce_of(key))

    def release_claim(self, held: claims.Claim) -> bool:
        """Give the right back (the ladder said wait, or deciding failed), only if it is still ours."""
        return claims.release(self.client, held)

    def clear_stale_claim(self, generation: int) -> bool:
        """Delete ``generation``'s claim if it names this agent, which holds no claim between its decisions: one
        whose create was in doubt and landed late.  Left alone, it would stall the generation for as long as
        this agent keeps its lease."""
        key = self.keys.claim(generation)
        entry = self.signed.store.get(key)
        value = verify(self._token, key, entry.value).value if entry is not None else None
        if entry is None or value is None or value.get("node") != self.node:
            return False
        return claims.release(self.client, claims.Claim(self.root + key, str(value.get("nonce")),
                                                         entry.mod_revision))

    def counter(self) -> tuple[int, int]:
        """The run's generation counter and the revision it was written at (0, 0 before any generation).  A
        forged counter (reported) reads as the launch's current generation: nothing signed moved it since."""
        entry, value = self.signed.get_entry(GENERATION)
        if entry is None:
            return 0, 0
        if value is not None:
            return int(value["generation"]), entry.mod_revision
        return self.current() or 0, entry.mod_revision

    def commit(self, held: claims.Claim, generation: int, decision: Mapping[str, Any], *,
               spares: Sequence[PoolEntry] = (), counter_revision: int | None = None) -> claims.Outcome:
        """Publish the decision that follows ``generation`` under ``held``, in one transaction.

        A decision that goes on in process (its body names the next
        ``generation``) also moves the launch's current generation and the
        run's counter to it (compared against ``counter_revision``, the
        counter's revision when it read ``generation``), and marks each of
        ``spares`` taken by it (compared against the revision the pool showed).
        """
        key = self.keys.decision(generation)
        nonce = secrets.token_hex(8)
        body = {**decision, "nonce": nonce}
        writes: list[Put] = []
        guards: list[Compare] = []
        counter = None
        if decision.get("generation"):
            following = int(decision["generation"])
            current = self.keys.current()
            writes.append(Put(self.root + current, sign(self._token, current, {"generation": following,
                                                                               "node": self.node})))
            assert counter_revision is not None, "a decision that moves the generation compares the counter"
            counter = Compare.unchanged(self.root + GENERATION, counter_revision)
            writes.append(Put(self.root + GENERATION, sign(self._token, GENERATION, {"generation": following})))
            for spare in spares:
                pool_key = self.keys.spare(spare.worker)
                value = {"worker": spare.worker, "node": spare.node, "ready_wall": spare.ready_wall,
                         "claimed": following, "lease": spare.lease}
                writes.append(Put(self.root + pool_key, sign(self._token, pool_key, value), spare.lease))
                guards.append(Compare.unchanged(self.root + pool_key, spare.revision))
        else:
            assert not spares, "only a decision that goes on in process promotes spares"
        return claims.commit(self.client, held, claims.Decision(
            self.root + key, sign(self._token, key, body), nonce, tuple(writes), counter, tuple(guards)),
            self._nonce_of(key))

    # ------------------------------------------------------------ the pool
    def _agent_lease(self) -> int:
        if self._lease_source is not None:
            lease = self._lease_source()
            with self._lease_lock:
                if lease != self._lease:  # the owner's lease expired and was replaced: the spares' keys went
                    self._lease = lease
                    self.registered.clear()
                return lease
        with self._lease_lock:
            if not self._lease:
                self._lease = self.client.lease_grant(POOL_TTL_S)
            return self._lease

    def register_spare(self, worker: str, ready_wall: float) -> None:
        """Put a warm spare in the pool, on this agent's lease (it leaves the pool when the agent dies)."""
        key = self.keys.spare(worker)
        lease = self._agent_lease()
        value = {"worker": worker, "node": self.node, "ready_wall": ready_wall, "claimed": None, "lease": lease}
        self.client.put(self.root + key, sign(self._token, key, value), lease=lease)
        with self._lease_lock:
            self.registered.add(worker)

    def unregister_spare(self, worker: str) -> None:
        with self._lease_lock:
            self.registered.discard(worker)
        self.signed.store.delete(self.keys.spare(worker))

    def keep_pool_alive(self) -> None:
        """Renew this store's own lease (a request), or notice that its owner's was replaced (none)."""
        if self._lease_source is not None:
            self._agent_lease()
            return
        with self._lease_lock:
            lease = self._lease
        if lease and self.client.lease_keepalive(lease) <= 0:
            with self._lease_lock:  # expired in an outage: its keys are gone, so register the spares again
                self._lease = 0
                self.registered.clear()

    def pool(self) -> list[PoolEntry]:
        return self.pool_of(self.signed.store.get_prefix(self.keys.pool()))

    def pool_of(self, entries: Iterable[Entry]) -> list[PoolEntry]:
        found = []
        for entry in entries:
            value = verify(self._token, entry.key, entry.value).value  # a forged spare is never promoted
            if value is None or not entry.key.startswith(self.keys.pool()):
                continue
            claimed = value.get("claimed")
            found.append(PoolEntry(str(value["worker"]), str(value["node"]), float(value["ready_wall"]),
                                   entry.mod_revision, int(claimed) if claimed is not None else None,
                                   int(value.get("lease") or 0)))
        return found

    def close(self) -> None:
        with self._lease_lock:
            lease, self._lease = self._lease, 0
            spares, self.registered = sorted(self.registered), set()
        if self._lease_source is not None:  # the lease is its owner's: take this launch's spares out by hand
            for worker in spares:
                try:
                    self.signed.store.delete(self.keys.spare(worker))
                except ControlStoreError:
                    pass  # the store is out: they go with the owner's lease when the agent ends
            return
        if lease:
            try:
                self.client.lease_revoke(lease)
            except ControlStoreError:
                pass


@dataclass
class Involvement:
    """This node took part in a failure of one generation: a member died here, or a survivor here waits."""

    since: float
    failure: Failure | None = None
    incident: Incident | None = None
    detected_at: float = 0.0
    last_progress_at: float = 0.0
    wait_since: float | None = None
    """When the ladder first said wait for repair (it is asked again every tick until it acts)."""
