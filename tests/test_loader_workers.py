"""ElasticLoader with worker processes: the in-process stream, exactly, under restores, resizes and failures.

Workers fork from the test process (no torch import per worker); the
two-rank training test runs two real gloo processes.
"""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import sys
import threading
import time
import warnings
from pathlib import Path

import psutil
import pytest
import torch

from resilient import ElasticLoader
from resilient.agent.forking import Process
from resilient.data import DataFetchError
from tests import launch
from tests.loader_worker import BATCH, SEED, N, Samples

WORKER = Path(__file__).with_name("loader_worker.py")
REPO = WORKER.parent.parent
WORKERS = {"num_workers": 2, "prefetch_factor": 2, "multiprocessing_context": "fork"}


def make(n: int = 23, batch: int = 4, *, rank: int = 0, world: int = 1, dataset=None, **kw) -> ElasticLoader:
    return ElasticLoader(dataset if dataset is not None else Samples(n), batch_size=batch, seed=SEED, rank=rank,
                         world_size=world, **kw)


def take(loader: ElasticLoader, k: int) -> list[tuple[list[int], torch.Tensor, torch.Tensor, set[int]]]:
    out = []
    for _ in range(k):
        batch = next(loader)
        out.append((list(loader.last_indices), batch["x"].clone(), batch["i"].clone(), set(batch["pid"].tolist())))
    return out


def lockstep(ls: list[ElasticLoader], steps: int) -> list:
    return [b for _ in range(steps) for loader in ls for b in take(loader, 1)]


def assert_same(got: list, want: list) -> None:
    assert len(got) == len(want)
    for n, ((gi, gx, gii, _), (wi, wx, wii, _)) in enumerate(zip(got, want, strict=True)):
        assert gi == wi, f"batch {n}: last_indices {gi} != {wi}"
        assert gii.tolist() == gi, f"batch {n}: last_indices {gi} are not the indices of the batch {gii.tolist()}"
        assert torch.equal(gx, wx) and torch.equal(gii, wii), f"batch {n}: tensors differ"


def children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def wait_gone(pids: set[int], timeout: float = 15.0) -> set[int]:
    deadline = time.monotonic() + timeout
    alive = set(pids)
    while alive and time.monotonic() < deadline:
        alive = {p for p in alive if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE}
        time.sleep(0.05)
    return alive


@pytest.mark.parametrize("world", [1, 2])
def test_workers_give_the_in_process_stream(world):
    # 23 samples, batches of 4: batches cross epoch boundaries, epochs are shuffled differently.
    got_loaders = [make(rank=r, world=world, **WORKERS) for r in range(world)]
    got = lockstep(got_loaders, 12)
    want = lockstep([make(rank=r, world=world) for r in range(world)], 12)
    assert_same(got, want)
    assert all(loader.consumed == 12 * 4 * world for loader in got_loaders)
    assert os.getpid() not in set().union(*(b[3] for b in got)), "the batches were not read in worker processes"
    for loader in got_loaders:
        loader.close()


def test_a_restore_in_the_middle_of_an_epoch_drops_prefetched_batches_and_continues_the_stream():
    first = make(dataset=Samples(23, delay=0.002), **WORKERS)
    head = take(first, 3)  # 2 workers x prefetch 2: more batches are in flight than were taken
    state = first.state_dict()
    assert state["consumed"] == 3 * 4, "prefetched batches were counted as consumed"
    first.close()
    second = make(**WORKERS)
    second.load_state_dict(state)
    tail = take(second, 6)
    second.close()
    assert_same(head + tail, take(make(), 9))


def test_a_cursor_saved_on_two_ranks_resplits_on_one_exactly_like_in_process():
    def run(options: dict) -> list:
        two = [make(rank=r, world=2, **options) for r in range(2)]
        head = lockstep(two, 3)
        state = two[0].state_dict()
        for loader in two:
            loader.close()
        one = make(**options)
        one.load_state_dict(state)
        one.bind(0, 1)
        tail = take(one, 5)
        one.close()
        return head + tail

    assert_same(run(WORKERS), run({}))


def test_persistent_workers_are_reused_and_never_return_a_stale_batch():
    # Slow samples, so that batches of the old position are still being read when the position changes.
    loader = make(dataset=Samples(23, delay=0.01), persistent_workers=True, **WORKERS)
    reference = make()
    start = loader.state_dict()
    got = take(loader, 2)
    pids = set().union(*(b[3] for b in got))
    assert len(pids) == 2 and os.getpid() not in pids
    ahead = loader.state_dict()
    ahead["consumed"] = 40  # jump forward: into the second epoch
    for state, expect_at in ((start, 0), (ahead, 40), (start, 0)):
        loader.load_state_dict(state)
        batch = take(loader, 2)
        reference.load_state_dict(state)
        assert_same(batch, take(reference, 2))
        assert set().union(*(b[3] for b in batch)) <= pids, "persistent workers were replaced"
        assert loader.last_indices == reference.indices_at(expect_at + 4, 4)
    loader.bind(1, 2)  # a world-size change also moves the position of this rank
    reference.bind(1, 2)
    assert_same(take(loader, 3), take(reference, 3))
    loader.close()
    assert not wait_gone(pids), "persistent workers outlived close()"


def test_close_and_release_stop_the_workers_and_a_closed_loader_starts_new_ones():
    loader = make(**WORKERS)
    first = set().union(*(b[3] for b in take(loader, 2)))
    loader.close()
    assert not wait_gone(first), "workers outlived close()"
    again = set().union(*(b[3] for b in take(loader, 2)))
    assert again and not again & first and os.getpid() not in again
    assert loader.consumed == 4 * 4
    del loader
    gc.collect()
    assert not wait_gone(again), "workers outlived their loader"


@pytest.mark.parametrize("options", [{}, WORKERS], ids=["in-process", "workers"])
def test_a_sample_that_raises_names_its_dataset_index_and_stream_position(options):
    loader = make(dataset=Samples(23, fail_at=13), **options)
    stream = make().indices_at(0, 23 * 2)
    position = stream.index(13)
    batches_before = position // 4
    take(loader, batches_before)
    with pytest.raises(DataFetchError) as info:
        next(loader)
    message = str(info.value)
    assert f"dataset[13] at stream position {position} raised ValueError: sample 13 is corrupt" in message
    assert (info.value.index, info.value.position, info.value.cause_type) == (13, position, "ValueError")
    assert loader.consumed == batches_before * 4, "the failed batch was counted as consumed"
    with pytest.raises(DataFetchError, match=r"dataset\[13\]"):  # asking again reads the same batch again
        next(loader)
    loader.close()


def test_a_collate_fn_that_raises_names_the_batch_position():
    def collate(samples):
        if any(s["i"] == 5 for s in samples):
            raise KeyError("no field")
        return torch.stack([s["x"] for s in samples])

    loader = ElasticLoader(Samples(8), batch_size=4, shuffle=False, collate_fn=collate, **WORKERS)
    next(loader)
    with pytest.raises(DataFetchError, match=r"collate_fn on the batch starting at stream position 4 raised KeyError"):
        next(loader)
    loader.close()


@pytest.mark.parametrize("options", [{}, WORKERS], ids=["in-process", "workers"])
def test_pin_memory_gives_the_same_batches_with_or_without_an_accelerator(options):
    loader = make(pin_memory=True, **options)
    with warnings.catch_warnings():
        # Without an accelerator torch warns that it does not pin; that is all it should do.
        warnings.filterwarnings("ignore", message=".*pin_memory.*no accelerator")
        got = take(loader, 7)
    assert_same(got, take(make(), 7))
    loader.close()


def test_starting_workers_draws_no_number_from_the_global_rng():
    # A resumed run starts its workers at another step than the uninterrupted run: it must not shift the RNG.
    torch.manual_seed(1)
    expected = torch.rand(4)
    torch.manual_seed(1)
    loader = make(**WORKERS)
    take(loader, 1)
    loader.load_state_dict({**loader.state_dict(), "consumed": 8})
    take(loader, 1)
    assert torch.equal(torch.rand(4), expected)
    loader.close()


class CountedReads:
    """``Samples`` whose reads the worker processes count in shared memory; the reads after the first
    ``open_reads`` wait until ``gate`` is set."""

    def __init__(self, n: int, open_reads: int) -> None:
        ctx = multiprocessing.get_context("fork")
        self.samples, self.open_reads = Samples(n), open_reads
        self.started, self.done, self.gate = ctx.Value("i", 0), ctx.Value("i", 0), ctx.Event()

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        with self.started.get_lock():
            ordinal, self.started.value = self.started.value, self.started.value + 1
        if ordinal >= self.open_reads:
            self.gate.wait()
        item = self.samples[i]
        with self.done.get_lock():
            self.done.value += 1
        return item


def test_data_wait_is_the_loops_wait_not_the_workers_reading_time():
    # The loader's clock is the count of samples the workers have read: its data wait is the reads the loop
    # waited for.  Two workers with two batches each in flight: batch 0 and the 4 behind it are read freely.
    reads = CountedReads(40, open_reads=5 * 4)
    calls: list[float] = []

    def clock() -> float:
        calls.append(float(reads.done.value))
        return calls[-1]

    loader = make(dataset=reads, clock=clock, **WORKERS)
    try:
        next(loader)  # starts the workers: the loop waits for batch 0's reads
        first_wait = loader.data_wait_s
        assert first_wait >= 4
        while reads.done.value < 5 * 4:  # batches 1-4 are read while the loop does its step (no bound: hang guard)
            time.sleep(0.01)
        for _ in range(4):
            next(loader)
        assert loader.data_wait_s == first_wait, "the loop was charged for reads done while it was away"
        # Batch 5 is read only once the loop waits for it: all its reads are the loop's wait.
        gate = threading.Thread(target=lambda: (wait_calls(calls, 2 * 5 + 1), reads.gate.set()), daemon=True)
        gate.start()
        next(loader)
        assert loader.data_wait_s - first_wait >= 4 and loader.last_indices == loader.indices_at(20, 4)
    finally:
        reads.gate.set()
        loader.close()


def wait_calls(calls: list[float], n: int) -> None:
    """Until the loader has read its clock ``n`` times (the last one as it began to wait for a batch)."""
    while len(calls) < n:
        time.sleep(0.005)


def run_rank(tmp: Path, rank: int, world: int, steps: int) -> Process:
    cmd = [sys.executable, str(WORKER), "--rank", str(rank), "--world", str(world), "--init", str(tmp / f"init{world}"),
           "--ckpt", str(tmp / "ckpt"), "--steps", str(steps), "--out", str(tmp / f"out{world}.{rank}.json")]
    env = launch.base_env()
    env.pop("RESILIENT_AGENT_SOCKET", None)
    return launch.popen(cmd, env)


def finish(procs: list[Process]) -> None:
    for proc in procs:
        done = launch.collect(proc, timeout=120)
        assert done.returncode == 0, f"rank failed ({done.returncode}):\n{done.output[-3000:]}"


def test_training_on_two_gloo_ranks_with_workers_resumes_on_one_rank_with_the_in_process_stream(tmp_path):
    finish([run_rank(tmp_path, r, 2, 5) for r in range(2)])
    finish([run_rank(tmp_path, 0, 1, 9)])
    two = [json.loads((tmp_path / f"out2.{r}.json").read_text()) for r in range(2)]
    one = json.loads((tmp_path / "out1.0.json").read_text())
    assert [o["world_size"] for o in two] == [2, 2] and one["world_size"] == 1
    assert one["restored_from"] == "step_0000000005" and [r["step"] for r in one["records"]] == [5, 6, 7, 8]
    assert two[0]["consumed"] == 5 * 2 * BATCH and one["consumed"] == 5 * 2 * BATCH + 4 * BATCH

    # The same steps with in-process loaders bound to the same ranks.
    ref = [ElasticLoader(Samples(N), batch_size=BATCH, seed=SEED, rank=r, world_size=2) for r in range(2)]
    for step in range(5):
        for r in range(2):
            batch = next(ref[r])
            rec = two[r]["records"][step]
            assert rec["indices"] == ref[r].last_indices, f"rank {r} step {step}: other samples"
            assert rec["x"] == batch["x"].tolist()
            assert two[r]["pid"] not in rec["pids"], "the batch was not read by a worker process"
    resumed = ElasticLoader(Samples(N), batch_size=BATCH, seed=SEED, rank=0, world_size=1)
    resumed.load_state_dict(ref[0].state_dict())
    for rec in one["records"]:
        batch = next(resumed)
        assert rec["indices"] == resumed.last_indices, f"step {rec['step']} after the resize: other samples"
        assert rec["x"] == batch["x"].tolist()


def micro(loader: ElasticLoader, steps: int) -> list:
    """``steps`` steps of ``micro_batches()``, as ``take`` records them."""
    return [(list(loader.last_indices), b["x"].clone(), b["i"].clone(), set(b["pid"].tolist()))
            for _ in range(steps) for b in loader.micro_batches()]


@pytest.mark.parametrize("persistent", [False, True], ids=["workers", "persistent-workers"])
def test_workers_serve_the_plans_micro_batches_and_a_rewind_drops_what_they_prefetched(persistent):
    def run(options: dict) -> tuple[list, list[int]]:
        loader = make(dataset=Samples(23, delay=0.002), **options)
        loader.load_state_dict({**loader.state_dict(), "global_batch": 12})  # three micro-batches a step
        got = micro(loader, 2)
        step = loader.micro_batches()
        got.append(take_one(step, loader))  # the workers read ahead of this first micro-batch of the third step
        restarts = [loader._pipeline.restarts] if loader._pipeline is not None else []
        loader.rewind(12)  # the attempt of the second step is retried
        got += micro(loader, 2)
        got += take(loader, 2)  # the classic way from there: another layout, read from the cursor on
        got += micro(loader, 1)
        if loader._pipeline is not None:
            restarts.append(loader._pipeline.restarts)
        assert loader.consumed == 12 * 3 + 4 * 2 + 12
        loader.close()
        return got, restarts

    options = {**WORKERS, "persistent_workers": persistent}
    got, restarts = run(options)
    want, _ = run({})
    assert_same(got, want)
    assert restarts[1] - restarts[0] == 3, "restarted at the rewind, at next() and back at micro_batches()"
    assert os.getpid() not in set().union(*(b[3] for b in got)), "the batches were not read in worker processes"


def take_one(step, loader: ElasticLoader) -> tuple:
    b = next(step)
    return list(loader.last_indices), b["x"].clone(), b["i"].clone(), set(b["pid"].tolist())
