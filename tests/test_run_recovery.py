"""In-process recovery of a Run: survivors and a promoted spare re-form the group and retry the step.

Real processes on real gloo run ``tests/recovery_worker.py`` (a script with
no ``init_process_group`` call: ``Run(ddp=True)`` makes the group).  The
test process plays the agent: it hosts the TCPStore (the first group's
rendezvous and the recovery store), gives each worker the agent's
environment and a heartbeat socket of its own, reads the ``recovery``
reports from it, and publishes each generation's assignments when a rank
died.  Every comparison is with a run that was never interrupted.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from resilient.agent.forking import Process
from resilient.elastic.reform import Member, plan_assignments, publish_assignments
from resilient.worker.protocol import Heartbeat, decode_datagram

from . import launch
from .helpers import assert_same_tree

WORKER = Path(__file__).with_name("recovery_worker.py")
REPO = WORKER.parent.parent
STEPS = 8
KILL_AT = 5
WAIT_S = 120.0


class Agent:
    """The agent's part: the store, one heartbeat socket per worker, the processes, the assignments."""

    def __init__(self, out: Path, timeout_s: float = 60.0) -> None:
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.timeout_s = timeout_s
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=WAIT_S))
        self.sock_dir = Path(f"/tmp/rrc-{os.getpid()}-{time.monotonic_ns()}")  # short: the 107-byte limit
        self.sock_dir.mkdir(mode=0o700)
        self.procs: dict[str, Process] = {}
        self.sockets: dict[socket.socket, str] = {}
        self.heard: dict[str, list[Heartbeat]] = {}
        self._lock = threading.Lock()
        self._passes = 0
        """Passes of the receiver so far (each one reads every socket's queue empty)."""
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._receive, daemon=True)
        self._thread.start()

    def start(self, worker: str, *args: str, rank: int | None = None, world: int = 0) -> None:
        """A member (``rank`` of ``world``) or, without a rank, a spare."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(str(self.sock_dir / f"{worker}.sock"))
        with self._lock:
            self.sockets[sock] = worker
            self.heard[worker] = []
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RESILIENT_", "TORCHELASTIC_", "MASTER_"))
               and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
        env.update({"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "RESILIENT_AGENT_SOCKET": sock.getsockname(),
                    "RESILIENT_RECOVERY_STORE": f"127.0.0.1:{self.store.port}", "RESILIENT_WORKER_ID": worker,
                    "RESILIENT_RECOVERY_TIMEOUT": str(self.timeout_s), "RESILIENT_GENERATION": "0",
                    "RESILIENT_ERROR_FILE": str(self.out / f"{worker}.error.json")})
        if rank is None:
            env["RESILIENT_ROLE"] = "spare"
        else:
            env.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                        "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(self.store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"})
        with (self.out / f"{worker}.log").open("w") as log:
            self.procs[worker] = launch.popen(
                [sys.executable, str(WORKER), "--trace", str(self.out / "trace"), "--name", worker,
                 "--steps", str(STEPS), *args], env, output=log)

    def _receive(self) -> None:
        while not self._closed.is_set():
            with self._lock:
                socks = list(self.sockets)
            ready = select.select(socks, [], [], 0.01)[0] if socks else time.sleep(0.01)
            for sock in ready or ():
                while True:  # all it holds: a pass leaves nothing queued that was sent before it began
                    try:
                        data = sock.recv(65536, socket.MSG_DONTWAIT)
                    except BlockingIOError:
                        break
                    with self._lock:
                        self.heard[self.sockets[sock]].extend(decode_datagram(data))
            with self._lock:
                self._passes += 1

    def reports(self, worker: str, event: str | None = None) -> list[dict]:
        with self._lock:
            found = [hb.recovery for hb in self.heard[worker] if hb.kind == "recovery"]
        return [r for r in found if r is not None and (event is None or r["event"] == event)]

    def messages(self, worker: str) -> list[Heartbeat]:
        with self._lock:
            return list(self.heard[worker])

    def wait_for_report(self, worker: str, event: str, timeout: float = WAIT_S) -> dict:
        """The worker's first ``event`` report; ``timeout`` is a hang guard.  A worker that exited has sent all it
        will: it fails once a receiver pass that began after the exit was seen has read the worker's queue."""
        deadline = time.monotonic() + timeout
        exited_at: int | None = None
        while True:
            with self._lock:
                passes = self._passes  # read before the reports: a pass counted here was read below
            found = self.reports(worker, event)
            if found:
                return found[0]
            drained = exited_at is not None and passes >= exited_at + 2
            if drained or time.monotonic() > deadline:
                pytest.fail(f"{worker} sent no {event!r} report:\n{self.log(worker)}")
            if exited_at is None and self.procs[worker].poll() is not None:
                with self._lock:
                    exited_at = self._passes
            time.sleep(0.01)

    def publish(self, generation: int, members: list[tuple[str, int | None]], source: int = 0) -> float:
        ms = [Member(worker_id=w, new_rank=r, old_rank=old) for r, (w, old) in enumerate(members)]
        publish_assignments(self.store, plan_assignments(generation, ms, source, "127.0.0.1", self.store.port))
        return time.monotonic()

    def wait(self, worker: str, timeout: float = WAIT_S) -> int:
        try:
            return self.procs[worker].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{worker} did not exit within {timeout} s:\n{self.log(worker)}")

    def finish(self, *workers: str) -> None:
        for w in workers:
            assert self.wait(w) == 0, f"{w} exited {self.procs[w].returncode}:\n{self.log(w)}"

    def log(self, worker: str) -> str:
        return (self.out / f"{worker}.log").read_text()[-5000:]

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
        self._closed.set()
        self._thread.join(timeout=5)
        for sock in self.sockets:
            sock.close()
        for path in self.sock_dir.iterdir():
            path.unlink()
        self.sock_dir.rmdir()


def steps_of(out: Path, worker: str) -> list[dict]:
    return [rec for rec in map(json.loads, (out / f"trace.{worker}").read_text().splitlines()) if "losses" in rec]


def by_rank_and_step(out: Path, *workers: str) -> dict[tuple[int, int], dict]:
    """(rank, step) -> the step's record; a step done twice on a rank fails."""
    found: dict[tuple[int, int], dict] = {}
    for w in workers:
        for rec in steps_of(out, w):
            key = (rec["rank"], rec["step"])
            assert key not in found, f"step {rec['step']} of rank {rec['rank']} was done twice"
            found[key] = {k: rec[k] for k in ("world", "accumulation", "indices", "losses", "consumed", "samples")}
    return found


def final(out: Path, worker: str) -> dict:
    return torch.load(out / f"trace.{worker}.final.pt", weights_only=True)


def run_uninterrupted(out: Path, world: int, *args: str) -> Path:
    agent = Agent(out)
    try:
        for r in range(world):
            agent.start(f"r{r}", *args, rank=r, world=world)
        agent.finish(*(f"r{r}" for r in range(world)))
        for r in range(world):
            [ready] = agent.reports(f"r{r}", "ready")  # sent once, at the first attempt
            assert ready == {"event": "ready", "worker": f"r{r}", "role": "worker", "step": 0, "world_size": world,
                             "global_batch": 4 * world, "micro_batch": 4, "batch_rule": "refuse"}
        return out
    finally:
        agent.close()


QUIET = ("--quiet", "--samples", "48")  # no dropout or augmentation; 4 steps of 12 samples an epoch on 3 ranks


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """Two ranks, never interrupted, checkpoints every 2 steps."""
    out = tmp_path_factory.mktemp("reference")
    return run_uninterrupted(out, 2, "--dir", str(out / "ckpt"))


@pytest.fixture(scope="module")
def reference3(tmp_path_factory) -> Path:
    """Three ranks, never interrupted, without randomness in the model or the data."""
    return run_uninterrupted(tmp_path_factory.mktemp("reference3"), 3, *QUIET)


def spare_scenario(out: Path, world: int, where: str, *args: str) -> tuple[Agent, float]:
    """Ranks w0.. and spare s0; w1 dies at KILL_AT; generation 1 puts s0 in rank 1."""
    agent = Agent(out)
    agent.start("s0", *args)
    agent.wait_for_report("s0", "ready")  # pre-warmed: imports done, model built, newest checkpoint restored
    for r in range(world):
        agent.start(f"w{r}", *args, *(["--kill-step", str(KILL_AT), "--kill-where", where] if r == 1 else []),
                    rank=r, world=world)
    assert agent.wait("w1") == -signal.SIGKILL, agent.log("w1")
    members: list[tuple[str, int | None]] = [(f"w{r}", r) for r in range(world)]
    members[1] = ("s0", None)
    published = agent.publish(1, members, source=0)
    agent.finish(*(w for w, _ in members))
    return agent, published


def test_a_spare_replaces_a_rank_killed_between_steps_of_three_bitwise_with_the_carried_bucket_layout(
        reference3, tmp_path):
    # With three ranks the order of gloo's sums depends on DDP's bucket layout; a fresh wrapper would start in
    # its first-iteration layout and the retried step would differ in the last bits (3.7e-9 here).
    agent, _ = spare_scenario(tmp_path, 3, "between", *QUIET)
    try:
        got = by_rank_and_step(tmp_path, "w0", "w1", "w2", "s0")
        assert got == by_rank_and_step(reference3, "r0", "r1", "r2")
        assert [r["step"] for r in steps_of(tmp_path, "s0")] == list(range(KILL_AT, STEPS))
        for w in ("w0", "w2", "s0"):
            assert_same_tree(final(tmp_path, w), final(reference3, "r0"))
            assert agent.wait_for_report(w, "rejoined")["completed"] == KILL_AT
    finally:
        agent.close()


def test_a_spare_replaces_a_rank_killed_in_backward_and_the_run_is_bitwise_the_uninterrupted_one(
        reference, tmp_path):
    where = "backward"
    agent, published = spare_scenario(tmp_path, 2, where, "--dir", str(tmp_path / "ckpt"))
    try:
        ref = by_rank_and_step(reference, "r0", "r1")
        got = by_rank_and_step(tmp_path, "w0", "w1", "s0")  # each (rank, step) once: nothing re-done
        assert got == ref, "every step's losses and sample ids equal the uninterrupted run's"
        assert [r["step"] for r in steps_of(tmp_path, "s0")] == list(range(KILL_AT, STEPS))
        for w in ("w0", "s0"):
            assert_same_tree(final(tmp_path, w), final(reference, "r0"))
        survivor = agent.wait_for_report("w0", "rejoined")
        spare = agent.wait_for_report("s0", "rejoined")
        for report, rank, replacement in ((survivor, 0, False), (spare, 1, True)):
            assert (report["generation"], report["rank"], report["world_size"], report["completed"],
                    report["source"], report["replacement"]) == (1, rank, 2, KILL_AT, 0, replacement), report
        assert spare["failed_at"] is None and survivor["failed_at"] is not None
        assert set(survivor["seconds"]) == {"abandon", "wait", "form", "sync", "total"}
        # Ready as a spare before the members started (nothing to restore yet), then, once promoted, ready as a
        # member at its first attempt: this rank's script opted in too.
        readies = [(r["role"], r["step"], r["world_size"], r["global_batch"]) for r in agent.reports("s0", "ready")]
        assert readies == [("spare", 0, 1, 4), ("worker", KILL_AT, 2, 8)], readies
        # The spare sent nothing but recovery reports before it was promoted, then said hello as a member.
        heard = agent.messages("s0")
        first = next(i for i, hb in enumerate(heard) if hb.kind != "recovery")
        assert heard[first].kind == "hello" and heard[first].generation == 1 and heard[first].rank == 1
        assert all(hb.kind == "recovery" for hb in heard[:first])
        assert {hb.generation for hb in heard[first:]} == {1}
        assert {(hb.generation, hb.rank) for hb in agent.messages("w0") if hb.kind == "section"
                and hb.step > KILL_AT} == {(1, 0)}, "the survivor's heartbeats carry the new generation"
        # Checkpoints went on in the re-formed group, the spare writing rank 1's file.
        manifest = json.loads((tmp_path / "ckpt" / f"step_{STEPS:010d}" / "manifest.json").read_text())
        assert manifest["world_size"] == 2 and len([f for f in manifest["files"] if f["rank"] == 1]) == 1
        kill_to_done = retried_done(tmp_path, "w0", KILL_AT) - survivor["failed_at"]
        print(f"\n{where}: failure -> assignments published {published - survivor['failed_at']:.3f} s, "
              f"-> retried step done {kill_to_done:.3f} s, rejoined seconds {survivor['seconds']}")
    finally:
        agent.close()


def retried_done(out: Path, worker: str, step: int) -> float:
    return next(rec["t"] for rec in steps_of(out, worker) if rec["step"] == step)


def test_without_a_spare_the_survivors_shrink_keeping_the_global_batch(reference3, tmp_path):
    ref_out = reference3
    out = tmp_path / "shrink"
    agent = Agent(out)
    try:
        for r in range(3):
            agent.start(f"w{r}", *QUIET, *(["--kill-step", str(KILL_AT)] if r == 2 else []), rank=r, world=3)
        assert agent.wait("w2") == -signal.SIGKILL, agent.log("w2")
        agent.publish(1, [("w0", 0), ("w1", 1)], source=0)
        agent.finish("w0", "w1")
        for w in ("w0", "w1"):
            report = agent.wait_for_report(w, "rejoined")
            assert (report["world_size"], report["completed"], report["replacement"]) == (2, KILL_AT, False)
            print(f"\nshrink, {w}: failure -> retried step done "
                  f"{retried_done(out, w, KILL_AT) - report['failed_at']:.3f} s, rejoined seconds {report['seconds']}")
        ref = by_rank_and_step(ref_out, "r0", "r1", "r2")
        got = by_rank_and_step(out, "w0", "w1", "w2")
        for step in range(STEPS):
            ranks = [r for r in range(3) if (r, step) in got]
            assert ranks == ([0, 1, 2] if step < KILL_AT else [0, 1]), f"step {step} ran on ranks {ranks}"
            mine = sorted(i for r in ranks for batch in got[r, step]["indices"] for i in batch)
            theirs = sorted(i for r in range(3) for batch in ref[r, step]["indices"] for i in batch)
            assert mine == theirs and len(mine) == 12, f"step {step}: the global batch's samples differ"
            if step >= KILL_AT:
                assert got[0, step]["accumulation"] == 2 and got[0, step]["world"] == 2
        for epoch in range(STEPS * 12 // 48):  # every sample of an epoch exactly once
            seen = sorted(i for (_, step), rec in got.items() if step // 4 == epoch
                          for batch in rec["indices"] for i in batch)
            assert seen == list(range(48)), f"epoch {epoch}"
        # The same sums in another order (two micro-batches of 3 per rank, two ranks, instead of three ranks of
        # 4): equal to rounding. 1e-5 is far above float32 rounding here and far below any real divergence.
        for w in ("w0", "w1"):
            mine_state, theirs_state = final(out, w)["model"], final(ref_out, "r0")["model"]
            for name in theirs_state:
                torch.testing.assert_close(mine_state[name], theirs_state[name], rtol=0, atol=1e-5)
        assert_same_tree(final(out, "w0"), final(out, "w1"))
    finally:
        agent.close()


def test_a_survivor_whose_assignment_never_comes_gives_up_within_the_timeout(tmp_path):
    agent = Agent(tmp_path, timeout_s=3.0)
    try:
        for r in range(2):
            agent.start(f"w{r}", *(["--kill-step", "2"] if r == 1 else []), rank=r, world=2)
        assert agent.wait("w1") == -signal.SIGKILL, agent.log("w1")
        code = agent.wait("w0", 60)
        assert code != 0, agent.log("w0")
        gave_up = agent.wait_for_report("w0", "gave_up")  # which timeout fired: the recovery's 3 s, named below
        assert (gave_up["worker"], gave_up["generation"]) == ("w0", 0)
        assert gave_up["error"].startswith("AssignmentTimeoutError: worker w0: no assignment for generation 1 "
                                           "within 3 s"), gave_up
        error = json.loads((tmp_path / "w0.error.json").read_text())
        assert "AssignmentTimeoutError" in error["traceback"] and "within 3 s" in error["traceback"]
        assert error["step"] == 2
    finally:
        agent.close()
