"""Measurements from the traces and events of recovery_bench.py, summaries, verdicts and the Markdown report.

Pure functions of the records and of the results dict; ``recovery_bench.py --render JSON`` uses them to
recompute the summary and re-render a report without running anything.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from _agent_report import cell, fmt, key_lines, ratio_ci, row, stats

MODES = ("spare", "shrink", "restart", "torchrun", "torchft", "torchrun_noshare", "restart_classic", "torchrun_classic",
         "torchrun_classic_noshare", "restart_all", "restart_all_spares")
INFO_MODES = ("torchrun_noshare", "torchrun_classic_noshare")  # torchrun with its workaround, for comparison
PEERS = ("torchrun", "torchrun_noshare", "torchrun_classic", "torchrun_classic_noshare",
         "restart_all")  # the ratios' denominators
RUNGS = {"spare": "promote_spare", "shrink": "shrink"}  # how each in-process mode must recover
NAMES = {
    "spare": "spare + in-process (`resilient run --spares 1`)",
    "shrink": "shrink (`resilient run --nproc-per-node 1:2`)",
    "restart": "restart (`resilient run`)",
    "torchrun": "torchrun --max-restarts 1",
    "torchft": "torchft 0.2.0 (2 replica groups)",
    "torchrun_noshare": "torchrun, no shared store (info)",
    "restart_classic": "restart, unmodified DDP script (`resilient run`)",
    "torchrun_classic": "torchrun --max-restarts 1, unmodified DDP script",
    "torchrun_classic_noshare": "torchrun, no shared store, unmodified DDP script",
    "restart_all": "restart, every rank killed (`resilient run`)",
    "restart_all_spares": "restart, every rank killed, a warm spare (`resilient run --spares 1`)",
}
METRICS = {  # key: what it measures (seconds after the SIGKILL unless a count)
    "t_first_new_step": "kill -> next newly completed step",
    "steps_redone": "steps re-done",
    "t_first_step_after": "kill -> first step completed after the recovery",
}
PHASES = {  # in-process modes: where the time from the kill to the next new step goes
    "notice": "agent notices the death (kill -> the agent's detection time)",
    "decide": "the agent's decision (detection -> recovery_decided; includes its wait for every survivor's "
              "`waiting` report, at most min(5 s, recovery timeout / 4))",
    "reform": "re-formation (decision -> the last member's group formed)",
    "sync": "state sync (the last member's broadcast of the state, DDP rebuilt)",
    "retry": "the retried step (last member rejoined -> the next new step completed)",
}
WORKER_SIDE = {  # the survivors' own account (group_rejoined ``seconds``)
    "survivor_noticed": "kill -> a survivor saw its collective fail",
    "survivor_abandon": "survivor: rewind + release the old group",
    "survivor_wait": "survivor: waiting for its assignment",
}
TARGETS = {"spare": 0.05, "shrink": 0.10, "restart_classic": 0.3, "restart_all_spares": 1.0}
PEER_OF = {"restart_classic": "torchrun_classic",  # a target's peer runs the same script (default: torchrun)
           "restart_all_spares": "restart_all"}  # a restart with a spare no slower than one without
MAX_REDONE = {"restart_classic": 1}  # steps a restart may re-do at most (every trial)


# ------------------------------------------------------------------ records -> measurements
def _complete(recs: list[dict[str, Any]]) -> float | None:
    """When one step was completed by every rank of one world (records of that step), or None."""
    best = None
    by_world: dict[int, dict[int, float]] = defaultdict(dict)
    for r in sorted(recs, key=lambda r: r["t"]):
        by_world[r["world"]].setdefault(r["rank"], r["t"])
    for world, ranks in by_world.items():
        if set(ranks) == set(range(world)):
            t = max(ranks.values())
            best = t if best is None else min(best, t)
    return best


def measure(recs: list[dict[str, Any]], t_kill: float) -> dict[str, Any]:
    """Steps and times around a kill at ``t_kill`` from every process's trace (wall clocks, one host).

    A step counts as completed when every rank of one world recorded it.  Before the kill: steps begun
    before it (a survivor may record the last one a few ms after the kill; that update was all-reduced on
    every rank).  Re-done: steps completed before the kill that some process began again after it.
    """
    steps = [r for r in recs if r["ev"] == "step"]
    before: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in steps:
        if r["t0"] < t_kill:
            before[r["step"]].append(r)
    done = [s for s, rs in before.items() if _complete(rs) is not None]
    last_done = max(done, default=-1)
    after = [r for r in steps if r["t"] > t_kill]
    new = [r for r in after if r["step"] == last_done + 1]
    t_new = _complete(new)
    redone = sorted({r["step"] for r in steps if r["t0"] > t_kill and r["step"] <= last_done})
    begun = [r for r in steps if r["t0"] > t_kill]
    first = min((r["step"] for r in begun), default=None)
    t_first = _complete([r for r in begun if r["step"] == first]) if first is not None else None
    ends = [r for r in recs if r["ev"] == "end"]
    return {
        "last_done_before": last_done, "steps_redone": len(redone), "redone": redone,
        "t_first_new_step": t_new - t_kill if t_new is not None else None, "t_new_abs": t_new,
        "first_step_after": first, "t_first_step_after": t_first - t_kill if t_first is not None else None,
        "world_before": max((r["world"] for r in before.get(last_done, [])), default=None),
        "world_after": max((r["world"] for r in new), default=None),
        "finished": sorted((r.get("rank"), r["step"]) for r in ends),
    }  # fmt: skip


def finished_all(m: dict[str, Any], steps: int) -> bool:
    """Every rank of the world after the recovery ended at ``steps`` updates."""
    world = m.get("world_after")
    return world is not None and sorted(m["finished"]) == [(r, steps) for r in range(world)]


def breakdown(agent: list[dict[str, Any]], worker: list[dict[str, Any]], t_kill: float,
              t_new: float | None) -> dict[str, Any]:
    """Where an in-process recovery's time went, from the agent's events and the members' ``group_rejoined``.

    The agent's detection time is ``recovered_in_process.time - .seconds`` (it measures from detection).
    """
    first = {k: next((e for e in agent if e["kind"] == k), None)
             for k in ("recovery_decided", "generation_continued", "recovered_in_process")}  # fmt: skip
    rip, dec = first["recovered_in_process"], first["recovery_decided"]
    rejoined = [e for e in worker if e["kind"] == "group_rejoined"]
    out: dict[str, Any] = {"rung": (rip or {}).get("rung") or (dec or {}).get("action"),
                           "decision": (dec or {}).get("reason"), "slowest": (rip or {}).get("slowest"),
                           "agent_seconds": (rip or {}).get("seconds")}  # fmt: skip
    if rip is None or dec is None or not rejoined:
        return out
    noticed = rip["time"] - rip["seconds"]
    last = max(rejoined, key=lambda e: e["time"])
    formed = last["time"] - last["seconds"]["sync"]
    out["phases"] = {"notice": noticed - t_kill, "decide": dec["time"] - noticed, "reform": formed - dec["time"],
                     "sync": last["seconds"]["sync"], "retry": t_new - last["time"] if t_new is not None else None}
    if (gc := first["generation_continued"]) is not None:
        out["t_generation_continued"] = gc["time"] - t_kill
    survivors = [e for e in rejoined if not e.get("replacement")]
    if survivors:
        s = min(survivors, key=lambda e: e["time"] - e["seconds"]["total"])
        out["worker"] = {"survivor_noticed": s["time"] - s["seconds"]["total"] - t_kill,
                         "survivor_abandon": s["seconds"]["abandon"], "survivor_wait": s["seconds"]["wait"]}
    return out


# ------------------------------------------------------------------ summary and verdicts
def modes(res: dict[str, Any]) -> list[str]:
    return list(res["config"]["modes"])


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"modes": {}, "ratio": {}, "ratio_ci": {}}
    for mode in modes(res):
        trials = [t for t in res["trials"] if t["mode"] == mode]
        ok = [t for t in trials if t["success"]]
        s: dict[str, Any] = {"trials": len(trials), "succeeded": len(ok)}
        for key in METRICS:
            s[key] = stats([t.get(key) for t in ok])
        phases = [t.get("breakdown", {}).get("phases") or {} for t in ok]
        s["phases"] = {k: stats([p.get(k) for p in phases]) for k in PHASES}
        side = [t.get("breakdown", {}).get("worker") or {} for t in ok]
        s["worker"] = {k: stats([p.get(k) for p in side]) for k in WORKER_SIDE}
        rungs: dict[str, int] = defaultdict(int)
        for t in trials:
            rungs[(t.get("breakdown") or {}).get("rung") or "-"] += 1
        s["rungs"] = dict(rungs)
        s["in_process"] = sum(1 for t in ok if in_process(t))
        out["modes"][mode] = s
    for p in (p for p in PEERS if p in out["modes"]):
        peer = [t["t_first_new_step"] for t in res["trials"] if t["mode"] == p and t["success"]]
        out["ratio"][p], out["ratio_ci"][p] = {}, {}
        for mode in (m for m in modes(res) if m not in PEERS):
            o, t = out["modes"][mode]["t_first_new_step"], out["modes"][p]["t_first_new_step"]
            out["ratio"][p][mode] = o["median"] / t["median"] if o and t and t["median"] else None
            mine = [x["t_first_new_step"] for x in res["trials"] if x["mode"] == mode and x["success"]]
            out["ratio_ci"][p][mode] = ratio_ci(mine, peer)
    return out


def in_process(t: dict[str, Any]) -> bool:
    """The trial recovered on the rung its mode is about (a spare promoted, the world shrunk), no restart."""
    b = t.get("breakdown") or {}
    return t["mode"] in RUNGS and b.get("rung") == RUNGS[t["mode"]] and b.get("agent_seconds") is not None


def verdicts(res: dict[str, Any]) -> dict[str, Any]:
    sm = res["summary"] if "summary" in res else summarize(res)
    v: dict[str, Any] = {}
    for mode, limit in TARGETS.items():
        if mode not in sm["modes"]:
            continue
        peer = PEER_OF.get(mode, "torchrun")
        s, r = sm["modes"][mode], sm["ratio"].get(peer, {}).get(mode)
        ci = sm["ratio_ci"].get(peer, {}).get(mode)
        ps = sm["modes"].get(peer, {})
        text = (f"median kill -> next new step {fmt((s['t_first_new_step'] or {}).get('median'))} / {peer} "
                f"{fmt((ps.get('t_first_new_step') or {}).get('median'))} = "
                + ("-" if r is None else f"{r:.3f}") + (f" (95% bootstrap {ci[0]:.3f} .. {ci[1]:.3f})" if ci else "")
                + (f" ({ps['succeeded']}/{ps['trials']} of its runs succeeded)" if ps else "")
                + f"; limit <= {limit:g}")  # fmt: skip
        # Against torchrun, the least favourable of its variants that restarted at least once: the default, or
        # without its shared store (its workaround for the stale-address failure of its restarts).
        measured = [x for x in (r, sm["ratio"].get(f"{peer}_noshare", {}).get(mode)) if x is not None]
        worst = max(measured) if measured else None
        ok = worst is not None and worst <= limit and s["trials"] > 0
        if mode in RUNGS:
            text += f"; recovered in process ({RUNGS[mode]}) in {s['in_process']}/{s['trials']} trials"
            ok = ok and s["in_process"] == s["trials"]
        if (n := sm["ratio"].get(f"{peer}_noshare", {}).get(mode)) is not None:
            text += (f"; / {peer} without its shared store = {n:.3f}; the verdict takes the larger ratio of those "
                     "measured")
        if mode in MAX_REDONE:
            redone = s["steps_redone"]
            within = redone is not None and redone["max"] <= MAX_REDONE[mode] and redone["n"] == s["trials"]
            text += (f"; steps re-done max {redone['max'] if redone else '-'} (limit {MAX_REDONE[mode]}); "
                     f"{s['succeeded']}/{s['trials']} succeeded")
            ok = ok and within and s["succeeded"] == s["trials"]
        if mode == "spare":
            redone = s["steps_redone"]
            zero = redone is not None and redone["max"] == 0 and redone["n"] == s["trials"]
            text += f"; steps re-done max {redone['max'] if redone else '-'}; {s['succeeded']}/{s['trials']} succeeded"
            ok = ok and zero and s["trials"] > 0 and s["succeeded"] == s["trials"]
        v[mode] = {"verdict": "PASS" if ok else "MISS", "ratio": r, "ci95": ci, "text": text}
    return v


# ------------------------------------------------------------------ markdown
def render_markdown(res: dict[str, Any]) -> str:
    env, cfg = res["environment"], res["config"]
    sm = res.get("summary") or summarize(res)
    v = res.get("verdicts") or verdicts(res)
    ms = modes(res)
    la = [" ".join(f"{x:.2f}" for x in env.get(k, [])) for k in ("loadavg_start", "loadavg_end")]
    L = [
        "# Recovery benchmark: spare + in-process, shrink, restart, torchrun, torchft\n",
        (f"Host: {env['cpus']} CPUs ({env['cpu_model']}), kernel {env['kernel']}, python {env['python']}, "
         f"torch {env['torch']}, torchft {env.get('torchft') or 'not installed'}.  "),
        (f"Code measured: `resilient/` of `{env['git_head']}`, exported with `git archive`.  " if env.get("code_rev")
         else f"Code measured: the working tree at `{env['git_head']}`"
         + (" (with uncommitted changes under resilient/)" if env.get("git_dirty_resilient") else "") + ".  "),
        f"Commit `{env['commit']}`; produced by `{env['invocation']}`.  ",
        f"Load average (1/5/15 min): {la[0]} at start, {la[1]} at end; total run {env.get('total_s', 0):.0f} s.  ",
        (f"Workload: 2 ranks, gloo on CPU (`OMP_NUM_THREADS=1`), {cfg['steps']} steps of an MLP 64-256-64 padded to "
         f"{cfg['step_ms']:.0f} ms, a checkpoint every {cfg['every']} steps (`benchmarks/_recovery_worker.py`, attempt "
         f"style: `Run(ddp=True)`, `run.attempt()`, `run.micro_batches()`; the `_classic` modes run it with `--style "
         f"classic`: the script wraps DDP itself, no `run.attempt()`). Rank {cfg['fault_rank']} SIGKILLs itself "
         f"at step {cfg['fault_step']} ({cfg['fault_at']} of the step) on the first attempt only; with a spare it first "
         f"waits (at most {cfg['spare_wait_s']:.0f} s) for the agent's `spare_ready` event; in the `restart_all` modes "
         "every rank does so at that step (no survivor: a restart, beside a warm spare in `restart_all_spares`). "
         f"{cfg['trials']} trials per "
         "mode, modes interleaved in a rotating order, one trial at a time.  "),
        "Commands: " + "; ".join(f"{m}: `{env['commands'][m]}`" for m in ms) + ".  ",
    ]  # fmt: skip
    if "torchft" in ms:
        L.append(f"torchft settings: {env.get('torchft_settings')}.  ")
    if res.get("torchft_unavailable"):
        L.append(f"**torchft was not measured**: {res['torchft_unavailable']}  ")
    L += ["\n## Targets\n", row("target", "result", "verdict"), row("---", "---", "---")]
    names = {"spare": "spare + in-process <= 0.05x torchrun, 0 steps re-done, N/N successes",
             "shrink": "shrink <= 0.1x torchrun",
             "restart_classic": "restart of the unmodified DDP script <= 0.3x torchrun on it, <= 1 step re-done",
             "restart_all_spares": "a restart with a warm spare no slower than one without (<= 1.0x)"}
    L += [row(names[k], x["text"], f"**{x['verdict']}**") for k, x in v.items()]
    L += [f"\n## Kill of rank {cfg['fault_rank']} at step {cfg['fault_step']}\n",
          ("Cells: median (min .. max, n) over successful trials, seconds after the SIGKILL (wall clocks, one "
           "host). *Next newly completed step*: the first step index above the last one every rank completed "
           "before the kill, completed by every rank of the world after it. *Re-done*: steps completed before "
           "the kill that a process began again after it. Success: the job finished every step, exit 0 "
           "(torchft: the surviving replica group did).\n"),
          row("mode", "succeeded", "recovered by (trials)", *METRICS.values(),
              *(f"/ {NAMES[p]} (medians)" for p in PEERS if p in ms)),
          row(*["---"] * (6 + sum(p in ms for p in PEERS)))]  # fmt: skip
    for m in ms:
        s = sm["modes"][m]
        ratios = [sm["ratio"].get(p, {}).get(m) for p in PEERS if p in ms]
        rungs = ", ".join(f"{k} {n}" for k, n in sorted(s.get("rungs", {}).items())) if m in RUNGS else "-"
        L.append(row(NAMES[m], f"{s['succeeded']}/{s['trials']}", rungs, *(cell(s[k], 1 if k == "steps_redone" else 2,
                     "" if k == "steps_redone" else " s") for k in METRICS),
                     *("-" if r is None else f"{r:.3f}" for r in ratios)))  # fmt: skip
    for m in (x for x in ("spare", "shrink") if x in ms):
        s = sm["modes"][m]
        L += [f"\n### Where the milliseconds go: {m}\n",
              ("From the agent's events (`recovery_decided`, `generation_continued`, `recovered_in_process`, whose "
               "`seconds` count from the agent's detection) and the members' `group_rejoined` events (their "
               "`seconds`: abandon, wait, form, sync; the slowest member's are the agent's `slowest`). The phases "
               "add up to kill -> next new step.\n"),
              row("phase", "median (min .. max, n)"), row("---", "---")]  # fmt: skip
        if not s.get("in_process"):
            why = next((t["breakdown"].get("decision") for t in res["trials"] if t["mode"] == m and t.get("breakdown")
                        and t["breakdown"].get("decision")), None)  # fmt: skip
            L.append(f"No trial recovered in process. The agent decided: {why or '(no recovery_decided event)'}\n")
            continue
        L += [row(what, cell(s["phases"][k], 3)) for k, what in PHASES.items()]
        L += [row(f"*{what}*", cell(s["worker"][k], 3)) for k, what in WORKER_SIDE.items()]
    fails = [t for t in res["trials"] if not t["success"]]
    if fails:
        L.append("\n## Failed trials (what the output said)\n")
        for t in fails:
            lines = key_lines((t.get("evidence") or {}).get("output_tail", []))
            L.append(f"- {t['mode']} #{t['trial']}: {t.get('why')}")
            L += [f"  - `{ln}`" for ln in lines]
    L += ["\n## Per trial\n", row("mode", "#", "exit", "ok", "last done", "re-done", "next new step", "world after",
                                   "rung", "notice", "decide", "reform", "sync", "retry", "wall", "load 1m", "why"),
          row(*["---"] * 17)]  # fmt: skip
    for t in sorted(res["trials"], key=lambda t: (ms.index(t["mode"]), t["trial"])):
        b = t.get("breakdown") or {}
        p = b.get("phases") or {}
        L.append(row(t["mode"], t["trial"], t.get("rc"), "yes" if t["success"] else "**no**",
                     t.get("last_done_before", "-"), t.get("steps_redone", "-"), fmt(t.get("t_first_new_step"), 3),
                     t.get("world_after", "-"), b.get("rung") or "-", *(fmt(p.get(k), 3) for k in PHASES),
                     fmt(t.get("wall_s"), 1), f"{t.get('loadavg1', 0):.2f}", (t.get("why") or "")[:160]))  # fmt: skip
    return "\n".join(L) + "\n"
