"""Load on etcd from agents in steady training: requests per agent per second, from etcd's own counters.

    python benchmarks/store_load_bench.py          # ~1 minute; writes benchmarks/results/store_load_bench.{json,md}

Three agents on one etcd (started here, on loopback): two training nodes of
one rank each and a spare node (``--role spare``), running
``resilient.chaos.workload`` (every step under ``run.attempt()``, so the
agents follow the launch's recovery keys and the spare waits in the pool).
Once the run trains, etcd's ``grpc_server_handled_total`` (unary calls
completed) and ``grpc_server_started_total`` (calls begun, streams
included) are read, again ``--window`` seconds later; the difference per
agent per second is the steady-state load, split by method.

Target (issue: a control plane for a thousand nodes): at most 3 requests
per agent per second, flat in the number of agents.  There is no peer to
take a ratio against in this run: torchrun's agents talk to etcd only in a
rendezvous, never while training.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from _provenance import commit, load_now, uncommitted_code_changes

from resilient.chaos.cluster import Etcd

HERE = Path(__file__).resolve().parent
LINE = re.compile(r'^(grpc_server_(?:handled|started)_total)\{([^}]*)\} ([0-9.e+]+)$')


def counters(metrics_url: str) -> dict[tuple[str, str, str], float]:
    """(counter, service/method, grpc_type) -> value, from etcd's /metrics."""
    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        text = r.read().decode()
    found: dict[tuple[str, str, str], float] = {}
    for line in text.splitlines():
        m = LINE.match(line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        key = (m.group(1), f"{labels.get('grpc_service', '')}/{labels.get('grpc_method', '')}",
               labels.get("grpc_type", ""))
        found[key] = found.get(key, 0.0) + float(m.group(3))
    return found


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--window", type=float, default=30.0, help="seconds of steady training measured")
    p.add_argument("--out", type=Path, default=HERE / "results" / "store_load_bench")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="store-load-"))
    etcd = Etcd(root / "etcd")
    host_port = etcd.url.split("://", 1)[1]
    metrics = f"http://{host_port}/metrics"
    steps = 100000  # far more than the window needs: the run is stopped once measured
    token = root / "token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    agents: dict[str, subprocess.Popen] = {}
    try:
        for node, role in (("node0", "worker"), ("node1", "worker"), ("spare0", "spare")):
            run_dir = root / node
            cmd = [sys.executable, "-m", "resilient", "run", "--run-dir", str(run_dir), "--quiet",
                   "--nnodes", "2", "--nproc-per-node", "1", "--store", etcd.url, "--run-id", "load",
                   "--node-id", node, "--local-addr", "127.0.0.1", "--rdzv-last-call", "1",
                   "--token-file", str(token), *(["--role", "spare"] if role == "spare" else []),
                   "-m", "resilient.chaos.workload", "--steps", str(steps), "--out", str(root / "out"),
                   "--ckpt", str(root / "ckpt"), "--every", "50", "--step-sleep", "0.05"]
            agents[node] = subprocess.Popen(cmd, stdout=open(root / f"{node}.log", "w"), stderr=subprocess.STDOUT,
                                            env={**os.environ, "PYTHONPATH": str(HERE.parent)})
        trace = root / "out" / "trace.jsonl"
        deadline = time.monotonic() + 180
        while not (trace.exists() and sum(1 for _ in trace.open()) >= 40):
            if time.monotonic() > deadline or any(a.poll() is not None for a in agents.values()):
                logs = "\n".join((root / f"{n}.log").read_text()[-2000:] for n in agents)
                raise SystemExit(f"the run did not train: {logs}")
            time.sleep(0.5)
        time.sleep(5.0)  # spares warm and in the pool, every watch started
        before, t0 = counters(metrics), time.monotonic()
        time.sleep(args.window)
        after, t1 = counters(metrics), time.monotonic()
        stepped = sum(1 for _ in trace.open())
        alive = all(a.poll() is None for a in agents.values())
    finally:
        for agent in agents.values():
            if agent.poll() is None:
                agent.terminate()
        for agent in agents.values():
            try:
                agent.wait(timeout=60)
            except subprocess.TimeoutExpired:
                agent.kill()
        etcd.close()
    seconds = t1 - t0
    n = len(agents)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in set(after) | set(before)}
    handled = {k[1]: v for k, v in delta.items() if k[0] == "grpc_server_handled_total" and v > 0}
    started = {f"{k[1]} ({k[2]})": v for k, v in delta.items() if k[0] == "grpc_server_started_total" and v > 0}
    total_started = sum(started.values())
    result = {
        "commit": commit(), "uncommitted": uncommitted_code_changes(),
        "command": "python benchmarks/store_load_bench.py " + shlex.join(sys.argv[1:]),
        "load": load_now(), "agents": n, "window_s": round(seconds, 2), "all_agents_alive": alive,
        "trace_lines_at_end": stepped,
        "requests_per_agent_per_s": round(total_started / seconds / n, 3),
        "target_per_agent_per_s": 3.0,
        "started_by_method_per_agent_per_s": {k: round(v / seconds / n, 3) for k, v in sorted(started.items())},
        "handled_by_method_per_agent_per_s": {k: round(v / seconds / n, 3) for k, v in sorted(handled.items())},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    rows = "\n".join(f"| {k} | {v} |" for k, v in result["started_by_method_per_agent_per_s"].items())
    args.out.with_suffix(".md").write_text(
        f"# etcd load from agents in steady training\n\ncommit `{result['commit']}`; "
        f"`{result['command']}`; load {result['load']}\n\n"
        f"{n} agents (2 training nodes, 1 spare node), {seconds:.1f} s of training: "
        f"**{result['requests_per_agent_per_s']} requests per agent per second** (target <= 3).\n\n"
        f"| call begun (per agent per s) | rate |\n|---|---|\n{rows}\n")
    print(json.dumps(result, indent=2))
    return 0 if alive else 1


if __name__ == "__main__":
    sys.exit(main())
