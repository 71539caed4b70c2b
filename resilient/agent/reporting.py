"""What the agent shows the outside world: ``status.json`` (and its store copy) and ``/metrics``.

Wiring only.  The numbers come from the one authoritative ledger
(:class:`~resilient.agent.accounting.NodeAccounting`) and the tracker when a
snapshot is taken or a scrape arrives; nothing here keeps a second copy.
The status publisher is :class:`~resilient.agent.status.StatusPublisher`,
the exporter :class:`~resilient.metrics.exporter.MetricsServer` (imported
when the agent starts, so that importing the agent stays light).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..core.events import Emit, EventKind
from .accounting import NodeAccounting
from .config import AgentConfig
from .coordination import Coordination
from .rundir import RunDir
from .slowness import SlownessWatch
from .status import StatusPublisher
from .tracker import RankTracker

if TYPE_CHECKING:
    from .memory_tier import NodeMemory


class NodeReporting:
    """The node's status publisher and metrics server, started and stopped with the agent."""

    def __init__(self, config: AgentConfig, run_dir: RunDir, *, tracker: RankTracker, accounting: NodeAccounting,
                 coordination: Coordination, emit: Emit, clock: Callable[[], float] = time.monotonic) -> None:
        self._config = config
        self._accounting = accounting
        self._coordination = coordination
        self._emit = emit
        self._peak_flops: float | None = None
        self.metrics: Any = None
        self.spares_ready: Callable[[], int] | None = None
        self.memory: NodeMemory | None = None
        """The node's memory tier, for its gauges (set by the agent)."""
        """Warm spares now (set by the agent when in-process recovery is on offer)."""
        self.slowness: SlownessWatch | None = None
        """Straggler and slowdown detection (set by the agent)."""
        self.status = StatusPublisher(
            config, status_file=run_dir.status_file, control_socket=run_dir.socket_path("control.sock"),
            tracker=tracker, accounting=accounting, restarts_used=lambda: coordination.restarts_used_cached,
            refresh_restarts=coordination.restarts_used,
            store_put=coordination.control.put if config.store_url is not None else None, emit=emit, clock=clock,
            threads=coordination.threads)
        self.status.slowness = lambda: self.slowness.snapshot() if self.slowness is not None else None

    def start(self) -> None:
        """Start ``/metrics`` (when a port is configured), then the status publisher."""
        from ..metrics.exporter import MetricsServer
        from .accounting import device_peak_flops

        c = self._config
        self._peak_flops = device_peak_flops(c.peak_flops_per_device)
        if c.metrics_port is not None:
            self.metrics = MetricsServer(self.node_view, addr=c.metrics_addr, port=c.metrics_port)
            self._emit(EventKind.METRICS_LISTENING, port=self.metrics.port, url=self.metrics.url)
            print(f"resilient: metrics for node {c.node_id} at {self.metrics.url}", file=sys.stderr, flush=True)
            self.status.metrics_url = self.metrics.url
        self.status.start()

    def stop(self) -> None:
        """Write the final status and ``ledger.json``, then close ``/metrics``."""
        self.status.stop()
        self._accounting.save()
        if self.metrics is not None:
            self.metrics.close()

    def node_view(self) -> Any:
        """What a metrics scrape reports, computed now from the ledger and the agent's counters."""
        from ..metrics.exporter import NodeView
        from .accounting import job_mfu

        acc, a = self._accounting, self._accounting.account()
        c = self._config
        return NodeView(
            run_id=c.run_id, node=c.node_id, now=acc.now(), account=a,
            restarts_by_reason=dict(acc.restarts_by_reason), hangs=acc.hangs,
            recoveries_by_rung=dict(acc.recoveries_by_rung),
            spares_ready=self.spares_ready() if self.spares_ready is not None else 0,
            incidents_by_kind=dict(acc.incidents_by_kind), restarts_used=self._coordination.restarts_used_cached,
            restart_budget=c.restart.max_restarts, generation=a.generation or 0, world_size=a.world_size or 0,
            full_world_size=c.max_nodes * c.nproc_per_node, checkpoint_duration_s=acc.checkpoint_duration_s,
            checkpoint_bytes=acc.checkpoint_bytes, checkpoint_failures=acc.checkpoint_failures,
            stall_threshold_s=c.stall_alert_after_s, goodput_objective=c.goodput_objective,
            flops_per_step=c.flops_per_step,
            peak_flops=self._peak_flops * c.nproc_per_node if self._peak_flops is not None else None,
            mfu=job_mfu(a, c.flops_per_step, self._peak_flops),
            slowness=self.slowness.snapshot() if self.slowness is not None else None,
            quarantine=self.status.quarantine() if self.status.quarantine is not None else None,
            memory_bytes=self.memory.used_bytes() if self.memory is not None else None,
            memory_limit_bytes=self.memory.limit if self.memory is not None else None,
        )
