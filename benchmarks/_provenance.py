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
