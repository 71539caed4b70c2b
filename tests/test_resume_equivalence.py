"""Two-branch resume check: a run stopped and resumed equals the run that never stopped.

Branch A trains N+K steps in one process without checkpoints.  Branch B
trains N steps (saving on the way and at the end), the process ends, a new
process restores and trains K more.  Batches, learning rates, losses,
parameters, optimizer state and every RNG stream must be bitwise equal.
"""

from __future__ import annotations

import pytest

from .helpers import assert_same_run, read_trace, run_worker

N, K = 12, 8


@pytest.mark.parametrize(
    ("nproc", "mode"), [(1, "async"), (1, "sync"), (2, "async")], ids=["world1-async", "world1-sync", "ddp2-async"]
)
def test_resumed_run_is_bitwise_equal(tmp_path, nproc, mode):
    extra = ["--sync"] if mode == "sync" else []
    run_worker(tmp_path / "a", "--steps", str(N + K), nproc=nproc)
    ckpt = str(tmp_path / "ckpt")
    run_worker(tmp_path / "b", "--steps", str(N), "--dir", ckpt, "--every", "5", *extra, nproc=nproc)
    run_worker(tmp_path / "b", "--steps", str(N + K), "--dir", ckpt, "--every", "5", *extra, nproc=nproc)
    for rank in range(nproc):
        a, b = read_trace(tmp_path / "a", rank), read_trace(tmp_path / "b", rank)
        assert [s["restored_from"] for s in b.starts] == [None, f"step_{N:010d}"]
        assert len(b.all_steps) == N + K, "no step may be repeated or skipped"
        assert_same_run(a, b)


def test_resumed_run_from_s3_is_bitwise_equal(tmp_path, s3_url):
    url, endpoint = s3_url
    common = ["--dir", url, "--endpoint-url", endpoint, "--every", "5"]
    run_worker(tmp_path / "a", "--steps", str(N + K))
    run_worker(tmp_path / "b", "--steps", str(N), *common)
    run_worker(tmp_path / "b", "--steps", str(N + K), *common)
    a, b = read_trace(tmp_path / "a"), read_trace(tmp_path / "b")
    assert [s["restored_from"] for s in b.starts] == [None, f"step_{N:010d}"]
    assert_same_run(a, b)
