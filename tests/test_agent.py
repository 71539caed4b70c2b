"""``resilient run`` on one machine: real agent, real workers (gloo DDP), real faults from chaos plans.

The fault-free reference run goes through the agent as well, so every
comparison is between two runs of the same command.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from resilient.core.exitcodes import EXIT_PREEMPTED_AGENT, EXIT_STOPPED, EXIT_UNHEALTHY

from .agent_helpers import events, explain, incidents, node_status, run_agent, start_agent, wait_for
from .helpers import assert_same_run, read_trace

STEPS = 30
NODE = "n0"


def worker_args(trace: Path, ckpt: Path, *extra: str) -> tuple[str, ...]:
    return ("--steps", str(STEPS), "--every", "5", "--keep", "3", "--dir", str(ckpt), "--trace", str(trace), *extra)


def write_plan(path: Path, *faults: dict) -> Path:
    path.write_text(json.dumps({"version": 1, "seed": 0, "faults": list(faults)}))
    return path


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same training, supervised by the agent, with no fault."""
    d = tmp_path_factory.mktemp("reference")
    proc = run_agent(d / "run", "--nproc-per-node", "2", "--node-id", NODE,
                     script_args=worker_args(d / "trace", d / "ckpt"))
    assert proc.returncode == 0, explain(proc)
    return read_trace(d / "trace", 0), read_trace(d / "trace", 1)


def test_crashed_rank_restarts_from_newest_checkpoint_and_matches_reference(tmp_path, reference):
    plan = write_plan(tmp_path / "plan.json", {"kind": "kill", "rank": 1, "step": 13, "attempt": 0, "section": "step"})
    run_dir = tmp_path / "run"
    # Synchronous saves: step_10 is committed before step 10 runs, so the restore point does not depend on
    # how fast a background save finishes on a loaded machine before the kill at step 13.
    # With the workers' output on the console, as a user sees it.  The durable tier's restart: without the
    # node's memory tier, which would serve a newer step from memory (tests/test_memory_tier_live.py).
    proc = run_agent(run_dir, "--nproc-per-node", "2", "--node-id", NODE, "--fault-plan", str(plan),
                     "--no-memory-tier",
                     script_args=worker_args(tmp_path / "trace", tmp_path / "ckpt", "--sync"), console=True)
    assert proc.returncode == 0, explain(proc)

    [incident] = incidents(run_dir)
    assert (incident["rank"], incident["kind"], incident["signal"]) == (1, "signal", signal.SIGKILL)
    assert (incident["section"], incident["step"]) == ("step", 13)
    assert "killed by SIGKILL" in incident["summary"]
    assert incident["decision"]["action"] == "restart"
    # Rank 0 is a casualty: either it raised gloo's error about its dead peer (its error file says so) and is a
    # consequence, or the agent stopped it before it raised anything.  Never both, never the cause.
    [other] = incident["other_failures"]
    survivor_error = run_dir / "nodes" / NODE / "g1" / "rank0.error.json"
    if survivor_error.exists():
        error = json.loads(survivor_error.read_text())
        assert other.startswith("rank 0 on n0") and f"consequence: {error['exc_type']}: " in other, other
        assert "stopped by the agent" not in other
        assert "Traceback" in (run_dir / "nodes" / NODE / "g1" / "rank0.log").read_text(), "the log keeps it"
    else:
        assert other.startswith("rank 0 on n0") and "stopped by the agent" in other, other
    assert other.endswith("(after rank 1 was killed by SIGKILL)"), other

    # What the restart restored is appended to the incident: the same checkpoint on both ranks, and its time.
    restored = incident["restored"]
    assert (restored["generation"], restored["checkpoint"], restored["step"]) == (2, "step_0000000010", 10)
    per_rank = {int(r): v for r, v in restored["ranks"].items()}
    assert {r: (v["checkpoint"], v["step"]) for r, v in per_rank.items()} == {0: ("step_0000000010", 10),
                                                                             1: ("step_0000000010", 10)}
    assert all(v["seconds"] > 0 for v in per_rank.values()), per_rank
    slowest = max(per_rank, key=lambda r: per_rank[r]["seconds"])
    assert restored["slowest_rank"] == slowest and restored["seconds"] == round(per_rank[slowest]["seconds"], 3)
    [event] = [e for e in events(run_dir, "restored") if e["generation"] == 2]
    assert event["incident"] == incident["id"] and event["checkpoint"] == "step_0000000010"

    # The console leads with the incident: no worker traceback before it, the survivor as one line under it,
    # then what the restart restored.
    console = proc.stdout.splitlines()
    at = next(i for i, line in enumerate(console) if line.startswith(f"resilient: incident {incident['id']}: "))
    assert not [line for line in console if "Traceback" in line], proc.stdout
    assert console[at + 1] == f"resilient:   {other}", proc.stdout
    restore_line = (f"resilient: generation 2: all 2 ranks restored step_0000000010 (step 10) in "
                    f"{restored['seconds']:.2f} s (slowest rank {slowest})")
    assert restore_line in console[at:], proc.stdout

    for rank, ref in enumerate(reference):
        got = read_trace(tmp_path / "trace", rank)
        assert [s["restored_from"] for s in got.starts] == [None, "step_0000000010"]
        assert_same_run(ref, got)

    status = subprocess.run([sys.executable, "-m", "resilient", "status", "--run-dir", str(run_dir)],
                            capture_output=True, text=True, timeout=60, check=True).stdout
    assert "restarts used: 1 of 3" in status
    assert f"newest committed checkpoint: step_{STEPS:010d} (step {STEPS})" in status
    assert "rank 1 on n0: killed by SIGKILL in section 'step' at step 13" in status
    assert "restore: generation 2: all 2 ranks restored step_0000000010 (step 10) in " in status
    assert "verdict from node n0: succeeded" in status


def test_hangs_are_detected_with_stacks_and_the_run_recovers_exactly(tmp_path, reference):
    """A sleep in the data section, a deadlock in a step, and a SIGSTOP: each caught, each recovered."""
    plan = write_plan(
        tmp_path / "plan.json",
        {"kind": "hang", "rank": 1, "step": 8, "attempt": 0, "section": "data"},
        {"kind": "deadlock", "rank": 0, "step": 14, "attempt": 1, "section": "step"},
        {"kind": "sigstop", "rank": 1, "step": 22, "attempt": 2, "section": "step"},
    )
    run_dir = tmp_path / "run"
    proc = run_agent(run_dir, "--nproc-per-node", "2", "--node-id", NODE, "--fault-plan", str(plan),
                     "--max-restarts", "5", "--timeout-floor", "3", "--section-timeout", "step=4",
                     script_args=worker_args(tmp_path / "trace", tmp_path / "ckpt"))
    assert proc.returncode == 0, explain(proc)

    sleep, deadlock, stopped = incidents(run_dir)
    assert [i["kind"] for i in (sleep, deadlock, stopped)] == ["hang"] * 3
    assert [(i["rank"], i["section"], i["step"]) for i in (sleep, deadlock, stopped)] == [
        (1, "data", 8), (0, "step", 14), (1, "step", 22)]
    # Detected against the right timeout, calibrated (floor 3 s) for data, explicit for step, and never before it;
    # that the first check after the timeout decides is the policy's unit test (test_sections_policy.py).
    assert sleep["hang"]["source"] == "calibrated" and sleep["hang"]["timeout_s"] == 3.0
    assert deadlock["hang"]["source"] == stopped["hang"]["source"] == "explicit"
    assert deadlock["hang"]["timeout_s"] == stopped["hang"]["timeout_s"] == 4.0
    for i in (sleep, deadlock, stopped):
        assert i["hang"]["overrun_s"] > 0, i["hang"]

    # The stacks of the hung rank say where it hangs.
    assert "_hang" in sleep["stacks"]["1"]["text"] and sleep["stacks"]["1"]["method"] == "faulthandler"
    assert "rank 1 is not in a collective" in sleep["hang"]["attribution"]
    assert "_deadlock" in deadlock["stacks"]["0"]["text"]
    culprit = stopped["stacks"]["1"]
    assert culprit["state"] == "stopped" and culprit["method"] == "py-spy", culprit
    assert "inject.py" in culprit["text"] and "MainThread" in culprit["text"]
    assert "process is stopped" in stopped["hang"]["attribution"]

    detected = events(run_dir, "hang_detected")
    assert [e["rank"] for e in detected] == [1, 1, 1] or len(detected) == 3
    for rank, ref in enumerate(reference):
        assert_same_run(ref, read_trace(tmp_path / "trace", rank))


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "script.py"
    path.write_text(body)
    return path


def test_crash_loop_stops_with_a_verdict(tmp_path):
    script = _script(tmp_path, "import sys\nprint('failing before any checkpoint', flush=True)\nsys.exit(3)\n")
    run_dir = tmp_path / "run"
    proc = run_agent(run_dir, "--node-id", NODE, "--max-restarts", "10", "--crash-loop-restarts", "2",
                     script=script, timeout=120)
    assert proc.returncode == EXIT_STOPPED, explain(proc)
    [finished] = events(run_dir, "agent_finished")
    assert finished["verdict"] == "crash_loop"
    assert len(events(run_dir, "restart")) == 2
    found = incidents(run_dir)
    assert len(found) == 3 and all(i["exit_code"] == 3 for i in found)
    assert found[-1]["decision"]["verdict"] == "crash_loop"
    # The script reports no step (it has no Run): the same rank ending the same way, not "at step 0".
    assert "each failing the same way (rank 0 by exit 3)" in found[-1]["decision"]["reason"], found[-1]
    assert found[-1]["step"] is None and "no step was reported" in found[-1]["summary"]
    assert "crash_loop" in proc.stderr


def test_independent_faults_without_a_commit_between_are_restarted_while_the_budget_lasts(tmp_path):
    """Two faults on other ranks at other steps, no checkpoint at all: with --crash-loop-restarts 1 the second is
    not taken for a loop (it is not the first failure again), so the run restarts and finishes."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"version": 1, "seed": 0, "faults": [
        {"kind": "kill", "rank": 1, "step": 2, "attempt": 0, "section": "step"},
        {"kind": "kill", "rank": 0, "step": 4, "attempt": 1, "section": "step"}]}))
    run_dir = tmp_path / "run"
    proc = run_agent(run_dir, "--nproc-per-node", "2", "--node-id", NODE, "--max-restarts", "3",
                     "--crash-loop-restarts", "1", "--fault-plan", str(plan),
                     script_args=("--steps", "6", "--trace", str(tmp_path / "trace")))
    assert proc.returncode == 0, explain(proc)
    restarts = events(run_dir, "restart")
    assert len(restarts) == 2, restarts
    assert "not a crash loop: 1 restarts without a new commit, but not the same failure again" in \
        restarts[1]["reason"], restarts[1]
    # Each killed rank is placed where its last heartbeat said: at the planned step, or before it by the heartbeats
    # it had not sent yet (less than one batch interval of them; see test_heartbeat.py), so not exactly.
    got = [(i["rank"], i["step"]) for i in incidents(run_dir)]
    assert [rank for rank, _ in got] == [1, 0] and got[0][1] <= 2 and got[1][1] <= 4, got


def test_restart_budget_is_counted_and_enforced(tmp_path):
    script = _script(tmp_path, "import sys\nsys.exit(5)\n")
    run_dir = tmp_path / "run"
    proc = run_agent(run_dir, "--node-id", NODE, "--max-restarts", "1", "--crash-loop-restarts", "9",
                     script=script, timeout=120)
    assert proc.returncode == EXIT_STOPPED, explain(proc)
    [finished] = events(run_dir, "agent_finished")
    assert (finished["verdict"], finished["restarts_used"]) == ("budget_exhausted", 1)


def test_do_not_restart_exit_code_stops_at_once(tmp_path):
    script = _script(tmp_path, "import sys\nsys.exit(78)\n")
    run_dir = tmp_path / "run"
    proc = run_agent(run_dir, "--node-id", NODE, script=script, timeout=120)
    assert proc.returncode == 78, explain(proc)
    [finished] = events(run_dir, "agent_finished")
    assert (finished["verdict"], finished["restarts_used"]) == ("do_not_restart", 0)
    assert not events(run_dir, "restart")


def test_sigterm_commits_at_a_step_boundary_and_the_resumed_run_matches(tmp_path, reference):
    run_dir = tmp_path / "run"
    args = worker_args(tmp_path / "trace", tmp_path / "ckpt")
    slow = (*args, "--step-sleep", "0.1")
    agent = start_agent(run_dir, "--nproc-per-node", "2", "--node-id", NODE, "--run-id", "pre",
                        script_args=slow, log=tmp_path / "agent.log")
    try:
        wait_for(lambda: (s := node_status(run_dir, NODE)) and any(r["step"] >= 7 for r in s["ranks"].values()),
                 timeout=120, what="the workers to pass step 7")
        assert_status_is_live(run_dir, tmp_path / "trace")
        agent.send_signal(signal.SIGTERM)
        code = agent.wait(timeout=90)
    finally:
        agent.kill()
    log = (tmp_path / "agent.log").read_text()
    assert code == EXIT_PREEMPTED_AGENT, log
    [request] = events(run_dir, "stop_requested")
    stop_at = request["stop_at_step"]
    assert 7 < stop_at < STEPS
    assert (tmp_path / "ckpt" / f"step_{stop_at:010d}").is_dir(), "the stop step was committed"
    assert not incidents(run_dir)

    proc = run_agent(tmp_path / "run2", "--nproc-per-node", "2", "--node-id", NODE, script_args=args)
    assert proc.returncode == 0, explain(proc)
    for rank, ref in enumerate(reference):
        got = read_trace(tmp_path / "trace", rank)
        assert [s["restored_from"] for s in got.starts] == [None, f"step_{stop_at:010d}"]
        assert_same_run(ref, got)


def last_traced_step(trace: Path, rank: int) -> int:
    """The newest step rank ``rank`` finished, from its own trace (a line being written is skipped)."""
    steps = [-1]
    for line in Path(f"{trace}.rank{rank}").read_text().splitlines():
        try:
            steps.append(json.loads(line).get("step", -1))
        except json.JSONDecodeError:
            pass
    return max(steps)


def assert_status_is_live(run_dir: Path, trace: Path) -> None:
    """`resilient status` shows each rank's step as the worker is at it: at most one heartbeat batch behind.

    A worker finishing step k has sent the heartbeat of step k at its start (0.1 s earlier), and reports
    step k+1 as it begins it; so between two reads of its trace, k_before and k_after, status must show a
    step in [k_before, k_after + 1].  status.json alone (written once a second) is ~10 steps behind here.
    """
    from resilient.cli.status_cmd import collect_from_run_dir, render

    for _ in range(5):
        before = {r: last_traced_step(trace, r) for r in (0, 1)}
        status = collect_from_run_dir(run_dir)
        after = {r: last_traced_step(trace, r) for r in (0, 1)}
        [node] = status["nodes"]
        assert node["read"] == "live", node
        for r in (0, 1):
            shown = node["ranks"][str(r)]["step"]
            assert before[r] <= shown <= after[r] + 1, (r, before[r], shown, after[r])
        time.sleep(0.13)
    assert "read live from its agent" in render(status, 5)


def test_unhealthy_node_steps_out_and_says_why(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_agent(run_dir, "--node-id", NODE, "--health-path", str(tmp_path), "--min-free-disk-gb", "1000000",
                     script=_script(tmp_path, "raise SystemExit('must not start')\n"), timeout=120)
    assert proc.returncode == EXIT_UNHEALTHY, explain(proc)
    [unhealthy] = events(run_dir, "node_unhealthy")
    assert "free disk" in unhealthy["reason"] and str(tmp_path) in unhealthy["reason"]
    assert not events(run_dir, "workers_started")
