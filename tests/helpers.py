"""Shared helpers: run the training worker in real processes and read its traces."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

WORKER = Path(__file__).with_name("worker_train.py")
REPO = WORKER.parent.parent


@dataclass
class Trace:
    starts: list[dict] = field(default_factory=list)
    steps: dict[int, dict] = field(default_factory=dict)
    """Last record of each step (a replayed step overwrites the first try)."""
    all_steps: list[dict] = field(default_factory=list)
    end: dict | None = None


def read_trace(prefix: Path, rank: int = 0) -> Trace:
    trace = Trace()
    for line in Path(f"{prefix}.rank{rank}").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("event") == "start":
            trace.starts.append(rec)
        elif rec.get("event") == "end":
            trace.end = rec
        else:
            trace.steps[rec["step"]] = rec
            trace.all_steps.append(rec)
    return trace


def run_worker(
    trace: Path, *args: str, nproc: int = 1, expect: str = "ok", timeout: float = 120, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run the worker (under torchrun when ``nproc`` > 1); ``expect`` is "ok" or "killed"."""
    cmd = [sys.executable, str(WORKER), "--trace", str(trace), *args]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "--max-restarts=0", *cmd[1:]]
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, check=False)
    if expect == "ok":
        assert proc.returncode == 0, f"worker failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    elif expect == "killed":
        killed = proc.returncode == -signal.SIGKILL or (nproc > 1 and proc.returncode != 0)
        assert killed, f"worker was expected to be SIGKILLed, exit {proc.returncode}:\n{proc.stderr[-3000:]}"
    return proc


def assert_same_run(reference: Trace, resumed: Trace, from_step: int = 0) -> None:
    """Every step at or after ``from_step`` and the final state are bitwise equal."""
    assert reference.end is not None and resumed.end is not None
    assert sorted(resumed.steps) == sorted(reference.steps)
    for step in sorted(reference.steps):
        if step < from_step:
            continue
        ref, got = reference.steps[step], resumed.steps[step]
        assert got["indices"] == ref["indices"], f"step {step}: batches differ {got['indices']} != {ref['indices']}"
        assert got["lr"] == ref["lr"], f"step {step}: learning rate differs"
        assert got["loss"] == ref["loss"], f"step {step}: loss differs {got['loss']} != {ref['loss']}"
    for key in ("step", "params", "optimizer", "torch_rng", "python_rng", "numpy_rng"):
        assert resumed.end[key] == reference.end[key], f"final {key} differs"


def assert_same_tree(x: object, y: object, where: str = "state") -> None:
    """Bitwise equal trees (dicts, lists, tuples) of tensors and plain values; ``where`` names a difference."""
    import torch

    if isinstance(x, torch.Tensor):
        assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y), where
    elif isinstance(x, dict):
        assert isinstance(y, dict) and x.keys() == y.keys(), where
        for k in x:
            assert_same_tree(x[k], y[k], f"{where}.{k}")
    elif isinstance(x, (list, tuple)):
        assert isinstance(y, (list, tuple)) and len(x) == len(y), where
        for i, (u, v) in enumerate(zip(x, y)):
            assert_same_tree(u, v, f"{where}[{i}]")
    else:
        assert x == y, f"{where}: {x!r} != {y!r}"
