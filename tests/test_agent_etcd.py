"""Several agents on one machine meeting through a real etcd: losing a node (and its node_lost incident),
and an etcd outage."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from .agent_helpers import events, events_so_far, incidents, node_status, start_agent, wait_for
from .helpers import read_trace


def _node_args(url: str, run_id: str, node: str, nnodes: str) -> tuple[str, ...]:
    return ("--nnodes", nnodes, "--nproc-per-node", "1", "--store", url, "--run-id", run_id, "--node-id", node,
            "--local-addr", "127.0.0.1", "--rdzv-last-call", "2", "--stop-grace", "3")


def _worker(tmp_path: Path, steps: int) -> tuple[str, ...]:
    return ("--steps", str(steps), "--every", "5", "--keep", "3", "--dir", str(tmp_path / "ckpt"),
            "--trace", str(tmp_path / "trace"), "--elastic", "--step-sleep", "0.1")


def _start_nodes(tmp_path: Path, url: str, run_id: str, nodes: list[str], nnodes: str, steps: int,
                 step: int) -> dict[str, object]:
    """One agent per node (one worker each); return once every rank passed ``step``."""
    run_dir = tmp_path / "run"
    agents = {n: start_agent(run_dir, *_node_args(url, run_id, n, nnodes), script_args=_worker(tmp_path, steps),
                             log=tmp_path / f"{n}.log") for n in nodes}
    try:
        wait_for(lambda: _ranks_past(run_dir, nodes, step), timeout=180, what=f"every node to pass step {step}")
    except BaseException:
        _kill_all(agents)
        raise
    return agents


def _ranks_past(run_dir: Path, nodes: list[str], step: int) -> bool:
    for node in nodes:
        s = node_status(run_dir, node)
        if not s or not s["ranks"] or not all(r["step"] >= step for r in s["ranks"].values()):
            return False
    return True


def _finish(agents: dict[str, object], timeout: float) -> dict[str, int]:
    codes = {}
    deadline = time.monotonic() + timeout
    for node, agent in agents.items():
        codes[node] = agent.wait(timeout=max(1.0, deadline - time.monotonic()))  # type: ignore[attr-defined]
    return codes


def _outage_noticed_by(run_dir: Path) -> set[str]:
    """The nodes whose agents said the store became unreachable, so far."""
    return {e["node"] for e in events_so_far(run_dir, "store_outage_start")}


def _kill_all(agents: dict[str, object]) -> None:
    for agent in agents.values():
        if agent.poll() is None:  # type: ignore[attr-defined]
            agent.kill()  # type: ignore[attr-defined]


def test_losing_one_of_three_nodes_continues_on_two_from_the_newest_checkpoint(tmp_path, etcd_server):
    run_dir, nodes, steps = tmp_path / "run", ["n0", "n1", "n2"], 40
    agents = _start_nodes(tmp_path, etcd_server.url, "lose-one", nodes, "2:3", steps, step=12)
    try:
        # The node with the highest node rank dies whole: its agent and its worker, at once.
        victim = max(nodes, key=lambda n: node_status(run_dir, n)["node_rank"])
        worker_pids = [r["pid"] for r in node_status(run_dir, victim)["ranks"].values()]
        agents[victim].kill()
        for pid in worker_pids:
            with contextlib.suppress(ProcessLookupError):  # the parent-death signal may have been first
                os.kill(pid, signal.SIGKILL)
        survivors = {n: a for n, a in agents.items() if n != victim}
        codes = _finish(survivors, timeout=240)
    finally:
        _kill_all(agents)
    logs = {n: (tmp_path / f"{n}.log").read_text()[-3000:] for n in nodes}
    assert all(code == 0 for code in codes.values()), (codes, logs)

    joined = [e for e in events(run_dir, "rendezvous_joined") if e["node"] != victim]
    assert {e["num_nodes"] for e in joined if e["generation"] == 1} == {3}
    last = max(e["generation"] for e in joined)
    assert {e["num_nodes"] for e in joined if e["generation"] == last} == {2}
    assert {e["node"] for e in joined if e["generation"] == last} == set(survivors)

    # The survivors judged the victim lost from their probes (its port refused them), before its lease lapsed.
    lost = [i for i in incidents(run_dir) if i["kind"] == "node_lost"]
    assert lost and {i["node"] for i in lost} == {victim}, incidents(run_dir)
    assert all(f"node {victim} was lost: its agent does not answer probes" in i["summary"] for i in lost), lost
    assert {e["node"] for e in events(run_dir, "node_lost")} <= set(survivors)

    trace = read_trace(tmp_path / "trace", 0)
    resumed = [s for s in trace.starts if s["world_size"] == 2]
    assert resumed, trace.starts
    restored_step = int(resumed[-1]["restored_from"].split("_")[1])
    # Updates rank 0 completed on three nodes, before the loss; the restore is the newest commit
    # before that point (every 5 steps, saved in the background so possibly one cadence behind).
    records = [json.loads(line) for line in (tmp_path / "trace.rank0").read_text().splitlines()]
    second_start = [i for i, r in enumerate(records) if r.get("event") == "start"][1]
    done_before = max(r["step"] for r in records[:second_start] if "step" in r and "event" not in r) + 1
    assert restored_step % 5 == 0 and done_before - 10 < restored_step <= done_before, (restored_step, done_before)
    assert trace.end is not None and trace.end["step"] == steps
    assert sorted(trace.steps) == list(range(steps))

    # A survivor's failure (its workers' collective errors: the cause was the lost node) names what the restart
    # restored, in its file and in its run-wide copy in the store.
    from resilient.cli.status_cmd import collect_from_store

    stored = {i["id"]: i for i in collect_from_store(etcd_server.url, "lose-one")["incidents"]}
    failed = [i for i in incidents(run_dir) if i["kind"] in ("exit", "signal")]
    assert failed and {i["node"] for i in failed} <= set(survivors), incidents(run_dir)
    for i in failed:
        restored = i["restored"]
        assert (restored["checkpoint"], restored["step"]) == (resumed[-1]["restored_from"], restored_step), i
        assert restored["generation"] > i["generation"] and not restored["missing"]
        assert stored[i["id"]]["restored"] == restored


def test_a_short_etcd_outage_does_not_kill_the_run(tmp_path, etcd_outage_server):
    run_dir, nodes, steps = tmp_path / "run", ["a", "b"], 60
    agents = _start_nodes(tmp_path, etcd_outage_server.url, "outage", nodes, "2", steps, step=5)
    try:
        etcd_outage_server.stop()
        # Down until every node noticed (their peer watch asks the store once a second), then back.
        wait_for(lambda: _outage_noticed_by(run_dir) == set(nodes), timeout=60, what="every node to notice the outage")
        etcd_outage_server.start()
        codes = _finish(agents, timeout=240)
    finally:
        _kill_all(agents)
    logs = {n: (tmp_path / f"{n}.log").read_text()[-3000:] for n in nodes}
    assert codes == {"a": 0, "b": 0}, (codes, logs)
    assert not events(run_dir, "restart"), "the outage must not restart the workers"
    assert {e["node"] for e in events(run_dir, "store_outage_start")} == set(nodes)
    assert {e["node"] for e in events(run_dir, "store_outage_end")} == set(nodes)
    trace = read_trace(tmp_path / "trace", 0)
    assert len(trace.starts) == 1 and trace.end is not None and trace.end["step"] == steps
    # The on-call view from any machine: read from etcd, not from the run directory.
    status = subprocess.run([sys.executable, "-m", "resilient", "status", "--store", etcd_outage_server.url,
                             "--run-id", "outage"], capture_output=True, text=True, timeout=60, check=False)
    assert status.returncode == 0, status.stderr
    assert "node a (agent pid" in status.stdout and "node b (agent pid" in status.stdout
    assert "finished: succeeded" in status.stdout and "restarts used: 0 of 3" in status.stdout
