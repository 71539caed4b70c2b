"""The agent's account of this node's worker processes across generations.

:class:`~resilient.agent.sweep.NodeProcesses` is the mechanism (the lock,
``pids.json``, the sweep, the wait); this module is what the agent does
with it: sweep an earlier agent's leftovers at start, record each
generation's workers, report workers that SIGKILL did not end as an
incident, and refuse to start new workers beside them until they are gone.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..core.events import Emit, EventKind
from .incidents import Incident, stuck_incident
from .sweep import GIVE_UP_AFTER_S, NodeProcesses, Stuck


class ProcessBookkeeping:
    """Claims the node directory at creation (refusing while an earlier agent runs) and sweeps its leftovers."""

    def __init__(self, node_dir: Path, node_id: str, *, emit: Emit,
                 record_incident: Callable[[Incident], None]) -> None:
        self._node = node_id
        self._emit = emit
        self._record_incident = record_incident
        self.processes = NodeProcesses(node_dir)
        swept = self.processes.claim()
        if swept.lost:
            emit(EventKind.PREVIOUS_AGENT_LOST, previous_agent=swept.previous_agent, generation=swept.generation,
                 reason=f"the previous agent of node {node_id} (pid {swept.previous_agent}) died without ending "
                        "(killed, or its machine lost); this agent takes the node's place")
        if swept.killed:
            emit(EventKind.LEFTOVERS_SWEPT, previous_agent=swept.previous_agent, pids=list(swept.killed),
                 stuck=[s.describe() for s in swept.stuck])
        self._stuck: tuple[Stuck, ...] = swept.stuck
        """Workers SIGKILL did not end, not yet waited for."""

    def report_swept(self, generation: int) -> None:
        """Record the incident for leftovers the sweep at start could not end (once the store is up)."""
        if self._stuck:
            self._record_incident(stuck_incident(self._node, generation, self._stuck,
                                                 after="after sweeping an earlier agent's workers",
                                                 wait_s=GIVE_UP_AFTER_S))

    def workers_started(self, generation: int, pids: dict[int, int]) -> None:
        """Record the new workers for a later agent's sweep."""
        self.processes.record_workers(generation, pids)

    def workers_stopped(self, generation: int, stuck: tuple[Stuck, ...]) -> None:
        """After a generation's workers were stopped: report any that SIGKILL did not end."""
        self.processes.workers_stopped(generation, stuck)
        if stuck:
            self._stuck = stuck
            self._record_incident(stuck_incident(self._node, generation, stuck, after="after stopping the workers",
                                                 wait_s=GIVE_UP_AFTER_S))

    def has_stuck(self) -> bool:
        return bool(self._stuck)

    def await_stuck(self) -> str | None:
        """Wait for workers SIGKILL did not end; returns why the node is unhealthy if they outlive the wait."""
        stuck, self._stuck = self._stuck, ()
        if not stuck:
            return None
        left = self.processes.wait_stuck(stuck, GIVE_UP_AFTER_S)
        if not left:
            self._emit(EventKind.STUCK_WORKERS_GONE, pids=[s.pid for s in stuck])
            return None
        reason = (f"{'; '.join(s.describe() for s in left)} after waiting {GIVE_UP_AFTER_S:.0f} s: the node needs "
                  "attention (a hung filesystem or driver); no new workers start beside it")
        self._emit(EventKind.NODE_UNHEALTHY, reason=reason, problems=[s.describe() for s in left])
        return reason

    def release(self) -> None:
        """Give up the node directory's lock (the agent ends)."""
        self.processes.release()
