"""Silent-slowdown detection: the whole job got slower than its own baseline, and which section moved.

The job's time per step in a window is the median over ranks of each
rank's mean seconds per step (boundary to boundary, so a longer checkpoint
stall counts).  After ``warmup_windows``, the median of the next
``baseline_windows`` windows is the baseline; from then on the log ratio of
each window to it goes through the CUSUM of :mod:`resilient.watchdog.cusum`
(noise from the series' own successive differences).  A slowdown begins
when the CUSUM flags and ends when it clears; while it lasts its cost, the
seconds per step above the baseline times the steps, accumulates.

**Attribution** compares each section now (the median of the last
``consecutive`` windows) with its baseline, both on the job (median over
ranks) and on every single rank, and names the largest move:

- one rank's section grew more than the job's: that rank (a straggler, or
  its own input path);
- a section grew on every rank: ``data`` is the input pipeline,
  ``compute`` clocks, thermals or a code change, ``optimizer`` the
  optimizer, ``checkpoint`` storage, a user's section by name;
- ``comm`` grew beyond what a single slow rank explains (its peers wait for
  it in communication): the network.

Pure: :meth:`SlowdownDetector.observe` takes one window of every rank and
returns what changed; no clock, no I/O.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from ..core.errors import ConfigError
from .cusum import Cusum, CusumRule, advance, noise
from .timing import CHECKPOINT, COMM, COMPUTE, DATA, OPTIMIZER, RankWindow

CAUSES = {
    DATA: "the input pipeline (data wait)",
    COMPUTE: "compute on every rank (clocks, thermals or a code change)",
    COMM: "communication (the network)",
    OPTIMIZER: "the optimizer step on every rank",
    CHECKPOINT: "the checkpoint stall (storage)",
}
"""What a section that grew on every rank points at."""


@dataclass(frozen=True, kw_only=True)
class SlowdownConfig:
    """How the slowdown detector sets its baseline and decides."""

    enabled: bool = True
    """Off: windows are not scored (a slowdown in progress ends)."""
    rule: CusumRule = field(default_factory=lambda: CusumRule(min_effect=0.25))
    """Tuned to a 25% slowdown, so moves under 12% are never accumulated: a job's own step time wanders by 10-15%
    for tens of seconds on a shared machine (``tests/data/step_noise.json``), which is not worth a page."""
    warmup_windows: int = 4
    """Windows ignored after a start or a re-formation."""
    baseline_windows: int = 40
    """Windows after the warm-up whose median is the first baseline (200 steps)."""
    rolling_windows: int = 200
    """The baseline then follows the job: the median of up to this many windows (1,000 steps) before the most
    recent ``gap_windows``, frozen while a slowdown lasts (so a long slowdown is never taken for the norm)."""
    gap_windows: int = 20
    """The most recent windows left out of the baseline (a slowdown gathering evidence is not its own baseline)."""
    history: int = 40
    """Windows kept for the noise estimate."""
    noise_floor: float = 0.01
    """Smallest noise assumed (log units)."""

    def __post_init__(self) -> None:
        for name in ("warmup_windows", "baseline_windows", "history", "rolling_windows", "gap_windows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"SlowdownConfig.{name}={value!r} must be an int >= 0 (windows)")
        if self.baseline_windows < 3:
            raise ConfigError(f"SlowdownConfig.baseline_windows={self.baseline_windows} must be >= 3: the "
                              "baseline's noise is estimated from it")
        if not (isinstance(self.noise_floor, (int, float)) and math.isfinite(self.noise_floor)
                and self.noise_floor > 0):
            raise ConfigError(f"SlowdownConfig.noise_floor={self.noise_floor!r} must be a positive number")


@dataclass(frozen=True)
class Attribution:
    """The section (and rank, when one rank's) that explains most of a slowdown."""

    section: str
    rank: int | None
    """The single rank whose section grew, or None where it grew on every rank."""
    node: str
    delta_s: float
    """Seconds per step the section grew (on that rank, beyond the job's median, when ``rank`` is set)."""
    share: float
    """``delta_s`` over the growth of the job's step time."""
    cause: str


@dataclass(frozen=True)
class SlowdownChange:
    """A slowdown of the whole job began or ended."""

    kind: Literal["began", "ended"]
    window: int
    baseline_s: float
    step_s: float
    """The job's seconds per step over the evidence windows."""
    attribution: Attribution | None
    excess_s: float
    """Seconds above the baseline so far (at "ended": the slowdown's whole cost)."""
    reason: str

    @property
    def ratio(self) -> float:
        return self.step_s / self.baseline_s


class SlowdownDetector:
    """Watches the job's step time against its own baseline and attributes a lasting rise to a section."""

    def __init__(self, config: SlowdownConfig | None = None) -> None:
        self.config = config or SlowdownConfig()
        self.reset()

    def reset(self) -> None:
        """Forget the baseline and every history (a new generation or a new world size)."""
        self._seen = 0
        self._base: list[tuple[float, Mapping[int, RankWindow]]] = []
        self._hist: deque[tuple[float, Mapping[int, RankWindow]]] = deque(
            maxlen=self.config.rolling_windows + self.config.gap_windows)
        """Windows the baseline is taken from (the newest ``gap_windows`` of them left out); none while slow."""
        self.baseline_s: float | None = None
        self._y: deque[float] = deque(maxlen=self.config.history)
        self._recent: deque[tuple[float, int, Mapping[int, RankWindow]]] = deque(maxlen=self.config.history)
        self._base_noise = self.config.noise_floor
        self._cusum = Cusum()
        self.excess_s = 0.0
        self.last: SlowdownChange | None = None

    @property
    def slow(self) -> bool:
        return self._cusum.flagged

    def reconfigure(self, config: SlowdownConfig) -> list[SlowdownChange]:
        """Use ``config`` from the next window on; turning it off ends a slowdown in progress."""
        if not config.enabled:
            self.config = config
            return self.finish()
        self.config = config
        self._y = deque(self._y, maxlen=config.history)
        self._recent = deque(self._recent, maxlen=config.history)
        self._hist = deque(self._hist, maxlen=config.rolling_windows + config.gap_windows)
        return []

    def end(self) -> list[SlowdownChange]:
        """End a slowdown in progress, if any (the run ended): its change carries the cost; the baseline stays."""
        return self._end(self._recent[-1][1] if self._recent else -1) if self.slow else []

    def finish(self) -> list[SlowdownChange]:
        """End a slowdown in progress (if any) and forget everything (see :meth:`reset`)."""
        ended = self.end()
        self.reset()
        return ended

    def observe(self, windows: Mapping[int, RankWindow]) -> list[SlowdownChange]:
        """Score one window of every rank; return a slowdown that began or ended."""
        cfg = self.config
        if not cfg.enabled or not windows:
            return []
        self._seen += 1
        if self._seen <= cfg.warmup_windows:
            return []
        index = max(w.window for w in windows.values())
        step_s = statistics.median(w.step_s for w in windows.values())
        steps = max(w.steps for w in windows.values())
        if self.baseline_s is None:
            self._base.append((step_s, windows))
            if len(self._base) >= cfg.baseline_windows:
                self._set_baseline()
            return []
        y = math.log(max(step_s, 1e-9) / self.baseline_s)
        self._y.append(y)
        self._recent.append((step_s, index, windows))
        sigma = noise(self._y, cfg.noise_floor) if len(self._y) >= cfg.baseline_windows else self._base_noise
        was = self._cusum.flagged
        self._cusum = advance(self._cusum, y, sigma, cfg.rule)
        if self._cusum.flagged:
            if not was:  # the evidence windows were slow too: count them from the start
                n = min(cfg.rule.consecutive, len(self._recent))
                self.excess_s = sum(max(0.0, s - self.baseline_s) * _steps(ws) for s, _, ws in list(self._recent)[-n:])
                self.last = self._change("began", index)
                return [self.last]
            self.excess_s += max(0.0, step_s - self.baseline_s) * steps
            return []
        ended = self._end(index) if was else []
        self._follow((step_s, windows))
        return ended

    def _follow(self, window: tuple[float, Mapping[int, RankWindow]]) -> None:
        """Take a window that is not part of a slowdown into the rolling baseline."""
        self._hist.append(window)
        older = list(self._hist)[:-self.config.gap_windows or None]
        if len(older) >= self.config.baseline_windows:
            self.baseline_s = statistics.median(s for s, _ in older)

    def _end(self, index: int) -> list[SlowdownChange]:
        self._cusum = Cusum()
        change = self._change("ended", index)
        self.last = change
        self.excess_s = 0.0
        return [change]

    def _set_baseline(self) -> None:
        times = [s for s, _ in self._base]
        self.baseline_s = statistics.median(times)
        logs = [math.log(max(t, 1e-9) / self.baseline_s) for t in times]
        self._base_noise = noise(logs, self.config.noise_floor)
        self._y.extend(logs)
        self._hist.extend(self._base)
        self._base = []

    def _change(self, kind: Literal["began", "ended"], index: int) -> SlowdownChange:
        assert self.baseline_s is not None
        n = min(self.config.rule.consecutive, len(self._recent))
        recent = list(self._recent)[-n:]
        step_s = statistics.median(s for s, _, _ in recent) if recent else self.baseline_s
        attribution = self._attribute([ws for _, _, ws in recent], step_s) if recent else None
        pct = (step_s / self.baseline_s - 1) * 100
        where = "" if attribution is None else f"; it moved in {_describe(attribution)}"
        if kind == "began":
            reason = (f"the job slowed down: {step_s * 1e3:.1f} ms per step against its baseline "
                      f"{self.baseline_s * 1e3:.1f} ms ({pct:+.0f}%){where}")
        else:
            reason = (f"the slowdown ended: {step_s * 1e3:.1f} ms per step against the baseline "
                      f"{self.baseline_s * 1e3:.1f} ms; it cost {self.excess_s:.1f} s above the baseline")
        return SlowdownChange(kind, index, self.baseline_s, step_s, attribution, self.excess_s, reason)

    def _attribute(self, recent: list[Mapping[int, RankWindow]], step_s: float) -> Attribution | None:
        """The section (and rank) whose growth explains most of the step time's."""
        assert self.baseline_s is not None
        grew = step_s - self.baseline_s
        if grew <= 0:
            return None
        older = [ws for _, ws in list(self._hist)[:-self.config.gap_windows or None]] or [ws for _, ws in self._hist]
        base_job = _job_sections(older)
        base_rank = {r: _rank_sections([ws[r] for ws in older if r in ws]) for r in {r for ws in older for r in ws}}
        job = _job_sections(recent)
        job_delta = {s: job.get(s, 0.0) - base_job.get(s, 0.0) for s in set(job) | set(base_job)}
        candidates: list[tuple[float, str, int | None, str]] = []
        worst_single = 0.0
        for rank, base in base_rank.items():
            now = _rank_sections([ws[rank] for ws in recent if rank in ws])
            node = next((ws[rank].node for ws in recent if rank in ws), "")
            for section in set(now) - {COMM}:
                single = now[section] - base.get(section, 0.0) - job_delta.get(section, 0.0)
                worst_single = max(worst_single, single)
                candidates.append((single, section, rank, node))
        for section, delta in job_delta.items():
            # Peers waiting for one slow rank spend its extra time in communication: that part is not the network.
            candidates.append((delta - worst_single if section == COMM else delta, section, None, ""))
        delta, section, who, node = max(candidates, key=lambda c: (c[0], c[2] is None))
        if delta <= 0:
            return None
        cause = CAUSES.get(section, f"the section {section!r} on every rank") if who is None else \
            f"rank {who}'s input pipeline" if section == DATA else f"rank {who}'s {section} (a straggler)"
        return Attribution(section, who, node, delta, min(1.0, delta / grew), cause)


def _steps(windows: Mapping[int, RankWindow]) -> int:
    return max(w.steps for w in windows.values())


def _rank_sections(windows: list[RankWindow]) -> dict[str, float]:
    """Per section, the median over ``windows`` of one rank's seconds per step."""
    names = {s for w in windows for s in w.sections}
    return {s: statistics.median(w.sections.get(s, 0.0) for w in windows) for s in names}


def _job_sections(windows: list[Mapping[int, RankWindow]]) -> dict[str, float]:
    """Per section, the median over windows of the median over ranks."""
    names = {s for ws in windows for w in ws.values() for s in w.sections}
    return {s: statistics.median(statistics.median(w.sections.get(s, 0.0) for w in ws.values()) for ws in windows)
            for s in names}


def _describe(a: Attribution) -> str:
    share = f"{a.share * 100:.0f}% of the rise"
    node = f" on node {a.node}" if a.node else ""
    return f"{a.cause}{node}: +{a.delta_s * 1e3:.1f} ms per step, {share}"
