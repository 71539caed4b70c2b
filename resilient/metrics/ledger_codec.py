"""The ledger's internal records and their plain-JSON form (``Ledger.to_dict`` / ``Ledger.from_dict``).

Every field that influences a later account is saved, floats as Python
floats (JSON keeps them bit for bit), so a restored ledger fed the same
events gives the same account as one that never stopped.  Derived caches
(the timeline's frozen buckets) are not saved.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, fields
from enum import Enum
from typing import TYPE_CHECKING, Any

from ..core.errors import ResilientError
from .catalogue import CATEGORIES
from .ledger_state import LedgerConfig
from .timeline import Timeline

if TYPE_CHECKING:
    from .ledger import Ledger

FORMAT = 1
"""Version of the saved form; bump on an incompatible change."""

(PRODUCTIVE, INIT, CHECKPOINT, DETECTION, RECOVERY, REPLAY, DATA, EXCESS, DEGRADED, IDLE) = (
    CATEGORIES.index(c) for c in ("productive", "init", "checkpoint_stall", "failure_detection", "recovery",
                                  "replay", "data_wait", "slowdown_excess", "degraded", "idle"))
LOST_TO_ETTR = (INIT, DETECTION, RECOVERY, REPLAY, IDLE)
SECTION_CATEGORY = {"data": DATA, "checkpoint": CHECKPOINT, "init": RECOVERY, "restore": RECOVERY,
                    "after_steps": IDLE}
"""Sections that are not step work, and their category once the generation has stepped."""
Piece = tuple[float, float, int]
"""An attributed interval: (t0, t1, category index)."""


class LedgerStateError(ResilientError, ValueError):
    """A saved ledger cannot be read (unknown format or damaged)."""


class Phase(Enum):
    """What the node is doing, as far as attribution goes."""

    WAITING = "waiting"  # agent up, no generation spawned yet: init, or recovery after an agent restart
    SPAWNING = "spawning"  # workers spawned, the lead rank has not entered "step": init or recovery
    RUNNING = "running"  # the lead rank's sections drive the attribution
    RECOVERING = "recovering"  # a failure was detected: recovery until a later generation's first step
    BETWEEN = "between"  # the generation ended: recovery or idle, by outcome
    FINISHED = "finished"  # idle


class _Rank:
    """One rank's position in the current generation."""

    __slots__ = ("section", "since", "smp0", "step", "stepped", "tok0", "work")

    def __init__(self, section: str, step: int, since: float, work: float, stepped: bool, tok0: int,
                 smp0: int) -> None:
        self.section, self.step, self.since, self.work = section, step, since, work
        self.stepped = stepped  # entered "step" at this index (so reaching the next index completes a step)
        self.tok0, self.smp0 = tok0, smp0  # cumulative counters at the start of this index

    def to_list(self) -> list[Any]:
        return [self.section, self.step, self.since, self.work, self.stepped, self.tok0, self.smp0]


class _Incident:
    """One failure's cost as it accrues."""

    __slots__ = ("detected_t", "id", "kind", "mark", "recovered_t", "replay_s", "started_t", "state")

    def __init__(self, id: str, kind: str, started_t: float, detected_t: float, recovered_t: float | None,
                 replay_s: float, mark: int, state: str) -> None:
        self.id, self.kind, self.started_t, self.detected_t = id, kind, started_t, detected_t
        self.recovered_t, self.replay_s = recovered_t, replay_s
        self.mark = mark  # the high-water step at the failure: replay ends past it
        self.state = state  # "recovering", "replaying" or "closed"

    def to_list(self) -> list[Any]:
        return [self.id, self.kind, self.started_t, self.detected_t, self.recovered_t, self.replay_s, self.mark,
                self.state]


_SCALARS = ("start_t", "last_t", "clamped_events", "hold", "generation", "world_size", "full_world_size",
            "generations_seen", "lead", "lead_step", "lead_section", "lead_work", "lead_stepped", "lead_ideal",
            "high_water", "replay_mark", "attempted_steps", "replayed_steps", "attempted_tokens",
            "replayed_tokens", "committed_step", "committed_tokens", "committed_samples", "last_commit_t",
            "last_progress_t", "measured", "floor")
_ADDED = {"saves_deferred": 0, "deferred_steps": 0, "ideal_frozen": 0, "resumes_diverged": 0,
          "diverged_from_step": None}
"""Scalars added since format 1 was first written, with the value a ledger saved before them had."""


def ledger_to_dict(ledger: Ledger) -> dict[str, Any]:
    d: dict[str, Any] = {"format": FORMAT, "config": asdict(ledger.config)}
    d.update({name: getattr(ledger, name) for name in (*_SCALARS, *_ADDED)})
    d["phase"] = ledger.phase.value
    d["seconds"] = list(ledger.seconds)
    d["ranks"] = [[rank, *r.to_list()] for rank, r in ledger.ranks.items()]
    d["tokens_at"] = [[step, [[rank, *c] for rank, c in at.items()]] for step, at in ledger.tokens_at.items()]
    d["reservoir"] = list(ledger.reservoir)
    d["histograms"] = [[rank, list(h[0]), h[1], h[2]] for rank, h in ledger.histograms.items()]
    d["incidents"] = [inc.to_list() for inc in ledger.incidents]
    d["segments"] = [list(s) for s in ledger.segments]
    d["timeline"] = ledger.timeline.to_dict()
    return d


def ledger_from_dict(cls: type[Ledger], d: dict[str, Any], config: LedgerConfig | None) -> Ledger:
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        got = d.get("format") if isinstance(d, dict) else type(d).__name__
        raise LedgerStateError(f"saved ledger has format {got!r}, this version reads format {FORMAT}; "
                               "start a new ledger (delete ledger.json) or use the matching resilient version")
    try:
        if config is None:
            known = {f.name for f in fields(LedgerConfig)}
            config = LedgerConfig(**{k: v for k, v in d["config"].items() if k in known})
        ledger = cls(config)
        for name in _SCALARS:
            setattr(ledger, name, d[name])
        for name, default in _ADDED.items():
            value = d.get(name, default)
            setattr(ledger, name, None if value is None else int(value))
        ledger.phase = Phase(d["phase"])
        ledger.seconds = [float(x) for x in d["seconds"]]
        ledger.ranks = {int(r[0]): _Rank(*r[1:]) for r in d["ranks"]}
        ledger.tokens_at = {int(step): {int(c[0]): (int(c[1]), int(c[2])) for c in at} for step, at in d["tokens_at"]}
        ledger.reservoir = deque((float(x) for x in d["reservoir"]), maxlen=config.reservoir)
        ledger.histograms = {int(h[0]): [[int(c) for c in h[1]], float(h[2]), int(h[3])] for h in d["histograms"]}
        ledger.incidents = [_Incident(*inc) for inc in d["incidents"]]
        ledger.segments = deque(([float(s[0]), float(s[1]), int(s[2])] for s in d["segments"]),
                                maxlen=config.max_relabel_segments)
        ledger.timeline = Timeline.from_dict(d["timeline"], config.timeline_max_buckets)
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise LedgerStateError(f"saved ledger is damaged ({type(exc).__name__}: {exc}); start a new ledger") from exc
    return ledger
