"""A scheduled save never makes the loop wait for the writer unless asked to (``CheckpointConfig.when_busy``).

The policy (:mod:`resilient.checkpoint.pacing`) is pure and tested with its
reasons.  The mechanism is tested in one process with a storage whose writes
block until the test lets them go (no timing: a busy writer is busy until
released), and on two real gloo ranks where one rank's disk is slow: the
ranks must agree to defer, every commit must verify, and the run must resume
bitwise equal from a deferred save.
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest
import torch

import resilient
from resilient.checkpoint import CheckpointConfig, CheckpointManager, LocalStorage
from resilient.checkpoint.coordinator import Coordinator
from resilient.checkpoint.inspect import verify_checkpoint
from resilient.checkpoint.pacing import Busy, Pending, decide_save, local_busy, second_buffer_fits
from resilient.core.errors import ConfigError

from .helpers import assert_same_run, read_trace, run_worker

# ----------------------------------------------------------------------------------------- the pure policy


def test_a_free_writer_snapshots_and_a_busy_one_defers_with_the_step_it_is_busy_with():
    free = decide_save(step=4, due=True, pending=None, busy=Busy.FREE, busy_step=None, policy="defer")
    assert (free.action, free.pending, free.reason) == ("snapshot", None, "writer free")
    busy = decide_save(step=4, due=True, pending=None, busy=Busy.BUSY, busy_step=2, policy="defer")
    assert busy.action == "defer"
    assert busy.pending == Pending(due_step=4, slots=1, reason="writer busy with the save of step 2")
    assert busy.reason == "writer busy with the save of step 2: deferred to the first step with a free writer"


def test_due_steps_while_pending_join_the_one_pending_save_and_it_lands_late():
    pending = Pending(due_step=4, slots=1, reason="writer busy with the save of step 2")
    quiet = decide_save(step=5, due=False, pending=pending, busy=Busy.BUSY, busy_step=2, policy="defer")
    assert quiet.pending == pending and quiet.reason.endswith("still pending since step 4")
    joined = decide_save(step=6, due=True, pending=pending, busy=Busy.BUSY, busy_step=2, policy="defer")
    assert joined.pending == Pending(due_step=4, slots=2, reason=pending.reason)
    assert "this due step joins it" in joined.reason
    landed = decide_save(step=7, due=False, pending=joined.pending, busy=Busy.FREE, busy_step=None, policy="defer")
    assert (landed.action, landed.pending, landed.landed) == ("snapshot", None, joined.pending)
    assert landed.reason == "writer free; takes the save due at step 4, 3 steps late"


def test_second_buffer_queues_one_and_defers_when_both_are_busy_or_memory_is_short():
    queue = decide_save(step=3, due=True, pending=None, busy=Busy.CAN_QUEUE, busy_step=2, policy="second_buffer")
    assert queue.action == "queue" and "second buffer, queued" in queue.reason
    both = decide_save(step=3, due=True, pending=None, busy=Busy.BUSY, busy_step=1, policy="second_buffer")
    assert both.action == "defer" and "and a second save queued" in both.reason
    short = decide_save(step=3, due=True, pending=None, busy=Busy.NO_MEMORY, busy_step=1, policy="second_buffer")
    assert short.action == "defer" and "no memory for a second host buffer" in short.reason
    # One rank can queue, another cannot: the maximum decides for all, so all defer.
    assert max(Busy.CAN_QUEUE, Busy.NO_MEMORY) is Busy.NO_MEMORY


def test_local_busy_levels():
    assert local_busy(in_flight=0, policy="defer", second_buffer_fits=False) is Busy.FREE
    assert local_busy(in_flight=1, policy="defer", second_buffer_fits=True) is Busy.BUSY
    assert local_busy(in_flight=1, policy="second_buffer", second_buffer_fits=True) is Busy.CAN_QUEUE
    assert local_busy(in_flight=1, policy="second_buffer", second_buffer_fits=False) is Busy.NO_MEMORY
    assert local_busy(in_flight=2, policy="second_buffer", second_buffer_fits=True) is Busy.BUSY


def test_second_buffer_needs_headroom():
    gib = 1 << 30
    assert second_buffer_fits(0, 0)[0]
    assert second_buffer_fits(gib, 2 * gib)[0]
    ok, why = second_buffer_fits(gib, gib + (100 << 20))
    assert not ok and why == "a second buffer needs 1024 MiB plus 256 MiB headroom, only 1124 MiB available"


def test_when_busy_is_validated():
    with pytest.raises(ConfigError, match="when_busy='later' must be one of defer, second_buffer, wait"):
        CheckpointConfig(dir="x", when_busy="later")  # type: ignore[arg-type]
    with pytest.warns(UserWarning, match="has no effect with async_save=False"):
        CheckpointConfig(dir="x", when_busy="second_buffer", async_save=False)


# ------------------------------------------------------------------- one process, a writer held busy


class GatedStorage(LocalStorage):
    """Local storage whose shard writes wait until ``gate`` is set (bounded, so a test cannot hang); ``order``
    records each write let through, for tests to add what they saw return."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.gate = threading.Event()
        self.writing = threading.Event()
        self.order: list[str] = []

    def write_file(self, *args, **kwargs):
        self.writing.set()
        assert self.gate.wait(60), "the test never released the writer"
        self.order.append("write released")
        return super().write_file(*args, **kwargs)


def payloads(step: int):
    return lambda: {"rank": {"w": torch.full((64,), float(step))}, "replicated": {"m": torch.arange(32.0) * step}}


def manager(tmp_path: Path, policy: str) -> tuple[CheckpointManager, GatedStorage, resilient.EventLog]:
    storage = GatedStorage(tmp_path / policy)
    events = resilient.EventLog()
    config = CheckpointConfig(dir=tmp_path / policy, every_steps=1, keep=100, when_busy=policy)  # type: ignore[arg-type]
    return CheckpointManager(config, Coordinator(), events, storage=storage), storage, events


def at_boundary(m: CheckpointManager, step: int, due: bool = True, timeout: float = 30.0):
    """``save_due`` on a thread: returns (finished, decision); a boundary that blocks is not finished."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(m.save_due(step, due=due, payloads=payloads(step), counters={},
                                                               fingerprint={})), daemon=True)
    t.start()
    t.join(timeout)
    return (not t.is_alive()), (out[0] if out else None), t


def test_defer_never_waits_for_the_writer_and_lands_at_the_first_free_step(tmp_path):
    m, storage, events = manager(tmp_path, "defer")
    assert at_boundary(m, 1)[1].action == "snapshot"
    assert storage.writing.wait(30)
    for step in (2, 3):
        finished, decision, _ = at_boundary(m, step)
        assert finished, "a due save waited for the busy writer"
        assert decision.action == "defer"
    finished, decision, _ = at_boundary(m, 4, due=False)  # not due, still pending: nothing taken
    assert finished and decision.action == "defer" and m.pending == Pending(2, 2, m.pending.reason)
    deferred = [(e.fields["step"], e.fields["pending_since"]) for e in events.of_kind("checkpoint_deferred")]
    assert deferred == [(2, 2), (3, 2)], "one event per due step, both for the one pending save"
    storage.gate.set()
    m.wait()
    finished, decision, _ = at_boundary(m, 5, due=False)
    assert finished and decision.action == "snapshot" and decision.landed == Pending(2, 2, decision.landed.reason)
    assert m.pending is None
    m.wait()
    steps = [(r.step, r.ok, r.deferred_from, r.deferred_slots, r.waited_s) for r in m.results]
    assert steps == [(1, True, None, 0, 0.0), (5, True, 2, 2, 0.0)]
    landed = events.of_kind("checkpoint_deferred_landed")
    assert [(e.fields["due_step"], e.fields["step"], e.fields["steps_late"]) for e in landed] == [(2, 5, 3)]
    assert all(verify_checkpoint(storage, name).ok for name in storage.list_committed())


def returning(order: list[str], call) -> threading.Thread:
    """``call()`` on a thread that adds "returned" to ``order`` when it returns."""
    thread = threading.Thread(target=lambda: (call(), order.append("returned")), daemon=True)
    thread.start()
    return thread


def test_wait_policy_still_waits_for_the_writer(tmp_path):
    m, storage, events = manager(tmp_path, "wait")
    at_boundary(m, 1)
    assert storage.writing.wait(30)
    thread = returning(storage.order, lambda: m.save_due(2, due=True, payloads=payloads(2), counters={},
                                                         fingerprint={}))
    storage.gate.set()
    thread.join(30)
    assert not thread.is_alive()
    assert storage.order[0] == "write released" and "returned" in storage.order, \
        f"when_busy='wait' took the save without waiting for the writer: {storage.order}"
    m.wait()
    assert [r.step for r in m.results] == [1, 2]
    assert m.results[-1].waited_s > 0 and m.results[-1].stall_s >= m.results[-1].waited_s
    assert events.of_kind("checkpoint_deferred") == []


def test_second_buffer_queues_at_most_one_save(tmp_path):
    m, storage, events = manager(tmp_path, "second_buffer")
    at_boundary(m, 1)
    assert storage.writing.wait(30)
    finished, decision, _ = at_boundary(m, 2)
    assert finished and decision.action == "queue" and m.in_flight == 2
    finished, decision, _ = at_boundary(m, 3)
    assert finished and decision.action == "defer" and m.in_flight == 2, "a second save was queued"
    assert "and a second save queued" in events.of_kind("checkpoint_deferred")[0].fields["reason"]
    storage.gate.set()
    m.wait()
    at_boundary(m, 4)
    m.wait()
    got = [(r.step, r.ok, r.queued, r.deferred_from, r.waited_s) for r in m.results]
    assert got == [(1, True, False, None, 0.0), (2, True, True, None, 0.0), (4, True, False, 3, 0.0)]
    # The queued save was written after the one ahead of it, from its own buffer: its content is its step's.
    names = storage.list_committed()
    assert names == ["step_0000000001", "step_0000000002", "step_0000000004"]
    assert all(verify_checkpoint(storage, n).ok for n in names)
    restored = m.restore()
    assert restored is not None and restored.rank_state["w"][0].item() == 4.0


def test_second_buffer_without_memory_defers_and_says_so(tmp_path, monkeypatch):
    import psutil

    m, storage, events = manager(tmp_path, "second_buffer")
    at_boundary(m, 1)
    assert storage.writing.wait(30)

    class Scarce:
        available = 1 << 20

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Scarce())
    finished, decision, _ = at_boundary(m, 2)
    assert finished and decision.action == "defer" and m.in_flight == 1
    event = events.of_kind("checkpoint_deferred")[0].fields
    assert "no memory for a second host buffer" in event["reason"]
    assert event["memory"].startswith("a second buffer needs") and "only 1 MiB available" in event["memory"]
    storage.gate.set()
    m.wait()


def test_a_final_save_with_a_busy_writer_waits_and_commits_the_final_step(tmp_path):
    m, storage, events = manager(tmp_path, "defer")
    at_boundary(m, 1)
    assert storage.writing.wait(30)
    at_boundary(m, 2)  # deferred
    out: list = []
    final = returning(storage.order, lambda: out.append(m.save(3, payloads(3)(), counters={}, fingerprint={},
                                                                wait=True)))
    storage.gate.set()
    final.join(30)
    assert storage.order[0] == "write released" and storage.order[-1] == "returned", \
        f"the final save did not wait for the writer: {storage.order}"
    result = out[0]
    assert (result.step, result.ok, result.deferred_from) == (3, True, 2) and result.waited_s > 0
    assert m.pending is None and storage.list_committed()[-1] == "step_0000000003"
    landed = events.of_kind("checkpoint_deferred_landed")[0].fields
    assert (landed["due_step"], landed["step"]) == (2, 3) and "an explicit save" in landed["reason"]


def test_run_loop_defers_and_its_final_save_waits_for_the_busy_writer(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    events = resilient.EventLog()
    run = resilient.Run(model=model, optimizer=opt, events=events, agent=None,
                        checkpoint=CheckpointConfig(dir=tmp_path / "c", every_steps=1, keep=10))
    gate, writing = threading.Event(), threading.Event()
    real = LocalStorage.write_file
    order: list[str] = []

    def gated(self, *args, **kwargs):
        writing.set()
        assert gate.wait(60), "the test never released the writer"
        order.append("write released")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(LocalStorage, "write_file", gated)
    finished = threading.Event()

    def train() -> None:
        for _ in run.steps(4):
            model(torch.ones(1, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
        order.append("finished")
        finished.set()

    loop = threading.Thread(target=train, daemon=True)
    loop.start()
    assert writing.wait(30), "the save at step 1 never started writing"
    for _ in range(300):  # the loop runs on while the writer is held: steps 2 and 3 are deferred
        if len(events.of_kind("checkpoint_deferred")) == 2:
            break
        loop.join(0.1)
    assert [e.fields["step"] for e in events.of_kind("checkpoint_deferred")] == [2, 3]
    gate.set()
    loop.join(30)
    assert finished.is_set()
    # Nothing finished before the held write was let through (the final save's own writes may land after the loop:
    # it commits in the background until close()).
    assert order[0] == "write released" and "finished" in order, \
        f"the final save did not wait for the busy writer: {order}"
    result = run.close()
    assert (result.step, result.ok, result.deferred_from, result.deferred_slots) == (4, True, 2, 2)
    assert LocalStorage(tmp_path / "c").list_committed() == ["step_0000000001", "step_0000000004"]


# ------------------------------------------------------------------- two gloo ranks, one slow disk

STEPS = 30
# Rank 1's disk is slow, and so is rank 0's retention (it lists the checkpoints after each commit).  The commit
# is collective, so a slow write keeps both writers busy until it ends; but after the outcome rank 0 is still
# busy in retention while rank 1 is free: without agreement rank 1 would snapshot a save rank 0 defers.
SLOW = ["--slow-storage", "1", "write_file", "0.3", "--slow-storage", "0", "list_committed", "0.3",
        "--step-sleep", "0.05"]


def rank_events(prefix: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in Path(f"{prefix}.rank{rank}").read_text().splitlines()]


def of_kind(events: list[dict], kind: str) -> list[dict]:
    return [e for e in events if e["kind"] == kind]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("reference") / "trace"
    run_worker(path, "--steps", str(STEPS), nproc=2)
    return read_trace(path)


def test_two_ranks_agree_to_defer_when_one_disk_is_slow_and_resume_from_a_deferred_save(tmp_path, reference):
    ckpt, ev = tmp_path / "ckpt", tmp_path / "events"
    run_worker(tmp_path / "t", "--dir", str(ckpt), "--steps", str(STEPS), "--every", "1", "--keep", "100",
               "--when-busy", "defer", *SLOW, "--events", str(ev), nproc=2, timeout=240)
    ranks = [rank_events(ev, r) for r in (0, 1)]
    deferred = [[(e["step"], e["pending_since"]) for e in of_kind(r, "checkpoint_deferred")] for r in ranks]
    assert deferred[0], "rank 1's slow disk never made a save wait"
    assert deferred[0] == deferred[1], "the ranks took different decisions"
    landed = [[(e["due_step"], e["step"]) for e in of_kind(r, "checkpoint_deferred_landed")] for r in ranks]
    assert landed[0] == landed[1] and landed[0]
    assert all(e["reason"].startswith("writer busy with the save of step ") for e in of_kind(ranks[0],
                                                                                               "checkpoint_deferred"))
    committed = [[(e["step"], e["deferred_from"]) for e in of_kind(r, "checkpoint_committed")] for r in ranks]
    assert committed[0] == committed[1]
    assert not any(of_kind(r, "checkpoint_failed") for r in ranks)
    # Scheduled saves never waited for the writer; only the final (explicit) save may have.
    scheduled = [e for r in ranks for e in of_kind(r, "checkpoint_committed") if e["step"] != STEPS]
    assert scheduled and all(e["waited_s"] == 0.0 for e in scheduled)
    storage = LocalStorage(ckpt)
    names = storage.list_committed()
    assert names[-1] == f"step_{STEPS:010d}", "the final save did not commit the final step"
    assert [int(n.split("_")[1]) for n in names] == [s for s, _ in committed[0]]
    assert all(verify_checkpoint(storage, n).ok for n in names)

    # Resume from the newest save that was taken late (not the final one) in a location holding only it.
    late = [s for s, frm in committed[0] if frm is not None and s != STEPS]
    assert late, f"no deferred save landed before the final step: {committed[0]}"
    step = late[-1]
    resumed_dir = tmp_path / "resume"
    resumed_dir.mkdir()
    shutil.copytree(ckpt / f"step_{step:010d}", resumed_dir / f"step_{step:010d}")
    run_worker(tmp_path / "t", "--dir", str(resumed_dir), "--steps", str(STEPS), "--every", "1", "--keep", "100",
               nproc=2, timeout=240)
    resumed = read_trace(tmp_path / "t")  # the same trace: steps after the save are the resumed run's
    assert resumed.starts[-1]["restored_from"] == f"step_{step:010d}"
    assert_same_run(reference, resumed, from_step=step)


def test_two_ranks_with_the_wait_policy_save_every_step_and_wait(tmp_path):
    ckpt, ev = tmp_path / "ckpt", tmp_path / "events"
    steps = 6
    run_worker(tmp_path / "t", "--dir", str(ckpt), "--steps", str(steps), "--every", "1", "--keep", "100",
               "--when-busy", "wait", *SLOW, "--events", str(ev), nproc=2, timeout=240)
    for rank in (0, 1):
        events = rank_events(ev, rank)
        assert of_kind(events, "checkpoint_deferred") == []
        committed = of_kind(events, "checkpoint_committed")
        assert [e["step"] for e in committed] == list(range(1, steps + 1))
        assert any(e["waited_s"] > 0 for e in committed), f"rank {rank} never waited for the slow writer"
