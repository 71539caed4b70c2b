"""Each shipped drill (``chaos/*.toml``) run on this machine as its own test: real agents, gloo ranks, warm spares.

A few representative drills run by default; the rest are marked ``drills`` (``bash scripts/test.sh --all``, as CI
runs it).  References are shared within a session as ``resilient drill run`` shares them: a drill whose workload and
world match one already run reuses its reference's final state.

The verdicts a test holds to are the drill's behaviour (exit code, teardown, rung, equality, re-done steps, events,
damaged checkpoints refused).  The timing verdicts (detected within, resumed within, alerted within, goodput) must
have been measured; their margins are the drill suite benchmark's (``benchmarks/drill_suite.py``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from resilient.chaos.drill import Drill, load_drill
from resilient.chaos.runner import leftovers, reference_key, run_drill

from .invariants import check_event_logs

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = {path.stem: path for path in sorted((ROOT / "chaos").glob("*.toml"))}
# Cheap and unlike each other: a spare taking a killed rank in process, a restart from the newest commit, and a whole
# node lost across agents meeting through etcd.
REPRESENTATIVE = ("kill-rank", "crash-restart", "kill-node")
# Final states of the references run in this session, by workload and world (``run_drill``'s ``references``).
REFERENCES: dict[tuple[Any, ...], dict[str, Any]] = {}
# Agents, spares and the host faults' cgroups, netns and proxies: a drill runs alone, never beside another test.
pytestmark = pytest.mark.serial


def _timing(verdict: dict[str, Any]) -> bool:
    """A verdict on how long something took (its margin is a benchmark's), not on what happened."""
    name, wanted = verdict["expectation"], str(verdict["wanted"])
    return name.endswith(" within") or name in ("goodput", "goodput against Young/Daly") \
        or (name.startswith("alert ") and wanted.startswith("fires within"))


def _measured(verdict: dict[str, Any]) -> bool:
    """A timing verdict that has a measurement: the thing happened, however long it took."""
    return verdict["got"] not in ("never", "never notified", "unknown") and not verdict["got"].startswith("no ")


@pytest.fixture(scope="session")
def drill_results(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("drills")


def _jsonl(path: Path, kind: str | None = None) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows if kind is None else [r for r in rows if r.get("kind") == kind]


def _hang_alert(drill_dir: Path, record: dict[str, Any]) -> None:
    """The page an on-call gets went through the shipped rules and routes, after the hang was detected."""
    assert dict(record["measured"]["alerts"])["HangDetected"] > record["measured"]["detect_s"], record["measured"]


def _gameday(drill_dir: Path, record: dict[str, Any]) -> None:
    """The quick game day: its two kills struck, each a restart, and the ledger made a Young/Daly prediction."""
    day = record["gameday"]
    assert day["faults"] == 2 and day["incidents"] == 2, day
    assert day["relative_error"] is not None and day["young_interval_steps"] > 0, day


def _s3_flaky(drill_dir: Path, record: dict[str, Any]) -> None:
    """The flaky store's faults struck requests (counted by the proxy as each window closed)."""
    lifted = _jsonl(drill_dir / "faulted" / "host_faults.jsonl", "fault_lifted")
    assert [e["fault"]["kind"] for e in lifted] == ["s3_errors", "s3_drop"], lifted
    assert lifted[0]["requests"]["errors"] > 0 and lifted[1]["requests"]["drop"] > 0, lifted


def _s3_outage(drill_dir: Path, record: dict[str, Any]) -> None:
    """The store that answered only 503 failed saves, reported as such."""
    failed = _jsonl(drill_dir / "faulted" / "run" / "events.jsonl", "checkpoint_failed")
    assert failed and all("the store is throttling or unavailable (SlowDown" in e["error"] for e in failed), failed


def _packet_loss(drill_dir: Path, record: dict[str, Any]) -> None:
    """The lossy link dropped packets (counted by iptables)."""
    lifted = _jsonl(drill_dir / "faulted" / "host_faults.jsonl", "fault_lifted")
    assert lifted[0]["dropped_packets"] > 0, lifted


def _nan_loss(drill_dir: Path, record: dict[str, Any]) -> None:
    """The NaN was refused on both ranks and retried once."""
    nan = _jsonl(drill_dir / "faulted" / "run" / "events.jsonl", "nonfinite_gradients")
    assert sorted(e["rank"] for e in nan) == [0, 1] and all(e["retried"] and e["step"] == 40 for e in nan), nan


def _zombie_launch(drill_dir: Path, record: dict[str, Any]) -> None:
    """The resubmitted job holds the fence: every save of the first (the zombie) after that was refused, and every
    checkpoint committed at the end is the new launch's."""
    zombie = drill_dir / "faulted"
    [joined] = _jsonl(zombie / "resubmitted" / "run" / "events.jsonl", "launch_joined")
    fenced = _jsonl(zombie / "run" / "events.jsonl", "checkpoint_fenced")
    assert fenced and all(e["holder"]["launch"] == joined["launch_id"] for e in fenced), fenced[:2]
    launches = {json.loads(m.read_text())["launch"] for m in (zombie / "ckpt").glob("step_*/manifest.json")}
    assert launches == {joined["launch_id"]}, launches


def _kill_node(drill_dir: Path, record: dict[str, Any]) -> None:
    """The spare node's worker took rank 1: in the order they were written, rank 1's steps are n1's worker's from
    the first up to a step past the fault's trigger, then the spare's to the last, each at most once.

    The handover step is read, not assumed: the fault fires from outside once rank 1's trace shows the trigger step
    (the injector looks ten times a second), and a step or two may complete before it takes hold.  Between the two
    workers at most one step has no line of rank 1's: the one a killed worker completed (rank 0 traced it, and the
    spare took the state after it) but died before writing down."""
    trace = _jsonl(drill_dir / "faulted" / "trace.jsonl")
    [trigger] = [f["step"] for f in record["faults"]]
    steps = sorted(t["step"] for t in trace if t["rank"] == 0)
    rank1 = sorted((t for t in trace if t["rank"] == 1), key=lambda t: t["time"])
    workers = [t["worker"] for t in rank1]
    handover = workers.index("spare0.s0")
    assert set(workers[:handover]) == {"n1.w0"} and set(workers[handover:]) == {"spare0.s0"}, workers
    old, new = [t["step"] for t in rank1[:handover]], [t["step"] for t in rank1[handover:]]
    assert old == steps[:len(old)] and new == steps[-len(new):], (old, new)
    assert trigger < new[0] and old[-1] < new[0] <= old[-1] + 2, (old, new)  # nothing re-done, one line at most lost


def _partition_node(drill_dir: Path, record: dict[str, Any]) -> None:
    """The survivor's connections to the silent node were shut, and the spare node's worker took rank 1."""
    severed = _jsonl(drill_dir / "faulted" / "run" / "events.jsonl", "peer_connections_severed")
    assert severed and all(e["node"] == "n0" and e["sockets"] > 0 and e["problem"] is None for e in severed), severed
    _kill_node(drill_dir, record)


def _partition_node_restart(drill_dir: Path, record: dict[str, Any]) -> None:
    """The run restarted without waiting for the silent node: the spare node took its place in the restart's round
    and its worker took rank 1 from the newest commit; the cut-off node, back on the network, found the run over
    and ended as it did."""
    events = _jsonl(drill_dir / "faulted" / "run" / "events.jsonl")
    severed = [e for e in events if e["kind"] == "peer_connections_severed"]
    assert severed and all(e["node"] == "n0" and e["sockets"] > 0 for e in severed), severed
    [took] = [e for e in events if e["kind"] == "spare_node_takes_place"]
    assert took["node"] == "spare0" and took["lost_node"] == "n1", took
    trace = _jsonl(drill_dir / "faulted" / "trace.jsonl")
    [trigger] = [f["step"] for f in record["faults"]]
    last = max(t["step"] for t in trace)
    rank1 = sorted((t for t in trace if t["rank"] == 1), key=lambda t: t["time"])
    workers = [t["worker"] for t in rank1]
    handover = next(i for i, w in enumerate(workers) if w.startswith("spare0."))
    assert set(workers[:handover]) == {"n1.w0"} and {w[:7] for w in workers[handover:]} == {"spare0."}, workers
    old, new = [t["step"] for t in rank1[:handover]], [t["step"] for t in rank1[handover:]]
    assert old == list(range(len(old))) and new == list(range(new[0], last + 1)), (old, new)
    assert new[0] <= trigger < old[-1] + 1 and old[-1] - new[0] < 10, (old, new)  # from the commit at or before it
    finished = {e["node"]: e for e in events if e["kind"] == "agent_finished"}
    assert finished["n1"]["exit_code"] == 0 and finished["n1"]["reason"] == \
        "the run ended while this node was held out", finished["n1"]


def _shrink_node(drill_dir: Path, record: dict[str, Any]) -> None:
    """The shrink left two ranks."""
    trace = _jsonl(drill_dir / "faulted" / "trace.jsonl")
    assert {t["world"] for t in trace if t["step"] > 35} == {2} and {t["world"] for t in trace if t["step"] < 25} == {3}


CHECKS: dict[str, Callable[[Path, dict[str, Any]], None]] = {
    "hang-alert": _hang_alert, "gameday": _gameday, "s3-flaky": _s3_flaky, "s3-outage": _s3_outage,
    "packet-loss": _packet_loss, "nan-loss": _nan_loss, "zombie-launch": _zombie_launch, "kill-node": _kill_node,
    "shrink-node": _shrink_node, "partition-node": _partition_node, "partition-node-restart": _partition_node_restart,
}


def _params() -> list[Any]:
    return [pytest.param(name, id=name, marks=() if name in REPRESENTATIVE else (pytest.mark.drills,))
            for name in SHIPPED]


def test_every_check_and_representative_names_a_shipped_drill():
    assert set(CHECKS) <= set(SHIPPED) and set(REPRESENTATIVE) <= set(SHIPPED), (set(CHECKS) | set(REPRESENTATIVE))
    assert len(SHIPPED) >= 24


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("name", _params())
def test_the_shipped_drill_passes_on_this_machine_and_leaves_nothing_behind(name, drill_results, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    drill: Drill = load_drill(SHIPPED[name]).quick()  # the game day a third as long; every other drill as it is
    key = reference_key(drill)
    shared = None if key is None else REFERENCES.get(key)
    result = run_drill(drill, drill_results, references=REFERENCES)
    record, drill_dir = result.record, drill_results / name

    assert record["skipped"] is None, record["skipped"]  # this machine has the cgroups (v1, as root), netns, etcd
    behaviour = [v for v in record["verdicts"] if not _timing(v)]
    assert [v for v in behaviour if not v["ok"]] == [], record["verdicts"]
    assert [v for v in record["verdicts"] if _timing(v) and not _measured(v)] == [], record["verdicts"]
    measured = record["measured"]
    assert measured["fault_at"] is not None, measured
    # Every faulted run trained: its goodput is that of the nodes that did (an idle spare node is left out).
    assert measured["goodput"] is not None and measured["goodput"] > 0, measured
    if drill.expect.detected_within_s is not None:
        assert measured["detect_s"] is not None, measured
    for latent in measured["latent"]:  # a damaged checkpoint was refused, not restored
        assert latent["caught_by"] == "checkpoint_quarantined" and latent["caught_s"] is not None, measured
    if any(f.get("source") == "host" for f in record["faults"]):
        assert [v["got"] for v in record["verdicts"]
                if v["expectation"] == "teardown of cgroups, mounts and namespaces"] == ["0 left"]
    # A reference is run once per workload and world, and shared.
    if drill.needs_reference and shared is not None:
        assert record["reference_from"] == shared["drill"] and not (drill_dir / "reference").exists(), record
    else:
        assert record.get("reference_from") is None, record
    for run in ("reference", "faulted"):
        if (drill_dir / run / "run").exists():
            assert leftovers((drill_dir / run / "run").resolve()) == [], run
    report = result.report.read_text()
    assert "| expectation | wanted | got | verdict | margin |" in report
    assert (drill_dir / f"{name}.png").read_bytes()[:4] == b"\x89PNG" and record["timeline"]
    if name in CHECKS:
        CHECKS[name](drill_dir, record)
    assert check_event_logs(drill_dir) == []  # the drills' runs keep the recovery invariants too
