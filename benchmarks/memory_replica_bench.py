"""A node lost with its agent under a restarting script: its memory state from a peer's copy, against none.

    python benchmarks/memory_replica_bench.py      # ~4 minutes; writes benchmarks/results/memory_replica_bench.{json,md}

Runs the shipped drill ``lose-node-memory-replica`` (two nodes of one rank
each and a spare node on one etcd; a script that makes its own process
group, so every failure restarts; durable commits only at step 0; node n1's
agent SIGKILLed after its rank completes step 37) through the public
``resilient drill run``, ``--repeat`` times with its ``--memory-replicas 1
--memory-pin-every 5`` and as many times without them (the same drill file
with those flags left out and its expectations about the copy dropped): the
peer is this project's own restart without a copy, in the same run.

From each faulted run's files: the fault's time, the restart decision, the
first step completed after the fault whose number is above every step
completed before the decision (the next new step), the step the ranks
restored (``memory_tier_restored``, or the durable commit's), what the
staging fetched and how long it took (``memory_replica_staged``); with the
drill's own score: steps re-done and equality to the uninterrupted run.

Target (issue: a lost node falls back to a copy on one peer node): with the
copy, the restart restores a step of the memory tier (at most
``pin_every`` + the copy's lag behind the loss), bitwise; without it, the
durable commit.
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

import tomllib
from _provenance import load_now, run_line, run_record

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DRILL = ROOT / "chaos" / "lose-node-memory-replica.toml"
COPY_EVENTS = ("memory_replica_held", "memory_replica_staged", "memory_tier_restored")


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def without_copy(tmp: Path) -> Path:
    """The shipped drill without ``--memory-replicas``: the same workload, fault and world."""
    text = DRILL.read_text()
    spec = tomllib.loads(text)
    flags = spec["topology"]["agent_args"]
    out = []
    for line in text.splitlines():
        if line.startswith("agent_args"):
            line = "agent_args = []"
        elif line.startswith("events ="):
            kept = [e for e in spec["expect"]["events"] if e not in COPY_EVENTS]
            line = "events = " + json.dumps(kept)
        elif line.startswith("max_redone_steps"):
            continue  # without a copy the restart re-does every step since the durable commit
        out.append(line)
    path = tmp / "lose-node-memory-replica.toml"
    path.write_text("\n".join(out) + "\n")
    assert flags, "the shipped drill keeps a copy"
    return path


def measure(drill_dir: Path, record: dict[str, Any]) -> dict[str, Any]:
    faulted = drill_dir / "faulted"
    fault_at = next(e["time"] for e in _jsonl(faulted / "host_faults.jsonl") if e["kind"] == "fault_injected")
    events = _jsonl(faulted / "run" / "events.jsonl")
    decided = min(e["time"] for e in events if e["kind"] == "restart" and e["time"] >= fault_at)
    trace = _jsonl(faulted / "trace.jsonl")
    done_before = max(t["step"] for t in trace if t["time"] <= decided)
    new = min(t["time"] for t in trace if t["step"] > done_before and t["time"] > decided)
    restored = [e for e in events if e["kind"] == "restored" and e["time"] >= fault_at]
    staged = [e for e in events if e["kind"] == "memory_replica_staged"]
    fetched = sum(v.get("bytes", 0) for e in staged for v in e["staged"].values())
    measured = record["measured"]
    return {"fault_to_next_new_step_s": round(new - fault_at, 3), "last_step_before_loss": done_before,
            "restored_from": "memory" if restored and str(restored[0]["checkpoint"]).startswith("memory:")
            else "durable", "restored_step": (restored[0]["step"] or 0) if restored else None,
            "redone_steps": measured["redone_steps"], "equal": measured["equal"], "rung": measured["rung"],
            "staged_s": max((e["seconds"] for e in staged), default=None), "staged_bytes": fetched,
            "passed": record["passed"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", type=Path, default=HERE / "results")
    args = p.parse_args()
    started = time.time()
    load_before = load_now()
    runs: dict[str, list[dict[str, Any]]] = {"with a copy": [], "without": []}
    with tempfile.TemporaryDirectory(prefix="memory-replica-") as tmp:
        files = {"with a copy": DRILL, "without": without_copy(Path(tmp))}
        for i in range(args.repeat):
            for mode, drill in files.items():
                out = Path(tmp) / f"{mode.replace(' ', '-')}-{i}"
                proc = subprocess.run([sys.executable, "-m", "resilient", "drill", "run", str(drill), "--out", str(out)],
                                      capture_output=True, text=True, timeout=900, check=False)
                [record] = json.loads((out / "drills.json").read_text())
                runs[mode].append(measure(out / "lose-node-memory-replica", record) | {"drill_exit": proc.returncode})
                print(f"{mode} #{i + 1}: {runs[mode][-1]}", flush=True)
    summary = {mode: {"median_next_new_step_s": statistics.median(r["fault_to_next_new_step_s"] for r in found),
                      "median_redone": statistics.median(r["redone_steps"] for r in found),
                      "from_memory": sum(r["restored_from"] == "memory" for r in found),
                      "bitwise": sum(bool(r["equal"]) for r in found), "runs": len(found)}
               for mode, found in runs.items()}
    with_copy, without = summary["with a copy"], summary["without"]
    met = (with_copy["from_memory"] == with_copy["bitwise"] == with_copy["runs"] == without["bitwise"]
           and with_copy["median_redone"] < without["median_redone"])
    result = {**run_record("memory_replica_bench.py", sys.argv[1:], started, load_before),
              "runs": runs, "summary": summary, "met": met,
              "redone_ratio": round(with_copy["median_redone"] / without["median_redone"], 3)
              if without["median_redone"] else None}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "memory_replica_bench.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = ["# A node lost with its agent: memory state from a peer's copy, against none", "",
             run_line(result), "",
             "| mode | run | fault → next new step (s) | last step before | restored | re-done | staging (s, bytes) | equal |",
             "|---|---|---|---|---|---|---|---|"]
    for mode, found in runs.items():
        for i, r in enumerate(found):
            staging = f"{r['staged_s']}, {r['staged_bytes']}" if r["staged_s"] is not None else "-"
            lines.append(f"| {mode} | {i + 1} | {r['fault_to_next_new_step_s']:.3f} | {r['last_step_before_loss']} | "
                         f"{r['restored_from']} step {r['restored_step']} | {r['redone_steps']} | {staging} | "
                         f"{'bitwise' if r['equal'] else 'NOT EQUAL'} |")
    lines += ["", "| mode | median fault → next new step (s) | median re-done | from memory | bitwise |",
              "|---|---|---|---|---|"]
    lines += [f"| {m} | {s['median_next_new_step_s']:.3f} | {s['median_redone']} | {s['from_memory']}/{s['runs']} | "
              f"{s['bitwise']}/{s['runs']} |" for m, s in summary.items()]
    lines += ["", f"Re-done steps with a copy / without: {result['redone_ratio']}. Met: {'yes' if met else 'NO'}."]
    (args.out / "memory_replica_bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
