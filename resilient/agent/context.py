"""What a generation works with: :class:`GenerationContext`, the pieces of the agent it is handed.

The supervisor builds one per generation; the generation's watch loop and the executors of its decisions
(:mod:`.failures`, :mod:`.recover`, :mod:`.continuation`, :mod:`.eviction`, the cross-machine
:mod:`.cluster_flow`) read it.  It lives apart from all of them so that each can name its type without importing
the others.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any

from ..core.events import Emit
from ..core.supervised import ThreadReports

if TYPE_CHECKING:
    from ..coord.quarantine import Standing
    from ..elastic.observe import RestartOutlook
    from .accounting import NodeAccounting
    from .config import AgentConfig
    from .forking import Spawner
    from .incidents import Incident
    from .inproc import InProcess
    from .policy import Failure
    from .restores import RestoreSummary
    from .rundir import RunDir
    from .shared import SharedFacts
    from .slowness import SlownessWatch
    from .status import StatusPublisher
    from .sweep import Stuck
    from .timing_link import TimingLink
    from .tracker import RankTracker


@dataclass(frozen=True)
class GenerationContext:
    """The pieces of the agent a generation uses, and nothing else."""

    config: AgentConfig
    run_dir: RunDir
    launch_id: str
    clock: Callable[[], float]
    echo_to: IO[str]
    tracker: RankTracker
    accounting: NodeAccounting
    status: StatusPublisher
    shared: SharedFacts
    """The launch's verdict, stop and stop request in the store."""
    emit: Emit
    waiting: Callable[[], int]
    """Nodes waiting to join the run (reads the store: called from PeerWatch's thread only)."""
    stop_requested: Callable[[], str | None]
    """Why this agent was asked to stop gracefully (SIGTERM, the control socket), or None."""
    interrupted: Callable[[], bool]
    """SIGINT: stop now, without a checkpoint."""
    workers_started: Callable[[int, dict[int, int]], None]
    """Record a generation's worker pids (for a later agent's sweep)."""
    workers_stopped: Callable[[int, tuple[Stuck, ...]], None]
    """Report workers of a generation that SIGKILL did not end."""
    restored: Callable[[RestoreSummary], None]
    """Report what this node's ranks of a generation restored (once per generation)."""
    inproc: InProcess | None = None
    """In-process recovery on offer (None: every failure ends the generation)."""
    restart_outlook: Callable[[Failure], RestartOutlook] | None = None
    """What the restart policy would say about ``failure`` now (the ladder's lower rungs)."""
    next_generation: Callable[[], int] | None = None
    """Take the run's next generation number (an in-process recovery starts one without a rendezvous)."""
    record_incident: Callable[[Incident], None] | None = None
    """Record an incident now (in-process recovery: the generation goes on, the supervisor never sees it)."""
    recovered: Callable[[str, dict[str, Any]], None] | None = None
    """An in-process recovery completed: append its record to the incident that started it."""
    slowness: SlownessWatch | None = None
    """Straggler and slowdown detection over the ranks' timing windows."""
    quarantined: Callable[[], Standing | None] | None = None
    """Across machines: this node's quarantine record, from the quarantine gate's watch of it (the peer watch asks
    every second; a request only while the watch is not following etcd)."""
    spawner: Spawner | None = None
    """Starts the workers (forked from the agent's fork server when it can); None: the plain way."""
    settle_heartbeats: Callable[[], None] | None = None
    """Hand every heartbeat already queued to the tracker (called when workers exited non-zero)."""
    threads: ThreadReports = field(default_factory=ThreadReports)
    timing_link: TimingLink | None = None
    """Across machines: sends this node's timing windows to the scorer, and receives every node's as the scorer."""
    """Where the generation's supervised threads (the peer watch) report an unexpected error."""
