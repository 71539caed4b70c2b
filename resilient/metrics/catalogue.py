"""The one catalogue of metric names: the exporter, the dashboards and the alert rules use these.

A test checks that every metric a dashboard panel or an alert rule names is
here, and that the exporter serves exactly these.  Names follow Prometheus
conventions: ``resilient_`` prefix, base units (seconds, bytes), ``_total``
for counters, ``_ratio`` for 0..1 gauges.  Label values are bounded: run id
and node are fixed for an agent's life, rank is below the world size, and
``category``, ``reason``, ``kind`` and ``scope`` take values from the
closed sets below.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.events import FAILURE_KINDS, OutcomeKind

CATEGORIES = (
    "productive",
    "init",
    "checkpoint_stall",
    "failure_detection",
    "recovery",
    "replay",
    "data_wait",
    "slowdown_excess",
    "degraded",
    "idle",
)
"""Where every second of wall time goes; exactly one category at a time, summing to wall time."""

BADPUT_CATEGORIES = CATEGORIES[1:]
INCIDENT_KINDS: tuple[str, ...] = FAILURE_KINDS
RESTART_REASONS: tuple[str, ...] = (*FAILURE_KINDS, OutcomeKind.MEMBERSHIP.value)
RECOVERY_RUNGS: tuple[str, ...] = ("retry_in_place", "promote_spare", "shrink", "grow")
"""The in-process rungs of the recovery ladder the agent carries out (resilient.elastic.decide.Action values),
and growing back onto a spare."""
SCOPES = ("run", "window")
"""``run``: since the run started; ``window``: the rolling window (default one hour)."""

STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
"""Upper bounds (seconds) of the step-duration histogram."""


@dataclass(frozen=True)
class Metric:
    name: str
    type: str
    """"counter", "gauge" or "histogram" (as Prometheus exposes them)."""
    help: str
    labels: tuple[str, ...]


_NODE = ("run_id", "node")

METRICS: tuple[Metric, ...] = (
    Metric("resilient_agent_info", "gauge", "1 for each agent; labels carry its version", (*_NODE, "version")),
    Metric("resilient_wall_seconds_total", "counter", "Wall time accounted since the run started", _NODE),
    Metric("resilient_goodput_seconds_total", "counter", "Seconds of productive training (new steps at ideal speed)",
           _NODE),
    Metric("resilient_badput_seconds_total", "counter", "Seconds lost, by category", (*_NODE, "category")),
    Metric("resilient_goodput_ratio", "gauge", "Productive seconds over wall seconds", (*_NODE, "scope")),
    Metric("resilient_ettr_ratio", "gauge",
           "Effective training time ratio: wall time not lost to init, failures, recovery, replay or idling",
           (*_NODE, "scope")),
    Metric("resilient_ideal_step_seconds", "gauge", "Ideal step time (set, or mean of steps <= median + 3 MAD)",
           _NODE),
    Metric("resilient_committed_step", "gauge", "Newest committed (checkpointed) step", _NODE),
    Metric("resilient_last_commit_timestamp_seconds", "gauge",
           "Unix time at which the agent saw the newest commit", _NODE),
    Metric("resilient_last_progress_timestamp_seconds", "gauge",
           "Unix time at which a new (not replayed) step last completed (before the first: the run's start)",
           _NODE),
    Metric("resilient_stall_threshold_seconds", "gauge",
           "Seconds without a new step after which the run counts as stalled (alerting threshold)", _NODE),
    Metric("resilient_goodput_objective_ratio", "gauge", "Goodput objective of the run (alerting threshold)", _NODE),
    Metric("resilient_attempted_steps_total", "counter", "Steps computed, including replays", _NODE),
    Metric("resilient_replayed_steps_total", "counter", "Steps computed again after a rollback", _NODE),
    Metric("resilient_committed_tokens_total", "counter", "Tokens of committed progress", _NODE),
    Metric("resilient_attempted_tokens_total", "counter", "Tokens computed, including replays", _NODE),
    Metric("resilient_replayed_tokens_total", "counter", "Tokens computed again after a rollback", _NODE),
    Metric("resilient_mfu_ratio", "gauge",
           "Model FLOPs utilisation of new steps over the time they took, run or rolling window (needs a known peak)",
           (*_NODE, "scope")),
    Metric("resilient_model_flops_per_step", "gauge", "Model FLOPs of one optimizer step, whole job", _NODE),
    Metric("resilient_peak_flops", "gauge", "Peak FLOP/s of this node's devices, as configured or looked up", _NODE),
    Metric("resilient_step_duration_seconds", "histogram", "Duration of each step, per rank", (*_NODE, "rank")),
    Metric("resilient_restarts_total", "counter", "Group restarts, by reason", (*_NODE, "reason")),
    Metric("resilient_hangs_total", "counter", "Hangs detected", _NODE),
    Metric("resilient_recoveries_total", "counter",
           "Failures answered in process (no restart) and growths, by rung: retry_in_place, promote_spare, shrink "
           "after a failure, grow back onto a spare", (*_NODE, "rung")),
    Metric("resilient_spares_ready", "gauge", "Spare workers warm and waiting to take a failed rank's place", _NODE),
    Metric("resilient_memory_tier_bytes", "gauge", "Bytes the node's memory tier holds (every rank's slots)", _NODE),
    Metric("resilient_memory_tier_limit_bytes", "gauge", "Bytes the node's memory tier may hold (--memory-limit)",
           _NODE),
    Metric("resilient_incidents_total", "counter", "Incidents, by kind", (*_NODE, "kind")),
    Metric("resilient_restarts_used", "gauge", "Restarts counted against the run's budget", _NODE),
    Metric("resilient_restart_budget", "gauge", "The run's restart budget (--max-restarts)", _NODE),
    Metric("resilient_checkpoint_age_seconds", "gauge", "Seconds since the newest commit was seen", _NODE),
    Metric("resilient_checkpoint_duration_seconds", "gauge", "Duration of the latest save, snapshot to commit",
           _NODE),
    Metric("resilient_checkpoint_bytes", "gauge", "Size of the newest finished save (all files of the checkpoint)",
           _NODE),
    Metric("resilient_checkpoint_failures_total", "counter", "Saves that failed (the run went on)", _NODE),
    Metric("resilient_checkpoint_saves_deferred_total", "counter",
           "Scheduled saves not taken at their step because the previous save was still being written", _NODE),
    Metric("resilient_checkpoint_deferred_steps_total", "counter",
           "Steps by which deferred saves were taken late, summed (extra steps at risk)", _NODE),
    Metric("resilient_resumes_diverged_total", "counter",
           "Resumes that were not where the saving run was and went on, accepted (--resume-check accept)", _NODE),
    Metric("resilient_world_size", "gauge", "Ranks in the current generation", _NODE),
    Metric("resilient_full_world_size", "gauge", "Ranks the run has with every node present", _NODE),
    Metric("resilient_generation", "gauge", "Current generation (rendezvous round) number", _NODE),
    Metric("resilient_straggler_score", "gauge",
           "A rank's seconds per step in a section over its peers' median, latest window (1.25: 25% slower)",
           (*_NODE, "rank", "section")),
    Metric("resilient_straggler_flagged", "gauge",
           "1 while a rank is flagged as persistently slower than its peers in a section", (*_NODE, "rank", "section")),
    Metric("resilient_slowdown_active", "gauge", "1 while the job's step time is above its own baseline", _NODE),
    Metric("resilient_slowdown_ratio", "gauge", "The job's step time over its baseline while a slowdown lasts", _NODE),
    Metric("resilient_baseline_step_seconds", "gauge",
           "The job's baseline seconds per step (the slowdown detector's, boundary to boundary)", _NODE),
    Metric("resilient_node_quarantined", "gauge",
           "1 while this node has a quarantine record in force (it stays out of every rendezvous)", _NODE),
    Metric("resilient_node_quarantine_offences", "gauge",
           "Times this node was quarantined in its fleet (each offence doubles the next expiry)", _NODE),
)

BY_NAME = {m.name: m for m in METRICS}


def series_names() -> frozenset[str]:
    """Every series name a scrape can contain (histograms add _bucket, _sum and _count)."""
    names: set[str] = set()
    for m in METRICS:
        if m.type == "histogram":
            names.update({f"{m.name}_bucket", f"{m.name}_sum", f"{m.name}_count"})
        else:
            names.add(m.name)
    return frozenset(names)
