"""Building blocks of checkpoint_bench.py: environment probes, the training state, and the timed peers.

Each peer function times exactly one operation and returns plain numbers; the orchestration
(interleaving, repeats, deleting old files) lives in checkpoint_bench.py.
"""

from __future__ import annotations

import gc
import math
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

import resilient
from resilient import Run

GiB, MiB = 1 << 30, 1 << 20
PIECE = 16 * MiB  # write size of the raw and dd references
pc = time.perf_counter


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def summary(xs: list[float]) -> dict[str, Any]:
    return {"n": len(xs), "median": med(xs), "min": min(xs), "max": max(xs), "samples": xs}


def _cmd(*argv: str) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, check=False).stdout.strip()
    except OSError:  # tool not installed
        return ""


def rm(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.remove(path)


def settle(seconds: float = 0.5) -> None:
    """Flush everything dirty (incl. discards of deleted files) so no peer pays for another's I/O."""
    gc.collect()
    os.sync()
    time.sleep(seconds)


def drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            return f.write("3\n") > 0
    except OSError:
        return False


def cached_fraction(path: str) -> float | None:
    """Fraction of ``path`` resident in the page cache (util-linux fincore), None if unknown."""
    out = _cmd("fincore", "--bytes", "--noheadings", "--raw", "--output", "RES,SIZE", path).split()
    return int(out[0]) / max(1, int(out[1])) if len(out) == 2 else None


def preread(paths: list[str]) -> None:
    """Pull files into the page cache (the 'warm' condition)."""
    buf = bytearray(PIECE)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def environment(directory: str) -> dict[str, Any]:
    """Filesystem + mount options of ``directory``, whether drop_caches works, host, git commit, load."""
    real, fs = os.path.realpath(directory), {"path": directory}
    with open("/proc/mounts") as f:
        for dev, mnt, fstype, opts, *_ in (line.split() for line in f):
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(fs.get("mountpoint", "")):
                fs.update(device=dev, mountpoint=mnt, fstype=fstype, mount_options=opts)
    probe = os.path.join(directory, "dropcache_probe")
    with open(probe, "wb") as f:
        f.write(os.urandom(8 * MiB))
        os.fsync(f.fileno())
    preread([probe])
    before, wrote, after = cached_fraction(probe), drop_caches(), cached_fraction(probe)
    rm(probe)
    works = wrote and after is not None and after < 0.05
    root = os.path.dirname(os.path.dirname(os.path.abspath(resilient.__file__)))
    return {
        "filesystem": fs,
        "drop_caches": {"write_ok": wrote, "cached_before": before, "cached_after": after, "works": works},
        "cpus": os.cpu_count(),
        "mem_total_gb": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9,
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "git_commit": _cmd("git", "-C", root, "rev-parse", "HEAD"),
        "git_head": _cmd("git", "-C", root, "log", "-1", "--format=%h %ad %s", "--date=short"),
        "command": shlex.join([sys.executable, *sys.argv]),
        "git_dirty_resilient": _cmd("git", "-C", root, "status", "--porcelain", "resilient").splitlines(),
        "loadavg_start": list(os.getloadavg()),
    }


def build_state(size_gb: float, layers: int = 8) -> tuple[nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    """Model with size_gb/3 GiB of fp32 params + AdamW moments after one real step (1 GiB: d = 3328)."""
    d = max(64, int(math.sqrt(size_gb * GiB / 3 / 4 / layers)) // 64 * 64)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(d, d) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(16, d)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    tensors = [*model.state_dict().values(), *(v for s in opt.state.values() for v in s.values())]
    nbytes = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    n_params = sum(p.numel() for p in model.parameters())
    return model, opt, {"layers": layers, "d": d, "params": n_params, "state_gib": nbytes / GiB}


def fingerprint(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Small clones used to check that every restore is bit-exact."""
    p0, pl = next(iter(model.parameters())), list(model.parameters())[-1]
    st = opt.state[pl]
    return [p0[:4].clone(), pl[-4:].clone(), st["exp_avg"][-4:].clone(), st["exp_avg_sq"][:4].clone()]


def check_restored(model: nn.Module, opt: torch.optim.Optimizer, ref: list[torch.Tensor]) -> None:
    if not all(torch.equal(a, b) for a, b in zip(fingerprint(model, opt), ref)):
        raise RuntimeError("restored state differs from the saved state")


def touch_state(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Write every tensor in place without changing a bit (x * 1.0), as a training step would, so no
    peer finds the state cold because the benchmark idled."""
    with torch.no_grad():
        for t in [*model.parameters(), *(v for st in opt.state.values() for v in st.values())]:
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                t.mul_(1.0)


def ours_save(run: Run, loop: Iterator[int]) -> dict[str, float]:
    """Stall = how long the step loop waits at a due boundary (``next(loop)``); then wait for the durable commit.

    ``loop`` is ``run.steps(...)`` of a Run that saves every step, already
    started: resuming it completes an update and snapshots the next save.
    """
    t0 = pc()
    next(loop)
    stall = pc() - t0
    assert run.checkpoints is not None
    res = run.checkpoints.wait()
    if res is None or not res.ok:
        raise RuntimeError(f"our save failed: {res}")
    nbytes = res.manifest.total_bytes
    return {"stall_s": stall, "manager_stall_s": res.stall_s, "write_s": res.write_s, "total_s": pc() - t0,
            "bytes": nbytes, "write_gbps": nbytes / res.write_s / 1e9}  # fmt: skip


def torch_save_fsync(model: nn.Module, opt: torch.optim.Optimizer, path: str) -> dict[str, float]:
    """state_dict()s + torch.save to a new file + fsync of the file and its directory."""
    t0 = pc()
    with open(path, "wb") as f:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f)
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)
    os.fsync(fd)
    os.close(fd)
    return {"stall_s": pc() - t0}


def dcp_save(model: nn.Module, opt: torch.optim.Optimizer, path: str, stager: Any) -> dict[str, float]:
    """torch.distributed.checkpoint.async_save; stall = until it returns, total = until the future is done."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    t0 = pc()
    msd, osd = get_state_dict(model, opt)
    fut = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=path, async_stager=stager)
    stall = pc() - t0
    fut.result()  # type: ignore[union-attr]
    return {"stall_s": stall, "total_s": pc() - t0}


def raw_write(mv: memoryview, path: str) -> dict[str, float]:
    """The same number of bytes in 16 MiB os.write calls to a new file, then fsync."""
    # touch one byte per page first (untimed): ours writes from a buffer the snapshot just wrote, so the
    # reference must not pay for source pages the VM may have let go cold while the buffer sat idle
    sum(mv[i] for i in range(0, len(mv), 4096))
    t0 = pc()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for start in range(0, len(mv), PIECE):
        chunk, done = mv[start : start + PIECE], 0
        while done < len(chunk):
            done += os.write(fd, chunk[done:])
    os.fsync(fd)
    os.close(fd)
    dt = pc() - t0
    return {"wall_s": dt, "gbps": len(mv) / dt / 1e9}


def dd_write(path: str, nbytes: int) -> dict[str, float]:
    """dd if=/dev/zero bs=16M conv=fsync; wall time including the process start."""
    count = max(1, math.ceil(nbytes / PIECE))
    t0 = pc()
    _cmd("dd", "if=/dev/zero", f"of={path}", "bs=16M", f"count={count}", "conv=fsync")
    dt = pc() - t0
    return {"wall_s": dt, "gbps": count * PIECE / dt / 1e9}
