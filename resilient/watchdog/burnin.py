"""Burn-in: what a node must show before it rejoins after a quarantine, measured and judged against its fleet.

:func:`measure` runs in a process of its own (``python -m
resilient.watchdog.burnin --scratch DIR``, started by the agent, which never
imports torch) and measures three things a training node needs:

- ``matmul_gflops``: a square matmul on the node's accelerator (CUDA where
  present, else the CPU), best of several;
- ``disk_write_mbps``: writing a file in the node's directory and fsyncing
  it, best of several;
- ``allreduce_gbps``: a gloo all-reduce between two processes of this node
  over TCP on ``--addr`` (the address its peers reach it at), best of several.
  It exercises the collective stack the ranks use; a pair across machines
  is not measured here.

Best-of rather than the median, because a node is judged by what it can
still do: interference from its neighbours only ever makes a repeat slower.
:func:`judge` (pure) compares each measure with the median of the other
nodes' latest passing burn-ins and passes when every one reaches
``min_ratio`` of it; with no other node's numbers it passes on its own
(finite, positive numbers) and says so.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MEASURES = ("matmul_gflops", "disk_write_mbps", "allreduce_gbps")
"""What a burn-in measures; larger is better for each."""


@dataclass(frozen=True)
class Check:
    """One measure against the fleet's median for it."""

    measure: str
    value: float
    reference: float | None
    """The median of the other nodes' passing burn-ins; None when no other node has one."""
    ratio: float | None
    passed: bool


@dataclass(frozen=True)
class BurnInVerdict:
    """Whether a node may rejoin, why, and each measure's comparison."""

    passed: bool
    reason: str
    checks: tuple[Check, ...]


def judge(result: Mapping[str, Any], fleet: Mapping[str, Mapping[str, Any]], node: str,
          min_ratio: float) -> BurnInVerdict:
    """Judge ``node``'s burn-in ``result`` against the other nodes' latest passing ones in ``fleet``. Pure."""
    checks = []
    for m in MEASURES:
        value = result.get(m)
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            checks.append(Check(m, float("nan") if value is None else float(value), None, None, False))
            continue
        peers = [float(r[m]) for n, r in fleet.items() if n != node and r.get("passed") and
                 isinstance(r.get(m), (int, float)) and math.isfinite(r[m]) and r[m] > 0]
        reference = statistics.median(peers) if peers else None
        ratio = None if reference is None else value / reference
        checks.append(Check(m, float(value), reference, ratio, ratio is None or ratio >= min_ratio))
    failed = [c for c in checks if not c.passed]
    compared = [c for c in checks if c.reference is not None]
    if failed:
        parts = [f"{c.measure} {c.value:.3g}" + ("" if c.ratio is None else
                                                 f" is {c.ratio:.0%} of the fleet's median {c.reference:.3g}")
                 for c in failed]
        return BurnInVerdict(False, f"burn-in failed (needs {min_ratio:.0%} of the fleet's median): "
                             + "; ".join(parts), tuple(checks))
    if not compared:
        return BurnInVerdict(True, "burn-in passed on its own numbers: no other node of the fleet has a burn-in "
                             "to compare with", tuple(checks))
    worst = min(compared, key=lambda c: c.ratio or 0.0)
    return BurnInVerdict(True, f"burn-in passed: every measure at least {min_ratio:.0%} of the fleet's median "
                         f"(lowest: {worst.measure} at {worst.ratio:.0%})", tuple(checks))


# ---------------------------------------------------------------- measuring (its own process, with torch)
def _allreduce_peer(rank: int, addr: str, port: int, mib: int, repeats: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    store = dist.TCPStore(addr, port, 2, False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    t = torch.ones(mib * 262144)  # float32: 4 bytes each
    dist.all_reduce(t)  # warm the connections
    best = math.inf
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(t)
        best = min(best, time.perf_counter() - start)
    dist.destroy_process_group()
    if out is not None:
        out.put(t.numel() * 4 / best / 1e9)


def _allreduce_gbps(addr: str, mib: int, repeats: int) -> float:
    """A gloo all-reduce of ``mib`` MiB between this process and a forked one (before any compute: OpenMP
    state does not survive a fork)."""
    import multiprocessing as mp

    import torch.distributed as dist

    master = dist.TCPStore(addr, 0, 2, True, wait_for_workers=False)
    ctx = mp.get_context("fork")
    results: Any = ctx.Queue()
    child = ctx.Process(target=_allreduce_peer, args=(1, addr, master.port, mib, repeats, None), daemon=True)
    child.start()
    try:
        _allreduce_peer(0, addr, master.port, mib, repeats, results)
        return float(results.get(timeout=60))
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()


def _matmul_gflops(n: int, repeats: int) -> tuple[float, str]:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    (a @ b).sum().item()  # warm-up (and CUDA context)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        c = a @ b
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    del c
    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    return 2.0 * n ** 3 / best / 1e9, name


def _disk_write_mbps(scratch: Path, mib: int, repeats: int) -> float:
    scratch.mkdir(parents=True, exist_ok=True)
    path = scratch / f".burn-in-{os.getpid()}.tmp"
    block = os.urandom(1 << 20)
    best = math.inf
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                for _ in range(mib):
                    os.write(fd, block)
                os.fsync(fd)
            finally:
                os.close(fd)
            best = min(best, time.perf_counter() - start)
    finally:
        path.unlink(missing_ok=True)
    return mib * (1 << 20) / best / 1e6


def measure(scratch: Path, *, addr: str = "127.0.0.1", matmul_n: int = 768, disk_mib: int = 32,
            allreduce_mib: int = 8, repeats: int = 5) -> dict[str, Any]:
    """Measure this node (see the module docstring): the numbers, the device, and how long it took."""
    start = time.perf_counter()
    allreduce = _allreduce_gbps(addr, allreduce_mib, repeats)
    gflops, device = _matmul_gflops(matmul_n, repeats)
    disk = _disk_write_mbps(scratch, disk_mib, repeats)
    return {"matmul_gflops": round(gflops, 3), "disk_write_mbps": round(disk, 3), "allreduce_gbps": round(allreduce, 4),
            "device": device, "seconds": round(time.perf_counter() - start, 3),
            "sizes": {"matmul_n": matmul_n, "disk_mib": disk_mib, "allreduce_mib": allreduce_mib, "repeats": repeats}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m resilient.watchdog.burnin",
                                description="Measure this node for a burn-in; prints one JSON object.")
    p.add_argument("--scratch", type=Path, required=True, help="a directory on the disk checkpoints go to")
    p.add_argument("--addr", default="127.0.0.1", help="the address this node's peers reach it at")
    p.add_argument("--matmul-n", type=int, default=768)
    p.add_argument("--disk-mib", type=int, default=32)
    p.add_argument("--allreduce-mib", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    result = measure(args.scratch, addr=args.addr, matmul_n=args.matmul_n, disk_mib=args.disk_mib,
                     allreduce_mib=args.allreduce_mib, repeats=args.repeats)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
