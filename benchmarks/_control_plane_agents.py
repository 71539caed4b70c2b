"""The simulated agents of the control-plane benchmark: each the store side of one real agent.

An :class:`Agent` is built from the classes the agent uses (its own etcd
client, watches, presence, recovery keys and rendezvous) and does what the
agent's other parts would make it do: its periodic writes, its watch loop's
passes (relay, decide, apply), a grow.  A :class:`Recorder` notes when each
agent of a process judged a lost node lost and read the decision.
``_control_plane_process.py`` hosts a share of them in one process.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

from resilient.agent.cluster import ClusterStore, collectors
from resilient.agent.cluster_watch import ClusterWatch
from resilient.agent.rendezvous import EtcdRendezvous, RendezvousTimeouts
from resilient.agent.shared import SharedFacts
from resilient.agent.timing_link import TimingLink
from resilient.coord import claims, keyspace
from resilient.coord.etcd import EtcdClient, EtcdControlStore
from resilient.coord.etcd_transport import EtcdConfig
from resilient.coord.keyspace import LaunchKeys, rendezvous_space, run_root
from resilient.coord.liveness import QUORUM
from resilient.coord.presence import Presence
from resilient.coord.proof import Seal, SignedStore
from resilient.coord.quarantine import FleetQuarantine
from resilient.coord.store import ControlStoreError
from resilient.coord.watch import PrefixWatch

RUN = "plane"
LAUNCH = "l1"
ROOT = run_root(RUN)
KEYS = LaunchKeys(LAUNCH)
"""The launch's keys, relative to the run's root."""
AT = LaunchKeys(LAUNCH, ROOT)
"""The launch's keys in etcd."""
OUTBOX_WINDOWS = 16
"""Windows in a node's timing outbox (``resilient.agent.windows.OUTBOX_WINDOWS``: with fast steps it is full)."""


def timing_record(node: str, rank: int, generation: int, world: int) -> dict[str, Any]:
    """A node's timing outbox as its agent publishes it, one rank, full (the shape of ``WindowTable.outbox``)."""
    window = {"n": 5, "step": 0.052311, "s": {"data": 0.001204, "compute": 0.03817, "comm": 0.00921,
                                              "optimizer": 0.00377, "checkpoint": 0.0}, "left": 4100,
              "world": world, "cpu": 0.000412}
    return {"node": node, "generation": generation,
            "windows": [[rank, {"w": i, **window}] for i in range(OUTBOX_WINDOWS)]}


class Stopped(ControlStoreError):
    pass


class KillableClient(EtcdClient):
    """An etcd client whose every request fails once its agent is stopped (the node lost)."""

    def __init__(self, config: EtcdConfig) -> None:
        super().__init__(config)
        self.dead = False

    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        if self.dead:
            raise Stopped("this simulated node is lost")
        return super().call(path, body)

    def stream(self, *args: Any, **kwargs: Any) -> Any:
        if self.dead:
            raise Stopped("this simulated node is lost")
        return super().stream(*args, **kwargs)


class Recorder:
    """What this process saw during a trial: when each agent judged the victim lost and read the decision."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.errors: list[str] = []
        self.start_retries = 0
        self.watching: str | None = None
        self.probers: frozenset[str] = frozenset()
        self.decision_key: str | None = None
        self.reset()

    def reset(self, victim: str | None = None, probers: frozenset[str] = frozenset(),
              decision_key: str | None = None) -> None:
        with self.lock:
            self.watching, self.probers, self.decision_key = victim, probers, decision_key
            self.judged_at: dict[str, float] = {}
            self.applied_at: dict[str, float] = {}
            self.accused_seen_at: dict[str, float] = {}
            self.decision_seen_at: dict[str, float] = {}
            self.decided: float | None = None

    def judged(self, agent: Agent, node: str) -> None:
        if node == self.watching:
            with self.lock:
                self.judged_at.setdefault(agent.node, time.time())

    def applied(self, agent: Agent) -> None:
        with self.lock:
            self.applied_at.setdefault(agent.node, time.time())

    def seen(self, agent: Agent) -> None:
        """A change reached ``agent``'s watch: note when the accusations and the decision first were in its copy
        (what the store delivered, before its watch loop's pass weighed them)."""
        victim, decision = self.watching, self.decision_key
        if (victim is None or agent.node in self.accused_seen_at) and (
                decision is None or agent.node in self.decision_seen_at):
            return
        entries = agent.watch.view().entries
        now = time.time()
        with self.lock:
            if victim is not None and agent.node not in self.accused_seen_at:
                accusers = sum(AT.suspect(victim, p) in entries for p in self.probers)
                if accusers >= min(QUORUM, len(self.probers)):
                    self.accused_seen_at[agent.node] = now
            if decision is not None and agent.node not in self.decision_seen_at and decision in entries:
                self.decision_seen_at[agent.node] = now


class Agent:
    """The store side of one agent: its own etcd client, watches, presence, recovery keys and rendezvous."""

    def __init__(self, config: EtcdConfig, token: str, members: int, recorder: Recorder, node: str,
                 rank: int | None) -> None:
        """``members``: member nodes in the whole run (the rendezvous' most); ``recorder``: where this process
        notes what its agents saw."""
        self.recorder = recorder
        self.members = members
        self.node = node
        self.rank = rank
        """This node's rank (one per member node); None for a spare node."""
        self.member = rank is not None
        """A member of the first round (joins the rounds)."""
        self.worker = f"{node}.{'w0' if rank is not None else 's0'}"
        self.client = KillableClient(config)
        self.events = 0
        self.watch = PrefixWatch(self.client, ROOT + keyspace.LAUNCH, on_change=self._event)
        self.timing_watch = (PrefixWatch(self.client, ROOT + keyspace.TIMING, on_change=self._timing_event)
                             if rank == 0 else None)
        """The scorer's alone (``SlownessWatch``: one agent scores every rank's windows)."""
        self.seal = Seal(token, ROOT)
        self.presence = Presence(self.client, AT, node, self._lost, self._error, watch=self.watch,
                                 seal=self.seal)
        self.control = EtcdControlStore(self.client, ROOT)
        self.signed = SignedStore(self.control, token)
        self.store = ClusterStore(self.signed, self.client, ROOT, KEYS, node, token,
                                  lease=lambda: self.presence.lease, live=self.presence.live, watch=self.watch)
        self.shared = SharedFacts(self.signed, LAUNCH, node, watch=self.watch, root=ROOT,
                                  timing_watch=(lambda: self.timing_watch) if rank == 0 else None)
        self.link = TimingLink("127.0.0.1", token, lambda key, problem: None) if rank is not None else None
        """A member's timing link: it sends its windows to the scorer's, and the scorer's receives them."""
        self.announced: int | None = None
        self.generation = 0
        self.rendezvous = EtcdRendezvous(self.client, rendezvous_space(RUN, LAUNCH), ROOT + keyspace.GENERATION, node,
                                         "127.0.0.1", min_nodes=1, max_nodes=members,
                                         timeouts=RendezvousTimeouts(join_s=600.0, last_call_s=30.0),
                                         lease=lambda: self.presence.lease, live=self.presence.live,
                                         on_error=self._error, seal=self.seal, floor=self._current)
        self.cluster: ClusterWatch | None = None
        self.woken = threading.Event()
        self.waiting_for: int | None = None
        """The generation whose group this node's member left (a peer was lost): to report, then decide."""
        self.reported = -1
        self.collecting = False
        """This agent collects the failed generation's reports (it passes every TICK_S until it decides)."""
        self.quarantine = FleetQuarantine(self.client)
        self.quarantine_watch = PrefixWatch(self.client, self.quarantine.keys_of(self.node)[0], on_error=self._error)
        """This node's quarantine record, followed as the agent's quarantine gate follows it."""

    def _current(self) -> int:
        """The launch's current generation as its signed recovery key says (the rendezvous' floor, as the agent's)."""
        found = self.signed.get(KEYS.current())
        return int(found["generation"]) if found is not None else 0

    def _event(self) -> None:
        self.events += 1
        self.recorder.seen(self)

    def _timing_event(self) -> None:
        self.events += 1

    def _wake(self) -> None:
        self.woken.set()

    def _error(self, error: str) -> None:
        if not self.client.dead:
            with self.recorder.lock:
                self.recorder.errors.append(f"{self.node}: {error}")

    def _started(self, start: Callable[[], object], what: str) -> None:
        """``start()``, tried 3 times: a store error here means this process stalled (its lease lapsed before its
        key was written, or its requests timed out: every started agent judges each new node here), which a real
        agent on a machine of its own does not."""
        for attempt in range(3):
            try:
                start()
                return
            except ControlStoreError as e:
                with self.recorder.lock:
                    self.recorder.start_retries += 1
                if attempt == 2:
                    raise
                self._error(f"start {what} again: {e}")

    def start(self) -> None:
        self._started(self.watch.start, "its watch")
        self.quarantine_watch.start()
        if self.timing_watch is not None:
            self.timing_watch.start()
        self._started(self.presence.start, "its presence")
        self.cluster = ClusterWatch(self.store, lambda: self.generation, self._wake, self._error)

    def _lost(self, node: str, why: str) -> None:
        self.recorder.judged(self, node)
        if self.rank is not None and not self.client.dead:
            self.waiting_for = self.generation  # its rank's collective failed: it left the group
            self._wake()

    def stop(self) -> None:
        """The node is lost: nothing more of it reaches the store."""
        self.client.dead = True

    def close(self) -> None:
        if self.cluster is not None:
            self.cluster.close()
        self.rendezvous.leave()
        self.presence.leave()
        self.watch.close()
        self.quarantine_watch.close()
        if self.timing_watch is not None:
            self.timing_watch.close()
        if self.link is not None:
            self.link.close()

    # --------------------------------------------------------------- periodic writes
    def publish_timing(self) -> None:
        """What the agent's peer watch does with its rank's newest windows each second (``PeerWatch``): the scorer
        announces its timing link once a generation and reads every node's windows; the others send theirs to
        it, or to the store while no scorer is announced."""
        assert self.rank is not None and self.link is not None
        if self.rank == 0:
            if self.announced != self.generation:
                self.shared.announce_scorer(self.link.address, self.generation)
                self.announced = self.generation
            self.link.follow(LAUNCH)
            self.link.records()
            self.shared.timing()
            return
        record = timing_record(self.node, self.rank, self.generation, self.members)
        scorer = self.shared.scorer()
        if scorer is None or not self.link.send(str(scorer.get("address")), LAUNCH, record):
            self.shared.publish_timing(record)

    def publish_status(self) -> None:
        """The status copy in the store (``StatusPublisher``: every 30 s while the phase and generation hold)."""
        snapshot = {"run_id": RUN, "node": self.node, "phase": "running", "generation": self.generation,
                    "ranks": {} if self.rank is None else {str(self.rank): {"section": "compute", "step": 4100}},
                    "padding": "x" * 1500}  # the rest of a snapshot: timeouts, restore, recovery, slowness
        self.control.put(keyspace.status(self.node), json.dumps(snapshot).encode())

    def ask_waiting(self) -> None:
        self.rendezvous.num_nodes_waiting()

    def join_round(self) -> float:
        """Join the next rendezvous round; returns when this node has its place (wall clock)."""
        assignment = self.rendezvous.next()
        self.generation = assignment.generation
        return time.time()

    def read_quarantine(self) -> None:
        """The agent's quarantine check: the record as its watch holds it (a request only when a record stands)."""
        self.quarantine.standing_in(self.node, self.quarantine_watch.view().entries)

    # --------------------------------------------------------------- the watch loop's pass
    def tick(self) -> None:
        """What the agent's watch loop does with its snapshot: relay, decide, apply."""
        assert self.cluster is not None
        snap = self.cluster.snapshot
        if snap is None or self.client.dead:
            return
        view = snap.view
        if view.decision is not None:
            self.recorder.applied(self)
            body = view.decision
            mine = [m for m in body["members"] if m["node"] == self.node]
            self.generation = int(body["generation"])
            self.waiting_for = None
            self.collecting = False
            if mine:
                self.rank = int(mine[0]["new_rank"])
                self.worker = str(mine[0]["worker_id"])
                self.store.publish_node(self.generation, {self.rank: self.worker}, world_size=int(body["world_size"]),
                                        store="127.0.0.1:1", opted_in=True, batch=None)
            return
        if self.waiting_for != self.generation or self.rank is None:
            return
        if self.reported != self.generation:
            self.reported = self.generation
            self.store.report(self.generation, "waiting", self.worker, {"rank": self.rank, "step": 7})
            return
        turns = collectors(view.failed_by, snap.running & snap.live, self.node)
        self.collecting = not turns or turns[0] == self.node
        if view.claim is not None or not self.collecting:
            return  # the generation's collector reads the nodes' and survivors' reports and decides
        full = self.store.reports(view)
        members = full.members()
        accounted = set(full.waiting) | {w for _, (w, n) in members.items() if n not in snap.live}
        if not members or {w for w, _ in members.values()} - accounted:
            return
        self.decide(snap, full)

    def decide(self, snap: Any, view: Any) -> None:
        """The collector's decision: promote a pool spare into the lost node's rank, in one transaction."""
        held = self.store.claim(view.generation, "decide")
        if held is None:
            return
        pool = [s for s in snap.pool if s.claimed is None and s.node in snap.live]
        members = view.members()
        lost = {r: (w, n) for r, (w, n) in members.items() if n not in snap.live}
        if not pool or len(lost) != 1:
            self.store.release_claim(held)
            return
        spare = pool[0]
        [(rank, _)] = lost.items()
        _, counter_revision = self.store.counter()
        nxt = view.generation + 1
        body = {"action": "promote_spare", "reason": "a node was lost", "node": self.node, "generation": nxt,
                "world_size": len(members), "step": 7,
                "members": [{"worker_id": w, "node": n, "new_rank": r, "old_rank": r}
                            for r, (w, n) in sorted(members.items()) if r != rank]
                + [{"worker_id": spare.worker, "node": spare.node, "new_rank": rank, "old_rank": None}],
                "source_rank": 0, "store": "127.0.0.1:1", "incident": None,
                "promotions": [{"rank": rank, "spare": spare.worker, "node": spare.node}], "dropped": []}
        sent = time.time()  # when the commit went out (after it returns, this process may be slow to notice)
        outcome = self.store.commit(held, view.generation, body, spares=[spare], counter_revision=counter_revision)
        if outcome is claims.Outcome.COMMITTED:
            with self.recorder.lock:
                self.recorder.decided = sent
        else:
            self.store.release_claim(held)

    def grow(self) -> float | None:
        """Commit a grow onto a pool spare (the agent of rank 0 does); returns when its commit was sent, or None."""
        assert self.cluster is not None
        snap = self.cluster.snapshot
        if snap is None:
            return None
        view = self.store.reports(snap.view)
        held = self.store.claim(view.generation, "grow")
        if held is None:
            return None
        pool = [s for s in snap.pool if s.claimed is None and s.node in snap.live]
        members = view.members()
        _, counter_revision = self.store.counter()
        spare = pool[0]
        nxt = view.generation + 1
        body = {"action": "grow", "reason": "grow onto a spare", "node": self.node, "generation": nxt,
                "world_size": len(members) + 1, "step": 9, "at_step": 9,
                "members": [{"worker_id": w, "node": n, "new_rank": r, "old_rank": r}
                            for r, (w, n) in sorted(members.items())]
                + [{"worker_id": spare.worker, "node": spare.node, "new_rank": len(members), "old_rank": None}],
                "source_rank": 0, "store": "127.0.0.1:1", "incident": None,
                "promotions": [{"rank": len(members), "spare": spare.worker, "node": spare.node}], "dropped": []}
        sent = time.time()
        outcome = self.store.commit(held, view.generation, body, spares=[spare], counter_revision=counter_revision)
        if outcome is claims.Outcome.COMMITTED:
            return sent
        self.store.release_claim(held)
        return None
