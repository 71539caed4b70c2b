#!/usr/bin/env python
"""Memory tier benchmark: what the node's memory tier costs a training step, against the same run without it.

One rank under ``resilient run`` (``benchmarks/_memory_worker.py``: about 100 MB of model and AdamW state,
each step padded by a sleep to 50 ms from its start, as a step whose compute is on a GPU leaves the host
idle), in three modes interleaved in a rotating order inside each repeat, so every ratio compares runs
measured under the same conditions:

* ``off``: ``--no-memory-tier`` (the peer);
* ``auto``: the default (the interval chosen from the measured cost, within 5% of the step);
* ``every1``: ``--memory-every 1`` (a save at every boundary: the cost of one save, per step).

A step's period is the wall time between the starts of two consecutive steps, so the boundary's work (the
copy into shared memory; its hashing, on a thread, where it takes a core from the step) is in it.  The
first ``--skip`` steps are left out (start-up, and the first interval decision at step 4).  The cost per
step of a mode is its mean period minus that of ``off`` in the same repeat; its share is over the padded
step.  Results: ``benchmarks/results/memory_tier_bench.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _provenance

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_memory_worker.py"
PY = sys.executable
MODES = {"off": ["--no-memory-tier"], "auto": [], "every1": ["--memory-every", "1"]}
TARGET_SHARE = 0.05
TRIAL_TIMEOUT_S = 300.0


def log(msg: str) -> None:
    print(f"[memory_tier_bench] {msg}", file=sys.stderr, flush=True)


def command(mode: str, trial: Path, args: argparse.Namespace) -> list[str]:
    return [PY, "-m", "resilient", "run", "--nproc-per-node", "1", "--quiet", "--run-dir", str(trial / "run"),
            "--node-id", "n0", *MODES[mode], str(WORKER), "--out", str(trial / "out.json"), "--ckpt",
            str(trial / "ckpt"), "--events", str(trial / "events.jsonl"), "--steps", str(args.steps),
            "--step-ms", str(args.step_ms)]  # fmt: skip


def trial(mode: str, repeat: int, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    d = root / f"{mode}_{repeat:02d}"
    d.mkdir()
    cmd = command(mode, d, args)
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TRIAL_TIMEOUT_S, check=False)
    wall = time.monotonic() - t0
    if proc.returncode != 0 or not (d / "out.json").exists():
        raise SystemExit(f"{mode} #{repeat}: resilient run exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    out = json.loads((d / "out.json").read_text())
    events = [json.loads(line) for line in (d / "events.jsonl").read_text().splitlines() if line.strip()]
    cadence = [{k: e.get(k) for k in ("step", "every", "previous", "cost_s", "step_s", "reason")}
               for e in events if e.get("kind") == "memory_cadence"]
    off = [e.get("reason") for e in events if e.get("kind") == "memory_tier_off"]
    periods = out["periods_s"][args.skip:]
    r = {"mode": mode, "repeat": repeat, "wall_s": round(wall, 2), "state_bytes": out["state_bytes"],
         "steps_timed": len(periods), "mean_period_s": statistics.fmean(periods),
         "median_period_s": statistics.median(periods), "max_period_s": max(periods),
         "median_compute_s": statistics.median(out["compute_s"][args.skip:]), "cadence": cadence,
         "tier_off": off}  # fmt: skip
    shutil.rmtree(d, ignore_errors=True)
    return r


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    step_s = res["config"]["step_ms"] / 1e3
    by: dict[str, dict[int, dict[str, Any]]] = {}
    for t in res["trials"]:
        by.setdefault(t["mode"], {})[t["repeat"]] = t
    out: dict[str, Any] = {}
    for mode, trials in by.items():
        costs = [t["mean_period_s"] - by["off"][i]["mean_period_s"] for i, t in trials.items() if i in by["off"]]
        out[mode] = {"mean_period_s": statistics.median(t["mean_period_s"] for t in trials.values()),
                     "cost_per_step_s": statistics.median(costs) if costs else None,
                     "cost_share": statistics.median(costs) / step_s if costs else None,
                     "costs_s": costs, "intervals": sorted({c["every"] for t in trials.values() for c in t["cadence"]}),
                     "tier_off": sorted({r for t in trials.values() for r in t["tier_off"]})}  # fmt: skip
    return out


def verdict(res: dict[str, Any]) -> dict[str, Any]:
    auto = res["summary"].get("auto", {})
    share = auto.get("cost_share")
    ok = share is not None and share <= TARGET_SHARE and not auto.get("tier_off")
    return {"text": f"memory tier on its chosen interval costs {share:.1%} of a {res['config']['step_ms']:.0f} ms "
                    f"step for {res['trials'][0]['state_bytes'] / 1e6:.1f} MB of state (target <= "
                    f"{TARGET_SHARE:.0%})" if share is not None else "no auto trials",
            "verdict": "PASS" if ok else "MISS"}


def render(res: dict[str, Any]) -> str:
    env, cfg, s = res["environment"], res["config"], res["summary"]
    v = res["verdict"]
    lines = ["# Memory tier benchmark", "",
             (f"State: {res['trials'][0]['state_bytes'] / 1e6:.1f} MB (model + AdamW moments), one rank; steps "
              f"padded to {cfg['step_ms']:.0f} ms; {cfg['steps']} steps per run, the first {cfg['skip']} left out.  "),
             f"Host: {env['cpus']} CPUs, kernel {env['kernel']}, torch {env['torch']}, python {env['python']}.  ",
             f"Load at start: {env['load_start']}; at end: {env['load_end']}.  ",
             f"Code: `{env['git_head']}` (commit `{env['commit']}`){' with uncommitted changes' if env['dirty'] else ''}.  ",
             f"Command: `{env['invocation']}`.  ",
             f"Repeats: {cfg['repeats']} (modes interleaved in a rotating order); total {env['total_s']:.0f} s.", "",
             "## Target", "", f"**{v['verdict']}**: {v['text']}.", "",
             "## By mode (medians over repeats)", "",
             "| mode | flags | mean step period | cost per step vs off | share of the step | intervals chosen |",
             "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for mode, flags in MODES.items():
        if mode not in s:
            continue
        m = s[mode]
        cost = "-" if mode == "off" else f"{m['cost_per_step_s'] * 1e3:+.2f} ms"
        share = "-" if mode == "off" else f"{m['cost_share']:.1%}"
        lines.append(f"| {mode} | `{' '.join(flags) or '(default)'}` | {m['mean_period_s'] * 1e3:.2f} ms | "
                     f"{cost} | {share} | {', '.join(map(str, m['intervals'])) or '-'} |")
    lines += ["", "## Trials", "", "| mode | repeat | mean period | median | max | median compute | cadence events |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for t in res["trials"]:
        cad = "; ".join(f"step {c['step']}: every {c['every']} (cost {c['cost_s'] * 1e3:.1f} ms, step "
                        f"{(c['step_s'] or 0) * 1e3:.1f} ms)" for c in t["cadence"]) or "-"
        lines.append(f"| {t['mode']} | {t['repeat']} | {t['mean_period_s'] * 1e3:.2f} ms | "
                     f"{t['median_period_s'] * 1e3:.2f} ms | {t['max_period_s'] * 1e3:.1f} ms | "
                     f"{t['median_compute_s'] * 1e3:.1f} ms | {cad} |")
    lines += ["", "Commands:", ""] + [f"- {m}: `{c}`" for m, c in env["commands"].items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--skip", type=int, default=20, help="steps left out at the start of every run")
    ap.add_argument("--step-ms", type=float, default=50.0)
    ap.add_argument("--dir", default="/var/tmp", help="parent of the scratch dir")
    ap.add_argument("--out-dir", default=str(HERE / "results"))
    args = ap.parse_args(argv)
    if args.skip >= args.steps:
        raise SystemExit(f"--skip {args.skip}: must be below --steps {args.steps}")

    root = Path(tempfile.mkdtemp(prefix="memory_tier_bench_", dir=args.dir))
    t0 = time.time()
    modes = list(MODES)
    res: dict[str, Any] = {
        "config": {"repeats": args.repeats, "steps": args.steps, "skip": args.skip, "step_ms": args.step_ms},
        "environment": {**_provenance.host(sys.argv),
                        "commands": {m: shlex.join(command(m, Path("<trial>"), args)) for m in modes}},
        "trials": []}  # fmt: skip
    try:
        for i in range(args.repeats):
            for mode in modes[i % len(modes):] + modes[:i % len(modes)]:
                r = trial(mode, i, root, args)
                res["trials"].append(r)
                log(f"{mode:6s} #{i}: mean period {r['mean_period_s'] * 1e3:.2f} ms, median "
                    f"{r['median_period_s'] * 1e3:.2f} ms, intervals {[c['every'] for c in r['cadence']]}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    res["environment"] |= {"load_end": _provenance.load_now(), "total_s": time.time() - t0}
    res["summary"] = summarize(res)
    res["verdict"] = verdict(res)
    base = _provenance.write_results(args.out_dir, "memory_tier_bench", res, render)
    log(f"wrote {base}.json and .md")
    print(f"{res['verdict']['verdict']}  {res['verdict']['text']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
