"""The rendered sbatch script on a real Slurm (munged, slurmctld and three slurmd started by the fixture).

A 2-process training under the agent, requeued by hand in the middle (what a preemption does): the job runs
again with ``SLURM_RESTART_COUNT`` 1, which the agent takes as a new launch of the same run, and resumes from
the newest commit, ending bitwise equal to an uninterrupted run.  A script that fails on every try ends with
the agent's crash-loop verdict (exit 80), which the script does not requeue.  A run of two nodes and a spare
node meets through the etcd the script starts on the allocation's first node; one node's agent is killed, the
spare node takes its ranks in process, and the job completes without a requeue.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import pytest

from resilient.chaos.cluster import etcd_binary
from resilient.chaos.monitor import free_port
from resilient.deploy.render import render
from resilient.deploy.topology import load_topology

from .agent_helpers import agent_env
from .slurm_cluster import SlurmCluster

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def slurm():
    # Not under pytest's tmp_path: its directories are private to root, and munged runs as munge.
    root = Path(tempfile.mkdtemp(prefix="resilient-slurm-"))
    cluster = SlurmCluster(root, nodes=3)
    try:
        yield cluster
    finally:
        left = cluster.close()
        shutil.rmtree(root, ignore_errors=True)
        assert left == [], left


def sbatch_for(tmp_path: Path, run_id: str, script: str, args: list[str], *, module: bool,
               max_restarts: int = 3, nodes: int = 1, spares: int = 0) -> Path:
    topology = tmp_path / "topology.toml"
    topology.write_text(f"""
[run]
id = "{run_id}"
script = "{script}"
args = {json.dumps(args)}
module = {"true" if module else "false"}
workdir = "{tmp_path}"
python = "{sys.executable}"
agent_args = ["--crash-loop-restarts", "2"]

[nodes]
count = {nodes}
nproc_per_node = {2 if nodes == 1 else 1}
spares = {spares}
max_restarts = {max_restarts}

[metrics]
port = 0
addr = "127.0.0.1"

[slurm]
partition = "debug"
""")
    files = render(load_topology(topology), "slurm", assets=ROOT / "dashboards")
    path = tmp_path / f"{run_id}.sbatch"
    path.write_text(files[f"{run_id}.sbatch"])
    return path


def output(workdir: Path, run_id: str, job: int) -> str:
    """The job's output (the batch script's and the agents' logs), as far as it is written."""
    path = workdir / f"slurm-{run_id}-{job}.out"
    return path.read_text() if path.exists() else f"(no {path})"


def events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def steps(out: Path) -> list[dict]:
    path = out / "trace.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def committed(ckpt: Path) -> list[int]:
    """Steps of the committed checkpoints (a local directory: step_N/ with its manifest)."""
    return sorted(int(p.name.split("_")[1]) for p in ckpt.glob("step_*") if (p / "manifest.json").exists())


def test_a_requeued_job_resumes_from_the_newest_commit_as_a_new_launch(slurm, tmp_path):
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    args = ["--steps", "500", "--every", "20", "--out", str(out), "--ckpt", str(ckpt), "--step-sleep", "0.1"]
    job = slurm.sbatch(sbatch_for(tmp_path, "requeue", "resilient.chaos.workload", args, module=True),
                       agent_env())
    run_dir = tmp_path / "runs" / "requeue"
    deadline = time.monotonic() + 120
    while not [s for s in committed(ckpt) if s >= 100]:
        assert time.monotonic() < deadline, (slurm.job(job), output(tmp_path, "requeue", job))
        time.sleep(0.5)
    requeued = slurm.run("scontrol", "requeue", str(job))
    assert requeued.returncode == 0, requeued.stderr
    committed_before = committed(ckpt)[-1]
    done = slurm.wait_state(job, ("COMPLETED", "FAILED", "CANCELLED"), timeout=300)
    log = output(tmp_path, "requeue", job)
    assert done["JobState"] == "COMPLETED" and done["Restarts"] == "1" and done["ExitCode"] == "0:0", (done, log)
    assert "left to Slurm" in log and "run requeue finished" in log, log
    seen = events(run_dir)
    launches = [e["launch_id"] for e in seen if e["kind"] == "launch_joined"]
    assert launches == [f"slurm-{job}-0", f"slurm-{job}-1"], launches
    [preempted] = [e for e in seen if e["kind"] == "agent_finished" and e["exit_code"] != 0]
    assert preempted["verdict"] == "preempted" and preempted["restarts_used"] == 0, preempted
    # Slurm SIGTERMs every process of the job, the workers too: a stop, not a failure (no incident, no restart).
    assert not [e for e in seen if e["kind"] == "incident"], [e for e in seen if e["kind"] == "incident"]
    final = json.loads((out / "final.json").read_text())
    assert final["step"] == 500
    # The second launch began at the newest commit, which the stopping agents took (a preemption's save) or
    # the one before: every step was done, none lost, at most one checkpoint interval re-done.
    trace = [t for t in steps(out) if t["rank"] == 0]
    assert {t["step"] for t in trace} == set(range(500))
    redone = len(trace) - 500
    assert 0 <= redone < 20, (redone, committed_before)


def test_a_crash_loop_verdict_is_not_requeued(slurm, tmp_path):
    fail = tmp_path / "fail.py"
    fail.write_text("import sys\nprint('failing on purpose', flush=True)\nsys.exit(3)\n")
    job = slurm.sbatch(sbatch_for(tmp_path, "crashloop", str(fail), [], module=False, max_restarts=5), agent_env())
    done = slurm.wait_state(job, ("COMPLETED", "FAILED", "CANCELLED"), timeout=180)
    run_dir = tmp_path / "runs" / "crashloop"
    log = output(tmp_path, "crashloop", job)
    assert done["JobState"] == "FAILED" and done["ExitCode"] == "80:0" and done["Restarts"] == "0", (done, log)
    assert "stopped with a verdict (exit 80): not requeued" in log, log
    [finished] = [e for e in events(run_dir) if e["kind"] == "agent_finished"]
    assert finished["exit_code"] == 80, finished


def test_two_nodes_and_a_spare_meet_through_the_first_nodes_etcd_and_the_spare_takes_a_lost_nodes_ranks(
        slurm, tmp_path):
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    args = ["--steps", "300", "--every", "20", "--out", str(out), "--ckpt", str(ckpt), "--step-sleep", "0.05"]
    env = agent_env({"ETCD": etcd_binary(), "ETCD_PORT": str(free_port()), "ETCD_PEER_PORT": str(free_port()),
                     "ETCD_DIR": str(tmp_path / "etcd")})
    job = slurm.sbatch(sbatch_for(tmp_path, "multi", "resilient.chaos.workload", args, module=True, nodes=2,
                                  spares=1), env)
    run_dir = tmp_path / "runs" / "multi"
    status = run_dir / "nodes" / "n2" / "status.json"
    deadline = time.monotonic() + 180
    while not [s for s in committed(ckpt) if s >= 60] or not status.exists():
        assert time.monotonic() < deadline, (slurm.job(job), output(tmp_path, "multi", job))
        time.sleep(0.5)
    victim = json.loads(status.read_text())["agent_pid"]
    os.kill(victim, signal.SIGKILL)  # node n2 lost with its agent
    done = slurm.wait_state(job, ("COMPLETED", "FAILED", "CANCELLED"), timeout=300)
    log = output(tmp_path, "multi", job)
    assert done["JobState"] == "COMPLETED" and done["Restarts"] == "0" and done["ExitCode"] == "0:0", (done, log)
    seen = events(run_dir)
    started = {e["node"]: e for e in seen if e["kind"] == "agent_started"}
    assert set(started) == {"n1", "n2", "n3"}, started
    stores = {e["store"] for e in started.values()}
    assert stores == {f"etcd://127.0.0.1:{env['ETCD_PORT']}"}, stores  # the first node's etcd, by its NodeAddr
    assert [e["node"] for e in seen if e["kind"] == "spare_node_joined"][:1] == ["n3"]
    assert any(e["kind"] == "node_lost" for e in seen), [e["kind"] for e in seen]
    assert "promote_spare" in [e.get("action") for e in seen if e["kind"] == "recovery_decided"]
    final = json.loads((out / "final.json").read_text())
    assert final["step"] == 300 and final["world"] == 2, final
    # Every step trained by the world (the lost node's last line may be missing: it died after a step's all-reduce,
    # before writing it, and the spare took over after that step), each rank at most once per step since
    # nothing is re-done when the spare takes the lost ranks in process.
    trace = steps(out)
    assert {t["step"] for t in trace} == set(range(300))
    for rank in (0, 1):
        mine = [t["step"] for t in trace if t["rank"] == rank]
        assert len(mine) == len(set(mine)), f"rank {rank} re-did steps"
    assert "run multi finished" in log, log
