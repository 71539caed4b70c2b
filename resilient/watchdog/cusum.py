"""Robust noise and a one-sided CUSUM with persistence: what the straggler and slowdown detectors share.

Both detectors watch a series of log ratios, one value per window of steps
(a rank's time against its peers', the job's step time against its own
baseline), and must tell a lasting shift from this machine's noise without
a fixed threshold.  Three rules do that:

- **Noise from the data.**  The spread of a series is the median absolute
  deviation of its *successive differences*, divided by sqrt(2).  A level
  shift adds one large difference, which the median ignores, so the noise
  estimate does not grow when the very slowdown we look for begins (the MAD
  of the values themselves would, and would then hide it).
- **Evidence accumulates.**  A one-sided CUSUM (Page, 1954) adds each
  window's excess over a reference value, in noise units, clipped so that
  one outlier (a GC pause, a page-cache miss) cannot decide alone.  The
  reference is half the smallest slowdown worth reporting, or ``allowance``
  noise units, whichever is larger: on a very quiet machine a 1% difference
  is real but not worth a page.
- **Persistence.**  A series is flagged only when the CUSUM is past its
  decision level *and* the last ``consecutive`` windows were each above the
  reference; it is cleared after ``clear_after`` windows in a row below it
  (hysteresis: clearing needs the shift gone, not merely a quiet window).

Pure: no clock, no I/O; the same values give the same answers.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from ..core.errors import ConfigError

MAD_TO_SIGMA = 1.4826
"""MAD x this estimates the standard deviation of normal noise."""


def noise(series: Sequence[float], floor: float) -> float:
    """Window-to-window noise of ``series`` (log units): MAD of successive differences / sqrt(2), at least ``floor``.

    >>> round(noise([0.0, 0.1, 0.0, 0.1, 0.0, 0.1, 1.0, 1.1, 1.0, 1.1], 0.001), 3)  # the level shift is ignored
    0.105
    """
    if len(series) < 3:
        return floor
    values = list(series)
    diffs = [b - a for a, b in zip(values, values[1:], strict=False)]
    centre = statistics.median(diffs)
    mad = statistics.median(abs(d - centre) for d in diffs)
    return max(floor, MAD_TO_SIGMA * mad / math.sqrt(2.0))


@dataclass(frozen=True, kw_only=True)
class CusumRule:
    """When a series of log ratios counts as shifted up, and when as back to normal."""

    allowance: float = 0.5
    """CUSUM reference value in noise units (k): shifts smaller than twice this are not accumulated."""
    decision: float = 10.0
    """CUSUM decision level in noise units (h)."""
    consecutive: int = 3
    """Windows in a row above the reference needed to flag (K), besides the CUSUM past ``decision``."""
    clear_after: int = 6
    """Windows in a row below the reference that clear a flag."""
    min_effect: float = 0.05
    """The slowdown the rule is tuned to catch, as a fraction (0.05: 5% slower): the reference is at least half
    of it, so a shift smaller than half of it is never accumulated, however long it lasts."""
    clip: float = 4.0
    """Most one window can add to or take from the CUSUM, in noise units."""

    def __post_init__(self) -> None:
        for name in ("allowance", "decision", "min_effect", "clip"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(f"CusumRule.{name}={value!r} must be a positive number")
        for name in ("consecutive", "clear_after"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"CusumRule.{name}={value!r} must be an int >= 1 (windows)")

    def reference(self, sigma: float) -> float:
        """The reference value (log units) for noise ``sigma``."""
        return max(self.allowance * sigma, math.log1p(self.min_effect) / 2.0)


@dataclass(frozen=True)
class Cusum:
    """The CUSUM state of one series."""

    s: float = 0.0
    """Accumulated excess over the reference, in noise units (never negative)."""
    run: int = 0
    """Windows in a row above the reference."""
    flagged: bool = False
    quiet: int = 0
    """While flagged: windows in a row below the reference."""


def advance(state: Cusum, x: float, sigma: float, rule: CusumRule) -> Cusum:
    """``state`` after one more window of value ``x`` (log ratio) with noise ``sigma`` (> 0).

    >>> rule = CusumRule()
    >>> s = Cusum()
    >>> for _ in range(3):
    ...     s = advance(s, 0.22, 0.02, rule)   # 25% slower, far above the noise
    >>> s.flagged, s.run
    (True, 3)
    """
    assert sigma > 0, "noise() never returns less than its positive floor"
    ref = rule.reference(sigma)
    step = max(-rule.clip, min(rule.clip, (x - ref) / sigma))
    s = max(0.0, state.s + step)
    run = state.run + 1 if x > ref else 0
    if state.flagged:
        quiet = state.quiet + 1 if x <= ref else 0
        if quiet >= rule.clear_after:
            return Cusum()
        return Cusum(s=s, run=run, flagged=True, quiet=quiet)
    return Cusum(s=s, run=run, flagged=s > rule.decision and run >= rule.consecutive)
