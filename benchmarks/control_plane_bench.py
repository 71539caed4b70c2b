"""The control plane at scale, by simulation: N agents' store clients on one real etcd, N = 16 ... 1,024.

    python benchmarks/control_plane_bench.py                  # writes benchmarks/results/control_plane_bench.{json,md,png}
    python benchmarks/control_plane_bench.py --agents 16,64   # a quick look

Each simulated agent is the store side of a real agent, in this one process:
its own etcd client, the watch of the run's launches (``PrefixWatch``; the
scorer, the agent of rank 0, also the watch of every node's timing
windows), its ``Presence`` (a presence key on a lease
renewed every second, the peers judged from the accusations in the watch),
its ``ClusterStore`` and ``ClusterWatch`` (the recovery keys, the pool, the
decision's claim and one-transaction commit).  What a real agent's other
parts write is written as they write it: every second the timing windows of
its rank (its outbox, full: 16 windows, as with steps of a few tens of
milliseconds; slower steps publish less often); every second the
question the peer watch asks of the rendezvous (nodes waiting to join?), on
the agent's real ``EtcdRendezvous``; every 5 s the quarantine read.  The
workers are simulated: each member node holds one rank; a few spare nodes
each hold one warm spare in the pool.  Probes are simulated too: a probe
server and three probers per agent, at 0.15 s, would be 20,000 messages a
second in this one process at N = 1,024; a lost node's probers write their
accusations themselves, as their probers would, ``SILENCE_S`` after the
loss.

Per N: a fresh etcd; the agents started and settled; the member nodes
form the run's first rendezvous round (every member's ``EtcdRendezvous.next``
at once: the time until each has its place, p50 and p99); then

* **steady state**, ``--window`` seconds: requests begun on etcd (its
  ``grpc_server_started_total``) in total and per agent, by method; watch
  events delivered per agent per second; etcd's CPU (cores) and resident
  memory; this simulator's CPU (cores: where it is near 2, the latencies
  below are this machine's limit, not the protocol's);
* **node loss with a ready spare** (``--trials`` times): a member node's
  agent stops (its client fails every request from then on, its lease
  lapses); its probers accuse it, at once when it was killed (its port
  refuses) and ``SILENCE_S`` later when it went silent (powered off, its
  traffic dropped), the trials alternating; every agent's presence judges
  it lost;
  the survivors report waiting (as their workers would, their collectives
  failed; each wait outside the watched keys, the generation marked failed
  once); the generation's collector (the node that marked it) reads the
  nodes' members and the waits, takes the generation's claim and commits
  the promotion of a pool spare in one transaction; every agent applies it
  (reads it in its watch) and the members publish their next generation.
  Times from the loss to: the node judged lost by every agent (p50, p99),
  the decision committed, the decision read by every agent (p50, p99);
* **a grow**: the agent holding rank 0 commits a grow onto a pool spare; the
  time until every agent read it (p50, p99);
* **a restart's round**: every live member node joins the next round at
  once (the lost nodes, judged lost, are not waited for): the time until
  each has its place (p50, p99).

Targets: steady load at most 3 requests per agent per second, flat in N;
node loss to the decision applied by every agent, p99 at most 1 s at 1,024
agents.  There is no peer in this
run: torchrun's agents meet in etcd only at a rendezvous.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from _provenance import commit, load_now, uncommitted_code_changes
from store_load_bench import counters

from resilient.agent.cluster import ClusterStore, collectors
from resilient.agent.cluster_watch import ClusterWatch
from resilient.agent.rendezvous import EtcdRendezvous, RendezvousTimeouts
from resilient.chaos.cluster import Etcd
from resilient.coord import claims
from resilient.coord.etcd import EtcdClient
from resilient.coord.etcd_transport import EtcdConfig
from resilient.coord.launch import launch_prefix
from resilient.coord.liveness import PROBERS, SILENCE_S, probers_of
from resilient.coord.presence import Presence
from resilient.coord.proof import SignedStore
from resilient.coord.quarantine import FleetQuarantine
from resilient.coord.rendezvous import rendezvous_space
from resilient.coord.store import ControlStoreError, EtcdControlStore, StoreRequestError
from resilient.coord.watch import PrefixWatch

HERE = Path(__file__).resolve().parent
RUN = "plane"
LAUNCH = "l1"
ROOT = f"/resilient/{RUN}/"
PREFIX = launch_prefix(LAUNCH)
OUTBOX_WINDOWS = 16
"""Windows in a node's timing outbox (``resilient.agent.windows.OUTBOX_WINDOWS``: with fast steps it is full)."""


def timing_record(node: str, rank: int, generation: int, world: int) -> dict[str, Any]:
    """A node's timing outbox as its agent publishes it, one rank, full (the shape of ``WindowTable.outbox``)."""
    window = {"n": 5, "step": 0.052311, "s": {"data": 0.001204, "compute": 0.03817, "comm": 0.00921,
                                              "optimizer": 0.00377, "checkpoint": 0.0}, "left": 4100,
              "world": world, "cpu": 0.000412}
    return {"node": node, "generation": generation,
            "windows": [[rank, {"w": i, **window}] for i in range(OUTBOX_WINDOWS)]}
TICK_S = 0.1
"""The agents' watch loop interval (``--monitor-interval``): how often a woken agent reads its snapshot."""


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


class Agent:
    """The store side of one agent (see the module doc)."""

    def __init__(self, bench: Bench, node: str, rank: int | None) -> None:
        self.bench = bench
        self.node = node
        self.rank = rank
        """This node's rank (one per member node); None for a spare node."""
        self.worker = f"{node}.{'w0' if rank is not None else 's0'}"
        self.client = KillableClient(bench.config)
        self.events = 0
        self.watch = PrefixWatch(self.client, ROOT + "launch", on_change=self._event)
        self.timing_watch = (PrefixWatch(self.client, ROOT + "timing/", on_change=self._event)
                             if rank == 0 else None)
        """The scorer's alone (``SlownessWatch``: one agent scores every rank's windows)."""
        self.presence = Presence(self.client, ROOT + PREFIX, node, self._lost, self._error, watch=self.watch)
        self.signed = SignedStore(EtcdControlStore(self.client, ROOT), bench.token)
        self.store = ClusterStore(self.signed, self.client, ROOT, PREFIX, node, bench.token,
                                  lease=lambda: self.presence.lease, live=self.presence.live, watch=self.watch)
        self.generation = 0
        self.rendezvous = EtcdRendezvous(self.client, rendezvous_space(RUN, LAUNCH), ROOT + "generation", node,
                                         "127.0.0.1", min_nodes=1, max_nodes=bench.members,
                                         timeouts=RendezvousTimeouts(join_s=600.0, last_call_s=30.0),
                                         lease=lambda: self.presence.lease, live=self.presence.live,
                                         on_error=self._error)
        self.cluster: ClusterWatch | None = None
        self.woken = threading.Event()
        self.waiting_for: int | None = None
        """The generation whose group this node's member left (a peer was lost): to report, then decide."""
        self.reported = -1
        self.collecting = False
        """This agent collects the failed generation's reports (it passes every TICK_S until it decides)."""
        self.quarantine = FleetQuarantine(self.client)

    def _event(self) -> None:
        self.events += 1

    def _error(self, error: str) -> None:
        if not self.client.dead:
            self.bench.errors.append(f"{self.node}: {error}")

    def start(self) -> None:
        self.watch.start()
        if self.timing_watch is not None:
            self.timing_watch.start()
        for attempt in range(3):
            try:
                self.presence.start()
                break
            except StoreRequestError as e:
                # Its lease lapsed before its key was written: this process stalled past the lease's TTL (every
                # started agent judges each new node here), which a real agent on a machine of its own does not.
                self.bench.start_retries += 1
                if attempt == 2:
                    raise
                self.bench.errors.append(f"{self.node}: start again: {e}")
        self.cluster = ClusterWatch(self.store, lambda: self.generation, self.woken.set, self._error)

    def _lost(self, node: str, why: str) -> None:
        self.bench.judged(self, node)
        if self.rank is not None and not self.client.dead:
            self.waiting_for = self.generation  # its rank's collective failed: it left the group
            self.woken.set()

    def stop(self) -> None:
        """The node is lost: nothing more of it reaches the store."""
        self.client.dead = True

    def close(self) -> None:
        if self.cluster is not None:
            self.cluster.close()
        self.rendezvous.leave()
        self.presence.leave()
        self.watch.close()
        if self.timing_watch is not None:
            self.timing_watch.close()

    # --------------------------------------------------------------- periodic writes
    def publish_timing(self) -> None:
        assert self.rank is not None
        self.signed.put(f"timing/{LAUNCH}/{self.node}",
                        timing_record(self.node, self.rank, self.generation, self.bench.members))

    def ask_waiting(self) -> None:
        self.rendezvous.num_nodes_waiting()

    def join_round(self) -> float:
        """Join the next rendezvous round; returns when this node has its place (its time)."""
        assignment = self.rendezvous.next()
        self.generation = assignment.generation
        return time.monotonic()

    def read_quarantine(self) -> None:
        self.quarantine.standing_and_offences(self.node)

    # --------------------------------------------------------------- the watch loop's pass
    def tick(self) -> None:
        """What the agent's watch loop does with its snapshot: relay, decide, apply."""
        assert self.cluster is not None
        snap = self.cluster.snapshot
        if snap is None or self.client.dead:
            return
        view = snap.view
        if view.decision is not None:
            self.bench.applied(self, view.generation, view.decision)
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
        self.bench.decide(self, snap, full)


class Bench:
    def __init__(self, url: str, token: str) -> None:
        self.config = EtcdConfig.from_url(url)
        self.token = token
        self.errors: list[str] = []
        self.lock = threading.Lock()
        self.marks: dict[str, Any] = {}
        self.judged_at: dict[str, float] = {}
        self.applied_at: dict[str, float] = {}
        self.watching: str | None = None
        self.members = 0
        self.start_retries = 0

    def judged(self, agent: Agent, node: str) -> None:
        if node == self.watching:
            with self.lock:
                self.judged_at.setdefault(agent.node, time.monotonic())

    def applied(self, agent: Agent, generation: int, decision: dict[str, Any]) -> None:
        with self.lock:
            self.applied_at.setdefault(agent.node, time.monotonic())

    def decide(self, agent: Agent, snap: Any, view: Any) -> None:
        held = agent.store.claim(view.generation, "decide")
        if held is None:
            return
        pool = [s for s in snap.pool if s.claimed is None and s.node in snap.live]
        members = view.members()
        lost = {r: (w, n) for r, (w, n) in members.items() if n not in snap.live}
        if not pool or len(lost) != 1:
            agent.store.release_claim(held)
            return
        spare = pool[0]
        [(rank, _)] = lost.items()
        _, counter_revision = agent.store.counter()
        nxt = view.generation + 1
        body = {"action": "promote_spare", "reason": "a node was lost", "node": agent.node, "generation": nxt,
                "world_size": len(members), "step": 7,
                "members": [{"worker_id": w, "node": n, "new_rank": r, "old_rank": r}
                            for r, (w, n) in sorted(members.items()) if r != rank]
                + [{"worker_id": spare.worker, "node": spare.node, "new_rank": rank, "old_rank": None}],
                "source_rank": 0, "store": "127.0.0.1:1", "incident": None,
                "promotions": [{"rank": rank, "spare": spare.worker, "node": spare.node}], "dropped": []}
        outcome = agent.store.commit(held, view.generation, body, spares=[spare], counter_revision=counter_revision)
        if outcome is claims.Outcome.COMMITTED:
            with self.lock:
                self.marks["decided"] = time.monotonic()
        else:
            agent.store.release_claim(held)

    def grow(self, agent: Agent, snap: Any) -> bool:
        view = agent.store.reports(snap.view)
        held = agent.store.claim(view.generation, "grow")
        if held is None:
            return False
        pool = [s for s in snap.pool if s.claimed is None and s.node in snap.live]
        members = view.members()
        _, counter_revision = agent.store.counter()
        spare = pool[0]
        nxt = view.generation + 1
        body = {"action": "grow", "reason": "grow onto a spare", "node": agent.node, "generation": nxt,
                "world_size": len(members) + 1, "step": 9, "at_step": 9,
                "members": [{"worker_id": w, "node": n, "new_rank": r, "old_rank": r}
                            for r, (w, n) in sorted(members.items())]
                + [{"worker_id": spare.worker, "node": spare.node, "new_rank": len(members), "old_rank": None}],
                "source_rank": 0, "store": "127.0.0.1:1", "incident": None,
                "promotions": [{"rank": len(members), "spare": spare.worker, "node": spare.node}], "dropped": []}
        outcome = agent.store.commit(held, view.generation, body, spares=[spare], counter_revision=counter_revision)
        if outcome is claims.Outcome.COMMITTED:
            with self.lock:
                self.marks["decided"] = time.monotonic()
            return True
        agent.store.release_claim(held)
        return False


def round_together(agents: list[Agent], timeout_s: float) -> dict[str, Any]:
    """Every agent joins the next rendezvous round at once: when each had its place, and why the round formed."""
    with ThreadPoolExecutor(len(agents)) as joining:
        t0 = time.monotonic()
        futures = [joining.submit(a.join_round) for a in agents]
        done = [f.result(timeout=timeout_s) - t0 for f in futures]
    reasons = sorted({why for a in agents for _, why in a.rendezvous.formed[-1:]})
    return {"placed_s": _pcts(done), "nodes": len(agents), "generation": agents[0].generation, "formed_by": reasons}


def _requests(after: dict[Any, float], before: dict[Any, float]) -> float:
    """Requests begun on etcd between two readings of its counters."""
    return sum(v - before.get(k, 0.0) for k, v in after.items() if k[0] == "grpc_server_started_total")


def _pcts(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None, "n": 0}
    ordered = sorted(values)
    return {"p50": round(statistics.median(ordered), 3),
            "p99": round(ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))], 3),
            "n": len(ordered)}


def _proc_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _proc_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


PENDING: set[tuple[str, str]] = set()
"""(agent, action) submitted and not yet done: an agent never has two of one action in flight (as a real agent,
whose periodic writes wait for the one before); one skipped instead is counted in SKIPPED."""
SKIPPED: dict[str, int] = {}
PENDING_LOCK = threading.Lock()


def _submit(pool: ThreadPoolExecutor, agent: Agent, action: str) -> bool:
    """Submit ``action`` of ``agent`` unless one is still in flight (False: skipped)."""
    with PENDING_LOCK:
        if (agent.node, action) in PENDING:
            SKIPPED[action] = SKIPPED.get(action, 0) + 1
            return False
        PENDING.add((agent.node, action))
    pool.submit(_safe, agent, action)
    return True


def _periodic(agents: list[Agent], every_s: float, action: str, pool: ThreadPoolExecutor,
              done: threading.Event) -> None:
    """Run ``action`` of each live agent every ``every_s``, the agents spread evenly over the interval."""
    step = every_s / max(1, len(agents))
    while not done.is_set():
        start = time.monotonic()
        for i, agent in enumerate(agents):
            if done.is_set():
                return
            if not agent.client.dead:
                _submit(pool, agent, action)
            wait = start + (i + 1) * step - time.monotonic()
            if wait > 0:
                done.wait(wait)
        done.wait(max(0.0, start + every_s - time.monotonic()))


def _safe(agent: Agent, action: str) -> None:
    try:
        getattr(agent, action)()
    except ControlStoreError as e:
        agent._error(f"{action}: {type(e).__name__}: {e}")
    finally:
        with PENDING_LOCK:
            PENDING.discard((agent.node, action))


def _ticker(agents: list[Agent], done: threading.Event, pool: ThreadPoolExecutor) -> None:
    """The agents' watch loops: a woken agent reads its snapshot and acts, at most every TICK_S; an agent that
    has a wait to report, or collects the reports, passes every TICK_S woken or not (a real agent's loop passes
    every monitor interval on a core of its own; here the passes that would find nothing to do are left out)."""
    while not done.is_set():
        start = time.monotonic()
        for agent in agents:
            polls = agent.waiting_for is not None and (agent.reported != agent.generation or agent.collecting)
            if (agent.woken.is_set() or polls) and not agent.client.dead:
                woken = agent.woken.is_set()
                agent.woken.clear()
                if not _submit(pool, agent, "tick") and woken:
                    agent.woken.set()  # its pass still runs: the change that woke it is read by the next one
        done.wait(max(0.0, start + TICK_S - time.monotonic()))


def _wait(what: str, ok: Any, timeout_s: float, interval_s: float = 0.05) -> float:
    deadline = time.monotonic() + timeout_s
    while not ok():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(interval_s)
    return time.monotonic()


def measure(n: int, args: argparse.Namespace) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix=f"control-plane-{n}-"))
    etcd = Etcd(root / "etcd")
    host_port = etcd.url.split("://", 1)[1]
    metrics = f"http://{host_port}/metrics"
    etcd_pid = etcd._server.proc.pid if etcd._server is not None else 0  # its CPU and memory
    spares = args.trials + 2
    members = n - spares
    bench = Bench(etcd.url, secrets.token_hex(32))
    bench.members = members
    result: dict[str, Any] = {"agents": n, "member_nodes": members, "spare_nodes": spares}
    agents: list[Agent] = []
    done = threading.Event()
    pool = ThreadPoolExecutor(args.threads)
    loops = ThreadPoolExecutor(args.threads)  # the watch loops' passes, never queued behind the periodic writes
    threads: list[threading.Thread] = []
    started = time.monotonic()
    try:
        for i in range(n):
            agents.append(Agent(bench, f"n{i:04d}" if i < members else f"s{i - members:04d}",
                                i if i < members else None))
        with ThreadPoolExecutor(8) as starting:  # as nodes come up: a few at a time, not all in one instant
            list(starting.map(lambda a: a.start(), agents))
        _wait("every agent to see every node live", lambda: all(len(a.presence.live()) == n for a in agents),
              args.settle_timeout)
        result["start_s"] = round(time.monotonic() - started, 2)
        result["start_retries"] = bench.start_retries
        member_agents = [a for a in agents if a.rank is not None]
        result["first_round"] = round_together(member_agents, args.settle_timeout)
        print(f"N={n} first round: {json.dumps(result['first_round'])}", flush=True)
        first = member_agents[0].generation
        for agent in agents:
            agent.generation = first
            if agent.rank is not None:
                pool.submit(agent.store.publish_node, first, {agent.rank: agent.worker}, world_size=members,
                            store="127.0.0.1:1", opted_in=True, batch=None)
            else:
                pool.submit(agent.store.register_spare, agent.worker, time.time())
        agents[0].store.set_current(first)
        for every, action in ((1.0, "publish_timing"), (1.0, "ask_waiting"), (5.0, "read_quarantine")):
            chosen = member_agents if action != "read_quarantine" else agents
            threads.append(threading.Thread(target=_periodic, args=(chosen, every, action, pool, done), daemon=True))
        threads.append(threading.Thread(target=_ticker, args=(agents, done, loops), daemon=True))
        for t in threads:
            t.start()
        time.sleep(5.0)
        before, events0, t0 = counters(metrics), sum(a.events for a in agents), time.monotonic()
        cpu0, sim0 = _proc_cpu(etcd_pid), time.process_time()
        time.sleep(args.window)
        after, events1, t1 = counters(metrics), sum(a.events for a in agents), time.monotonic()
        cpu1, sim1 = _proc_cpu(etcd_pid), time.process_time()
        seconds = t1 - t0
        delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in set(after) | set(before)}
        started_calls = {f"{k[1]} ({k[2]})": v for k, v in delta.items()
                         if k[0] == "grpc_server_started_total" and v > 0}
        total = sum(started_calls.values())
        result["steady"] = {
            "window_s": round(seconds, 2), "requests_per_s": round(total / seconds, 1),
            "requests_per_agent_per_s": round(total / seconds / n, 3),
            "by_method_per_agent_per_s": {k: round(v / seconds / n, 3) for k, v in sorted(started_calls.items())},
            "watch_events_per_agent_per_s": round((events1 - events0) / seconds / n, 1),
            "etcd_cpu_cores": round((cpu1 - cpu0) / seconds, 3), "etcd_rss_mib": round(_proc_rss_mib(etcd_pid), 1),
            "simulator_cpu_cores": round((sim1 - sim0) / seconds, 3),
        }
        print(f"N={n} steady: {json.dumps(result['steady'])}", flush=True)
        losses = []
        for trial in range(args.trials):
            live_members = [a for a in agents if a.rank is not None and not a.client.dead]
            victim = live_members[(trial * 7 + 1) % len(live_members)]
            bench.judged_at, bench.applied_at, bench.marks = {}, {}, {}
            bench.watching = victim.node
            generation = victim.generation
            events_before, requests_before = sum(a.events for a in agents), counters(metrics)
            # Alternately killed (its port refuses at once: its probers accuse it at once) and silent (powered
            # off, its traffic dropped: accused after SILENCE_S without an answer).
            how = "killed" if trial % 2 == 0 else "silent"
            lost_at = time.monotonic()
            victim.stop()
            if how == "silent":
                time.sleep(SILENCE_S)
            live_nodes = {a.node for a in agents if not a.client.dead} | {victim.node}
            for node in probers_of(live_nodes, victim.node, PROBERS):
                prober = next(a for a in agents if a.node == node)
                prober.client.put(f"{ROOT}{PREFIX}suspect/{victim.node}/{node}",
                                  json.dumps({"why": "no answer", "at": time.time()}).encode(),
                                  lease=prober.presence.lease)
            others = [a for a in agents if not a.client.dead]
            alive = len(others)
            try:
                _wait("every agent to read the decision", lambda alive=alive: len(bench.applied_at) >= alive,
                      args.trial_timeout)
                complete = True
            except TimeoutError:
                complete = False
            judged = [t - lost_at for t in bench.judged_at.values()]
            applied = [t - lost_at for t in bench.applied_at.values()]
            events = sum(a.events for a in agents) - events_before
            requests = _requests(counters(metrics), requests_before)
            decided = bench.marks.get("decided")
            losses.append({
                "victim": victim.node, "how": how, "generation": generation, "complete": complete,
                "judged_lost_s": _pcts(judged), "decided_s": round(decided - lost_at, 3) if decided else None,
                "applied_s": _pcts(applied),
                "applied_after_decision_s": _pcts([t - decided for t in bench.applied_at.values()]) if decided else None,
                "agents_applied": len(applied), "agents_alive": len(others),
                # What the recovery cost the store, from the loss until every agent read the decision (and the
                # time the counters were read in): watch events each agent received, requests begun on etcd.
                "watch_events_per_agent": round(events / len(others), 1),
                "requests_per_agent": round(requests / len(others), 1)})
            print(f"N={n} loss {trial}: {json.dumps(losses[-1])}", flush=True)
            time.sleep(2.0)  # the members publish their next generation
        result["node_loss"] = losses
        lead = next(a for a in agents if a.rank == 0 and not a.client.dead)
        bench.applied_at, bench.marks = {}, {}
        bench.watching = None
        others = [a for a in agents if not a.client.dead]
        snap = lead.cluster.snapshot if lead.cluster is not None else None
        grown = snap is not None and bench.grow(lead, snap)
        grow: dict[str, Any] = {"committed": grown}
        if grown:
            try:
                _wait("every agent to read the grow", lambda: len(bench.applied_at) >= len(others), args.trial_timeout)
            except TimeoutError:
                pass
            decided = bench.marks["decided"]
            grow["applied_after_decision_s"] = _pcts([t - decided for t in bench.applied_at.values()])
            grow["agents_applied"], grow["agents_alive"] = len(bench.applied_at), len(others)
        result["grow"] = grow
        print(f"N={n} grow: {json.dumps(grow)}", flush=True)
        restarting = [a for a in agents if a.rank is not None and not a.client.dead
                      and a in member_agents]
        result["restart_round"] = round_together(restarting, args.trial_timeout)
        print(f"N={n} restart round: {json.dumps(result['restart_round'])}", flush=True)
    except (TimeoutError, ControlStoreError) as e:  # recorded: what this machine could not simulate is a result
        result["failed"] = f"{type(e).__name__}: {e}"
        print(f"N={n}: {result['failed']}", flush=True)
    finally:
        done.set()
        for t in threads:
            t.join(timeout=30)
        result["errors"] = len(bench.errors)
        result["first_errors"] = bench.errors[:5]
        result["skipped_as_still_in_flight"] = dict(SKIPPED)
        SKIPPED.clear()
        with ThreadPoolExecutor(args.threads) as closing:
            list(closing.map(lambda a: a.close(), agents))
        pool.shutdown(wait=True, cancel_futures=True)
        loops.shutdown(wait=True, cancel_futures=True)
        etcd.close()
    return result


def _worst(r: dict[str, Any], key: str, how: str | None = None) -> float | None:
    """The worst p99 of ``key`` over a result's node losses (those lost ``how``: killed or silent)."""
    return max((t[key]["p99"] for t in r.get("node_loss", []) if t.get(key) and t[key]["p99"] is not None
                and how in (None, t.get("how"))), default=None)


def _most(r: dict[str, Any], key: str) -> float | None:
    """The largest ``key`` over a result's node losses."""
    return max((t[key] for t in r.get("node_loss", []) if t.get(key) is not None), default=None)


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = [r["agents"] for r in results if "steady" in r]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(ns, [r["steady"]["requests_per_agent_per_s"] for r in results if "steady" in r], "o-",
              label="requests to etcd")
    left.axhline(3.0, color="grey", linestyle=":", label="target (3)")
    left.set_xscale("log", base=2)
    left.set_xlabel("agents")
    left.set_ylabel("per agent per second")
    left.set_title("steady load")
    left.legend()
    for key, label, how in (("applied_s", "decision read, node killed", "killed"),
                            ("judged_lost_s", "judged lost, node silent", "silent"),
                            ("applied_s", "decision read, node silent", "silent")):
        points = [(r["agents"], _worst(r, key, how)) for r in results if _worst(r, key, how) is not None]
        right.plot([x for x, _ in points], [y for _, y in points], "o-", label=f"{label}, p99")
    right.axhline(1.0, color="grey", linestyle=":", label="target (1 s)")
    right.set_xscale("log", base=2)
    right.set_xlabel("agents")
    right.set_ylabel("seconds after the loss")
    right.set_title("node loss, by every agent")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--agents", default="16,64,256,1024")
    p.add_argument("--window", type=float, default=20.0, help="seconds of steady state measured per N")
    p.add_argument("--trials", type=int, default=3, help="node losses per N")
    p.add_argument("--threads", type=int, default=48, help="the simulator's threads for requests and passes")
    p.add_argument("--settle-timeout", type=float, default=300.0)
    p.add_argument("--trial-timeout", type=float, default=60.0)
    p.add_argument("--out", type=Path, default=HERE / "results" / "control_plane_bench")
    args = p.parse_args()
    threading.stack_size(512 * 1024)
    results = [measure(int(n), args) for n in args.agents.split(",")]
    out = {"commit": commit(), "uncommitted": uncommitted_code_changes(),
           "command": "python benchmarks/control_plane_bench.py " + shlex.join(sys.argv[1:]), "load": load_now(),
           "results": results,
           "targets": {"requests_per_agent_per_s": 3.0, "loss_to_applied_p99_s_at_1024": 1.0}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(out, indent=2) + "\n")
    plot(results, args.out.with_suffix(".png"))
    rows = []
    for r in results:
        s = r.get("steady", {})
        rows.append(f"| {r['agents']} | {s.get('requests_per_agent_per_s')} | {s.get('watch_events_per_agent_per_s')} "
                    f"| {s.get('etcd_cpu_cores')} | {s.get('etcd_rss_mib')} | {s.get('simulator_cpu_cores')} "
                    f"| {_worst(r, 'applied_s', 'killed')} | {_worst(r, 'judged_lost_s', 'silent')} "
                    f"| {_worst(r, 'applied_s', 'silent')} "
                    f"| {_most(r, 'watch_events_per_agent')} | {_most(r, 'requests_per_agent')} "
                    f"| {(r.get('grow') or {}).get('applied_after_decision_s', {}).get('p99')} "
                    f"| {(r.get('first_round') or {}).get('placed_s', {}).get('p99')} "
                    f"| {(r.get('restart_round') or {}).get('placed_s', {}).get('p99')} "
                    f"| {r.get('failed', '')} |")
    args.out.with_suffix(".md").write_text(
        f"# The control plane at scale, simulated\n\ncommit `{out['commit']}`; `{out['command']}`; load {out['load']}\n\n"
        "| agents | requests/agent/s | watch events/agent/s | etcd cores | etcd RSS MiB | simulator cores "
        "| killed: loss to decision read p99 s | silent: loss to judged lost p99 s "
        "| silent: loss to decision read p99 s | loss: watch events/agent "
        "| loss: requests/agent | grow read p99 s | first round p99 s | restart round p99 s | failed |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n")
    print(args.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
