#!/usr/bin/env python
"""Checkpoint benchmark: resilient's async checkpoints vs. torch.save, DCP and the raw disk.

(a) loop stall per checkpoint, (b) background durable write throughput, (c) verified restore (warm and
cold) plus restore + first optimizer step, (d) saves due faster than the disk writes them (when_busy
"defer" vs "wait", see _ckpt_pacing.py), on a state of 8 x nn.Linear fp32 + AdamW moments (--size-gb).
One process, one run; peers are interleaved in a rotating order inside each repeat, so every ratio
compares peers measured under the same conditions.  Results go to benchmarks/results/checkpoint_bench
.{json,md}; benchmarks/README.md says what each line means.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shutil
import sys
import tempfile
from typing import Any

import _ckpt_pacing
import _ckpt_peers as cp
import torch
from _ckpt_report import TARGETS, describe, render_markdown, verdicts

from resilient import CheckpointConfig, Run
from resilient.checkpoint.coordinator import Coordinator
from resilient.checkpoint.manager import CheckpointManager
from resilient.core.events import EventLog

SAVE_PEERS = ["ours", "torch_save_fsync", "dcp_default", "dcp_reused_stager", "raw_write", "dd"]


def rotated(items: list[str], r: int) -> list[str]:
    return items[r % len(items) :] + items[: r % len(items)]


def saves(res: dict[str, Any], model: torch.nn.Module, opt: torch.optim.Optimizer, root: str, repeats: int) -> Run:
    """(a) stall and (b) write throughput; returns the Run (whose checkpoints (c) restores)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    dist.init_process_group("gloo", store=dist.FileStore(f"{root}/pg_store", 1), rank=0, world_size=1)
    # Saves go through the public step loop: a Run that checkpoints every update, whose loop we resume
    # without training (the state is touched instead), so each resume is one due save at a boundary.
    config = CheckpointConfig(dir=f"{root}/ours", every_steps=1, keep=2, save_on_finish=False)
    run = Run(model=model, optimizer=opt, checkpoint=config)
    loop = run.steps(1 << 62)
    next(loop)  # step 0: nothing to save yet
    cp.settle()
    cp.touch_state(model, opt)
    first = cp.ours_save(run, loop)  # the first save: the host buffer is allocated and faulted (Run.prepare)
    cp.log(f"ours first save: stall {first['stall_s']:.3f}s, write {first['write_gbps']:.2f} GB/s")
    nbytes = int(first["bytes"])
    raw = memoryview(os.urandom(nbytes))  # the raw reference writes the same number of (random) bytes
    stager = DefaultStager(StagingOptions(False, False, False, False))
    cp.dcp_save(model, opt, f"{root}/dcp_warmup", stager)  # allocate the reused stager once, like ours
    cp.rm(f"{root}/dcp_warmup")

    samples: dict[str, list[dict[str, Any]]] = {k: [] for k in SAVE_PEERS}
    prev: dict[str, str] = {}
    for r in range(repeats):
        for kind in rotated(SAVE_PEERS, r):
            cp.settle()
            if kind not in ("raw_write", "dd"):
                cp.touch_state(model, opt)
            path = f"{root}/{kind}_{r}"
            if kind == "ours":
                s = cp.ours_save(run, loop)  # retention deletes the old one after the commit
            elif kind == "torch_save_fsync":
                s = cp.torch_save_fsync(model, opt, path)
            elif kind.startswith("dcp"):
                s = cp.dcp_save(model, opt, path, stager if kind == "dcp_reused_stager" else None)
            elif kind == "raw_write":
                s = cp.raw_write(raw, path)
            else:
                s = cp.dd_write(path, nbytes)
            # Delete the previous file only AFTER the timed write, as our retention does: deleting right
            # before it hands that writer 1 GiB of just-freed page-cache pages, which on this VM (memory
            # balloon) are several times cheaper than pages the hypervisor took back.
            if kind != "ours":
                cp.rm(prev.get(kind, ""))
                prev[kind] = path
            samples[kind].append(s | {"loadavg1": os.getloadavg()[0]})
        last = {k: v[-1].get("stall_s", v[-1].get("wall_s")) for k, v in samples.items()}
        cp.log(f"repeat {r}: " + ", ".join(f"{k}={t:.3f}s" for k, t in last.items()))
    stager.close()
    del raw
    torch_file = prev.pop("torch_save_fsync")  # kept for the restore comparison
    for path in prev.values():
        cp.rm(path)

    res["save"] = {"checkpoint_bytes": nbytes, "ours_first": first, "samples": samples}
    res["torch_file"] = torch_file
    return run


def restores(res: dict[str, Any], model: torch.nn.Module, opt: torch.optim.Optimizer, run: Run, repeats: int) -> None:
    """(c) restore, warm and cold, then restore + first optimizer step (warm)."""
    assert run.checkpoints is not None and run.checkpoints.last_committed is not None
    ref, cfg, tfile = cp.fingerprint(model, opt), run.checkpoints.config, res["torch_file"]
    ckpt_dir = os.path.join(cfg.dir, run.checkpoints.last_committed.name)
    ours_files = sorted((e.path for e in os.scandir(ckpt_dir)), key=os.path.getsize, reverse=True)
    run.close()
    del run
    gc.collect()

    def torch_load_lsd() -> None:
        sd = torch.load(tfile, weights_only=True)
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optimizer"])

    peers = {
        "ours_run_ctor": lambda: Run(model=model, optimizer=opt, checkpoint=cfg).restored_from,
        "ours_manager_restore": lambda: CheckpointManager(cfg, Coordinator(), EventLog()).restore(),
        "torch_load_load_state_dict": torch_load_lsd,
        "torch_load_only": lambda: torch.load(tfile, weights_only=True),
    }
    files = {k: ours_files if k.startswith("ours") else [tfile] for k in peers}
    res["restore"] = {}
    for cond in ["warm"] + (["cold"] if res["environment"]["drop_caches"]["works"] else []):
        samples: dict[str, list[float]] = {k: [] for k in peers}
        cached: dict[str, list[float | None]] = {k: [] for k in peers}
        for r in range(repeats):
            for k in rotated(list(peers), r):
                cp.preread(files[k]) if cond == "warm" else cp.drop_caches()
                cached[k].append(cp.cached_fraction(files[k][0]))
                cp.settle()
                t0 = cp.pc()
                got = peers[k]()
                samples[k].append(cp.pc() - t0)
                assert got is not None or not k.startswith("ours"), f"{k}: nothing restored"
                del got
                if k in ("ours_run_ctor", "torch_load_load_state_dict"):
                    cp.check_restored(model, opt, ref)
        res["restore"][cond] = {k: cp.summary(v) for k, v in samples.items()} | {"cached_fraction_before": cached}
        cp.log(f"restore {cond} (median s): " + ", ".join(f"{k}={cp.med(v):.3f}" for k, v in samples.items()))

    # Work a restore defers (e.g. page faults on optimizer state) shows up in the first optimizer
    # step after it.  Real steps change the state, so this runs last.
    x = torch.randn(32, res["state"]["d"])

    def train_step() -> float:
        t0 = cp.pc()
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return cp.pc() - t0

    fs: dict[str, dict[str, list[float]]] = {
        k: {"restore_s": [], "first_step_s": [], "second_step_s": []}
        for k in ("ours_run_ctor", "torch_load_load_state_dict")
    }
    for r in range(repeats):
        for k in rotated(list(fs), r):
            cp.preread(files[k])
            cp.settle()
            t0 = cp.pc()
            peers[k]()
            fs[k]["restore_s"].append(cp.pc() - t0)
            fs[k]["first_step_s"].append(train_step())
            fs[k]["second_step_s"].append(train_step())
    out: dict[str, Any] = {"batch": 32}
    res["first_step"] = out
    for k, d in fs.items():
        out[k] = {m: cp.summary(v) for m, v in d.items()}
        out[k]["restore_plus_first_step_s"] = cp.med(d["restore_s"]) + cp.med(d["first_step_s"])
    cp.log(
        "restore + first step (median s): " + ", ".join(f"{k}={out[k]['restore_plus_first_step_s']:.3f}" for k in fs)
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=1.0, help="state dict size in GiB (default 1.0)")
    ap.add_argument("--repeats", type=int, default=3, help="repeats per measurement; medians reported (default 3)")
    ap.add_argument("--dir", default="/var/tmp", help="parent of the scratch dir, on the disk to test (/var/tmp)")
    ap.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--pacing-steps", type=int, default=16, help="steps per when_busy policy run in (d) (16)")
    ap.add_argument("--render", metavar="JSON", help="only re-render the .md next to an existing results .json")
    args = ap.parse_args(argv)
    if args.render:
        with open(args.render) as f, open(os.path.splitext(args.render)[0] + ".md", "w") as out:
            out.write(render_markdown(json.load(f)))
        return 0
    os.makedirs(args.dir, exist_ok=True)
    root = tempfile.mkdtemp(prefix="ckpt_bench_", dir=args.dir)
    t_start = cp.pc()
    try:
        res: dict[str, Any] = {"config": vars(args) | {"dir": root}, "targets": {k: describe(k) for k in TARGETS}}
        res["environment"] = env = cp.environment(root)
        fs = env["filesystem"]
        cp.log(f"{fs.get('fstype')} on {fs.get('device')} ({fs.get('mount_options')}); drop_caches works: "
               f"{env['drop_caches']['works']}")  # fmt: skip
        if fs.get("fstype") in ("tmpfs", "ramfs"):
            raise SystemExit(f"{root} is on {fs['fstype']}, not a disk: pick another --dir")
        model, opt, res["state"] = cp.build_state(args.size_gb)
        cp.log(f"state: {res['state']['params'] / 1e6:.1f} M params, {res['state']['state_gib']:.3f} GiB state dict")
        run = saves(res, model, opt, root, args.repeats)
        _ckpt_pacing.busy_writer(res, model, opt, root, args.repeats, args.pacing_steps)
        restores(res, model, opt, run, args.repeats)
        res["verdicts"] = verdicts(res)
        env |= {"loadavg_end": list(os.getloadavg()), "total_s": cp.pc() - t_start,
                "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9}  # fmt: skip
        os.makedirs(args.out_dir, exist_ok=True)
        base = os.path.join(args.out_dir, "checkpoint_bench")
        with open(base + ".json", "w") as f:
            json.dump(res, f, indent=1, default=str)
        with open(base + ".md", "w") as f:
            f.write(render_markdown(res))
        cp.log(f"wrote {base}.json and .md")
        for k, x in res["verdicts"].items():
            print(f"{x['verdict']}  {k:13s} ratio {x['ratio']:.3f} (limit {x['limit']}): {describe(k)}")
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
