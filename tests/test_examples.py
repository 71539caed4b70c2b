"""The examples run: train_gpt.py on one process, and the crash/recover demo end to end under `resilient run`."""

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


@pytest.mark.timeout(240)
def test_resume_demo_matches(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        str(EXAMPLES / "resume_demo.py"),
        "--steps",
        "60",
        "--every",
        "20",
        "--crash-at",
        "45",
        "--workdir",
        str(tmp_path / "demo"),
        "--timeout",
        "150",
        "--memory-every",
        "1",
        "--",
        *SMALL_MODEL,
    ]
    proc = subprocess.run(cmd, check=False, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=230)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "verdict: MATCH" in out, out[-6000:]
    # The kill lands at the top of step 45: the agent places rank 1 there or, having lost the heartbeats not yet
    # sent (less than one batch interval of them: test_heartbeat.py's
    # test_a_section_entry_an_interval_after_the_last_send_sends_the_queue_so_it_never_spans_an_interval), before.
    found = re.search(r"rank 1 on \S+: killed by SIGKILL in section '\w+' at step (\d+)", out)
    assert found and int(found.group(1)) <= 45, out[-6000:]
    assert "decision: restart" in out
    assert "incident g0001-" in out and "to detect" in out and "replayed" in out  # the goodput report
    # The restart resumed from the node's memory tier, newer than the durable commit of step 40.  The tier saves
    # every step here (`--memory-every 1`: left to choose, its interval follows its measured cost, which a loaded
    # machine raised past the 5 steps from 40 to the cut): at the boundary of the cut step (45, saved before its
    # body ran and killed itself), or at 44 when rank 1's copy of 45 was still being hashed as the kill came (a
    # save first waits for the previous one's manifest, so 44 is whole on every rank).  The steps from there to
    # the failure were trained again.
    resumed = re.search(r"(memory:)?step_(\d+) \(resumed at step (\d+)\)", out)
    assert resumed and resumed.group(1) == "memory:", out[-6000:]
    assert int(resumed.group(2)) == int(resumed.group(3)) and 44 <= int(resumed.group(3)) <= 45, out[-6000:]
    at = int(resumed.group(3))
    if at == 45:  # nothing to train again
        assert re.search(r"^\s*steps replayed\s+-\s+0\s*$", out, re.MULTILINE), out[-6000:]
    else:
        assert f"{45 - at} (steps {at}..44)" in out, out[-6000:]


@pytest.mark.timeout(240)
def test_resume_demo_matches_with_fsdp(tmp_path: Path) -> None:
    """The same demo with the model sharded by FSDP2: the crashed and resumed run equals the one that never
    stopped (parameters and optimizer state gathered whole)."""
    cmd = [sys.executable, str(EXAMPLES / "resume_demo.py"), "--steps", "40", "--every", "20", "--crash-at", "30",
           "--workdir", str(tmp_path / "demo"), "--timeout", "150", "--memory-every", "1", "--", *SMALL_MODEL,
           "--fsdp"]
    proc = subprocess.run(cmd, check=False, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=230)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "verdict: MATCH" in out, out[-6000:]
    # Each rank's shards came back from the node's memory tier, newer than the commit of step 20: the boundary of
    # the cut step 30, or 29 when rank 1's copy of 30 was still being hashed (as for the unsharded demo above).
    resumed = re.search(r"(memory:)?step_(\d+) \(resumed at step (\d+)\)", out)
    assert resumed and resumed.group(1) == "memory:", out[-6000:]
    assert int(resumed.group(2)) == int(resumed.group(3)) and 29 <= int(resumed.group(3)) <= 30, out[-6000:]
