"""The examples run: train_gpt.py on one process, and the main job (examples/recovery_demo.py) end to end."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
# A smaller model than the examples' defaults keeps this file well under a minute and a half on 2 cores.
SMALL_MODEL = ["--layers", "2", "--batch-size", "8"]


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)  # a single-process run must not think it is distributed
    return env


@pytest.mark.timeout(120)
def test_train_gpt_single_process(tmp_path: Path) -> None:
    ckpt, trace = tmp_path / "ckpt", tmp_path / "trace.jsonl"
    cmd = [
        sys.executable,
        str(EXAMPLES / "train_gpt.py"),
        "--steps",
        "30",
        "--every",
        "10",
        "--keep",
        "2",
        "--ckpt-dir",
        str(ckpt),
        "--trace",
        str(trace),
        "--log-every",
        "10",
        *SMALL_MODEL,
    ]
    proc = subprocess.run(cmd, check=False, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "final_step=30" in proc.stdout

    records = [json.loads(line) for line in trace.read_text().splitlines()]
    starts = [r for r in records if r["kind"] == "start"]
    steps = [r for r in records if r["kind"] == "step"]
    finals = [r for r in records if r["kind"] == "final"]
    assert len(starts) == 1 and starts[0]["restored_from"] is None
    assert [r["step"] for r in steps] == list(range(30))
    assert all(len(r["indices"]) == 8 and r["lr"] > 0 and r["loss"] > 0 for r in steps)
    assert len(finals) == 1 and finals[0]["step"] == 30
    assert len(finals[0]["param_sha256"]) == 64 and len(finals[0]["optimizer_sha256"]) == 64

    committed = sorted(p.name for p in ckpt.iterdir() if (p / "manifest.json").is_file())
    assert committed == ["step_0000000020", "step_0000000030"]  # keep=2

    # Running it again restores the final checkpoint and has nothing left to do.
    proc = subprocess.run(cmd, check=False, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "restored_from=step_0000000030 final_step=30" in proc.stdout


def _demo(tmp_path: Path, *args: str, timeout: int) -> tuple[str, dict]:
    workdir = tmp_path / "demo"
    cmd = [sys.executable, str(EXAMPLES / "recovery_demo.py"), "--workdir", str(workdir), "--timeout", "150", *args]
    proc = subprocess.run(cmd, check=False, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-8000:]
    return out, json.loads((workdir / "summary.json").read_text())


def _events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


@pytest.mark.timeout(300)
def test_the_main_job_recovers_one_crash_three_ways_and_replays_a_nan_incident(tmp_path: Path) -> None:
    """The README's main job, smaller: torchrun, `resilient run` and `resilient run --spares 1` each recover
    rank 1's SIGKILL at the top of step 100 into the run that never stopped; then a poisoned sample stops a run
    with exit 79, and its bundle, replayed elsewhere, fails at the same step naming that sample."""
    out, summary = _demo(tmp_path, "--steps", "120", "--every", "40", "--crash-at", "100", "--nan-at", "60",
                         "--memory-every", "1", "--", *SMALL_MODEL, timeout=290)
    rows = {row["mode"]: row for row in summary["rows"]}
    assert list(rows) == ["torchrun", "restart", "spare", "uninterrupted"]
    for mode in ("torchrun", "restart", "spare"):
        row = rows[mode]
        assert row["verdict"] == "MATCH", row
        assert row["compared"] == 2 * (120 + row["redone"]), row  # every step of both ranks, each redone one twice
        assert row["recovery_s"] > 0 and 0 < row["goodput"] < 1, row
    # torchrun's ranks restore the commit of step 80 and train 80..99 again, within their recovery.
    assert rows["torchrun"]["redone"] == 20 and rows["torchrun"]["resumed_at"] == 80, rows["torchrun"]
    assert rows["torchrun"]["recovery_s"] > rows["torchrun"]["redone_s"] > 0, rows["torchrun"]
    # The agent's restart restores its memory tier, saved every step here: at the boundary of the cut step, or
    # at 99 when rank 1's copy of 100 was still being hashed as the kill came.
    assert rows["restart"]["redone"] <= 1 and rows["restart"]["resumed_at"] in (99, 100), rows["restart"]
    # The spare takes rank 1's place in process and rank 0 never stops: step 100 is retried, nothing re-done.
    assert rows["spare"]["redone"] == 0 and rows["spare"]["resumed_at"] == 100, rows["spare"]
    [recovered] = [e for e in _events(tmp_path / "demo" / "spare" / "run") if e["kind"] == "recovered_in_process"]
    assert recovered["rung"] == "promote_spare", recovered
    assert "promote" not in json.dumps(_events(tmp_path / "demo" / "restart" / "run"))
    # One table line and one timeline per launch; the crashed ones mark the crash.
    for row in summary["rows"]:
        assert re.search(rf"^{re.escape(row['label'])}\s+.*(MATCH|the reference)", out, re.MULTILINE), out[-6000:]
        [line] = [ln for ln in out.splitlines() if ln.startswith(row["label"]) and set(ln.split()[-1]) <= set("#r.-!")]
        assert ("!" in line) == (row["mode"] != "uninterrupted"), line
    incident = summary["incident"]
    assert incident["reproduced"] and incident["step"] == 60, incident
    found = re.search(r"samples of step 60 on rank 1: \[([\d, ]+)\] \(the same as the run's\)", out)
    assert found and incident["sample"] in [int(i) for i in found.group(1).split(",")], out[-6000:]
    assert "This rank's own backward made them not finite" in out
    assert re.search(r"verdict: torchrun, restart: MATCH, resilient run, restart: MATCH, resilient run --spares 1: "
                     r"MATCH; the incident reproduced on replay", out), out[-3000:]


@pytest.mark.timeout(240)
def test_the_main_job_with_fsdp_restarts_into_the_same_run(tmp_path: Path) -> None:
    """The model sharded by FSDP2 (a shard exists once: recovery is a restart): the crashed run resumes from
    the node's memory tier into the one that never stopped (parameters and optimizer state gathered whole)."""
    _, summary = _demo(tmp_path, "--steps", "40", "--every", "20", "--crash-at", "30", "--modes", "restart",
                         "--no-incident", "--memory-every", "1", "--", *SMALL_MODEL, "--fsdp", timeout=230)
    [row, _] = summary["rows"]
    assert row["verdict"] == "MATCH" and row["resumed_at"] in (29, 30), row
    restored = [e for e in _events(tmp_path / "demo" / "restart" / "run") if e["kind"] == "restored"]
    assert [e["generation"] for e in restored] == [1, 2] and restored[0]["checkpoint"] is None, restored
    assert restored[1]["checkpoint"] == f"memory:step_{row['resumed_at']:010d}", restored
