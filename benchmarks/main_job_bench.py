#!/usr/bin/env python
"""The main job's table as a result file: ``examples/recovery_demo.py`` run as the README runs it, once or more.

    python benchmarks/main_job_bench.py                 # one run of the demo, ~2 minutes on 2 cores
    python benchmarks/main_job_bench.py --runs 3        # three, each row's median beside its runs

Each run is the whole demo (the uninterrupted run, torchrun with a restart, ``resilient run`` with a
restart, ``resilient run --spares 1``, the NaN incident bundled and replayed), launched as a command, its
``summary.json`` read back.  Per mode: seconds from the crash to the next new step, steps re-done,
goodput from the script's trace and, for ``resilient run``, from the agent's ledger; the verdict against
the uninterrupted run.  The runs are sequential, with nothing else started by this script meanwhile.
Results: ``benchmarks/results/main_job_bench.{json,md}`` with the commit, the command and the load.
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

from _provenance import host, load_now

HERE = Path(__file__).resolve().parent
DEMO = HERE.parent / "examples" / "recovery_demo.py"


def run_demo(workdir: Path, extra: list[str], timeout_s: float) -> dict[str, Any]:
    cmd = [sys.executable, str(DEMO), "--workdir", str(workdir), *extra]
    started = time.time()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    summary = json.loads((workdir / "summary.json").read_text()) if (workdir / "summary.json").exists() else {}
    return {"exit_code": done.returncode, "seconds": time.time() - started, "summary": summary,
            "tail": (done.stdout + done.stderr)[-3000:] if done.returncode else ""}


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per mode, across the runs: each figure's median and its values."""
    modes: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        for row in run["summary"].get("rows", []):
            modes.setdefault(row["mode"], []).append(row)
    out = []
    for mode, rows in modes.items():
        entry: dict[str, Any] = {"mode": mode, "label": rows[0]["label"],
                                 "verdicts": [r["verdict"] for r in rows]}
        for key in ("recovery_s", "redone", "goodput", "ledger_goodput", "wall_s"):
            values = [r[key] for r in rows if r.get(key) is not None]
            entry[key] = {"median": statistics.median(values) if values else None, "values": values}
        out.append(entry)
    return out


def render(res: dict[str, Any]) -> str:
    env = res["environment"]
    lines = [
        "# The main job: one crash, three ways to recover it",
        "",
        (f"Command: `{env['invocation']}`; commit {env['commit']} ({env['git_head']}); {env['cpus']} CPUs, "
         f"torch {env['torch']}; load average at start {env['load_start']['loadavg']}, at end "
         f"{env['loadavg_end']}; {len(res['runs'])} run(s) of the demo, {env['total_s']:.0f} s in all."),
        "",
        ("| launcher | recovery (crash -> next new step) | steps re-done | goodput (trace) "
         "| goodput (agent's ledger) | final model vs uninterrupted |"),
        "|---|---|---|---|---|---|",
    ]

    def fmt(figure: dict[str, Any], form: str) -> str:
        if figure["median"] is None:
            return "-"
        values = ", ".join(form.format(v) for v in figure["values"])
        return form.format(figure["median"]) + (f" ({values})" if len(figure["values"]) > 1 else "")

    def pct(figure: dict[str, Any]) -> dict[str, Any]:
        median = figure["median"]
        return {"median": None if median is None else 100 * median, "values": [100 * v for v in figure["values"]]}

    for m in res["summary"]:
        lines.append(f"| {m['label']} | {fmt(m['recovery_s'], '{:.2f} s')} | {fmt(m['redone'], '{:g}')} | "
                     f"{fmt(pct(m['goodput']), '{:.0f}%')} | {fmt(pct(m['ledger_goodput']), '{:.0f}%')} | "
                     f"{', '.join(m['verdicts'])} |")
    incidents = [r["summary"].get("incident") for r in res["runs"]]
    lines += ["", "NaN incident replayed: " + ", ".join(
        "reproduced" if i and i.get("reproduced") else "NOT reproduced" for i in incidents) + ".",
        "", "Medians first, each run's value in brackets.  Definitions: docs/install.md, \"The main job\"."]
    failed = [r for r in res["runs"] if r["exit_code"] != 0]
    for r in failed:
        lines += ["", f"A run exited {r['exit_code']}:", "```", r["tail"], "```"]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=1, help="runs of the demo (default 1)")
    p.add_argument("--out-dir", default=str(HERE / "results"))
    p.add_argument("--timeout", type=float, default=900.0, help="longest one run may take, in seconds")
    p.add_argument("demo_args", nargs="*", help="after --: arguments for recovery_demo.py")
    args = p.parse_args()
    t0 = time.time()
    res: dict[str, Any] = {"environment": host(sys.argv), "runs": []}
    with tempfile.TemporaryDirectory(prefix="main_job_bench.") as scratch:
        for i in range(args.runs):
            run = run_demo(Path(scratch) / f"run{i}", args.demo_args, args.timeout)
            print(f"run {i + 1}/{args.runs}: exit {run['exit_code']} in {run['seconds']:.0f} s", flush=True)
            res["runs"].append(run)
    res["environment"] |= {"loadavg_end": load_now()["loadavg"], "total_s": time.time() - t0}
    res["summary"] = summarize(res["runs"])
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "main_job_bench.json").write_text(json.dumps(res, indent=1, default=str))
    (out / "main_job_bench.md").write_text(render(res))
    print(render(res))
    return 0 if all(r["exit_code"] == 0 for r in res["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
