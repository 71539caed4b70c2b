"""``resilient status`` without --run-dir: the one run directory under runs/, or a list of them to pick from."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from .helpers import REPO


def fake_run(runs: Path, name: str, run_id: str, updated_at: float, phase: str,
             finished: dict | None = None) -> Path:
    """A run directory as an agent leaves it: events.jsonl and one node's status.json."""
    d = runs / name
    (d / "nodes" / "n0").mkdir(parents=True)
    lines = [{"kind": "agent_started", "time": updated_at - 60, "node": "n0", "run_id": run_id}]
    if finished is not None:
        lines.append({"kind": "agent_finished", "time": updated_at, "node": "n0", **finished})
    (d / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    os.utime(d / "events.jsonl", (updated_at - 60, updated_at - 60))
    (d / "nodes" / "n0" / "status.json").write_text(json.dumps(
        {"run_id": run_id, "node": "n0", "phase": phase, "updated_at": updated_at, "ranks": {}}))
    return d


def status(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "resilient", "status", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)}, check=False)


def test_several_run_directories_are_listed_newest_first_and_one_must_be_picked(tmp_path):
    runs = tmp_path / "runs"
    now = time.time()
    fake_run(runs, "old", "run-old", now - 7200, "finished: succeeded",
             {"verdict": "succeeded", "exit_code": 0, "reason": "all workers exited 0"})
    fake_run(runs, "live", "run-live", now - 1, "running")
    fake_run(runs, "stopped", "run-stopped", now - 300, "finished: crash_loop",
             {"verdict": "crash_loop", "exit_code": 80, "reason": "crash loop"})
    (runs / "not-a-run").mkdir()  # no events.jsonl: not a run directory

    proc = status(tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines[0] == "resilient: error: 3 run directories under runs/, newest first; pick one with --run-dir:"
    assert lines[1].split() == ["RUN", "DIR", "RUN", "ID", "UPDATED", "STATE"]
    rows = [line.split(None, 3) for line in lines[2:]]
    assert [(r[0], r[1]) for r in rows] == [("runs/live", "run-live"), ("runs/stopped", "run-stopped"),
                                            ("runs/old", "run-old")]
    assert rows[0][3].split()[-1] == "running"
    assert rows[1][3].endswith("finished: crash_loop (exit 80)")
    assert rows[2][2] == "2h" and rows[2][3].endswith("finished: succeeded (exit 0)")
    assert proc.stdout == ""

    # The one picked with --run-dir is shown.
    picked = status(tmp_path, "--run-dir", "runs/stopped")
    assert picked.returncode == 0, picked.stderr
    assert "verdict from node n0: crash_loop: crash loop (exit 80)" in picked.stdout


def test_the_only_run_directory_is_read_and_none_is_a_clear_error(tmp_path):
    assert "no run directory under runs/; pass --run-dir DIR" in status(tmp_path).stderr
    fake_run(tmp_path / "runs", "only", "run-only", time.time(), "finished: succeeded",
             {"verdict": "succeeded", "exit_code": 0, "reason": "all workers exited 0"})
    proc = status(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "run status from runs/only" in proc.stdout
    assert re.search(r"node n0 \(agent pid None\): finished: succeeded, .*, updated \d+s ago", proc.stdout), proc.stdout
