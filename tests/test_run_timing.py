"""The Run's step timer: sections of a step, the exposed communication wait, windows; its hook changes no bit."""

from __future__ import annotations

import gc
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from resilient.run.timing import StepTimer, run_queue_wait


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_a_step_is_split_into_data_compute_comm_and_optimizer():
    clock, sent = Clock(), []
    timer = StepTimer(sent.append, window=2, clock=clock)
    timer.begin()
    for step in range(2):
        timer.switch("data")
        clock.t += 0.002                    # waiting for the batch
        timer.switch("step")
        clock.t += 0.010                    # forward and backward; the last bucket is handed over here
        timer.bucket_handed()
        clock.t += 0.004                    # the backward waits for the all-reduce: exposed
        timer.bucket_done()
        timer.optimizer_pre()
        clock.t += 0.003
        timer.optimizer_post()
        clock.t += 0.001                    # the rest of the step body
        timer.end_step(step)
    [report] = sent
    assert report["w"] == 0 and report["n"] == 2 and report["step"] == pytest.approx(0.020)
    assert report["s"] == pytest.approx({"data": 0.002, "compute": 0.011, "comm": 0.004, "optimizer": 0.003})


def test_each_window_says_how_many_steps_are_left_when_the_loop_said_how_many_it_runs():
    clock, sent = Clock(), []
    timer = StepTimer(sent.append, window=2, clock=clock)
    timer.begin()
    for step in range(2):
        clock.t += 0.01
        timer.end_step(step)
    timer.total = 10  # Run.steps(10)
    for step in range(2, 4):
        clock.t += 0.01
        timer.end_step(step)
    assert "left" not in sent[0] and sent[1]["left"] == 6  # after updates 0..3 of 10


def test_buckets_reduced_under_the_backward_are_not_counted_as_waiting():
    clock, sent = Clock(), []
    timer = StepTimer(sent.append, window=1, clock=clock)
    timer.begin()
    timer.switch("step")
    timer.bucket_handed()
    clock.t += 0.005
    timer.bucket_done()                     # the first bucket finished while the backward went on
    clock.t += 0.005
    timer.bucket_handed()                   # the last bucket: only what follows it held the backward up
    clock.t += 0.001
    timer.bucket_done()
    timer.end_step(0)
    assert sent[0]["s"]["comm"] == pytest.approx(0.001) and sent[0]["s"]["compute"] == pytest.approx(0.010)


def test_each_window_says_how_long_the_thread_waited_for_a_cpu_per_step():
    clock, sent, waited = Clock(), [], [1.0]
    timer = StepTimer(sent.append, window=2, clock=clock, cpu_wait=lambda: waited[0])
    timer.begin()
    for step in range(4):
        clock.t += 0.01
        waited[0] += 0.003 if step < 2 else 0.0005   # the scheduler kept it waiting in the first window
        timer.end_step(step)
    assert [r["cpu"] for r in sent] == pytest.approx([0.003, 0.0005])
    blind = []
    timer = StepTimer(blind.append, window=1, clock=clock, cpu_wait=lambda: None)  # no schedstat here
    timer.begin()
    timer.end_step(0)
    assert "cpu" not in blind[0]


def test_the_run_queue_wait_is_read_from_the_kernel_and_grows_while_other_threads_hog_the_cpus(tmp_path):
    before = run_queue_wait()
    assert before is not None and before >= 0  # Linux keeps it for every thread
    # More busy processes than CPUs: this thread, spinning too, must wait its turn.
    hogs = [mp.get_context("spawn").Process(target=_spin, args=(1.5,)) for _ in range((os.cpu_count() or 1) * 2)]
    for h in hogs:
        h.start()
    try:
        _spin(1.0)
    finally:
        for h in hogs:
            h.join()
    assert run_queue_wait() - before > 0.05
    (tmp_path / "bad").write_text("not numbers")
    assert run_queue_wait(str(tmp_path / "bad")) is None and run_queue_wait(str(tmp_path / "none")) is None


def _spin(seconds: float) -> None:
    import time

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_a_checkpoint_at_the_boundary_counts_in_the_next_step_and_rare_sections_report_their_mean():
    clock, sent = Clock(), []
    timer = StepTimer(sent.append, window=4, clock=clock)
    timer.begin()
    for step in range(4):
        if step == 2:
            timer.switch("checkpoint")      # the loop's stall at a step boundary
            clock.t += 0.040
            timer.switch("")
        timer.switch("step")
        clock.t += 0.010
        timer.end_step(step)
    [report] = sent
    assert report["s"]["checkpoint"] == pytest.approx(0.010)  # median 0: the mean per step instead
    assert report["step"] == pytest.approx(0.020)


def test_a_resume_mid_window_sends_the_partial_window_and_a_retried_step_is_dropped():
    clock, sent = Clock(), []
    timer = StepTimer(sent.append, window=5, clock=clock, cpu_wait=lambda: None)
    timer.begin()
    for step in (7, 8):                     # resumed at step 7: window 1 has steps 7, 8, 9
        clock.t += 0.01
        timer.end_step(step)
    clock.t += 5.0                          # a failed attempt and its recovery
    timer.begin()
    clock.t += 0.01
    timer.end_step(9)
    assert sent == [{"w": 1, "n": 3, "step": pytest.approx(0.01), "s": {"compute": pytest.approx(0.01)}}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _grads(rank: int, world: int, port: int, hooked: bool, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.05)  # several buckets
    sent: list = []
    if hooked:
        ddp.register_comm_hook(None, StepTimer(sent.append, window=1).comm_hook(None))
    torch.manual_seed(1 + rank)
    for _ in range(3):
        ddp(torch.randn(32, 64)).pow(2).mean().backward()
    if rank == 0:
        out["grads"] = [p.grad.numpy().tobytes() for p in model.parameters()]  # bytes: no shared memory
    dist.barrier()
    del ddp, model
    gc.collect()  # reference cycles holding the group go before it is destroyed (else gloo may abort at exit)
    dist.destroy_process_group()


def _spawn(rank: int, world: int, port: int, hooked: bool, queue) -> None:
    out: dict = {}
    _grads(rank, world, port, hooked, out)
    if rank == 0:
        queue.put(out["grads"])


def test_the_timing_hook_reduces_exactly_as_ddp_does_at_a_world_size_that_is_not_a_power_of_two():
    ctx = mp.get_context("spawn")
    results = []
    for hooked in (False, True):
        queue = ctx.Queue()
        port = _free_port()
        procs = [ctx.Process(target=_spawn, args=(r, 3, port, hooked, queue)) for r in range(3)]
        for p in procs:
            p.start()
        results.append(queue.get(timeout=120))  # a rank that failed sends nothing: fail, do not hang
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0
    plain, hooked = results
    assert plain == hooked


class _Ticks:
    """A clock that moves one tick per read: every interval the timer measures is positive."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def test_a_ddp_wrapper_the_script_made_is_timed_and_its_own_hook_registered_later_runs_inside():
    from resilient.run.timing import time_script_ddp

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))
        first: list = []
        assert time_script_ddp(ddp, StepTimer(first.append, window=1, clock=_Ticks(), cpu_wait=lambda: None)) is None
        states: list = []

        def own(state, bucket):
            states.append(state)
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer() * 2)  # the script's own reduction: visible in the gradients
            return fut

        ddp.register_comm_hook("mine", own)  # after the Run, as a script that wrapped DDP itself does
        with pytest.raises(RuntimeError, match="can only be called once"):
            ddp.register_comm_hook("again", own)
        later: list = []
        timer = StepTimer(later.append, window=1, clock=_Ticks(), cpu_wait=lambda: None)
        assert time_script_ddp(ddp, timer) is None  # a second Run over the wrapper takes its timing over
        timer.begin()
        x = torch.ones(4, 8)
        ddp(x).sum().backward()
        timer.end_step(0)
        assert states == ["mine"], "the script's hook ran, with the state it registered"
        assert torch.equal(ddp.module.bias.grad, torch.full((8,), 8.0)), "its result is what DDP applied"
        assert first == [] and later and later[0]["s"].get("comm", 0) > 0, later
        plain = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))
        plain.register_comm_hook(None, own)  # before the Run: DDP takes one hook, so it cannot be timed
        why = time_script_ddp(plain, StepTimer(later.append, window=1))
        assert why is not None and "registered before resilient.Run()" in why and "own" in why
    finally:
        gc.collect()
        dist.destroy_process_group()
