"""Run ``resilient run`` and ``resilient status`` as real processes and read what they leave behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .helpers import REPO, WORKER


def agent_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(extra or {})}


def agent_cmd(run_dir: Path, *flags: str, script: Path = WORKER, script_args: tuple[str, ...] = (),
              quiet: bool = True) -> list[str]:
    return [sys.executable, "-m", "resilient", "run", "--run-dir", str(run_dir), *(["--quiet"] if quiet else []),
            *flags, str(script), *script_args]


def run_agent(run_dir: Path, *flags: str, script: Path = WORKER, script_args: tuple[str, ...] = (),
              timeout: float = 240, env: dict[str, str] | None = None, console: bool = False
              ) -> subprocess.CompletedProcess:
    """Run the agent to its end; ``console``: echo worker output too, with stderr merged into ``stdout`` in the
    order it was written (the agent flushes every line), as a terminal would show it."""
    cmd = agent_cmd(run_dir, *flags, script=script, script_args=script_args, quiet=not console)
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT if console else subprocess.PIPE,
                          text=True, timeout=timeout, env=agent_env(env), check=False)


def start_agent(run_dir: Path, *flags: str, script: Path = WORKER, script_args: tuple[str, ...] = (),
                env: dict[str, str] | None = None, log: Path | None = None) -> subprocess.Popen:
    out = open(log, "w") if log is not None else subprocess.DEVNULL
    cmd = agent_cmd(run_dir, *flags, script=script, script_args=script_args)
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=agent_env(env))


def events(run_dir: Path, kind: str | None = None) -> list[dict[str, Any]]:
    found = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line.strip()]
    return [e for e in found if kind is None or e["kind"] == kind]


def events_so_far(run_dir: Path, kind: str | None = None) -> list[dict[str, Any]]:
    """The run's events as far as they are written, while it runs: none before the file exists, and a line still
    being appended is not one yet."""
    try:
        lines = (run_dir / "events.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    found = []
    for line in lines:
        try:
            found.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return [e for e in found if kind is None or e["kind"] == kind]


def incidents(run_dir: Path) -> list[dict[str, Any]]:
    files = sorted((run_dir / "incidents").glob("*.json"))
    return sorted((json.loads(p.read_text()) for p in files), key=lambda i: i["wall_time"])


def wait_for(predicate, timeout: float, what: str, interval: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def node_status(run_dir: Path, node: str) -> dict[str, Any] | None:
    try:
        return json.loads((run_dir / "nodes" / node / "status.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def explain(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{(proc.stderr or '')[-5000:]}"
