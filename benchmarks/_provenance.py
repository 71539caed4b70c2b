"""What a benchmark result was measured on: git state of the code and the load on the machine.

Shared by the benchmarks that write their own provenance (loader, metrics).
Uncommitted changes are those to the measured code (``resilient/``) and to
the benchmarks themselves; result files under ``benchmarks/results`` are
outputs, not code, and are left out.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def git(*args: str) -> str:
    """Output of a git command in the repository (empty when git or the repository is missing)."""
    try:
        out = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30,
                             check=False)
    except OSError:
        return ""
    return out.stdout.rstrip("\n") if out.returncode == 0 else ""


def commit() -> str:
    return git("rev-parse", "HEAD") or "unknown (not a git checkout)"


def uncommitted_code_changes() -> list[str]:
    """``git status --porcelain`` lines for the measured code and the benchmarks, results excluded."""
    return git("status", "--porcelain", "--", "resilient", "benchmarks", ":(exclude)benchmarks/results").splitlines()


def load_now() -> dict:
    """Load average and the kernel's running/total task counts (``/proc/loadavg``): other work on the machine."""
    try:
        fields = Path("/proc/loadavg").read_text().split()
        running, total = (int(x) for x in fields[3].split("/"))
    except (OSError, ValueError, IndexError):
        running = total = -1
    return {"loadavg": list(os.getloadavg()), "running_tasks": running, "total_tasks": total}


def host(argv: list[str]) -> dict:
    """The machine, the code and the command a result was measured with, and the load at its start."""
    import platform
    import shlex
    import sys

    import torch

    return {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version(),
            "torch": torch.__version__, "commit": commit(), "git_head": git("log", "-1", "--format=%h %cs %s"),
            "dirty": uncommitted_code_changes(), "invocation": shlex.join([sys.executable, *argv]),
            "load_start": load_now()}


def write_results(out_dir: str | Path, name: str, res: dict, render) -> Path:  # noqa: ANN001
    """``<out_dir>/<name>.json`` (every number) and ``.md`` (``render(res)``); returns their common stem."""
    import json

    os.makedirs(out_dir, exist_ok=True)
    base = Path(out_dir) / name
    base.with_suffix(".json").write_text(json.dumps(res, indent=1, default=str))
    base.with_suffix(".md").write_text(render(res))
    return base


def run_record(script: str, argv: list[str], started: float, load_before: dict) -> dict:
    """What every result file records about its run: commit, uncommitted code, command, load, duration."""
    import time

    return {"commit": commit(), "uncommitted": uncommitted_code_changes(),
            "command": f"python benchmarks/{script} " + " ".join(argv), "load_before": load_before,
            "load_after": load_now(), "seconds": round(time.time() - started, 1)}


def run_line(result: dict) -> str:
    """The line under a result's title that says where and how it was measured."""
    return (f"commit `{result['commit']}`; `{result['command']}`; {result['seconds']} s; load before "
            f"{result['load_before']['loadavg']}, after {result['load_after']['loadavg']}")

