"""Prometheus ``/metrics`` for one node agent, computed on scrape.

There is no second copy of the numbers: each scrape asks the agent for a
:class:`NodeView` (the ledger's account at that moment plus the agent's own
counters) and turns it into metric families named in
:mod:`resilient.metrics.catalogue`.  ``prometheus_client`` is imported
lazily, when a server is started (``pip install prometheus-client``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from .. import __version__
from ..core.errors import ConfigError
from .catalogue import BADPUT_CATEGORIES, BY_NAME, INCIDENT_KINDS, RECOVERY_RUNGS, RESTART_REASONS, STEP_BUCKETS


@dataclass(frozen=True, kw_only=True)
class NodeView:
    """Everything one scrape reports, gathered by the agent at scrape time."""

    run_id: str
    node: str
    now: float
    """Wall time of the scrape."""
    account: Any
    """The ledger's :class:`~resilient.metrics.ledger.Account` at ``now``."""
    restarts_by_reason: Mapping[str, int] = field(default_factory=dict)
    recoveries_by_rung: Mapping[str, int] = field(default_factory=dict)
    spares_ready: int = 0
    hangs: int = 0
    incidents_by_kind: Mapping[str, int] = field(default_factory=dict)
    restarts_used: int = 0
    restart_budget: int = 0
    generation: int = 0
    world_size: int = 0
    full_world_size: int = 0
    checkpoint_duration_s: float | None = None
    checkpoint_bytes: int | None = None
    checkpoint_failures: int = 0
    stall_threshold_s: float = 600.0
    goodput_objective: float = 0.9
    flops_per_step: float | None = None
    peak_flops: float | None = None
    mfu: Mapping[str, float | None] = field(default_factory=dict)
    """MFU by scope ("run", "window"); None where it cannot be computed."""
    slowness: Mapping[str, Any] | None = None
    """Straggler scores and the slowdown state (:meth:`~resilient.agent.slowness.SlownessWatch.snapshot`)."""
    quarantine: Mapping[str, Any] | None = None
    """Across machines: this node's quarantine (:meth:`~resilient.agent.quarantine_gate.QuarantineGate.view`)."""
    memory_bytes: int | None = None
    """Bytes the node's memory tier holds; None without one."""
    memory_limit_bytes: int | None = None


def families(view: NodeView) -> Iterator[Any]:
    """The metric families of one scrape."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    base = [view.run_id, view.node]
    a = view.account

    def fam(name: str) -> Any:
        spec = BY_NAME[name]
        kind = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily, "histogram": HistogramMetricFamily}
        # Counter families take the name without _total; the client appends it.
        family_name = name[: -len("_total")] if spec.type == "counter" else name
        return kind[spec.type](family_name, spec.help, labels=list(spec.labels))

    def one(name: str, value: float | None, *extra: str) -> Any:
        """A family of one series; a gauge not known yet is NaN (exported from the first scrape, so a panel or
        a rule finds it), a counter not known yet is left out."""
        f = fam(name)
        if value is not None and not math.isnan(value):
            f.add_metric([*base, *extra], float(value))
        elif BY_NAME[name].type == "gauge":
            f.add_metric([*base, *extra], math.nan)
        return f

    f = fam("resilient_agent_info")
    f.add_metric([*base, __version__], 1.0)
    yield f
    yield one("resilient_wall_seconds_total", a.wall_s)
    yield one("resilient_goodput_seconds_total", a.seconds["productive"])
    f = fam("resilient_badput_seconds_total")
    for category in BADPUT_CATEGORIES:
        f.add_metric([*base, category], a.seconds[category])
    yield f
    for name, run_value, window_value in (
        ("resilient_goodput_ratio", a.goodput_ratio, a.window.goodput_ratio),
        ("resilient_ettr_ratio", a.ettr, a.window.ettr),
        ("resilient_mfu_ratio", view.mfu.get("run"), view.mfu.get("window")),
    ):
        f = fam(name)
        for scope, value in (("run", run_value), ("window", window_value)):
            f.add_metric([*base, scope], math.nan if value is None else float(value))
        yield f
    yield one("resilient_ideal_step_seconds", a.ideal_step_s)
    yield one("resilient_committed_step", a.committed_step)
    yield one("resilient_last_commit_timestamp_seconds", a.last_commit_t)
    # Before the first new step, the run's start: a run stuck in initialisation also counts as stalled.
    yield one("resilient_last_progress_timestamp_seconds",
              a.last_progress_t if a.last_progress_t is not None else a.now - a.wall_s)
    yield one("resilient_stall_threshold_seconds", view.stall_threshold_s)
    yield one("resilient_goodput_objective_ratio", view.goodput_objective)
    yield one("resilient_attempted_steps_total", a.attempted_steps)
    yield one("resilient_replayed_steps_total", a.replayed_steps)
    yield one("resilient_committed_tokens_total", a.committed_tokens)
    yield one("resilient_attempted_tokens_total", a.attempted_tokens)
    yield one("resilient_replayed_tokens_total", a.replayed_tokens)
    yield one("resilient_model_flops_per_step", view.flops_per_step)
    yield one("resilient_peak_flops", view.peak_flops)
    f = fam("resilient_step_duration_seconds")
    for rank, (counts, total, count) in sorted(a.step_histograms.items()):
        cumulative, buckets = 0, []
        for bound, n in zip([*STEP_BUCKETS, math.inf], counts):
            cumulative += n
            buckets.append(("+Inf" if math.isinf(bound) else repr(float(bound)), cumulative))
        f.add_metric([*base, str(rank)], buckets, sum_value=total)
    yield f
    f = fam("resilient_restarts_total")
    for reason in RESTART_REASONS:
        f.add_metric([*base, reason], view.restarts_by_reason.get(reason, 0))
    yield f
    yield one("resilient_hangs_total", view.hangs)
    f = fam("resilient_recoveries_total")
    for rung in RECOVERY_RUNGS:
        f.add_metric([*base, rung], view.recoveries_by_rung.get(rung, 0))
    yield f
    yield one("resilient_spares_ready", view.spares_ready)
    yield one("resilient_memory_tier_bytes", view.memory_bytes)
    yield one("resilient_memory_tier_limit_bytes", view.memory_limit_bytes)
    f = fam("resilient_incidents_total")
    for kind in INCIDENT_KINDS:
        f.add_metric([*base, kind], view.incidents_by_kind.get(kind, 0))
    yield f
    yield one("resilient_restarts_used", view.restarts_used)
    yield one("resilient_restart_budget", view.restart_budget)
    age = None if a.last_commit_t is None else max(0.0, view.now - a.last_commit_t)
    yield one("resilient_checkpoint_age_seconds", age)
    yield one("resilient_checkpoint_duration_seconds", view.checkpoint_duration_s)
    yield one("resilient_checkpoint_bytes", view.checkpoint_bytes)
    yield one("resilient_checkpoint_failures_total", view.checkpoint_failures)
    yield one("resilient_checkpoint_saves_deferred_total", a.saves_deferred)
    yield one("resilient_checkpoint_deferred_steps_total", a.deferred_steps)
    yield one("resilient_resumes_diverged_total", a.resumes_diverged)
    yield one("resilient_world_size", view.world_size)
    yield one("resilient_full_world_size", view.full_world_size)
    yield one("resilient_generation", view.generation)
    yield from _slowness(view.slowness or {}, fam, base)
    q = view.quarantine or {}
    yield one("resilient_node_quarantined", 1.0 if q.get("standing") else 0.0)
    yield one("resilient_node_quarantine_offences", float(q.get("offences", 0)))


def _slowness(snap: Mapping[str, Any], fam: Callable[[str], Any], base: list[str]) -> Iterator[Any]:
    """The straggler and slowdown gauges from the detectors' snapshot."""
    score, flagged = fam("resilient_straggler_score"), fam("resilient_straggler_flagged")
    for s in snap.get("scores", []):  # the scorer's agent shows every rank's, each labelled with its own node
        labels = [base[0], str(s.get("node") or base[1]), str(s["rank"]), s["section"]]
        score.add_metric(labels, float(s["relative"]))
        flagged.add_metric(labels, 1.0 if s["flagged"] else 0.0)
    yield score
    yield flagged
    slow = snap.get("slowdown")
    active, ratio, baseline = fam("resilient_slowdown_active"), fam("resilient_slowdown_ratio"), \
        fam("resilient_baseline_step_seconds")
    active.add_metric(base, 1.0 if slow else 0.0)
    ratio.add_metric(base, float(slow["ratio"]) if slow else math.nan)  # NaN: no slowdown to measure
    known = snap.get("baseline_s")
    baseline.add_metric(base, math.nan if known is None else float(known))  # NaN: no baseline yet
    yield active
    yield ratio
    yield baseline


class _Collector:
    def __init__(self, view: Callable[[], NodeView]) -> None:
        self._view = view

    def collect(self) -> Iterator[Any]:
        yield from families(self._view())

    def describe(self) -> list[Any]:
        return []  # no describe-time scrape: registering must not compute a view


class MetricsServer:
    """``/metrics`` over HTTP on ``addr:port`` (port 0: a free one; see :attr:`port`)."""

    def __init__(self, view: Callable[[], NodeView], *, addr: str = "127.0.0.1", port: int = 0) -> None:
        try:
            from prometheus_client import CollectorRegistry, start_http_server
        except ImportError as e:
            raise ConfigError("--metrics-port needs prometheus-client: pip install prometheus-client") from e
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(view))  # type: ignore[arg-type]
        try:
            self._server, self._thread = start_http_server(port, addr=addr, registry=self.registry)
        except OSError as e:
            raise ConfigError(f"cannot serve metrics on {addr}:{port} ({e.strerror}); pick another --metrics-port "
                              "or 0 for a free one") from None
        self.addr = addr
        self.port = int(self._server.server_port)

    @property
    def url(self) -> str:
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"http://{host}:{self.port}/metrics"

    def scrape_text(self) -> str:
        """The exposition text a scrape would get (for tests and `resilient status`)."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
