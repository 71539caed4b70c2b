"""Verdicts and the Markdown report of checkpoint_bench.py: pure functions of the results dict.

``checkpoint_bench.py --render JSON`` uses render_markdown() to re-render a report without re-running.
"""

from __future__ import annotations

from typing import Any

import _ckpt_pacing
from _ckpt_peers import GiB, med

# key: (what is compared, reference, limit, True if ours/reference must be >= the limit)
TARGETS: dict[str, tuple[str, str, float, bool]] = {
    "stall": ("stall per checkpoint (steady state)", "torch.save+fsync", 0.10, False),
    "write": ("background durable write (incl. hashing)", "raw os.write+fsync", 0.9, True),
    "restore_warm": ("verified restore, warm cache", "torch.load+load_state_dict", 1.3, False),
    "restore_cold": ("verified restore, cold cache", "torch.load", 1.2, False),
}
RESTORE_REFERENCE = {"restore_warm": "torch_load_load_state_dict", "restore_cold": "torch_load_only"}
"""The peer each restore target is measured against (the cold one against ``torch.load`` alone, unverified and
leaving the model as it was)."""


def describe(key: str) -> str:
    name, ref, limit, at_least = TARGETS[key]
    return f"ours {name} {'>=' if at_least else '<='} {limit} x {ref}"


def verdicts(res: dict[str, Any]) -> dict[str, Any]:
    sm = res["save"]["samples"]
    bw = [x["write_gbps"] for x in sm["ours"]]
    v: dict[str, Any] = {
        "stall": {"ours": med([x["stall_s"] for x in sm["ours"]]),
                  "ref": med([x["stall_s"] for x in sm["torch_save_fsync"]])},
        "write": {"ours": med(bw), "ref": med([x["gbps"] for x in sm["raw_write"]]),
                  "per_repeat_ratio": [o / w["gbps"] for o, w in zip(bw, sm["raw_write"])],
                  "ratio_vs_dd": med(bw) / med([x["gbps"] for x in sm["dd"]])},
    }  # fmt: skip
    for cond, rr in res["restore"].items():
        ours, only = rr["ours_run_ctor"]["median"], rr["torch_load_only"]["median"]
        ref = rr[RESTORE_REFERENCE[f"restore_{cond}"]]["median"]
        v[f"restore_{cond}"] = {"ours": ours, "ref": ref, "ratio_vs_load_only": ours / only}
    for k, x in v.items():
        *_, limit, at_least = TARGETS[k]
        x["ratio"], x["limit"] = x["ours"] / x["ref"], limit
        x["verdict"] = "PASS" if (x["ratio"] >= limit if at_least else x["ratio"] <= limit) else "MISS"
    return v


def fmt(x: float | None, unit: str = "s", nd: int = 3) -> str:
    return "-" if x is None else f"{x:.{nd}f} {unit}".strip()


def row(*cells: Any) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def stats(xs: list[float], unit: str = "s", nd: int = 3) -> list[str]:
    return [fmt(med(xs), unit, nd), fmt(min(xs), unit, nd), fmt(max(xs), unit, nd)]


def render_markdown(res: dict[str, Any]) -> str:
    env, st, s, v, fst = res["environment"], res["state"], res["save"], res["verdicts"], res["first_step"]
    fs, dc, sm = env["filesystem"], env["drop_caches"], s["samples"]
    la = [" ".join(f"{x:.2f}" for x in env[k]) for k in ("loadavg_start", "loadavg_end")]
    dirty = " (with uncommitted changes under resilient/)" if env["git_dirty_resilient"] else ""
    L = [
        "# Checkpoint benchmark\n",
        (f"State: {st['params'] / 1e6:.1f} M fp32 params ({st['layers']} x Linear({st['d']},{st['d']})) + AdamW "
        f"exp_avg/exp_avg_sq after one step = {st['state_gib']:.3f} GiB; our checkpoint file "
        f"{s['checkpoint_bytes'] / GiB:.3f} GiB.  "),
        f"Disk: `{fs['path']}` on **{fs.get('fstype')}** ({fs.get('device')}, `{fs.get('mount_options')}`).  ",
        (f"drop_caches: {'works' if dc['works'] else 'does NOT work, so no cold restores'} "
        f"(probe file cached fraction {dc['cached_before']} -> {dc['cached_after']}).  "),
        (f"Host: {env['cpus']} CPUs, {env['mem_total_gb']:.1f} GB RAM, kernel {env['kernel']}, torch {env['torch']} "
        f"({env['torch_threads']} threads), python {env['python']}.  "),
        f"Load average (1/5/15 min): {la[0]} at start, {la[1]} at end.  ",
        f"Code: `{env['git_head']}`{dirty} (commit `{env['git_commit']}`).  ",
        f"Command: `{env['command']}`.  ",
        (f"Repeats: {res['config']['repeats']} (medians; peers interleaved in rotating order). "
        f"Peak RSS {env['peak_rss_gb']:.2f} GB. Total run {env['total_s']:.0f} s.\n"),
        "## Targets\n",
        row("target", "ours", "reference", "ours / reference", "limit", "verdict"),
        row(*["---"] * 6),
    ]  # fmt: skip
    for k, x in v.items():
        name, ref, limit, at_least = TARGETS[k]
        unit, nd = ("GB/s", 2) if k == "write" else ("s", 3)
        L.append(row(name, fmt(x["ours"], unit, nd), f"{ref} {fmt(x['ref'], unit, nd)}", f"{x['ratio']:.3f}",
                     f"{'>=' if at_least else '<='} {limit:.2f}", f"**{x['verdict']}**"))  # fmt: skip
    o, t = (fst[k]["restore_plus_first_step_s"] for k in ("ours_run_ctor", "torch_load_load_state_dict"))
    L.append(row("*not a spec target:* warm restore + first optimizer step", fmt(o),
                 f"torch.load+load_state_dict + first step {fmt(t)}", f"{o / t:.3f}", "(info)", "-"))  # fmt: skip

    stall = {k: [x["stall_s"] for x in sm[k]] for k in sm if k not in ("raw_write", "dd")}
    until = {k: fmt(med([x["total_s"] for x in sm[k]])) for k in ("ours", "dcp_default", "dcp_reused_stager")}
    mgr = fmt(med([x["manager_stall_s"] for x in sm["ours"]]))
    b2b = [row("ours, next save while previous still writing", *stats([x["second_stall_s"] for x in s["back_to_back"]]),
               "= wait for the previous commit + snapshot")] if "back_to_back" in s else []  # results before (d)
    L += [
        "\n## (a) Training-loop stall per checkpoint\n",
        row("method", "median", "min", "max", "notes"),
        row(*["---"] * 5),
        row("ours, first save", fmt(s["ours_first"]["stall_s"]), "", "", "allocates + faults the host buffer"),
        row("ours, steady state (the step loop at a due boundary)", *stats(stall["ours"]),
            f"manager's stall_s {mgr}; until durable commit {until['ours']}"),
        *b2b,
        row("torch.save + fsync", *stats(stall["torch_save_fsync"]), "the whole call blocks"),
        row("DCP async_save, default (new stager per call)", *stats(stall["dcp_default"]),
            f"until future done {until['dcp_default']}"),
        row("DCP async_save, reused DefaultStager", *stats(stall["dcp_reused_stager"]),
            f"until future done {until['dcp_reused_stager']}"),
        f"\n## (b) Background durable write throughput ({s['checkpoint_bytes'] / 1e9:.3f} GB per write)\n",
        row("writer", "median GB/s", "min", "max", "notes"),
        row(*["---"] * 5),
        row("ours: bytes / SaveResult.write_s", *stats([x["write_gbps"] for x in sm["ours"]], ""),
            "hash + write + fsync + manifest + rename + dir fsyncs"),
        row("raw: 16 MiB os.write + fsync", *stats([x["gbps"] for x in sm["raw_write"]], ""), "the reference"),
        row("dd if=/dev/zero bs=16M conv=fsync", *stats([x["gbps"] for x in sm["dd"]], ""), "incl. process start"),
        (f"\nours/raw per repeat: {', '.join(f'{x:.2f}' for x in v['write']['per_repeat_ratio'])}; "
        f"ours/dd (medians): {v['write']['ratio_vs_dd']:.2f}.\n"),
        "## (c) Restore (ours includes verification)\n",
        row("method", "cache", "median", "min", "max"),
        row(*["---"] * 5),
    ]  # fmt: skip
    for cond, rr in res["restore"].items():
        L += [row(k, cond, fmt(x["median"]), fmt(x["min"]), fmt(x["max"])) for k, x in rr.items() if "median" in x]
    L.append("")
    for cond in res["restore"]:
        x = v[f"restore_{cond}"]
        L.append(f"{cond}: ours / (torch.load + load_state_dict) = {x['ratio']:.2f}; "
                 f"ours / torch.load alone = {x['ratio_vs_load_only']:.2f}  ")  # fmt: skip
    L += [
        f"\n### Restore + first optimizer step (warm cache, batch {fst['batch']}; not a spec target)\n",
        row("restore", "restore", "first step", "next step", "restore + first step"),
        row(*["---"] * 5),
    ]
    for k in ("ours_run_ctor", "torch_load_load_state_dict"):
        x = fst[k]
        L.append(row(k, *(fmt(x[m]["median"]) for m in ("restore_s", "first_step_s", "second_step_s")),
                     fmt(x["restore_plus_first_step_s"])))  # fmt: skip
    L += _ckpt_pacing.render(res)
    return "\n".join(L) + "\n"
