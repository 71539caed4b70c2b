"""A drill's timeline as a PNG: each rank's completed steps over time, with the faults and the agent's answers.

The x axis is seconds since the faulted run's first event; one line per rank
(and per worker that held the rank: a promoted spare continues the line in
another colour) from the workload's trace, and vertical marks for what the
score measures from: each fault's injection (and a host fault's lift), the
detection, the recovery decision or restart, and the resumption.  Drawn with
matplotlib (``resilient-train[report]``), imported only here.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..core.errors import ConfigError
from .score import DETECTIONS

MARKS = {
    "fault_injected": ("tab:red", "fault"),
    "fault_lifted": ("tab:gray", "lifted"),
    "recovery_decided": ("tab:purple", "decided"),
    "restart": ("tab:purple", "restart"),
    "recovered_in_process": ("tab:green", "resumed"),
    "restored": ("tab:green", "restored"),
    "checkpoint_quarantined": ("tab:brown", "damaged checkpoint refused"),
    "alert_notified": ("tab:blue", "alert"),
}


def draw(events: Sequence[Mapping[str, Any]], trace: Sequence[Mapping[str, Any]], path: Path, title: str) -> Path:
    """Write the timeline of one faulted run to ``path``; ConfigError naming the fix without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ConfigError("the drill timeline needs matplotlib: pip install 'resilient-train[report]'") from e
    timed = sorted((e for e in events if "time" in e), key=lambda e: float(e["time"]))
    starts = [float(t["time"]) for t in trace if "time" in t] + [float(e["time"]) for e in timed[:1]]
    t0 = min(starts, default=0.0)
    fig, ax = plt.subplots(figsize=(10, 4.5), dpi=100)
    lines: dict[tuple[int, str], list[tuple[float, int]]] = defaultdict(list)
    for t in trace:
        if "time" in t:
            lines[(int(t["rank"]), str(t.get("worker", "")))].append((float(t["time"]) - t0, int(t["step"])))
    for (rank, worker), points in sorted(lines.items()):
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], ".", markersize=2,
                label=f"rank {rank}" + (f" ({worker})" if worker else ""))
    detected = False
    top = max((p[1] for pts in lines.values() for p in pts), default=1)
    for ev in timed:
        kind = str(ev.get("kind"))
        if kind == "alert_notified" and ev.get("status") != "firing":
            continue
        if kind in MARKS:
            colour, label = MARKS[kind]
            if kind == "alert_notified":
                label = f"alert {ev.get('alertname')} ({ev.get('receiver')})"
        elif kind in DETECTIONS and not detected:
            colour, label, detected = "tab:orange", f"detected ({kind})", True
        else:
            continue
        x = float(ev["time"]) - t0
        ax.axvline(x, color=colour, linewidth=1, alpha=0.8)
        ax.text(x, top, f" {label}", rotation=90, va="top", ha="left", fontsize=7, color=colour)
    ax.set_xlabel("seconds since the run began")
    ax.set_ylabel("step completed")
    ax.set_title(title, fontsize=10)
    if lines:
        ax.legend(loc="lower right", fontsize=7, markerscale=4)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
