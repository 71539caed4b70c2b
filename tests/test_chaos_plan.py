"""Chaos plans: the format, matching, seeded generation, and faults carried out in real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from resilient.faults.inject import FaultInjector, InjectedFault
from resilient.faults.plan import Fault, FaultPlan, FaultPlanError
from resilient.core.events import EventLog

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def test_plan_round_trips_through_json(tmp_path):
    plan = FaultPlan(seed=7, faults=(
        Fault(kind="exit", rank=1, step=12, exit_code=3),
        Fault(kind="hang", rank=None, node="n2", step=30, attempt=None, section="data", duration_s=2.5),
    ))
    path = tmp_path / "plan.json"
    plan.dump(path)
    assert FaultPlan.load(path) == plan
    raw = json.loads(path.read_text())
    assert raw["version"] == 1 and raw["faults"][0] == {
        "kind": "exit", "step": 12, "section": "step", "rank": 1, "node": None, "attempt": 0, "exit_code": 3}
    # the minimal spelling: defaults for section, rank, node and attempt
    assert FaultPlan.loads('{"version": 1, "faults": [{"kind": "kill", "step": 4}]}').faults == (
        Fault(kind="kill", step=4, section="step", rank=None, node=None, attempt=0),)


@pytest.mark.parametrize(
    "plan, message",
    [
        ({"faults": []}, r"version: missing; add \"version\": 1"),
        ({"version": 2}, "version: 2 is not supported"),
        ({"version": 1, "faults": {}}, "faults: must be a list"),
        ({"version": 1, "fautls": []}, "fautls: unknown field"),
        ({"version": 1, "seed": 1.5}, "seed: 1.5 must be an integer"),
        ({"version": 1, "faults": [{"kind": "kil", "step": 1}]}, r"faults\[0\]\.kind: 'kil' is not a fault kind; use one of kill, exit"),
        ({"version": 1, "faults": [{"kind": "kill"}]}, r"faults\[0\]\.step: missing"),
        ({"version": 1, "faults": [{"kind": "kill", "step": -1}]}, r"faults\[0\]\.step: -1 must be an integer >= 0"),
        ({"version": 1, "faults": [{"kind": "kill", "step": 1, "stpe": 2}]}, r"faults\[0\]\.stpe: unknown field"),
        ({"version": 1, "faults": [{"kind": "kill", "step": 1}, {"kind": "kill", "step": 1, "rank": "0"}]},
         r"faults\[1\]\.rank: '0' must be a rank >= 0, or null"),
        ({"version": 1, "faults": [{"kind": "kill", "step": 1, "exit_code": 3}]},
         r"exit_code: only an 'exit' fault has one, this one is 'kill'; remove it"),
        ({"version": 1, "faults": [{"kind": "exit", "step": 1, "exit_code": 300}]}, "use 0..255"),
        ({"version": 1, "faults": [{"kind": "hang", "step": 1, "duration_s": -1}]}, "duration_s: -1 must be seconds"),
        ({"version": 1, "faults": [{"kind": "raise", "step": 1, "duration_s": 1}]}, "only 'hang' and 'slow' faults"),
        ({"version": 1, "faults": [{"kind": "slow", "step": 1}]}, "a 'slow' fault needs the seconds"),
        ({"version": 1, "faults": [{"kind": "hang", "step": 1, "steps": 3}]}, "only a 'slow' fault has one"),
        ({"version": 1, "faults": [{"kind": "slow", "step": 1, "duration_s": 0.1, "steps": 0}]}, "steps: 0"),
        ({"version": 1, "faults": [{"kind": "kill", "step": 1, "section": ""}]}, "section: '' must be a section"),
        ({"version": 1, "faults": [{"kind": "kill", "step": 1, "attempt": True}]}, "attempt: True must be"),
        ({"version": 1, "faults": ["kill"]}, r"faults\[0\]\.must be an object"),
    ],
)
def test_validation_names_the_field_and_the_fix(tmp_path, plan, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(plan))
    with pytest.raises(FaultPlanError, match=message) as info:
        FaultPlan.load(path)
    assert str(path) in str(info.value)


def test_unreadable_plans_say_so(tmp_path):
    with pytest.raises(FaultPlanError, match="cannot read fault plan"):
        FaultPlan.load(tmp_path / "missing.json")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(FaultPlanError, match="not valid JSON"):
        FaultPlan.load(tmp_path / "broken.json")


def test_matching():
    exact = Fault(kind="kill", rank=1, node="n1", step=5, attempt=0, section="step")
    assert exact.matches("n1", 1, 5, 0, "step")
    for args in (("n2", 1, 5, 0, "step"), ("n1", 0, 5, 0, "step"), ("n1", 1, 6, 0, "step"),
                 ("n1", 1, 5, 1, "step"), ("n1", 1, 5, 0, "data"), (None, 1, 5, 0, "step")):
        assert not exact.matches(*args), args
    anywhere = Fault(kind="kill", rank=None, node=None, step=5, attempt=None, section="data")
    assert all(anywhere.matches(node, rank, 5, attempt, "data")
               for node in (None, "a") for rank in (0, 7) for attempt in (0, 3))
    plan = FaultPlan(faults=(exact, anywhere))
    assert plan.matching("n1", 1, 5, 0, "step") == (exact,)
    assert plan.matching("n9", 4, 5, 2, "data") == (anywhere,)
    assert plan.for_worker("n1", 1, 0) == (exact, anywhere) and plan.for_worker("n1", 1, 1) == (anywhere,)


def test_random_plans_are_deterministic_and_valid():
    kwargs = {"world_size": 4, "steps": 50, "count": 6, "kinds": ("kill", "exit", "hang"),
              "sections": ("step", "data"), "nodes": ("n1", "n2"), "exit_code": 9, "hang_s": 3.0}
    plan = FaultPlan.random(123, **kwargs)
    assert plan == FaultPlan.random(123, **kwargs)
    assert plan != FaultPlan.random(124, **kwargs)
    assert FaultPlan.loads(plan.dumps()) == plan and plan.seed == 123
    assert [f.attempt for f in plan.faults] == list(range(6))  # one fault per restart
    for f in plan.faults:
        assert 0 <= f.rank < 4 and 1 <= f.step < 50 and f.section in ("step", "data") and f.node in ("n1", "n2")
        assert f.exit_code == (9 if f.kind == "exit" else None)
        assert f.duration_s == (3.0 if f.kind == "hang" else None)
    with pytest.raises(FaultPlanError, match="first_step"):
        FaultPlan.random(1, world_size=1, steps=1)


def test_injector_fires_each_fault_once_and_records_it_first(capsys):
    events = EventLog()
    plan = FaultPlan(seed=5, faults=(
        Fault(kind="raise", rank=0, step=3, section="data"),
        Fault(kind="hang", rank=0, step=2, duration_s=0.05),
        Fault(kind="kill", rank=1, step=1),  # another rank's
    ))
    injector = FaultInjector(plan, None, 0, 0, events=events)
    injector.at("step", 1)
    injector.at("data", 2)
    started = time.monotonic()
    injector.at("step", 2)
    assert time.monotonic() - started >= 0.05
    injector.at("step", 2)  # entered again at the same step: already fired
    with pytest.raises(InjectedFault, match=r"rank 0 .*raise entering section 'data' at step 3"):
        injector.at("data", 3)
    assert not injector.armed
    recorded = events.of_kind("fault_injected")
    assert [e.fields["fault"]["kind"] for e in recorded] == ["hang", "raise"] and recorded[0].fields["seed"] == 5
    assert "resilient: injecting fault" in capsys.readouterr().err
    assert not FaultInjector(plan, None, 0, 1, events=events).armed  # attempt 1: nothing planned


def test_a_slow_fault_delays_its_section_once_per_step_for_its_steps():
    events = EventLog()
    plan = FaultPlan(faults=(Fault(kind="slow", rank=0, step=2, section="data", duration_s=0.03, steps=2),))
    slept: list[float] = []
    injector = FaultInjector(plan, None, 0, 0, events=events, sleep=slept.append)

    def entry(section: str, step: int) -> list[float]:
        """What entering ``section`` at ``step`` slept."""
        before = len(slept)
        injector.at(section, step)
        return slept[before:]

    assert entry("data", 1) == []                            # before its step
    assert entry("data", 2) == [0.03] and entry("data", 2) == []  # once per step, however often it is entered
    assert entry("step", 3) == []                            # another section
    assert entry("data", 3) == [0.03] and entry("data", 3) == []
    assert entry("data", 4) == [] and not injector.armed     # 2 steps: over at step 4
    assert slept == [0.03, 0.03]
    assert [e.fields["fault"]["kind"] for e in events.of_kind("fault_injected")] == ["slow"]


# -------------------------------------------------- faults in real (torch-free) processes
INJECT_SCRIPT = """
import faulthandler, signal, sys, time
from resilient.faults.inject import FaultInjector
from resilient.faults.plan import FaultPlan
faulthandler.register(signal.SIGUSR2, file=open(sys.argv[2], "a"), all_threads=True)
open(sys.argv[2] + ".ready", "w").close()
injector = FaultInjector(FaultPlan.load(sys.argv[1]), "n1", 0, 0)
for step in range(5):
    print("step", step, flush=True)
    injector.at("step", step)
print("torch" in sys.modules, "done", flush=True)
"""


def start_injected(tmp_path: Path, fault: dict) -> tuple[subprocess.Popen, Path]:
    plan, stacks = tmp_path / "plan.json", tmp_path / "stacks.txt"
    plan.write_text(json.dumps({"version": 1, "seed": 0, "faults": [fault]}))
    proc = subprocess.Popen([sys.executable, "-c", INJECT_SCRIPT, str(plan), str(stacks)], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, stacks


def wait_for(condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.mark.parametrize("kind, expect", [("kill", -signal.SIGKILL), ("raise", 1), ("exit", 42)])
def test_crashing_faults_in_a_process(tmp_path, kind, expect):
    fault = {"kind": kind, "step": 2, "node": "n1", **({"exit_code": 42} if kind == "exit" else {})}
    proc, _ = start_injected(tmp_path, fault)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == expect, err
    assert out.split("\n")[:3] == ["step 0", "step 1", "step 2"] and "done" not in out
    assert f"injecting fault into rank 0 (pid {proc.pid}): {kind}" in err
    if kind == "raise":
        assert "InjectedFault" in err


def test_hanging_faults_show_in_the_stack_and_sigstop_stops(tmp_path):
    for kind, function in (("deadlock", "_deadlock_partner"), ("hang", "_hang")):
        proc, stacks = start_injected(tmp_path, {"kind": kind, "step": 1})
        try:
            wait_for(lambda p=proc, s=stacks, f=function: _hung(p, s, f))
            if kind == "deadlock":  # both sides of the deadlock are in the dump
                assert "in _deadlock\n" in stacks.read_text()
        finally:
            proc.kill()
            proc.communicate(timeout=10)
        stacks.unlink()
        Path(f"{stacks}.ready").unlink()

    proc, _ = start_injected(tmp_path, {"kind": "sigstop", "step": 3})
    try:
        wait_for(lambda: _state(proc.pid) == "T")
        os.kill(proc.pid, signal.SIGCONT)  # continued, it carries on to the end
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0 and out.strip().endswith("False done")  # and it never imported torch


def _hung(proc: subprocess.Popen, stacks: Path, function: str) -> bool:
    """Ask for a dump; True once one shows ``function``."""
    assert proc.poll() is None, proc.communicate()
    if not Path(f"{stacks}.ready").exists():
        return False
    os.kill(proc.pid, signal.SIGUSR2)
    time.sleep(0.1)
    return stacks.exists() and function in stacks.read_text()


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
