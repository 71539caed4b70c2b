"""A whole node lost: seconds from the fault to the run's next new step, killed and powered off.

    python benchmarks/node_loss_bench.py            # ~9 minutes; writes benchmarks/results/node_loss_bench.{json,md}

Runs the shipped drills ``kill-node`` (the agent of rank 1's node and its
worker SIGKILLed after step 30) and ``partition-node`` (rank 1's node, in a
network namespace of its own, cut off the network for 20 s: no packet
passes, no connection is reset, as when a machine loses power) through the
public ``resilient drill run``, ``--repeat`` times each; and
``partition-node-restart``, the same partition under a script that recovers
by restart (it makes a process group of its own): the spare node takes the
lost node's place in the restart's round.  Two nodes of one rank each and a
spare node, on one etcd the drill starts.

From each faulted run's files: the fault's time (``host_faults.jsonl``),
the first recovery decision after it (``recovery_decided`` or ``restart``
in ``events.jsonl``), and the first step completed after the fault whose
number is above every step completed before that decision
(``trace.jsonl``): the run's next new step.  With the drill's own score:
the rung, the steps re-done and the equality to the uninterrupted run.

Targets: with a ready spare, 0 steps re-done and the next new step within
1.5 s of a SIGKILL, and within 3 s of the traffic being cut (a silent node
is judged after 2.5 s, ``--node-silence-timeout``'s default, which an agent
stalled 2 s outlasts).  The restart has no time target (it re-does the steps
since the newest commit); it must restart without waiting for the cut-off
node and end bitwise.  There is no peer to take a ratio against: torchrun's
agents restart every rank after a node loss, from the newest checkpoint.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _provenance import load_now, run_line, run_record

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TARGETS: dict[str, float | None] = {"kill-node": 1.5, "partition-node": 3.0, "partition-node-restart": None}
"""Seconds from the fault to the next new step (None: measured, no target)."""
RUNG = {"kill-node": "promote_spare", "partition-node": "promote_spare", "partition-node-restart": "restart"}


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def measure(drill_dir: Path, record: dict[str, Any]) -> dict[str, Any]:
    """One faulted run: fault -> decision -> next new step."""
    faulted = drill_dir / "faulted"
    fault_at = next(e["time"] for e in _jsonl(faulted / "host_faults.jsonl") if e["kind"] == "fault_injected")
    events = _jsonl(faulted / "run" / "events.jsonl")
    decided = min(e["time"] for e in events if e["kind"] in ("recovery_decided", "restart") and e["time"] >= fault_at)
    trace = _jsonl(faulted / "trace.jsonl")
    done_before = max(t["step"] for t in trace if t["time"] <= decided)
    new = min(t["time"] for t in trace if t["step"] > done_before and t["time"] > decided)
    measured = record["measured"]
    return {"fault_to_decision_s": round(decided - fault_at, 3), "fault_to_next_new_step_s": round(new - fault_at, 3),
            "rung": measured["rung"], "redone_steps": measured["redone_steps"], "equal": measured["equal"],
            "detected_by": measured["detected_by"], "passed": record["passed"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", type=Path, default=HERE / "results")
    args = p.parse_args()
    started = time.time()
    load_before = load_now()
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in TARGETS}
    with tempfile.TemporaryDirectory(prefix="node-loss-") as tmp:
        for i in range(args.repeat):
            for name in TARGETS:
                out = Path(tmp) / f"{name}-{i}"
                proc = subprocess.run([sys.executable, "-m", "resilient", "drill", "run", str(ROOT / "chaos" / f"{name}.toml"),
                                       "--out", str(out)], capture_output=True, text=True, timeout=900, check=False)
                [record] = json.loads((out / "drills.json").read_text())
                if record.get("skipped"):
                    print(f"{name}: skipped on this machine: {record['skipped']}", file=sys.stderr)
                    return 2
                runs[name].append(measure(out / name, record) | {"drill_exit": proc.returncode})
                print(f"{name} #{i + 1}: {runs[name][-1]}", flush=True)
    summary = {}
    for name, found in runs.items():
        seconds = [r["fault_to_next_new_step_s"] for r in found]
        target = TARGETS[name]
        in_time = target is None or max(seconds) <= target
        redone_ok = target is None or all(r["redone_steps"] == 0 for r in found)
        summary[name] = {"median_s": round(statistics.median(seconds), 3), "max_s": max(seconds),
                         "target_s": target, "met": in_time and redone_ok
                         and all(r["equal"] and r["rung"] == RUNG[name] and r["passed"] for r in found)}
    result = {**run_record("node_loss_bench.py", sys.argv[1:], started, load_before),
              "runs": runs, "summary": summary}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "node_loss_bench.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = ["# A whole node lost: fault to the next new step", "",
             run_line(result), "",
             "| drill | run | fault → decision (s) | fault → next new step (s) | rung | re-done | equal |",
             "|---|---|---|---|---|---|---|"]
    for name, found in runs.items():
        for i, r in enumerate(found):
            lines.append(f"| {name} | {i + 1} | {r['fault_to_decision_s']:.3f} | {r['fault_to_next_new_step_s']:.3f} | "
                         f"{r['rung']} | {r['redone_steps']} | {'bitwise' if r['equal'] else 'NOT EQUAL'} |")
    lines += ["", "| drill | median (s) | max (s) | target (s) | met |", "|---|---|---|---|---|"]
    lines += [f"| {n} | {s['median_s']:.3f} | {s['max_s']:.3f} | {s['target_s'] or 'none (restart: bitwise, no wait)'} | "
              f"{'yes' if s['met'] else 'NO'} |" for n, s in summary.items()]
    (args.out / "node_loss_bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(s["met"] for s in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
