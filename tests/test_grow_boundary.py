"""Where a grow takes effect: its boundary placed from the measured step rate, and only inside the run.

The agent learns the run's length from the ranks' timing windows (``Run.steps(total)``); a grow whose
boundary the run never reaches would leave its joiners waiting for members that have finished.
"""

from __future__ import annotations

import pytest

from resilient.agent.continuation import GROW_LEAD_STEPS, Boundary, place_boundary
from resilient.agent.tracker import HeartbeatIntake, RankTracker
from resilient.worker.protocol import Heartbeat


@pytest.mark.parametrize(("furthest", "rate", "lead_s", "total", "want"), [
    # No end known: the lead alone; no time left to weigh the grow against.
    (10, 2.0, 1.0, None, Boundary(10 + GROW_LEAD_STEPS + 2, None)),
    # Ranks held (no progress): the lead in steps only.
    (9, 0.0, 1.0, 14, Boundary(9 + GROW_LEAD_STEPS, None)),
    # Inside the run: the time after the boundary at the measured rate.
    (10, 2.0, 1.0, 100, Boundary(15, (100 - 15) / 2.0)),
    (10, 2.5, 0.5, 20, Boundary(15, 5 / 2.5)),
    # A boundary at or past the last step is never reached: no grow.
    (10, 2.0, 1.0, 15, None),
    (10, 2.0, 1.0, 16, Boundary(15, 0.5)),
    (12, 0.0, 1.0, 14, None),
])
def test_the_boundary_is_the_lead_past_the_furthest_rank_and_inside_the_run(furthest, rate, lead_s, total, want):
    assert place_boundary(furthest, rate, lead_s, total) == want


def _timing(generation: int, pid: int, report: dict) -> Heartbeat:
    return Heartbeat(rank=0, local_rank=0, pid=pid, section="step", step=4, seq=5, kind="timing",
                     generation=generation, timing=report)


def test_the_tracker_learns_the_run_s_length_from_the_current_ranks_windows_only():
    tracker = RankTracker()
    intake = HeartbeatIntake(tracker, accounting=None)  # type: ignore[arg-type]  timing reports never reach it
    tracker.start_generation({0: 100}, now=0.0, generation=2)
    assert tracker.total_steps is None
    intake(_timing(1, 100, {"w": 0, "n": 5, "left": 95, "total": 100}), 1.0)  # an earlier generation's
    intake(_timing(2, 999, {"w": 0, "n": 5, "left": 95, "total": 100}), 1.0)  # not this rank's process
    assert tracker.total_steps is None
    intake(_timing(2, 100, {"w": 0, "n": 5}), 1.0)  # a loop without an end says none
    assert tracker.total_steps is None
    for bad in ("100", -1, True, 1.5):
        intake(_timing(2, 100, {"w": 0, "n": 5, "total": bad}), 1.0)
        assert tracker.total_steps is None, bad
    intake(_timing(2, 100, {"w": 0, "n": 5, "left": 95, "total": 100}), 1.0)
    assert tracker.total_steps == 100
