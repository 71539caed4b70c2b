"""What a generation works with: :class:`GenerationContext`, the pieces of the agent it is handed.

The supervisor builds one per generation; the generation's watch loop and the executors of its decisions
(:mod:`.failures`, :mod:`.recover`, :mod:`.continuation`, :mod:`.eviction`, the cross-machine
:mod:`.cluster_flow`) read it.  It lives apart from all of them so that each can name its type without importing
the others.  What the generation asks of the agent around it goes through three small interfaces:
:class:`Asked` (stops, interrupts, nodes waiting, a quarantine), :class:`Books` (what it records) and
:class:`Generations` (the restart history the one decision reads, the generation counter it moves).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any, Protocol

from ..core.events import Emit
from ..core.supervised import ThreadReports

if TYPE_CHECKING:
    from ..coord.quarantine import Standing
    from .accounting import NodeAccounting
    from .config import AgentConfig
    from .decision import Restarts
    from .forking import Spawner
    from .incidents import Incident
    from .inproc import InProcess
    from .restores import RestoreSummary
    from .rundir import RunDir
    from .shared import SharedFacts
    from .slowness import SlownessWatch
    from .status import StatusPublisher
    from .sweep import Stuck
    from .timing_link import TimingLink
    from .tracker import RankTracker


class Asked(Protocol):
    """What the generation is asked from outside it, read on its watch loop's passes."""

    def stop_requested(self) -> str | None:
        """Why this agent was asked to stop gracefully (SIGTERM, the control socket), or None."""

    def interrupted(self) -> bool:
        """SIGINT: stop now, without a checkpoint."""

    def nodes_waiting(self) -> int:
        """Nodes waiting to join the run (reads the store: called from the peer watch's thread only)."""

    def quarantined(self) -> Standing | None:
        """Across machines: this node's quarantine record, from the quarantine gate's watch of it (None: none,
        or no gate)."""


class Books(Protocol):
    """Where the generation records what happened to it, in the agent's books and incidents."""

    def workers_started(self, generation: int, pids: dict[int, int]) -> None:
        """A generation's worker pids (for a later agent's sweep)."""

    def workers_stopped(self, generation: int, stuck: tuple[Stuck, ...]) -> None:
        """Workers of a generation that SIGKILL did not end."""

    def restored(self, summary: RestoreSummary) -> None:
        """What this node's ranks of a generation restored (once per generation)."""

    def record_incident(self, incident: Incident) -> None:
        """An incident, now (in-process recovery: the generation goes on, the lifecycle never sees it)."""

    def recovered(self, incident_id: str, record: dict[str, Any]) -> None:
        """An in-process recovery completed: its record, appended to the incident that started it."""


class Generations(Protocol):
    """The run's restarts and generations, as the one decision (:mod:`.decision`) and its executors need them."""

    def restarts(self) -> Restarts:
        """The run's restart history now (from the store) and the restart policy's bounds."""

    def next_generation(self) -> int:
        """Take the run's next generation number (an in-process recovery starts one without a rendezvous)."""


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
    asked: Asked
    books: Books
    generations: Generations
    inproc: InProcess | None = None
    """In-process recovery on offer (None: every failure ends the generation)."""
    slowness: SlownessWatch | None = None
    """Straggler and slowdown detection over the ranks' timing windows."""
    spawner: Spawner | None = None
    """Starts the workers (forked from the agent's fork server when it can); None: the plain way."""
    settle_heartbeats: Callable[[], None] | None = None
    """Hand every heartbeat already queued to the tracker (called when workers exited non-zero)."""
    threads: ThreadReports = field(default_factory=ThreadReports)
    """Where the generation's supervised threads (the peer watch) report an unexpected error."""
    timing_link: TimingLink | None = None
    """Across machines: sends this node's timing windows to the scorer, and receives every node's as the scorer."""
