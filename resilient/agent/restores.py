"""What a generation's workers restored, in one line for the console, the incident and ``resilient status``.

Each worker reports its restore to the agent (a ``restored`` message of the
heartbeat protocol: the checkpoint's name, or none for a fresh start, its
step and the seconds the restore took).  :func:`summarise_restores` is pure:
it turns this node's reports into one :class:`RestoreSummary`, whose
``line`` reads, for example::

    generation 2: all 2 ranks restored step_0000000010 (step 10) in 0.42 s (slowest rank 1)

and which names the ranks that restored something different, nothing, or
did not report at all.  The supervisor prints it, emits it as a
``restored`` event, shows it in ``status.json`` and appends it to the
incident of the failure that caused the restart.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class RestoreSummary:
    """What this node's ranks of one generation restored."""

    generation: int
    node: str
    ranks: Mapping[int, Mapping[str, Any]]
    """Each reporting rank's report: checkpoint (None: fresh start), step, seconds."""
    missing: tuple[int, ...]
    """Ranks of the generation that sent no report (yet)."""
    checkpoint: str | None
    """The checkpoint every rank restored; None when they differ, started fresh, or some did not report."""
    step: int | None
    seconds: float
    """The slowest rank's restore time: the generation trains only once every rank has restored."""
    slowest_rank: int | None
    line: str

    @property
    def complete(self) -> bool:
        return not self.missing

    def record(self) -> dict[str, Any]:
        """The JSON form kept in the incident, the event and ``status.json``."""
        return {"generation": self.generation, "node": self.node, "checkpoint": self.checkpoint, "step": self.step,
                "seconds": self.seconds, "slowest_rank": self.slowest_rank, "missing": list(self.missing),
                "ranks": {str(r): dict(v) for r, v in sorted(self.ranks.items())}, "summary": self.line}


def _what(report: Mapping[str, Any]) -> str:
    name = report.get("checkpoint")
    return "nothing (fresh start)" if name is None else f"{name} (step {report.get('step')})"


def summarise_restores(generation: int, node: str, expected: Sequence[int], reports: Mapping[int, Mapping[str, Any]],
                       *, multi_node: bool = False) -> RestoreSummary:
    """Summarise ``reports`` (rank -> report) of this node's ranks ``expected``; needs at least one report."""
    if not reports:
        raise ValueError("summarise_restores needs at least one rank's report")
    missing = tuple(r for r in sorted(expected) if r not in reports)
    slowest = max(sorted(reports), key=lambda r: float(reports[r].get("seconds") or 0.0))
    seconds = round(float(reports[slowest].get("seconds") or 0.0), 3)
    kinds = {(v.get("checkpoint"), v.get("step")) for v in reports.values()}
    same = len(kinds) == 1 and not missing
    name, step = next(iter(kinds)) if same else (None, None)
    where = f"generation {generation}" + (f" on {node}" if multi_node else "")
    timing = f"in {seconds:.2f} s (slowest rank {slowest})"
    count = len(reports) + len(missing)
    who = f"rank {slowest}" if count == 1 else f"all {count} ranks"
    if same and name is not None:
        text = f"{who} restored {name} (step {step}) {timing}"
    elif same:
        text = f"{who} started fresh (no checkpoint to restore) {timing}"
    else:
        groups: dict[str, list[int]] = {}
        for rank in sorted(reports):
            groups.setdefault(_what(reports[rank]), []).append(rank)
        parts = [f"{_ranks(ranks)} restored {what}" for what, ranks in groups.items()]
        if missing:
            parts.append(f"{_ranks(list(missing))} did not report a restore")
        text = "; ".join(parts) + f"; {timing}"
    return RestoreSummary(generation=generation, node=node, ranks=dict(reports), missing=missing,
                          checkpoint=name, step=step, seconds=seconds, slowest_rank=slowest, line=f"{where}: {text}")


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
