"""In-process recovery: re-forming the gloo group among survivors and a spare, state taken from a peer.

The test process hosts the TCPStore and plays the agent (it publishes each
generation's assignments); workers are real processes on real gloo
(``tests/reform_worker.py``).  One uninterrupted 3-rank run is the
reference for the spare case and, from its step 4, for the shrink case.

``python -m tests.test_reform measure [HIDDEN LAYERS]`` runs the spare
scenario on a bigger model and prints where the time from the kill went.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from resilient.agent.forking import Process
from resilient.elastic.reform import (
    Assignment,
    AssignmentError,
    AssignmentTimeoutError,
    Member,
    assignment_key,
    is_peer_failure,
    plan_assignments,
    publish_assignments,
    wait_for_assignment,
)
from resilient.elastic.state_sync import StateSyncError, decide_source

from . import launch
from .helpers import assert_same_tree

WORKER = Path(__file__).with_name("reform_worker.py")
REPO = WORKER.parent.parent
STEPS = 8
KILL_AT = 5
WAIT_S = 120.0


@dataclass
class Cluster:
    """Worker processes and the store their agent would host; the test publishes the generations."""

    out: Path
    store: dist.TCPStore = field(init=False)
    procs: dict[str, Process] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=WAIT_S))

    def start(self, worker: str, *args: str) -> None:
        cmd = [sys.executable, str(WORKER), "--port", str(self.store.port), "--worker", worker,
               "--out", str(self.out), "--steps", str(STEPS), *args]
        with (self.out / f"{worker}.log").open("w") as log:
            self.procs[worker] = launch.popen(cmd, output=log)

    def publish(self, generation: int, members: list[tuple[str, int | None]], standby: tuple[str, ...] = (),
                source: int = 0) -> float:
        ms = [Member(worker_id=w, new_rank=r, old_rank=old) for r, (w, old) in enumerate(members)]
        publish_assignments(self.store, plan_assignments(generation, ms, source, "127.0.0.1", self.store.port,
                                                         standby))
        return time.monotonic()

    def wait(self, worker: str, timeout: float = WAIT_S) -> int:
        try:
            return self.procs[worker].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{worker} did not exit within {timeout} s:\n{self.log(worker)}")

    def finish(self, *workers: str) -> None:
        deadline = time.monotonic() + WAIT_S
        for w in workers:
            code = self.wait(w, max(1.0, deadline - time.monotonic()))
            assert code == 0, f"{w} exited {code}:\n{self.log(w)}"

    def log(self, worker: str) -> str:
        return (self.out / f"{worker}.log").read_text()[-4000:]

    def trace(self, worker: str) -> list[dict]:
        return [json.loads(line) for line in (self.out / f"{worker}.jsonl").read_text().splitlines()]

    def final(self, worker: str) -> dict:
        return torch.load(self.out / f"{worker}.final.pt", weights_only=True)

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)


def losses(trace: list[dict]) -> dict[tuple[int, int, int], str]:
    """(world size, rank, step) -> loss (hex float) of each completed step; a step completed twice fails."""
    out: dict[tuple[int, int, int], str] = {}
    for rec in trace:
        if rec["event"] == "step":
            key = (rec["world"], rec["rank"], rec["step"])
            assert key not in out, f"step {rec['step']} completed twice on rank {rec['rank']}"
            out[key] = rec["loss"]
    return out


def assert_same_state(a: dict, b: dict) -> None:
    """Model, optimizer and scheduler state bitwise equal."""
    for part in ("model", "optimizer", "scheduler"):
        assert_same_tree(a[part], b[part], part)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted 3-rank run; rank 0 dumps its state after step KILL_AT - 1."""
    cluster = Cluster(tmp_path_factory.mktemp("reference"))
    try:
        for w in ("r0", "r1", "r2"):
            cluster.start(w, *(["--dump-at", str(KILL_AT - 1)] if w == "r0" else []))
        cluster.publish(1, [("r0", 0), ("r1", 1), ("r2", 2)])
        cluster.finish("r0", "r1", "r2")
        found: dict = {}
        for w in ("r0", "r1", "r2"):
            found.update(losses(cluster.trace(w)))
        assert len(found) == 3 * STEPS
        return found, cluster.final("r0"), cluster.out / "dump.pt"
    finally:
        cluster.close()


def recovery_times(cluster: Cluster, survivors: tuple[str, ...], victim: str, published: float) -> dict[str, float]:
    """Seconds from the kill to each stage, on the slowest survivor (one host: one monotonic clock)."""
    kill = next(r["t"] for r in cluster.trace(victim) if r["event"] == "kill")
    stages: dict[str, float] = {"assignments published": published - kill}
    for w in survivors:
        trace = cluster.trace(w)
        failure = next(r for r in trace if r["event"] == "failure")
        gen2 = next(r for r in trace if r["event"] == "generation" and r["generation"] == 2)
        retried = next(r for r in trace if r["event"] == "step" and r["generation"] == 2)
        for name, t in (("exception", failure["t"]), ("group re-formed", gen2["formed"]),
                        ("state synced", gen2["synced"]), ("retried step done", retried["t"])):
            stages[name] = max(stages.get(name, 0.0), t - kill)
        stages["first exception"] = min(stages.get("first exception", 1e9), failure["t"] - kill)
    return stages


def run_spare_scenario(out: Path, *extra: str) -> tuple[Cluster, dict[str, float]]:
    cluster = Cluster(out)
    for w in ("w0", "w1", "w2", "spare"):
        cluster.start(w, *extra, *(["--kill-at", str(KILL_AT)] if w == "w1" else []))
    cluster.publish(1, [("w0", 0), ("w1", 1), ("w2", 2)], standby=("spare",))
    assert cluster.wait("w1") == -signal.SIGKILL, cluster.log("w1")
    published = cluster.publish(2, [("w0", 0), ("spare", None), ("w2", 2)], source=0)
    cluster.finish("w0", "w2", "spare")
    return cluster, recovery_times(cluster, ("w0", "w2"), "w1", published)


def test_a_spare_replaces_a_rank_killed_in_backward_and_the_run_is_bitwise_the_uninterrupted_one(
        reference, tmp_path):
    ref_losses, ref_final, _ = reference
    cluster, times = run_spare_scenario(tmp_path)
    try:
        got: dict = {}
        for w in ("w0", "w1", "w2", "spare"):
            got.update(losses(cluster.trace(w)))  # each (rank, step) once: nothing re-done, nothing skipped
        assert got == ref_losses
        for w in ("w0", "w2", "spare"):
            assert_same_state(cluster.final(w), ref_final)
        for w in ("w0", "w2"):
            failure = next(r for r in cluster.trace(w) if r["event"] == "failure")
            assert failure["step"] == KILL_AT and failure["generation"] == 1, failure
        joined = next(r for r in cluster.trace("spare") if r["event"] == "generation")
        assert (joined["generation"], joined["rank"], joined["replacement"]) == (2, 1, True)
        assert (joined["source"], joined["completed"]) == (0, KILL_AT - 1), joined
        gen2 = next(r for r in cluster.trace("w0") if r["event"] == "generation" and r["generation"] == 2)
        assert gen2["subgroups"] == {"workers": ["w0", "spare", "w2"], "max_rank": 2}, gen2
        print("recovery (s after the kill):", {k: round(v, 4) for k, v in times.items()})
    finally:
        cluster.close()


def test_without_a_spare_the_survivors_shrink_and_continue_like_a_two_rank_run_from_that_step(reference, tmp_path):
    ref_losses, _, dump = reference
    cluster = Cluster(tmp_path / "shrink")
    shrunk = Cluster(tmp_path / "two")
    try:
        for w in ("w0", "w1", "w2"):
            cluster.start(w, *(["--kill-at", str(KILL_AT)] if w == "w1" else []))
        cluster.publish(1, [("w0", 0), ("w1", 1), ("w2", 2)])
        for w in ("t0", "t1"):
            shrunk.start(w, "--load", str(dump))
        shrunk.publish(1, [("t0", 0), ("t1", 1)])
        assert cluster.wait("w1") == -signal.SIGKILL, cluster.log("w1")
        cluster.publish(2, [("w0", 0), ("w2", 2)], source=0)
        cluster.finish("w0", "w2")
        shrunk.finish("t0", "t1")

        got: dict = {}
        for w in ("w0", "w1", "w2"):
            got.update(losses(cluster.trace(w)))
        two: dict = {}
        for w in ("t0", "t1"):
            two.update(losses(shrunk.trace(w)))
        before = {k: v for k, v in ref_losses.items() if k[2] < KILL_AT}
        assert {k: v for k, v in got.items() if k[0] == 3} == before
        assert {k: v for k, v in got.items() if k[0] == 2} == two
        assert sorted(k[1:] for k in two) == [(r, s) for r in (0, 1) for s in range(KILL_AT, STEPS + 1)]
        for w in ("w0", "w2"):
            gen2 = next(r for r in cluster.trace(w) if r["event"] == "generation" and r["generation"] == 2)
            assert (gen2["world"], gen2["completed"]) == (2, KILL_AT - 1), gen2
            assert gen2["subgroups"]["max_rank"] == 1, gen2
            if w == "w0":
                assert gen2["subgroups"]["workers"] == ["w0", "w2"], gen2
            assert_same_state(cluster.final(w), shrunk.final("t0"))
    finally:
        cluster.close()
        shrunk.close()


def test_a_rank_whose_model_does_not_fit_the_source_fails_on_every_rank_at_once_naming_the_misfit(tmp_path):
    cluster = Cluster(tmp_path)
    try:
        cluster.start("a")
        cluster.start("b", "--hidden", "16")
        cluster.publish(1, [("a", 0), ("b", 1)])
        codes = {w: cluster.wait(w, 60) for w in ("a", "b")}
        assert codes == {"a": 1, "b": 1}, codes
        assert "StateSyncError: rank 1: the model does not match the source's" in cluster.log("b")
        assert "StateSyncError: rank 0: another rank's state does not fit the source's" in cluster.log("a")
        assert not any(r["event"] == "step" for w in ("a", "b") for r in cluster.trace(w))
    finally:
        cluster.close()


# ---- the pieces, one process ------------------------------------------------------------------------------------


def _assignment(**over) -> Assignment:
    fields = {
        "generation": 2, "worker_id": "b", "source_rank": 0, "store_host": "127.0.0.1", "store_port": 1234,
        "prefix": "reform/g2/",
        "members": (Member(worker_id="a", new_rank=0, old_rank=0), Member(worker_id="b", new_rank=1)),
    }
    fields.update(over)
    return Assignment(**fields)


def test_an_assignment_round_trips_through_json_and_says_who_is_a_replacement():
    a = _assignment()
    assert Assignment.from_json(a.to_json()) == a
    assert (a.rank, a.world_size, a.replacements, a.is_replacement) == (1, 2, (1,), True)
    assert _assignment(worker_id="c").rank is None  # not a member: standby


@pytest.mark.parametrize("over, words", [
    ({"source_rank": 1}, "replacement without state"),
    ({"source_rank": 5}, "not a rank"),
    ({"members": (Member(worker_id="a", new_rank=0), Member(worker_id="b", new_rank=2))}, "0..1 once each"),
    ({"members": (Member(worker_id="a", new_rank=0, old_rank=0), Member(worker_id="a", new_rank=1))}, "twice"),
    ({"generation": 0}, ">= 1"),
    ({"store_port": 0}, "store address"),
])
def test_a_malformed_assignment_is_refused_naming_the_problem(over, words):
    with pytest.raises(AssignmentError, match=words):
        _assignment(**over)


def test_a_truncated_or_foreign_assignment_is_refused():
    with pytest.raises(AssignmentError, match="not JSON"):
        Assignment.from_json(_assignment().to_json()[:-5])
    with pytest.raises(AssignmentError, match="resilient.assignment/1"):
        Assignment.from_json('{"generation": 2}')
    body = json.loads(_assignment().to_json())
    del body["store_port"]
    with pytest.raises(AssignmentError, match="store_port"):
        Assignment.from_json(json.dumps(body))


def test_a_spare_waits_through_standby_generations_and_a_missing_one_times_out_naming_the_key():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    members = [Member(worker_id="a", new_rank=0, old_rank=0)]
    publish_assignments(store, plan_assignments(1, members, 0, "127.0.0.1", store.port, standby=("s",)))
    members2 = [Member(worker_id="a", new_rank=0, old_rank=0), Member(worker_id="s", new_rank=1)]
    publish_assignments(store, plan_assignments(2, members2, 0, "127.0.0.1", store.port))
    got = wait_for_assignment(store, "s", 0, timeout_s=5)
    assert (got.generation, got.rank, got.is_replacement, got.prefix) == (2, 1, True, "reform/g2/")
    # On a clock that stands still the whole 0.3 s is left for the store's wait, which says what it waited: the
    # call's timeout, not the store's 10 s.
    with pytest.raises(AssignmentTimeoutError, match=rf"within 0.3 s \(store key '{assignment_key(3, 's')}': "
                                                     r"wait timeout after 300ms"):
        wait_for_assignment(store, "s", 2, timeout_s=0.3, clock=lambda: 100.0)


def test_the_agent_can_plan_assignments_without_importing_torch():
    code = ("import sys; from resilient.elastic.reform import Member, plan_assignments; "
            "a = plan_assignments(3, [Member(worker_id='w', new_rank=0, old_rank=1)], 0, 'h', 1); "
            "print(a[0].prefix, 'torch' in sys.modules)")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    assert out.split() == ["reform/g3/", "False"]


def test_the_source_is_a_rank_that_completed_the_most_so_an_update_is_never_applied_twice_or_lost():
    kept = decide_source([4, None, 4], preferred=0)
    assert (kept.source_rank, kept.completed, kept.replacements, kept.behind) == (0, 4, (1,), ())
    assert "agent's choice" in kept.reason
    ahead = decide_source([4, 5, 5], preferred=0)  # rank 0 had not applied step 5's update
    assert (ahead.source_rank, ahead.completed, ahead.behind) == (1, 5, (0,))
    assert "had completed step 4" in ahead.reason and "[0] had not applied step 5" in ahead.reason
    with pytest.raises(StateSyncError, match="diverged"):
        decide_source([3, 5])
    with pytest.raises(StateSyncError, match="no rank holds training state"):
        decide_source([None, None])


def test_gloo_errors_of_a_lost_peer_are_recognised_and_others_are_not():
    assert is_peer_failure(RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:538] Connection closed by peer"))
    assert is_peer_failure(dist.DistBackendError("anything"))
    assert not is_peer_failure(ValueError("Connection closed by peer"))
    assert not is_peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


def _measure(hidden: int, layers: int) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        mb = sum(p.numel() for p in __import__("tests.reform_worker", fromlist=["build"]).build(hidden, layers)
                 .parameters()) * 4 / 2**20
        cluster, times = run_spare_scenario(Path(tmp), "--hidden", str(hidden), "--layers", str(layers))
        cluster.close()
        gen2 = [r for w in ("w0", "w2", "spare") for r in cluster.trace(w)
                if r["event"] == "generation" and r["generation"] == 2]
        print(f"model {mb:.0f} MB of parameters (+2x Adam state), 3 ranks, spare replaces rank 1")
        for name, t in sorted(times.items(), key=lambda kv: kv[1]):
            print(f"  {name:24s} {t * 1000:9.1f} ms after the kill")
        print("  sync (all ranks):", [round((r["synced"] - r["formed"]) * 1000, 1) for r in gen2], "ms")
        ends = [r["t"] for r in cluster.trace("w0") if r["event"] == "step" and r["generation"] == 1]
        gaps = sorted(b - a for a, b in itertools.pairwise(ends))
        print(f"  a step before the failure: {gaps[len(gaps) // 2] * 1000:.1f} ms (median)")


if __name__ == "__main__":
    if sys.argv[1:2] == ["measure"]:
        _measure(*(int(a) for a in sys.argv[2:4])) if len(sys.argv) > 2 else _measure(2048, 6)


def test_a_member_waiting_for_the_others_leaves_when_its_generation_is_abandoned_and_not_before():
    """The arrival count before ``init_process_group`` is the interruptible part of forming a group: a member
    whose peer died before arriving leaves on the agent's abort instead of waiting out its timeout."""
    from resilient.elastic.reform import ReformAborted, reform

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    [mine] = [a for a in plan_assignments(5, [Member(worker_id="w0", new_rank=0, old_rank=0),
                                               Member(worker_id="w1", new_rank=1, old_rank=1)], 0, "127.0.0.1",
                                          store.port) if a.worker_id == "w0"]
    asked: list[float] = []

    def aborted() -> bool:
        asked.append(time.monotonic())
        return len(asked) >= 5  # the agent abandons the generation after a few looks

    with pytest.raises(ReformAborted, match="generation 5 was abandoned while it formed \\(1 of 2 members"):
        reform(mine, timeout_s=60, store=store, aborted=aborted)
    assert len(asked) == 5  # it left at the first look that said so (a timeout is a ReformError, not this)
    assert not dist.is_initialized()


def test_a_member_gives_up_a_dead_agents_store_when_its_generation_is_abandoned():
    """The store a generation forms on is the deciding agent's: if that agent is gone, connecting is retried a
    second at a time until the member's own agent abandons the generation, not for the whole timeout."""
    import socket

    from resilient.elastic.reform import ReformAborted, reach_store

    with socket.socket() as probe:  # a port with nothing behind it: the agent that hosted the store is gone
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    looks: list[int] = []
    with pytest.raises(ReformAborted, match=f"store generation 7 forms on \\(127.0.0.1:{port}\\) is unreachable"):
        reach_store("127.0.0.1", port, 60, 7, lambda: looks.append(1) or len(looks) >= 2)
    assert len(looks) == 2
    live = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    reached = reach_store("127.0.0.1", live.port, 60, 7, lambda: False)
    assert reached.timeout == timedelta(seconds=60)  # its later waits keep the whole bound, not the 1 s attempt
