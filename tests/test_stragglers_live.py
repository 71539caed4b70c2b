"""Stragglers and slowdowns on live runs: 3 ranks of gloo DDP under ``resilient run``, faults from a plan.

The worker (``tests/pace_worker.py``) times its steps with the Run's own
timer and the agent scores the windows as they come; faults are ``slow``
entries of a fault plan (a sleep in a rank's step, or in every rank's data
wait).  What users see is asserted: the events, the incidents, ``resilient
status``, and a threshold changed on the running job.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from .agent_helpers import agent_env, events, explain, incidents, node_status, run_agent, start_agent, wait_for

pytestmark = pytest.mark.serial  # timing detection: run alone, not beside another test's load

WORKER = Path(__file__).parent / "pace_worker.py"
RUN_ID = "slow"
NODE = ("--node-id", "n0", "--run-id", RUN_ID)
DEVICE = ("--device-ms", "60")
"""Steps of about 80 ms, 60 of them waiting as for a device.  3 ranks and the agent share 2 cores here, and a
rank the scheduler keeps waiting is slower than its peers for real: with 30 ms steps one rank of a healthy run
was 2.7 ms (8% of a step) slower for 25 steps, and with 60 ms steps one rank's optimizer 3 ms (5.5%) slower for
15, each enough to be flagged.  At 80 ms such a delay is under the 5% of a step that a flag needs."""
SLOW_S = 0.015
"""Added by the slow faults: about 20% of a step of this worker on this machine."""


def plan(path: Path, *faults: dict) -> Path:
    path.write_text(json.dumps({"version": 1, "seed": 0, "faults": list(faults)}))
    return path


def scrape(url: str) -> dict[str, float]:
    """Sample name with its labels -> value."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "resilient", *args], capture_output=True, text=True, timeout=60,
                          env=agent_env(), check=False)


def kinds(run_dir: Path, *wanted: str) -> list[dict]:
    return [e for e in events(run_dir) if e["kind"] in wanted]


def test_a_drifting_replica_is_caught_by_the_audit_while_the_detectors_score_every_rank(tmp_path):
    """500 steps with no slow fault.  Rank 2's copy of one weight is changed at step 150 (timing does not move):
    the audit at step 200 names rank 2 and that tensor."""
    run = tmp_path / "run"
    proc = run_agent(run, "--nproc-per-node", "3", *NODE, script=WORKER,
                     script_args=("--steps", "500", "--out", str(tmp_path / "out"), "--perturb", "2,150", *DEVICE),
                     timeout=240)
    assert proc.returncode == 0, explain(proc)
    audits = kinds(run, "replica_mismatch")
    # Found at every audit from step 200 on (the weight stays apart: every rank applies the same update).
    assert [e["step"] for e in audits] == [200, 300, 400], audits
    assert audits[0]["ranks"] == [2] and audits[0]["tensors"] == [{"tensor": "0.weight", "ranks": [2]}]
    assert audits[0]["tensors_differing"] == 1 and audits[0]["of_tensors"] == 6
    mismatch = [i for i in incidents(run) if i["kind"] == "replica_mismatch"]
    assert len(mismatch) == 3 and mismatch[0]["rank"] == 2 and "0.weight (rank 2)" in mismatch[0]["summary"]
    slowness = node_status(run, "n0")["slowness"]
    # The detectors did score: a baseline was set (every step waits 60 ms as for its device) and every rank has
    # scores in compute and the optimizer (data wait is under half a millisecond here: too short to compare, so
    # not scored).
    assert slowness["baseline_s"] is not None and slowness["baseline_s"] >= 0.060, slowness
    scored = {(s["rank"], s["section"]) for s in slowness["scores"]}
    assert {(r, s) for r in range(3) for s in ("compute", "optimizer")} <= scored, scored


def test_a_slowed_rank_is_flagged_after_the_detector_is_turned_on_at_run_time(tmp_path):
    """Started with straggler detection off; turned on mid-run; the slow rank is then named, with its numbers."""
    run = tmp_path / "run"
    faults = plan(tmp_path / "plan.json", {"kind": "slow", "rank": 1, "step": 300, "section": "step",
                                           "duration_s": SLOW_S})
    proc = start_agent(run, "--nproc-per-node", "3", *NODE, "--fault-plan", str(faults), "--metrics-port", "0",
                       "--detector", "straggler.enabled=false", script=WORKER,
                       script_args=("--steps", "700", "--out", str(tmp_path / "out"), *DEVICE),
                       log=tmp_path / "agent.log")
    try:
        wait_for(lambda: (s := node_status(run, "n0")) and s.get("ranks")
                 and min(r["step"] for r in s["ranks"].values()) >= 350, 120, "step 350 on every rank")
        assert kinds(run, "straggler_flagged") == []  # off: the slow rank went unflagged so far
        answer = cli("detectors", "--run-dir", str(run), "straggler.enabled=true", "straggler.rule.consecutive=4")
        assert answer.returncode == 0, answer.stderr
        assert "* straggler.enabled = true" in answer.stdout and "* straggler.rule.consecutive = 4" in answer.stdout
        refused = cli("detectors", "--run-dir", str(run), "straggler.rule.consecutive=0")
        assert refused.returncode == 1 and "must be an int >= 1" in refused.stderr
        wait_for(lambda: kinds(run, "straggler_flagged") and kinds(run, "slowdown_began"), 120, "the flag")
        [listening] = kinds(run, "metrics_listening")
        samples = scrape(listening["url"])  # the gauges while the run is slow
        assert proc.wait(timeout=180) == 0, (tmp_path / "agent.log").read_text()[-3000:]
    finally:
        proc.kill()
    changed = kinds(run, "detectors_changed")
    assert len(changed) == 1 and changed[0]["changes"] == {"straggler.enabled": True, "straggler.rule.consecutive": 4}
    assert changed[0]["source"] == "control socket" and changed[0]["settings"]["straggler.rule.consecutive"] == 4
    ordered = kinds(run, "detectors_changed", "straggler_flagged")
    flagged = [e for e in ordered if e["kind"] == "straggler_flagged"]
    assert ordered[0]["kind"] == "detectors_changed" and flagged, ordered
    assert {(e["rank"], e["section"]) for e in flagged} == {(1, "compute")}
    assert flagged[0]["ratio"] > 1.15 and "rank 1 (node n0) is a straggler in compute" in flagged[0]["reason"]
    [incident] = [i for i in incidents(run) if i["kind"] == "straggler"]
    assert incident["rank"] == 1 and incident["section"] == "compute" and incident["performance"]["ratio"] > 1.15
    # The job slowed down too, and the slowdown names the straggler, not the network.
    began = kinds(run, "slowdown_began")
    assert began and began[0]["attribution"]["rank"] == 1 and began[0]["attribution"]["section"] == "compute"
    status = cli("status", "--run-dir", str(run))
    assert "straggler: rank 1 in compute: rank 1 (node n0) is a straggler in compute" in status.stdout, status.stdout
    flagged = {k: v for k, v in samples.items() if k.startswith("resilient_straggler_flagged{")}
    assert [k for k, v in flagged.items() if v == 1] == [k for k in flagged if 'rank="1"' in k and
                                                          'section="compute"' in k], flagged
    score = [v for k, v in samples.items() if k.startswith("resilient_straggler_score{") and 'rank="1"' in k
             and 'section="compute"' in k]
    assert score and score[0] > 1.15
    assert samples['resilient_slowdown_active{node="n0",run_id="' + RUN_ID + '"}'] == 1
    ratio = [v for k, v in samples.items() if k.startswith("resilient_slowdown_ratio{")]
    baseline = [v for k, v in samples.items() if k.startswith("resilient_baseline_step_seconds{")]
    assert ratio and ratio[0] > 1.1 and baseline and baseline[0] >= 0.060, (ratio, baseline)
    # The baseline stands still while the job is slow: the gauge is the one the slowdown in progress began against.
    assert baseline[0] in {e["baseline_s"] for e in began}, (baseline, began)
    # Timing changed nothing: every rank ends with the same parameters.
    digests = {json.loads((tmp_path / f"out.{r}").read_text())["params"] for r in range(3)}
    assert len(digests) == 1


def test_slow_data_loading_is_a_data_wait_slowdown_not_a_straggler(tmp_path):
    run = tmp_path / "run"
    faults = plan(tmp_path / "plan.json", {"kind": "slow", "rank": None, "step": 300, "section": "data",
                                           "duration_s": SLOW_S, "steps": 250})
    proc = run_agent(run, "--nproc-per-node", "3", *NODE, "--fault-plan", str(faults), script=WORKER,
                     script_args=("--steps", "700", "--out", str(tmp_path / "out"), *DEVICE), timeout=300)
    assert proc.returncode == 0, explain(proc)
    assert kinds(run, "straggler_flagged") == []
    [began] = kinds(run, "slowdown_began")
    assert began["attribution"]["section"] == "data" and began["attribution"]["rank"] is None
    assert "input pipeline" in began["reason"] and began["ratio"] > 1.15
    assert began["host"]["now"]["cpu"] and began["host"]["baseline"]["cpu"]  # the host's telemetry beside it
    [ended] = kinds(run, "slowdown_ended")
    assert ended["excess_s"] > 0 and ended["baseline_s"] == began["baseline_s"], (began, ended)
    # The ledger counted the slowdown's time as data wait (the input pipeline's), not as slow steps, from its start
    # to its end (how that relates to the detector's excess: test_ledger.py's
    # test_a_slower_input_pipeline_costs_data_wait_not_slow_steps).
    assert ended["ledger_category"] == "data_wait" and ended["ledger_cost_s"] == ended["ledger_s"]["data_wait"] > 0
    [incident] = [i for i in incidents(run) if i["kind"] == "slowdown"]
    assert incident["performance"]["attribution"]["section"] == "data"
    assert incident["performance"]["ended"]["excess_s"] == ended["excess_s"]


def test_a_straggler_is_flagged_in_a_script_that_wraps_ddp_itself_and_registers_its_own_hook(tmp_path):
    """The script as most are written: it makes the process group and the DDP wrapper itself, passes the wrapper
    to resilient.Run(), then registers a communication hook of its own.  Rank 1 is 15 ms slower from step 150.
    The ranks that wait for it wait inside the backward; the Run's hook on the script's wrapper tells that wait
    from compute, so rank 1 alone is flagged, in compute.  The script's hook runs (inside the Run's) and every
    rank ends with the same parameters."""
    run = tmp_path / "run"
    faults = plan(tmp_path / "plan.json", {"kind": "slow", "rank": 1, "step": 150, "section": "step",
                                           "duration_s": SLOW_S})
    proc = run_agent(run, "--nproc-per-node", "3", *NODE, "--fault-plan", str(faults), script=WORKER,
                     script_args=("--steps", "500", "--out", str(tmp_path / "out"), "--wrap-self", "--own-hook",
                                  *DEVICE), timeout=300)
    assert proc.returncode == 0, explain(proc)
    assert kinds(run, "comm_not_timed") == []
    flagged = kinds(run, "straggler_flagged")
    assert flagged and {(e["rank"], e["section"]) for e in flagged} == {(1, "compute")}, flagged
    outs = [json.loads((tmp_path / f"out.{r}").read_text()) for r in range(3)]
    assert len({o["params"] for o in outs}) == 1 and all(o["own_hook_calls"] > 0 for o in outs), outs


def test_a_straggler_is_flagged_in_an_fsdp2_script_whose_peers_wait_in_its_collectives(tmp_path):
    """FSDP2 (fully_shard) on 3 ranks: the ranks that wait for a slow peer wait inside the all-gathers and
    reduce-scatters, which the Run times as communication; rank 1, 15 ms slower from step 150, is flagged alone,
    in compute, and every rank ends with the same parameters."""
    run = tmp_path / "run"
    faults = plan(tmp_path / "plan.json", {"kind": "slow", "rank": 1, "step": 150, "section": "step",
                                           "duration_s": SLOW_S})
    proc = run_agent(run, "--nproc-per-node", "3", *NODE, "--fault-plan", str(faults), script=WORKER,
                     script_args=("--steps", "500", "--out", str(tmp_path / "out"), "--fsdp", *DEVICE), timeout=300)
    assert proc.returncode == 0, explain(proc)
    assert kinds(run, "comm_not_timed") == []
    flagged = kinds(run, "straggler_flagged")
    assert flagged and {(e["rank"], e["section"]) for e in flagged} == {(1, "compute")}, flagged
    outs = [json.loads((tmp_path / f"out.{r}").read_text()) for r in range(3)]
    assert len({o["params"] for o in outs}) == 1, outs
