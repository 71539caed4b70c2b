"""Holding for a repair across machines (``resilient.agent.cluster_decide``), against a real etcd.

Two nodes' recovery pieces run in this process, each as its agent runs them:
its in-process recovery (:class:`~resilient.agent.inproc.InProcess`), its
launch's recovery keys followed through its own etcd watch
(:mod:`resilient.agent.cluster_watch`), and a watch loop that passes
through :func:`~resilient.agent.cluster_flow.tick` after each pause of the
monitor interval, or sooner when its watch or a worker's report wakes it.
Only the worker processes are stood in for: their reports are handed to
the agents as heartbeats.

While the ladder holds a failed generation for a repair, the collector asks
it again on every pass.  A pass that holds must write nothing: the launch's
recovery keys are what every agent's watch wakes on, the collector's own
included, so a write per pass makes the loop, and every other agent's,
pass again at once.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from resilient.agent.cluster import ClusterStore
from resilient.agent.cluster_flow import report_lost, start, tick
from resilient.agent.config import AgentConfig
from resilient.agent.decision import Restarts
from resilient.agent.incidents import Incident
from resilient.agent.inproc import InProcess
from resilient.agent.policy import Failure, History, RestartConfig
from resilient.agent.rendezvous import Assignment
from resilient.coord.etcd import EtcdClient, EtcdConfig, EtcdControlStore
from resilient.coord.keyspace import LaunchKeys
from resilient.coord.proof import SignedStore, sign
from resilient.coord.watch import PrefixWatch
from resilient.core.events import EventKind
from resilient.core.supervised import ThreadReports
from resilient.elastic.observe import FaultKind
from resilient.worker.protocol import Heartbeat

from .agent_helpers import wait_for

TOKEN = "t" * 64
LAUNCH = "launch/l1/"
KEYS = LaunchKeys("l1")
GENERATION = 3
STEP = 7
RECOVERY_TIMEOUT_S = 8.0
"""The ladder holds for a repair at most half of it (4 s); the second collector's turn comes a quarter in (2 s)."""
MONITOR_S = 0.1
"""The watch loop's pause between passes (``AgentConfig.monitor_interval_s``)."""
WINDOW_S = 2.0


class _Group:
    """What the recovery's watch loop reads of a node's worker group: its members, its spares, and the event
    that wakes it (the agent's ``WorkerGroup.changed``)."""

    def __init__(self, workers: dict[int, str], spares: list[str]) -> None:
        self.workers = {rank: SimpleNamespace(worker_id=worker) for rank, worker in workers.items()}
        self.spares = dict.fromkeys(spares)
        self.changed = threading.Event()

    def pause(self, seconds: float) -> None:
        self.changed.wait(seconds)
        self.changed.clear()


class _Node:
    """One node's agent, as far as recovery across machines goes, with its watch loop on a thread of its own."""

    def __init__(self, url: str, run_id: str, tmp: Path, node: str, node_rank: int, workers: dict[int, str]) -> None:
        self.name = node
        self.events: list[tuple[Any, dict[str, Any]]] = []
        config = AgentConfig(entrypoint=("train.py",), run_id=run_id, node_id=node, run_dir=tmp / node,
                             nproc_per_node=2, min_nodes=2, max_nodes=2, store_url=url,
                             recovery_timeout_s=RECOVERY_TIMEOUT_S, monitor_interval_s=MONITOR_S)
        self.inp = InProcess(config, self.emit, time.monotonic)
        self.crashes: list[tuple[str, ...]] = []
        """Errors the node's supervised threads met (none expected)."""
        client = EtcdClient(EtcdConfig.from_url(url))
        root = f"/resilient/{run_id}/"
        self.launch_watch = PrefixWatch(client, root + "launch").start()
        store = ClusterStore(SignedStore(EtcdControlStore.for_run(client, run_id), TOKEN), client, root, KEYS,
                             node, TOKEN, watch=self.launch_watch)
        threads = ThreadReports(lambda *crash: self.crashes.append(crash))
        self.inp.follow_launch(store, threads)
        # Every node keeps a spare.  This one is still warming; an earlier one was ready 0.5 s after its start, so
        # the ladder expects this one within half a second: the repair a hold waits for.
        spare = self._measured_spare()
        self.group = _Group(workers, [spare])
        self.inp.changed = self.group.changed
        self.ctx = SimpleNamespace(
            config=config, inproc=self.inp, clock=time.monotonic, emit=self.emit, shared=None,
            generations=SimpleNamespace(restarts=lambda: Restarts(History(), RestartConfig())),
            books=SimpleNamespace(record_incident=lambda incident: None))
        self.a = Assignment(node_rank=node_rank, num_nodes=2, generation=GENERATION, master_addr="127.0.0.1",
                            master_port=0, members=("n0", "n1"))
        self.passes: list[float] = []
        """When each pass of the watch loop began."""
        self.news: tuple[float, Any] | None = None
        """When the loop's pass brought news that ends the generation's watch, and what it was."""
        self._todo: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._done = threading.Event()
        start(self.ctx, self.group, self.a)
        for rank, worker in workers.items():
            self.report(rank, {"event": "ready", "worker": worker, "role": "worker", "step": 0})
        self._thread = threading.Thread(target=self._loop, name=f"watch loop {node}", daemon=True)
        self._thread.start()

    def emit(self, kind: Any, **fields: Any) -> None:
        self.events.append((kind, fields))

    def _measured_spare(self) -> str:
        inp, earlier, warming = self.inp, f"{self.name}.s0", f"{self.name}.s1"
        inp.spare_started(earlier, 0, generation=GENERATION)
        ready = {"event": "ready", "worker": earlier, "role": "spare", "step": 0}
        inp.on_message(_heartbeat(-1, ready), inp.spares[earlier].started_at + 0.5)
        inp.spare_gone(earlier, 0)
        inp.spare_started(warming, 0, generation=GENERATION)
        return warming

    def report(self, rank: int, recovery: dict[str, Any]) -> None:
        """A worker's recovery report reaches this agent (it wakes the watch loop)."""
        self.inp.on_message(_heartbeat(rank, recovery), time.monotonic())

    def on_loop(self, action: Callable[[], None]) -> None:
        """Run ``action`` on the watch loop's thread before its next pass, as the agent answers a worker's exit."""
        self._todo.put(action)
        self.group.changed.set()

    def _loop(self) -> None:
        while not self._done.is_set() and self.news is None:
            while not self._todo.empty():
                self._todo.get()()
            self.passes.append(time.monotonic())
            news = tick(self.ctx, self.group, self.a, None, time.monotonic())
            if news is not None:
                self.news = (time.monotonic(), news)
                return
            self.group.pause(MONITOR_S)

    def decided(self) -> list[str]:
        return [fields["action"] for kind, fields in self.events if kind is EventKind.RECOVERY_DECIDED]

    def close(self) -> None:
        self._done.set()
        self.group.changed.set()
        self._thread.join(timeout=30)
        self.inp.leave_launch()
        self.launch_watch.close()
        self.inp.close()


def _heartbeat(rank: int, recovery: dict[str, Any]) -> Heartbeat:
    return Heartbeat(rank=rank, local_rank=max(rank, 0) % 2, pid=0, section="step", step=STEP, seq=1,
                     kind="recovery", recovery=recovery)


def _revision(client: EtcdClient) -> int:
    return client.snapshot_prefix("/nothing/")[1]


def _writes(client: EtcdClient, prefix: str, first: int, last: int) -> list[str]:
    """The keys under ``prefix`` written or deleted at revisions ``first`` to ``last``, replayed from etcd's
    history."""
    found: list[str] = []
    if last < first:
        return found
    for batch in client.watch_prefix(prefix, first, idle_s=1.0):
        for _, entry in batch.events:
            if entry.mod_revision > last:
                return found
            found.append(entry.key)
    return found


def test_a_hold_for_a_repair_across_machines_writes_nothing_until_it_ends(tmp_path: Path, etcd_server,
                                                                          etcd_run_id) -> None:
    """Rank 1 on n0 crashes; no spare is ready and the world may not shrink (``--nnodes 2``), but each node's
    spare is expected ready within a second: the ladder holds.  For as long as it holds, its passes write
    nothing to the store (the loop passes once a monitor interval, woken by nothing it wrote), and the hold
    ends when its bound is spent, in the next rung: a restart, decided once."""
    client = EtcdClient(EtcdConfig.from_url(etcd_server.url))
    root = f"/resilient/{etcd_run_id}/"
    client.put(f"{root}generation", sign(TOKEN, "generation", {"generation": GENERATION}))
    for node in ("n0", "n1"):  # both nodes reach the store (their presence keys, as their agents keep them)
        key = f"{LAUNCH}nodes/{node}"
        client.put(root + key, sign(TOKEN, key, {"state": "running"}))
    nodes: list[_Node] = []
    try:
        n0 = _Node(etcd_server.url, etcd_run_id, tmp_path, "n0", 0, {0: "n0.w0", 1: "n0.w1"})
        nodes.append(n0)
        n1 = _Node(etcd_server.url, etcd_run_id, tmp_path, "n1", 1, {2: "n1.w0", 3: "n1.w1"})
        nodes.append(n1)
        store = n0.inp.cluster.store  # type: ignore[union-attr]
        wait_for(lambda: len(store.view(GENERATION).nodes) == 2
                 and all(n.get("opted_in") for n in store.view(GENERATION).nodes.values()), 10,
                 "both nodes' members opted in")

        def lose_rank_1() -> None:
            now = time.monotonic()
            failure = Failure(kind="exit", time=now, rank=1, node="n0", exit_code=1, step=STEP,
                              detail="RuntimeError: boom")
            incident = Incident(id=f"g{GENERATION:04d}-n0", node="n0", generation=GENERATION, kind="exit", rank=1,
                                pid=0, section="step", step=STEP, summary="rank 1 exited 1")
            held = report_lost(n0.ctx, n0.group, n0.a, lost={1: "n0.w1"}, kind=FaultKind.CRASH, failure=failure,
                               incident=incident, exit_codes=(1,), detected_at=now, last_progress_at=now)
            assert held is not None

        n0.on_loop(lose_rank_1)
        # The survivors' collectives fail after the crash: n0 marked the generation failed, so it collects first.
        wait_for(lambda: store.view(GENERATION).failed_by == "n0", 10, "n0 to report its lost rank")
        waiting = {"event": "waiting", "generation": GENERATION, "step": STEP, "position": "before"}
        n0.report(0, {**waiting, "worker": "n0.w0"})
        n1.report(2, {**waiting, "worker": "n1.w0"})
        n1.report(3, {**waiting, "worker": "n1.w1"})

        def holding() -> float | None:
            inv = n0.inp.cluster.involved.get(GENERATION)  # type: ignore[union-attr]
            return inv.wait_since if inv is not None else None

        wait_since = wait_for(holding, 10, "n0's ladder to hold for the repair")
        first, passes = _revision(client), (len(n0.passes), len(n1.passes))
        time.sleep(WINDOW_S)
        last, passes = _revision(client), (len(n0.passes) - passes[0], len(n1.passes) - passes[1])
        wait_for(lambda: n0.news is not None and n1.news is not None, 4 * RECOVERY_TIMEOUT_S, "the hold to end")
        written = _writes(client, root, first + 1, last)
        print(f"in {WINDOW_S:g} s of holding: passes n0={passes[0]} n1={passes[1]}, etcd revisions {last - first}, "
              f"writes under the run's keys {len(written)}")
        # Nothing written while it holds, so nothing wakes either loop: each passes about once a monitor
        # interval (the bound allows twice that), where a write per pass made hundreds.
        assert written == [], f"{len(written)} writes in {WINDOW_S:g} s of holding: {sorted(set(written))}"
        bound = 2 * WINDOW_S / MONITOR_S
        assert 0 < passes[0] <= bound and passes[1] <= bound, (passes, bound)
        # The hold ends when its bound is spent, in the next rung, decided by n0 and carried out by both.
        assert n0.news is not None and n1.news is not None
        (ended, problem), (_, followed) = n0.news, n1.news
        assert ended - wait_since >= n0.inp.ladder.max_wait_s, (ended - wait_since, n0.inp.ladder.max_wait_s)
        assert isinstance(problem, str) and problem.startswith(f"node n0 decided restart after generation {GENERATION}")
        assert "the wait bound is spent" in problem, problem
        assert isinstance(followed, str) and followed.startswith("node n0 decided restart"), followed
        decision = store.view(GENERATION).decision
        assert decision is not None and decision["action"] == "restart" and decision["node"] == "n0"
        assert n0.decided() == ["wait_for_repair", "restart"], n0.decided()
        assert n1.decided() in ([], ["wait_for_repair"]), n1.decided()
        assert n0.crashes == [] and n1.crashes == [], (n0.crashes, n1.crashes)
    finally:
        for node in nodes:
            node.close()
