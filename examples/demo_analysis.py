"""What recovery_demo.py reads from the traces of train_gpt.py: one launch's cost of a crash, the same for every
launcher, and the comparison with the run that never stopped.

Everything here comes from the trace (one JSON line per completed step and rank, with ``t0``, the start of the
step's last attempt, and ``t``, its end; a ``crash`` line just before the SIGKILL) and the wall time the demo
measured around the launcher, so torchrun and ``resilient run`` are measured with one yardstick:

- **recovery**: from the crash to the end of the next new step (the crash's step or a later one, begun after
  the crash), so it holds detection, restart or re-formation, restore, and any step trained again;
- **steps re-done**: rank 0's completions of a step it had already completed;
- **goodput**: the seconds of the steps the final model keeps (each step's last completion on rank 0, from
  the start of its attempt to its end) over the launch's wall time.  Start-up, checkpoint saves, steps
  thrown away, recovery and shutdown are the rest.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

FIELDS = ("lr", "loss", "indices")


class Trace:
    """A trace file split into launches: per launch, ``{(rank, step): record}`` and its start records.

    A start line for a rank already in the newest launch opens the next launch (the ranks of one launch
    write their start lines before any step); a spare promoted into a rank's place opens one of its own.
    """

    def __init__(self, path: str) -> None:
        self.launches: list[dict[str, Any]] = []
        self.final: dict[str, Any] | None = None
        self.crash: dict[str, Any] | None = None
        self.records: list[dict[str, Any]] = []
        current: dict[int, dict[str, Any]] = {}
        with open(path, encoding="utf-8") as f:
            for line in f:
                rec = json.loads(line)
                self.records.append(rec)
                rank = rec["rank"]
                if rec["kind"] == "start":
                    if not self.launches or rank in self.launches[-1]["starts"]:
                        self.launches.append({"starts": {}, "steps": {}})
                    self.launches[-1]["starts"][rank] = rec
                    current[rank] = self.launches[-1]
                elif rec["kind"] == "step":
                    current[rank]["steps"][(rank, rec["step"])] = rec
                elif rec["kind"] == "crash":
                    self.crash = rec
                elif rec["kind"] == "final":
                    self.final = rec

    def rank0_steps(self) -> list[dict[str, Any]]:
        """Rank 0's completed steps, in the order they ended."""
        return sorted((r for r in self.records if r["kind"] == "step" and r["rank"] == 0), key=lambda r: r["t"])


def compare(ref: Trace, res: Trace, steps: int, nproc: int) -> tuple[list[str], int]:
    """Differences between the uninterrupted trace and a crashed+recovered one; also the records compared."""
    problems: list[str] = []
    if len(ref.launches) != 1:
        problems.append(f"the uninterrupted trace has {len(ref.launches)} launches, expected 1")
    expected = {(r, s) for r in range(nproc) for s in range(steps)}
    reference = ref.launches[0]["steps"] if ref.launches else {}
    if set(reference) != expected:
        problems.append(f"the uninterrupted trace misses {len(expected - set(reference))} (rank, step) records")
    covered: set[tuple[int, int]] = set()
    compared = 0
    for i, launch in enumerate(res.launches):
        for key, rec in sorted(launch["steps"].items()):
            covered.add(key)
            want = reference.get(key)
            if want is None:
                problems.append(f"launch {i + 1}: rank {key[0]} step {key[1]} has no reference record")
                continue
            compared += 1
            for name in FIELDS:
                if rec[name] != want[name]:
                    problems.append(f"launch {i + 1}: rank {key[0]} step {key[1]} {name}: "
                                    f"{_short(rec[name])} != uninterrupted {_short(want[name])}")
    if covered != expected:
        problems.append(f"the recovered run's trace misses {len(expected - covered)} (rank, step) records")
    for name in ("param_sha256", "optimizer_sha256"):
        a = ref.final.get(name) if ref.final else None
        b = res.final.get(name) if res.final else None
        if a is None or a != b:
            problems.append(f"final {name}: uninterrupted {a} != recovered {b}")
    return problems, compared


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass
class Cost:
    """One launch, measured from its trace and its wall time."""

    wall_s: float
    goodput: float
    kept_s: float
    crash_t: float | None = None
    recovery_s: float | None = None
    redone: int = 0
    redone_s: float = 0.0
    resumed_at: int | None = None  # the first step trained after the crash
    spans: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # category -> [(t0, t1)]


def measure(trace: Trace, launched_at: float, ended_at: float) -> Cost:
    """The cost of one launch (``launched_at``/``ended_at``: wall-clock times around the launcher process)."""
    done = trace.rank0_steps()
    last = {rec["step"]: rec for rec in done}  # each step's last completion is the one the model keeps
    kept = [rec for rec in done if last[rec["step"]] is rec]
    thrown = [rec for rec in done if last[rec["step"]] is not rec]
    kept_s = sum(rec["t"] - rec["t0"] for rec in kept)
    wall = ended_at - launched_at
    cost = Cost(wall_s=wall, goodput=kept_s / wall if wall > 0 else 0.0, kept_s=kept_s,
                redone=len(thrown), redone_s=sum(rec["t"] - rec["t0"] for rec in thrown))
    first = {}
    for rec in done:
        first.setdefault(rec["step"], rec)
    cost.spans = {"new": [(r["t0"], r["t"]) for r in first.values()],
                  "redone": [(r["t0"], r["t"]) for r in done if first[r["step"]] is not r]}
    if trace.crash is not None:
        # The crashing rank had done every step before its crash step; rank 0 may end the last of them just
        # after the crash, which is work from before it.  What is trained after it begins after it.
        crash_t, crash_step = trace.crash["t"], trace.crash["step"]
        cost.crash_t = crash_t
        after = [r for r in done if r["t0"] > crash_t]
        new = next((r for r in after if r["step"] >= crash_step), None)
        if new is not None:
            cost.recovery_s = new["t"] - crash_t
        if after:
            cost.resumed_at = after[0]["step"]
            cost.spans["down"] = [(crash_t, after[0]["t0"])]
    return cost


LEGEND = "# new steps   r steps trained again   . recovering   - start-up, saves, exit   ! crash"


def timelines(rows: list[tuple[str, float, Cost]], width: int = 64) -> list[str]:
    """One line per launch on a common time axis from its launcher's start: each column shows what most of its
    time went to."""
    span = max(cost.wall_s for _, _, cost in rows)
    col = span / width
    label_w = max(len(label) for label, _, _ in rows)
    ticks = [" "] * (width + 8)
    step = 10 if span > 40 else 5
    for second in range(0, int(span) + 1, step):
        mark = f"{second} s"
        at = int(second / col)
        ticks[at:at + len(mark)] = mark
    lines = [f"{'':{label_w}}  {''.join(ticks).rstrip()}"]
    for label, launched_at, cost in rows:
        cells = []
        for i in range(width):
            a, b = launched_at + i * col, launched_at + (i + 1) * col
            if a >= launched_at + cost.wall_s:
                cells.append(" ")
                continue
            share = {name: sum(max(0.0, min(b, y) - max(a, x)) for x, y in spans)
                     for name, spans in cost.spans.items()}
            share["other"] = max(0.0, min(b, launched_at + cost.wall_s) - a) - sum(share.values())
            top = max(share, key=lambda k: share[k])
            cells.append({"new": "#", "redone": "r", "down": ".", "other": "-"}[top])
        if cost.crash_t is not None:
            at = int((cost.crash_t - launched_at) / col)
            if 0 <= at < width:
                cells[at] = "!"
        lines.append(f"{label:{label_w}}  {''.join(cells)}")
    return lines
