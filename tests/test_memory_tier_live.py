"""The memory tier under a real agent: real workers (gloo DDP, two ranks), real kills, real shared memory.

Every comparison is against the same command run without a fault: a run
restored from the memory tier must end bitwise equal to the run that never
stopped, having done at most the step that was cut again.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from resilient.agent.memory_tier import directory_for
from resilient.checkpoint import memory as mem

from .agent_helpers import agent_cmd, agent_env, events, explain, incidents, node_status, run_agent, wait_for
from .helpers import assert_same_run, read_trace

NODE = "n0"
SHORT = 40
LONG = 60


def args(trace: Path, ckpt: Path, steps: int, *extra: str) -> tuple[str, ...]:
    return ("--steps", str(steps), "--every", "10", "--keep", "3", "--dir", str(ckpt), "--trace", str(trace),
            "--sync", *extra)


def tier_dir(run_dir: Path) -> Path:
    return directory_for(Path("/dev/shm"), "mem", NODE, run_dir)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Both lengths of the training, supervised by the agent, with no fault."""
    out = {}
    for steps in (SHORT, LONG):
        d = tmp_path_factory.mktemp(f"reference{steps}")
        proc = run_agent(d / "run", "--nproc-per-node", "2", "--node-id", NODE, "--run-id", "mem",
                         script_args=args(d / "trace", d / "ckpt", steps))
        assert proc.returncode == 0, explain(proc)
        out[steps] = (read_trace(d / "trace", 0), read_trace(d / "trace", 1))
    return out


def restored_of(run_dir: Path, generation: int) -> dict:
    [event] = [e for e in events(run_dir, "restored") if e["generation"] == generation]
    return event


def test_a_crash_mid_step_resumes_from_the_memory_tier_at_the_step_it_cut(tmp_path, reference):
    run_dir = tmp_path / "run"
    proc = run_agent(run_dir, "--nproc-per-node", "2", "--node-id", NODE, "--run-id", "mem", "--memory-every", "1",
                     script_args=args(tmp_path / "trace", tmp_path / "ckpt", SHORT, "--crash-step", "37",
                                      "--crash-rank", "1"))
    assert proc.returncode == 0, explain(proc)
    [incident] = incidents(run_dir)
    # The agent places rank 1 at step 37, or before it when the heartbeats of the last steps were still queued
    # (sent in batches, test_heartbeat.py) as SIGKILL came: what it restores comes from the tier, not from there.
    assert incident["rank"] == 1 and incident["step"] <= 37, incident
    restored = restored_of(run_dir, 2)
    # Rank 1 died inside step 37, after both ranks saved the boundary before it; rank 0's copy of that boundary
    # may still have been hashing when the agent stopped it, and then the boundary before is the common one.
    step = restored["step"]
    assert step in (36, 37) and restored["checkpoint"] == f"memory:step_{step:010d}", restored
    assert {r["checkpoint"] for r in restored["ranks"].values()} == {restored["checkpoint"]}
    assert incident["restored"]["checkpoint"] == restored["checkpoint"]
    [memory_restored, *_] = [e for e in events(run_dir, "memory_tier_restored")]
    assert memory_restored["durable_step"] == 30 and memory_restored["step"] == step
    for rank, ref in enumerate(reference[SHORT]):
        got = read_trace(tmp_path / "trace", rank)
        assert [s["restored_from"] for s in got.starts] == [None, restored["checkpoint"]]
        assert got.starts[1]["step"] == step
        done = [s["step"] for s in got.all_steps]
        again = {s for s in done if done.count(s) > 1}
        assert again <= set(range(step, 38)), again  # at most the step cut, and the one rank 0 finished meanwhile
        assert_same_run(ref, got)
    # The run ended: the tier is gone, and the agent said so.
    [released] = events(run_dir, "memory_tier_released")
    assert released["directory"] == str(tier_dir(run_dir)) and released["reason"] == "succeeded"
    assert not tier_dir(run_dir).exists()


def test_a_node_without_room_keeps_to_the_durable_tier_and_says_so(tmp_path, reference):
    run_dir = tmp_path / "run"
    proc = run_agent(run_dir, "--nproc-per-node", "2", "--node-id", NODE, "--run-id", "mem", "--memory-every", "1",
                     "--memory-limit", "12K",
                     script_args=args(tmp_path / "trace", tmp_path / "ckpt", SHORT, "--crash-step", "37",
                                      "--crash-rank", "1"))
    assert proc.returncode == 0, explain(proc)
    off = events(run_dir, "memory_tier_off")
    assert off and all("over its limit of 12288" in e["reason"] and "--memory-limit" in e["reason"] for e in off)
    restored = restored_of(run_dir, 2)
    assert restored["checkpoint"] == "step_0000000030", restored
    for rank, ref in enumerate(reference[SHORT]):
        assert_same_run(ref, read_trace(tmp_path / "trace", rank))


def _kill_agent_midway(tmp_path: Path, run_dir: Path) -> int:
    """Start the long run, SIGKILL the agent and everything it started once both ranks hold step 25 or later in
    the memory tier (as ``resilient status`` shows it); return the newest step both ranks hold."""
    cmd = agent_cmd(run_dir, "--nproc-per-node", "2", "--node-id", NODE, "--run-id", "mem", "--memory-every", "1",
                    script_args=args(tmp_path / "trace", tmp_path / "ckpt", LONG, "--step-sleep", "0.05"))
    agent = subprocess.Popen(cmd, env=agent_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    try:
        def far_enough() -> bool:
            status = node_status(run_dir, NODE)
            held = (status or {}).get("memory") or {}
            steps = held.get("holdings", {})
            return all(min(steps.get(stem, [0])) >= 25 for stem in ("rank00000", "rank00001", "replicated"))

        wait_for(far_enough, 120, "both ranks to hold step 25 in the memory tier")
    finally:
        os.killpg(agent.pid, signal.SIGKILL)  # the agent, its fork server, its workers: nothing cleans up
        agent.wait(timeout=30)
    root = tier_dir(run_dir)
    # Gone means no process left that could still write the tier. A worker forked from the fork server shows the
    # server's environment in /proc (its own was set after the fork), so the test is also what maps the tier's
    # files: a worker whose save was under way would otherwise publish a step after the test read the tier.
    wait_for(lambda: not any(str(run_dir) in _environ(pid) or str(root) in _maps(pid) for pid in _pids()), 30,
             "the workers to be gone")
    held = [{r.step for r in mem.read_records(root, stem)} for stem in ("rank00000", "rank00001", "replicated")]
    common = set.intersection(*held)
    assert common and max(common) < LONG, held
    return max(common)


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _maps(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/maps").read_text(errors="replace")
    except OSError:
        return ""


def _environ(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def test_the_memory_tier_outlives_a_killed_agent_and_its_successor_resumes_from_it(tmp_path, reference):
    run_dir = tmp_path / "run"
    newest = _kill_agent_midway(tmp_path, run_dir)
    proc = run_agent(run_dir, "--nproc-per-node", "2", "--node-id", NODE, "--run-id", "mem", "--memory-every", "1",
                     script_args=args(tmp_path / "trace", tmp_path / "ckpt", LONG, "--step-sleep", "0.05"))
    assert proc.returncode == 0, explain(proc)
    [found] = events(run_dir, "memory_tier_found")
    assert newest in found["holdings"]["rank00001"]
    restored = [e for e in events(run_dir, "restored") if e["checkpoint"]][-1]
    assert restored["checkpoint"] == f"memory:step_{newest:010d}", restored
    for rank, ref in enumerate(reference[LONG]):
        got = read_trace(tmp_path / "trace", rank)
        assert got.starts[-1]["restored_from"] == restored["checkpoint"]
        assert_same_run(ref, got)
    assert not tier_dir(run_dir).exists()


def test_a_flipped_byte_in_the_memory_tier_falls_back_to_the_durable_tier(tmp_path, reference):
    run_dir = tmp_path / "run"
    _kill_agent_midway(tmp_path, run_dir)
    root = tier_dir(run_dir)
    for record in mem.read_records(root, "rank00001"):  # every step rank 1 holds: none of them restores
        shard = root / f"rank00001.{record.slot}.shard"
        raw = bytearray(shard.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        shard.write_bytes(raw)
    proc = run_agent(run_dir, "--nproc-per-node", "2", "--node-id", NODE, "--run-id", "mem", "--memory-every", "1",
                     script_args=args(tmp_path / "trace", tmp_path / "ckpt", LONG, "--step-sleep", "0.05"))
    assert proc.returncode == 0, explain(proc)
    [fallback, *_] = events(run_dir, "memory_tier_fallback")
    assert fallback["problems"] and all("rank00001" in p and "digest mismatch" in p for p in fallback["problems"])
    restored = [e for e in events(run_dir, "restored") if e["checkpoint"]][-1]
    assert restored["checkpoint"].startswith("step_") and restored["step"] % 10 == 0, restored
    for rank, ref in enumerate(reference[LONG]):
        assert_same_run(ref, read_trace(tmp_path / "trace", rank))
