"""The detectors on seeded traces of this machine's real step-time noise, with known faults at known steps.

The noise is ``tests/data/step_noise.json`` (recorded by
``benchmarks/record_step_noise.py``: 3 ranks of real gloo DDP training,
windows of 5 steps); faults are added with the effect they have on a
synchronous job (``resilient.watchdog.traces``).  Asserted: detection
latency per slowdown size, the rank and the section named, the cause of a
job-wide slowdown, and no false flag over 100,000 healthy steps.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from resilient.watchdog.slowdown import SlowdownDetector
from resilient.watchdog.straggler import StragglerConfig, StragglerDetector
from resilient.watchdog.traces import healthy, load_noise, replay, with_job_slowdown, with_straggler

NOISE = load_noise(Path(__file__).parent / "data" / "step_noise.json")
ONSET = 80  # windows of healthy history before each fault (400 steps: warm-up and the 200-step baseline first)
SEEDS = range(8)
RULE_ALONE = StragglerConfig(min_evidence_s=0.0)
"""The CUSUM rule's latency on this noise, without the evidence floor (tested on its own below)."""


@pytest.mark.parametrize("factor,median_steps,max_steps", [(1.50, 15, 15), (1.25, 20, 25), (1.10, 100, 200)])
def test_a_straggler_is_flagged_in_time_naming_the_rank_and_compute(factor, median_steps, max_steps):
    """Steps from the onset to the flag, over 8 seeded traces: the median and the slowest bounded.

    The bounds are this noise's (compute varies by 10% between windows at the 90th percentile): a 25%
    straggler takes 20 steps at the median and 25 at most, a 10% one 70 and 160 (benchmarks/straggler_bench.py).
    """
    latencies = []
    for seed in SEEDS:
        trace = with_straggler(healthy(NOISE, ONSET + 60, seed=seed), 1, factor, start=ONSET)
        seen = replay(trace, onset=ONSET, straggler=StragglerDetector(RULE_ALONE))
        flags = [s for s in seen if s.kind == "flagged"]
        assert flags, f"seed {seed}: a {factor - 1:.0%} straggler was never flagged"
        first = flags[0]
        assert (first.rank, first.section) == (1, "compute"), f"seed {seed}: {flags}"
        assert all(s.rank == 1 for s in flags), f"seed {seed}: another rank flagged too: {flags}"
        assert first.steps_after_onset is not None and first.steps_after_onset > 0
        latencies.append(first.steps_after_onset)
    assert statistics.median(latencies) <= median_steps and max(latencies) <= max_steps, latencies


@pytest.mark.parametrize("section,cause", [("data", "data"), ("comm", "comm")])
def test_a_job_wide_slowdown_is_not_a_straggler_and_is_attributed_to_its_section(section, cause):
    """A 20% slowdown of every rank is never a straggler, and is attributed to its section when seen.

    In one of the 8 traces it is not seen: it falls where the recorded job ran 15% faster than its
    baseline, so the job was only a few percent slower than its baseline (the rule ignores moves under 12%).
    """
    seen_in = []
    for seed in SEEDS:
        trace = with_job_slowdown(healthy(NOISE, ONSET + 60, seed=seed), section, 0.20, start=ONSET)
        seen = replay(trace, onset=ONSET, straggler=StragglerDetector(), slowdown=SlowdownDetector())
        assert not [s for s in seen if s.detector == "straggler"], f"seed {seed}: {seen}"
        began = [s for s in seen if s.detector == "slowdown" and s.kind == "began"]
        if began:
            assert (began[0].rank, began[0].section) == (None, cause), f"seed {seed}: {began}"
            assert began[0].steps_after_onset is not None and 0 < began[0].steps_after_onset <= 100
            seen_in.append(seed)
    assert len(seen_in) >= 7, seen_in


def test_no_false_flag_in_100000_healthy_steps():
    windows = 0
    for seed in range(100, 110):
        trace = healthy(NOISE, 2000, seed=seed)
        windows += len(trace)
        seen = replay(trace, straggler=StragglerDetector(), slowdown=SlowdownDetector())
        assert seen == [], f"seed {seed}: {seen[:3]}"
    assert windows * 5 == 100_000


def test_with_the_evidence_floor_a_straggler_is_flagged_within_seconds_and_a_brief_burst_never():
    """The default detector on the same noise: a 50% straggler is flagged once its slow windows span the 3 s floor
    (plus at most a few windows), and the same straggler for 1.5 s only (a burst of the host's) is not."""
    floor = StragglerConfig().min_evidence_s
    for seed in SEEDS:
        healthy_trace = healthy(NOISE, ONSET + 200, seed=seed)
        lasting = with_straggler(healthy_trace, 1, 1.5, start=ONSET)
        step_s = statistics.median(w.step_s for ws in lasting[ONSET:] for w in ws.values())
        flags = [s for s in replay(lasting, onset=ONSET, straggler=StragglerDetector()) if s.kind == "flagged"]
        assert flags and (flags[0].rank, flags[0].section) == (1, "compute"), f"seed {seed}: {flags}"
        seconds = flags[0].steps_after_onset * step_s
        assert floor <= seconds * 1.2 and seconds <= floor * 1.2 + 2.0, (seed, seconds)
        burst_windows = int(1.5 / (5 * step_s))
        burst = lasting[:ONSET + burst_windows] + healthy_trace[ONSET + burst_windows:]
        assert [s for s in replay(burst, onset=ONSET, straggler=StragglerDetector(RULE_ALONE))
                if s.kind == "flagged"], f"seed {seed}: the rule alone sees the burst"
        assert not replay(burst, onset=ONSET, straggler=StragglerDetector()), f"seed {seed}"
