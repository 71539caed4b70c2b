"""The ledger's fields and records (:class:`LedgerBooks`) and their plain-JSON form (``Ledger.to_dict`` / ``from_dict``).

Every field that influences a later account is saved, floats as Python
floats (JSON keeps them bit for bit), so a restored ledger fed the same
events gives the same account as one that never stopped.  Derived caches
(the timeline's frozen buckets) are not saved.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, fields
from enum import Enum
from typing import Any, TypeVar

from ..core.errors import ResilientError
from .catalogue import CATEGORIES
from .ledger_state import LedgerConfig
from .timeline import N_CATEGORIES, Timeline

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

Books = TypeVar("Books", bound="LedgerBooks")


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


class LedgerBooks:
    """The ledger's fields: what its events write, what an account reads and what its JSON form carries.

    :class:`~.ledger.Ledger` adds the events; the account (``ledger_account``) and the JSON form (below) read
    these fields and nothing else, so neither needs the ledger's behaviour.
    """

    def __init__(self, config: LedgerConfig | None = None) -> None:
        self.config = config = config if config is not None else LedgerConfig()
        self.start_t: float | None = None
        self.last_t = 0.0
        self.clamped_events = 0
        """Events that came with a time earlier than the previous event's (clamped to it)."""
        self.phase = Phase.WAITING
        self.hold = INIT  # the category while not RUNNING
        self.generation = self.world_size = self.full_world_size = self.generations_seen = 0
        self.ranks: dict[int, _Rank] = {}
        self.lead: int | None = None
        self.lead_step, self.lead_section, self.lead_work = 0, "init", 0.0
        self.lead_stepped = False
        self.lead_ideal: float | None = None
        self.high_water = self.replay_mark = -1
        self.seconds = [0.0] * N_CATEGORIES
        self.attempted_steps = self.replayed_steps = self.attempted_tokens = self.replayed_tokens = 0
        self.committed_step: int | None = None
        self.committed_tokens = self.committed_samples = 0
        self.last_commit_t: float | None = None
        self.last_progress_t: float | None = None
        self.saves_deferred = self.deferred_steps = 0
        self.resumes_diverged = 0
        self.diverged_from_step: int | None = None
        self.tokens_at: dict[int, dict[int, tuple[int, int]]] = {}
        self.reservoir: deque[float] = deque(maxlen=config.reservoir)
        self.measured: float | None = None
        self.ideal_frozen = 0
        """1 while a slowdown is in progress: the measured ideal stays the pre-slowdown one
        (see :meth:`~.ledger.Ledger.freeze_ideal`)."""
        self.histograms: dict[int, list[Any]] = {}  # rank -> [counts, sum, count]
        self.incidents: list[_Incident] = []
        self.segments: deque[list[Any]] = deque(maxlen=config.max_relabel_segments)  # [t0, t1, cat]
        self.floor = 0.0  # failure detection never re-labels time before this
        self.timeline = Timeline(0.0, config.timeline_bucket_s, config.timeline_max_buckets)


_SCALARS = ("start_t", "last_t", "clamped_events", "hold", "generation", "world_size", "full_world_size",
            "generations_seen", "lead", "lead_step", "lead_section", "lead_work", "lead_stepped", "lead_ideal",
            "high_water", "replay_mark", "attempted_steps", "replayed_steps", "attempted_tokens",
            "replayed_tokens", "committed_step", "committed_tokens", "committed_samples", "last_commit_t",
            "last_progress_t", "measured", "floor")
_ADDED = {"saves_deferred": 0, "deferred_steps": 0, "ideal_frozen": 0, "resumes_diverged": 0,
          "diverged_from_step": None}
"""Scalars added since format 1 was first written, with the value a ledger saved before them had."""


def ledger_to_dict(ledger: LedgerBooks) -> dict[str, Any]:
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


def ledger_from_dict(cls: type[Books], d: dict[str, Any], config: LedgerConfig | None) -> Books:
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
