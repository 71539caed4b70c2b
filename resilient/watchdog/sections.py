"""Per-section hang timeouts: configuration, calibration and the hang decision.

Each rank tells its agent when it enters a section (``init``, ``restore``,
``data``, ``step``, ``checkpoint`` or a user's name).  A rank that stays in
one section longer than that section's timeout is hung.  The timeout of a
section comes from, in order of precedence:

1. ``explicit``: the user's number for that section;
2. ``calibrated``: once ``warmup`` durations of the section were observed,
   ``max(floor, factor * longest observed duration)``; it only grows, as
   the longest observation does.  The floor is ``floor_s``, or the
   section's own in ``floors``: a run whose checkpoints go to an object
   store gets :data:`REMOTE_SAVE_FLOOR_S` for its saves (:func:`for_storage`);
3. ``initial``: the generous value for that section (or ``default``) used
   before calibration, when first steps compile, caches fill and nothing is
   known yet.

Ordering.  NVRx validates soft < hard < barrier because it takes three
absolute numbers.  We take one detection timeout per section and express the
kill as "detection, then a grace period for the stack dump" (a supervisor
setting), so hard > soft holds by construction and cannot be misconfigured.
What is left to protect the user from is calibration undercutting the
defaults, so ``__post_init__`` checks: every timeout > 0 and finite,
``0 < floor_s <= initial[s]`` for every section (else calibration would raise
a timeout after warm-up: the initial value was a mistake), ``factor >= 1``
(a calibrated timeout is never shorter than a duration already seen) and
``warmup >= 1``.  Explicit values are not held to the floor: the user asked.

Everything here is pure: the supervisor measures durations with its own
clock, folds them in with :func:`observe` and asks :func:`decide_hang`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Literal, NamedTuple

from ..core.errors import ConfigError

Source = Literal["explicit", "calibrated", "initial"]

DEFAULT_SECTION = "default"
"""Key of ``initial`` used for sections it does not name (e.g. user sections)."""
KNOWN_SECTIONS = ("init", "restore", "data", "step", "checkpoint")
CHECKPOINT_SECTION = "checkpoint"
"""Sections the runtime itself reports, in the order a run goes through them."""

_DEFAULT_INITIAL: Mapping[str, float] = MappingProxyType(
    {"init": 600.0, "restore": 600.0, "data": 600.0, "step": 600.0, "checkpoint": 600.0, DEFAULT_SECTION: 600.0}
)


def _frozen(mapping: Mapping[str, float]) -> Mapping[str, float]:
    return MappingProxyType(dict(mapping))


@dataclass(frozen=True, kw_only=True)
class SectionTimeouts:
    """How long a rank may stay in one section before it counts as hung."""

    explicit: Mapping[str, float] = field(default_factory=dict)
    """Seconds per section set by the user; overrides calibration and ``initial``."""
    warmup: int = 5
    """Observed durations of a section needed before its timeout is calibrated."""
    factor: float = 3.0
    """Safety factor: a calibrated timeout is this times the longest observed duration."""
    floor_s: float = 5.0
    """A calibrated timeout is never below this (fast steps jitter by more than their length)."""
    floors: Mapping[str, float] = field(default_factory=dict)
    """A section's own floor, in place of ``floor_s`` (e.g. a save to an object store: :func:`for_storage`)."""
    initial: Mapping[str, float] = field(default_factory=lambda: _DEFAULT_INITIAL)
    """Seconds per section before calibration; the ``default`` key covers unnamed sections."""

    def __post_init__(self) -> None:
        # Copy the mappings so a caller mutating its dict cannot change a frozen config.
        object.__setattr__(self, "explicit", _frozen(self.explicit))
        object.__setattr__(self, "initial", _frozen(self.initial))
        object.__setattr__(self, "floors", _frozen(self.floors))
        for what, mapping in (("explicit", self.explicit), ("initial", self.initial), ("floors", self.floors)):
            for section, seconds in mapping.items():
                if not (seconds > 0 and math.isfinite(seconds)):
                    raise ConfigError(
                        f"SectionTimeouts.{what}[{section!r}]={seconds} must be a positive number of seconds"
                    )
        if DEFAULT_SECTION not in self.initial:
            raise ConfigError(
                f"SectionTimeouts.initial needs a {DEFAULT_SECTION!r} entry for sections it does not name"
            )
        if self.warmup < 1:
            raise ConfigError(f"SectionTimeouts.warmup={self.warmup} must be >= 1 observation")
        if not (self.factor >= 1.0 and math.isfinite(self.factor)):
            raise ConfigError(
                f"SectionTimeouts.factor={self.factor} must be >= 1: below 1 a calibrated timeout "
                "would fire on a duration already seen in a healthy run"
            )
        if not (self.floor_s > 0 and math.isfinite(self.floor_s)):
            raise ConfigError(f"SectionTimeouts.floor_s={self.floor_s} must be a positive number of seconds")
        for section, seconds in self.initial.items():
            if self.floor_s > seconds:
                raise ConfigError(
                    f"SectionTimeouts.floor_s={self.floor_s} exceeds initial[{section!r}]={seconds}: calibration "
                    "would lengthen the timeout after warm-up; raise the initial value or lower floor_s"
                )

    def floor_for(self, section: str) -> float:
        """The lowest calibrated timeout of ``section``."""
        return self.floors.get(section, self.floor_s)

    def initial_for(self, section: str) -> float:
        """The pre-calibration timeout of ``section``."""
        return self.initial.get(section, self.initial[DEFAULT_SECTION])


REMOTE_SAVE_FLOOR_S = 90.0
"""The checkpoint section's floor when the checkpoints go to an object store: a save there rides out the S3
client's retries (5 of them, up to 1 + 2 + 4 + 8 + 16 s of backoff for a throttled request) before it can fail
and say so; a floor of a few seconds took a store's bad minute for a hang and restarted every rank, whose
restores then waited on the same store."""
REMOTE_PREFIXES = ("s3://",)


def for_storage(cfg: SectionTimeouts, location: str | None) -> SectionTimeouts:
    """``cfg`` for a run whose checkpoints are at ``location``: on an object store the checkpoint section's floor
    is :data:`REMOTE_SAVE_FLOOR_S` (unless the user gave that section's timeout, or a higher floor)."""
    if location is None or not location.startswith(REMOTE_PREFIXES) or CHECKPOINT_SECTION in cfg.explicit:
        return cfg
    if cfg.floor_for(CHECKPOINT_SECTION) >= REMOTE_SAVE_FLOOR_S:
        return cfg
    floor = min(REMOTE_SAVE_FLOOR_S, cfg.initial_for(CHECKPOINT_SECTION))
    return replace(cfg, floors={**cfg.floors, CHECKPOINT_SECTION: floor})


@dataclass(frozen=True)
class SectionStat:
    """What was seen of one section: how many completed visits, and the longest."""

    count: int = 0
    max_s: float = 0.0


@dataclass(frozen=True)
class SectionStats:
    """Observed durations per section (immutable; :func:`observe` returns a new one)."""

    by_section: Mapping[str, SectionStat] = field(default_factory=lambda: MappingProxyType({}))

    def get(self, section: str) -> SectionStat:
        """The stat of ``section``; zero counts if never observed."""
        return self.by_section.get(section, SectionStat())


def observe(stats: SectionStats, section: str, duration_s: float) -> SectionStats:
    """``stats`` with one completed visit of ``section`` lasting ``duration_s`` folded in.

    Feed only completed visits (the rank moved on to another section); the
    visit that is hung right now must not calibrate its own timeout.
    """
    if not (duration_s >= 0 and math.isfinite(duration_s)):
        raise ValueError(f"duration_s={duration_s} must be a finite number >= 0")
    old = stats.get(section)
    new = SectionStat(count=old.count + 1, max_s=max(old.max_s, duration_s))
    return SectionStats(MappingProxyType({**stats.by_section, section: new}))


class Timeout(NamedTuple):
    """A section's timeout and where it came from."""

    seconds: float
    source: Source


def timeout_for(section: str, stats: SectionStats, cfg: SectionTimeouts) -> Timeout:
    """The timeout of ``section`` now: explicit, else calibrated after warm-up, else initial."""
    if section in cfg.explicit:
        return Timeout(cfg.explicit[section], "explicit")
    stat = stats.get(section)
    if stat.count >= cfg.warmup:
        return Timeout(max(cfg.floor_for(section), stat.max_s * cfg.factor), "calibrated")
    return Timeout(cfg.initial_for(section), "initial")


def explain_timeout(section: str, stats: SectionStats, cfg: SectionTimeouts) -> str:
    """Where the timeout of ``section`` comes from, e.g. ``calibrated: max 2.67 s x 3.0 after 5 observations``."""
    timeout = timeout_for(section, stats, cfg)
    stat = stats.get(section)
    if timeout.source == "explicit":
        return "explicit"
    if timeout.source == "initial":
        return f"initial: {stat.count} of {cfg.warmup} warm-up observations so far"
    text = f"calibrated: max {stat.max_s:.2f} s x {cfg.factor:g} after {stat.count} observations"
    if stat.max_s * cfg.factor < cfg.floor_for(section):
        text += f", raised to the floor {cfg.floor_for(section):g} s"
        if section in cfg.floors:
            text += " (the section's own)"
    return text


@dataclass(frozen=True)
class RankView:
    """What the agent knows about one running rank: its latest section and when it entered it."""

    section: str
    step: int
    entered_at: float
    """Agent clock (the heartbeat receiver's) when the rank reported entering the section."""
    pid: int


@dataclass(frozen=True, kw_only=True)
class HangDecision:
    """A rank overran its section's timeout; the most overrun one when several did."""

    rank: int
    section: str
    step: int
    pid: int
    elapsed_s: float
    """Time the rank has spent in the section so far."""
    overrun_s: float
    """``elapsed_s - timeout_s``."""
    timeout_s: float
    source: Source
    also_overrun: tuple[int, ...]
    """Other ranks past their timeout too (a stuck collective holds them all)."""
    reason: str


def decide_hang(
    ranks: Mapping[int, RankView], stats: SectionStats, cfg: SectionTimeouts, now: float
) -> HangDecision | None:
    """The most overrun rank among ``ranks`` (running ranks only), or None if no rank is past its timeout.

    Ties go to the lowest rank.  A rank exactly at its timeout is not hung yet.
    """
    overrun: list[tuple[float, int, Timeout]] = []
    for rank, view in ranks.items():
        timeout = timeout_for(view.section, stats, cfg)
        over = (now - view.entered_at) - timeout.seconds
        if over > 0:
            overrun.append((over, rank, timeout))
    if not overrun:
        return None
    overrun.sort(key=lambda item: (-item[0], item[1]))
    over, rank, timeout = overrun[0]
    view = ranks[rank]
    elapsed = now - view.entered_at
    others = tuple(sorted(r for _, r, _ in overrun[1:]))
    reason = (
        f"rank {rank} has been in section {view.section!r} (step {view.step}) for {elapsed:.1f} s; "
        f"timeout {timeout.seconds:.1f} s ({explain_timeout(view.section, stats, cfg)})"
    )
    if others:
        reason += f"; also past their timeouts: rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))}"
    return HangDecision(
        rank=rank,
        section=view.section,
        step=view.step,
        pid=view.pid,
        elapsed_s=elapsed,
        overrun_s=over,
        timeout_s=timeout.seconds,
        source=timeout.source,
        also_overrun=others,
        reason=reason,
    )


@dataclass(frozen=True)
class SectionCalibration:
    """One row of the calibration table shown by ``resilient status``."""

    section: str
    timeout_s: float
    source: Source
    count: int
    max_s: float
    detail: str
    """Where the timeout comes from, as in hang reasons."""


def calibration_summary(stats: SectionStats, cfg: SectionTimeouts) -> tuple[SectionCalibration, ...]:
    """The timeout of every section that is configured or was observed: runtime sections first, in run order."""
    names = (set(cfg.initial) - {DEFAULT_SECTION}) | set(cfg.explicit) | set(stats.by_section)
    order = {name: i for i, name in enumerate(KNOWN_SECTIONS)}
    rows = []
    for section in sorted(names, key=lambda s: (order.get(s, len(order)), s)):
        timeout = timeout_for(section, stats, cfg)
        stat = stats.get(section)
        rows.append(
            SectionCalibration(
                section=section,
                timeout_s=timeout.seconds,
                source=timeout.source,
                count=stat.count,
                max_s=stat.max_s,
                detail=explain_timeout(section, stats, cfg),
            )
        )
    return tuple(rows)
