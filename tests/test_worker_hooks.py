"""The worker's side of the agent contract: environment, heartbeats from a Run, stacks, errors, graceful stop.

A hand-built agent environment (a heartbeat receiver in the test, per-rank
files in tmp) stands in for the agent; workers are real processes running
a tiny ``resilient.Run`` (world size 1, no torchrun), and few of them,
since each one imports torch.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import resilient
from resilient.agent.heartbeat import HeartbeatReceiver
from resilient.core.errors import ConfigError
from resilient.worker.env import WorkerEnv, launched_distributed
from resilient.worker.hooks import StopRequest, WorkerHooks, read_stop_request
from resilient.worker.protocol import Heartbeat

REPO = Path(__file__).resolve().parent.parent

WORKER = '''
import argparse, json, sys, time
import torch
import resilient

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=10)
p.add_argument("--ckpt", default=None)
p.add_argument("--every", type=int, default=4)
p.add_argument("--events", required=True)
p.add_argument("--trace", required=True)
p.add_argument("--park-at", type=int, default=None, help="wait in park_here() at this step for the release file")
p.add_argument("--release", default=None)
p.add_argument("--config-error-at", type=int, default=None)
args = p.parse_args()


def park_here(release):
    while not os.path.exists(release):
        time.sleep(0.01)


def validate(step):
    raise resilient.ConfigError(f"setting xyz is invalid at step {step}")


import os
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = resilient.ElasticLoader([torch.randn(4) for _ in range(32)], batch_size=4, seed=1)
ckpt = resilient.CheckpointConfig(dir=args.ckpt, every_steps=args.every, when_busy="wait") if args.ckpt else None
trace = open(args.trace, "a")
with resilient.Run(model=model, optimizer=opt, data=data, checkpoint=ckpt,
                   events=resilient.EventLog(args.events)) as run:
    trace.write(json.dumps({"start": run.step, "torch_before_run": True}) + "\\n")
    for step in run.steps(args.steps):
        if step == args.park_at:
            with run.section("park"):
                park_here(args.release)
        if step == args.config_error_at:
            with run.section("validate"):
                validate(step)
        loss = model(next(run.data)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        trace.write(json.dumps({"step": step}) + "\\n")
        trace.flush()
print("finished", run.step, flush=True)
'''


def wait_for(condition, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


class Agent:
    """A stand-in agent: a heartbeat receiver plus the per-rank files of the contract."""

    def __init__(self, root: Path, **overrides) -> None:
        self.root = root
        self.sock_dir = Path(f"/tmp/rwh-{os.getpid()}-{time.monotonic_ns()}")
        self.sock_dir.mkdir(mode=0o700)
        self.messages: list[Heartbeat] = []
        self._lock = threading.Lock()
        self.receiver = HeartbeatReceiver(self.sock_dir / "hb.sock", self._on_message)
        self.env = WorkerEnv(**{
            "agent_socket": str(self.sock_dir / "hb.sock"), "run_id": "t", "run_dir": str(root), "node_id": "n1",
            "stack_file": str(root / "rank0.stacks.txt"), "error_file": str(root / "rank0.error.json"),
            "control_file": str(root / "control.json"), **overrides,
        })

    def _on_message(self, hb: Heartbeat, _at: float) -> None:
        with self._lock:
            self.messages.append(hb)

    def seen(self) -> list[Heartbeat]:
        with self._lock:
            return list(self.messages)

    def sections(self) -> list[tuple[str, str, int]]:
        return [(m.kind, m.section, m.step) for m in self.seen()]

    def close(self) -> None:
        self.receiver.close()
        for p in self.sock_dir.iterdir():
            p.unlink()
        self.sock_dir.rmdir()


def send_marker(agent: Agent) -> None:
    """A heartbeat in section ``marker`` from a socket of the test's own, after everything sent so far."""
    from resilient.worker.protocol import encode

    marker = Heartbeat(rank=99, local_rank=0, pid=os.getpid(), section="marker", step=0, seq=1, kind="section",
                       generation=0)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(encode(marker), str(agent.sock_dir / "hb.sock"))


@pytest.fixture
def agent(tmp_path):
    a = Agent(tmp_path)
    yield a
    a.close()


def start_worker(tmp_path: Path, agent: Agent, *args: str, env: dict | None = None) -> subprocess.Popen:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("RESILIENT_", "TORCHELASTIC_"))}
    full_env.update({"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **agent.env.to_environ(), **(env or {})})
    return subprocess.Popen(
        [sys.executable, str(script), "--events", str(tmp_path / "events.jsonl"), "--trace",
         str(tmp_path / "trace.jsonl"), *args],
        env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def read_events(tmp_path: Path, kind: str) -> list[dict]:
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["kind"] == kind]


def traced_steps(tmp_path: Path) -> list[int]:
    return [r["step"] for r in map(json.loads, (tmp_path / "trace.jsonl").read_text().splitlines()) if "step" in r]


# ------------------------------------------------------------- environment
def test_environment_round_trip_and_absence():
    assert WorkerEnv.from_environ({"RANK": "3", "WORLD_SIZE": "4"}) is None  # not under an agent
    env = WorkerEnv(agent_socket="/s", rank=3, world_size=4, local_rank=1, local_world_size=2, group_rank=1,
                    group_world_size=2, master_addr="10.0.0.1", master_port=29500, run_id="r", run_dir="/d",
                    node_id="n", generation=2, attempt=1, stack_file="/x", stack_signal=12, error_file="/e",
                    control_file="/c", stop_signal=10, fault_plan="/p")
    assert WorkerEnv.from_environ(env.to_environ()) == env
    minimal = WorkerEnv.from_environ({"RESILIENT_AGENT_SOCKET": "/s", "TORCHELASTIC_RESTART_COUNT": "2",
                                      "TORCHELASTIC_RUN_ID": "tr", "RESILIENT_STACK_FILE": ""})
    assert minimal == WorkerEnv(agent_socket="/s", attempt=2, run_id="tr")
    assert (minimal.stack_signal, minimal.stop_signal) == (signal.SIGUSR2, signal.SIGUSR1)


@pytest.mark.parametrize(
    "environ, message",
    [
        ({"RANK": "one"}, "RANK='one' is not an integer"),
        ({"RANK": "4", "WORLD_SIZE": "4"}, "RANK=4 is not within WORLD_SIZE=4"),
        ({"LOCAL_RANK": "1"}, "LOCAL_RANK=1 is not within LOCAL_WORLD_SIZE=1"),
        ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000"),
        ({"RESILIENT_GENERATION": "-1"}, "RESILIENT_GENERATION=-1 must be >= 0"),
        ({"RESILIENT_ATTEMPT": "1", "TORCHELASTIC_RESTART_COUNT": "2"}, "RESILIENT_ATTEMPT=1 but TORCHELASTIC"),
        ({"RESILIENT_STACK_SIGNAL": "9"}, r"RESILIENT_STACK_SIGNAL=9 \(SIGKILL\) cannot be caught"),
        ({"RESILIENT_STOP_SIGNAL": "999"}, "RESILIENT_STOP_SIGNAL=999 is not a signal"),
        ({"RESILIENT_STOP_SIGNAL": "12"}, "both 12; they must differ"),
    ],
)
def test_invalid_environment_names_the_variable(environ, message):
    with pytest.raises(ConfigError, match=message):
        WorkerEnv.from_environ({"RESILIENT_AGENT_SOCKET": "/s", **environ})


def test_the_recovery_variables_round_trip_and_torch_says_when_a_group_is_wanted():
    env = WorkerEnv(agent_socket="/s", recovery_store=("10.0.0.2", 29400), worker_id="s0", role="spare",
                    recovery_timeout_s=12.5)
    assert WorkerEnv.from_environ(env.to_environ()) == env
    assert env.to_environ()["RESILIENT_RECOVERY_STORE"] == "10.0.0.2:29400"
    ipv6 = WorkerEnv.from_environ({"RESILIENT_AGENT_SOCKET": "/s", "RESILIENT_RECOVERY_STORE": "[::1]:5",
                                   "RESILIENT_WORKER_ID": "w0"})
    assert ipv6 is not None and (ipv6.recovery_store, ipv6.role, ipv6.recovery_timeout_s) == (("::1", 5), "worker", 60)
    plain = WorkerEnv.from_environ({"RESILIENT_AGENT_SOCKET": "/s"})
    assert plain is not None and (plain.recovery_store, plain.worker_id) == (None, None)  # restart-only recovery
    assert launched_distributed({"WORLD_SIZE": "2"}) and not launched_distributed({"WORLD_SIZE": "1"})
    assert not launched_distributed({})
    with pytest.raises(ConfigError, match="WORLD_SIZE='two' is not an integer"):
        launched_distributed({"WORLD_SIZE": "two"})


@pytest.mark.parametrize(
    "environ, message",
    [
        ({"RESILIENT_RECOVERY_STORE": "localhost"}, "RESILIENT_RECOVERY_STORE='localhost' is not host:port"),
        ({"RESILIENT_RECOVERY_STORE": "h:0"}, "RESILIENT_RECOVERY_STORE='h:0' is not host:port"),
        ({"RESILIENT_RECOVERY_STORE": ":29400"}, "is not host:port"),
        ({"RESILIENT_RECOVERY_STORE": "h:1"}, "RESILIENT_RECOVERY_STORE is set but RESILIENT_WORKER_ID is not"),
        ({"RESILIENT_ROLE": "boss"}, "RESILIENT_ROLE='boss' is not a role: use one of worker, spare"),
        ({"RESILIENT_ROLE": "spare"}, "RESILIENT_ROLE=spare needs RESILIENT_RECOVERY_STORE"),
        ({"RESILIENT_RECOVERY_TIMEOUT": "0"}, "RESILIENT_RECOVERY_TIMEOUT=0.0 must be a number of seconds > 0"),
        ({"RESILIENT_RECOVERY_TIMEOUT": "soon"}, "RESILIENT_RECOVERY_TIMEOUT='soon' is not a number"),
    ],
)
def test_invalid_recovery_environment_names_the_variable(environ, message):
    with pytest.raises(ConfigError, match=message):
        WorkerEnv.from_environ({"RESILIENT_AGENT_SOCKET": "/s", **environ})


def test_a_spare_sends_only_recovery_reports_until_promoted_then_says_hello_as_a_member(agent):
    from dataclasses import replace

    hooks = WorkerHooks(replace(agent.env, recovery_store=("127.0.0.1", 1), worker_id="s0", role="spare"))
    try:
        hooks.hello("/ckpt")
        hooks.enter("restore", 0, None)
        hooks.restored(None, None, 0.1)
        hooks.recovery({"event": "ready", "worker": "s0", "role": "spare"})
        wait_for(lambda: len(agent.seen()) == 1, what="the ready report")
        hooks.rejoin(2, 1)
        hooks.enter("step", 4, None)
        hooks.bye(5, None)
        wait_for(lambda: len(agent.seen()) == 4, what="hello, a section and bye from the promoted spare")
    finally:
        hooks.uninstall()
    got = [(m.kind, m.generation, m.rank, m.checkpoint) for m in agent.seen()]
    assert got == [("recovery", 0, 0, None), ("hello", 2, 1, "/ckpt"), ("section", 2, 1, None), ("bye", 2, 1, None)]
    assert hooks.rank == 1 and not hooks.standby


def test_stop_requests(tmp_path):
    control = tmp_path / "control.json"
    control.write_text(json.dumps({"stop_at_step": 12, "reason": "preempted"}))
    assert read_stop_request(str(control)) == StopRequest(12, "preempted")
    control.write_text(json.dumps({"stop_at_step": "12"}))
    assert read_stop_request(str(control)).stop_at_step == 0  # a broken request still stops, now
    assert "without a readable control file" in read_stop_request(str(tmp_path / "missing.json")).reason


# --------------------------------------------------------- a Run in-process
def tiny(tmp_path: Path, agent_env: WorkerEnv | None, **kw) -> resilient.Run:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    data = resilient.ElasticLoader([torch.randn(4) for _ in range(16)], batch_size=4, seed=1)
    ckpt = resilient.CheckpointConfig(dir=tmp_path / "ckpt", every_steps=2, async_save=False)
    return resilient.Run(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data=data,
                         checkpoint=ckpt, agent=agent_env, **kw)


def train(run: resilient.Run, steps: int) -> None:
    for _ in run.steps(steps):
        loss = run.model(next(run.data)).pow(2).mean()
        loss.backward()
        run.optimizer.step()
        run.optimizer.zero_grad()


def test_a_closing_run_sends_its_heartbeats_before_a_collection_holds_the_gil(tmp_path, agent, monkeypatch):
    """Run.close() collects garbage (the DDP wrapper it made sits in reference cycles), which holds the GIL
    throughout: seconds on a CPU-starved rank, when the heartbeat thread cannot send.  Seen in the cpu-quota drill
    as a hang "in section 'checkpoint'" of a rank that had left it: 'after_steps' was still queued.  Everything
    queued is sent before the collection."""
    import gc

    run = tiny(tmp_path, agent.env, ddp=True)  # no process group: the module stays plain, the Run owns the wrapping
    queued: list[int] = []
    collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: queued.append(len(run._state.hooks.sender._pending)) or collect(*a))
    try:
        train(run, 3)
        time.sleep(0.05)  # a quiet spell: close's first heartbeat goes out at once, the next one is queued
        run.close()
        wait_for(lambda: agent.sections()[-1][0] == "bye", what="bye")
    finally:
        run._state.hooks.uninstall()
    assert queued == [0], "heartbeats were still queued when the collection began"
    assert agent.sections()[-2:] == [("section", "after_steps", 3), ("bye", "after_steps", 3)], agent.sections()


def test_run_reports_its_sections(tmp_path, agent):
    run = tiny(tmp_path, agent.env)
    try:
        train(run, 3)
        with run.section("eval"):
            pass
        run.close()
        wait_for(lambda: agent.sections()[-1][0] == "bye", what="bye")
    finally:
        run._state.hooks.uninstall()
    S = "section"
    assert agent.sections() == [
        ("hello", "init", 0), (S, "restore", 0), (S, "init", 0),  # restore re-enters init
        ("restored", "init", 0),  # what it restored: nothing yet
        (S, "step", 0), (S, "data", 0), (S, "step", 0),  # next(run.data) inside the step
        ("notice", "step", 0),  # once, at the first step's end: what this script's integration allows
        (S, "step", 1), (S, "data", 1), (S, "step", 1),
        (S, "checkpoint", 2),  # the cadence checkpoint after 2 updates, at the boundary (between steps:
        (S, "step", 2), (S, "data", 2), (S, "step", 2),  # leaving it reports nothing until step 2 starts)
        (S, "checkpoint", 3),  # save_on_finish
        (S, "after_steps", 3),  # the loop is done: the script's own work after training
        (S, "eval", 3),  # a user section after the loop; leaving it re-enters after_steps
        (S, "after_steps", 3),
        (S, "checkpoint", 3),  # close() waits for the last commit
        (S, "after_steps", 3),
        ("bye", "after_steps", 3),
    ]
    msgs = agent.seen()
    assert msgs[0].checkpoint == str(tmp_path / "ckpt") and msgs[0].pid == os.getpid()
    [report] = [m for m in msgs if m.kind == "restored"]
    assert report.restored is not None and (report.restored["checkpoint"], report.restored["step"]) == (None, None)
    assert report.restored["seconds"] > 0
    assert msgs[-1].committed_step == 3  # save_on_finish committed the final state
    assert [m.seq for m in msgs] == list(range(1, len(msgs) + 1))  # nothing lost
    assert run.heartbeats is not None and (run.heartbeats.sent, run.heartbeats.dropped) == (len(msgs), 0)
    # nothing follows the bye: the sending thread is gone, and a section after close() sends nothing
    assert not any(t.name == "resilient-heartbeat-sender" and t.is_alive() for t in threading.enumerate())
    with run.section("late"):
        pass
    assert (run.heartbeats.sent, run.heartbeats.dropped) == (len(msgs), 0)
    send_marker(agent)  # the receiver takes datagrams in order: one the run had sent would come before it
    wait_for(lambda: agent.seen()[-1].section == "marker", what="the marker")
    assert agent.seen()[:-1] == msgs


def test_a_restoring_run_reports_the_checkpoint_its_step_and_its_time(tmp_path, agent):
    first = tiny(tmp_path, None)  # no agent: commits step 2 (cadence) and step 3 (save_on_finish)
    train(first, 3)
    first.close()
    run = tiny(tmp_path, agent.env)
    try:
        wait_for(lambda: any(m.kind == "restored" for m in agent.seen()), what="the restore report")
    finally:
        run._state.hooks.uninstall()
    [report] = [m for m in agent.seen() if m.kind == "restored"]
    assert report.restored is not None and run.restored_from == "step_0000000003"
    assert (report.restored["checkpoint"], report.restored["step"]) == (run.restored_from, run.step) == (
        "step_0000000003", 3)
    assert report.restored["seconds"] > 0


def test_explicit_no_agent_beats_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("RESILIENT_AGENT_SOCKET", "/nonexistent/socket")
    monkeypatch.setenv("RANK", "not-a-number")  # would fail if the environment were read
    run = tiny(tmp_path, None)
    assert run._state.hooks is None and run.data.report_section is None
    train(run, 2)
    with run.section("eval"):
        pass
    run.close()


def test_graceful_stop_in_process(tmp_path, agent):
    """The stop signal only sets a flag; the stop happens at the boundary of the requested step."""
    run = tiny(tmp_path, agent.env)
    steps_done = []
    try:
        with pytest.raises(SystemExit) as info:
            for step in run.steps(10):
                if step == 1:
                    Path(agent.env.control_file).write_text(json.dumps({"stop_at_step": 3, "reason": "drill"}))
                    os.kill(os.getpid(), agent.env.stop_signal)
                steps_done.append(step)
        wait_for(lambda: agent.sections()[-1][0] == "bye", what="bye")
    finally:
        run._state.hooks.uninstall()
    assert info.value.code == 0 and steps_done == [0, 1, 2] and run.step == 3
    stop = run.events.of_kind("graceful_stop")[0].fields
    assert (stop["stop_at_step"], stop["reason"], stop["committed"]) == (3, "drill", "step_0000000003")
    assert agent.seen()[-1].committed_step == 3


# -------------------------------------------------------- worker processes
def test_worker_under_agent_heartbeats_dumps_stacks_and_stops_gracefully(tmp_path, agent):
    release = tmp_path / "release"
    proc = start_worker(tmp_path, agent, "--steps", "50", "--ckpt", str(tmp_path / "ckpt"), "--every", "4",
                        "--park-at", "5", "--release", str(release))
    try:
        wait_for(lambda: ("section", "park", 5) in agent.sections() or proc.poll() is not None, what="park")
        assert proc.poll() is None, proc.communicate()
        os.kill(proc.pid, agent.env.stack_signal)
        stacks = Path(agent.env.stack_file)
        wait_for(lambda: stacks.exists() and "park_here" in stacks.read_text(), what="a stack dump")
        Path(agent.env.control_file).write_text(json.dumps({"stop_at_step": 7, "reason": "preempted"}))
        os.kill(proc.pid, agent.env.stop_signal)
        release.touch()
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "finished" not in out  # SystemExit(0) left the loop and the script
    assert traced_steps(tmp_path) == list(range(7))
    assert "Current thread" in stacks.read_text() and "in park_here" in stacks.read_text()
    stop = read_events(tmp_path, "graceful_stop")
    assert len(stop) == 1 and stop[0]["step"] == 7 and stop[0]["reason"] == "preempted" and stop[0]["committed"]
    assert [e["step"] for e in read_events(tmp_path, "checkpoint_committed")] == [4, 7]
    wait_for(lambda: agent.sections()[-1][0] == "bye", timeout=5, what="bye")
    kinds = agent.sections()
    assert kinds[0] == ("hello", "init", 0) and kinds[-1] == ("bye", "checkpoint", 7)  # the stop step's commit, then bye
    assert [s for k, s, step in kinds if k == "section" and s == "step"].count("step") >= 7
    assert {("section", "data", 6), ("section", "checkpoint", 4), ("section", "checkpoint", 7)} <= set(kinds)
    msgs = agent.seen()
    assert msgs[0].checkpoint == str(tmp_path / "ckpt") and msgs[0].pid == proc.pid
    assert msgs[-1].committed_step == 7 and not Path(agent.env.error_file).exists()


def test_config_error_writes_the_error_file_and_exits_78(tmp_path, agent):
    before, before_mono = time.time(), time.monotonic()
    proc = start_worker(tmp_path, agent, "--steps", "5", "--config-error-at", "2")
    _out, err = proc.communicate(timeout=60)
    after, after_mono = time.time(), time.monotonic()
    assert proc.returncode == 78, err
    assert "setting xyz is invalid" in err  # the traceback is still printed for the rank's log
    record = json.loads(Path(agent.env.error_file).read_text())
    assert record["exc_type"] == "resilient.core.errors.ConfigError" and record["exit_code"] == 78
    assert record["message"] == "setting xyz is invalid at step 2" and "in validate" in record["traceback"]
    assert record["section"] == "validate" and record["step"] == 2  # where it was raised, not where it surfaced
    assert record["rank"] == 0 and record["pid"] == proc.pid
    assert before <= record["time"] <= after and before_mono <= record["monotonic"] <= after_mono, record
    assert traced_steps(tmp_path) == [0, 1]
    # Where the run was in its data: step 2 begins at stream position 8 (two batches of 4 read), and its
    # samples are the loader's at 8..11, for an incident to name and a replay to check.
    loader = resilient.ElasticLoader(list(range(32)), batch_size=4, seed=1)
    loader.bind(0, 1)
    position = record["position"]
    assert (position["step"], position["step_start"], position["global_batch"], position["seed"]) == (2, 8, 4, 0)
    assert position["indices"] == position["rank_indices"] == loader.indices_at(8, 4) and not position["cut"]


def test_plan_driven_exit_fault_exits_with_its_code_at_its_step(tmp_path, agent):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"version": 1, "seed": 3, "faults": [
        {"kind": "exit", "rank": 0, "node": "n1", "step": 3, "attempt": 0, "section": "data", "exit_code": 42},
        {"kind": "kill", "rank": 0, "step": 1, "attempt": 1},  # another attempt's: must not fire
    ]}))
    proc = start_worker(tmp_path, agent, "--steps", "6", env={"RESILIENT_FAULT_PLAN": str(plan)})
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 42, err
    assert traced_steps(tmp_path) == [0, 1, 2]
    assert "injecting fault into rank 0" in err and "exit with code 42 entering section 'data' at step 3" in err
    fired = read_events(tmp_path, "fault_injected")  # recorded before it fired
    assert len(fired) == 1 and fired[0]["fault"]["exit_code"] == 42 and fired[0]["seed"] == 3
    wait_for(lambda: ("section", "data", 3) in agent.sections(), timeout=5, what="the data heartbeat")
    assert agent.sections()[-1] == ("section", "data", 3)  # the agent saw where it died
