"""Kill a rank of a 2-rank training job mid-run and show the recovered run is the same run.

    python examples/resume_demo.py                       # ~1-2 minutes on 2 CPU cores

It launches ``examples/train_gpt.py`` under ``resilient run`` (the node
agent, embedded defaults: no external service; gloo + DDP, CPU):

  (a) a reference run of N steps, uninterrupted;
  (b) the same run in a fresh checkpoint directory, where rank 1 SIGKILLs
      itself at the top of step S: the agent records the incident (which
      rank, which signal, which section and step), stops rank 0, restarts
      both from the newest committed checkpoint, and the job finishes with
      exit code 0 (a restored run never crashes itself);
  (c) a comparison of the two traces: per step and rank, the learning rate,
      the loss and the sample indices, and the final digests of the model
      parameters and the optimizer state, which must be bitwise equal.

It prints the incident, an evidence table and the goodput report of the
crashed run (where its time went, and what the incident cost), and exits 0
on MATCH, 1 on MISMATCH, 2 when a launch did not behave as expected.  Arguments after
``--`` go to train_gpt.py.
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

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.join(HERE, "train_gpt.py")
NPROC = 2
CRASH_RANK = 1


def launch(label: str, run_dir: str, train_args: list[str], timeout_s: float,
           agent_args: list[str] | None = None) -> tuple[int, str]:
    """Run ``resilient run ... train_gpt.py`` streaming its output prefixed by ``label``; return (exit code, output)."""
    cmd = [
        sys.executable,
        "-m",
        "resilient",
        "run",
        f"--nproc-per-node={NPROC}",
        f"--run-dir={run_dir}",
        *(agent_args or []),
        TRAIN,
        *train_args,
    ]
    print(f"\n=== {label}: python {' '.join(os.path.relpath(c) if c == TRAIN else c for c in cmd[1:])}", flush=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    lines: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            print(f"  [{label}] {line}", end="", flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    started = time.monotonic()
    try:
        rc = proc.wait(timeout=timeout_s)
    except KeyboardInterrupt:  # the launch runs in its own session: Ctrl-C does not reach it by itself
        _kill_group(proc)
        raise
    except subprocess.TimeoutExpired:
        print(f"  [{label}] timed out after {timeout_s:.0f}s; killing the launch", flush=True)
        _kill_group(proc)
        rc = proc.wait(timeout=30)
        rc = rc if rc else 124
    reader.join(timeout=10)
    print(f"=== {label}: exit code {rc} after {time.monotonic() - started:.1f}s", flush=True)
    return rc, "".join(lines)


def _kill_group(proc: subprocess.Popen[str]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# ------------------------------------------------------------------- traces
class Trace:
    """A trace file split into launches: per launch, ``{(rank, step): record}`` and its start records."""

    def __init__(self, path: str) -> None:
        self.launches: list[dict[str, Any]] = []
        self.final: dict[str, Any] | None = None
        current: dict[int, dict[str, Any]] = {}  # rank -> launch it is in
        with open(path, encoding="utf-8") as f:
            for line in f:
                rec = json.loads(line)
                rank = rec["rank"]
                if rec["kind"] == "start":
                    # Ranks of one launch write their start lines before any step; a start line for a rank
                    # already in the newest launch opens the next launch.
                    if not self.launches or rank in self.launches[-1]["starts"]:
                        self.launches.append({"starts": {}, "steps": {}})
                    self.launches[-1]["starts"][rank] = rec
                    current[rank] = self.launches[-1]
                elif rec["kind"] == "step":
                    current[rank]["steps"][(rank, rec["step"])] = rec
                elif rec["kind"] == "final":
                    self.final = rec


FIELDS = ("lr", "loss", "indices")


def compare(ref: Trace, res: Trace, steps: int) -> tuple[list[str], int]:
    """Differences between the reference and the crashed+resumed traces; also the number of compared records."""
    problems: list[str] = []
    if len(ref.launches) != 1:
        problems.append(f"reference trace has {len(ref.launches)} launches, expected 1")
    expected = {(r, s) for r in range(NPROC) for s in range(steps)}
    reference = ref.launches[0]["steps"] if ref.launches else {}
    if set(reference) != expected:
        problems.append(f"reference trace misses {len(expected - set(reference))} (rank, step) records")
    covered: set[tuple[int, int]] = set()
    compared = 0
    for i, launch_ in enumerate(res.launches):
        for key, rec in sorted(launch_["steps"].items()):
            covered.add(key)
            want = reference.get(key)
            if want is None:
                problems.append(f"launch {i + 1}: rank {key[0]} step {key[1]} has no reference record")
                continue
            compared += 1
            for field in FIELDS:
                if rec[field] != want[field]:
                    problems.append(
                        f"launch {i + 1}: rank {key[0]} step {key[1]} {field}: "
                        f"{_short(rec[field])} != reference {_short(want[field])}"
                    )
    if covered != expected:
        problems.append(f"crashed+resumed traces miss {len(expected - covered)} (rank, step) records")
    for name in ("param_sha256", "optimizer_sha256"):
        a = ref.final.get(name) if ref.final else None
        b = res.final.get(name) if res.final else None
        if a is None or a != b:
            problems.append(f"final {name}: reference {a} != resumed {b}")
    return problems, compared


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def incident_summaries(run_dir: str) -> list[str]:
    """One line per incident the agent wrote: what failed, and what the agent decided."""
    found = []
    folder = os.path.join(run_dir, "incidents")
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            inc = json.load(f)
        decision = inc.get("decision") or {}
        found.append(f"{inc['id']}: {inc['summary']}")
        found.append(f"  decision: {decision.get('action')}: {decision.get('reason')}")
    return found


# --------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Arguments after -- are passed to train_gpt.py (e.g. -- --d-model 64).",
    )
    p.add_argument("--steps", type=int, default=300, help="training steps N")
    p.add_argument("--every", type=int, default=50, help="checkpoint cadence")
    p.add_argument("--crash-at", type=int, default=170, help="rank 1 SIGKILLs itself at the top of this step")
    p.add_argument("--keep", type=int, default=3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--workdir",
        default=os.path.join("runs", "demo"),
        help="where checkpoints and traces go (its ref/ and resumed/ are wiped first)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="longest wait for one launch, in seconds")
    p.add_argument("--memory-every", type=int, default=None, metavar="N",
                   help="the node's memory tier saves every N steps (default: the agent chooses from its cost)")
    args = p.parse_args(argv)
    if not args.every < args.crash_at < args.steps:
        p.error(
            f"need --every < --crash-at < --steps so that a checkpoint exists before the crash "
            f"(got every={args.every} crash-at={args.crash_at} steps={args.steps})"
        )

    started = time.monotonic()
    ref_dir, res_dir = os.path.join(args.workdir, "ref"), os.path.join(args.workdir, "resumed")
    for d in (ref_dir, res_dir):
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
    ref_ckpt, ref_trace = os.path.join(ref_dir, "ckpt"), os.path.join(ref_dir, "trace.jsonl")
    res_ckpt, res_trace = os.path.join(res_dir, "ckpt"), os.path.join(res_dir, "trace.jsonl")
    common = [
        "--steps",
        str(args.steps),
        "--every",
        str(args.every),
        "--keep",
        str(args.keep),
        "--seed",
        str(args.seed),
    ]
    crash = ["--crash-at-step", str(args.crash_at), "--crash-rank", str(CRASH_RANK)]
    res_cmd = [*common, "--ckpt-dir", res_ckpt, "--trace", res_trace, *crash, *extra]

    def fail(why: str) -> int:
        print(f"\nDEMO FAILED: {why}", flush=True)
        return 2

    ref_cmd = [*common, "--ckpt-dir", ref_ckpt, "--trace", ref_trace, *extra]
    agent_args = [] if args.memory_every is None else [f"--memory-every={args.memory_every}"]
    rc, _ = launch("reference", os.path.join(ref_dir, "run"), ref_cmd, args.timeout, agent_args)
    if rc != 0:
        return fail(f"the reference run exited with {rc}")

    res_run = os.path.join(res_dir, "run")
    rc, _ = launch("crash", res_run, res_cmd, args.timeout, agent_args)
    if rc != 0:
        return fail(f"the agent did not recover the crashed run: exit code {rc}")
    incidents = incident_summaries(res_run)
    print("\n>>> incidents recorded by the agent:" if incidents else "\n>>> no incident was recorded", flush=True)
    for line in incidents:
        print(f"    {line}", flush=True)
    if not incidents:
        return fail("the planned crash left no incident")

    ref, res = Trace(ref_trace), Trace(res_trace)
    problems, compared = compare(ref, res, args.steps)
    if len(res.launches) != 2:
        problems.append(f"crashed+resumed trace has {len(res.launches)} launches, expected 2")
    first, second = (res.launches + [{"starts": {}, "steps": {}}] * 2)[:2]
    restored_from = second["starts"].get(0, {}).get("restored_from")
    resume_step = second["starts"].get(0, {}).get("step")
    crashed_last = max((s for (r, s) in first["steps"] if r == CRASH_RANK), default=None)
    replayed = sorted({s for (_, s) in first["steps"]} & {s for (_, s) in second["steps"]})
    if restored_from is None:
        problems.append("the relaunch did not restore a checkpoint")

    def loss_of(t: Trace, step: int, launch_index: int = -1) -> str:
        rec = t.launches[launch_index]["steps"].get((0, step)) if t.launches else None
        return f"{rec['loss']:.6f}" if rec else "-"

    rows = [
        ("steps (N), ranks", f"{args.steps}, {NPROC}", f"{args.steps}, {NPROC}"),
        ("crash", "-", f"rank {CRASH_RANK} SIGKILL at top of step {args.crash_at} (last step done: {crashed_last})"),
        ("restored from", "-", f"{restored_from} (resumed at step {resume_step})"),
        ("steps replayed", "-", f"{len(replayed)}" + (f" (steps {replayed[0]}..{replayed[-1]})" if replayed else "")),
        (
            "records compared",
            f"{len(ref.launches[0]['steps']) if ref.launches else 0}",
            f"{compared} (lr, loss, sample indices per rank and step)",
        ),
        ("rank-0 loss, step 0", loss_of(ref, 0, 0), loss_of(res, 0, 0)),
        (f"rank-0 loss, step {resume_step}", loss_of(ref, resume_step or 0, 0), loss_of(res, resume_step or 0)),
        (f"rank-0 loss, step {args.steps - 1}", loss_of(ref, args.steps - 1, 0), loss_of(res, args.steps - 1)),
        (
            "param sha256",
            (ref.final or {}).get("param_sha256", "-")[:32],
            (res.final or {}).get("param_sha256", "-")[:32],
        ),
        (
            "optimizer sha256",
            (ref.final or {}).get("optimizer_sha256", "-")[:32],
            (res.final or {}).get("optimizer_sha256", "-")[:32],
        ),
    ]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows + [("", "reference", "")])
    print("\n" + "=" * 100)
    print(f"{'':{w0}}  {'reference':{w1}}  crashed + resumed")
    print("-" * 100)
    for name, a, b in rows:
        print(f"{name:{w0}}  {a:{w1}}  {b}")
    print("-" * 100)
    for problem in problems[:20]:
        print(f"  ! {problem}")
    if len(problems) > 20:
        print(f"  ! ... and {len(problems) - 20} more")
    verdict = "MATCH" if not problems else "MISMATCH"
    print(f"verdict: {verdict}  (demo took {time.monotonic() - started:.0f}s; files in {args.workdir})")
    print("=" * 100, flush=True)

    # Where the crashed run's time went, from the agent's goodput ledger.
    print(f"\n=== goodput of the crashed + recovered run: resilient report goodput {res_run}", flush=True)
    report = subprocess.run([sys.executable, "-m", "resilient", "report", "goodput", res_run],
                            capture_output=True, text=True, timeout=120, check=False)
    print(report.stdout + report.stderr, flush=True)
    if report.returncode != 0:
        return fail(f"the goodput report failed with exit code {report.returncode}")
    return 0 if verdict == "MATCH" else 1


if __name__ == "__main__":
    sys.exit(main())
