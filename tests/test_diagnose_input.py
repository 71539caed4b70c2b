"""Input-path isolation: ``resilient diagnose input`` on a real script, and its verdict (pure)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from resilient.watchdog.input_path import judge_input, phase_times

from .agent_helpers import agent_env

pytestmark = [pytest.mark.timeout(300), pytest.mark.serial]

WORKER = Path(__file__).parent / "pace_worker.py"


def _windows(step_ms: float, data_ms: float, n: int = 6) -> list[dict]:
    return [{"w": i, "n": 5, "step": (step_ms + (0.3 if i % 2 else -0.3)) / 1e3, "s": {"data": data_ms / 1e3}}
            for i in range(n)]


def test_the_verdict_compares_the_slowest_ranks_and_leaves_the_noise_out():
    slow = {0: {"windows": {"real": _windows(60, 15), "resident": _windows(45, 0)}},
            1: {"windows": {"real": _windows(61, 15), "resident": _windows(45.5, 0)}}}
    v = judge_input(slow)
    # Windows 1-5 (the first is left out) alternate 0.3 ms about the level: their median is 0.3 ms above it.
    assert v.input_bound and v.cost_s == pytest.approx(0.0155, abs=1e-6) and v.real.step_s == pytest.approx(0.0613)
    assert v.reason.startswith("the run is input-bound: the input path costs 15.5 ms of a 61.3 ms step (34%)")
    fine = {0: {"windows": {"real": _windows(45.5, 0.3), "resident": _windows(45, 0)}}}
    v = judge_input(fine)
    assert not v.input_bound and "is not what limits this run" in v.reason
    # A 2 ms difference inside window-to-window noise of several ms is not a verdict.
    noisy = [{"w": i, "n": 5, "step": (45 + (6 if i % 2 else -6)) / 1e3, "s": {"data": 0.0}} for i in range(6)]
    assert not judge_input({0: {"windows": {"real": [{**w, "step": w["step"] + 0.002} for w in noisy],
                                            "resident": noisy}}}).input_bound
    # Slower steps on the real path that the wait for data does not explain are not the input path's doing.
    v = judge_input({0: {"windows": {"real": _windows(50, 0.3), "resident": _windows(45, 0.1)}}})
    assert not v.input_bound and v.cost_s == pytest.approx(0.005, abs=1e-6), v
    assert "waits only 0.2 ms more for its batches" in v.reason
    assert phase_times(_windows(50, 1)).windows == 5  # the first window is left out
    with pytest.raises(ValueError, match="no rank reported"):
        judge_input({})


def _diagnose(tmp_path: Path, *script_args: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "resilient", "diagnose", "input", "--steps", "20",
                           "--nproc-per-node", "2", "--json", "--run-dir", str(tmp_path / "diag"), str(WORKER),
                           "--steps", "100", "--out", str(tmp_path / "out"), "--device-ms", "20", "--audit-every",
                           "0", "--ckpt", str(tmp_path / "ckpt"), *script_args],
                          capture_output=True, text=True, timeout=240, env=agent_env(), check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_a_slow_input_path_is_pinned_on_it_and_a_fast_one_is_cleared(tmp_path):
    slow = _diagnose(tmp_path / "slow", "--data-ms", "40")
    assert slow["input_bound"] and slow["ranks"] == [0, 1], slow
    # Each batch is read in the loop, 32 samples sleeping 1.25 ms each: every real step waits at least 40 ms for
    # its data, and takes that plus the 20 ms device wait.  With the batches in memory the wait is gone (the
    # verdict's arithmetic is test_the_verdict_compares_the_slowest_ranks_and_leaves_the_noise_out's).
    real, resident = slow["real"], slow["resident"]
    assert real["data_s"] >= 0.040 and real["step_s"] >= 0.060 and resident["step_s"] >= 0.020, slow
    assert resident["data_s"] < real["data_s"] and resident["step_s"] < real["step_s"], slow
    assert slow["cost_s"] == real["step_s"] - resident["step_s"], slow
    fast = _diagnose(tmp_path / "fast")
    assert not fast["input_bound"] and fast["real"]["step_s"] >= 0.020, fast
    assert fast["real"]["data_s"] < real["data_s"], (fast, slow)
    assert fast["cost_s"] == fast["real"]["step_s"] - fast["resident"]["step_s"], fast
    # A diagnosis keeps nothing: the script's checkpoint location is never written, the script's own output
    # after its loop never happens (the job stops at the boundary after the second phase).
    assert not (tmp_path / "slow" / "ckpt").exists() and not (tmp_path / "fast" / "ckpt").exists()
    assert not list((tmp_path / "slow").glob("out.*"))
    assert sorted(p.name for p in (tmp_path / "slow" / "diag" / "diagnosis").iterdir()) == ["rank0.json", "rank1.json"]
