"""Host faults of the drills: parsed and checked, injected on real processes through real cgroups, undone.

Each kind is an object that injects it and says how to undo it; what lasts is undone newest first, every undo
tried even when one before it failed.

The cgroup tests move a real sleeping process into a freezer and a CPU cgroup of this machine (cgroup v1 here,
as root) and read the kernel's view back: its state, its cgroup, its quota.  The skip test points the injector
at a cgroup tree that has neither, as on a machine without them, and the drill is reported as skipped with why.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from resilient.chaos import host_faults
from resilient.chaos.drill import DrillError, load_drill
from resilient.chaos.host import HostInjector, UndoStack
from resilient.chaos.host_faults import HOST_FAULT_KINDS, HostFault, HostFaultError, parse_host_faults, unavailable
from resilient.chaos.host_kinds import KINDS
from resilient.chaos.runner import run_drill
from resilient.core.events import EventKind, EventLog, ForwardingLog
from resilient.watchdog.attribution import Suspect, attribute_hang
from resilient.watchdog.procfs import frozen_by_cgroup
from resilient.watchdog.stacks import capture, process_state


@pytest.mark.parametrize(("table", "message"), [
    ({"kind": "melt", "step": 3}, "'melt' is not a host fault"),
    ({"kind": "freeze", "rank": 0}, "give one trigger"),
    ({"kind": "freeze", "step": 3, "at_s": 1.0, "duration_s": 1.0}, "give one trigger"),
    ({"kind": "freeze", "step": 3}, "freeze: give duration_s"),
    ({"kind": "corrupt_checkpoint", "at_s": 2.0}, "give step = N"),
    ({"kind": "cpu_quota", "step": 3, "quota": 2.0}, "between 0.01 and 1"),
    ({"kind": "cpu_quota", "step": 3, "speed": 2.0}, "speed: unknown key"),
    ({"kind": "cpu_quota", "step": "3"}, "step = '3': must be an integer"),
    ({"kind": "store_outage", "step": 3}, "store_outage: give duration_s"),
])
def test_a_bad_host_fault_is_refused_naming_the_table_and_the_fix(table, message):
    with pytest.raises(HostFaultError, match="host_faults") as err:
        parse_host_faults([table])
    assert message in str(err.value), str(err.value)


def test_a_drill_checks_its_host_faults_against_its_workload(tmp_path):
    path = tmp_path / "d.toml"
    path.write_text("[drill]\nname = 'd'\n[workload]\nscript = 'train.py'\n"
                    "[[host_faults]]\nkind = 'freeze'\nstep = 5\nduration_s = 2\n")
    with pytest.raises(DrillError, match="with a script of yours, trigger by time: at_s"):
        load_drill(path)
    path.write_text("[drill]\nname = 'd'\n[[host_faults]]\nkind = 'cpu_quota'\nrank = 4\nstep = 5\n")
    with pytest.raises(DrillError, match="rank 4 is outside the world of 2 ranks"):
        load_drill(path)
    path.write_text("[drill]\nname = 'd'\n[[host_faults]]\nkind = 'cpu_quota'\nrank = 1\nstep = 5\n")
    drill = load_drill(path)  # host faults alone are a schedule
    assert drill.host_faults == (HostFault(kind="cpu_quota", rank=1, step=5),) and drill.faults == ()


def sleeper() -> subprocess.Popen:
    """A process in its loop (it said so): frozen there, not in its interpreter's start-up."""
    code = "import time\nprint('ready', flush=True)\nwhile True: time.sleep(0.02)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc


def run_out(tmp_path: Path, pid: int, done_step: int) -> Path:
    """What the injector reads of a faulted run: the agent's pids.json and the workload's trace."""
    out = tmp_path / "faulted"
    (out / "run" / "nodes" / "n0").mkdir(parents=True)
    (out / "run" / "nodes" / "n0" / "pids.json").write_text(json.dumps({"workers": [{"rank": 0, "pid": pid}]}))
    (out / "trace.jsonl").write_text("".join(json.dumps({"rank": 0, "step": s}) + "\n" for s in range(done_step)))
    return out


def until(predicate) -> None:
    """Poll until ``predicate()`` holds; no bound of its own: the test's timeout is the hang guard."""
    while not predicate():
        time.sleep(0.02)


def test_a_frozen_rank_is_frozen_for_its_duration_named_frozen_and_its_cgroup_removed(tmp_path):
    assert unavailable("freeze") is None, unavailable("freeze")  # this machine has the v1 freezer, as root
    proc = sleeper()
    try:
        out = run_out(tmp_path, proc.pid, 3)
        inj = HostInjector((HostFault(kind="freeze", rank=0, step=5, duration_s=0.6),), out, out / "ckpt", "t")
        inj.poll()
        assert inj.events() == [] and process_state(proc.pid) in ("sleeping", "running")  # step 5 not reached
        with open(out / "trace.jsonl", "a") as f:
            f.write(json.dumps({"rank": 0, "step": 5}) + "\n")
        inj.poll()
        [fired] = inj.events()
        assert fired["kind"] == "fault_injected" and fired["source"] == "host" and fired["pid"] == proc.pid
        until(lambda: frozen_by_cgroup(proc.pid))
        assert process_state(proc.pid) == "frozen"
        # Its stacks are still read (py-spy without pausing it), and the hang is pinned on it, not on a peer.
        got = capture(proc.pid, tmp_path / "stacks.txt", 10, host_py_spy())
        assert got.state == "frozen" and "MainThread" in got.text and "<module> (<string>:3)" in got.text, got
        blamed = attribute_hang([Suspect(0, "step", 5, 2.0, "frozen", got.text),
                                 Suspect(1, "step", 6, 2.5, "sleeping", "Current thread:\n  File \"x.py\"")])
        assert blamed.rank == 0 and "frozen (its cgroup's freezer)" in blamed.reason
        time.sleep(0.7)
        inj.poll()
        assert [e["kind"] for e in inj.events()] == ["fault_injected", "fault_lifted"]
        assert process_state(proc.pid) in ("sleeping", "running") and inj.leftovers() == []
    finally:
        inj.close()
        proc.kill()
        proc.wait()


def host_py_spy() -> str:
    from resilient.watchdog.stacks import find_py_spy

    found = find_py_spy()
    assert found is not None, "py-spy is a test dependency (resilient-train[hang])"
    return found


def test_a_cpu_quota_throttles_the_rank_in_the_kernel_and_close_lifts_it(tmp_path):
    assert unavailable("cpu_quota") is None, unavailable("cpu_quota")
    proc = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 30: pass"])
    try:
        out = run_out(tmp_path, proc.pid, 1)
        inj = HostInjector((HostFault(kind="cpu_quota", rank=0, at_s=0.0, quota=0.1),), out, out / "ckpt", "t")
        inj.poll()
        [fired] = inj.events()
        group = Path(fired["cgroup"])
        assert fired["quota_us"] == 10_000 and (group / "cpu.cfs_quota_us").read_text().strip() == "10000"
        assert str(proc.pid) in (group / "cgroup.procs").read_text().split()
        time.sleep(1.0)
        stat = dict(line.split() for line in (group / "cpu.stat").read_text().splitlines())
        assert int(stat["nr_throttled"]) > 0  # the kernel held the spinning process back
        assert inj.close() == [] and inj.leftovers() == [] and not group.exists()
        assert [e["kind"] for e in inj.events()] == ["fault_injected", "fault_lifted"]
    finally:
        proc.kill()
        proc.wait()


def test_a_checkpoint_fault_damages_the_newest_commit_at_or_after_its_step(tmp_path):
    ckpt = tmp_path / "ckpt"
    for step, committed in ((10, True), (20, True), (30, False)):  # step 30 is still being written
        d = ckpt / f"step_{step:010d}"
        d.mkdir(parents=True)
        (d / "rank00000.shard").write_bytes(bytes(range(256)) * 4)
        (d / "small").write_bytes(b"x")
        if committed:
            (d / "manifest.json").write_text("{}")
    out = tmp_path / "out"
    out.mkdir()
    inj = HostInjector((HostFault(kind="corrupt_checkpoint", step=15),
                        HostFault(kind="truncate_checkpoint", step=10)), out, ckpt, "t")
    inj.poll()
    corrupt, truncate = inj.events()
    assert corrupt["checkpoint"] == truncate["checkpoint"] == "step_0000000020"
    data = (ckpt / "step_0000000020" / "rank00000.shard").read_bytes()
    assert corrupt["file"] == "rank00000.shard" and truncate["bytes"] == 1024 and len(data) == 512
    # The flip landed at the middle before the cut: the first half is intact except the 16 flipped bytes.
    assert data[:512] == (bytes(range(256)) * 4)[:512]
    assert (ckpt / "step_0000000010" / "rank00000.shard").read_bytes() == bytes(range(256)) * 4


def test_a_drill_whose_fault_this_machine_cannot_produce_is_skipped_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(host_faults, "CGROUP_ROOT", tmp_path / "no-cgroups")  # a machine with no cgroup hierarchies
    why = unavailable("freeze")
    assert why is not None and "no cgroup freezer hierarchy" in why
    path = tmp_path / "d.toml"
    path.write_text("[drill]\nname = 'frz'\n[[host_faults]]\nkind = 'freeze'\nstep = 5\nduration_s = 2\n"
                    "[expect]\nequal = 'bitwise'\n")
    result = run_drill(load_drill(path), tmp_path / "out")
    assert result.record["skipped"] == f"freeze: {why}" and result.verdicts == [] and not result.passed
    assert not (tmp_path / "out" / "frz" / "reference").exists()  # nothing ran, not even the reference
    assert "Skipped: freeze: no cgroup freezer hierarchy" in result.report.read_text()


def test_a_runs_checkpoint_trouble_also_reaches_the_agents_event_log(tmp_path):
    own, agent = EventLog(), EventLog(tmp_path / "events.jsonl")
    log = ForwardingLog(own, agent, lambda: {"rank": 3, "node": "n1", "source": "worker"})
    log.emit(EventKind.CHECKPOINT_COMMITTED, name="step_10")
    log.emit(EventKind.CHECKPOINT_QUARANTINED, name="step_20", reason="digest mismatch")
    assert [e.kind for e in log.all()] == ["checkpoint_committed", "checkpoint_quarantined"]
    [forwarded] = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert forwarded["kind"] == "checkpoint_quarantined" and forwarded["rank"] == 3 and forwarded["node"] == "n1"
    assert forwarded["reason"] == "digest mismatch" and log.path is None


def test_a_full_disk_is_a_tmpfs_filled_to_the_last_byte_then_freed_and_unmounted(tmp_path):
    assert unavailable("fill_disk") is None, unavailable("fill_disk")
    out = tmp_path / "faulted"
    out.mkdir()
    ckpt = out / "ckpt"
    inj = HostInjector((HostFault(kind="fill_disk", at_s=0.0, duration_s=0.3, size_mb=2),), out, ckpt, "t")
    inj.prepare()
    try:
        assert inj.mounts() == [str(ckpt.resolve())]
        inj.poll()
        [fired] = inj.events()
        assert fired["free_bytes"] == 0 and fired["filler_bytes"] > 1_900_000
        with pytest.raises(OSError, match="No space left on device"):
            (ckpt / "step_0000000010.tmp").write_bytes(b"x" * 10_000)  # what a save meets
        time.sleep(0.4)
        inj.poll()
        assert [e["kind"] for e in inj.events()] == ["fault_injected", "fault_lifted"]
        (ckpt / "after").write_bytes(b"x" * 10_000)  # space is back
    finally:
        inj.close()
        left = inj.unmount()
    assert left == [] and not (ckpt / "after").exists()  # the tmpfs and what was on it are gone
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "ckpt").mkdir()
    (tmp_path / "other" / "ckpt" / "step_0000000010").mkdir()
    busy = HostInjector((HostFault(kind="fill_disk", step=1),), tmp_path / "other", tmp_path / "other" / "ckpt", "t")
    with pytest.raises(RuntimeError, match="is not empty: a tmpfs mounted over it would hide a checkpoint"):
        busy.prepare()


def test_a_lost_node_is_its_agent_killed_and_named(tmp_path):
    """kill_node finds the node that runs the rank in the agents' pids.json and SIGKILLs that node's agent."""
    agent, worker = sleeper(), sleeper()
    try:
        out = run_out(tmp_path, worker.pid, done_step=6)
        (out / "run" / "nodes" / "n1").mkdir()
        (out / "run" / "nodes" / "n1" / "pids.json").write_text(json.dumps(
            {"agent": {"pid": agent.pid}, "workers": [{"rank": 1, "pid": worker.pid}]}))
        (out / "run" / "nodes" / "n0" / "pids.json").write_text(json.dumps(
            {"agent": {"pid": worker.pid}, "workers": [{"rank": 0, "pid": worker.pid}]}))
        with open(out / "trace.jsonl", "a") as f:
            f.write(json.dumps({"rank": 1, "step": 5}) + "\n")
        inj = HostInjector((HostFault(kind="kill_node", rank=1, step=5),), out, out / "ckpt", "t")
        inj.poll()
        assert agent.wait(timeout=5) == -9 and worker.poll() is None  # the agent, not the rank's own process
        [fired] = inj.events()
        assert fired["node"] == "n1" and fired["agent_pid"] == agent.pid and inj.killed_nodes() == {"n1"}
    finally:
        for proc in (agent, worker):
            proc.kill()
            proc.wait()


def test_a_store_outage_stops_the_real_etcd_and_starts_it_again_with_its_data(tmp_path):
    import urllib.request

    from resilient.chaos.cluster import Etcd

    etcd = Etcd(tmp_path / "etcd")
    endpoint = etcd.url.replace("etcd://", "http://")

    def put_get(key: str, value: str | None = None) -> str:
        import base64

        b64 = base64.b64encode(key.encode()).decode()
        if value is not None:
            body = json.dumps({"key": b64, "value": base64.b64encode(value.encode()).decode()}).encode()
            urllib.request.urlopen(urllib.request.Request(f"{endpoint}/v3/kv/put", body), timeout=5).read()
        got = json.load(urllib.request.urlopen(urllib.request.Request(
            f"{endpoint}/v3/kv/range", json.dumps({"key": b64}).encode()), timeout=5))
        return base64.b64decode(got["kvs"][0]["value"]).decode()

    try:
        assert put_get("k", "before") == "before"
        out = tmp_path / "faulted"
        out.mkdir()
        inj = HostInjector((HostFault(kind="store_outage", at_s=0.0, duration_s=1.0),), out, out / "ckpt", "t",
                           store=etcd)
        inj.poll()
        assert etcd.pids() == []
        with pytest.raises(OSError):
            urllib.request.urlopen(f"{endpoint}/health", timeout=2)
        until(lambda: (inj.poll(), [e["kind"] for e in inj.events()])[1] == ["fault_injected", "fault_lifted"])
        assert len(etcd.pids()) == 1 and put_get("k") == "before"  # the same ports, the same data
        inj.close()
    finally:
        etcd.close()
    assert etcd.pids() == [] and not etcd.data.exists()


def test_every_host_fault_kind_has_one_object_that_injects_it() -> None:
    assert sorted(KINDS) == sorted(HOST_FAULT_KINDS)
    for kind in HOST_FAULT_KINDS:
        trigger = {"step": 3} if kind.endswith("_checkpoint") else {"at_s": 1.0}
        fault = HostFault(kind=kind, duration_s=2.0, **trigger)
        assert fault.describe().endswith(("at 1 s", "after rank 0 completes step 3")), fault.describe()


def test_what_lasts_is_lifted_when_due_and_the_rest_unwound_newest_first_every_undo_tried() -> None:
    lifted: list[tuple[str, dict]] = []
    stack = UndoStack(lambda fault, detail: lifted.append((fault.kind, detail)))
    order: list[str] = []

    def undo(name: str, fails: bool = False):
        def run() -> dict:
            order.append(name)
            if fails:
                raise OSError(f"{name} is stuck")
            return {"name": name}
        return run

    stack.push(HostFault(kind="freeze", at_s=0.0, duration_s=5.0), undo("thaw"), until=None)
    stack.push(HostFault(kind="s3_errors", at_s=0.0, duration_s=1.0), undo("clear"), until=10.0)
    stack.push(HostFault(kind="partition", at_s=0.0, duration_s=1.0), undo("mend", fails=True), until=None)
    stack.push(HostFault(kind="store_outage", at_s=0.0, duration_s=1.0), undo("start"), until=None)
    stack.lift_due(9.9)
    assert order == [] and len(stack) == 4
    stack.lift_due(10.0)
    assert order == ["clear"] and len(stack) == 3
    failed = stack.unwind()
    assert order == ["clear", "start", "mend", "thaw"], "newest first, and the one after a failed undo still runs"
    assert [k for k, _ in lifted] == ["s3_errors", "store_outage", "freeze"]
    assert len(failed) == 1 and "cut rank 0's node off the network" in failed[0] and "mend is stuck" in failed[0]
    assert len(stack) == 0 and stack.unwind() == []


def test_a_frozen_and_throttled_rank_is_thawed_and_its_cgroups_removed_newest_first_on_close(tmp_path: Path) -> None:
    for kind in ("freeze", "cpu_quota"):
        assert unavailable(kind) is None, f"this machine cannot produce {kind}: {unavailable(kind)}"
    victim = subprocess.Popen(["sleep", "600"])
    try:
        node = tmp_path / "run" / "nodes" / "n0"
        node.mkdir(parents=True)
        (node / "pids.json").write_text(json.dumps({"agent": {"pid": 1}, "workers": [{"rank": 0, "pid": victim.pid}]}))
        faults = (HostFault(kind="cpu_quota", at_s=0.0, quota=0.5), HostFault(kind="freeze", at_s=0.0, duration_s=60))
        inj = HostInjector(faults, tmp_path, tmp_path / "ckpt", "unit")
        try:
            inj.poll()
            made = inj.leftovers()
            assert len(made) == 2 and all(Path(p).is_dir() for p in made), made
            freezer = next(Path(p) for p in made if "freeze" in p)
            assert (freezer / "freezer.state").read_text().strip() in ("FREEZING", "FROZEN")
            assert str(victim.pid) in (freezer / "cgroup.procs").read_text().split()
        finally:
            stuck = inj.close()
        assert stuck == [] and inj.leftovers() == []
        assert process_state(victim.pid) in ("sleeping", "running")
        lifts = [e["fault"]["kind"] for e in inj.events() if e["kind"] == "fault_lifted"]
        assert lifts == ["freeze", "cpu_quota"], "undone newest first"
        injected = [e for e in inj.events() if e["kind"] == "fault_injected"]
        assert [e["pid"] for e in injected] == [victim.pid, victim.pid]
    finally:
        victim.kill()
        victim.wait(timeout=30)
    assert victim.returncode == -9, "a thawed process dies of SIGKILL"
