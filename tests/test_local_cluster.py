"""``resilient local-cluster``: a topology's stack on loopback from installed binaries, driven as a user would.

``up`` starts etcd, Prometheus and Alertmanager (real servers) and two agents; a 2-node training runs through
them; one node's agent is SIGKILLed (a machine lost), started again by the supervisor under the same node id,
and the run resumes from the newest commit and completes; Prometheus scraped both agents; ``down`` leaves no
process behind.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from resilient.chaos.runner import leftovers
from resilient.deploy.local import alive, read_state, recorded_pids, run_exit_code
from resilient.core.errors import ConfigError
from resilient.core.exitcodes import EXIT_PREEMPTED_AGENT, EXIT_STOPPED, EXIT_UNHEALTHY

from .agent_helpers import agent_env

STEPS = 300


def cli(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "resilient", "local-cluster", *args], cwd=cwd, env=agent_env(),
                          check=False,
                          capture_output=True, text=True, timeout=timeout)


def topology(tmp_path: Path, workdir: str = ".") -> Path:
    path = tmp_path / "topology.toml"
    path.write_text(f"""
[run]
id = "local"
script = "resilient.chaos.workload"
module = true
args = ["--steps", "{STEPS}", "--every", "20", "--out", "out", "--ckpt", "ckpt", "--step-sleep", "0.05"]
workdir = "{workdir}"

[nodes]
count = 2
nproc_per_node = 1
""")
    return path


def committed(ckpt: Path) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in ckpt.glob("step_*") if (p / "manifest.json").exists())


def events(run_dir: Path, kind: str) -> list[dict]:
    return [e for line in (run_dir / "events.jsonl").read_text().splitlines() if (e := json.loads(line))["kind"] == kind]


def query(prometheus: str, expr: str) -> list[dict]:
    url = f"{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as r:
        return list(json.load(r)["data"]["result"])


def test_up_trains_two_nodes_through_a_lost_node_and_down_leaves_nothing(tmp_path):
    d = tmp_path / "cluster"
    up = cli("up", str(topology(tmp_path)), "--dir", str(d), "--alert-for", "1", cwd=tmp_path)
    state = read_state(d)
    try:
        assert up.returncode == 0, (up.stdout, up.stderr)
        assert state is not None and state["status"] == "running", state
        assert state["store"].startswith("etcd://127.0.0.1:"), state
        for url in (state["prometheus"], state["alertmanager"]):
            with urllib.request.urlopen(f"{url}/-/ready", timeout=5) as r:
                assert r.status == 200, url
        assert all(alive(p) for p in recorded_pids(state)), state
        again = cli("up", str(topology(tmp_path)), "--dir", str(d), cwd=tmp_path)
        assert again.returncode == 2 and "already up" in again.stderr, again.stderr

        ckpt = tmp_path / "ckpt"
        deadline = time.monotonic() + 120
        while not [s for s in committed(ckpt) if s >= 60]:
            assert time.monotonic() < deadline, cli("status", "--dir", str(d), cwd=tmp_path).stdout
            time.sleep(0.3)
        victim = read_state(d)["agents"]["n1"]["pid"]
        killed = cli("kill", "n1", "--dir", str(d), cwd=tmp_path)
        assert killed.returncode == 0 and f"pid {victim}" in killed.stdout, (killed.stdout, killed.stderr)
        lost_at = committed(ckpt)[-1]

        waited = cli("wait", "--dir", str(d), "--timeout", "240", cwd=tmp_path, timeout=300)
        assert waited.returncode == 0, (waited.stdout, waited.stderr)
        state = read_state(d)
        assert state["status"] == "finished" and state["exit_code"] == 0, state
        n0, n1 = state["agents"]["n0"], state["agents"]["n1"]
        assert n0["starts"] == 1 and n0["exits"] == [0], n0
        assert n1["starts"] == 2 and n1["exits"] == [-9, 0], n1  # killed, started again, finished with the run

        run_dir = tmp_path / "runs" / "local"
        [lost] = events(run_dir, "previous_agent_lost")
        assert lost["node"] == "n1" and lost["previous_agent"] == victim, lost
        restored = [e for e in events(run_dir, "restored") if e["generation"] == 2]
        assert len(restored) == 2 and all(e["step"] >= lost_at for e in restored), restored
        final = json.loads((tmp_path / "out" / "final.json").read_text())
        assert final["step"] == STEPS and final["world"] == 2, final
        trace = [json.loads(line) for line in (tmp_path / "out" / "trace.jsonl").read_text().splitlines()]
        rank0 = [t["step"] for t in trace if t["rank"] == 0]
        assert set(rank0) == set(range(STEPS)), "every step was trained"
        assert len(rank0) - STEPS < 40, "at most the steps since the newest commit were trained again"

        # Prometheus scraped both agents while they ran (the drills' monitoring, with the shipped rules).
        up_series = query(state["prometheus"], "max by (target) (max_over_time(up[10m]))")
        assert {s["metric"]["target"]: s["value"][1] for s in up_series} == {"n0": "1", "n1": "1"}, up_series
    finally:
        down = cli("down", "--dir", str(d), cwd=tmp_path, timeout=240)
    assert down.returncode == 0 and "no process left" in down.stdout, (down.stdout, down.stderr)
    final_state = read_state(d)
    assert final_state["status"] == "stopped", final_state
    assert not [p for p in recorded_pids(state) if alive(p)], "every server and agent it started is gone"
    assert leftovers(tmp_path / "runs" / "local") == []
    assert not Path(state["servers"]["etcd"]["data"]).exists(), "etcd's data is removed"


def test_bad_input_is_refused_with_the_fix(tmp_path):
    missing = cli("up", str(topology(tmp_path, workdir="/nonexistent-workdir")), "--dir", str(tmp_path / "c"),
                  cwd=tmp_path)
    assert missing.returncode == 2 and "/nonexistent-workdir" in missing.stderr and "--workdir" in missing.stderr
    assert not (tmp_path / "c").exists(), "nothing started"
    nothing = cli("down", "--dir", str(tmp_path / "none"), cwd=tmp_path)
    assert nothing.returncode == 2 and "no local cluster" in nothing.stderr and "--dir" in nothing.stderr
    with pytest.raises(ConfigError, match="alert-for"):
        from resilient.deploy.local import up

        up(topology(tmp_path), tmp_path / "c", alert_for_s=0)


def test_the_run_exit_code_follows_the_slurm_scripts_order():
    assert run_exit_code([0, 0]) == 0
    assert run_exit_code([EXIT_UNHEALTHY, EXIT_STOPPED]) == EXIT_STOPPED, "a verdict anywhere decides"
    assert run_exit_code([0, EXIT_UNHEALTHY]) == EXIT_UNHEALTHY
    assert run_exit_code([EXIT_PREEMPTED_AGENT, EXIT_UNHEALTHY]) == EXIT_UNHEALTHY
    assert run_exit_code([0, EXIT_PREEMPTED_AGENT]) == EXIT_PREEMPTED_AGENT, "a 0 may be a launch's end, not the run's"
    assert run_exit_code([0, 3]) == 0, "the run finished; an agent that crashed on the way does not matter"
    assert run_exit_code([3, 1]) == 3


def test_the_documented_commands_and_example_topology_are_valid():
    import re
    import shlex

    from resilient.cli.main import build_parser
    from resilient.deploy.topology import load_topology

    root = Path(__file__).resolve().parent.parent
    example = load_topology(root / "deploy" / "local" / "topology.toml")
    assert example.nodes == 2 and example.module and not example.etcd
    parser = build_parser()
    seen = 0
    for doc in (root / "docs" / "deploy.md", root / "deploy" / "README.md"):
        for line in re.findall(r"^resilient local-cluster .*$", doc.read_text(), flags=re.MULTILINE):
            args = parser.parse_args(shlex.split(line.split("#")[0])[1:])
            assert args.handler is not None, line
            seen += 1
    assert seen >= 8, seen
