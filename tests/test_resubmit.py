"""Resubmitting a run under its own run id (as a Slurm requeue or a Kubernetes restart does), with real etcd.

Each launch of a run id gets its own launch: stop requests, verdicts, restart
records and the rendezvous of the first launch must not end the second, and
the second continues from the newest commit, bitwise equal to a run that
never stopped.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from resilient.core.exitcodes import EXIT_PREEMPTED_AGENT, EXIT_STOPPED

from .agent_helpers import events, explain, node_status, run_agent, start_agent, wait_for
from .helpers import assert_same_run, read_trace

STEPS = 24
NODE = "n0"


def _flags(url: str, run_id: str, *extra: str) -> tuple[str, ...]:
    return ("--nnodes", "1", "--nproc-per-node", "2", "--store", url, "--run-id", run_id, "--node-id", NODE,
            "--local-addr", "127.0.0.1", "--rdzv-last-call", "0.5", *extra)


def _worker(tmp_path: Path, *extra: str) -> tuple[str, ...]:
    return ("--steps", str(STEPS), "--every", "5", "--keep", "3", "--dir", str(tmp_path / "ckpt"),
            "--trace", str(tmp_path / "trace"), *extra)


def _signal_after_step(run_dir: Path, flags: tuple[str, ...], tmp_path: Path, step: int, signum: int) -> int:
    """Start the first launch, send ``signum`` to its agent once a worker passed ``step``; its exit code."""
    agent = start_agent(run_dir, *flags, script_args=_worker(tmp_path, "--step-sleep", "0.1"),
                        log=tmp_path / "first.log")
    try:
        wait_for(lambda: (s := node_status(run_dir, NODE)) and any(r["step"] >= step for r in s["ranks"].values()),
                 timeout=120, what=f"the workers to pass step {step}")
        agent.send_signal(signum)
        return agent.wait(timeout=90)
    finally:
        agent.kill()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same training under the embedded store, with no fault."""
    d = tmp_path_factory.mktemp("reference")
    proc = run_agent(d / "run", "--nproc-per-node", "2", "--node-id", NODE, script_args=_worker(d))
    assert proc.returncode == 0, explain(proc)
    return read_trace(d / "trace", 0), read_trace(d / "trace", 1)


def test_a_preempted_run_resubmitted_with_the_same_command_resumes_and_matches(tmp_path, reference,
                                                                               etcd_server, etcd_run_id):
    run_dir = tmp_path / "run"
    flags = _flags(etcd_server.url, etcd_run_id)
    code = _signal_after_step(run_dir, flags, tmp_path, 6, signal.SIGTERM)
    assert code == EXIT_PREEMPTED_AGENT, (tmp_path / "first.log").read_text()[-3000:]
    [request] = events(run_dir, "stop_requested")
    stop_at = request["stop_at_step"]

    # The identical command again: a new launch, the run continues from the committed stop step.
    proc = run_agent(run_dir, *flags, script_args=_worker(tmp_path))
    assert proc.returncode == 0, explain(proc)
    launches = [e["launch_id"] for e in events(run_dir, "launch_joined")]
    assert len(launches) == 2 and launches[0] != launches[1], launches
    generations = [e["generation"] for e in events(run_dir, "rendezvous_joined")]
    assert generations == sorted(set(generations)), "generation numbers never repeat across launches"
    for rank, ref in enumerate(reference):
        got = read_trace(tmp_path / "trace", rank)
        assert [s["restored_from"] for s in got.starts] == [None, f"step_{stop_at:010d}"]
        assert_same_run(ref, got)


def test_a_run_stopped_by_a_crash_loop_resumes_once_the_cause_is_fixed(tmp_path, reference, etcd_server,
                                                                      etcd_run_id):
    run_dir = tmp_path / "run"
    # Every attempt dies at step 12, after the commit of step 10: no new commit, so a crash loop.
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"version": 1, "seed": 0, "faults": [
        {"kind": "exit", "rank": 1, "step": 12, "attempt": None, "section": "step", "exit_code": 3}]}))
    flags = _flags(etcd_server.url, etcd_run_id, "--crash-loop-restarts", "1")
    worker = _worker(tmp_path, "--sync")  # synchronous saves: step 10 is committed before step 12 begins
    first = run_agent(run_dir, *flags, "--fault-plan", str(plan), script_args=worker)
    assert first.returncode == EXIT_STOPPED, explain(first)
    assert "crash_loop" in first.stderr, explain(first)

    # The cause is fixed (no fault plan); the same run id continues from the newest commit.
    second = run_agent(run_dir, *flags, script_args=worker)
    assert second.returncode == 0, explain(second)
    assert "restarts used 0/3" in second.stderr, "restart records of the earlier launch do not count"
    for rank, ref in enumerate(reference):
        got = read_trace(tmp_path / "trace", rank)
        # One start per generation.  The first launch's restarts restore the newest commit (step 10) or a step
        # up to 12 from the node's memory tier (the crash is inside step 12, after its boundary was saved);
        # the second launch finds no memory tier (the stopped agent released it) and restores the commit.
        restored = [s["restored_from"] for s in got.starts]
        assert len(restored) == len(events(run_dir, "workers_started")) >= 3, restored
        first_launch = set(restored[1:-1])
        assert restored[0] is None and restored[-1] == "step_0000000010", restored
        assert first_launch <= {"step_0000000010", *(f"memory:step_{n:010d}" for n in (10, 11, 12))}, restored
        assert_same_run(ref, got)


def test_a_launch_left_without_an_end_mark_is_replaced_when_its_rendezvous_is_closed(tmp_path, etcd_server,
                                                                                    etcd_run_id):
    """SIGINT ends an agent without marking its launch ended; its rendezvous is closed all the same."""
    run_dir = tmp_path / "run"
    flags = _flags(etcd_server.url, etcd_run_id)
    code = _signal_after_step(run_dir, flags, tmp_path, 2, signal.SIGINT)
    assert code == 130, (tmp_path / "first.log").read_text()[-3000:]
    proc = run_agent(run_dir, *flags, script_args=_worker(tmp_path))
    assert proc.returncode == 0, explain(proc)
    joined = [(e["launch_id"], e["action"]) for e in events(run_dir, "launch_joined")]
    assert [a for _, a in joined] == ["create", "join", "replace"], joined
    assert joined[0][0] == joined[1][0] != joined[2][0]
