"""One GPT training script, one crash, three ways to recover it; then a NaN incident bundled and replayed.

    python examples/recovery_demo.py                     # about 3 minutes on 2 CPU cores

It runs ``examples/train_gpt.py`` (2 gloo ranks, DDP, CPU; the step under
``run.attempt()``) for N steps:

  (0) uninterrupted, under ``resilient run``: the run every other one must equal;
  (1) under ``torchrun --max-restarts 1``, rank 1 SIGKILLing itself at the top
      of step S: torchrun restarts both ranks, which restore the newest commit;
  (2) under ``resilient run``, the same crash: the agent restarts both ranks,
      which restore the node's memory tier (a step or so back) or the commit;
  (3) under ``resilient run --spares 1``, the same crash: a warm spare takes
      rank 1's place in process, rank 0 never stops, nothing is trained again.

It prints one table (recovery seconds, steps re-done, goodput, and whether the
final model equals the uninterrupted one, bitwise) and one picture of the four
launches on a common time axis; demo_analysis.py says how each is measured.
Then it trains the same script with one poisoned sample (every target masked,
so its loss is NaN on every read): the run stops with exit 79, and the demo
lists the incident, bundles it, and replays the bundle in another directory,
where the same error comes back at the same step on the same samples.

Exit 0 when every recovered run matches and the replay reproduced, 1 on a
MISMATCH or a failed replay, 2 when a launch did not behave as expected.
Arguments after ``--`` go to train_gpt.py.  Files: ``--workdir`` (runs/demo),
with ``summary.json`` holding the table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from demo_analysis import LEGEND, Cost, Trace, compare, measure, timelines

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.join(HERE, "train_gpt.py")
NPROC = 2
CRASH_RANK = 1
EXIT_UNRECOVERABLE = 79  # a step whose gradients are not finite on every try
# torchrun (torch 2.13) hands its restarted gloo workers the previous attempt's addresses unless its shared
# rendezvous store is turned off; with it, its restart fails (benchmarks/results/recovery_bench_classic.md).
TORCHRUN_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
MODES = {  # name -> (table label, launcher arguments before the script)
    "torchrun": ("torchrun, restart", ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={NPROC}",
                                       "--max-restarts=1"]),
    "restart": ("resilient run, restart", ["-m", "resilient", "run", f"--nproc-per-node={NPROC}"]),
    "spare": ("resilient run --spares 1", ["-m", "resilient", "run", f"--nproc-per-node={NPROC}", "--spares=1"]),
}


def launch(label: str, cmd: list[str], timeout_s: float, env: dict[str, str] | None = None
           ) -> tuple[int, float, float, str]:
    """Run ``cmd``, streaming its output prefixed by ``label``; (exit code, wall-clock start, end, output)."""
    shown = " ".join(os.path.relpath(c) if c.startswith(HERE) else c for c in cmd)
    print(f"\n=== {label}: {shown}", flush=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **(env or {}))
    started = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    lines: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            print(f"  [{label}] {line}", end="", flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=timeout_s)
    except KeyboardInterrupt:  # the launch runs in its own session: Ctrl-C does not reach it by itself
        _kill_group(proc)
        raise
    except subprocess.TimeoutExpired:
        print(f"  [{label}] timed out after {timeout_s:.0f}s; killing the launch", flush=True)
        _kill_group(proc)
        rc = proc.wait(timeout=30) or 124
    ended = time.time()
    reader.join(timeout=10)
    print(f"=== {label}: exit code {rc} after {ended - started:.1f}s", flush=True)
    return rc, started, ended, "".join(lines)


def _kill_group(proc: subprocess.Popen[str]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class DemoFailed(Exception):
    """A launch did not behave as the demo expects (exit 2)."""


def train_cmd(launcher: list[str], folder: str, train_args: list[str], args: argparse.Namespace) -> list[str]:
    memory = [] if args.memory_every is None else [f"--memory-every={args.memory_every}"]
    agent = ["--run-dir", os.path.join(folder, "run"), *memory] if "resilient" in launcher else []
    return [sys.executable, *launcher, *agent, TRAIN, *train_args,
            "--ckpt-dir", os.path.join(folder, "ckpt"), "--trace", os.path.join(folder, "trace.jsonl")]


def ledger_goodput(run_dir: str) -> float | None:
    """The agent's own goodput for the run (its ledger, `resilient report goodput`), or None."""
    done = subprocess.run([sys.executable, "-m", "resilient", "report", "goodput", run_dir, "--no-png"],
                          capture_output=True, text=True, timeout=120, check=False)
    path = os.path.join(run_dir, "goodput.json")
    if done.returncode != 0 or not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        nodes = json.load(f).get("nodes") or {}
    ratios = [account["goodput_ratio"] for account in nodes.values()]
    return min(ratios) if ratios else None


def run_modes(args: argparse.Namespace, extra: list[str]) -> tuple[list[dict[str, Any]], bool]:
    """The uninterrupted run, then each mode with the crash; the table's rows and whether all matched."""
    common = ["--steps", str(args.steps), "--every", str(args.every), "--seed", str(args.seed),
              "--log-every", str(args.log_every), *extra]
    folder = os.path.join(args.workdir, "uninterrupted")
    rc, t0, t1, _ = launch("uninterrupted", train_cmd(MODES["restart"][1], folder, common, args), args.timeout)
    if rc != 0:
        raise DemoFailed(f"the uninterrupted run exited with {rc}")
    reference = Trace(os.path.join(folder, "trace.jsonl"))
    rows: list[dict[str, Any]] = []
    timeline: list[tuple[str, float, Cost]] = []
    crash = ["--crash-at-step", str(args.crash_at), "--crash-rank", str(CRASH_RANK)]
    for mode in args.modes:
        label, launcher = MODES[mode]
        folder = os.path.join(args.workdir, mode)
        env = TORCHRUN_ENV if mode == "torchrun" else None
        rc, s0, s1, _ = launch(label, train_cmd(launcher, folder, [*common, *crash], args), args.timeout, env)
        if rc != 0:
            raise DemoFailed(f"{label}: the crashed run did not recover: exit code {rc}")
        trace = Trace(os.path.join(folder, "trace.jsonl"))
        if trace.crash is None:
            raise DemoFailed(f"{label}: the planned crash at step {args.crash_at} did not happen")
        cost = measure(trace, s0, s1)
        problems, compared = compare(reference, trace, args.steps, NPROC)
        ledger = ledger_goodput(os.path.join(folder, "run")) if mode != "torchrun" else None
        rows.append({"mode": mode, "label": label, "recovery_s": cost.recovery_s, "redone": cost.redone,
                     "redone_s": cost.redone_s, "goodput": cost.goodput, "ledger_goodput": ledger,
                     "wall_s": cost.wall_s, "resumed_at": cost.resumed_at, "compared": compared,
                     "verdict": "MATCH" if not problems else "MISMATCH", "problems": problems})
        timeline.append((label, s0, cost))
    base = measure(reference, t0, t1)
    rows.append({"mode": "uninterrupted", "label": "uninterrupted", "recovery_s": None, "redone": 0,
                 "redone_s": 0.0, "goodput": base.goodput, "wall_s": base.wall_s, "verdict": "-",
                 "ledger_goodput": ledger_goodput(os.path.join(args.workdir, "uninterrupted", "run"))})
    timeline.append(("uninterrupted", t0, base))
    print_table(rows, args)
    print("\n" + "\n".join(timelines(timeline)))
    print(f"  {LEGEND}", flush=True)
    return rows, all(r["verdict"] in ("MATCH", "-") for r in rows)


def print_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    w = max(len(r["label"]) for r in rows)
    head = f"{'':{w}}  {'recovery':>9}  {'steps re-done':>13}  {'goodput':>7}  {'(ledger)':>8}  final model"
    print("\n" + "=" * len(head) + f"\n{NPROC} ranks, {args.steps} steps, rank {CRASH_RANK} SIGKILLed at the top "
          f"of step {args.crash_at}\n" + "-" * len(head) + "\n" + head)
    for r in rows:
        rec = "-" if r["recovery_s"] is None else f"{r['recovery_s']:.2f} s"
        redone = f"{r['redone']} ({r['redone_s']:.1f} s)" if r["redone"] else "0"
        ledger = "-" if r.get("ledger_goodput") is None else f"{100 * r['ledger_goodput']:.0f}%"
        verdict = "(the reference)" if r["verdict"] == "-" else \
            f"{r['verdict']} ({r['compared']} records and the final digests)"
        print(f"{r['label']:{w}}  {rec:>9}  {redone:>13}  {100 * r['goodput']:6.0f}%  {ledger:>8}  {verdict}")
        for problem in r.get("problems", [])[:10]:
            print(f"{'':{w}}    ! {problem}")
    print("-" * len(head))
    print("recovery: crash -> end of the next new step.  goodput: seconds of the steps the final model keeps over\n"
          "the launch's wall time, the same yardstick for all.  (ledger): the agent's own account\n"
          "(`resilient report goodput`), over the time it saw, which starts after the launcher's own start-up.")
    if any(r["mode"] == "torchrun" for r in rows):
        print("torchrun ran with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: without it, its restarted gloo ranks fail "
              "to connect.")
    print("=" * len(head), flush=True)


def nan_incident(args: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    """A run with one poisoned sample stops with exit 79; list, bundle and replay its incident."""
    reference = Trace(os.path.join(args.workdir, "uninterrupted", "trace.jsonl"))
    step = args.nan_at
    sample = reference.launches[0]["steps"][(CRASH_RANK, step)]["indices"][0]
    folder = os.path.join(args.workdir, "nan")
    train = ["--steps", str(args.steps), "--every", str(args.every), "--seed", str(args.seed),
             "--log-every", str(args.log_every), "--poison-sample", str(sample), *extra]
    print(f"\n>>> a poisoned sample: dataset window {sample}, read by rank {CRASH_RANK} at step {step}, has every "
          f"target masked (its loss is 0/0)", flush=True)
    rc, _, _, _ = launch("NaN", train_cmd(MODES["restart"][1], folder, train, args), args.timeout)
    if rc != EXIT_UNRECOVERABLE:
        raise DemoFailed(f"the poisoned run exited with {rc}, not {EXIT_UNRECOVERABLE}")
    run_dir = os.path.join(folder, "run")
    cli = [sys.executable, "-m", "resilient", "incident"]
    listed = subprocess.run([*cli, "ls", run_dir, "--json"], capture_output=True, text=True, timeout=60, check=True)
    # The run's one failure; a loaded machine may also have left a straggler incident beside it.
    records = [r for r in json.loads(listed.stdout) if r.get("kind") == "exit"]
    if len(records) != 1:
        raise DemoFailed(f"the poisoned run left {len(records)} failure incidents, expected 1")
    incident = records[0]["id"]
    bundle = os.path.abspath(os.path.join(args.workdir, f"{incident}.tar.gz"))
    replay_dir = os.path.abspath(os.path.join(args.workdir, "replay"))
    shutil.rmtree(replay_dir, ignore_errors=True)
    for verb in (["ls", run_dir], ["bundle", run_dir, incident, "--out", bundle]):
        show(subprocess.run([*cli, *verb], capture_output=True, text=True, timeout=300, check=False), verb)
    # --yes: the bundle was made a moment ago from this demo's own script (a replay prints what it would run and
    # runs nothing without it).
    replayed = subprocess.run([*cli, "replay", bundle, "--workdir", replay_dir, "--yes"], capture_output=True,
                              text=True, timeout=args.timeout, check=False, cwd=args.workdir)
    show(replayed, ["replay", bundle, "--workdir", replay_dir, "--yes"])
    return {"sample": sample, "step": step, "incident": incident, "bundle": bundle,
            "replay_exit": replayed.returncode, "reproduced": replayed.returncode == 0}


def show(done: subprocess.CompletedProcess[str], verb: list[str]) -> None:
    print(f"\n$ resilient incident {' '.join(verb)}", flush=True)
    text = (done.stdout + done.stderr).rstrip()
    if verb[0] == "ls":  # piped, `ls` prints whole lines; cut them as on a terminal
        width = max(100, shutil.get_terminal_size((160, 24)).columns)
        text = "\n".join(line if len(line) <= width else line[:width - 3] + "..." for line in text.splitlines())
    print(text, flush=True)
    if done.returncode not in (0, 1):
        raise DemoFailed(f"resilient incident {verb[0]} exited with {done.returncode}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Arguments after -- are passed to train_gpt.py (e.g. -- --d-model 64).")
    p.add_argument("--steps", type=int, default=300, help="training steps N")
    p.add_argument("--every", type=int, default=50, help="checkpoint cadence")
    p.add_argument("--crash-at", type=int, default=170, help="rank 1 SIGKILLs itself at the top of this step")
    p.add_argument("--nan-at", type=int, default=120, help="the step that reads the poisoned sample")
    p.add_argument("--modes", default="torchrun,restart,spare",
                   help=f"which crashed runs, in order, comma-separated, of {', '.join(MODES)}")
    p.add_argument("--no-incident", action="store_true", help="skip the NaN incident")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--log-every", type=int, default=100, help="train_gpt.py's progress lines")
    p.add_argument("--workdir", default=os.path.join("runs", "demo"), help="where everything goes (wiped first)")
    p.add_argument("--timeout", type=float, default=600.0, help="longest wait for one launch, in seconds")
    p.add_argument("--memory-every", type=int, default=None, metavar="N",
                   help="`resilient run`'s memory tier saves every N steps (default: the agent chooses from its cost)")
    args = p.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in args.modes if m not in MODES]
    if unknown or not args.modes:
        p.error(f"--modes: unknown {unknown or 'empty'}; choose from {', '.join(MODES)}")
    if not args.every < args.crash_at < args.steps:
        p.error(f"need --every < --crash-at < --steps, so that a commit exists before the crash "
                f"(got every={args.every} crash-at={args.crash_at} steps={args.steps})")
    if not args.no_incident and not args.every <= args.nan_at < args.steps:
        p.error(f"need --every <= --nan-at < --steps, so that the incident has a commit to bundle "
                f"(got every={args.every} nan-at={args.nan_at} steps={args.steps})")
    started = time.monotonic()
    shutil.rmtree(args.workdir, ignore_errors=True)
    os.makedirs(args.workdir)
    summary: dict[str, Any] = {"steps": args.steps, "crash_at": args.crash_at, "nproc": NPROC}
    try:
        summary["rows"], matched = run_modes(args, extra)
        summary["incident"] = None if args.no_incident else nan_incident(args, extra)
    except DemoFailed as e:
        print(f"\nDEMO FAILED: {e}", flush=True)
        return 2
    reproduced = summary["incident"] is None or summary["incident"]["reproduced"]
    summary["seconds"] = time.monotonic() - started
    with open(os.path.join(args.workdir, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
    verdicts = ", ".join(f"{r['label']}: {r['verdict']}" for r in summary["rows"] if r["verdict"] != "-")
    replay = "" if summary["incident"] is None else \
        f"; the incident {'reproduced' if reproduced else 'did NOT reproduce'} on replay"
    print(f"\nverdict: {verdicts}{replay}  (demo took {summary['seconds']:.0f}s; files in {args.workdir})",
          flush=True)
    return 0 if matched and reproduced else 1


if __name__ == "__main__":
    sys.exit(main())
