"""Input-path isolation, the verdict: is the run waiting on its input pipeline?  Pure.

``resilient diagnose input`` runs the script twice over in one job
(:mod:`resilient.worker.diagnose`): steps on the real input path, then as
many on the same batches held in memory.  The difference in step time is
what the input path costs a step (reading, decoding, collating, transfer,
as far as the loop waits for them).  The job's step is the slowest rank's,
so each phase's step time is the slowest rank's median over its windows
(the first window of each phase is left out: start-up, and the loader's
first fill).  The run is called input-bound when that cost is at least
``min_share`` of a step with the batches in memory and three times the
noise of the windows (1.4826 MAD), and the loop's wait for data accounts
for it: the wait grows by at least half the cost and by ``min_share`` of a
step.  A step that is slower on the real path while the loop hardly waits
longer for its batches is not the input path's doing (noise on a loaded
host, or loader workers competing with compute for CPUs, which the verdict
names); otherwise the input path is cleared.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MAD_TO_SIGMA = 1.4826


@dataclass(frozen=True)
class PhaseTimes:
    """One rank's phase: median step and data-wait seconds, and the noise of its step time."""

    step_s: float
    data_s: float
    noise_s: float
    windows: int


@dataclass(frozen=True)
class InputVerdict:
    """Whether the input path limits the run, by how much, and why."""

    input_bound: bool
    reason: str
    cost_s: float
    """Seconds per step the input path costs (real step minus in-memory step, slowest ranks)."""
    share: float
    """That cost over the step with the batches in memory."""
    real: PhaseTimes
    resident: PhaseTimes
    """The slowest rank's numbers in each phase."""


def phase_times(windows: Sequence[Mapping[str, Any]], skip: int = 1) -> PhaseTimes:
    """Medians over ``windows`` (timing reports ``{"step", "s": {"data": ...}}``) after the first ``skip``."""
    kept = list(windows[skip:]) or list(windows)
    if not kept:
        raise ValueError("a phase without timing windows: the job ended before it was measured")
    steps = [float(w["step"]) for w in kept]
    data = [float((w.get("s") or {}).get("data", 0.0)) for w in kept]
    median = statistics.median(steps)
    noise = MAD_TO_SIGMA * statistics.median([abs(s - median) for s in steps])
    return PhaseTimes(median, statistics.median(data), noise, len(kept))


def judge_input(results: Mapping[int, Mapping[str, Any]], min_share: float = 0.05) -> InputVerdict:
    """The verdict over every rank's two phases (``{rank: {"windows": {"real": [...], "resident": [...]}}}``)."""
    if not results:
        raise ValueError("no rank reported its diagnosis")
    real = max((phase_times(r["windows"]["real"]) for r in results.values()), key=lambda p: p.step_s)
    resident = max((phase_times(r["windows"]["resident"]) for r in results.values()), key=lambda p: p.step_s)
    cost = real.step_s - resident.step_s
    share = cost / resident.step_s if resident.step_s > 0 else math.inf
    noise = max(real.noise_s, resident.noise_s)
    numbers = (f"{cost * 1e3:.1f} ms of a {real.step_s * 1e3:.1f} ms step ({share:.0%}); with the batches in memory "
               f"a step takes {resident.step_s * 1e3:.1f} ms, and the wait for data goes from "
               f"{real.data_s * 1e3:.1f} ms to {resident.data_s * 1e3:.1f} ms")
    waited = real.data_s - resident.data_s
    slower = cost >= min_share * resident.step_s and cost >= 3 * noise
    if slower and waited >= 0.5 * cost and waited >= min_share * resident.step_s:
        return InputVerdict(True, f"the run is input-bound: the input path costs {numbers}. Look at the loader "
                            "(workers, prefetch, decoding, storage) before the hardware", cost, share, real, resident)
    if slower:
        return InputVerdict(False, f"the input path is not what limits this run: a step is {numbers}, but the "
                            f"loop waits only {waited * 1e3:.1f} ms more for its batches, so the difference is not "
                            "the wait for data (noise on a loaded host, or loader workers competing with compute for "
                            "CPUs: compare with fewer loader workers)", cost, share, real, resident)
    return InputVerdict(False, f"the input path is not what limits this run: it costs {numbers} (noise "
                        f"{noise * 1e3:.1f} ms); a slowdown is elsewhere (compute, communication, storage)",
                        cost, share, real, resident)
