"""The durable tier's save interval from its measured cost and the run's failure rate (Young/Daly).

A save costs the training loop its stall (the agreement and the snapshot
into host memory; the write runs behind the loop).  A failure costs, on
average, half an interval of work done again.  Saving every ``tau`` seconds
with a save cost ``C`` and a mean time between failures ``M`` loses, to
first order, ``C / tau + tau / (2 M)`` of the wall time; Young's optimum is
``sqrt(2 C M)`` and Daly's higher-order one (used here)
``sqrt(2 C M) (1 + x / 3 + x^2 / 9) - C`` with ``x = sqrt(C / (2 M))``,
``M`` itself once ``C >= 2 M``.

:func:`decide_every` turns that into steps: the optimum over the measured
step time, never shorter than the write (a save due while the previous one
is still written is deferred anyway, see :mod:`.pacing`), never longer than
``CheckpointConfig.every_steps``, the user's bound.  Without a failure rate
(no ``mtbf_s`` and no history from the agent) the interval is the bound.

:class:`Cadence` is one rank's side: the step times and save costs it
measured, the interval in force, and the proposal it brings to the ranks'
agreement.  The ranks agree at each scheduled save, inside the save's own
agreement (:meth:`.manager.CheckpointManager.save_due`), on the largest
proposal; a rank with nothing measured proposes nothing (0).  Every change
is a ``checkpoint_cadence`` event with its numbers.  :func:`alternatives`
prices the chosen interval against others for the goodput report.  Pure but
for :class:`Cadence`'s own small state.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

SAVES_MEASURED = 8
"""The newest saves whose median cost is taken."""
STEPS_MEASURED = 32
"""The newest step times whose median is taken."""


@dataclass(frozen=True)
class FailureRate:
    """The run's mean time between failures, as a Run is given it."""

    mtbf_s: float | None
    """Seconds; None: the interval is computed, but no rate is known yet (it stays at the bound)."""
    source: str
    """Where it came from, for the reasons: ``CheckpointConfig.mtbf_s``, ``--mtbf``, the run's history."""

    def __post_init__(self) -> None:
        assert self.mtbf_s is None or self.mtbf_s > 0, self.mtbf_s


def estimate_mtbf(failures: int, exposure_s: float) -> tuple[float | None, str]:
    """The MTBF from a history of ``failures`` in ``exposure_s`` seconds, and how; None before any failure (a run
    that has not failed yet gives no rate, and guessing one would set its interval)."""
    if failures <= 0 or exposure_s <= 0:
        return None, f"no failure in {exposure_s:.0f} s of the run's history"
    return exposure_s / failures, f"{failures} failure(s) in {exposure_s:.0f} s of the run's history"


@dataclass(frozen=True)
class SaveCost:
    """What one save cost: the loop's stall and the write behind it, in seconds."""

    stall_s: float
    write_s: float


@dataclass(frozen=True)
class Interval:
    """A durable save interval and the numbers that chose it."""

    every: int
    """Steps between scheduled saves."""
    reason: str
    cost_s: float | None = None
    """Median loop stall of the newest saves."""
    write_s: float | None = None
    """Median write time of the newest saves."""
    step_s: float | None = None
    """Median step time."""
    mtbf_s: float | None = None
    optimum_s: float | None = None
    """Daly's optimal interval in seconds."""


def daly_optimum_s(cost_s: float, mtbf_s: float) -> float:
    """Daly's optimal time between saves (higher-order Young) for save cost ``cost_s`` and MTBF ``mtbf_s``."""
    if cost_s <= 0:
        return 0.0
    if cost_s >= 2 * mtbf_s:
        return mtbf_s
    x = math.sqrt(cost_s / (2 * mtbf_s))
    return math.sqrt(2 * cost_s * mtbf_s) * (1 + x / 3 + x * x / 9) - cost_s


def lost_share(interval_s: float, *, cost_s: float, mtbf_s: float) -> float:
    """The first-order share of wall time an interval loses: its saves' stalls plus the work a failure redoes."""
    assert interval_s > 0 and mtbf_s > 0
    return cost_s / interval_s + interval_s / (2 * mtbf_s)


def _secs(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds >= 100 else f"{seconds:.3g} s"


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def decide_every(costs: Sequence[SaveCost], step_s: float | None, mtbf_s: float | None, *, bound: int,
                 mtbf_source: str = "") -> Interval:
    """Steps between durable saves, at most ``bound``; see the module's doc."""
    assert bound >= 1
    if mtbf_s is None:
        return Interval(bound, f"no failure rate known: every {bound} steps (CheckpointConfig.every_steps); give one "
                        "with CheckpointConfig(mtbf_s=...) or `resilient run --mtbf`")
    if not costs or step_s is None or step_s <= 0:
        return Interval(bound, f"no save measured yet: every {bound} steps (the bound)", mtbf_s=mtbf_s)
    cost, write = _median([c.stall_s for c in costs]), _median([c.write_s for c in costs])
    optimum = daly_optimum_s(cost, mtbf_s)
    every = max(1, round(optimum / step_s))
    source = f" ({mtbf_source})" if mtbf_source else ""
    reason = (f"a save stalls the loop {cost * 1e3:.1f} ms, a step takes {step_s * 1e3:.1f} ms and the MTBF is "
              f"{_secs(mtbf_s)}{source}: Young/Daly's optimum is {_secs(optimum)}, every {every} step(s)")
    floor = math.ceil(write / step_s)
    if every < floor:
        every, reason = floor, reason + f", raised to {floor} so that the {write:.2f} s write ends before the next"
    if every > bound:
        every, reason = bound, reason + f", capped at every_steps={bound}"
    return Interval(every, reason, cost_s=cost, write_s=write, step_s=step_s, mtbf_s=mtbf_s, optimum_s=optimum)


@dataclass(frozen=True)
class Alternative:
    """One interval priced by the first-order model: what its saves and a failure's redone work cost per hour."""

    label: str
    every: int
    stall_s_per_h: float
    redo_s_per_h: float

    @property
    def lost_s_per_h(self) -> float:
        return self.stall_s_per_h + self.redo_s_per_h


def alternatives(chosen: int, *, bound: int, step_s: float, cost_s: float, mtbf_s: float) -> list[Alternative]:
    """The chosen interval against the user's bound, half and twice it, and every step: seconds lost per hour."""
    labelled: dict[int, str] = {}
    for every, label in ((chosen, "chosen"), (bound, "every_steps"), (max(1, chosen // 2), "half"),
                         (chosen * 2, "twice"), (1, "every step")):
        labelled.setdefault(every, label)
    out = []
    for every, label in sorted(labelled.items()):
        interval = every * step_s
        out.append(Alternative(label, every, 3600 * cost_s / interval, 3600 * interval / (2 * mtbf_s)))
    return out


def priced_alternatives(event: dict[str, Any] | None) -> list[dict[str, Any]]:
    """A ``checkpoint_cadence`` event's interval against the alternatives, priced by the numbers that chose it, as
    plain records (``label``, ``every``, ``stall_s_per_h``, ``redo_s_per_h``, ``lost_s_per_h``) for the goodput
    report; empty without an event or its numbers."""
    if not event:
        return []
    step_s, cost_s, mtbf_s = event.get("step_s"), event.get("cost_s"), event.get("mtbf_s")
    if not step_s or cost_s is None or not mtbf_s:
        return []
    return [{**asdict(a), "lost_s_per_h": a.lost_s_per_h}
            for a in alternatives(int(event["every"]), bound=int(event["bound"]), step_s=step_s, cost_s=cost_s,
                                  mtbf_s=mtbf_s)]


class Cadence:
    """One rank's durable interval: its measurements, the interval in force, its proposal to the ranks."""

    def __init__(self, bound: int, rate: FailureRate) -> None:
        assert bound >= 1
        self.bound = bound
        self.rate = rate
        self.every = bound
        """The interval in force: the same on every rank (agreed at each scheduled save)."""
        self.costs: deque[SaveCost] = deque(maxlen=SAVES_MEASURED)
        self.step_times: deque[float] = deque(maxlen=STEPS_MEASURED)

    def step_done(self, seconds: float | None) -> None:
        if seconds is not None and seconds > 0:
            self.step_times.append(seconds)

    def saved(self, cost: SaveCost) -> None:
        self.costs.append(cost)

    def proposal(self) -> Interval | None:
        """This rank's interval for the agreement; None (proposes 0) without a failure rate or a measured save."""
        if self.rate.mtbf_s is None or not self.costs or not self.step_times:
            return None
        return decide_every(list(self.costs), _median(list(self.step_times)), self.rate.mtbf_s, bound=self.bound,
                            mtbf_source=self.rate.source)

    def adopt(self, agreed: int) -> bool:
        """Take the agreed interval (0: nobody proposed one, keep it); whether it changed."""
        if agreed <= 0 or agreed == self.every:
            return False
        assert agreed <= self.bound, f"agreed interval {agreed} above the bound {self.bound}"
        self.every = agreed
        return True
