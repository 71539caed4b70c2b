#!/usr/bin/env python
"""Sharded checkpoint benchmark: FSDP2 state on 2 ranks, resilient vs. DCP and the raw disk.

A model of 8 ``nn.Linear(d, d)`` fp32 layers, each ``fully_shard``-ed over 2 gloo ranks (CPU), with
AdamW moments after one real step: ``--size-gb`` of state in all (half per rank).  In each repeat, in a
rotating order, every rank at once:

- ``ours``: a due save at a step boundary of a ``resilient.Run`` that checkpoints every update (the
  public step loop): stall = how long the loop waits; write = ``SaveResult.write_s`` (hashing, write,
  fsync, index, manifest, rename);
- ``dcp_default``: ``get_state_dict`` + ``torch.distributed.checkpoint.async_save`` with a new stager per
  call; stall = until it returns; then the future is awaited;
- ``dcp_reused_stager``: the same with one ``DefaultStager`` reused across calls (cached staging buffers);
- ``raw_write``: each rank writes as many random bytes as its checkpoint file in 16 MiB ``os.write``
  calls, then ``fsync`` (the disk's reference).

Restores (warm page cache, and cold when ``drop_caches`` works): ``ours`` = a new ``resilient.Run`` over
the same model (verified restore: every block of every file read hashed, straight into the live tensors,
then ``set_state_dict``), ``dcp_load`` =
``get_state_dict`` + ``dcp.load`` + ``set_state_dict``.  Each restore is checked bit-exact.  The slowest
rank's time counts.  Also timed: each process's first ``Run()``, over an empty location (nothing to restore).  Results: ``benchmarks/results/sharded_bench.{json,md}``.

    python benchmarks/sharded_bench.py --size-gb 1 --repeats 5      # the reported run, a few minutes
    python benchmarks/sharded_bench.py --size-gb 0.05 --repeats 2 --out-dir /tmp/quick   # smoke test
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import _ckpt_peers as cp
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from resilient import CheckpointConfig, Run

SAVE_PEERS = ["ours", "dcp_default", "dcp_reused_stager", "raw_write"]
RESTORE_PEERS = ["ours", "dcp_load"]
TARGETS = {  # key: (what, reference, limit, True if ours/reference must be >= limit)
    "stall": ("loop stall per save", "the better of DCP async_save default / reused stager", 1.0, False),
    "restore": ("verified restore (warm)", "get_state_dict + dcp.load + set_state_dict", 1.0, False),
    "write": ("durable write throughput (both ranks)", "raw os.write + fsync on both ranks", 0.9, True),
    "empty": ("`Run()` with nothing to restore, a fresh process's first", None, 0.05, False),
}
"""``empty`` has no peer (DCP has no Run): its limit is in seconds."""
WORLD = 2


def build(size_gb: float, rank: int) -> tuple[nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    layers = 8
    d = max(64, int(math.sqrt(size_gb * cp.GiB / 3 / 4 / layers)) // 64 * 64)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(d, d) for _ in range(layers)])
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    torch.manual_seed(rank)
    model(torch.randn(16, d)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    local = [p.to_local() for p in model.parameters()] + [
        v.to_local() for s in opt.state.values() for v in s.values() if hasattr(v, "to_local")]
    nbytes = sum(t.numel() * t.element_size() for t in local)
    return model, opt, {"layers": layers, "d": d, "params": sum(p.numel() for p in model.parameters()),
                        "rank_state_gib": nbytes / cp.GiB, "state_gib": WORLD * nbytes / cp.GiB}


def fingerprint(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    p0, pl = next(iter(model.parameters())), list(model.parameters())[-1]
    st = opt.state[pl]
    return [p0.to_local()[:4].clone(), pl.to_local()[-4:].clone(), st["exp_avg"].to_local()[-4:].clone(),
            st["exp_avg_sq"].to_local()[:4].clone()]


def touch(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    with torch.no_grad():
        for t in [*model.parameters(), *(v for s in opt.state.values() for v in s.values())]:
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                t.mul_(1.0)


def slowest(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def settle() -> None:
    dist.barrier()
    cp.settle()
    dist.barrier()


def dcp_save(model: nn.Module, opt: torch.optim.Optimizer, path: str, stager: Any) -> dict[str, float]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    t0 = cp.pc()
    msd, osd = get_state_dict(model, opt)
    fut = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=path, async_stager=stager)
    stall = cp.pc() - t0
    fut.result()  # type: ignore[union-attr]
    return {"stall_s": slowest(stall), "total_s": slowest(cp.pc() - t0)}


def dcp_load(model: nn.Module, opt: torch.optim.Optimizer, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def worker(rank: int, args: argparse.Namespace, root: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(f"{root}/pg_store", WORLD), rank=rank, world_size=WORLD)
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    model, opt, state = build(args.size_gb, rank)
    log = cp.log if rank == 0 else (lambda msg: None)
    log(f"state: {state['params'] / 1e6:.1f} M params, {state['state_gib']:.3f} GiB in all on {WORLD} ranks")
    config = CheckpointConfig(dir=f"{root}/ours", every_steps=1, keep=2, save_on_finish=False, timeout_s=600)
    dist.barrier()
    t0 = cp.pc()
    run = Run(model=model, optimizer=opt, checkpoint=config, agent=None)  # the process's first: nothing to restore
    empty_s = slowest(cp.pc() - t0)
    log(f"Run() with nothing to restore, the process's first: {empty_s:.3f}s")
    loop = run.steps(1 << 62)
    next(loop)
    touch(model, opt)
    first = cp.ours_save(run, loop)  # allocates and faults the host buffer once, like DCP's reused stager
    log(f"ours first save: stall {first['stall_s']:.3f}s")
    mine = os.path.join(config.dir, run.checkpoints.last_committed.name, f"rank{rank:05d}.shard")  # type: ignore
    raw = memoryview(os.urandom(os.path.getsize(mine)))
    stager = DefaultStager(StagingOptions(False, False, False, False))
    dcp_save(model, opt, f"{root}/dcp_warmup", stager)
    samples: dict[str, list[dict[str, float]]] = {k: [] for k in SAVE_PEERS}
    prev: dict[str, str] = {}
    for r in range(args.repeats):
        for kind in cp_rotated(SAVE_PEERS, r):
            settle()
            touch(model, opt)
            dist.barrier()
            path = f"{root}/{kind}_{r}"
            if kind == "ours":
                s = cp.ours_save(run, loop)
                s = {**s, "stall_s": slowest(s["stall_s"]), "write_s": slowest(s["write_s"])}
                s["write_gbps"] = s["bytes"] / s["write_s"] / 1e9
            elif kind == "raw_write":
                os.makedirs(path, exist_ok=True)
                w = cp.raw_write(raw, f"{path}/rank{rank}")
                wall = slowest(w["wall_s"])
                s = {"wall_s": wall, "gbps": WORLD * len(raw) / wall / 1e9}
            else:
                s = dcp_save(model, opt, path, stager if kind == "dcp_reused_stager" else None)
            dist.barrier()
            if kind != "ours":  # the previous file goes after the timed write, as our retention does
                if rank == 0:
                    cp.rm(prev.get(kind, ""))
                prev[kind] = path
            samples[kind].append(s)
        log(f"repeat {r}: " + ", ".join(f"{k}={v[-1].get('stall_s', v[-1].get('wall_s')):.3f}s"
                                        for k, v in samples.items()))
    stager.close()
    dcp_dir = prev.get("dcp_reused_stager", "")
    ref = fingerprint(model, opt)
    run.close()
    del run, loop
    restores: dict[str, dict[str, list[float]]] = {}
    conditions = ["warm"] + (["cold"] if args.cold else [])
    for cond in conditions:
        restores[cond] = {k: [] for k in RESTORE_PEERS}
        for r in range(args.repeats):
            for kind in cp_rotated(RESTORE_PEERS, r):
                dist.barrier()
                if rank == 0:
                    files = cp_files(config.dir if kind == "ours" else dcp_dir)
                    cp.preread(files) if cond == "warm" else cp.drop_caches()
                settle()
                t0 = cp.pc()
                if kind == "ours":
                    restored = Run(model=model, optimizer=opt, checkpoint=config, agent=None)
                    assert restored.restored_from is not None
                    restored.close()
                else:
                    dcp_load(model, opt, dcp_dir)
                restores[cond][kind].append(slowest(cp.pc() - t0))
                if not all(torch.equal(a, b) for a, b in zip(fingerprint(model, opt), ref)):
                    raise RuntimeError(f"{kind}: restored state differs from the saved state")
        log(f"restore {cond} (median s): " + ", ".join(f"{k}={cp.med(v):.3f}" for k, v in restores[cond].items()))
    floors: dict[str, list[float]] = {"sha256": [], "xxh3": [], "fresh_memory": []}
    for _ in range(args.repeats):  # what any verified restore into new memory pays, both ranks at once
        settle()
        floors["sha256"].append(slowest(sha256_floor(raw)))
        settle()
        floors["xxh3"].append(slowest(xxh3_floor(raw)))
        settle()
        t0 = cp.pc()
        fresh = torch.empty(len(raw), dtype=torch.uint8).fill_(1)  # new pages, each written once
        floors["fresh_memory"].append(slowest(cp.pc() - t0))
        del fresh
    log("floors (median s): " + ", ".join(f"{k}={cp.med(v):.3f}" for k, v in floors.items()))
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"state": state, "first_save": first, "save": samples, "restore": restores,
                       "floors": floors, "empty_s": empty_s}, f)
    dist.destroy_process_group()


def sha256_floor(data: memoryview, piece: int = 16 << 20) -> float:
    """Seconds to SHA-256 ``data`` in 16 MiB pieces on 2 threads (hashlib releases the GIL)."""
    import hashlib
    from concurrent.futures import ThreadPoolExecutor

    t0 = cp.pc()
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda i: hashlib.sha256(data[i:i + piece]).digest(), range(0, len(data), piece)))
    return cp.pc() - t0


def xxh3_floor(data: memoryview, piece: int = 4 << 20) -> float:
    """Seconds to xxh3-128 ``data`` in 4 MiB blocks on 2 threads (the default digest; it releases the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    import xxhash

    t0 = cp.pc()
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda i: xxhash.xxh3_128(data[i:i + piece]).digest(), range(0, len(data), piece)))
    return cp.pc() - t0


def cp_rotated(items: list[str], r: int) -> list[str]:
    return items[r % len(items):] + items[: r % len(items)]


def cp_files(directory: str) -> list[str]:
    return [os.path.join(d, f) for d, _, names in os.walk(directory) for f in names]


def verdicts(res: dict[str, Any]) -> dict[str, dict[str, Any]]:
    save, restore = res["save"], res["restore"]
    stall = {k: cp.med([x["stall_s"] for x in save[k]]) for k in ("ours", "dcp_default", "dcp_reused_stager")}
    out = {
        "stall": {"ours": stall["ours"], "ref": min(stall["dcp_default"], stall["dcp_reused_stager"])},
        "restore": {"ours": cp.med(restore["warm"]["ours"]), "ref": cp.med(restore["warm"]["dcp_load"])},
        "write": {"ours": cp.med([x["write_gbps"] for x in save["ours"]]),
                  "ref": cp.med([x["gbps"] for x in save["raw_write"]])},
        "empty": {"ours": res["empty_s"], "ref": None},
    }
    for key, x in out.items():
        *_, limit, at_least = TARGETS[key]
        x["ratio"], x["limit"] = (x["ours"] / x["ref"] if x["ref"] else x["ours"]), limit
        x["verdict"] = "PASS" if (x["ratio"] >= limit if at_least else x["ratio"] <= limit) else "MISS"
    return out


def render(res: dict[str, Any]) -> str:
    env, st, save = res["environment"], res["state"], res["save"]
    fs = env["filesystem"]
    L = ["# Sharded checkpoint benchmark (FSDP2 on 2 ranks)\n",
         f"Command: `{env['command']}`  ",
         f"Commit: {env['git_commit']} ({env['git_head']}); uncommitted changes to resilient/: "
         f"{len(env['git_dirty_resilient'])}  ",
         f"Machine: {env['cpus']} CPUs, {env['mem_total_gb']:.1f} GB RAM, kernel {env['kernel']}, torch {env['torch']}; "
         f"{fs.get('fstype')} on {fs.get('device')}  ",
         f"Load average at start {env['loadavg_start']}, at end {env['loadavg_end']}; total {env['total_s']:.0f} s  ",
         f"State: {st['layers']} x Linear({st['d']}, {st['d']}) + AdamW moments = {st['state_gib']:.3f} GiB "
         f"({st['rank_state_gib']:.3f} GiB per rank); {res['config']['repeats']} repeats, medians, slowest rank.\n",
         "| target | ours | reference | ours / reference | limit | verdict |", "|---|---|---|---|---|---|"]
    for key, x in res["verdicts"].items():
        name, ref, limit, at_least = TARGETS[key]
        unit = "GB/s" if key == "write" else "s"
        if x["ref"] is None:  # an absolute limit
            L.append(f"| {name} | {x['ours']:.3f} {unit} | - | - | {'>=' if at_least else '<='} {limit} {unit} | "
                     f"**{x['verdict']}** |")
            continue
        L.append(f"| {name} | {x['ours']:.3f} {unit} | {ref}: {x['ref']:.3f} {unit} | {x['ratio']:.3f} | "
                 f"{'>=' if at_least else '<='} {limit} | **{x['verdict']}** |")
    L += ["\n## Saves (seconds; slowest rank)\n", "| peer | median stall | min | max | median total or wall |",
          "|---|---|---|---|---|"]
    for k, xs in save.items():
        stalls = [x.get("stall_s", x.get("wall_s")) for x in xs]
        total = cp.med([x.get("total_s", x.get("wall_s", 0.0)) for x in xs])
        L.append(f"| {k} | {cp.med(stalls):.3f} | {min(stalls):.3f} | {max(stalls):.3f} | {total:.3f} |")
    ours_gbps = ", ".join(f"{x['write_gbps']:.2f}" for x in save["ours"])
    raw_gbps = ", ".join(f"{x['gbps']:.2f}" for x in save["raw_write"])
    L.append(f"\nours first save (host buffer allocated): stall {res['first_save']['stall_s']:.3f} s. "
             f"Write GB/s per repeat, ours: {ours_gbps}; raw: {raw_gbps}.\n")
    L += ["## Restores (seconds; slowest rank)\n", "| cache | peer | median | min | max |", "|---|---|---|---|---|"]
    for cond, peers in res["restore"].items():
        for k, xs in peers.items():
            L.append(f"| {cond} | {k} | {cp.med(xs):.3f} | {min(xs):.3f} | {max(xs):.3f} |")
    fl = res.get("floors", {})
    if fl:
        L += ["\n## Floors of a verified restore (seconds; slowest rank, both ranks at once)\n",
              "| what | median | min | max |", "|---|---|---|---|",
              *(f"| {label} | {cp.med(fl[k]):.3f} | {min(fl[k]):.3f} | {max(fl[k]):.3f} |" for k, label in (
                  ("sha256", "SHA-256 of a rank's file bytes in memory, 2 threads per rank"),
                  ("xxh3", "xxh3-128 (the default digest) of the same, 2 threads per rank"),
                  ("fresh_memory", "writing as many bytes into new memory (pages never touched)")))]
    return "\n".join(L) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=1.0, help="state in GiB over both ranks (default 1.0)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default="/var/tmp", help="parent of the scratch dir, on the disk to test")
    ap.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args(argv)
    os.makedirs(args.dir, exist_ok=True)
    root = tempfile.mkdtemp(prefix="sharded_bench_", dir=args.dir)
    started = time.perf_counter()
    try:
        env = cp.environment(root)
        if env["filesystem"].get("fstype") in ("tmpfs", "ramfs"):
            raise SystemExit(f"{root} is on tmpfs: pick another --dir")
        args.cold = bool(env["drop_caches"]["works"])
        out = os.path.join(root, "result.json")
        mp.spawn(worker, args=(args, root, out), nprocs=WORLD, join=True)
        with open(out) as f:
            res = json.load(f)
        res["config"] = {k: v for k, v in vars(args).items()}
        env |= {"loadavg_end": list(os.getloadavg()), "total_s": time.perf_counter() - started}
        res["environment"] = env
        res["targets"] = {k: f"ours {n} {'>=' if a else '<='} {lim} {f'x {ref}' if ref else 's'}"
                          for k, (n, ref, lim, a) in TARGETS.items()}
        res["verdicts"] = verdicts(res)
        os.makedirs(args.out_dir, exist_ok=True)
        base = os.path.join(args.out_dir, "sharded_bench")
        with open(base + ".json", "w") as f:
            json.dump(res, f, indent=1, default=str)
        with open(base + ".md", "w") as f:
            f.write(render(res))
        cp.log(f"wrote {base}.json and .md")
        for k, x in res["verdicts"].items():
            print(f"{x['verdict']}  {k:8s} ratio {x['ratio']:.3f} (limit {x['limit']}): {res['targets'][k]}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
