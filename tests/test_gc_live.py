"""``resilient checkpoint gc`` run over and over beside a live training run: no commit is torn, nothing newest lost.

A real job (tests/worker_train.py, two ranks) saves every second step through a dozen commits while the test
runs the operator's ``checkpoint gc --keep 2`` in a loop against the same location, a directory and a moto S3
bucket.  Every commit the job made must have published a whole checkpoint (each one still there verifies), no save
may fail, and the job's newest checkpoint must be there and verify at the end.  Before gc took the location's lock
and left young saves alone, it removed the staging area of the save in progress: the job published a checkpoint
without its files, or its save failed.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from resilient.checkpoint.inspect import verify_checkpoint
from resilient.checkpoint.locations import open_storage
from resilient.cli.main import main

from .helpers import run_worker

STEPS = 24
EVERY = 2
GC_LOOP_BOUND_S = 240.0
"""The loop of gc runs stops with the job, or after this long at most."""


def _events(prefix: Path, rank: int = 0) -> list[dict[str, Any]]:
    path = Path(f"{prefix}.rank{rank}")
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize("where", ["directory", "s3"])
def test_gc_in_a_loop_beside_a_live_job_never_tears_a_commit(tmp_path: Path, where: str,
                                                               request: pytest.FixtureRequest,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    if where == "s3":
        location, endpoint = request.getfixturevalue("s3_url")
        reach = ["--endpoint-url", endpoint]
        # The saves take their time: each step sleeps, so that the collections fall between and inside them.
        slow = ["--step-sleep", "0.3"]
    else:
        location, endpoint, reach = str(tmp_path / "ckpt"), None, []
        # Rank 0's commit waits before it takes the lock: its staging area sits complete, unpublished, meanwhile.
        slow = ["--slow-storage", "0", "commit", "0.2"]
    events = tmp_path / "events"
    job_failed: list[BaseException] = []

    def job() -> None:
        try:
            run_worker(tmp_path / "trace", "--steps", str(STEPS), "--dir", location, *reach, "--every", str(EVERY),
                       "--keep", "3", "--events", str(events), *slow, nproc=2, timeout=GC_LOOP_BOUND_S)
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread
            job_failed.append(e)

    storage = open_storage(location, endpoint_url=endpoint)
    worker = threading.Thread(target=job, name="training job")
    worker.start()
    runs, codes, reports = 0, [], []
    deadline = time.monotonic() + GC_LOOP_BOUND_S
    while worker.is_alive() and not storage.list_committed() and time.monotonic() < deadline:
        time.sleep(0.05)  # gc needs a location to look at: the job's first commit makes it
    while worker.is_alive() and time.monotonic() < deadline:
        codes.append(main(["checkpoint", "gc", location, *reach, "--keep", "2", "--json"]))
        reports.append(json.loads(capsys.readouterr().out))
        runs += 1
        time.sleep(0.02)
    worker.join(timeout=30)
    assert not worker.is_alive(), "the job did not end"
    assert not job_failed, job_failed[0]
    assert runs >= 3, f"only {runs} collections ran while the job trained: they proved nothing"
    assert set(codes) == {0}, codes
    # No collection ever saw a checkpoint that failed verification (one the job deleted meanwhile is skipped).
    assert [r["failed"] for r in reports if r["failed"]] == []

    log = _events(events)
    committed = [e["name"] for e in log if e.get("kind") == "checkpoint_committed"]
    failed = [e for e in log if e.get("kind") in ("checkpoint_failed", "checkpoint_fenced")]
    assert not failed, failed
    assert len(committed) == STEPS // EVERY, committed
    present = storage.list_committed()
    assert committed[-1] in present, (committed, present)
    for name in present:
        report = verify_checkpoint(storage, name)
        assert report.ok, f"{name} was published torn: {report.problem}"
    assert set(present) <= set(committed)
