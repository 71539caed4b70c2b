"""Acting on a persistent straggler by cost, live: one node of 2 ranks and a warm spare under ``resilient run``.

Rank 1 is slowed by a ``slow`` fault (30 ms more per step from step 10); it
is flagged, the flag stands, the agent weighs it (about 30 ms a step over
the steps left against the cost of promoting a spare) and replaces it: the
rank's process is ended and the spare takes rank 1 in process, at the same
step.  The sleep changes no number, so the run is bitwise equal to an
uninterrupted one: same samples and losses at every step, same parameters
and optimizer state, every step done once.
"""

from __future__ import annotations

import json
from pathlib import Path

from .agent_helpers import events, explain, incidents
from .test_agent_inproc import by_step, elastic_run, trace

STEPS = 300
ARGS = ("--step-sleep", "0.03", "--every", "50")


def test_a_persistent_straggler_is_replaced_by_the_spare_when_that_pays(tmp_path: Path) -> None:
    ref, proc = elastic_run(tmp_path, "ref", "--nproc-per-node", "2", extra=ARGS, steps=STEPS)
    assert proc.returncode == 0, explain(proc)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"version": 1, "seed": 0, "faults": [
        {"kind": "slow", "rank": 1, "step": 10, "section": "step", "duration_s": 0.03}]}))
    out, proc = elastic_run(tmp_path, "evict", "--nproc-per-node", "2", "--spares", "1", "--fault-plan", str(plan),
                            extra=ARGS, steps=STEPS)
    assert proc.returncode == 0, explain(proc)
    run = out / "run"
    assert not events(run, "restart"), "replaced by a restart, not in process"
    [flagged] = events(run, "straggler_flagged")
    assert (flagged["rank"], flagged["section"]) == (1, "compute")
    [decided] = events(run, "straggler_decided")
    assert decided["action"] == "swap" and decided["rank"] == 1 and decided["ladder"] == "promote_spare", decided
    # The arithmetic: about 30 ms a step over the steps the script said were left, against the spare's cost.
    assert 0.02 < decided["lost_s"] < 0.05 and decided["saved_s"] >= 2 * decided["cost_s"] > 0, decided
    assert 0 < decided["remaining_steps"] < STEPS - 40, decided
    assert "rank 1 (compute" in decided["reason"] and "is replaced by a spare" in decided["reason"]
    [ladder] = events(run, "recovery_decided")
    assert ladder["action"] == "promote_spare", ladder
    [incident] = [i for i in incidents(run) if i["id"].endswith("-evict-r1")]
    assert incident["kind"] == "straggler" and incident["summary"] == decided["reason"]
    assert incident["decision"]["action"] == "promote_spare" and incident["recovered"]["rung"] == "promote_spare"
    at = incident["recovered"]["resumed_after_step"]  # updates completed: the spare does the update of index `at`
    lines = trace(out)
    assert {line["worker"] for line in lines if line["rank"] == 1 and line["step"] >= at} == {"s2"}
    assert {line["worker"] for line in lines if line["rank"] == 1 and line["step"] < at} == {"w1"}
    assert "was ended by the agent as a persistent straggler" in ladder["reason"]
    # Bitwise the uninterrupted run, every step once per rank.
    got, want = by_step(lines), by_step(trace(ref))
    assert sorted(got) == list(range(STEPS)) == sorted(want)
    for step in range(STEPS):
        assert len(got[step]) == 2, (step, got[step])
        assert {x["rank"]: (x["indices"], x["losses"]) for x in got[step]} == \
            {x["rank"]: (x["indices"], x["losses"]) for x in want[step]}, step
    final, reference = json.loads((out / "final.json").read_text()), json.loads((ref / "final.json").read_text())
    assert final["params"] == reference["params"] and final["optimizer"] == reference["optimizer"]
