#!/usr/bin/env python
"""Recovery benchmark: one rank of two SIGKILLed at a fixed step, under five ways of recovering.

The workload of agent_bench.py (2 gloo ranks on CPU, ~45 ms steps, a checkpoint every 10 steps) in the
attempt style (_recovery_worker.py); rank 1 SIGKILLs itself at step 37 on the first attempt.  Modes,
interleaved in a rotating order, one trial at a time:

* ``spare``: ``resilient run --nproc-per-node 2 --spares 1``: a warm spare takes rank 1 in process (the
  doomed worker first waits for the agent's ``spare_ready`` event, so the fault meets a ready spare);
* ``shrink``: ``resilient run --nproc-per-node 1:2``: continue on one rank, global batch kept;
* ``restart``: ``resilient run --nproc-per-node 2``: the group restarts from the newest commit;
* ``torchrun``: ``torchrun --standalone --nproc-per-node 2 --max-restarts 1``, the same script;
* ``torchft``: torchft 0.2.0, two replica groups of one rank (_torchft_worker.py) and a lighthouse
  (``torchft_lighthouse --min_replicas 1``); replica 1 dies and replica 0 continues alone;
* ``torchrun_noshare`` (information, as in agent_bench.py): torchrun with
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, the workaround for its restarted gloo workers reading the
  previous attempt's addresses, so that there is a torchrun whose restarts succeed to compare with.

Per trial: kill -> next newly completed step, steps re-done, success; for the in-process modes where the
time went (_recovery_report.breakdown).  Every launch is bounded and killed as a process tree.  Results:
benchmarks/results/recovery_bench.{json,md}; benchmarks/README.md says what each line means.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
from _agent_report import where
from _recovery_report import INFO_MODES, MODES, breakdown, finished_all, measure, render_markdown, summarize, verdicts
from agent_bench import Launch, _cmd, find_py_spy, log, read_jsonl, save_results, snapshot

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CODE = REPO  # where the measured `resilient` package is imported from; main() points it at a snapshot
WORKER, FT_WORKER = HERE / "_recovery_worker.py", HERE / "_torchft_worker.py"
PY = sys.executable
LIGHTHOUSE = Path(PY).with_name("torchft_lighthouse")

STEPS, EVERY, STEP_MS, FAULT_STEP, FAULT_RANK = 60, 10, 45.0, 37, 1
TRIAL_TIMEOUT_S = 240.0  # a healthy trial takes ~15-40 s here
STALL_S = 60.0  # no trace line from any process for this long: the recovery is stuck
SPARE_WAIT_S = 60.0  # how long the doomed worker waits for a warm spare before the fault
MODE_ENV = {"torchrun_noshare": {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
            "torchrun_classic_noshare": {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}}
LAUNCHER = {
    "spare": ["--nproc-per-node", "2", "--spares", "1"],
    "shrink": ["--nproc-per-node", "1:2"],
    "restart": ["--nproc-per-node", "2"],
    "restart_classic": ["--nproc-per-node", "2"],
    "restart_all": ["--nproc-per-node", "2"],
    "restart_all_spares": ["--nproc-per-node", "2", "--spares", "1"],
}
# torchft: the lighthouse's defaults (printed by `torchft_lighthouse --help`) and train_ddp.py's timeouts
FT_LIGHTHOUSE = {"min_replicas": 1, "heartbeat_timeout_ms": 5000, "join_timeout_ms": 60000, "quorum_tick_ms": 100}
FT_WORKER_ARGS = {"pg-timeout-s": 5.0, "timeout-s": 30.0, "quorum-timeout-s": 60.0, "heartbeat-ms": 100.0}


class Proc(Launch):
    """One launched process (an agent, torchrun, a torchft lighthouse or replica) with its stamped output."""

    def __init__(self, cmd: list[str], trial_dir: Path, name: str, extra_env: dict[str, str] | None = None) -> None:
        self.name = name
        super().__init__(cmd, trial_dir, extra_env, code=CODE, log_name=f"{name}.log")

    def finish(self) -> list[int]:
        """SIGKILL the whole tree (whatever still runs); return the pids that were still running."""
        self.poll()
        left = [p.pid for p in self.known.values() if _running(p)]
        self.kill("trial over")
        self._reader.join(timeout=15)
        self.log.close()
        return left

    def tail(self, n: int = 60) -> list[str]:
        return [line for _, line in self.lines[-n:]]


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def stacks(procs: list[Proc]) -> dict[str, str]:
    """Where each live worker is (py-spy), keyed by pid: evidence for a stuck recovery."""
    py_spy, out = find_py_spy(), {}
    for p in (p for pr in procs for p in pr.known.values()):
        try:
            if not _running(p) or not any(a.endswith((WORKER.name, FT_WORKER.name)) for a in p.cmdline()[1:3]):
                continue
            run = subprocess.run([py_spy or "py-spy", "dump", "--pid", str(p.pid)], capture_output=True, text=True,
                                 timeout=30, check=False)  # fmt: skip
            out[str(p.pid)] = where(run.stdout + run.stderr)
        except (psutil.Error, OSError, subprocess.TimeoutExpired) as e:
            out[str(p.pid)] = f"no stack: {e}"
    return out


# ------------------------------------------------------------------ commands
def script(trial_dir: Path, mode: str, fault_at: str) -> list[str]:
    return [str(WORKER), "--trial-dir", str(trial_dir), "--steps", str(STEPS), "--every", str(EVERY), "--step-ms",
            str(STEP_MS), "--fault", "kill", "--fault-at", fault_at, "--fault-step", str(FAULT_STEP), "--fault-rank",
            "-1" if mode.startswith("restart_all") else str(FAULT_RANK),
            *(["--wait-spare", str(SPARE_WAIT_S)] if mode in ("spare", "restart_all_spares") else []),
            *(["--style", "classic"] if "classic" in mode else [])]  # fmt: skip


def command(mode: str, trial_dir: Path, fault_at: str) -> list[str]:
    if mode.startswith("torchrun"):
        return [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                *script(trial_dir, mode, fault_at)]  # fmt: skip
    return [PY, "-m", "resilient", "run", *LAUNCHER[mode], "--quiet", "--run-dir", str(trial_dir / "run"),
            *script(trial_dir, mode, fault_at)]  # fmt: skip


def ft_commands(trial_dir: Path, address: str) -> tuple[list[str], list[list[str]]]:
    lighthouse = [str(LIGHTHOUSE), "--bind", "127.0.0.1:0",
                  *(a for k, v in FT_LIGHTHOUSE.items() for a in (f"--{k}", str(v)))]  # fmt: skip
    replicas = [[PY, str(FT_WORKER), "--trial-dir", str(trial_dir), "--replica", str(r), "--lighthouse", address,
                 "--steps", str(STEPS), "--step-ms", str(STEP_MS), "--fault", "kill", "--fault-step", str(FAULT_STEP),
                 "--fault-replica", str(FAULT_RANK), *(a for k, v in FT_WORKER_ARGS.items() for a in (f"--{k}", str(v)))]
                for r in (0, 1)]  # fmt: skip
    return lighthouse, replicas


def shown(cmd: list[str]) -> str:
    names = {PY: "python", str(WORKER): f"benchmarks/{WORKER.name}", str(FT_WORKER): f"benchmarks/{FT_WORKER.name}",
             str(LIGHTHOUSE): "torchft_lighthouse"}  # fmt: skip
    return " ".join(names.get(a, a) for a in cmd)


# ------------------------------------------------------------------ trials
def watch(procs: list[Proc], d: Path, done: Any) -> str | None:
    """Poll until ``done()``; return why the benchmark gave up (timeout, or no trace line for STALL_S), or None."""
    start, size, changed = time.time(), -1, time.time()
    while not done():
        now = time.time()
        if (new := sum(p.stat().st_size for p in d.glob("trace.*.jsonl"))) != size:
            size, changed = new, now
        if now > changed + STALL_S:
            where_ = stacks(procs)
            return f"no trace line for {STALL_S:.0f} s; stuck in: " + "; ".join(f"pid {k}: {v}" for k, v in where_.items())
        if now > start + TRIAL_TIMEOUT_S:
            return f"timed out after {TRIAL_TIMEOUT_S:.0f} s"
        time.sleep(0.1)
    return None


def records(d: Path, prefix: str) -> list[dict[str, Any]]:
    return [r for p in sorted(d.glob(f"{prefix}.*.jsonl")) for r in read_jsonl(p)]


def trial(mode: str, idx: int, root: Path, fault_at: str) -> dict[str, Any]:
    d = root / f"{mode}_{idx:02d}"
    d.mkdir()
    res: dict[str, Any] = {"mode": mode, "trial": idx, "loadavg1": os.getloadavg()[0]}
    t0 = time.time()
    if mode == "torchft":
        procs, why = ft_launch(d)
        survivor = procs[1] if len(procs) > 1 else None
        if why is None and survivor is not None:
            why = watch(procs, d, lambda: all(p.poll() for p in procs[1:]))
        res["rc"] = survivor.rc if survivor is not None else None
        res["rcs"] = {p.name: p.rc for p in procs}
    else:
        procs = [Proc(command(mode, d, fault_at), d, "launcher", MODE_ENV.get(mode))]
        why = watch(procs, d, procs[0].poll)
        res["rc"] = procs[0].rc
    res["leftover_pids"] = {p.name: p.finish() for p in procs}
    res |= {"killed_by_bench": why, "wall_s": time.time() - t0}
    recs = records(d, "trace")
    kill = min((r for r in recs if r["ev"] == "kill"), key=lambda r: r["t"], default=None)  # the first of them
    if kill is None:
        res |= {"success": False, "why": why or f"exit {res['rc']} before the kill fired"}
    else:
        res["t_kill"] = kill["t"]
        m = measure(recs, kill["t"])
        res |= {k: v for k, v in m.items() if k != "t_new_abs"}
        if mode in ("spare", "shrink"):
            res["breakdown"] = breakdown(read_jsonl(d / "run" / "events.jsonl"), records(d, "events"), kill["t"],
                                         m["t_new_abs"])  # fmt: skip
        ok = why is None and res["rc"] == 0 and finished_all(m, STEPS) and m["t_first_new_step"] is not None
        res["success"] = ok
        if not ok:
            res["why"] = why or f"exit {res['rc']}; finished (rank, step) {m['finished']}; world after {m['world_after']}"
    if not res["success"]:
        res["evidence"] = {"output_tail": [ln for p in procs for ln in p.tail()]}
        if (d / "run").exists():
            res["evidence"]["agent_events_tail"] = [json.dumps(e)[:400] for e in read_jsonl(d / "run" / "events.jsonl")[-15:]]
    return res


def ft_launch(d: Path) -> tuple[list[Proc], str | None]:
    """Start the lighthouse, read its port from its first line, then the two replica groups."""
    lighthouse_cmd, _ = ft_commands(d, "")
    lh = Proc(lighthouse_cmd, d, "lighthouse")
    deadline = time.time() + 30
    while time.time() < deadline and not lh.poll():
        found = next((m for _, ln in list(lh.lines) if (m := re.search(r"listening on: http://[^:\s]+:(\d+)", ln))), None)
        if found:
            _, replicas = ft_commands(d, f"http://127.0.0.1:{found.group(1)}")
            return [lh, *(Proc(cmd, d, f"replica{r}") for r, cmd in enumerate(replicas))], None
        time.sleep(0.05)
    return [lh], f"the lighthouse printed no address within 30 s (exit {lh.rc})"


# ------------------------------------------------------------------ environment
def torchft_problem() -> str | None:
    """Why torchft cannot run here, or None."""
    if not LIGHTHOUSE.exists():
        return f"{LIGHTHOUSE} not found: pip install --no-deps torchft==0.2.0 (and its opentelemetry dependencies)"
    probe = subprocess.run([PY, "-c", "import torchft; print(torchft.__file__)"], capture_output=True, text=True,
                           timeout=120, check=False)  # fmt: skip
    return None if probe.returncode == 0 else f"import torchft failed: {probe.stderr.strip().splitlines()[-1:]}"


def environment(rev: str | None, ms: list[str], fault_at: str) -> dict[str, Any]:
    import torch

    with open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    ft_version = _cmd(PY, "-c", "import importlib.metadata as m; print(m.version('torchft'))") or None
    cmds = {m: " ".join([*(f"{k}={v}" for k, v in MODE_ENV.get(m, {}).items()), shown(command(m, Path("<trial>"),
                                                                                              fault_at))])
            for m in ms if m != "torchft"}  # fmt: skip
    if "torchft" in ms:
        lh, reps = ft_commands(Path("<trial>"), "http://127.0.0.1:<port>")
        cmds["torchft"] = f"{shown(lh)} & {shown(reps[0])} & (the same with --replica 1)"
    return {
        "cpus": os.cpu_count(), "cpu_model": cpu, "kernel": platform.release(), "python": platform.python_version(),
        "torch": torch.__version__, "torchft": ft_version, "code": str(CODE), "code_rev": rev,
        "git_head": _cmd("git", "log", "-1", "--format=%h %cs %s", rev or "HEAD"),
        "commit": rev or _cmd("git", "rev-parse", "HEAD"), "invocation": shlex.join([PY, *sys.argv]),
        "git_dirty_resilient": rev is None and bool(_cmd("git", "status", "--porcelain", "--", "resilient")),
        "loadavg_start": list(os.getloadavg()), "commands": cmds,
        "torchft_settings": {"lighthouse": FT_LIGHTHOUSE, "replica": FT_WORKER_ARGS},
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=20, help="trials per mode (default 20)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    ap.add_argument("--no-workaround-peer", action="store_true",
                    help="skip the informational torchrun_noshare mode (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)")
    ap.add_argument("--fault-at", choices=["top", "backward"], default="top",
                    help="where in step 37 rank 1 dies: at the top of its attempt, or inside its backward")
    ap.add_argument("--code", default="HEAD", metavar="REV", help="git revision of resilient/ to measure, exported "
                    "into the scratch dir (default HEAD); 'worktree': the tree as is")
    ap.add_argument("--dir", default="/var/tmp", help="parent of the scratch dir (default /var/tmp)")
    ap.add_argument("--out-dir", default=str(HERE / "results"))
    ap.add_argument("--render", metavar="JSON", help="only recompute the summary and verdicts of a results .json "
                    "and re-render the .md next to it")
    args = ap.parse_args(argv)
    if args.render:
        with open(args.render) as f:
            old = json.load(f)
        old["summary"] = summarize(old)
        old["verdicts"] = verdicts(old)
        with open(args.render, "w") as f:
            json.dump(old, f, indent=1, default=str)
        with open(os.path.splitext(args.render)[0] + ".md", "w") as out:
            out.write(render_markdown(old))
        return 0
    ms = [m.strip() for m in args.modes.split(",") if m.strip()]
    if args.no_workaround_peer:
        ms = [m for m in ms if m not in INFO_MODES]
    if bad := [m for m in ms if m not in MODES]:
        raise SystemExit(f"--modes: unknown {bad}; choose from {', '.join(MODES)}")
    res: dict[str, Any] = {}
    if "torchft" in ms and (problem := torchft_problem()) is not None:
        log(f"torchft left out: {problem}")
        res["torchft_unavailable"] = problem
        ms.remove("torchft")
    global CODE
    root = Path(tempfile.mkdtemp(prefix="recovery_bench_", dir=args.dir))
    rev = None if args.code == "worktree" else _cmd("git", "rev-parse", "--verify", args.code + "^{commit}")
    if args.code != "worktree" and not rev:
        raise SystemExit(f"--code {args.code}: not a git revision of {REPO}")
    CODE = snapshot(rev, root) if rev else REPO
    t0 = time.time()
    res |= {"config": {"trials": args.trials, "modes": ms, "steps": STEPS, "every": EVERY, "step_ms": STEP_MS,
                       "fault_step": FAULT_STEP, "fault_rank": FAULT_RANK, "fault_at": args.fault_at,
                       "spare_wait_s": SPARE_WAIT_S, "trial_timeout_s": TRIAL_TIMEOUT_S, "stall_s": STALL_S},
            "environment": environment(rev, ms, args.fault_at), "trials": []}  # fmt: skip
    log(f"scratch {root}; modes {ms}; {args.trials} trial(s) each")
    try:
        for i in range(args.trials):
            for mode in ms[i % len(ms):] + ms[:i % len(ms)]:
                r = trial(mode, i, root, args.fault_at)
                res["trials"].append(r)
                nxt = r.get("t_first_new_step")
                log(f"{mode:9s} #{i}: {'ok  ' if r['success'] else 'FAIL'} next new step "
                    f"{'-' if nxt is None else f'{nxt:.3f}s'}, re-done {r.get('steps_redone')}, "
                    f"world after {r.get('world_after')}, wall {r['wall_s']:.1f}s" + ("" if r["success"] else f": {r['why']}"))
                if r["success"]:
                    shutil.rmtree(root / f"{mode}_{i:02d}", ignore_errors=True)
    finally:
        save_results(res, root, t0, args.out_dir, "recovery_bench", summarize, verdicts, render_markdown)
    for k, v in res["verdicts"].items():
        print(f"{v['verdict']}  {k}: {v['text']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
