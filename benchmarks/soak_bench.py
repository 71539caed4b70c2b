#!/usr/bin/env python
"""Fault soak: random signals to any worker or spare, every few seconds, until the run ends.

The drills' reference workload (``python -m resilient.chaos.workload``: a DDP MLP under ``run.attempt()``, a
checkpoint every ``--every`` steps, steps padded by ``--step-sleep``) runs twice per seed under ``resilient run``
with two ranks:

* the **reference**: no fault, no spare (its wall time and its final digests are the yardstick);
* the **soak**: ``--spares S`` (default 1), and from the agent's start on, every ``U(lo, hi)`` seconds one of
  SIGKILL, SIGSEGV, SIGTERM or SIGSTOP (drawn from the seed) to one process drawn from the run's live workers and
  spares.  The targets are read as an operator would: the pids in the run's ``events.jsonl``
  (``workers_started``, ``spare_started``), alive and descended from the agent.  Nothing waits for a good moment:
  a fault may hit a worker still starting, a spare warming up, a rank in its save.

Per soak: whether it finished (the agent's exit 0), its wall time over the reference's, whether its final model
and optimizer digests equal the reference's (bitwise), the faults sent, the restarts and in-process recoveries
the agent reported, its verdict when it stopped, and the steps some rank completed more than once.

Targets (issue: cheap restarts): the 4-9 s soak finishes, bitwise equal, on every seed; the 2-5 s soak is
reported as it is.  Results: ``benchmarks/results/soak_bench.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import _provenance

from resilient.cli.status_cmd import read_events

HERE = Path(__file__).resolve().parent
PY = sys.executable
SIGNALS = {"KILL": signal.SIGKILL, "SEGV": signal.SIGSEGV, "TERM": signal.SIGTERM, "STOP": signal.SIGSTOP}
TIMEOUT_FACTOR = 10.0
"""A soak is given up (and counted as not finished) after this many times the reference's wall time."""


def log(msg: str) -> None:
    print(f"[soak_bench] {msg}", file=sys.stderr, flush=True)


def command(trial: Path, args: argparse.Namespace, spares: int) -> list[str]:
    return [PY, "-m", "resilient", "run", "--nproc-per-node", "2", *(["--spares", str(spares)] if spares else []),
            "--quiet", "--run-dir", str(trial / "run"), "--node-id", "n0", "-m", "resilient.chaos.workload",
            "--steps", str(args.steps), "--every", str(args.every), "--step-sleep", str(args.step_sleep),
            "--out", str(trial / "out"), "--ckpt", str(trial / "ckpt")]  # fmt: skip


# ------------------------------------------------------------------ the targets, as an operator finds them
def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of ``pid``, or None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1])


def _descends(pid: int, ancestor: int) -> bool:
    seen = 0
    while pid > 1 and seen < 64:
        st = _stat(pid)
        if st is None:
            return False
        pid, seen = st[1], seen + 1
        if pid == ancestor:
            return True
    return False


def targets(run_dir: Path, agent_pid: int) -> dict[int, str]:
    """The run's live workers and spares: pid -> what started it (``rank R (generation G)`` or ``spare``)."""
    found: dict[int, str] = {}
    try:
        lines = (run_dir / "events.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return found
    for line in lines:
        try:
            e = json.loads(line)
        except json.JSONDecodeError:
            continue  # being written
        if e.get("kind") == "workers_started":
            for rank, pid in (e.get("pids") or {}).items():
                found[int(pid)] = f"rank {rank} (generation {e.get('generation')})"
        elif e.get("kind") == "spare_started" and e.get("pid"):
            found[int(e["pid"])] = f"spare {e.get('worker')} (generation {e.get('generation')})"
    alive = {}
    for pid, role in found.items():
        st = _stat(pid)
        if st is not None and st[0] not in ("Z", "X") and _descends(pid, agent_pid):
            alive[pid] = role
    return alive


# ------------------------------------------------------------------ runs
def _redone(out: Path) -> int:
    """Steps some rank completed more than once (the most of any rank)."""
    try:
        lines = (out / "trace.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    per_rank: dict[int, Counter[int]] = {}
    for line in lines:
        try:
            e = json.loads(line)
        except json.JSONDecodeError:
            continue
        per_rank.setdefault(int(e["rank"]), Counter())[int(e["step"])] += 1
    return max((sum(n - 1 for n in c.values()) for c in per_rank.values()), default=0)


def _final(out: Path) -> dict[str, Any] | None:
    try:
        return json.loads((out / "final.json").read_text())
    except (OSError, ValueError):
        return None


def run_once(trial: Path, args: argparse.Namespace, *, spares: int, interval: tuple[float, float] | None, seed: int,
             timeout_s: float) -> dict[str, Any]:
    trial.mkdir(parents=True)
    cmd = command(trial, args, spares)
    rng = random.Random(f"soak:{seed}:{interval}")
    faults: list[dict[str, Any]] = []
    t0 = time.monotonic()
    with open(trial / "agent.log", "wb") as agent_log:
        proc = subprocess.Popen(cmd, stdout=agent_log, stderr=subprocess.STDOUT, start_new_session=True)
        next_at = None if interval is None else rng.uniform(*interval)
        why = None
        while proc.poll() is None:
            now = time.monotonic() - t0
            if now > timeout_s:
                why = f"gave up after {timeout_s:.0f} s (10x the reference)"
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                break
            if next_at is not None and now >= next_at:
                live = targets(trial / "run", proc.pid)
                if live:
                    pid = rng.choice(sorted(live))
                    name = rng.choice(sorted(SIGNALS))
                    try:
                        os.kill(pid, SIGNALS[name])
                        faults.append({"t_s": round(now, 3), "pid": pid, "target": live[pid], "signal": name})
                    except ProcessLookupError:
                        pass  # it ended as we chose it: draw the next fault on schedule
                assert interval is not None
                next_at = now + rng.uniform(*interval)
            time.sleep(0.05)
    wall = time.monotonic() - t0
    events = read_events(trial / "run" / "events.jsonl")
    finished = [e for e in events if e.get("kind") == "agent_finished"]
    kinds = Counter(e.get("kind") for e in events)
    return {"exit": proc.returncode, "wall_s": round(wall, 2), "why": why, "faults": faults,
            "restarts": kinds.get("restart", 0), "recovered_in_process": kinds.get("recovered_in_process", 0),
            "incidents": kinds.get("incident", 0), "redone": _redone(trial / "out"), "final": _final(trial / "out"),
            "verdict": finished[-1].get("verdict") if finished else None,
            "reason": finished[-1].get("reason") if finished else None,
            "log_tail": (trial / "agent.log").read_text(errors="replace")[-1500:] if proc.returncode else ""}


def same(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    keys = ("step", "samples", "params", "optimizer")
    return a is not None and b is not None and all(a.get(k) == b.get(k) for k in keys)


# ------------------------------------------------------------------ report
def summarize(res: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for s in res["soaks"]:
        key = s["config"]
        row = out.setdefault(key, {"trials": 0, "finished": 0, "bitwise": 0, "faults": 0, "wall_ratios": []})
        row["trials"] += 1
        row["finished"] += s["exit"] == 0
        row["bitwise"] += s["bitwise"]
        row["faults"] += len(s["faults"])
        if s["exit"] == 0:
            row["wall_ratios"].append(round(s["wall_s"] / s["reference_wall_s"], 3))
    return out


def verdicts(res: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, row in res["summary"].items():
        ok = row["finished"] == row["trials"] and row["bitwise"] == row["trials"]
        target = key.startswith("4-9 s")
        out[key] = {"verdict": ("PASS" if ok else "MISS") if target else "info",
                    "text": f"{key}: {row['finished']}/{row['trials']} finished, {row['bitwise']}/{row['trials']} "
                            f"bitwise the reference, {row['faults']} faults sent"
                            + (f", wall {min(row['wall_ratios']):.2f}-{max(row['wall_ratios']):.2f}x the reference"
                               if row["wall_ratios"] else "")
                            + (" (target: every soak finishes, bitwise)" if target else " (reported either way)")}
    return out


def render(res: dict[str, Any]) -> str:
    env, cfg = res["environment"], res["config"]
    lines = ["# Fault soak: random signals to any worker or spare", "",
             (f"Workload: `python -m resilient.chaos.workload`, 2 ranks, {cfg['steps']} steps of "
              f"{cfg['step_sleep'] * 1e3:.0f} ms padding, a checkpoint every {cfg['every']} steps; signals "
              f"{', '.join(cfg['signals'])} to a live worker or spare drawn from the seed.  "),
             f"Host: {env['cpus']} CPUs, kernel {env['kernel']}, torch {env['torch']}, python {env['python']}.  ",
             f"Load at start: {env['load_start']}; at end: {env['load_end']}.  ",
             f"Code: `{env['git_head']}` (commit `{env['commit']}`){' with uncommitted changes' if env['dirty'] else ''}.  ",
             f"Command: `{env['invocation']}`; total {env['total_s']:.0f} s.", "",
             "## Targets", "", "| soak | verdict | result |", "| --- | --- | --- |"]
    for key, v in res["verdicts"].items():
        lines.append(f"| {key} | **{v['verdict']}** | {v['text']} |")
    lines += ["", "## Soaks", "",
              "| soak | seed | exit | wall | / reference | bitwise | faults | restarts | in process | re-done | verdict |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for s in res["soaks"]:
        lines.append(f"| {s['config']} | {s['seed']} | {s['exit']} | {s['wall_s']:.1f} s | "
                     f"{s['wall_s'] / s['reference_wall_s']:.2f}x | {'yes' if s['bitwise'] else '**no**'} | "
                     f"{len(s['faults'])} | {s['restarts']} | {s['recovered_in_process']} | {s['redone']} | "
                     f"{s['verdict'] or '-'}{': ' + s['reason'] if s['exit'] and s['reason'] else ''}"
                     f"{' ' + s['why'] if s['why'] else ''} |")
    lines += ["", "## Faults sent", ""]
    for s in res["soaks"]:
        sent = "; ".join(f"{f['t_s']:.1f} s SIG{f['signal']} {f['target']}" for f in s["faults"]) or "none"
        lines.append(f"- {s['config']}, seed {s['seed']}: {sent}")
    lines += ["", "References (no fault, no spare): " + ", ".join(
        f"seed {r['seed']} {r['wall_s']:.1f} s" for r in res["references"]), "",
              "Commands:", "", f"- reference: `{env['commands']['reference']}`",
              f"- soak: `{env['commands']['soak']}`, signals sent from outside as described above"]
    return "\n".join(lines) + "\n"


def _interval(text: str) -> tuple[float, float]:
    try:
        lo, hi = (float(x) for x in text.split("-"))
    except ValueError:
        raise SystemExit(f"--intervals: {text!r} is not LO-HI seconds (for instance 4-9)") from None
    if not 0 < lo <= hi:
        raise SystemExit(f"--intervals: {text!r}: need 0 < LO <= HI")
    return lo, hi


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--intervals", default="4-9,2-5", help="comma-separated LO-HI seconds between faults")
    ap.add_argument("--seeds", default="1,2", help="comma-separated seeds (one soak per seed and interval)")
    ap.add_argument("--spares", type=int, default=1)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--step-sleep", type=float, default=0.05)
    ap.add_argument("--dir", default="/var/tmp", help="parent of the scratch dir")
    ap.add_argument("--out-dir", default=str(HERE / "results"))
    args = ap.parse_args(argv)
    intervals = [_interval(x) for x in args.intervals.split(",")]
    seeds = [int(x) for x in args.seeds.split(",")]

    root = Path(tempfile.mkdtemp(prefix="soak_bench_", dir=args.dir))
    t0 = time.time()
    res: dict[str, Any] = {
        "config": {"steps": args.steps, "every": args.every, "step_sleep": args.step_sleep, "spares": args.spares,
                   "intervals": intervals, "seeds": seeds, "signals": sorted(SIGNALS)},
        "environment": {**_provenance.host(sys.argv),
                        "commands": {"reference": shlex.join(command(Path("<trial>"), args, 0)),
                                     "soak": shlex.join(command(Path("<trial>"), args, args.spares))}},
        "references": [], "soaks": []}  # fmt: skip
    try:
        for seed in seeds:
            ref = run_once(root / f"ref_{seed}", args, spares=0, interval=None, seed=seed, timeout_s=600)
            if ref["exit"] != 0 or ref["final"] is None:
                raise SystemExit(f"the reference run failed (exit {ref['exit']}):\n{ref['log_tail']}")
            res["references"].append({"seed": seed, **ref})
            log(f"reference seed {seed}: {ref['wall_s']:.1f} s")
            for lo, hi in intervals:
                key = f"{lo:g}-{hi:g} s, {args.spares} spare(s)"
                s = run_once(root / f"soak_{lo:g}_{hi:g}_{seed}", args, spares=args.spares, interval=(lo, hi),
                             seed=seed, timeout_s=TIMEOUT_FACTOR * ref["wall_s"])
                s |= {"config": key, "seed": seed, "reference_wall_s": ref["wall_s"],
                      "bitwise": same(s["final"], ref["final"])}
                res["soaks"].append(s)
                log(f"{key} seed {seed}: exit {s['exit']}, wall {s['wall_s']:.1f} s "
                    f"({s['wall_s'] / ref['wall_s']:.2f}x), bitwise {s['bitwise']}, {len(s['faults'])} faults, "
                    f"{s['restarts']} restarts, {s['recovered_in_process']} in process, verdict {s['verdict']}")
    finally:
        res["environment"] |= {"load_end": _provenance.load_now(), "total_s": time.time() - t0}
        if res["soaks"]:
            res["summary"] = summarize(res)
            res["verdicts"] = verdicts(res)
            base = _provenance.write_results(args.out_dir, "soak_bench", res, render)
            log(f"wrote {base}.json and .md")
        shutil.rmtree(root, ignore_errors=True)
    for v in res.get("verdicts", {}).values():
        print(f"{v['verdict']}  {v['text']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
