"""The ideal step time: what a step costs when nothing is wrong.

Google's goodput library defines it from the step times themselves: take the
median and the median absolute deviation (MAD) of recent step durations,
drop the outliers above ``median + 3 * MAD`` (restore, compilation, a stall),
and average the rest.  The ledger feeds it the durations of recent *new*
steps of the lead rank (replays are excluded: they follow a restore and are
often slower).  Pure and deterministic: the same durations in the same order
give the same float.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from .ledger_codec import DEGRADED, EXCESS, PRODUCTIVE, Piece

MAD_FACTOR = 3.0
"""Durations above ``median + MAD_FACTOR * MAD`` are outliers."""


def measured_ideal(durations: Sequence[float], min_steps: int = 1) -> float | None:
    """Mean of the durations at or below ``median + 3 * MAD``; None with fewer than ``min_steps``.

    >>> measured_ideal([1.0, 1.0, 1.2, 0.8, 9.0])  # 9 s is an outlier (median 1, MAD 0.2)
    1.0
    """
    if len(durations) < max(1, min_steps):
        return None
    median = statistics.median(durations)
    mad = statistics.median([abs(d - median) for d in durations])
    bound = median + MAD_FACTOR * mad
    kept = [d for d in durations if d <= bound]
    # The median itself is always kept, so ``kept`` is never empty.
    return math.fsum(kept) / len(kept)


def split_new_step_time(a: float, b: float, *, ideal: float | None, work: float, world_size: int,
                        full_world_size: int) -> list[Piece]:
    """Attribute ``[a, b]`` of a new step that has already worked ``work`` seconds: pieces ``(t0, t1, category)``.

    Up to the ideal step time it is productive (``world/full`` of it when the
    job runs on fewer ranks than it was sized for, the rest degraded), beyond
    it slowdown excess; with no ideal known yet all of it is productive.
    """
    dt = b - a
    room = dt if ideal is None else min(dt, max(0.0, ideal - work))
    end = b if room >= dt else a + room
    out: list[Piece] = []
    if world_size < full_world_size:
        kept = a + room * world_size / full_world_size
        out.append((a, kept, PRODUCTIVE))
        out.append((kept, end, DEGRADED))
    else:
        out.append((a, end, PRODUCTIVE))
    if end < b:
        out.append((end, b, EXCESS))
    return out
