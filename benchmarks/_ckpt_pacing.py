"""checkpoint_bench.py, (d): saves due faster than the disk writes them, ``when_busy="defer"`` vs ``"wait"``.

A Run saves every step; each step lasts a quarter of the measured write time, so every due save finds the
writer busy.  The two policies run one after the other on the same state and disk (their order alternates
with each repeat), through the public loop only: the stall is how long ``next(loop)`` takes at each
boundary (the loop's own work is the sleep between).  Reported per policy: the stall at each due boundary,
the saves committed and the due saves deferred (``checkpoint_deferred`` events).
"""

from __future__ import annotations

import time
from typing import Any

import _ckpt_peers as cp
import torch

from resilient import CheckpointConfig, EventLog, Run

POLICIES = ("defer", "wait")


def run_policy(model: torch.nn.Module, opt: torch.optim.Optimizer, directory: str, policy: str, step_s: float,
               steps: int) -> dict[str, Any]:
    events = EventLog()
    config = CheckpointConfig(dir=directory, every_steps=1, keep=2, save_on_finish=False, when_busy=policy)  # type: ignore[arg-type]
    run = Run(model=model, optimizer=opt, checkpoint=config, events=events)
    loop = run.steps(steps + 1)
    next(loop)  # step 0: nothing due
    cp.touch_state(model, opt)
    next(loop)  # step 1: the first save allocates the host buffer; not counted
    assert run.checkpoints is not None
    run.checkpoints.wait()
    stalls = []
    t_start = cp.pc()
    for _ in range(steps - 1):
        time.sleep(step_s)  # the step's own work
        cp.touch_state(model, opt)
        t0 = cp.pc()
        next(loop)
        stalls.append(cp.pc() - t0)
    wall = cp.pc() - t_start
    run.close()
    results = [r for r in run.checkpoints.results if r.step > 1]
    if not all(r.ok for r in results):
        raise RuntimeError(f"a {policy} save failed: {[r.error for r in results if not r.ok]}")
    return {"stalls_s": stalls, "wall_s": wall, "committed": len(results),
            "deferred": len(events.of_kind("checkpoint_deferred")),
            "steps_late": sum(r.step - r.deferred_from for r in results if r.deferred_from is not None)}


def busy_writer(res: dict[str, Any], model: torch.nn.Module, opt: torch.optim.Optimizer, root: str, repeats: int,
                steps: int) -> None:
    """Fills ``res["pacing"]``; the step time comes from the write time measured in (b)."""
    write_s = cp.med([x["write_s"] for x in res["save"]["samples"]["ours"]])
    step_s = max(0.02, write_s / 4)
    out: dict[str, Any] = {"step_s": step_s, "write_s": write_s, "steps": steps,
                           "runs": {p: [] for p in POLICIES}}  # fmt: skip
    for r in range(repeats):
        for policy in POLICIES[r % 2:] + POLICIES[: r % 2]:
            cp.settle()
            got = run_policy(model, opt, f"{root}/pacing_{policy}_{r}", policy, step_s, steps)
            out["runs"][policy].append(got)
            cp.rm(f"{root}/pacing_{policy}_{r}")
            cp.log(f"pacing {policy}: median stall {cp.med(got['stalls_s']):.3f}s, max {max(got['stalls_s']):.3f}s, "
                   f"{got['committed']} committed, {got['deferred']} deferred")  # fmt: skip
    for policy, runs in out["runs"].items():
        every = [s for x in runs for s in x["stalls_s"]]
        out[policy] = {"median_stall_s": cp.med(every), "max_stall_s": max(every),
                       "committed": cp.med([x["committed"] for x in runs]),
                       "deferred": cp.med([x["deferred"] for x in runs]),
                       "steps_late": cp.med([x["steps_late"] for x in runs]),
                       "wall_s": cp.med([x["wall_s"] for x in runs])}  # fmt: skip
    out["ratio"] = out["defer"]["median_stall_s"] / out["wait"]["median_stall_s"]
    res["pacing"] = out


def render(res: dict[str, Any]) -> list[str]:
    """The report's section (d), or nothing for results from before it existed."""
    p = res.get("pacing")
    if p is None:
        return []
    from _ckpt_report import fmt, row

    lines = [
        (f"\n## (d) Saves due faster than the writer: `when_busy` defer vs wait\n\nA save every step of "
         f"{fmt(p['step_s'])}; the median write takes {fmt(p['write_s'])}; {p['steps'] - 1} due boundaries per run; "
         "medians over the repeats.\n"),
        row("when_busy", "median stall / due step", "max stall", "saves committed", "due saves deferred",
            "steps late in all", "wall"),
        row(*["---"] * 7),
    ]  # fmt: skip
    for policy in POLICIES:
        x = p[policy]
        lines.append(row(policy, fmt(x["median_stall_s"]), fmt(x["max_stall_s"]), f"{x['committed']:.0f}",
                         f"{x['deferred']:.0f}", f"{x['steps_late']:.0f}", fmt(x["wall_s"])))  # fmt: skip
    lines.append(f"\ndefer / wait, median stall per due step: {p['ratio']:.3f}.")
    return lines
