"""The ledger's timeline: seconds by category in fixed-width time buckets.

Bucket ``i`` covers ``[origin + i * width, origin + (i + 1) * width)``, with
``origin`` the run's start.  Every attributed interval is split at bucket
edges and added to the buckets it covers, so the buckets hold every second
of the run exactly once (as the ledger's totals do).  When the run outgrows
``max_buckets``, neighbouring pairs are merged and the width doubles: sums
are kept, resolution halves, memory stays bounded (2000 buckets of a
30-day run are 30-minute buckets).

The rolling window (the last ``window_s``) is read from here: whole buckets
inside the window count fully, the bucket straddling its start counts in
proportion to its overlap, so a window ratio is exact to within one bucket
width.  Pure: no clock, no I/O; the owner passes every time in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .catalogue import CATEGORIES

N_CATEGORIES = len(CATEGORIES)
# Row layout: seconds by category, then steps completed, their summed duration, and how many of them were
# new (not replayed).  Saved rows are sparse by index, so a row saved before a column existed reads as 0.
_STEPS = N_CATEGORIES
_STEP_SUM = N_CATEGORIES + 1
_NEW_STEPS = N_CATEGORIES + 2
_ROW = N_CATEGORIES + 3


@dataclass(frozen=True)
class Bucket:
    """One slice of the timeline."""

    t0: float
    t1: float
    seconds: dict[str, float]
    """Seconds in each category within ``[t0, t1)``."""
    steps: int
    """Steps the lead rank completed in the bucket (new and replayed)."""
    new_steps: int
    """Of those, the new ones (not replayed): the progress the bucket made."""
    mean_step_s: float | None
    """Their mean duration; None when no step completed."""


class Timeline:
    """Fixed-width buckets of seconds by category, coarsened by merging pairs past ``max_buckets``."""

    def __init__(self, origin: float, width: float, max_buckets: int) -> None:
        assert width > 0 and max_buckets >= 2, (width, max_buckets)
        self.origin = origin
        self.width = width
        self.max_buckets = max_buckets
        self.rows: list[list[float]] = []
        # Frozen Buckets of rows not modified since built: account() reuses them (derived, never saved).
        self._cache: list[Bucket] = []

    # ------------------------------------------------------------ writing
    def add(self, t0: float, t1: float, cat: int) -> None:
        """Attribute ``[t0, t1)`` to category index ``cat``."""
        self._spread(t0, t1, cat, 1.0)

    def move(self, t0: float, t1: float, src: int, dst: int) -> None:
        """Re-label ``[t0, t1)``, previously added as ``src``, as ``dst``."""
        self._spread(t0, t1, src, -1.0)
        self._spread(t0, t1, dst, 1.0)

    def add_step(self, t: float, duration: float, new: bool) -> None:
        """Count one completed step of ``duration`` seconds, ending at ``t`` (``new``: not a replay)."""
        row = self._row(self._index(t))
        row[_STEPS] += 1.0
        row[_STEP_SUM] += duration
        if new:
            row[_NEW_STEPS] += 1.0

    def _index(self, t: float) -> int:
        i = max(0, math.floor((t - self.origin) / self.width))
        while i >= self.max_buckets:
            self._coarsen()
            i = max(0, math.floor((t - self.origin) / self.width))
        return i

    def _row(self, i: int) -> list[float]:
        rows = self.rows
        while len(rows) <= i:
            rows.append([0.0] * _ROW)
        del self._cache[i:]
        return rows[i]

    def _spread(self, t0: float, t1: float, cat: int, sign: float) -> None:
        a = t0
        while a < t1:
            i = self._index(a)
            edge = self.origin + (i + 1) * self.width
            if edge <= a:  # float rounding at an edge: the time belongs to the next bucket
                if i + 1 >= self.max_buckets:
                    self._coarsen()
                    continue
                i += 1
                edge = self.origin + (i + 1) * self.width
            end = min(t1, edge) if edge > a else t1
            self._row(i)[cat] += sign * (end - a)
            a = end

    def _coarsen(self) -> None:
        rows = self.rows
        if len(rows) % 2:
            rows.append([0.0] * _ROW)
        self.rows = [[x + y for x, y in zip(rows[j], rows[j + 1])] for j in range(0, len(rows), 2)]
        self.width *= 2.0
        self._cache = []

    # ------------------------------------------------------------ reading
    def clone_tail(self) -> Timeline:
        """A copy whose last row may be written without touching this one (rows before it are shared)."""
        other = Timeline(self.origin, self.width, self.max_buckets)
        other.rows = list(self.rows)
        if other.rows:
            other.rows[-1] = list(other.rows[-1])
        return other

    def buckets(self, shared_with: Timeline | None = None) -> tuple[Bucket, ...]:
        """Every bucket as a frozen :class:`Bucket`.

        ``shared_with`` is the timeline this one was cloned from: its cached
        buckets are reused for the rows the clone has not changed.
        """
        reuse: list[Bucket] = []
        if shared_with is not None and shared_with.width == self.width:
            reuse = shared_with._cached()[: max(0, len(shared_with.rows) - 1)]
        out = list(reuse)
        out.extend(self._make(i) for i in range(len(out), len(self.rows)))
        return tuple(out)

    def _cached(self) -> list[Bucket]:
        cache = self._cache
        cache.extend(self._make(i) for i in range(len(cache), len(self.rows)))
        return cache

    def _make(self, i: int) -> Bucket:
        row = self.rows[i]
        steps = int(row[_STEPS])
        t0 = self.origin + i * self.width
        return Bucket(t0=t0, t1=self.origin + (i + 1) * self.width,
                      seconds=dict(zip(CATEGORIES, row[:N_CATEGORIES])), steps=steps,
                      new_steps=int(row[_NEW_STEPS]), mean_step_s=row[_STEP_SUM] / steps if steps else None)

    def window(self, start: float, now: float) -> tuple[list[float], float]:
        """Seconds by category within ``[start, now]``, and the new steps completed in it.

        The bucket straddling ``start`` counts pro rata, its steps as well as
        its seconds (a step is counted in the bucket where it completed).
        Every second from the origin to ``now`` must have been added.
        """
        full: list[list[float]] = []
        partial = [0.0] * (N_CATEGORIES + 1)  # seconds by category, then new steps
        for i in range(len(self.rows) - 1, -1, -1):
            t0 = self.origin + i * self.width
            end = min(self.origin + (i + 1) * self.width, now)
            if end <= start:
                break
            row = self.rows[i]
            if t0 >= start:
                full.append(row)
                continue
            covered = end - t0
            if covered > 0:
                share = (end - start) / covered
                partial = [p + share * x for p, x in zip(partial, [*row[:N_CATEGORIES], row[_NEW_STEPS]])]
        sums = [math.fsum(col) for col in zip(*full)] if full else [0.0] * _ROW
        seconds = [s + p for s, p in zip(sums[:N_CATEGORIES], partial)]
        return seconds, sums[_NEW_STEPS] + partial[N_CATEGORIES]

    # ------------------------------------------------------------ state
    def to_dict(self) -> dict[str, Any]:
        """Rows sparse (``[index, value, ...]`` of the non-zero entries): most buckets hold one or two categories."""
        rows = [[x for i, v in enumerate(r) if v for x in (i, v)] for r in self.rows]
        return {"origin": self.origin, "width": self.width, "rows": rows}

    @classmethod
    def from_dict(cls, d: dict[str, Any], max_buckets: int) -> Timeline:
        tl = cls(float(d["origin"]), float(d["width"]), max_buckets)
        for sparse in d["rows"]:
            row = [0.0] * _ROW
            for j in range(0, len(sparse), 2):
                row[int(sparse[j])] = float(sparse[j + 1])
            tl.rows.append(row)
        while len(tl.rows) > max_buckets:
            tl._coarsen()
        return tl
