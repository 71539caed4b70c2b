"""What an agent leaves when it dies, what the next one sweeps, and status that never waits on the network.

Real agents (``resilient run``) and real workers; the etcd outage uses a
real etcd that the test stops and starts.  The sweep's waiting and its
stuck-process verdict are also tested against a made-up ``/proc``, since a
process that SIGKILL cannot end (``D`` state) cannot be made on demand.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from resilient.agent.generation import SIGNALLED_POLL_S, _signalled_with_agent
from resilient.agent.launcher import Exit
from resilient.agent.sweep import AgentAlreadyRunningError, NodeProcesses, Stuck
from resilient.core.exitcodes import EXIT_PREEMPTED_AGENT, EXIT_UNHEALTHY
from resilient.watchdog.procfs import read_stat

from .agent_helpers import (
    agent_env,
    events,
    events_so_far,
    explain,
    incidents,
    node_status,
    run_agent,
    start_agent,
    wait_for,
)
from .helpers import read_trace

NODE = "n0"
HANG_GUARD_S = 60
"""Waits for something that must happen end only then; this bounds a hang, not how fast it happens."""


def gone(pid: int) -> bool:
    """No such process any more (a zombie is dead: only its exit status waits for its parent)."""
    st = read_stat(pid)
    return st is None or st.state in ("Z", "X")


def train_args(tmp_path: Path, steps: int) -> tuple[str, ...]:
    return ("--steps", str(steps), "--every", "5", "--keep", "3", "--dir", str(tmp_path / "ckpt"),
            "--trace", str(tmp_path / "trace"), "--step-sleep", "0.1")


def test_a_sigkilled_agent_takes_its_workers_and_the_next_agent_completes_the_run(tmp_path):
    run_dir, steps = tmp_path / "run", 40
    flags = ("--nproc-per-node", "2", "--node-id", NODE)
    agent = start_agent(run_dir, *flags, script_args=train_args(tmp_path, steps), log=tmp_path / "first.log")
    try:
        status = wait_for(lambda: (s := node_status(run_dir, NODE)) and len(s["ranks"]) == 2
                          and all(r["step"] >= 8 for r in s["ranks"].values()) and s, timeout=180,
                          what="both ranks past step 8 (a checkpoint committed)")
    finally:
        agent.kill()
        agent.wait()
    pids = [r["pid"] for r in status["ranks"].values()]
    [started] = events(run_dir, "workers_started")
    assert sorted(started["pids"].values()) == sorted(pids)
    # The parent-death signal ends them; only a hang guard bounds the wait.
    wait_for(lambda: all(gone(p) for p in pids), timeout=HANG_GUARD_S, interval=0.01,
             what=f"the workers to die with their agent: {[read_stat(p) for p in pids]}")

    proc = run_agent(run_dir, *flags, script_args=train_args(tmp_path, steps), timeout=240)
    assert proc.returncode == 0, explain(proc)
    assert not events(run_dir, "leftovers_swept"), "the parent-death signal left nothing to sweep"
    [lost] = events(run_dir, "previous_agent_lost")
    assert lost["previous_agent"] == agent.pid and lost["generation"] == 1, lost
    record = json.loads((run_dir / "nodes" / NODE / "pids.json").read_text())
    assert record["finished"] is True and record["agent"]["pid"] != agent.pid, record
    for rank in (0, 1):
        trace = read_trace(tmp_path / "trace", rank)
        assert len(trace.starts) == 2 and trace.starts[1]["restored_from"] is not None
        assert trace.end is not None and trace.end["step"] == steps


def test_a_scheduler_that_sigterms_the_workers_before_the_agent_is_a_stop_not_a_failure(tmp_path):
    """Slurm's preemption, `scontrol requeue` and scancel signal every process of the job: here the workers get
    SIGTERM a moment before their agent does (the worst order for the agent), which must stop with 75 and count
    neither an incident nor a restart."""
    run_dir = tmp_path / "run"
    # The window is a hang guard here: how long it is by default is the unit test's business (below), what this
    # test proves is the order (both workers dead of SIGTERM before the agent gets its own) and its outcome.
    flags = ("--nproc-per-node", "2", "--node-id", NODE, "--signalled-together", str(HANG_GUARD_S))
    agent = start_agent(run_dir, *flags, script_args=train_args(tmp_path, 400), log=tmp_path / "agent.log")
    try:
        status = wait_for(lambda: (s := node_status(run_dir, NODE)) and len(s["ranks"]) == 2
                          and all(r["step"] >= 3 for r in s["ranks"].values()) and s, timeout=180,
                          what="both ranks training")
        pids = [r["pid"] for r in status["ranks"].values()]
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        # Dead, and seen dead by the agent (its status says so once it recorded their exits): only then does the
        # agent get its own SIGTERM, so it must already be deciding about two failures when the signal comes.
        wait_for(lambda: all(gone(p) for p in pids) and (s := node_status(run_dir, NODE)) is not None
                 and [r["alive"] for r in s["ranks"].values()] == [False, False], timeout=HANG_GUARD_S,
                 interval=0.01, what="both workers dead of their SIGTERM, as the agent's status says")
        assert agent.poll() is None, "the agent ended before it got its own SIGTERM"
        agent.send_signal(signal.SIGTERM)
        code = agent.wait(timeout=120)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    log = (tmp_path / "agent.log").read_text()
    assert code == EXIT_PREEMPTED_AGENT, log
    [finished] = events(run_dir, "agent_finished")
    assert finished["verdict"] == "preempted" and finished["restarts_used"] == 0, finished
    assert "got SIGTERM together" in finished["reason"], finished
    assert not events(run_dir, "incident") and not incidents(run_dir), log


class FakeClock:
    """A clock that only the waiting code's sleeps move; ``stop_at``: when the agent's SIGTERM arrives."""

    def __init__(self, stop_at: float | None = None) -> None:
        self.now = 0.0
        self.stop_at = stop_at
        self.sleeps: list[float] = []

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s

    def stop_requested(self) -> str | None:
        return "SIGTERM" if self.stop_at is not None and self.now >= self.stop_at else None


def _exit(rank: int, returncode: int) -> Exit:
    return Exit(rank=rank, local_rank=rank, pid=100 + rank, returncode=returncode, at=0.0)


def test_workers_dead_of_sigterm_wait_for_the_agents_own_sigterm_within_the_window_and_no_longer():
    sigterm = [_exit(0, -signal.SIGTERM), _exit(1, -signal.SIGTERM)]

    def signalled(clock: FakeClock, failed: list[Exit] = sigterm) -> bool:
        return _signalled_with_agent(failed, clock.stop_requested, lambda: clock.now, 1.0, sleep=clock.sleep)

    late = FakeClock(stop_at=0.3)  # the scheduler's SIGTERM reaches the agent 0.3 s after its workers'
    assert signalled(late) is True
    assert 0.3 <= late.now < 0.3 + SIGNALLED_POLL_S, "answered at the first look after the stop arrived"
    never = FakeClock()
    assert signalled(never) is False
    assert never.now == pytest.approx(1.0) and sum(never.sleeps) == pytest.approx(1.0), "the window, exactly"
    assert max(never.sleeps) <= SIGNALLED_POLL_S
    already = FakeClock(stop_at=0.0)
    assert signalled(already) is True and already.sleeps == []
    other = FakeClock(stop_at=0.0)  # a crash among them, or a kill: a failure, not waited on
    assert signalled(other, [sigterm[0], _exit(1, -signal.SIGKILL)]) is False
    assert signalled(other, [_exit(0, 1)]) is False and other.sleeps == []


# A worker that starts a helper in its own process group (as a data-prep tool or a shell pipeline
# would): the parent-death signal reaches the worker, not the helper, which init adopts.
LEAVES_A_HELPER = """
import os, pathlib, subprocess, sys, time
out = pathlib.Path(sys.argv[1])
if (out / "launched").exists():
    sys.exit(0)  # the second agent's worker: the run is done
(out / "launched").write_text("")
helper = subprocess.Popen(["sleep", "600"])
(out / "helper.tmp").write_text(f"{helper.pid} {os.getpid()}")
os.replace(out / "helper.tmp", out / "helper")
time.sleep(600)
"""


def test_a_second_agent_refuses_a_live_one_and_the_next_sweeps_what_a_dead_one_left(tmp_path):
    run_dir = tmp_path / "run"
    script = tmp_path / "leaves_a_helper.py"
    script.write_text(LEAVES_A_HELPER)
    flags = ("--node-id", NODE)
    agent = start_agent(run_dir, *flags, script=script, script_args=(str(tmp_path),), log=tmp_path / "first.log")
    helper = worker = None
    try:
        wait_for(lambda: (tmp_path / "helper").exists(), timeout=60, what="the worker to start its helper")
        helper, worker = map(int, (tmp_path / "helper").read_text().split())
        assert read_stat(helper).pgid == worker

        refused = run_agent(run_dir, *flags, script=script, script_args=(str(tmp_path),), timeout=60)
        assert refused.returncode == 2, explain(refused)
        assert f"agent pid {agent.pid} is still running" in refused.stderr and "--node-id" in refused.stderr
        assert not gone(worker) and not gone(helper), "a refused agent must not touch the live agent's workers"
    finally:
        agent.kill()
        agent.wait()
    try:
        wait_for(lambda: gone(worker), timeout=HANG_GUARD_S, what="the worker to die with its agent", interval=0.01)
        assert not gone(helper), "the helper is outside the parent-death signal's reach: the sweep's case"

        proc = run_agent(run_dir, *flags, script=script, script_args=(str(tmp_path),), timeout=120)
        assert proc.returncode == 0, explain(proc)
        [swept] = events(run_dir, "leftovers_swept")
        assert swept["pids"] == [helper] and swept["previous_agent"] == agent.pid and swept["stuck"] == []
        assert gone(helper)
    finally:
        if helper is not None and not gone(helper):
            os.kill(helper, signal.SIGKILL)


def test_unhealthy_node_writes_an_incident_with_the_failed_checks(tmp_path):
    run_dir = tmp_path / "run"
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('must not start')\n")
    proc = run_agent(run_dir, "--node-id", NODE, "--health-path", str(tmp_path), "--min-free-disk-gb", "1000000",
                     script=script, timeout=120)
    assert proc.returncode == EXIT_UNHEALTHY, explain(proc)
    [incident] = incidents(run_dir)
    assert incident["kind"] == "unhealthy" and incident["node"] == NODE
    [problem] = incident["problems"]
    assert "free disk" in problem and str(tmp_path) in problem
    assert incident["decision"]["verdict"] == "unhealthy"
    [announced] = events(run_dir, "incident")
    assert announced["failure"] == "unhealthy" and announced["problems"] == [problem]
    # ... and it is counted where resilient_incidents_total{kind="unhealthy"} is read from.
    ledger = json.loads((run_dir / "nodes" / NODE / "ledger.json").read_text())
    assert ledger["agent"]["incidents_by_kind"] == {"unhealthy": 1}, ledger.get("agent")


def test_status_and_ledger_keep_updating_while_etcd_is_down(tmp_path, etcd_outage_server):
    run_dir, steps = tmp_path / "run", 250
    flags = ("--nnodes", "1", "--store", etcd_outage_server.url, "--run-id", "outage-status", "--node-id", NODE,
             "--local-addr", "127.0.0.1")
    agent = start_agent(run_dir, *flags, script_args=train_args(tmp_path, steps), log=tmp_path / "agent.log")
    ledger = run_dir / "nodes" / NODE / "ledger.json"
    try:
        wait_for(lambda: (s := node_status(run_dir, NODE)) and s["ranks"] and s["ranks"]["0"]["step"] >= 3,
                 timeout=180, what="the worker past step 3")
        earlier = len(events_so_far(run_dir))
        etcd_outage_server.stop()
        start = wait_for(lambda: _next(run_dir, earlier, "store_outage_start"), timeout=HANG_GUARD_S,
                         what="the agent to notice the outage")
        # Writes the agent made after it knew the store was down: status by its own time stamp (the agent's clock,
        # as the event's), the ledger by a new file seen after the event (its mtime is the file system's clock).
        status_writes: set[float] = set()
        ledger_mtimes = {ledger.stat().st_mtime_ns}

        def written_during_the_outage() -> bool:
            s = node_status(run_dir, NODE)
            if s is not None and s["updated_at"] > start["time"]:
                status_writes.add(s["updated_at"])
            ledger_mtimes.add(ledger.stat().st_mtime_ns)
            return len(status_writes) >= 4 and len(ledger_mtimes) >= 3  # the ledger every 5 s, status every second

        wait_for(written_during_the_outage, timeout=HANG_GUARD_S, interval=0.05,
                 what="4 status.json and 2 ledger.json writes while etcd is down")
        assert not events(run_dir, "store_outage_end"), "etcd is still down: the outage cannot have ended"
        etcd_outage_server.start()
        code = agent.wait(timeout=240)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    assert code == 0, (tmp_path / "agent.log").read_text()[-3000:]
    # Every counted write falls strictly inside the outage: after its start, before its end.
    end = _next(run_dir, events(run_dir).index(start), "store_outage_end")
    assert end is not None, "the agent never said the outage ended"
    assert all(start["time"] < t < end["time"] for t in status_writes), (start, sorted(status_writes), end)


def _next(run_dir: Path, after: int, kind: str) -> dict | None:
    """The first event of ``kind`` after the first ``after`` events of the run, or None (none yet)."""
    return next((e for e in events_so_far(run_dir)[after:] if e["kind"] == kind), None)


# ------------------------------------------------------------ a made-up /proc
class FakeProc:
    """A /proc directory with ``stat`` files we write, and a killpg that takes processes away."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.killed: list[tuple[int, int]] = []
        self.unkillable: set[int] = set()
        root.mkdir()

    def add(self, pid: int, *, pgid: int, state: str = "S", start: int = 1000) -> None:
        fields = [state, "1", str(pgid), str(pgid)] + ["0"] * 15 + [str(start)] + ["0"] * 10
        (self.root / str(pid)).mkdir(exist_ok=True)
        (self.root / str(pid) / "stat").write_text(f"{pid} (py thon) {' '.join(fields)}\n")

    def killpg(self, pgid: int, signum: int) -> None:
        self.killed.append((pgid, signum))
        for entry in list(self.root.iterdir()):
            st = read_stat(int(entry.name), self.root)
            if st is not None and st.pgid == pgid and st.pid not in self.unkillable:
                (entry / "stat").unlink()
                entry.rmdir()


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0

    def sleep(self, s: float) -> None:
        self.now += s


def _processes(tmp_path: Path, proc: FakeProc, clock: FakeTime) -> NodeProcesses:
    node_dir = tmp_path / "node"
    node_dir.mkdir(exist_ok=True)
    return NodeProcesses(node_dir, proc_root=proc.root, killpg=proc.killpg, clock=lambda: clock.now,
                         sleep=clock.sleep)


def test_sweep_kills_recorded_groups_skips_reused_pids_and_names_a_stuck_process(tmp_path):
    proc, clock = FakeProc(tmp_path / "proc"), FakeTime()
    proc.add(100, pgid=100, state="D", start=555)  # rank 0, stuck in uninterruptible sleep
    proc.add(101, pgid=100, start=560)  # a helper rank 0 started
    proc.add(200, pgid=200, start=999)  # rank 1's pid, reused by an unrelated process
    proc.add(301, pgid=300, start=800)  # rank 2 is gone, its helper is not
    proc.unkillable.add(100)
    first = _processes(tmp_path, proc, clock)
    first.claim()
    (tmp_path / "node" / "pids.json").write_text(
        '{"agent": {"pid": 7, "start_ticks": 1}, "generation": 4, "workers": ['
        '{"rank": 0, "pid": 100, "start_ticks": 555}, {"rank": 1, "pid": 200, "start_ticks": 600},'
        '{"rank": 2, "pid": 300, "start_ticks": 790}]}')
    first.release()

    result = _processes(tmp_path, proc, clock).claim()
    assert sorted(proc.killed) == [(100, signal.SIGKILL), (300, signal.SIGKILL)], "pid 200 was reused: spared"
    assert sorted(result.killed) == [100, 101, 301] and result.previous_agent == 7
    assert result.stuck == (Stuck(100, 0, "D (disk sleep)", 555),)
    assert "worker pid 100 (rank 0) still exists after SIGKILL, in state D (disk sleep)" in result.stuck[0].describe()
    assert 10.0 <= clock.now < 10.1, "it waited the kill bound, and no longer"


def test_a_stuck_process_that_ends_is_waited_for_and_one_that_stays_is_reported(tmp_path):
    proc, clock = FakeProc(tmp_path / "proc"), FakeTime()
    proc.add(100, pgid=100, state="D", start=555)
    processes = _processes(tmp_path, proc, clock)
    stuck = (Stuck(100, 0, "D (disk sleep)", 555),)
    assert processes.wait_stuck(stuck, timeout_s=5.0) == stuck and clock.now >= 5.0
    proc.add(100, pgid=100, state="Z", start=555)  # it died; only its parent has yet to reap it
    assert processes.wait_stuck(stuck, timeout_s=5.0) == ()


def test_only_one_agent_holds_a_node_directory(tmp_path):
    proc, clock = FakeProc(tmp_path / "proc"), FakeTime()
    first = _processes(tmp_path, proc, clock)
    first.claim()
    with pytest.raises(AgentAlreadyRunningError, match=rf"agent pid {os.getpid()} is still running"):
        _processes(tmp_path, proc, clock).claim()
    first.release()
    _processes(tmp_path, proc, clock).claim()  # free again once released (or once its holder died)


def test_a_worker_spawned_with_the_parent_death_signal_dies_when_its_parent_is_killed(tmp_path):
    """The mechanism alone: a parent that spawns through WorkerGroup, SIGKILLed."""
    code = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from resilient.agent.launcher import WorkerGroup, WorkerSpec\n"
        f"log = Path({str(tmp_path)!r}) / 'w.log'\n"
        "g = WorkerGroup([WorkerSpec(local_rank=0, rank=0, argv=('sleep', '600'), env={}, log_file=log, echo=False)])\n"
        "print(g.workers[0].pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=agent_env())
    try:
        child = int(parent.stdout.readline())
        assert not gone(child)
    finally:
        parent.kill()
        parent.wait()
    wait_for(lambda: gone(child), timeout=HANG_GUARD_S, what="the worker to die with its parent", interval=0.01)


def test_a_store_that_hangs_delays_only_the_store_copy_of_the_status(tmp_path):
    """The local files keep their cadence while every store call blocks; the last count read is shown."""
    import json
    import threading

    from resilient.agent.accounting import NodeAccounting
    from resilient.agent.config import AgentConfig
    from resilient.agent.status import StatusPublisher
    from resilient.agent.tracker import RankTracker
    from resilient.metrics.ledger import LedgerConfig

    store_up = threading.Event()
    restarts = {"read": 0}
    stored: list[dict] = []

    def refresh() -> None:
        store_up.wait()  # an etcd outage: the call hangs until the store is back
        restarts["read"] = 2

    def put(key: str, value: bytes) -> None:
        store_up.wait()
        stored.append(json.loads(value))

    config = AgentConfig(entrypoint=("train.py",), run_id="r", node_id="n", run_dir=tmp_path)
    accounting = NodeAccounting(tmp_path / "ledger.json", LedgerConfig())
    status_file = tmp_path / "status.json"
    publisher = StatusPublisher(config, status_file=status_file, control_socket=tmp_path / "control.sock",
                                tracker=RankTracker(), accounting=accounting,
                                restarts_used=lambda: restarts["read"], refresh_restarts=refresh, store_put=put,
                                emit=lambda *a, **k: None, interval_s=0.05)
    publisher.start()
    try:
        seen = set()

        def five_writes_none_published() -> bool:
            snap = json.loads(status_file.read_text()) if status_file.exists() else None
            if snap is not None:
                seen.add(snap["updated_at"])
                assert snap["restarts_used"] == 0 and snap["store_published_at"] is None, snap
            return len(seen) >= 5

        wait_for(five_writes_none_published, timeout=HANG_GUARD_S, interval=0.01,
                 what="5 status.json writes while the store hangs")
        assert (tmp_path / "ledger.json").exists() and stored == []
    finally:
        store_up.set()
        publisher.phase = "finished: succeeded"
        publisher.stop()
    final = json.loads(status_file.read_text())
    assert final["phase"] == "finished: succeeded"
    assert stored and stored[-1]["phase"] == "finished: succeeded", "the final status reaches the store"


def test_a_worker_killed_while_the_agent_looks_is_a_failure_on_the_next_pass_never_a_success(tmp_path, monkeypatch):
    """A worker's exit lands from its own thread at any moment.  One pass of the watch loop reads the exits,
    then does the in-process bookkeeping (store reads across machines, time on a loaded machine), then asks
    whether every member exited: a worker SIGKILLed in between must not count as exited and not failed (the
    agent would end the generation "all workers exited 0" and exit 0).  Here the bookkeeping kills the real
    worker and waits for its exit to be recorded; that pass sees it running, the next one as a failure."""
    from types import SimpleNamespace

    from resilient.agent import generation, machine
    from resilient.agent.health import HealthConfig
    from resilient.agent.launcher import WorkerGroup, WorkerSpec
    from resilient.agent.tracker import RankTracker
    from resilient.watchdog.sections import SectionTimeouts

    group = WorkerGroup([WorkerSpec(local_rank=0, rank=0, argv=("sleep", "600"), env={},
                                    log_file=tmp_path / "w.log", echo=False)])
    worker = group.workers[0]

    def kill_meanwhile(*_args):
        worker.signal(signal.SIGKILL)
        wait_for(lambda: worker.exit is not None, timeout=HANG_GUARD_S, what="the exit recorded", interval=0.01)

    monkeypatch.setattr(generation, "follow", kill_meanwhile)
    tracker = RankTracker()
    settled: list[int] = []
    ctx = SimpleNamespace(config=SimpleNamespace(signalled_together_s=0.0, health_paths=()), clock=lambda: 0.0,
                          tracker=tracker, inproc=None, slowness=None,
                          asked=SimpleNamespace(interrupted=lambda: False, stop_requested=lambda: None),
                          settle_heartbeats=lambda: settled.append(1))
    peers = SimpleNamespace(verdict=None, quarantined=None, waiting=0, ended=False, stop=None, stop_request=None,
                            detectors=None)
    state = machine.WatchState(machine.Phase.RUNNING, next_health=1e9)
    cfg = machine.Settings(preempt_grace_s=30.0, health_interval_s=10.0, health=HealthConfig(),
                           sections=SectionTimeouts())
    try:
        first = generation._observe(ctx, group, None, tmp_path, peers, state, SectionTimeouts())
        assert not first.failed and not first.all_exited, first
        assert settled == [], "no failure seen: nothing to settle"
        assert machine.transition(state, first, cfg).state.phase is not machine.Phase.ENDED
        monkeypatch.setattr(generation, "follow", lambda *_args: None)
        second = generation._observe(ctx, group, None, tmp_path, peers, state, SectionTimeouts())
        assert second.failed == (machine.Failed(0, -signal.SIGKILL),) and second.all_exited, second
        assert settled == [1], "its last heartbeats are in the tracker before the failure is built"
        assert isinstance(machine.transition(state, second, cfg).commands[0], machine.AnswerFailure)
    finally:
        group.stop(grace_s=0)


def test_a_bug_in_a_status_pass_is_reported_and_status_json_keeps_coming(tmp_path):
    """A part of the snapshot that raises (here the in-process recovery's view, once) used to end the status thread
    with nothing said: status.json froze while the run went on.  Now it is reported, with its traceback, and the
    thread starts again."""
    import json

    from resilient.agent.accounting import NodeAccounting
    from resilient.agent.config import AgentConfig
    from resilient.agent.status import StatusPublisher
    from resilient.agent.tracker import RankTracker
    from resilient.core.supervised import ThreadReports
    from resilient.metrics.ledger import LedgerConfig

    config = AgentConfig(entrypoint=("train.py",), run_id="r", node_id="n", run_dir=tmp_path)
    status_file = tmp_path / "status.json"
    crashes: list[tuple[str, str, str]] = []
    publisher = StatusPublisher(config, status_file=status_file, control_socket=tmp_path / "control.sock",
                                tracker=RankTracker(), accounting=NodeAccounting(tmp_path / "ledger.json",
                                                                                 LedgerConfig()),
                                restarts_used=lambda: 0, refresh_restarts=None, store_put=None,
                                emit=lambda *a, **k: None, interval_s=0.05,
                                threads=ThreadReports(lambda *crash: crashes.append(crash)))
    views = iter([{"rung": "spare"}, ZeroDivisionError("float division by zero")])

    def recovery() -> dict:
        view = next(views, {"rung": "restart"})
        if isinstance(view, Exception):
            raise view
        return view

    publisher.recovery = recovery
    publisher.start()
    try:
        wait_for(lambda: status_file.exists() and json.loads(status_file.read_text())["recovery"] == {"rung": "restart"},
                 timeout=HANG_GUARD_S, interval=0.01, what="status.json written again after the bug")
    finally:
        publisher.stop()
    assert [(name, error) for name, error, _ in crashes] == [("status", "ZeroDivisionError: float division by zero")]
    assert "raise view" in crashes[0][2]
