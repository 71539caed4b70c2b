"""The ledger's configuration and its results: :class:`LedgerConfig`, :class:`Account` and friends.

Results are frozen dataclasses built by :meth:`resilient.metrics.ledger.Ledger.account`;
:class:`IncidentCost` says what one failure cost, split into detection,
recovery and replay.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.errors import ConfigError
from .timeline import Bucket

__all__ = ["Account", "Bucket", "IncidentCost", "LedgerConfig", "WindowAccount"]


@dataclass(frozen=True, kw_only=True)
class LedgerConfig:
    """How the ledger measures."""

    ideal_step_s: float | None = None
    """Ideal step time set by the user (seconds); None: measured (mean of recent steps <= median + 3 MAD)."""
    window_s: float = 3600.0
    """Length of the rolling window for the ``window`` ratios (seconds)."""
    timeline_max_buckets: int = 2000
    """Most timeline buckets kept; past it neighbours merge and the bucket width doubles."""
    timeline_bucket_s: float = 1.0
    """Initial timeline bucket width (seconds)."""
    reservoir: int = 512
    """How many recent new-step durations the measured ideal is computed from."""
    min_steps_for_ideal: int = 5
    """New steps needed before a measured ideal exists (until then step time counts as productive)."""
    max_relabel_segments: int = 256
    """Attributed intervals kept for re-labelling as failure detection; older ones cannot be re-labelled."""
    max_uncommitted_steps: int = 4096
    """Steps whose cumulative tokens are remembered until committed; older ones are forgotten."""

    def __post_init__(self) -> None:
        if self.ideal_step_s is not None and not self.ideal_step_s > 0:
            raise ConfigError(f"LedgerConfig(ideal_step_s={self.ideal_step_s}): must be > 0 seconds, or None to "
                              "measure it")
        if not self.window_s > 0:
            raise ConfigError(f"LedgerConfig(window_s={self.window_s}): the rolling window must be > 0 seconds")
        if self.timeline_max_buckets < 2:
            raise ConfigError(f"LedgerConfig(timeline_max_buckets={self.timeline_max_buckets}): must be >= 2")
        if not self.timeline_bucket_s > 0:
            raise ConfigError(f"LedgerConfig(timeline_bucket_s={self.timeline_bucket_s}): must be > 0 seconds")
        if self.reservoir < 1:
            raise ConfigError(f"LedgerConfig(reservoir={self.reservoir}): must keep at least 1 step duration")
        if not 1 <= self.min_steps_for_ideal <= self.reservoir:
            raise ConfigError(f"LedgerConfig(min_steps_for_ideal={self.min_steps_for_ideal}): must be between 1 "
                              f"and reservoir={self.reservoir}")
        if self.max_relabel_segments < 1 or self.max_uncommitted_steps < 1:
            raise ConfigError("LedgerConfig: max_relabel_segments and max_uncommitted_steps must be >= 1")


@dataclass(frozen=True)
class IncidentCost:
    """What one failure cost this node, in seconds of wall time."""

    id: str
    kind: str
    detection_s: float
    """From the failing rank's last progress to the detection."""
    recovery_s: float
    """From the detection to the first step (new or replayed) of the recovered run."""
    replay_s: float
    """Seconds spent re-doing steps lost to the rollback."""
    total_s: float
    started_t: float
    """When the failing rank last made progress: where the cost starts."""
    detected_t: float
    open: bool
    """Still accruing cost (recovering, or replaying lost steps)."""


@dataclass(frozen=True)
class WindowAccount:
    """The ratios over the rolling window (the last ``window_s``, or the whole run if shorter)."""

    window_s: float
    wall_s: float
    seconds: dict[str, float]
    goodput_ratio: float
    ettr: float
    new_steps: float
    """New (not replayed) steps completed in the window; those of the bucket straddling its start pro rata."""


@dataclass(frozen=True)
class Account:
    """Where this node's wall time went, as of ``now``."""

    now: float
    wall_s: float
    seconds: dict[str, float]
    """Seconds by category (catalogue.CATEGORIES); they sum to ``wall_s``."""
    goodput_ratio: float
    ettr: float
    """Wall time not lost to init, failure detection, recovery, replay or idling, over wall time."""
    window: WindowAccount
    ideal_step_s: float | None
    ideal_source: str | None
    """"user", "measured", or None while too few steps were measured."""
    committed_step: int | None
    committed_tokens: int
    committed_samples: int
    attempted_steps: int
    attempted_tokens: int
    replayed_steps: int
    replayed_tokens: int
    last_progress_t: float | None
    last_commit_t: float | None
    step_histograms: dict[int, tuple[tuple[int, ...], float, int]]
    """Per rank: (counts per catalogue.STEP_BUCKETS bucket and +Inf, not cumulative; sum; count)."""
    incidents: tuple[IncidentCost, ...]
    timeline: tuple[Bucket, ...]
    generation: int
    world_size: int
    full_world_size: int
    clamped_events: int
    """Events whose time was earlier than the previous event's and was clamped to it."""
    saves_deferred: int = 0
    """Scheduled saves not taken at their step because the writer was busy (taken later)."""
    deferred_steps: int = 0
    """Steps by which deferred saves were taken late, summed: extra steps a failure could have cost."""
    resumes_diverged: int = 0
    """Resumes that were not where the saving run was and went on, accepted (``--resume-check accept``)."""
    diverged_from_step: int | None = None
    """The earliest step such a resume began at: from there the run is not the one that never stopped."""
