"""The node's live status, published once a second for ``resilient status``.

Written to ``<run_dir>/nodes/<node>/status.json`` (atomically) and, when
the run uses etcd, under ``status/<node>`` in the store, so that the
on-call engineer can read it from any machine.  Times in it are wall-clock
seconds for humans; the agent never compares them across hosts.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from ..fsutil import write_json_atomic
from ..watchdog.sections import calibration_summary

if TYPE_CHECKING:
    from .launcher import WorkerGroup
    from .rendezvous import Assignment
    from .supervisor import Agent


class StatusPublisher:
    """Snapshot the agent's state every ``interval_s`` seconds on a daemon thread."""

    def __init__(self, agent: Agent, interval_s: float = 1.0) -> None:
        self._agent = agent
        self._interval = interval_s
        self._group: WorkerGroup | None = None
        self._assignment: Assignment | None = None
        self.phase = "starting"
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def attach(self, group: WorkerGroup, assignment: Assignment) -> None:
        self._group, self._assignment = group, assignment
        self.phase = "running"

    def detach(self) -> None:
        self._group = None
        self.phase = "between generations"

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="status", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.publish()  # the final phase

    def _loop(self) -> None:
        while not self._done.wait(self._interval):
            self.publish()

    def snapshot(self) -> dict[str, Any]:
        agent = self._agent
        now_mono, now_wall = agent.clock(), time.time()
        group, a = self._group, self._assignment
        ranks = {}
        for rank, info in agent.tracker.ranks().items():
            alive = group is not None and rank in group.workers and group.workers[rank].exit is None
            ranks[str(rank)] = {
                "pid": info.pid, "section": info.section, "step": info.step,
                "in_section_s": round(now_mono - info.entered_at, 3),
                "last_heartbeat_age_s": round(now_mono - info.last_seen, 3) if info.heartbeats else None,
                "alive": alive,
            }
        return {
            "run_id": agent.config.run_id, "node": agent.config.node_id, "agent_pid": os.getpid(),
            "phase": self.phase, "updated_at": now_wall,
            "control_socket": str(agent.run_dir.socket_path("control.sock")),
            "metrics_url": agent.metrics.url if agent.metrics is not None else None,
            "generation": a.generation if a else None, "node_rank": a.node_rank if a else None,
            "num_nodes": a.num_nodes if a else None, "nproc_per_node": agent.config.nproc_per_node,
            "ranks": ranks if group is not None else {},
            "max_restarts": agent.config.restart.max_restarts, "restarts_used": self.restarts_used(),
            "committed_step": agent.tracker.committed_step,
            "timeouts": [{"section": c.section, "timeout_s": round(c.timeout_s, 3), "source": c.source,
                          "observations": c.count, "max_seen_s": round(c.max_s, 3)}
                         for c in calibration_summary(agent.tracker.stats, agent.config.sections)],
            "checkpoint": agent.tracker.checkpoint_location,
        }

    def restarts_used(self) -> int | None:
        try:
            return self._agent.restarts_used()
        except Exception:  # store unreachable: status still shows the rest
            return None

    def publish(self) -> None:
        try:
            self._agent.accounting.save()
        except OSError as e:
            self._agent.emit("ledger_write_failed", error=str(e))
        snap = self.snapshot()
        try:
            write_json_atomic(self._agent.run_dir.status_file, snap)
        except OSError as e:
            self._agent.emit("status_write_failed", error=str(e))
        if self._agent.config.store_url is not None:
            try:
                self._agent.control.put(f"status/{self._agent.config.node_id}", json.dumps(snap).encode())
            except Exception as e:  # reported, never fatal: status is for humans
                self._agent.emit("store_unreachable", error=f"{type(e).__name__}: {e}")
