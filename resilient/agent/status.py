"""The node's live status, published once a second for ``resilient status``.

Written to ``<run_dir>/nodes/<node>/status.json`` (atomically) and, when
the run uses etcd, under ``status/<node>`` in the store, so that the
on-call engineer can read it from any machine.  Times in it are wall-clock
seconds for humans; the agent never compares them across hosts.

``resilient status`` asks the running agent for a fresh :meth:`StatusPublisher.snapshot`
through its control socket (no token needed) whenever it can reach it, so
the rank rows it shows are as new as the newest heartbeat the agent has
received: at most one heartbeat batch (100 ms) behind the worker.  The file
and the store copy, read when the socket cannot be reached (another host,
an agent that ended), are at most one interval plus their write behind:
1 s for the file; for the store copy, 30 s while nothing but the numbers
changes, and one interval when the node's phase or generation changes (a
put every few seconds from each of a thousand agents would be most of what
the store serves in steady training).

Local first, network second: one thread writes ``status.json`` every
second and saves ``ledger.json`` every five (a few hundred kilobytes of
JSON) and touches nothing but local files and memory; a second thread reads the restart count from the store (the
count shown is the last one read) and copies the newest snapshot to the
store.  A store outage (the etcd client retries for up to its outage
tolerance, 60 s by default) then only makes the store copy stale, which
``store_published_at`` in the local file shows; the files on-call reads
during the outage stay current.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..coord import keyspace
from ..core.events import Emit, EventKind
from ..core.fsutil import write_json_atomic
from ..core.supervised import Supervised, ThreadReports
from ..watchdog.sections import calibration_summary

if TYPE_CHECKING:
    from .accounting import NodeAccounting
    from .config import AgentConfig
    from .launcher import WorkerGroup
    from .rendezvous import Assignment
    from .tracker import RankTracker


class StatusPublisher:
    """Snapshot the node's state every ``interval_s`` seconds: local files on one thread, the store on another.

    It reads only what it is given: the config values, the tracker, the
    ledger (``accounting``), ``restarts_used`` (a cached count, no I/O) and
    ``refresh_restarts`` (reads the store; called on the store thread only),
    ``store_put`` (None: no store copy) and ``emit`` for events.
    """

    def __init__(self, config: AgentConfig, *, status_file: Path, control_socket: Path, tracker: RankTracker,
                 accounting: NodeAccounting, restarts_used: Callable[[], int | None],
                 refresh_restarts: Callable[[], object] | None, store_put: Callable[[str, bytes], None] | None,
                 emit: Emit, clock: Callable[[], float] = time.monotonic,
                 interval_s: float = 1.0, final_store_timeout_s: float = 10.0,
                 store_interval_s: float = 30.0, ledger_interval_s: float = 5.0,
                 threads: ThreadReports | None = None) -> None:
        """``threads``: where the two writing threads report an error they did not expect (each is then started
        again, :mod:`resilient.core.supervised`)."""
        self._config = config
        self._reports = threads or ThreadReports()
        self._status_file = status_file
        self._control_socket = control_socket
        self._tracker = tracker
        self._accounting = accounting
        self._restarts_used = restarts_used
        self._refresh_restarts = refresh_restarts
        self._store_put = store_put
        self._emit = emit
        self._clock = clock
        self._interval = interval_s
        self._store_interval = store_interval_s
        self._ledger_interval = ledger_interval_s
        """Seconds between saves of the ledger (a few hundred kilobytes of JSON: tens of milliseconds of CPU a
        save, which at every second would take a percent of a core from the workers of a busy node)."""
        self._ledger_saved_at = float("-inf")
        self._ledger_generation: int | None = None
        """The generation the saved ledger holds: a new one is saved at once (an agent that starts on this run
        directory continues the generation numbers from it)."""
        self._final_store_timeout = final_store_timeout_s
        self._group: WorkerGroup | None = None
        self._assignment: Assignment | None = None
        self.phase = "starting"
        self.metrics_url: str | None = None
        self.restore: dict[str, Any] | None = None
        """What the newest generation's ranks restored (:meth:`RestoreSummary.record`), once they all reported."""
        self.recovery: Callable[[], dict[str, Any]] | None = None
        """In-process recovery's view: the ladder's newest decision, how the newest recovery completed, spares
        ready (set by the agent when it offers in-process recovery)."""
        self.slowness: Callable[[], dict[str, Any] | None] | None = None
        """Straggler scores, standing flags and the slowdown in progress (set by the agent's reporting)."""
        self.quarantine: Callable[[], dict[str, Any]] | None = None
        """Across machines: this node's quarantine record, offences and newest burn-in (set by the agent)."""
        self.memory: Callable[[], dict[str, Any]] | None = None
        """The node's memory tier: directory, limit, bytes held, steps held per rank (set by the agent)."""
        self.notices: Callable[[], dict[str, Any]] | None = None
        """What the workers' Runs told the agent (config changes, diverged resumes, the integration) by kind."""
        self._latest: dict[str, Any] | None = None
        self._store_published_at: float | None = None
        self._done = threading.Event()
        self._store_done = threading.Event()
        self._threads: list[Supervised] = []

    def attach(self, group: WorkerGroup, assignment: Assignment) -> None:
        self._group, self._assignment = group, assignment
        self.phase = "running"

    def detach(self) -> None:
        self._group = None
        self.phase = "between generations"

    def set_phase(self, phase: str) -> None:
        self.phase = phase

    def start(self) -> None:
        self._threads = [self._reports.run("status", self._local_loop, stop=self._done),
                         self._reports.run("status-store", self._store_loop, stop=self._store_done)]

    def stop(self) -> None:
        """Write the final status locally now; give the store copy up to ``final_store_timeout_s``."""
        self._done.set()
        if self._threads:
            self._threads[0].join(timeout=10)
        self.publish_local(final=True)  # the final phase, and the final ledger
        self._store_done.set()  # the store thread publishes that final snapshot, then ends
        if len(self._threads) > 1:
            self._threads[1].join(timeout=self._final_store_timeout)

    # ------------------------------------------------------------ local
    def _local_loop(self) -> None:
        while not self._done.wait(self._interval):
            self.publish_local()

    def snapshot(self) -> dict[str, Any]:
        c, tracker = self._config, self._tracker
        now_mono, now_wall = self._clock(), time.time()
        group, a = self._group, self._assignment
        ranks = {}
        for rank, info in tracker.ranks().items():
            alive = group is not None and rank in group.workers and group.workers[rank].exit is None
            ranks[str(rank)] = {
                "pid": info.pid, "section": info.section, "step": info.step,
                "in_section_s": round(now_mono - info.entered_at, 3),
                "last_heartbeat_age_s": round(now_mono - info.last_seen, 3) if info.heartbeats else None,
                "alive": alive,
            }
        return {
            "run_id": c.run_id, "node": c.node_id, "agent_pid": os.getpid(),
            "phase": self.phase, "updated_at": now_wall,
            "control_socket": str(self._control_socket), "metrics_url": self.metrics_url,
            "generation": a.generation if a else None, "node_rank": a.node_rank if a else None,
            "num_nodes": a.num_nodes if a else None, "nproc_per_node": c.nproc_per_node,
            "ranks": ranks if group is not None else {},
            "max_restarts": c.restart.max_restarts, "restarts_used": self._restarts_used(),
            "committed_step": tracker.committed_step, "stale_heartbeats": tracker.stale_heartbeats,
            "timeouts": [{"section": s.section, "timeout_s": round(s.timeout_s, 3), "source": s.source,
                          "observations": s.count, "max_seen_s": round(s.max_s, 3)}
                         for s in calibration_summary(tracker.stats, c.sections)],
            "checkpoint": tracker.checkpoint_location, "restore": self.restore,
            "recovery": self.recovery() if self.recovery is not None else None,
            "slowness": self.slowness() if self.slowness is not None else None,
            "quarantine": self.quarantine() if self.quarantine is not None else None,
            "memory": self.memory() if self.memory is not None else None,
            "notices": self.notices() if self.notices is not None else None,
            "store_published_at": self._store_published_at,
        }

    def publish_local(self, *, final: bool = False) -> dict[str, Any]:
        """Write status.json, then save the ledger when ``ledger_interval_s`` passed since its last save, a new
        generation started, or ``final`` (local files only); return the snapshot.

        Status first: the snapshot is taken just before its own write, never
        behind the ledger's (larger) one.
        """
        snap = self.snapshot()
        try:
            write_json_atomic(self._status_file, snap)
        except OSError as e:
            self._emit(EventKind.STATUS_WRITE_FAILED, error=str(e))
        self._latest = snap
        now, generation = time.monotonic(), self._accounting.ledger.generation
        if final or now - self._ledger_saved_at >= self._ledger_interval or generation != self._ledger_generation:
            self._ledger_saved_at, self._ledger_generation = now, generation
            try:
                self._accounting.save()
            except OSError as e:
                self._emit(EventKind.LEDGER_WRITE_FAILED, error=str(e))
        return snap

    # ------------------------------------------------------------ store
    def _store_loop(self) -> None:
        put_at, put_as = -float("inf"), None
        while True:
            now = time.monotonic()
            snap = self._latest
            shown = (snap.get("phase"), snap.get("generation")) if snap is not None else None
            due = now - put_at >= self._store_interval or shown != put_as  # a new phase or generation: at once
            self._publish_store(put=due)
            if due:
                put_at, put_as = now, shown
            if self._store_done.wait(self._interval):
                self._publish_store(put=True)
                return

    def _publish_store(self, *, put: bool) -> None:
        """Read the restart count (every interval) and, when ``put``, copy the newest snapshot to the store."""
        try:
            if self._refresh_restarts is not None:
                self._refresh_restarts()
            snap = self._latest
            if put and self._store_put is not None and snap is not None:
                self._store_put(keyspace.status(self._config.node_id), json.dumps(snap).encode())
                self._store_published_at = time.time()
        except Exception as e:  # reported, never fatal: status is for humans
            self._emit(EventKind.STORE_UNREACHABLE, error=f"{type(e).__name__}: {e}")
