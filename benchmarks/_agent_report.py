"""Measurements from worker traces, summaries, verdicts and the Markdown report of agent_bench.py.

Pure functions of the traces and of the results dict.

``agent_bench.py --render JSON`` uses render_markdown() to re-render a report without re-running.
"""

from __future__ import annotations

import itertools
import random
import re
import statistics
from typing import Any

HANG_MARGIN_S = 2.0
WORKER_NAME = "_agent_worker.py"
KILL_METRICS = {  # key: what it measures (seconds after the SIGKILL unless a count)
    "t_first_new_step": "kill -> first newly completed step (index > last completed before the kill)",
    "t_first_step_after": "kill -> first step completed after the restart",
    "steps_lost": "steps re-done = last completed before kill + 1 - restored step",
    "t_launcher_first_output": "kill -> first line the launcher printed after it",
    "t_agent_worker_failed": "kill -> agent's worker_failed event (ours only)",
    "t_new_proc_start": "kill -> first new worker process started (script's first line)",
    "t_imported": "kill -> both new workers imported torch + resilient",
    "t_pg_ready": "kill -> both new workers' init_process_group returned",
    "t_ddp_ready": "kill -> both new workers wrapped the model in DDP",
    "t_run_ready": "kill -> both new workers restored (Run created)",
}


def stats(xs: list[float]) -> dict[str, Any] | None:
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return {"n": len(xs), "median": statistics.median(xs), "min": min(xs), "max": max(xs)}


NAMES = {"ours": "ours", "torchrun": "torchrun", "torchrun_noshare": "torchrun, no shared store (info)"}
NO_RATIO = ("t_launcher_first_output", "t_agent_worker_failed")  # not the same event under both launchers
ALL_TRIALS = ("t_new_proc_start", "t_launcher_first_output", "t_agent_worker_failed")  # others: successful only


def ratio_ci(ours: list[float], peer: list[float], resamples: int = 10000, seed: int = 0) -> list[float] | None:
    """95% bootstrap interval of median(ours) / median(peer) (seeded: the report re-renders identically)."""
    if len(ours) < 2 or len(peer) < 2:
        return None
    rng = random.Random(seed)
    med = statistics.median
    rs = sorted(med(rng.choices(ours, k=len(ours))) / med(rng.choices(peer, k=len(peer))) for _ in range(resamples))
    return [rs[int(0.025 * resamples)], rs[int(0.975 * resamples) - 1]]


def launchers(res: dict[str, Any]) -> list[str]:
    return list(res["config"].get("launchers", ["ours", "torchrun"]))


# ------------------------------------------------------------------ traces -> measurements
def recovery(recs: list[dict[str, Any]], t_fault: float, attempt_before: int = 0) -> dict[str, Any]:
    """Steps and times around a fault at ``t_fault`` from both ranks' traces.

    A step counts as completed when every rank recorded it; the next attempt is the one after
    ``attempt_before``.  Times are seconds after the fault.
    """
    def done(attempt: int) -> dict[int, float]:
        by_rank: dict[int, dict[int, float]] = {}
        for r in recs:
            if r["ev"] == "step" and r["attempt"] == attempt:
                by_rank.setdefault(r["rank"], {})[r["step"]] = r["t"]
        if len(by_rank) < 2:
            return {}
        common = set(by_rank[0]) & set(by_rank[1])
        return {s: max(by_rank[0][s], by_rank[1][s]) for s in common}

    # Not filtered by time: the surviving rank may record the last step a few ms after the kill,
    # but that update was complete on both ranks (its gradients were all-reduced) and is re-done.
    before = done(attempt_before)
    last_done = max(before) if before else -1
    after_attempt = attempt_before + 1
    after = done(after_attempt)
    nxt = [r for r in recs if r["attempt"] == after_attempt]

    def first(ev: str, agg: Any = max) -> float | None:
        ts = [r["t"] for r in nxt if r["ev"] == ev]
        return agg(ts) - t_fault if len(ts) == 2 else None

    restored = sorted({r["restored_step"] for r in nxt if r["ev"] == "run_ready"})
    out: dict[str, Any] = {"last_done_before": last_done, "restored_step": restored[0] if len(restored) == 1 else None,
                           "restored_steps_by_rank": restored}  # fmt: skip
    rs = out["restored_step"]
    out["steps_lost"] = last_done + 1 - rs if rs is not None else None
    out["t_first_step_after"] = after[rs] - t_fault if rs is not None and rs in after else None
    out["t_first_new_step"] = after[last_done + 1] - t_fault if last_done + 1 in after else None
    out["t_new_proc_start"] = first("proc_start", min)
    out["t_imported"] = first("imported")
    out["t_pg_ready"] = first("pg_ready")
    out["t_ddp_ready"] = first("ddp_ready")
    out["t_run_ready"] = first("run_ready")
    out["attempts"] = sorted({r["attempt"] for r in recs})
    ends = [r for r in recs if r["ev"] == "end"]
    out["finished_steps"] = sorted(r["step"] for r in ends)
    return out


def step_times(recs: list[dict[str, Any]]) -> list[float]:
    """Rank 0's durations between consecutive completed steps of the first attempt."""
    ts = sorted((r["step"], r["t"]) for r in recs if r["ev"] == "step" and r["rank"] == 0 and r["attempt"] == 0)
    return [b[1] - a[1] for a, b in itertools.pairwise(ts) if b[0] == a[0] + 1]


def where(py_spy_dump: str) -> str:
    """Where a py-spy dump's main thread is: its innermost frames down to our code, e.g.
    ``_new_process_group_helper <- ... <- from_environment (resilient/checkpoint/coordinator.py:32)``."""
    lines = py_spy_dump.splitlines()
    start = next((i for i, ln in enumerate(lines) if "MainThread" in ln), None)
    if start is None:
        return (lines or ["?"])[-1][:160]
    frames = []
    for ln in lines[start + 1:]:
        if not ln.startswith("    "):
            break
        frames.append(ln.strip())
    ours = [i for i, f in enumerate(frames) if "resilient/" in f or WORKER_NAME in f]
    if not ours:
        return " <- ".join(f.split(" (")[0] for f in frames[:3])
    mine = " <- ".join(frames[i] for i in ours[:2])
    if ours[0] == 0:
        return mine
    return frames[0].split(" (")[0] + (" <- ... <- " if ours[0] > 1 else " <- ") + mine


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"kill": {}, "stop": {}, "kill_ratio": {}, "kill_ratio_ci": {}}
    for launcher in launchers(res):
        trials = [t for t in res["kill_trials"] if t["launcher"] == launcher]
        ok = [t for t in trials if t["success"]]
        s: dict[str, Any] = {"trials": len(trials), "succeeded": len(ok)}
        # Timings of successful trials only (a failed restart has no first new step), except the
        # restart's start, which every trial that got as far as a new worker process has.
        for key in KILL_METRICS:
            s[key] = stats([t.get(key) for t in (trials if key in ALL_TRIALS else ok)])
        s["step_s"] = stats([x for t in trials for x in t.get("step_s", [])])
        out["kill"][launcher] = s
    for peer in launchers(res)[1:]:
        ratios = {}
        for key in (k for k in KILL_METRICS if k not in NO_RATIO):
            o, t = out["kill"]["ours"][key], out["kill"][peer][key]
            ratios[key] = o["median"] / t["median"] if o and t and t["median"] else None
        out["kill_ratio"][peer] = ratios
        new = {launcher: [t["t_first_new_step"] for t in res["kill_trials"] if t["launcher"] == launcher
                          and t["success"] and t.get("t_first_new_step") is not None] for launcher in ("ours", peer)}
        out["kill_ratio_ci"][peer] = {"t_first_new_step": ratio_ci(new["ours"], new[peer])}
    configs = sorted({t["config"] for t in res["stop_trials"]}, key=lambda c: (c.startswith("torchrun"), c))
    for config in configs:
        trials = [t for t in res["stop_trials"] if t["config"] == config]
        det = [t for t in trials if t.get("detected")]
        within = [t for t in det if t.get("timeout_s") is not None and t["detect_s"] <= t["timeout_s"] + HANG_MARGIN_S]
        out["stop"][config] = {
            "trials": len(trials), "detected": len(det), "detect_s": stats([t["detect_s"] for t in det]),
            "timeout_s": stats([t.get("timeout_s") for t in det]), "within_timeout_plus_margin": len(within),
            "recovered": sum(1 for t in trials if t.get("recovered")),
            "t_first_new_step": stats([t.get("t_first_new_step") for t in trials if t.get("recovered")]),
        }  # fmt: skip
    return out


def _recovery(sm: dict[str, Any], peer: str) -> dict[str, Any]:
    k = sm["kill"]
    o, t = k["ours"]["t_first_new_step"], k[peer]["t_first_new_step"]
    if o is None:
        return {"verdict": "MISS", "text": "ours never reached a new step after the kill"}
    if t is None:
        return {"verdict": "PASS (peer never recovered)", "text": f"ours median {o['median']:.2f} s (n={o['n']}) to the "
                f"first newly completed step; {NAMES[peer]} never got there (none of its {k[peer]['trials']} restarts "
                "succeeded), so there is no ratio"}  # fmt: skip
    r = o["median"] / t["median"]
    ci = sm.get("kill_ratio_ci", {}).get(peer, {}).get("t_first_new_step")
    return {"verdict": "PASS" if r <= 1.0 else "MISS", "ratio": r, "ci95": ci,
            "text": f"kill -> first newly completed step, medians: ours {o['median']:.2f} s (n={o['n']}) / "
                    f"{NAMES[peer]} {t['median']:.2f} s (n={t['n']}, successful restarts only) = {r:.3f}"
                    + (f" (95% bootstrap interval {ci[0]:.2f} .. {ci[1]:.2f})" if ci else "") + "; limit <= 1.0"}


def verdicts(res: dict[str, Any]) -> dict[str, Any]:
    sm = res["summary"] if "summary" in res else summarize(res)
    k, v = sm["kill"], {}
    v["recovery"] = _recovery(sm, "torchrun")
    if "torchrun_noshare" in k:
        v["recovery_vs_noshare"] = _recovery(sm, "torchrun_noshare") | {"info": True}
    for config, s in sm["stop"].items():
        if config.startswith("torchrun"):
            continue
        worst = max((x["detect_s"] - x["timeout_s"] for x in res["stop_trials"]
                     if x["config"] == config and x.get("detected") and x.get("timeout_s") is not None), default=None)
        ok = s["trials"] > 0 and s["within_timeout_plus_margin"] == s["trials"]
        v[f"hang_{config}"] = {
            "verdict": "PASS" if ok else "MISS",
            "text": f"{config}: {s['within_timeout_plus_margin']}/{s['trials']} SIGSTOPs detected within the timeout "
                    f"+ {HANG_MARGIN_S:g} s" + (f" (worst: {worst:+.2f} s vs. the timeout)" if worst is not None else ""),
        }  # fmt: skip
    ok, n = k["ours"]["succeeded"], k["ours"]["trials"]
    v["restart_success"] = {"verdict": "PASS" if n > 0 and ok == n else "MISS",
                            "text": f"ours {ok}/{n} restarts succeeded (" + ", ".join(
                                f"{NAMES[p]} {k[p]['succeeded']}/{k[p]['trials']}" for p in k if p != "ours")
                            + "); target: every one"}  # fmt: skip
    return v


# ------------------------------------------------------------------ markdown
def fmt(x: float | None, nd: int = 2, unit: str = " s") -> str:
    return "-" if x is None else f"{x:.{nd}f}{unit}"


def diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def row(*cells: Any) -> str:
    return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"


def cell(s: dict[str, Any] | None, nd: int = 2, unit: str = " s") -> str:
    """``median (min .. max, n=N)``."""
    if s is None:
        return "-"
    return f"{fmt(s['median'], nd, unit)} ({fmt(s['min'], nd, '')} .. {fmt(s['max'], nd, '')}, n={s['n']})"


def key_lines(lines: list[str], n: int = 3) -> list[str]:
    """The few lines of a failure's output that say what went wrong: exception messages first."""
    exc = re.compile(r"^(\[rank\d+\]: )?[\w.]*(Error|Exception|Timeout)\w*: ")
    words = ("error", "failed", "timed out", "refused", "exitcode")
    for pick in (lambda ln: bool(exc.match(ln)), lambda ln: any(w in ln.lower() for w in words)):
        found: list[str] = []
        for line in (ln.strip() for ln in lines):
            if pick(line) and line[:240] not in found and not line.startswith("File "):
                found.append(line[:240])
        if found:
            return found[:n]
    return [ln.strip()[:240] for ln in lines[-n:] if ln.strip()]


def render_markdown(res: dict[str, Any]) -> str:
    env, cfg = res["environment"], res["config"]
    sm = res.get("summary") or summarize(res)
    v = res.get("verdicts") or verdicts(res)
    peers = launchers(res)
    k = sm["kill"]
    dirty = " (with uncommitted changes under resilient/)" if env.get("git_dirty_resilient") else ""
    la = [" ".join(f"{x:.2f}" for x in env.get(key, [])) for key in ("loadavg_start", "loadavg_end")]
    steps = ", ".join(f"{NAMES[p]} {fmt((k[p]['step_s'] or {}).get('median', 0) * 1000, 1, ' ms')}" for p in peers)
    L = [
        "# Agent benchmark: `resilient run` vs. `torchrun --max-restarts 1`\n",
        (f"Host: {env['cpus']} CPUs ({env['cpu_model']}), {env['mem_total_gb']:.1f} GB RAM, kernel {env['kernel']}, "
         f"python {env['python']}, torch {env['torch']}, {env.get('py_spy') or 'py-spy not installed'}.  "),
        (f"Code measured: `resilient/` of `{env['git_head']}`, exported with `git archive` (the working tree, which "
         "others were editing, was not used).  " if env.get("code_rev") else
         f"Code measured: the working tree at `{env['git_head']}`{dirty}.  "),
        f"Load average (1/5/15 min): {la[0]} at start, {la[1]} at end; total run {env.get('total_s', 0):.0f} s.  ",
        (f"Commit `{env['commit']}`; produced by `{env['invocation']}`.  " if env.get("invocation") else ""),
        (f"Workload (`benchmarks/_agent_worker.py`, the same for every launcher): 2 ranks, gloo DDP on CPU, "
         f"{cfg['steps']} steps of an MLP 64-256-64 padded to {cfg['step_ms']:.0f} ms (measured median step before "
         f"the fault: {steps}), `resilient.Run` with a checkpoint every {cfg['every']} steps and an `ElasticLoader`. "
         f"Rank {cfg['fault_rank']} SIGKILLs or SIGSTOPs itself at the top of step {cfg['fault_step']} on the first "
         f"attempt, so the last completed step is {cfg['fault_step'] - 1} and the newest committed checkpoint is "
         f"step {(cfg['fault_step'] // cfg['every']) * cfg['every']}.  "),
        "Commands (`OMP_NUM_THREADS=1`): " + "; ".join(f"`{env['commands'][p]}`" for p in peers) + ".  ",
        (f"Trials: {cfg['trials']} kill trials per launcher, interleaved in a rotating order; {cfg['stop_trials']} "
         f"SIGSTOP trials per configuration, rotated. Bounds: a kill trial {cfg['kill_trial_timeout_s']:.0f} s, or "
         f"{cfg.get('stall_s', 60):.0f} s without a trace line from any worker (stuck); a torchrun SIGSTOP trial "
         f"{cfg['stop_bound_s']:.0f} s after the stop. At a bound the benchmark dumps the workers' stacks (py-spy) "
         "and SIGKILLs the whole process tree.\n"),
        "## Targets\n",
        row("target", "result", "verdict"),
        row("---", "---", "---"),
    ]  # fmt: skip
    names = {"recovery": "recovery no slower than torchrun", "restart_success": "ours succeeds every restart",
             "recovery_vs_noshare": "*not a spec target:* recovery vs. torchrun with its workaround"}  # fmt: skip
    for key, x in v.items():
        L.append(row(names.get(key, f"hang detection within the timeout + {HANG_MARGIN_S:g} s"), x["text"],
                     f"**{x['verdict']}**"))
    L += [
        "\n## (a, b, d) SIGKILL of rank 1, restart from the newest checkpoint\n",
        ("Restart success: " + ", ".join(f"{NAMES[p]} **{k[p]['succeeded']}/{k[p]['trials']}**" for p in peers)
         + f" (success = the launcher exited 0 and both ranks finished all {cfg['steps']} steps after one restart).  "),
        ("Cells: median (min .. max, n) in seconds after the kill (worker wall clocks, one host); a step counts as "
         "completed when both ranks recorded it. Rows marked * use successful restarts only; the others every "
         "trial that got that far.\n"),
        row("metric", *(NAMES[p] for p in peers), *(f"ours / {NAMES[p]}" for p in peers[1:])),
        row(*["---"] * (2 * len(peers))),
    ]  # fmt: skip
    for key, what in KILL_METRICS.items():
        nd, unit = (1, "") if key == "steps_lost" else (2, " s")
        ratios = [sm["kill_ratio"][p].get(key) for p in peers[1:]]
        L.append(row(what + ("" if key in ALL_TRIALS else " *"), *(cell(k[p][key], nd, unit) for p in peers),
                     *("-" if r is None else f"{r:.3f}" for r in ratios)))
    share = {p: (k[p]["t_new_proc_start"] or {}).get("median") for p in peers}
    rest = {p: (k[p]["t_first_new_step"] or {}).get("median") for p in peers}
    L.append("\nWhere the time goes (medians): the launcher's own share, from the kill to the first new worker "
             "process (notice the failure, stop the survivor, rendezvous, spawn), is "
             + ", ".join(f"{NAMES[p]} {fmt(share[p])}" for p in peers)
             + "; the rest, to the first newly completed step, is the new workers' start: imports, process group, "
             "DDP construction, restore, the replayed steps (" + ", ".join(
                 f"{NAMES[p]} {fmt(diff(rest[p], share[p]))}" for p in peers)
             + "), the same code under every launcher.")
    fails = [t for t in res["kill_trials"] if not t["success"]]
    if fails:
        L.append("\n### Failed restarts (what the output said)\n")
        for t in fails:
            ev = t.get("evidence", {})
            after = ev.get("output_after_restart")
            lines = key_lines(ev.get("launcher_output_tail", []) if after is None else after)
            L.append(f"- {NAMES[t['launcher']]} #{t['trial']}: {t.get('why')}")
            L += [f"  - `{ln}`" for ln in lines] if lines else ["  - (the restarted workers printed nothing)"]
    L += ["\n## (c) SIGSTOP of rank 1: time to detection\n",
          row("configuration", "detected", "stop -> detection", "timeout (the agent's)", "within timeout + 2 s",
              "recovered and finished", "stop -> first new step"),
          row(*["---"] * 7)]  # fmt: skip
    for config, s in sm["stop"].items():
        if config.startswith("torchrun"):
            det = f"{s['detected']}/{s['trials']}" + ("" if s["detected"] else f" (not detected within "
                                                      f"{cfg['stop_bound_s']:.0f} s)")  # fmt: skip
            L.append(row(config, det, cell(s["detect_s"]), "-", "-", "- (killed by the benchmark)", "-"))
        else:
            to = s["timeout_s"]
            L.append(row(config, f"{s['detected']}/{s['trials']}", cell(s["detect_s"]),
                         "-" if to is None else f"{fmt(to['min'], 1)} .. {fmt(to['max'], 1)}",
                         f"{s['within_timeout_plus_margin']}/{s['trials']}", f"{s['recovered']}/{s['trials']}",
                         cell(s["t_first_new_step"])))  # fmt: skip
    L.append("\ndetect s = the agent's `hang_detected` event time (ours) or the launcher's first output line / exit "
             "(torchrun) minus the worker's timestamp just before it stopped itself.\n")
    L += ["## Per-trial: kill\n",
          row("launcher", "#", "exit", "ok", "last done", "restored", "lost", "first step after", "first new step",
              "new proc", "restored (Run)", "launcher saw", "wall", "load 1m", "why (if failed)"),
          row(*["---"] * 15)]  # fmt: skip
    for t in sorted(res["kill_trials"], key=lambda t: (t["launcher"], t["trial"])):
        L.append(row(t["launcher"], t["trial"], t.get("rc"), "yes" if t["success"] else "**no**",
                     t.get("last_done_before", "-"), t.get("restored_step", "-"), t.get("steps_lost", "-"),
                     fmt(t.get("t_first_step_after")), fmt(t.get("t_first_new_step")), fmt(t.get("t_new_proc_start")),
                     fmt(t.get("t_run_ready")), fmt(t.get("t_launcher_first_output")), fmt(t.get("wall_s"), 1),
                     f"{t.get('loadavg1', 0):.2f}", (t.get("why") or "")[:120]))  # fmt: skip
    L += ["\n## Per-trial: SIGSTOP\n",
          row("configuration", "#", "detected after", "by", "timeout", "source", "section/step", "exit", "recovered",
              "note"),
          row(*["---"] * 10)]  # fmt: skip
    for t in sorted(res["stop_trials"], key=lambda t: (t["config"], t["trial"])):
        note = t.get("killed_by_bench") or t.get("why") or (t.get("incident") or {}).get("summary") or ""
        if t.get("stacks_at_bound"):
            note += "; workers then: " + "; ".join(f"pid {p}: {w}" for p, w in t["stacks_at_bound"].items())
        stacks = (t.get("incident") or {}).get("stacks") or {}
        if stacks:
            note += "; stacks: " + ", ".join(f"rank {r} {s['state']} via {s['method']}" for r, s in stacks.items())
        L.append(row(t["config"], t["trial"], fmt(t.get("detect_s")) if t.get("detected") else "not detected",
                     t.get("detected_by", "-"), fmt(t.get("timeout_s"), 1), t.get("source") or "-",
                     f"{t.get('section') or '-'}/{t.get('step', '-')}", t.get("rc"),
                     {True: "yes", False: "**no**"}.get(t.get("recovered"), "-"), note[:400]))  # fmt: skip
    return "\n".join(L) + "\n"
