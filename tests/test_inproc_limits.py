"""What in-process recovery keeps of the script's world, and where it declines, under ``resilient run``.

Real agents and gloo workers (``tests/elastic_worker.py``), compared with an uninterrupted run:

- a re-formed group keeps the script's collective timeout: a barrier that waits longer than the recovery
  timeout still works after a recovery (the group was formed under the recovery's own deadline);
- a process group the script made itself cannot be made again by a re-formation, so the run declines
  in-process recovery at its first step, says so (event, console), stops its spare and recovers by restart;
- the same group made through ``Run(groups=fn)`` is made again after the re-formation, and the spare takes
  the rank in process.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .agent_helpers import events, explain
from .test_agent_inproc import assert_bitwise_equal, elastic_run
from .test_step_atomicity import assert_same_run


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out, proc = elastic_run(tmp_path_factory.mktemp("limits"), "ref", "--nproc-per-node", "2")
    assert proc.returncode == 0, explain(proc)
    return out


def test_a_barrier_longer_than_the_recovery_timeout_works_after_a_recovery(tmp_path: Path, reference: Path) -> None:
    out, proc = elastic_run(tmp_path, "barrier", "--nproc-per-node", "2", "--spares", "1", "--recovery-timeout", "5",
                            die=("w1", "kill"), extra=("--spares-ready", "1", "--barrier-at", "6", "--barrier-s", "8"))
    assert proc.returncode == 0, explain(proc)
    run = out / "run"
    assert not events(run, "restart"), "the barrier after the recovery failed: the group lost the script's timeout"
    [done] = events(run, "recovered_in_process")
    assert done["rung"] == "promote_spare", done
    assert_bitwise_equal(out, reference)


def test_a_group_the_script_made_itself_declines_in_process_recovery_and_the_run_restarts(
        tmp_path: Path, reference: Path) -> None:
    out, proc = elastic_run(tmp_path, "own", "--nproc-per-node", "2", "--spares", "1", die=("w1", "kill"),
                            extra=("--own-group", "script"))
    assert proc.returncode == 0, explain(proc)
    run = out / "run"
    declined = [e for e in events(run, "in_process_declined") if e.get("source") != "worker"]
    assert len(declined) == 1, declined
    assert "the script made process groups of its own (group '" in declined[0]["reason"]
    assert "create them in Run(groups=fn)" in declined[0]["reason"]
    assert "not in process: the script made process groups of its own (group '" in proc.stderr
    assert "the 1 spare(s) kept for it are stopped" in proc.stderr
    assert len(events(run, "restart")) == 1 and not events(run, "recovered_in_process")
    # The spare was stopped once the run declined, and none was started after (the restart included).
    started = events(run, "spare_started")
    assert len(started) == 1 and [e["worker"] for e in events(run, "spare_lost")] == [started[0]["worker"]]
    assert_same_run(out, reference, restarted=True)


def test_a_group_made_through_run_groups_is_made_again_and_the_spare_takes_the_rank(
        tmp_path: Path, reference: Path) -> None:
    out, proc = elastic_run(tmp_path, "run-groups", "--nproc-per-node", "2", "--spares", "1", die=("w1", "kill"),
                            extra=("--own-group", "run", "--spares-ready", "1"))
    assert proc.returncode == 0, explain(proc)
    run = out / "run"
    assert not events(run, "in_process_declined") and not events(run, "restart")
    [done] = events(run, "recovered_in_process")
    assert done["rung"] == "promote_spare", done
    assert_bitwise_equal(out, reference)
