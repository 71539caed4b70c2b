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

import pytest

from .agent_helpers import events, explain, incidents, start_agent
from .test_agent_inproc import WORKER, by_step, elastic_run, trace

pytestmark = pytest.mark.serial  # timing detection: run alone, not beside another test's load

STEPS = 300
ARGS = ("--step-sleep", "0.03", "--every", "50")


def assert_the_arithmetic(decided: dict, performance: dict) -> None:
    """The decision's numbers are the incident's window: the straggler's seconds per step over its peers' (at most
    the job's step), over the steps left; the event rounds them, the incident keeps them whole."""
    lost = min(performance["rank_s"] - performance["peers_s"], performance["job_step_s"])
    assert decided["lost_s"] == round(lost, 6), (decided, performance)
    assert decided["remaining_steps"] == performance["remaining_steps"], (decided, performance)
    assert performance["saved_s"] == lost * decided["remaining_steps"], (decided, performance)
    assert (decided["saved_s"], decided["cost_s"]) == (round(performance["saved_s"], 3),
                                                      round(performance["cost_s"], 3)), (decided, performance)
    assert performance["decision"] == decided["action"], (decided, performance)


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
    assert decided["lost_s"] > 0 and decided["saved_s"] >= 2 * decided["cost_s"] > 0, decided
    assert 0 < decided["remaining_steps"] < STEPS - 40, decided
    assert "rank 1 (compute" in decided["reason"] and "is replaced by a spare" in decided["reason"]
    [ladder] = events(run, "recovery_decided")
    assert ladder["action"] == "promote_spare", ladder
    [incident] = [i for i in incidents(run) if i["id"].endswith("-evict-r1")]
    assert incident["kind"] == "straggler" and incident["summary"] == decided["reason"]
    assert_the_arithmetic(decided, incident["performance"])
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


def test_across_machines_a_persistent_straggler_is_replaced_by_the_spare_nodes_worker(tmp_path: Path, etcd_server,
                                                                                      etcd_run_id: str) -> None:
    """Two nodes with one rank each and a spare node, meeting through etcd: rank 1's agent flags it against
    the other node's rank, asks the ladder over every node (it would promote the pool's spare), weighs the
    cost and ends the rank; the spare node's worker takes rank 1 in process, bitwise the uninterrupted run."""
    from .test_agent_cluster import _finish, _logs, _node, _script

    ref, proc = elastic_run(tmp_path, "ref", "--nproc-per-node", "2", extra=ARGS, steps=STEPS)
    assert proc.returncode == 0, explain(proc)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"version": 1, "seed": 0, "faults": [
        {"kind": "slow", "rank": 1, "step": 10, "section": "step", "duration_s": 0.03}]}))
    out = tmp_path / "run"
    out.mkdir()
    agents = {n: start_agent(out / "run", *_node(etcd_server.url, etcd_run_id, n, "2", "--fault-plan", str(plan),
                                                 *role),
                             script=WORKER, script_args=_script(out, STEPS, *ARGS, "--spares-ready", "1"),
                             log=tmp_path / f"{n}.log")
              for n, role in (("n0", ()), ("n1", ()), ("spare0", ("--role", "spare")))}
    codes = _finish(agents, 300)
    assert codes == {"n0": 0, "n1": 0, "spare0": 0}, _logs(tmp_path)
    run = out / "run"
    assert not events(run, "restart"), "replaced by a restart, not in process"
    [slow_node] = [e["node"] for e in events(run, "workers_started") if "1" in e["pids"]]
    [flagged] = events(run, "straggler_flagged")
    assert (flagged["node"], flagged["rank"], flagged["section"]) == (slow_node, 1, "compute"), flagged
    [decided] = events(run, "straggler_decided")
    assert decided["node"] == slow_node and decided["action"] == "swap" and decided["ladder"] == "promote_spare"
    assert decided["lost_s"] > 0 and decided["saved_s"] >= 2 * decided["cost_s"] > 0, decided
    # Across machines the incident is the generation's (the claim's winner writes it): the event's own numbers
    # agree, to the event's rounding (lost_s to 1e-6 s, saved_s to 1e-3 s).
    remaining = decided["remaining_steps"]
    assert abs(decided["saved_s"] - decided["lost_s"] * remaining) <= 5e-4 + 5e-7 * remaining + 1e-9, decided
    assert f"over {remaining} steps against" in decided["reason"], decided
    [ladder] = events(run, "recovery_decided")
    assert ladder["action"] == "promote_spare", ladder
    assert ladder["promotions"] == [{"rank": 1, "spare": "spare0.s0", "node": "spare0"}], ladder
    assert "was ended by the agent as a persistent straggler" in ladder["reason"], ladder
    done = {e["node"]: e for e in events(run, "recovered_in_process")}
    at = done["spare0"]["resumed_after_step"]
    lines = trace(out)
    assert {line["worker"] for line in lines if line["rank"] == 1 and line["step"] >= at} == {"spare0.s0"}
    got, want = by_step(lines), by_step(trace(ref))
    assert sorted(got) == list(range(STEPS)) == sorted(want)
    for step in range(STEPS):
        assert {x["rank"]: (x["indices"], x["losses"]) for x in got[step]} == \
            {x["rank"]: (x["indices"], x["losses"]) for x in want[step]} and len(got[step]) == 2, step
    final, reference = json.loads((out / "final.json").read_text()), json.loads((ref / "final.json").read_text())
    assert final["params"] == reference["params"] and final["optimizer"] == reference["optimizer"]
