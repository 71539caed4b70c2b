"""SIGKILL during a save, at every stage of the commit: nothing committed is lost.

For each kill point the process dies during the save at step 10 (checkpoints
every 5 steps, keep 1).  A new process must restore the newest checkpoint
that was committed before the kill (step 5 if the kill came before the
commit point, step 10 after it), finish the run bitwise equal to the
uninterrupted reference, and leave no staging leftovers behind.

There is no case for "renamed, parent directory not yet fsynced": SIGKILL
ends the process, not the kernel, and the page cache keeps the rename, so
such a test passes with or without the fsync and proves nothing.  Only a
power cut (or a filesystem that drops unsynced metadata, e.g. a VM snapshot
of the disk) can observe that fsync.  In its place, ``after_commit`` kills
the process once the publish returned, before its outcome reached anyone
and before retention: the checkpoint must count as committed.
"""

from __future__ import annotations

import os

import pytest

from resilient.checkpoint import LocalStorage

from .helpers import assert_same_run, read_trace, run_worker

STEPS = 15

# (kill point, checkpoint a new process must restore)
POINTS = [
    ("snapshot", "step_0000000005"),  # during the host-memory copy
    ("write", "step_0000000005"),  # while writing a shard
    ("before_manifest", "step_0000000005"),  # all shards written, no manifest yet
    ("before_rename", "step_0000000005"),  # manifest written in staging, not published
    ("after_commit", "step_0000000010"),  # published; outcome not yet shared, retention not run
    ("retention", "step_0000000010"),  # deleting the previous checkpoint
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("reference") / "trace"
    run_worker(path, "--steps", str(STEPS))
    return read_trace(path)


@pytest.mark.parametrize(("point", "expected"), POINTS, ids=[p for p, _ in POINTS])
def test_kill_during_save_loses_nothing(tmp_path, reference, point, expected):
    ckpt = tmp_path / "ckpt"
    common = ["--steps", str(STEPS), "--dir", str(ckpt), "--every", "5", "--keep", "1"]
    run_worker(tmp_path / "t", *common, "--fault", point, "--fault-step", "10", expect="killed")
    assert os.path.exists(f"{tmp_path / 't'}.fault-fired"), "the fault never fired"
    storage = LocalStorage(ckpt)
    assert storage.list_committed()[-1] == expected

    run_worker(tmp_path / "t", *common)
    resumed = read_trace(tmp_path / "t")
    assert resumed.starts[-1]["restored_from"] == expected
    assert_same_run(reference, resumed)
    assert not os.listdir(ckpt / ".staging"), "staging leftovers of the crashed save were not collected"
    assert not os.path.exists(ckpt / ".trash") or not os.listdir(ckpt / ".trash")
    assert storage.list_committed() == ["step_0000000015"]


def test_rank_killed_while_writing_under_ddp_aborts_the_commit(tmp_path):
    """Rank 1 dies mid-shard while rank 0 finished its files: nothing is committed."""
    ckpt = tmp_path / "ckpt"
    common = ["--steps", str(STEPS), "--dir", str(ckpt), "--every", "5", "--keep", "1"]
    run_worker(tmp_path / "ref", "--steps", str(STEPS), nproc=2)
    run_worker(tmp_path / "t", *common, "--fault", "write", "--fault-step", "10", "--fault-rank", "1",
               nproc=2, expect="killed")
    assert LocalStorage(ckpt).list_committed() == ["step_0000000005"]
    run_worker(tmp_path / "t", *common, nproc=2)
    for rank in (0, 1):
        resumed = read_trace(tmp_path / "t", rank)
        assert resumed.starts[-1]["restored_from"] == "step_0000000005"
        assert_same_run(read_trace(tmp_path / "ref", rank), resumed)


S3_POINTS = [("s3_upload", "step_0000000005"), ("s3_before_manifest", "step_0000000005")]


@pytest.mark.parametrize(("point", "expected"), S3_POINTS, ids=[p for p, _ in S3_POINTS])
def test_kill_during_save_to_s3_loses_nothing(tmp_path, reference, s3_url, point, expected):
    from resilient.checkpoint.s3 import S3Storage

    url, endpoint = s3_url
    common = ["--steps", str(STEPS), "--dir", url, "--endpoint-url", endpoint, "--every", "5", "--keep", "1"]
    run_worker(tmp_path / "t", *common, "--fault", point, "--fault-step", "10", expect="killed")
    storage = S3Storage(url, endpoint_url=endpoint)
    assert storage.list_committed() == [expected]
    run_worker(tmp_path / "t", *common)
    resumed = read_trace(tmp_path / "t")
    assert resumed.starts[-1]["restored_from"] == expected
    assert_same_run(reference, resumed)
    assert storage.list_committed() == ["step_0000000015"]
    assert storage.collect_garbage().removed == (), "leftovers of the crashed save survived the resumed run"
