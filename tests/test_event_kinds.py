"""Event kinds live in one place (``resilient.core.events.EventKind``) and their strings do not change.

``events.jsonl`` is read by operators, tools and tests, so a kind's string is
an interface: the source check keeps every call site on the enum, and a real
agent run pins the strings a few well-known kinds serialize to.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

from resilient.core.events import EventKind, EventLog, OutcomeKind

from .agent_helpers import events, explain, run_agent
from .helpers import REPO

PACKAGE = REPO / "resilient"
EMITTERS = {"emit", "_emit"}


def literal_kinds(source: str, filename: str) -> list[str]:
    """``file:line`` of every ``emit(...)`` / ``_emit(...)`` call whose kind is a string literal or f-string."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        if name not in EMITTERS:
            continue
        kinds = node.args[:1] + [k.value for k in node.keywords if k.arg == "kind"]
        if any(isinstance(k, ast.JoinedStr) or (isinstance(k, ast.Constant) and isinstance(k.value, str))
               for k in kinds):
            found.append(f"{filename}:{node.lineno}")
    return found


def package_sources() -> dict[str, str]:
    return {str(p.relative_to(REPO)): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


def emit_calls(sources: dict[str, str]) -> int:
    count = 0
    for filename, source in sources.items():
        for node in ast.walk(ast.parse(source, filename)):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
                count += name in EMITTERS
    return count


def test_the_checker_flags_string_literals_and_f_strings():
    source = ('log.emit("restart")\nemit(f"store_outage_{e}", detail=1)\nself._emit(kind="incident")\n'
              "log.emit(EventKind.RESTART)\nlog.emit(kind)\n")
    assert literal_kinds(source, "x.py") == ["x.py:1", "x.py:2", "x.py:3"]


def test_no_emit_call_in_the_package_passes_a_bare_string():
    sources = package_sources()
    # The walk must see the real call sites, or an empty walk would pass.
    assert emit_calls(sources) >= 50
    offenders = [where for filename, source in sources.items() for where in literal_kinds(source, filename)]
    assert offenders == [], f"use a resilient.core.events.EventKind member (add one if needed) at: {offenders}"


def test_every_event_kind_is_emitted_somewhere_and_named_after_its_string():
    used: set[str] = set()
    for filename, source in package_sources().items():
        if filename == "resilient/core/events.py":
            continue
        for node in ast.walk(ast.parse(source, filename)):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "EventKind":
                used.add(node.attr)
    assert used == {k.name for k in EventKind}, "EventKind lists every kind the code emits, and only those"
    assert [k for k in EventKind if k.value != k.name.lower()] == []


def test_kinds_read_as_their_strings_in_text_and_json(tmp_path):
    kind = EventKind.CHECKPOINT_COMMITTED
    assert (str(kind), f"{kind}", format(kind)) == ("checkpoint_committed",) * 3
    log = EventLog(tmp_path / "events.jsonl")
    event = log.emit(kind, step=3)
    assert type(event.kind) is str and event.kind == "checkpoint_committed"
    assert log.of_kind("checkpoint_committed") == [event] == log.of_kind(kind)
    [line] = (tmp_path / "events.jsonl").read_text().splitlines()
    assert json.loads(line)["kind"] == "checkpoint_committed"


def test_outcome_kinds_and_which_ones_restart_the_workers():
    # The ledger (resilient.metrics.ledger) and the logs read these strings.
    assert {k.value for k in OutcomeKind} == {"succeeded", "failed", "membership", "preempted", "interrupted",
                                              "verdict", "unhealthy", "quarantined"}
    assert {k for k in OutcomeKind if k.restarts_workers} == {OutcomeKind.FAILED, OutcomeKind.MEMBERSHIP}


def test_a_real_run_writes_the_well_known_kind_strings(tmp_path: Path):
    """A crash and a restart from a checkpoint: the strings operators grep for are the ones written."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"version": 1, "seed": 0, "faults": [
        {"kind": "kill", "rank": 0, "step": 7, "attempt": 0, "section": "step"}]}))
    run_dir = tmp_path / "run"
    worker_events = tmp_path / "worker_events.jsonl"
    # The restart must read the durable tier (its `checkpoint_restored` is one of the strings checked): with the
    # memory tier on, it restores from memory whenever the tier's interval, chosen from the measured cost of a
    # save, left it a step at or past the commit of step 5, and from the commit otherwise.
    proc = run_agent(run_dir, "--node-id", "n0", "--fault-plan", str(plan), "--no-memory-tier",
                     script_args=("--steps", "10", "--every", "5", "--dir", str(tmp_path / "ckpt"), "--sync",
                                  "--trace", str(tmp_path / "trace"), "--events", str(worker_events)))
    assert proc.returncode == 0, explain(proc)

    agent_kinds = [e["kind"] for e in events(run_dir)]
    for kind in ("agent_started", "launch_joined", "rendezvous_joined", "workers_started", "worker_failed",
                 "incident", "restart", "agent_finished"):
        assert kind in agent_kinds, (kind, agent_kinds)
    [incident] = events(run_dir, "incident")
    assert incident["step"] == 7
    [restart] = events(run_dir, "restart")
    assert restart["restarts_used"] == 1

    lines = Path(f"{worker_events}.rank0").read_text().splitlines()  # worker_train.py adds the rank
    worker_kinds = [json.loads(line)["kind"] for line in lines if line.strip()]
    for kind in ("run_started", "checkpoint_committed", "fault_injected", "checkpoint_restored", "run_closed"):
        assert kind in worker_kinds, (kind, worker_kinds)
