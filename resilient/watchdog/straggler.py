"""Straggler detection: which rank is slow, in which section, by how much, against its peers.

For every window of steps and every section a rank spends time in (see
:mod:`resilient.watchdog.timing`), the rank's **relative** value is the log
of its seconds per step over the median of its peers' (the other ranks,
itself left out, so two ranks can be told apart).  Each (rank, section)
series goes through the CUSUM of :mod:`resilient.watchdog.cusum`, with the
noise of that section taken as the median over ranks of each series' own
window-to-window noise (a straggler is one series among several, so it
cannot inflate the noise that is meant to expose it).  A rank is flagged in
a section after the CUSUM passes its decision level with ``consecutive``
slow windows in a row, and cleared with hysteresis.

A rank whose extra time is mostly waiting for a CPU (its training thread
runnable but not running, as the window's ``cpu_wait`` says: half of it or
more, or all but ``min_share`` of a step) is slower
because of its host's scheduler, not its own work: on a busy host the
scheduler keeps one rank waiting for a while and then another.  Such a flag
needs ``contention_windows`` windows in a row; a CPU quota or a neighbour
that goes on starving the rank is then flagged, and the reason says how
much of the extra time was the wait.

The wait is also scored on its own, as the series :data:`~resilient.watchdog.timing.CPU_WAIT`
of each rank, with the same persistence.  A quota's throttling lands in
whatever section the rank is in when its budget runs out: in compute one
window, in the all-reduce (never scored) the next, so no section's series
stays slow for long, while the wait itself does, window after window.

Its **individual** value, the window against the rank's own recent best
(its 10th percentile over ``history`` windows), is reported beside it: it
tells a rank that got slower from one that always was.

Communication is never scored here: ranks waiting for a straggler spend
longer in it, the straggler shorter (:data:`~resilient.watchdog.timing.NOT_A_CULPRIT`).
Nor is the checkpoint time of the rank that commits (:data:`COMMITTER`): it
does work there that no other rank does.

Pure: :meth:`StragglerDetector.observe` takes one window of every rank and
returns what changed; no clock, no I/O.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

from ..core.errors import ConfigError
from .cusum import Cusum, CusumRule, advance, noise
from .timing import CHECKPOINT, CPU_WAIT, NOT_A_CULPRIT, RankWindow

COMMITTER = 0
"""The rank that commits every checkpoint (:mod:`resilient.checkpoint.commit`): its checkpoint time holds work no
other rank does (the manifest, the fence, retention; tens of ms a save on S3), so it is compared with no one
there, and the other ranks' checkpoint time is compared among themselves."""


@dataclass(frozen=True, kw_only=True)
class StragglerConfig:
    """How the straggler detector scores windows."""

    enabled: bool = True
    """Off: windows are not scored and nothing is flagged (standing flags are cleared)."""
    rule: CusumRule = field(default_factory=CusumRule)
    """When a rank's series counts as slow, and when as recovered."""
    warmup_windows: int = 2
    """Windows ignored after a start or a re-formation (compilation, cold caches)."""
    history: int = 40
    """Windows of each series kept for its noise and its own best."""
    min_history: int = 6
    """Windows of history a section needs before it is scored."""
    noise_floor: float = 0.01
    """Smallest noise assumed (log units: 0.01 is about 1%), so a very quiet section is not over-trusted."""
    min_seconds: float = 0.0005
    """Seconds per step below which a section's time is treated as this much (too short to compare)."""
    min_share: float = 0.05
    """A rank is flagged only when its extra time in the section is at least this share of the job's step
    (0.05: 5%): a tiny section that is 40% slower costs the job nothing worth a page."""
    min_evidence_s: float = 3.0
    """Seconds of training a flag's slow windows must span at least (besides the rule's ``consecutive``): a busy
    host makes one rank slower for a second or so at a time (another process, a collection, the page cache), and
    with steps of a few milliseconds three windows last a fraction of that.  Steps of a second or more meet it
    with the rule's windows alone."""
    contention_windows: int = 12
    """Windows in a row a flag needs when the rank's extra wait for a CPU over its peers' explains half or more of
    its extra time, or all but ``min_share`` of a step of it (a busy host's scheduler, unless it persists); and a
    flag of the wait itself (``cpu_wait``) always."""

    def __post_init__(self) -> None:
        for name in ("warmup_windows", "history", "min_history", "contention_windows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"StragglerConfig.{name}={value!r} must be an int >= 0 (windows)")
        if self.min_history < 3 or self.min_history > self.history:
            raise ConfigError(f"StragglerConfig.min_history={self.min_history} must be between 3 and "
                              f"history={self.history}: noise is estimated from at least 3 windows")
        if not (isinstance(self.min_evidence_s, (int, float)) and math.isfinite(self.min_evidence_s)
                and self.min_evidence_s >= 0):
            raise ConfigError(f"StragglerConfig.min_evidence_s={self.min_evidence_s!r} must be a number of seconds >= 0")
        for name in ("noise_floor", "min_seconds", "min_share"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(f"StragglerConfig.{name}={value!r} must be a positive number")


@dataclass(frozen=True)
class StragglerChange:
    """A rank flagged as a straggler in a section, or cleared."""

    kind: Literal["flagged", "cleared"]
    rank: int
    node: str
    section: str
    window: int
    ratio: float
    """The rank's seconds per step over its peers' median, over the evidence windows (1.25: 25% slower)."""
    rank_s: float
    peers_s: float
    individual: float
    """The rank's seconds per step over its own recent best."""
    noise: float
    """The section's window-to-window noise (log units) the decision used."""
    steps: int
    """Steps in the evidence windows."""
    reason: str
    cpu_wait_s: float | None = None
    """The rank's wait for a CPU per step over its peers' median, over the evidence windows (None: unmeasured)."""


@dataclass(frozen=True)
class RankScore:
    """The latest scores of one rank in one section (for gauges and ``resilient status``)."""

    rank: int
    node: str
    section: str
    relative: float
    """Seconds per step over the peers' median in the latest window."""
    individual: float
    """Seconds per step over the rank's own recent best."""
    flagged: bool


@dataclass
class _Series:
    """One (rank, section): its log ratios, its own values, its peers' medians, its CUSUM."""

    x: deque[float]
    own: deque[float]
    peers: deque[float]
    steps: deque[int]
    waits: deque[float | None]
    """The rank's run-queue wait per step in each window (None where not measured)."""
    node: str = ""
    cusum: Cusum = Cusum()
    held: int = 0
    """Windows in a row this series' flag was held back as the host's contention."""


class StragglerDetector:
    """Scores every rank's windows against its peers' and flags the persistently slow ones."""

    def __init__(self, config: StragglerConfig | None = None) -> None:
        self.config = config or StragglerConfig()
        self._series: dict[tuple[int, str], _Series] = {}
        self._seen = 0

    def reset(self) -> None:
        """Forget every series (a new generation: ranks renumbered, world changed); warm up again."""
        self._series.clear()
        self._seen = 0

    def reconfigure(self, config: StragglerConfig) -> list[StragglerChange]:
        """Use ``config`` from the next window on; returns the flags cleared by turning the detector off."""
        self.config = config
        return [] if config.enabled else self.clear()

    def clear(self) -> list[StragglerChange]:
        """Clear every standing flag and forget every series (see :meth:`reset`); returns the flags cleared."""
        cleared = [self._change("cleared", r, s, ser, -1) for (r, s), ser in sorted(self._series.items())
                   if ser.cusum.flagged]
        self.reset()
        return cleared

    def observe(self, windows: Mapping[int, RankWindow]) -> list[StragglerChange]:
        """Score one window of steps, ``windows[rank]`` from every rank; return who was flagged or cleared."""
        cfg = self.config
        if not cfg.enabled or len(windows) < 2:
            return []
        self._seen += 1
        if self._seen <= cfg.warmup_windows:
            return []
        index = max(w.window for w in windows.values())
        sections = sorted({s for w in windows.values() for s in w.sections} - NOT_A_CULPRIT - {CPU_WAIT})
        series = {section: {r: w.sections.get(section, 0.0) for r, w in windows.items()
                            if not (section == CHECKPOINT and r == COMMITTER)} for section in sections}
        if all(w.cpu_wait is not None for w in windows.values()):
            series[CPU_WAIT] = {r: w.cpu_wait or 0.0 for r, w in windows.items()}
        changes: list[StragglerChange] = []
        for section, raw in series.items():
            values = {r: max(v, cfg.min_seconds) for r, v in raw.items()}
            if len(values) < 2 or all(v <= cfg.min_seconds for v in values.values()):
                continue
            for rank, value in values.items():
                ref = statistics.median(v for r, v in values.items() if r != rank)
                ser = self._series.get((rank, section))
                if ser is None:
                    n = cfg.history
                    ser = self._series[(rank, section)] = _Series(deque(maxlen=n), deque(maxlen=n),
                                                                  deque(maxlen=n), deque(maxlen=n),
                                                                  deque(maxlen=n))
                ser.node = windows[rank].node
                ser.x.append(math.log(value / ref))
                ser.own.append(value)
                ser.peers.append(ref)
                ser.steps.append(windows[rank].steps)
                ser.waits.append(windows[rank].cpu_wait)
            sigma = self._noise(section)
            if sigma is None:
                continue
            step_s = statistics.median(w.step_s for w in windows.values())
            for rank in sorted(values):
                ser = self._series[(rank, section)]
                was = ser.cusum.flagged
                ser.cusum = advance(ser.cusum, ser.x[-1], sigma, cfg.rule)
                if ser.cusum.flagged and not was and not (self._material(ser, step_s) and self._lasted(ser, step_s)):
                    ser.cusum = replace(ser.cusum, flagged=False)  # too small, or too brief yet: keep watching
                if ser.cusum.flagged and not was and self._contended(rank, section, step_s):
                    ser.held += 1
                    if ser.held < cfg.contention_windows or self._standing(rank, section):
                        # The scheduler's doing, unless it persists; and said once per rank (a flag in
                        # another section, or of the wait itself, already names it).
                        ser.cusum = replace(ser.cusum, flagged=False)
                elif not ser.cusum.flagged:
                    ser.held = 0
                if ser.cusum.flagged != was:
                    changes.append(self._change("flagged" if ser.cusum.flagged else "cleared", rank, section, ser,
                                                index, sigma))
        return changes

    def scores(self) -> list[RankScore]:
        """The latest relative and individual score of every (rank, section) series."""
        return [RankScore(rank, ser.node, section, math.exp(ser.x[-1]), _individual(ser), ser.cusum.flagged)
                for (rank, section), ser in sorted(self._series.items()) if ser.x]

    def flagged(self) -> list[tuple[int, str]]:
        """(rank, section) of every standing flag."""
        return [key for key, ser in sorted(self._series.items()) if ser.cusum.flagged]

    def _standing(self, rank: int, section: str) -> bool:
        """Whether ``rank`` has a standing flag in a section other than ``section``."""
        return any(ser.cusum.flagged for (r, s), ser in self._series.items() if r == rank and s != section)

    def _extra(self, ser: _Series) -> float:
        """The rank's seconds per step over its peers' median, over the evidence windows."""
        n = max(1, min(self.config.rule.consecutive, len(ser.own)))
        return statistics.median(list(ser.own)[-n:]) - statistics.median(list(ser.peers)[-n:])

    def _material(self, ser: _Series, step_s: float) -> bool:
        """Whether the rank's extra time over its peers, over the evidence windows, is worth flagging."""
        return self._extra(ser) >= self.config.min_share * step_s

    def _lasted(self, ser: _Series, step_s: float) -> bool:
        """Whether the series' windows in a row above the reference span ``min_evidence_s`` of training."""
        run = min(ser.cusum.run, len(ser.steps))
        return sum(list(ser.steps)[-run:]) * step_s >= self.config.min_evidence_s if run else False

    def _extra_wait(self, rank: int, section: str) -> float | None:
        """The rank's wait for a CPU per step over its peers' median, over the evidence windows; None if unmeasured."""
        n = max(1, min(self.config.rule.consecutive, len(self._series[(rank, section)].waits)))
        raw_mine = list(self._series[(rank, section)].waits)[-n:]
        raw_peers = [list(ser.waits)[-n:] for (r, s), ser in self._series.items() if s == section and r != rank]
        mine = [w for w in raw_mine if w is not None]
        peers = [[w for w in p if w is not None] for p in raw_peers]
        if len(mine) != len(raw_mine) or not peers or any(len(p) != len(raw_mine) for p in peers):
            return None  # not measured on some rank or window
        return statistics.median(mine) - statistics.median(statistics.median(p[i] for p in peers)
                                                           for i in range(len(mine)))

    def _contended(self, rank: int, section: str, step_s: float) -> bool:
        """Whether the rank's extra wait for a CPU explains most (half or more) of its extra time in the section,
        or leaves less than ``min_share`` unexplained (always, for the wait itself: it is the host's contention)."""
        wait = self._extra_wait(rank, section)
        if wait is None or wait <= 0:
            return False
        extra = self._extra(self._series[(rank, section)])
        return section == CPU_WAIT or wait >= 0.5 * extra or extra - wait < self.config.min_share * step_s

    def _noise(self, section: str) -> float | None:
        """The section's noise: the median over ranks of each series' own noise; None before ``min_history``."""
        cfg = self.config
        own = [noise(ser.x, cfg.noise_floor) for (_, s), ser in self._series.items()
               if s == section and len(ser.x) >= cfg.min_history]
        return statistics.median(own) if len(own) >= 2 else None

    def _change(self, kind: Literal["flagged", "cleared"], rank: int, section: str, ser: _Series, window: int,
                sigma: float | None = None) -> StragglerChange:
        n = max(1, min(self.config.rule.consecutive, len(ser.own)))
        rank_s = statistics.median(list(ser.own)[-n:])
        peers_s = statistics.median(list(ser.peers)[-n:])
        steps = sum(list(ser.steps)[-n:])
        ratio = rank_s / peers_s
        sigma = self._noise(section) if sigma is None else sigma
        noise_text = "" if sigma is None else f"; noise {sigma * 100:.1f}% per window"
        wait = self._extra_wait(rank, section)
        if kind == "flagged" and wait is not None and wait > 0.1 * max(rank_s - peers_s, 0.0):
            noise_text += (f"; {wait * 1e3:.1f} ms per step more than its peers waiting for a CPU (the host's CPUs "
                           f"are oversubscribed or a CPU quota throttles it)")
        where = f"rank {rank}" + (f" (node {ser.node})" if ser.node else "")
        if section == CPU_WAIT and kind == "flagged":
            reason = (f"{where} is a straggler waiting for a CPU ({CPU_WAIT}): runnable but not running "
                      f"{rank_s * 1e3:.1f} ms per step against its peers' median {peers_s * 1e3:.1f} ms over the "
                      f"last {steps} steps, whatever section it was in; a CPU quota throttles it or its host's "
                      f"CPUs are oversubscribed{'' if sigma is None else f' (noise {sigma * 100:.1f}% per window)'}")
        elif kind == "flagged":
            reason = (f"{where} is a straggler in {section}: {rank_s * 1e3:.1f} ms per step against its peers' "
                      f"median {peers_s * 1e3:.1f} ms ({(ratio - 1) * 100:+.0f}%) over the last {steps} steps"
                      f"{noise_text}")
        else:
            reason = (f"{where} is no longer a straggler in {section}: {rank_s * 1e3:.1f} ms per step against its "
                      f"peers' median {peers_s * 1e3:.1f} ms ({(ratio - 1) * 100:+.0f}%) over the last {steps} steps")
        return StragglerChange(kind, rank, ser.node, section, window, ratio, rank_s, peers_s, _individual(ser),
                               sigma or 0.0, steps, reason, None if wait is None else round(wait, 6))


def _individual(ser: _Series) -> float:
    """The latest value over the series' own 10th percentile (its recent best)."""
    own = sorted(ser.own)
    best = own[int(0.1 * (len(own) - 1))]
    return ser.own[-1] / best if best > 0 else 1.0
