#!/usr/bin/env python
"""Agent benchmark: `resilient run` vs. `torchrun --max-restarts 1` on a killed and on a stopped rank.

Both launchers start the same script (_agent_worker.py: 2 gloo DDP ranks on CPU, ~45 ms steps, a
checkpoint every 10 steps through resilient.Run, which restores the newest committed one on start).

* kill trials (--trials per launcher, interleaved in a rotating order): rank 1 SIGKILLs
  itself at the top of step 37 on the first attempt.  Measured from the worker traces: time from the
  kill to the first step completed after the restart and to the first newly completed step, steps
  re-done, and whether the job then finished every step with exit 0 (restart success rate).  A third,
  informational peer is torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (workers get their own store
  instead of the agent's shared one: the workaround for the stale-address restart failure).
* stop trials (--stop-trials per configuration, interleaved): rank 1 SIGSTOPs itself at the top of step
  37.  Ours: time to the agent's `hang_detected` event, default (calibrated) timeouts and with
  `--section-timeout step=3`; the run then recovers and finishes.  torchrun: time to its first output
  line or exit after the stop, bounded at 90 s, after which the whole process tree is killed.

Every launch is bounded and killed as a process tree (the launchers put each worker in its own
session).  Results: benchmarks/results/agent_bench.{json,md}; benchmarks/README.md says what each line
means.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
from _agent_report import recovery, render_markdown, step_times, summarize, verdicts, where

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CODE = REPO  # where the measured `resilient` package is imported from; main() points it at a snapshot
WORKER = HERE / "_agent_worker.py"
PY = sys.executable

STEPS, EVERY, STEP_MS, FAULT_STEP, FAULT_RANK = 60, 10, 45.0, 37, 1
KILL_TRIAL_TIMEOUT_S = 240.0  # a healthy kill trial takes ~20-40 s here (4 worker starts + 60 steps)
STALL_S = 60.0  # no trace line from any worker for this long: the restart is stuck (each phase takes < 10 s)
STOP_BOUND_S = 90.0  # after a SIGSTOP, how long a launcher gets to notice before the tree is killed
STOP_TRIAL_TIMEOUT_S = 300.0
LAUNCHERS = ("ours", "torchrun", "torchrun_noshare")
LAUNCHER_ENV = {"torchrun_noshare": {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}}
STOP_CONFIGS: dict[str, tuple[str, list[str]]] = {  # key: (launcher, extra launcher flags)
    "ours_calibrated": ("ours", []),
    "ours_step3": ("ours", ["--section-timeout", "step=3"]),
    "torchrun": ("torchrun", []),
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------ processes
def command(launcher: str, trial_dir: Path, fault: str, extra: list[str]) -> list[str]:
    script = [str(WORKER), "--trial-dir", str(trial_dir), "--steps", str(STEPS), "--every", str(EVERY),
              "--step-ms", str(STEP_MS), "--fault", fault, "--fault-step", str(FAULT_STEP),
              "--fault-rank", str(FAULT_RANK)]  # fmt: skip
    if launcher == "ours":
        return [PY, "-m", "resilient", "run", "--nproc-per-node", "2", "--quiet", "--run-dir",
                str(trial_dir / "run"), *extra, *script]  # fmt: skip
    return [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
            *extra, *script]  # fmt: skip


def tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def kill_tree(procs: list[psutil.Process]) -> int:
    """SIGKILL every process in ``procs`` and their process groups (each worker has its own session)."""
    mine = os.getpgid(0)
    groups = set()
    for p in procs:
        try:
            if p.is_running():  # psutil checks the pid was not reused since it was seen
                groups.add(os.getpgid(p.pid))
        except (ProcessLookupError, psutil.Error):
            pass
    for g in groups - {mine}:
        try:
            os.killpg(g, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    killed = 0
    for p in procs:
        try:
            p.kill()
            killed += 1
        except psutil.NoSuchProcess:
            pass
    return killed


class Launch:
    """One launcher process: its output lines stamped with time.time() as they arrive, and how it ended."""

    def __init__(self, cmd: list[str], trial_dir: Path, extra_env: dict[str, str] | None = None, *,
                 code: Path | None = None, log_name: str = "launcher.log") -> None:
        code = code or CODE  # the measured `resilient`: this module's, unless the caller measures its own
        env = {**os.environ, **(extra_env or {}), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(code), os.environ.get("PYTHONPATH")]))}  # fmt: skip
        self.t_start = time.time()
        self.lines: list[tuple[float, str]] = []
        self.log = open(trial_dir / log_name, "w", encoding="utf-8")  # noqa: SIM115  closed in finish()
        # cwd too: `python -m resilient` puts the working directory first on sys.path
        self.proc = subprocess.Popen(cmd, cwd=code, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        self.known: dict[int, psutil.Process] = {}  # every descendant seen, so orphans can still be killed
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.rc: int | None = None
        self.t_exit: float | None = None
        self.killed: str | None = None  # why we killed the tree, if we did

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in iter(self.proc.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            self.lines.append((time.time(), line))
            self.log.write(line + "\n")
        self.log.flush()

    def poll(self) -> bool:
        """Remember the current process tree; True once the launcher exited."""
        for p in tree(self.proc.pid):
            self.known.setdefault(p.pid, p)
        if self.rc is None and (rc := self.proc.poll()) is not None:
            self.rc, self.t_exit = rc, time.time()
        return self.rc is not None

    def kill(self, why: str) -> None:
        self.poll()
        self.killed = why
        kill_tree(list(self.known.values()))
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.poll()

    def alive(self) -> list[psutil.Process]:
        """Descendants seen so far that still run (zombies do not count)."""
        found = []
        for p in self.known.values():
            try:
                if p.pid != self.proc.pid and p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    found.append(p)
            except psutil.Error:
                pass
        return found

    def finish(self) -> list[int]:
        """Kill what the launcher left running and return those pids; close the log.

        After our own kill, the processes it hit get a few seconds to die before they would count.
        """
        left = self.alive()
        if self.killed and left:
            psutil.wait_procs(left, timeout=5)
            left = self.alive()
        kill_tree(left)
        self._reader.join(timeout=15)
        self.log.close()
        return [p.pid for p in left]

    def worker_stacks(self) -> dict[str, str]:
        """py-spy dumps of the live workers (evidence for a stuck restart), keyed by pid."""
        py_spy, out = find_py_spy(), {}
        for p in list(self.known.values()):
            try:
                # a worker is `python [-u] .../_agent_worker.py ...`; the launcher only has it as an argument
                if not p.is_running() or not any(a.endswith(WORKER.name) for a in p.cmdline()[1:3]):
                    continue
            except psutil.Error:
                continue
            if py_spy is None:
                out[str(p.pid)] = "py-spy not installed"
                continue
            try:
                run = subprocess.run([py_spy, "dump", "--pid", str(p.pid)], capture_output=True, text=True,
                                     timeout=30, check=False)
                out[str(p.pid)] = (run.stdout + run.stderr)[-4000:]
            except subprocess.TimeoutExpired:
                out[str(p.pid)] = "py-spy dump timed out"
        return out

    def output_after(self, t: float) -> tuple[float, str] | None:
        return next(((ts, line) for ts, line in list(self.lines) if ts > t), None)

    def tail(self, n: int = 40) -> list[str]:
        return [line for _, line in self.lines[-n:]]


# ------------------------------------------------------------------ traces
def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line cut by SIGKILL
    return out


def traces(trial_dir: Path) -> list[dict[str, Any]]:
    return read_jsonl(trial_dir / "trace.rank0.jsonl") + read_jsonl(trial_dir / "trace.rank1.jsonl")


def fault_record(recs: list[dict[str, Any]], kind: str) -> dict[str, Any] | None:
    return next((r for r in recs if r["ev"] == kind), None)


def agent_events(trial_dir: Path) -> list[dict[str, Any]]:
    return read_jsonl(trial_dir / "run" / "events.jsonl")


def failure_evidence(trial_dir: Path, launch: Launch) -> dict[str, Any]:
    ev: dict[str, Any] = {"launcher_output_tail": launch.tail(60)}
    if (trial_dir / "run").exists():
        ev["agent_events_tail"] = [json.dumps(e)[:400] for e in agent_events(trial_dir)[-15:]]
        for p in sorted((trial_dir / "run").glob("nodes/*/g*/rank*.log")):
            ev[f"worker_log_tail:{p.parent.name}/{p.name}"] = p.read_text(errors="replace").splitlines()[-25:]
    return ev


# ------------------------------------------------------------------ trials
def kill_trial(launcher: str, idx: int, root: Path) -> dict[str, Any]:
    d = root / f"kill_{launcher}_{idx:02d}"
    d.mkdir()
    res: dict[str, Any] = {"kind": "kill", "launcher": launcher, "trial": idx, "loadavg1": os.getloadavg()[0]}
    launch = Launch(command(launcher, d, "kill", []), d, LAUNCHER_ENV.get(launcher))
    deadline = launch.t_start + KILL_TRIAL_TIMEOUT_S
    size, changed = -1, launch.t_start
    while not launch.poll():
        now = time.time()
        if (new := sum(p.stat().st_size for p in d.glob("trace.rank*.jsonl"))) != size:
            size, changed = new, now
        if now > changed + STALL_S:
            stacks = launch.worker_stacks()
            res["stuck_stacks"] = stacks
            launch.kill(f"no progress for {STALL_S:.0f} s (no trace line from any worker); stuck in: "
                        + "; ".join(f"pid {pid}: {where(text)}" for pid, text in stacks.items()))
            break
        if now > deadline:
            launch.kill(f"timed out after {KILL_TRIAL_TIMEOUT_S:.0f} s")
            break
        time.sleep(0.1)
    res["leftover_pids"] = launch.finish()
    res |= {"rc": launch.rc, "killed_by_bench": launch.killed, "wall_s": (launch.t_exit or time.time()) - launch.t_start}
    recs = traces(d)
    kill = fault_record(recs, "kill")
    res["step_s"] = step_times(recs)
    if kill is None:
        res |= {"success": False, "why": launch.killed or f"exit {launch.rc} before the kill fired"}
    else:
        res["kill_step"], res["t_kill"] = kill["step"], kill["t"]
        res |= recovery(recs, kill["t"])
        if (seen := launch.output_after(kill["t"])) is not None:
            res["t_launcher_first_output"], res["launcher_first_output"] = seen[0] - kill["t"], seen[1][:300]
        if launcher == "ours":
            evs = agent_events(d)
            failed = next((e for e in evs if e["kind"] == "worker_failed"), None)
            res["t_agent_worker_failed"] = failed["time"] - kill["t"] if failed else None
        ok = launch.rc == 0 and res["finished_steps"] == [STEPS, STEPS] and 1 in res["attempts"]
        res["success"] = ok
        if not ok:
            res["why"] = (launch.killed or f"exit {launch.rc}; finished steps {res['finished_steps']}; "
                          f"attempts {res['attempts']}")  # fmt: skip
    res.pop("step_s") if not res["step_s"] else None
    if not res["success"]:
        res["evidence"] = failure_evidence(d, launch)
        if res.get("t_new_proc_start") is not None:  # what the restarted attempt printed, not the kill's fallout
            t_restart = res["t_kill"] + res["t_new_proc_start"]
            res["evidence"]["output_after_restart"] = [line for ts, line in launch.lines if ts >= t_restart][-80:]
    return res


def stop_trial(config: str, idx: int, root: Path) -> dict[str, Any]:
    launcher, extra = STOP_CONFIGS[config]
    d = root / f"stop_{config}_{idx:02d}"
    d.mkdir()
    res: dict[str, Any] = {"kind": "stop", "config": config, "launcher": launcher, "trial": idx, "flags": extra,
                           "loadavg1": os.getloadavg()[0]}  # fmt: skip
    launch = Launch(command(launcher, d, "sigstop", extra), d, LAUNCHER_ENV.get(launcher))
    deadline = launch.t_start + STOP_TRIAL_TIMEOUT_S
    t_stop: float | None = None
    detected: dict[str, Any] | None = None
    while not launch.poll():
        now = time.time()
        if t_stop is None and (rec := fault_record(read_jsonl(d / "trace.rank1.jsonl"), "sigstop")) is not None:
            t_stop = rec["t"]
        if t_stop is not None and detected is None:
            if launcher == "ours":
                hang = next((e for e in agent_events(d) if e["kind"] == "hang_detected"), None)
                if hang is not None:
                    detected = {"t": hang["time"], "what": "hang_detected", "event": hang}
            elif (seen := launch.output_after(t_stop)) is not None:
                detected = {"t": seen[0], "what": "launcher output", "line": seen[1][:300]}
        if t_stop is not None and now > t_stop + STOP_BOUND_S and (detected is None or launcher != "ours"):
            res["stacks_at_bound"] = {pid: where(text) for pid, text in launch.worker_stacks().items()}
        if t_stop is not None and detected is None and now > t_stop + STOP_BOUND_S:
            launch.kill(f"nothing detected within {STOP_BOUND_S:.0f} s of the SIGSTOP; process tree killed")
            break
        if launcher != "ours" and t_stop is not None and now > t_stop + STOP_BOUND_S:
            launch.kill(f"bound of {STOP_BOUND_S:.0f} s after the SIGSTOP reached; process tree killed")
            break
        if now > deadline:
            launch.kill(f"timed out after {STOP_TRIAL_TIMEOUT_S:.0f} s")
            break
        time.sleep(0.05)
    if t_stop is not None and detected is None and launch.t_exit is not None and launch.killed is None:
        detected = {"t": launch.t_exit, "what": f"launcher exited {launch.rc}"}
    res["leftover_pids"] = launch.finish()
    res |= {"rc": launch.rc, "killed_by_bench": launch.killed, "wall_s": (launch.t_exit or time.time()) - launch.t_start}
    if t_stop is None:
        res |= {"detected": False, "why": "the SIGSTOP never fired", "evidence": failure_evidence(d, launch)}
        return res
    res["t_stop"] = t_stop
    res["detected"] = detected is not None
    if detected is not None:
        res["detect_s"] = detected["t"] - t_stop
        res["detected_by"] = detected["what"]
        if "event" in detected:
            e = detected["event"]
            res |= {k: e.get(k) for k in ("timeout_s", "source", "rank", "section", "step", "overrun_s", "reason")}
        if "line" in detected:
            res["line"] = detected["line"]
    if launcher == "ours":
        incident = next((json.loads(p.read_text()) for p in sorted((d / "run" / "incidents").glob("*.json"))), None)
        if incident is not None:
            stacks = incident.get("stacks") or {}
            res["incident"] = {"summary": incident.get("summary"),
                               "stacks": {r: {"state": s.get("state"), "method": s.get("method"),
                                              "chars": len(s.get("text") or "")} for r, s in stacks.items()}}  # fmt: skip
        rec = recovery(traces(d), t_stop)
        res["recovered"] = launch.rc == 0 and rec["finished_steps"] == [STEPS, STEPS]
        res["t_first_new_step"] = rec["t_first_new_step"]
    if launcher != "ours" or not res.get("recovered", True):
        res["evidence"] = {"launcher_output_tail": launch.tail(30)}
    return res


# ------------------------------------------------------------------ environment
def _cmd(*argv: str) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, check=False, cwd=REPO).stdout.strip()
    except OSError:
        return ""


def shown(cmd: list[str]) -> str:
    """A command line as the report shows it (interpreter and worker by name)."""
    return " ".join("python" if a == PY else f"benchmarks/{WORKER.name}" if a == str(WORKER) else a for a in cmd)


def find_py_spy() -> str | None:
    beside = Path(PY).with_name("py-spy")
    return str(beside) if beside.exists() else shutil.which("py-spy")


def snapshot(rev: str, root: Path) -> Path:
    """Export ``resilient/`` at git revision ``rev`` into ``root/code`` (other sessions edit the tree)."""
    code = root / "code"
    code.mkdir()
    archive = subprocess.run(["git", "archive", rev, "resilient"], cwd=REPO, capture_output=True, check=True,
                             timeout=60).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(code)], input=archive, check=True, timeout=60)
    return code


def environment(rev: str | None) -> dict[str, Any]:
    import torch

    with open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    py_spy = find_py_spy()
    return {
        "cpus": os.cpu_count(), "cpu_model": cpu, "mem_total_gb": psutil.virtual_memory().total / 1e9,
        "kernel": platform.release(), "python": platform.python_version(), "torch": torch.__version__,
        "py_spy": _cmd(py_spy, "--version") if py_spy else None,
        "code": str(CODE), "code_rev": rev,
        "git_head": _cmd("git", "log", "-1", "--format=%h %cs %s", rev or "HEAD"),
        "commit": rev or _cmd("git", "rev-parse", "HEAD"),
        # the exact command that produced this result file, to rerun it as it was
        "invocation": shlex.join([PY, *sys.argv]),
        # with a revision the measured code is its exported snapshot, whatever the working tree holds
        "git_dirty_resilient": rev is None and bool(_cmd("git", "status", "--porcelain", "--", "resilient")),
        "loadavg_start": list(os.getloadavg()),
        "commands": {k: " ".join([*(f"{n}={v}" for n, v in LAUNCHER_ENV.get(k, {}).items()),
                                  shown(command(k, Path("<trial>"), "kill", []))]) for k in LAUNCHERS},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=20, help="kill/restart trials per launcher (default 20)")
    ap.add_argument("--stop-trials", type=int, default=3, help="SIGSTOP trials per configuration (default 3)")
    ap.add_argument("--no-workaround-peer", action="store_true",
                    help="skip the informational torchrun peer with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1")
    ap.add_argument("--code", default="HEAD", metavar="REV",
                    help="git revision of resilient/ to measure, exported into the scratch dir so that edits to "
                    "the working tree during the run do not change it (default HEAD); 'worktree': the tree as is")
    ap.add_argument("--dir", default="/var/tmp", help="parent of the scratch dir (default /var/tmp)")
    ap.add_argument("--out-dir", default=str(HERE / "results"))
    ap.add_argument("--render", metavar="JSON", help="only recompute the summary and verdicts of an existing "
                    "results .json from its trials and re-render the .md next to it")
    args = ap.parse_args(argv)
    if args.render:  # recompute the derived parts from the trials, so report changes apply to old results
        with open(args.render) as f:
            old = json.load(f)
        old["summary"] = summarize(old)
        old["verdicts"] = verdicts(old)
        with open(args.render, "w") as f:
            json.dump(old, f, indent=1, default=str)
        with open(os.path.splitext(args.render)[0] + ".md", "w") as out:
            out.write(render_markdown(old))
        return 0
    launchers = [k for k in LAUNCHERS if not (args.no_workaround_peer and k == "torchrun_noshare")]
    global CODE
    root = Path(tempfile.mkdtemp(prefix="agent_bench_", dir=args.dir))
    rev = None if args.code == "worktree" else _cmd("git", "rev-parse", "--verify", args.code + "^{commit}")
    if args.code != "worktree" and not rev:
        raise SystemExit(f"--code {args.code}: not a git revision of {REPO}")
    CODE = snapshot(rev, root) if rev else REPO
    t0 = time.time()
    res: dict[str, Any] = {
        "config": {"trials": args.trials, "stop_trials": args.stop_trials, "launchers": launchers,
                   "launcher_env": LAUNCHER_ENV, "stall_s": STALL_S, "steps": STEPS, "every": EVERY,
                   "step_ms": STEP_MS, "fault_step": FAULT_STEP, "fault_rank": FAULT_RANK,
                   "kill_trial_timeout_s": KILL_TRIAL_TIMEOUT_S, "stop_bound_s": STOP_BOUND_S,
                   "stop_configs": {k: list(v) for k, v in STOP_CONFIGS.items()}},
        "environment": environment(rev), "kill_trials": [], "stop_trials": [],
    }  # fmt: skip
    log(f"scratch {root}; {res['environment']['cpus']} CPUs, torch {res['environment']['torch']}")
    try:
        for i in range(args.trials):
            for launcher in launchers[i % len(launchers):] + launchers[:i % len(launchers)]:
                r = kill_trial(launcher, i, root)
                res["kill_trials"].append(r)
                log(f"kill {launcher:16s} #{i}: {'ok  ' if r['success'] else 'FAIL'} first new step "
                    f"{_f(r.get('t_first_new_step'))}, after restart {_f(r.get('t_first_step_after'))}, "
                    f"lost {r.get('steps_lost')}, wall {r['wall_s']:.1f}s" + ("" if r["success"] else f": {r['why']}"))
                if r["success"]:
                    shutil.rmtree(root / f"kill_{launcher}_{i:02d}", ignore_errors=True)
        configs = list(STOP_CONFIGS)
        for i in range(args.stop_trials):
            for config in configs[i % 3:] + configs[:i % 3]:
                r = stop_trial(config, i, root)
                res["stop_trials"].append(r)
                log(f"stop {config:15s} #{i}: " + (f"detected after {r['detect_s']:.2f}s by {r['detected_by']}"
                    + (f" (timeout {r['timeout_s']:.1f}s {r['source']})" if "timeout_s" in r else "")
                    if r.get("detected") else f"not detected ({r.get('killed_by_bench') or r.get('why')})")
                    + (f"; recovered: {r.get('recovered')}" if "recovered" in r else ""))
                if (r.get("recovered") and r.get("detected")) or (r["launcher"] != "ours" and "t_stop" in r):
                    shutil.rmtree(root / f"stop_{config}_{i:02d}", ignore_errors=True)
    finally:
        save_results(res, root, t0, args.out_dir, "agent_bench", summarize, verdicts, render_markdown)
    for k, v in res["verdicts"].items():
        print(f"{v['verdict']}  {k}: {v['text']}")
    return 0


def save_results(res: dict[str, Any], root: Path, t0: float, out_dir: str, name: str, summarize: Any,
                 verdicts: Any, render: Any) -> None:
    """Close a run's results (load at the end, what was kept), summarise, write ``<name>.json``/``.md``."""
    res["environment"] |= {"loadavg_end": list(os.getloadavg()), "total_s": time.time() - t0,
                           "kept": str(root) if any(p.name != "code" for p in root.iterdir()) else None}
    res["summary"] = summarize(res)
    res["verdicts"] = verdicts(res)
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, name)
    with open(base + ".json", "w") as f:
        json.dump(res, f, indent=1, default=str)
    with open(base + ".md", "w") as f:
        f.write(render(res))
    log(f"wrote {base}.json and .md")
    if res["environment"]["kept"]:
        log(f"kept the directories of failed trials under {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}s"


if __name__ == "__main__":
    sys.exit(main())
