"""Detector settings changed through the store: two agents (one rank each) meeting through a real etcd."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from .agent_helpers import agent_env, events, node_status, start_agent, wait_for

pytestmark = [pytest.mark.timeout(300), pytest.mark.serial]

WORKER = Path(__file__).parent / "pace_worker.py"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "resilient", "detectors", *args], capture_output=True, text=True,
                          timeout=60, env=agent_env(), check=False)


def test_a_change_through_the_store_reaches_every_agent_and_a_bad_one_is_refused_before_it_is_written(
        tmp_path, etcd_server, etcd_run_id):
    run = tmp_path / "run"
    flags = ("--nnodes", "2", "--nproc-per-node", "1", "--store", etcd_server.url, "--run-id", etcd_run_id,
             "--local-addr", "127.0.0.1", "--rdzv-last-call", "1")
    script = ("--steps", "300", "--out", str(tmp_path / "out"), "--device-ms", "40", "--audit-every", "0")
    agents = {n: start_agent(run, *flags, "--node-id", n, script=WORKER, script_args=script,
                             log=tmp_path / f"{n}.log") for n in ("n0", "n1")}
    store = ("--store", etcd_server.url, "--run-id", etcd_run_id, "--token-file", str(run / "token"))
    try:
        wait_for(lambda: all((s := node_status(run, n)) and s.get("ranks") and
                             min(r["step"] for r in s["ranks"].values()) >= 20 for n in agents), 120,
                 "both nodes past step 20")
        refused = _cli(*store, "straggler.rule.consecutive=0")
        assert refused.returncode == 2 and "must be an int >= 1" in refused.stderr, refused
        answer = _cli(*store, "straggler.rule.consecutive=4", "slowdown.enabled=false")
        assert answer.returncode == 0, answer.stderr
        assert "seq 1:" in answer.stdout and "* straggler.rule.consecutive = 4" in answer.stdout
        again = _cli(*store, "straggler.rule.decision=12")  # merged with the first: one record, seq 2
        assert again.returncode == 0 and "seq 2:" in again.stdout and "straggler.rule.consecutive = 4" in again.stdout
        wait_for(lambda: {e["node"] for e in events(run, "detectors_changed")} == set(agents), 60,
                 "every agent to apply the change")
        codes = {n: a.wait(timeout=120) for n, a in agents.items()}
    finally:
        for a in agents.values():
            if a.poll() is None:
                a.kill()
    assert codes == {"n0": 0, "n1": 0}, {n: (tmp_path / f"{n}.log").read_text()[-3000:] for n in agents}
    for node in agents:
        changed = [e for e in events(run, "detectors_changed") if e["node"] == node]
        # Each agent applied the newest sequence it saw (the two requests may arrive in one poll or two).
        last = changed[-1]
        assert last["source"].startswith("store (seq 2, by ") and last["settings"]["straggler.rule.decision"] == 12
        assert last["settings"]["straggler.rule.consecutive"] == 4 and last["settings"]["slowdown.enabled"] is False
        assert all(e["source"].startswith("store") for e in changed) and len(changed) <= 2
