"""The goodput report of a run: a terminal table, a JSON file and a PNG for a lead's slides.

Reads each node's persisted ledger (``<run_dir>/nodes/<node>/ledger.json``);
the run's incidents are passed in by the caller (the CLI reads them with the
agent's reader: nothing in ``resilient.metrics`` imports the agent).  Nothing
is recomputed from logs, so the report says exactly what ``/metrics`` said.
matplotlib is imported only to draw.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import Any

from ..core.errors import ConfigError
from .catalogue import CATEGORIES

_COLORS = {
    "productive": "#2e7d32", "init": "#9e9e9e", "checkpoint_stall": "#1565c0", "failure_detection": "#c62828",
    "recovery": "#ef6c00", "replay": "#ad1457", "data_wait": "#6a1b9a", "slowdown_excess": "#f9a825",
    "degraded": "#00838f", "idle": "#d7ccc8",
}


@dataclass(frozen=True)
class NodeReport:
    node: str
    account: Any
    """The node ledger's Account at the end of its record."""


def load(run_dir: Path) -> list[NodeReport]:
    """Every node's account, as of the last event its ledger recorded."""
    from ..core.fsutil import read_json
    from .ledger import Ledger

    paths = sorted((run_dir / "nodes").glob("*/ledger.json"))
    if not paths:
        raise ConfigError(f"no ledger under {run_dir}/nodes: is it the --run-dir of a `resilient run`?")
    reports = []
    for path in paths:
        saved = read_json(path)
        if saved is None:
            raise ConfigError(f"{path} is not valid JSON; was the agent killed while writing it? It is rewritten "
                              "every second, so an older copy is not kept")
        ledger = Ledger.from_dict(saved["ledger"])
        reports.append(NodeReport(path.parent.name, ledger.account(ledger.last_t)))
    return reports


def _plain(value: Any) -> Any:
    if is_dataclass(value) and not isinstance(value, type):
        return {k: _plain(v) for k, v in asdict(value).items()}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def to_json(reports: Sequence[NodeReport], incidents: Sequence[dict[str, Any]],
            cadence: dict[str, Any] | None = None, priced: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    return {"nodes": {r.node: _plain(r.account) for r in reports}, "incidents": list(incidents),
            "checkpoint_cadence": {"event": cadence, "alternatives": list(priced)} if cadence else None}


def render_cadence(cadence: dict[str, Any] | None, priced: Sequence[dict[str, Any]],
                   reports: Sequence[NodeReport]) -> list[str]:
    """What the chosen durable interval costs against the alternatives, and what this run measured.

    ``priced``: the alternatives as the checkpoint package prices them (the caller computes them; metrics sits below
    checkpoint)."""
    if cadence is None or not priced:  # no event, or one without the numbers that chose it
        return []
    out = [(f"checkpoint cadence: every {cadence['every']} steps since step {cadence.get('step')} "
           f"({cadence.get('mtbf_source')}); {cadence.get('reason')}"),
           (f"  model: a save stalls {cadence['cost_s'] * 1e3:.1f} ms, a step takes {cadence['step_s'] * 1e3:.1f} ms, "
           f"a failure every {_fmt_s(cadence['mtbf_s'])} redoes half an interval"),
           f"  {'every':>14}  {'saves':>9}  {'redone':>9}  {'lost':>9}  (seconds per hour)"]
    for a in priced:
        label = f"{a['every']} ({a['label']})"
        out.append(f"  {label:>14}  {a['stall_s_per_h']:9.1f}  {a['redo_s_per_h']:9.1f}  {a['lost_s_per_h']:9.1f}")
    for r in reports:
        a = r.account
        hours = a.wall_s / 3600 if a.wall_s > 0 else 0.0
        if hours:
            out.append(f"  measured on node {r.node}: checkpoint stall {a.seconds['checkpoint_stall'] / hours:.1f} s/h, "
                       f"replay {a.seconds['replay'] / hours:.1f} s/h over {_fmt_s(a.wall_s)}")
    return out


def _fmt_s(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.2f} h"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.1f} s"


def render(reports: Sequence[NodeReport], incidents: Sequence[dict[str, Any]],
           cadence: dict[str, Any] | None = None, priced: Sequence[dict[str, Any]] = ()) -> str:
    out = []
    for r in reports:
        a = r.account
        out.append(f"node {r.node}: wall {_fmt_s(a.wall_s)}, goodput {a.goodput_ratio:.1%}, ETTR {a.ettr:.1%}, "
                   f"ideal step {'-' if a.ideal_step_s is None else f'{a.ideal_step_s * 1000:.1f} ms'}"
                   f" ({a.ideal_source or 'not enough steps'})")
        width = max(len(c) for c in CATEGORIES)
        for category in CATEGORIES:
            seconds = a.seconds[category]
            share = seconds / a.wall_s if a.wall_s > 0 else 0.0
            bar = "#" * round(share * 40)
            out.append(f"  {category:<{width}}  {_fmt_s(seconds):>10}  {share:6.1%}  {bar}")
        out.append(f"  committed: step {a.committed_step}, {a.committed_tokens} tokens; attempted "
                   f"{a.attempted_steps} steps ({a.attempted_tokens} tokens), replayed {a.replayed_steps} steps "
                   f"({a.replayed_tokens} tokens)")
        if a.saves_deferred:
            out.append(f"  checkpoints: {a.saves_deferred} scheduled saves deferred (writer busy), taken "
                       f"{a.deferred_steps} steps late in all: extra steps at risk")
        if a.resumes_diverged:
            out.append(f"  not the same run from step {a.diverged_from_step}: {a.resumes_diverged} resume(s) were "
                       "not where the saving run was and went on, accepted (--resume-check accept)")
        for cost in a.incidents:
            out.append(f"  incident {cost.id} ({cost.kind}) cost {_fmt_s(cost.total_s)}: "
                       f"{_fmt_s(cost.detection_s)} to detect, {_fmt_s(cost.recovery_s)} to restart, "
                       f"{_fmt_s(cost.replay_s)} replayed")
    out += render_cadence(cadence, priced, reports)
    if incidents:
        out.append("incidents (first failure, from the run directory):")
        for inc in incidents:
            out.append(f"  {inc.get('id')}: {inc.get('summary')}")
    return "\n".join(out)


def plot(reports: Sequence[NodeReport], incidents: Sequence[dict[str, Any]], path: Path) -> None:
    """Timeline of categories with incidents marked, step time, and goodput over time, one column per node."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ConfigError("the PNG needs matplotlib: pip install matplotlib (or 'resilient-train[report]')") from e
    fig, axes = plt.subplots(3, len(reports), figsize=(11 * len(reports), 8), sharex="col", squeeze=False)
    for col, r in enumerate(reports):
        a = r.account
        buckets = list(a.timeline)
        t0 = buckets[0].t0 if buckets else 0.0
        mids = [((b.t0 + b.t1) / 2 - t0) / 60 for b in buckets]
        widths = [(b.t1 - b.t0) / 60 for b in buckets]
        bottom = [0.0] * len(buckets)
        ax = axes[0][col]
        for category in CATEGORIES:
            shares = [b.seconds.get(category, 0.0) / max(b.t1 - b.t0, 1e-9) for b in buckets]
            if any(shares):
                ax.bar(mids, shares, widths, bottom=bottom, color=_COLORS[category], label=category, linewidth=0)
                bottom = [x + y for x, y in zip(bottom, shares)]
        for cost in a.incidents:
            x = (cost.started_t - t0) / 60
            for row in axes[:, col]:
                row.axvline(x, color="black", linestyle="--", linewidth=1)
            ax.annotate(f"{cost.kind} {cost.id}\n{cost.total_s:.0f} s lost", (x, 1.02), fontsize=8, ha="left",
                        xycoords=("data", "axes fraction"))
        ax.set_ylabel("share of wall time")
        ax.set_ylim(0, 1)
        ax.set_title(f"node {r.node}: goodput {a.goodput_ratio:.1%}, ETTR {a.ettr:.1%}", pad=24)
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
        steps = [(m, b.mean_step_s * 1000) for m, b in zip(mids, buckets) if b.mean_step_s]
        axes[1][col].plot([m for m, _ in steps], [s for _, s in steps], color="#37474f")
        if a.ideal_step_s:
            axes[1][col].axhline(a.ideal_step_s * 1000, color=_COLORS["productive"], linestyle=":", label="ideal")
            axes[1][col].legend(fontsize=8)
        axes[1][col].set_ylabel("mean step time (ms)")
        cumulative, wall, points = 0.0, 0.0, []
        for m, b in zip(mids, buckets):
            cumulative += b.seconds.get("productive", 0.0)
            wall += b.t1 - b.t0
            points.append((m, cumulative / wall if wall else 0.0))
        axes[2][col].plot([m for m, _ in points], [g for _, g in points], color=_COLORS["productive"])
        axes[2][col].set_ylim(0, 1)
        axes[2][col].set_ylabel("goodput so far")
        axes[2][col].set_xlabel("minutes since the run started")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(run_dir: Path, incidents: Sequence[dict[str, Any]], out_dir: Path | None = None,
                 png: bool = True, cadence: dict[str, Any] | None = None,
                 priced: Sequence[dict[str, Any]] = ()) -> tuple[str, Path, Path | None]:
    """Build the report; return (table text, JSON path, PNG path or None).

    ``incidents`` are the run's incident records, oldest first; the caller
    reads them (the agent owns their format, and metrics sits below the agent).
    ``cadence``: the run's newest ``checkpoint_cadence`` event, if any; ``priced``: its interval against the
    alternatives (``resilient.checkpoint.cadence.priced_alternatives``).
    """
    reports = load(run_dir)
    out = out_dir or run_dir
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "goodput.json"
    json_path.write_text(json.dumps(to_json(reports, incidents, cadence, priced), indent=1, default=str))
    png_path = None
    if png:
        png_path = out / "goodput.png"
        plot(reports, incidents, png_path)
    return render(reports, incidents, cadence, priced), json_path, png_path
