#!/usr/bin/env python
"""The per-step tax of each integration: one GPT loop with and without the Run, in the same run.

    python benchmarks/step_tax_bench.py                     # both sizes, 3 rounds (about 10 minutes on 2 cores)
    python benchmarks/step_tax_bench.py --sizes small --rounds 5

Each run is ``benchmarks/_tax_gpt.py`` on two gloo ranks under ``resilient run --nproc-per-node 2`` with its
defaults (the memory tier on at its measured cadence, heartbeats, the step timer, the non-finite check, the
replica audit), alternating blocks of iterations (25 of the small model, 5 of the larger) of the loop as a script
has it without resilient and of the same loop through an integration: ``five`` (the README's five lines around
it) or ``attempt`` (``Run(ddp=True)``, the body under ``run.attempt()``); the integration commits a durable
checkpoint every 500 steps (the 10 M model: every 50).  The blocks share the machine's moment, which a comparison
of separate runs does not: this machine's speed drifts by 10% and more from one minute to the next.  A run's tax
is rank 0's median seconds per iteration of the integration over the plain loop's (the first tenth of each kind
left out: warm-up); the figure, the median over the rounds.
Results: ``benchmarks/results/step_tax_bench.{json,md}`` with the commit, the command and the load.
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
SCRIPT = HERE / "_tax_gpt.py"
MODES = ("plain", "five", "attempt")
ITERS = {"small": 1000, "10m": 100}
"""Iterations of each kind (plain, through the integration) per run."""
EVERY = {"small": 500, "10m": 50}
BLOCK = {"small": 25, "10m": 5}
"""Iterations per block: about a quarter of a second and a second."""
"""Steps between the integration's durable checkpoints: about every 5 s and 10 s of training."""
TARGETS = {"five": 1.05, "attempt": 1.10}
"""The tax each integration may cost at most (the issue's targets): its median seconds per step over plain's."""


def run_mode(workdir: Path, mode: str, size: str, iters: int, timeout_s: float) -> dict[str, Any]:
    """One run of ``mode`` under the agent: rank 0's median seconds per iteration, plain and through ``mode``."""
    out = workdir / f"{mode}.json"
    # The plain blocks send the agent no heartbeat: a fixed step timeout keeps one from looking like a hang.
    cmd = [sys.executable, "-m", "resilient", "run", "--run-dir", str(workdir / "run"), "--nproc-per-node", "2",
           "--section-timeout", "step=120", "--quiet", str(SCRIPT), "--block", str(BLOCK[size]), "--mode", mode, "--size", size, "--iters", str(iters),
           "--every", str(EVERY[size]), "--ckpt", str(workdir / "ckpt"), "--out", str(out)]
    started = time.time()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False, cwd=workdir)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"{mode} ({size}) exited {done.returncode}:\n{done.stderr[-3000:]}")
    found = json.loads(out.read_text())
    medians = {kind: statistics.median(t[len(t) // 10:]) for kind, t in found["times"].items()}
    return {"plain_s": medians["plain"], "mode_s": medians[mode], "ratio": medians[mode] / medians["plain"],
            "iterations": {kind: len(t) for kind, t in found["times"].items()}, "params": found["params"],
            "wall_s": time.time() - started}


def measure(size: str, rounds: int, timeout_s: float) -> dict[str, Any]:
    per_round: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="step_tax_bench.") as scratch:
        for r in range(rounds):
            got = {}
            for mode in (MODES[1:] if r % 2 == 0 else MODES[:0:-1]):
                workdir = Path(scratch) / f"{size}-{r}-{mode}"
                workdir.mkdir()
                got[mode] = run_mode(workdir, mode, size, ITERS[size], timeout_s)
                print(f"{size} round {r + 1}/{rounds} {mode}: {got[mode]['mode_s'] * 1e3:.2f} ms per step against "
                      f"{got[mode]['plain_s'] * 1e3:.2f} ms plain: {got[mode]['ratio']:.3f}x", flush=True)
            per_round.append(got)
    ratios = {m: [rd[m]["ratio"] for rd in per_round] for m in MODES[1:]}
    return {
        "size": size, "params": per_round[0]["five"]["params"], "iterations": ITERS[size], "rounds": per_round,
        "ms_per_step": {m: {"mode": statistics.median(rd[m]["mode_s"] * 1e3 for rd in per_round),
                            "plain": statistics.median(rd[m]["plain_s"] * 1e3 for rd in per_round)}
                        for m in MODES[1:]},
        "tax": {m: {"median": statistics.median(v), "values": v, "target": TARGETS[m],
                    "met": statistics.median(v) <= TARGETS[m]} for m, v in ratios.items()},
    }


def render(res: dict[str, Any]) -> str:
    env = res["environment"]
    lines = [
        "# The per-step tax of each integration",
        "",
        (f"Command: `{env['invocation']}`; commit {env['commit']}; {env['cpus']} CPUs, torch {env['torch']}; load "
         f"average at start {env['load_start']['loadavg']}, at end {env['loadavg_end']}; {env['total_s']:.0f} s "
         "in all."),
        "",
        "Two gloo ranks under `resilient run` with its defaults (the memory tier at its measured cadence, "
        "heartbeats, the step timer, the non-finite check, the replica audit); the integration commits a durable "
        "checkpoint every 500 steps (the 10 M model: every 50).  Each run alternates blocks of iterations (25 of "
        "the small model, 5 of the larger) of the loop without the Run and "
        "through the integration; its tax is rank 0's median seconds per iteration through the integration over "
        "the plain loop's in the same run, and the figure the median over the rounds.",
        "",
        "| model | five lines: ms per step (plain) | five-line tax (target <= 1.05x) | `run.attempt()`: ms per step "
        "(plain) | attempt tax (target <= 1.10x) |",
        "|---|---|---|---|---|",
    ]
    for m in res["sizes"]:
        ms, tax = m["ms_per_step"], m["tax"]

        def ratio(mode: str) -> str:
            values = ", ".join(f"{v:.3f}" for v in tax[mode]["values"])
            return f"**{tax[mode]['median']:.3f}x** ({values}) {'met' if tax[mode]['met'] else 'NOT met'}"

        lines.append(f"| {m['params'] / 1e6:.2f} M parameters, {m['iterations']} iterations of each kind | "
                     f"{ms['five']['mode']:.2f} ({ms['five']['plain']:.2f}) | {ratio('five')} | "
                     f"{ms['attempt']['mode']:.2f} ({ms['attempt']['plain']:.2f}) | {ratio('attempt')} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="small,10m", help="model sizes, comma-separated (small: ~0.1 M, 10m: ~10 M)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out-dir", default=str(HERE / "results"))
    p.add_argument("--timeout", type=float, default=900.0, help="longest one run may take, in seconds")
    args = p.parse_args()
    t0 = time.time()
    res: dict[str, Any] = {"environment": host(sys.argv),
                           "sizes": [measure(size, args.rounds, args.timeout) for size in args.sizes.split(",")]}
    res["environment"] |= {"loadavg_end": load_now()["loadavg"], "total_s": time.time() - t0}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "step_tax_bench.json").write_text(json.dumps(res, indent=1, default=str))
    (out / "step_tax_bench.md").write_text(render(res))
    print(render(res))
    return 0 if all(t["met"] for m in res["sizes"] for t in m["tax"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
