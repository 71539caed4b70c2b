"""The game day: a seeded random schedule of rank kills at a mean time between failures, against Young/Daly.

``[gameday]`` in a drill draws kills of random ranks at exponentially
distributed times (mean ``mtbf_s``) from ``start_after_s`` to ``duration_s``
after the faulted run begins, from the drill's seed: the same file gives the
same schedule.  The runner kills each rank's process from outside
(:mod:`resilient.chaos.host`), and the run restarts from its newest commit
each time.

The score compares the goodput the ledger measured with what the
Young/Daly model predicts from quantities measured separately:

- ``C``, the checkpoint cost: the uninterrupted reference run's checkpoint
  stall over its commits;
- ``tau``, the checkpoint interval: ``checkpoint_every`` steps of the
  reference's ideal step time;
- ``R``, the restart cost: detection plus recovery, per incident, from the
  faulted run's ledger;
- the work lost to a failure, which the model takes as ``tau / 2`` on
  average (the ledger's measured replay is reported beside it).

Predicted goodput: the reference's productive seconds over its wall time
plus, per fault that struck, ``R + tau / 2``.  The report also gives Young's
optimal interval for the configured MTBF, ``sqrt(2 C M)``, against the
drill's.  Pure.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

from .host_faults import HostFault


@dataclass(frozen=True, kw_only=True)
class GameDay:
    duration_s: float
    """Faults are drawn up to this many seconds after the faulted run began."""
    mtbf_s: float
    """Mean time between failures (exponential inter-arrival times)."""
    start_after_s: float = 5.0
    """No fault before this (the workers start, restore and warm up)."""
    max_error: float | None = None
    """Expectation: measured goodput within this relative error of the prediction (0.15: 15%)."""

    def schedule(self, seed: int, world: int) -> tuple[HostFault, ...]:
        """The kills, in time order: the same seed and world always give the same schedule."""
        rng = random.Random(f"gameday:{seed}")
        faults: list[HostFault] = []
        t = self.start_after_s
        while True:
            t += rng.expovariate(1.0 / self.mtbf_s)
            if t >= self.duration_s:
                return tuple(faults)
            faults.append(HostFault(kind="kill", rank=rng.randrange(world), at_s=round(t, 3)))


def predict(*, reference: Any, faulted: Any, checkpoint_every: int, injected: int, mtbf_s: float) -> dict[str, Any]:
    """The Young/Daly comparison from the reference's and the faulted run's ledger accounts
    (:class:`resilient.metrics.ledger_state.Account`)."""
    step_s = reference.ideal_step_s or faulted.ideal_step_s
    commits = max(1, (reference.committed_step or 0) // checkpoint_every)
    c = reference.seconds.get("checkpoint_stall", 0.0) / commits
    tau = None if step_s is None else checkpoint_every * step_s
    costs = [i for i in faulted.incidents if not i.open]
    r = sum(i.detection_s + i.recovery_s for i in costs) / len(costs) if costs else None
    replay = sum(i.replay_s for i in costs) / len(costs) if costs else None
    predicted = None
    if tau is not None and r is not None:
        productive = reference.seconds.get("productive", 0.0)
        predicted = productive / (reference.wall_s + injected * (r + tau / 2))
    measured = faulted.goodput_ratio
    error = None if predicted is None or predicted <= 0 else measured / predicted - 1.0
    young = math.sqrt(2 * c * mtbf_s) if c > 0 else None
    return {"faults": injected, "incidents": len(costs), "step_s": step_s, "checkpoint_cost_s": round(c, 4),
            "interval_s": None if tau is None else round(tau, 3), "restart_cost_s": None if r is None else round(r, 3),
            "replay_s": None if replay is None else round(replay, 3),
            "model_replay_s": None if tau is None else round(tau / 2, 3),
            "reference_goodput": round(reference.goodput_ratio, 4), "measured_goodput": round(measured, 4),
            "predicted_goodput": None if predicted is None else round(predicted, 4),
            "relative_error": None if error is None else round(error, 4), "mtbf_s": mtbf_s,
            "young_interval_s": None if young is None else round(young, 3),
            "young_interval_steps": None if young is None or not step_s else round(young / step_s)}
