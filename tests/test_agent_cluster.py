"""In-process recovery across machines: several agents meeting through a real etcd.

Each "node" is an agent of its own with its own worker, on one machine; the
script is the one a user writes (``tests/elastic_worker.py``).  The
reference is an uninterrupted run of the same script on one agent with as
many ranks: the same world, the same data split, the same gloo sums.

- a spare node (``--role spare``) takes the place of a lost node's rank
  from the launch's pool, in process, and the run stays bitwise equal to
  the reference with no step done twice;
- with no spare and ``--nnodes 2:3`` a lost node (its agent killed) is
  dropped: the run shrinks to two ranks keeping the global batch (every
  sample of the epoch once, each step's global sample set the
  reference's), then grows back when the node returns as a spare.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

from .agent_helpers import events, events_so_far, incidents, start_agent, wait_for
from .test_agent_inproc import (
    DIE_STEP,
    SHRINK_TOLERANCE,
    STEPS,
    WORKER,
    assert_bitwise_equal,
    assert_close,
    elastic_run,
    global_sets,
    trace,
)


def _node(url: str, run_id: str, node: str, nnodes: str, *extra: str) -> tuple[str, ...]:
    # A world of 2 to 3 nodes forms its first round as soon as 2 joined and the last call ran out: these tests
    # need all three in it, and under the suite's load an agent's start can trail the others' by more than a
    # second (seen: n0 joined 0.1 s after a round of n1 and n2 formed, and the test waited for a rank n2 never
    # had).  A round of every node closes at once whatever the last call, so the long one costs nothing here.
    last_call = "15" if ":" in nnodes else "1"
    return ("--nnodes", nnodes, "--nproc-per-node", "1", "--store", url, "--run-id", run_id, "--node-id", node,
            "--local-addr", "127.0.0.1", "--rdzv-last-call", last_call, "--stop-grace", "3", "--max-restarts", "2",
            "--recovery-timeout", "30", *extra)


def _script(out: Path, steps: int, *extra: str) -> tuple[str, ...]:
    return ("--steps", str(steps), "--out", str(out), "--ckpt", str(out / "ckpt"), *extra)


def _finish(agents: dict[str, object], timeout: float) -> dict[str, int]:
    import time

    deadline, codes = time.monotonic() + timeout, {}
    try:
        for node, agent in agents.items():
            codes[node] = agent.wait(timeout=max(1.0, deadline - time.monotonic()))  # type: ignore[attr-defined]
    finally:
        for agent in agents.values():
            if agent.poll() is None:  # type: ignore[attr-defined]
                agent.kill()  # type: ignore[attr-defined]
    return codes


def _lose_node(agents: dict[str, Any], node: str, out: Path, *, step: int) -> None:
    """Once ``node``'s rank completed ``step``, SIGKILL its agent: the node is lost (its worker dies with it)."""
    wait_for(lambda: (out / "trace.jsonl").exists() and any(
        line["worker"] == f"{node}.w0" and line["step"] >= step for line in trace(out)),
        timeout=180, what=f"node {node}'s rank to complete step {step}")
    agents[node].send_signal(signal.SIGKILL)
    agents[node].wait(timeout=30)


def _logs(tmp: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(tmp.glob("*.log")))


def test_a_spare_node_takes_a_lost_ranks_place_from_the_pool_bitwise(tmp_path: Path, etcd_server,
                                                                     etcd_run_id: str) -> None:
    ref, proc = elastic_run(tmp_path, "ref", "--nproc-per-node", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "run"
    out.mkdir()
    script = _script(out, STEPS, "--die-worker", "n1.w0", "--die-step", str(DIE_STEP), "--die-how", "kill",
                     "--spares-ready", "1")
    agents = {n: start_agent(out / "run", *_node(etcd_server.url, etcd_run_id, n, "2", *role), script=WORKER,
                             script_args=script, log=tmp_path / f"{n}.log")
              for n, role in (("n0", ()), ("n1", ()), ("spare0", ("--role", "spare")))}
    codes = _finish(agents, 240)
    assert codes == {"n0": 0, "n1": 0, "spare0": 0}, _logs(tmp_path)
    run = out / "run"
    assert not events(run, "restart"), "recovered by a restart, not in process"
    decided = events(run, "recovery_decided")
    assert [d["action"] for d in decided] == ["promote_spare"], decided
    assert decided[0]["promotions"] == [{"rank": 1, "spare": "spare0.s0", "node": "spare0"}], decided
    done = {e["node"]: e for e in events(run, "recovered_in_process")}
    assert set(done) == {"n0", "spare0"}, done  # n1 has no member left: it only follows
    assert all(d["rung"] == "promote_spare" and d["resumed_after_step"] == DIE_STEP for d in done.values()), done
    after = {line["worker"] for line in trace(out) if line["step"] > DIE_STEP and line["rank"] == 1}
    assert after == {"spare0.s0"}, f"rank 1 after the failure was {after}, not the spare node's worker"
    [incident] = [i for i in incidents(run) if i.get("decision")]
    assert incident["decision"]["action"] == "promote_spare", incident
    assert_bitwise_equal(out, ref)
    # n1 lost its rank: it starts a replacement for the pool (the run may need it later).
    assert [e["node"] for e in events(run, "spare_started")] == ["spare0", "n1"], events(run, "spare_started")


def _assert_trained_as_reference(out: Path, ref: Path, lines: list[dict[str, Any]], steps: int) -> None:
    """Each step's global sample set the reference's, each of the 84 samples once, the final parameters the
    reference's up to a shrunk world's summation order, and every step done."""
    assert global_sets(lines) == global_sets(trace(ref)), "a step's global sample set differs from the reference"
    assert sorted(i for ids in global_sets(lines).values() for i in ids) == list(range(84)), "a sample twice or never"
    final, want = json.loads((out / "final.json").read_text()), json.loads((ref / "final.json").read_text())
    assert_close(final["params"], want["params"], **SHRINK_TOLERANCE)
    assert final["step"] == steps


def _shrink_then_return(tmp: Path, url: str, run_id: str, steps: int, *extra: str) -> tuple[Path, dict[str, int]]:
    """Three nodes of one rank, ``--nnodes 2:3``, training ``steps`` steps (the worker's ``extra`` flags): n2's
    agent SIGKILLed once its rank completed step 2 (the others shrink to two in process), then n2 started again
    as ``--role spare``; the output directory and the agents' exit codes."""
    out = tmp / "run"
    out.mkdir()
    run = out / "run"
    script = _script(out, steps, *extra)
    # A step timeout of 2 s: the survivors wait in their step for the shrink, and must not be taken for hung
    # while they do.
    flags = {n: _node(url, run_id, n, "2:3", "--grow-settle", "0.5", "--section-timeout", "step=2")
             for n in ("n0", "n1", "n2")}
    agents = {n: start_agent(run, *flags[n], script=WORKER, script_args=script, log=tmp / f"{n}.log") for n in flags}
    try:
        _lose_node(agents, "n2", out, step=2)
        wait_for(lambda: events(run, "recovered_in_process"), timeout=60, what="the shrink to complete")
        agents["n2"] = start_agent(run, *flags["n2"], "--role", "spare", script=WORKER, script_args=script,
                                   log=tmp / "n2-back.log")
    except BaseException:
        _finish(agents, 0)
        raise
    return out, _finish(agents, 240)


def test_three_nodes_shrink_when_one_is_lost_and_grow_back_when_it_returns(tmp_path: Path, etcd_server,
                                                                           etcd_run_id: str) -> None:
    """``--nnodes 2:3``: node n2's agent is SIGKILLed (its worker dies with it); the two others shrink to two
    ranks in process; n2 comes back as ``--role spare`` and the run grows back to three at a step boundary.
    Every rank holds at step 9 until the grow is decided, so the returning node's warm-up cannot outlast the run."""
    steps, samples = 14, ("--samples", "84", "--plain")
    ref, proc = elastic_run(tmp_path, "ref", "--nproc-per-node", "3", extra=samples, steps=steps)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out, codes = _shrink_then_return(tmp_path, etcd_server.url, etcd_run_id, steps, *samples, "--hold-at", "9",
                                     "--step-sleep", "0.3")
    run = out / "run"
    assert codes == {"n0": 0, "n1": 0, "n2": 0}, _logs(tmp_path)
    assert not events(run, "restart"), _logs(tmp_path)
    decided = events(run, "recovery_decided")
    assert [d["action"] for d in decided] == ["shrink", "grow"], decided
    assert decided[0]["dropped_ranks"] == [2] and decided[0]["world_size"] == 2, decided[0]
    lines = trace(out)
    worlds = {line["step"]: line["world"] for line in lines}
    lost = min(s for s, w in worlds.items() if w == 2)
    at = min(s for s, w in worlds.items() if s > lost and w == 3)
    assert at > 9 and [worlds[s] for s in range(steps)] == [3] * lost + [2] * (at - lost) + [3] * (steps - at), worlds
    assert {line["worker"] for line in lines if line["step"] >= at and line["rank"] == 2} == {"n2.s0"}
    assert global_sets(lines) == global_sets(trace(ref)), "a step's global sample set differs from the reference"
    assert sorted(i for ids in global_sets(lines).values() for i in ids) == list(range(84)), "a sample twice or never"
    final, want = json.loads((out / "final.json").read_text()), json.loads((ref / "final.json").read_text())
    assert_close(final["params"], want["params"], **SHRINK_TOLERANCE)
    assert final["step"] == steps and final["world"] == 3
    [shrunk] = [i for i in incidents(run) if (i.get("decision") or {}).get("action") == "shrink"]
    assert "n2" in shrunk["summary"] and shrunk["recovered"]["world_size"] == 2, shrunk


def test_a_rank_lost_as_a_grow_is_decided_across_machines_is_folded_in_without_a_restart(
        tmp_path: Path, etcd_server, etcd_run_id: str) -> None:
    """A failure racing a grow across machines: ``--nnodes 2:3``, n2's agent SIGKILLed (shrink to two), n2 back as
    ``--role spare``; every rank holds at step 9 until a grow is decided, and n1's rank is SIGKILLed as that hold
    ends, while the agents carry out the grow (its generation published, its boundary ahead).  Its claim and
    decision are the grow's: the loss is reported against the grow's generation, whose members still forming it
    leave, and the next decision answers it in process: no restart, every sample once, each step's global
    sample set the reference's."""
    steps, samples = 14, ("--samples", "84", "--plain")
    ref, proc = elastic_run(tmp_path, "ref", "--nproc-per-node", "3", extra=samples, steps=steps)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out, codes = _shrink_then_return(tmp_path, etcd_server.url, etcd_run_id, steps, *samples, "--hold-at", "9",
                                     "--step-sleep", "0.3", "--die-worker", "n1.w0", "--die-step", "9",
                                     "--die-how", "after-hold")
    run = out / "run"
    assert codes == {"n0": 0, "n1": 0, "n2": 0}, _logs(tmp_path)
    assert not events(run, "restart"), _logs(tmp_path)
    decided = events(run, "recovery_decided")
    actions = [d["action"] for d in decided]
    assert actions[:3] == ["shrink", "grow", "shrink"] and actions[3:] in ([], ["grow"]), decided
    assert decided[2]["dropped_ranks"] == [1], decided[2]
    joiner = decided[1]["joiners"][0]["spare"]
    done = events(run, "recovered_in_process")
    assert {d["generation"] for d in done} >= {2, 4} and 3 not in {d["generation"] for d in done}, done
    lines = trace(out)
    assert {line["worker"] for line in lines if line["step"] == 9} == {"n0.w0", joiner}, "step 9 not retried by both"
    _assert_trained_as_reference(out, ref, lines, steps)


def test_a_node_holding_only_a_grow_s_joiner_ends_with_the_run_that_ended_before_the_boundary(
        tmp_path: Path, etcd_server, etcd_run_id: str) -> None:
    """``--nnodes 2:3``: n2 lost (shrink to two), back as ``--role spare``; every rank holds at step 9 until a
    grow onto n2's spare is decided, and the script leaves its loop after step 10, before the grow's boundary.
    n0 and n1 finish; n2 holds only the joiner, which waits for members that are gone.  n2 ends as the run did
    (succeeded), without judging the finished nodes lost and restarting."""
    out, codes = _shrink_then_return(tmp_path, etcd_server.url, etcd_run_id, 14, "--samples", "84", "--plain",
                                     "--hold-at", "9", "--stop-after", "10", "--step-sleep", "0.3")
    run = out / "run"
    assert codes == {"n0": 0, "n1": 0, "n2": 0}, _logs(tmp_path)
    assert [d["action"] for d in events(run, "recovery_decided")] == ["shrink", "grow"], _logs(tmp_path)
    assert not events(run, "restart"), _logs(tmp_path)
    finished = {e["node"]: e for e in events(run, "agent_finished")}
    assert {n: e["verdict"] for n, e in finished.items()} == {"n0": "succeeded", "n1": "succeeded",
                                                              "n2": "succeeded"}, finished
    assert "before the boundary at step" in finished["n2"]["reason"], finished["n2"]
    assert max(line["step"] for line in trace(out)) == 10


SECOND_FAULT_STEPS = 14


def _second_fault_run(tmp_path: Path, url: str, run_id: str, fault: dict[str, object]) -> tuple[Path, Path, dict]:
    """The uninterrupted 3-rank reference, then three nodes of one rank and a spare node started on ``url``: n2's
    rank killed at DIE_STEP (after the spare is ready) and ``fault`` planned on every node."""
    samples = ("--samples", "84", "--plain")
    ref, proc = elastic_run(tmp_path, "ref", "--nproc-per-node", "3", extra=samples, steps=SECOND_FAULT_STEPS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"version": 1, "seed": 0, "faults": [fault]}))
    out = tmp_path / "run"
    out.mkdir()
    script = _script(out, SECOND_FAULT_STEPS, *samples, "--die-worker", "n2.w0", "--die-step", str(DIE_STEP),
                     "--die-how", "kill", "--spares-ready", "1")
    agents = {n: start_agent(out / "run", *_node(url, run_id, n, "2:3", "--fault-plan", str(plan), *role),
                             script=WORKER, script_args=script, log=tmp_path / f"{n}.log")
              for n, role in (("n0", ()), ("n1", ()), ("n2", ()), ("spare0", ("--role", "spare")))}
    return ref, out, agents


def test_a_member_lost_while_the_group_re_forms_across_machines_is_folded_in_without_a_restart(
        tmp_path: Path, etcd_server, etcd_run_id: str) -> None:
    """A second fault during a re-formation across machines: n2's rank is killed at DIE_STEP and the spare node's
    worker takes its place; while that generation forms, a planned fault kills n1's rank as it enters the
    re-formation.  Every agent sees the loss in the store and abandons the generation: its members still
    forming it (n0's, and the spare node's, which holds no state) leave it and wait, and the next decision
    answers the loss in process (the spare node's refilled spare, or a shrink): no restart, every sample of
    the epoch once, each step's global sample set the reference's."""
    ref, out, agents = _second_fault_run(tmp_path, etcd_server.url, etcd_run_id,
                                         {"kind": "kill", "rank": 1, "step": DIE_STEP, "attempt": 0, "section": "restore"})
    run = out / "run"
    codes = _finish(agents, 240)
    assert codes == {"n0": 0, "n1": 0, "n2": 0, "spare0": 0}, _logs(tmp_path)
    assert not events(run, "restart"), _logs(tmp_path)
    decided = events(run, "recovery_decided")
    assert len(decided) == 2 and decided[0]["action"] == "promote_spare", decided
    assert decided[1]["action"] in ("promote_spare", "shrink"), decided[1]
    assert not events(run, "recovery_abandoned")
    done = events(run, "recovered_in_process")
    assert {d["rung"] for d in done} == {decided[1]["action"]} and all(d["resumed_after_step"] == DIE_STEP
                                                                        for d in done), done
    lines = trace(out)
    assert "spare0.s0" in {line["worker"] for line in lines if line["step"] > DIE_STEP}, "the promoted spare left"
    _assert_trained_as_reference(out, ref, lines, SECOND_FAULT_STEPS)


def test_the_deciding_agent_killed_while_the_group_forms_on_its_store_is_recovered_in_process(
        tmp_path: Path, etcd_server, etcd_run_id: str) -> None:
    """Group formation survives the death of the agent it forms on: n2's rank is killed, an agent decides (the
    spare node's worker takes rank 2) and the next generation forms on its store; n1's rank is held 3 s in the
    re-formation by a planned fault, and meanwhile the deciding agent is SIGKILLed (its node's rank with it).
    The members still forming leave (the store failed, or the agent aborted the generation), say they wait, and
    another agent decides the next generation in process: no restart, every sample once."""
    ref, out, agents = _second_fault_run(tmp_path, etcd_server.url, etcd_run_id,
                                         {"kind": "hang", "rank": 1, "step": DIE_STEP, "attempt": 0, "section": "restore",
                                          "duration_s": 3.0})
    run = out / "run"
    try:
        wait_for(lambda: events_so_far(run, "recovery_decided"), timeout=180, what="the first decision")
        decider = events_so_far(run, "recovery_decided")[0]["node"]
        wait_for(lambda: events_so_far(run, "fault_injected"), timeout=30, what="n1's rank held in the re-formation")
        agents[decider].send_signal(signal.SIGKILL)  # its worker, if it holds one, dies with it
        agents[decider].wait(timeout=30)
    except BaseException:
        _finish(agents, 0)
        raise
    codes = _finish({n: a for n, a in agents.items() if n != decider}, 240)
    assert set(codes.values()) == {0}, (decider, codes, _logs(tmp_path))
    assert not events(run, "restart"), _logs(tmp_path)
    decided = events(run, "recovery_decided")
    assert len(decided) == 2 and decided[0]["action"] == "promote_spare", decided
    # Which in-process rung answers depends on who decided first (a spare a node keeps warm, a shrink, or the same
    # members again when the store alone was lost); never a restart, and never the dead agent's decision.
    assert decided[1]["node"] != decider and decided[1]["action"] in ("promote_spare", "shrink", "retry_in_place"), \
        decided[1]
    done = events(run, "recovered_in_process")
    assert done and all(d["resumed_after_step"] == DIE_STEP for d in done), done
    lines = trace(out)
    _assert_trained_as_reference(out, ref, lines, SECOND_FAULT_STEPS)


def test_a_restart_takes_a_spare_node_in_a_lost_node_s_place_instead_of_waiting_for_it(
        tmp_path: Path, etcd_server, etcd_run_id: str) -> None:
    """The script makes a process group of its own, so it declines in-process recovery: a lost node means a
    restart.  n1's agent is SIGKILLed (its worker dies with it) and never comes back; the spare node takes n1's
    place in the restart's rendezvous (``--nnodes 2`` would otherwise wait for n1 until the join timeout), and
    the resumed run equals the uninterrupted one bitwise: every step's losses and samples, as last done, and the
    final parameters and optimizer state."""
    steps, own = 12, ("--own-group", "script")
    ref, proc = elastic_run(tmp_path, "ref", "--nproc-per-node", "2", extra=own, steps=steps)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "run"
    out.mkdir()
    run = out / "run"
    script = _script(out, steps, *own, "--step-sleep", "0.3")
    agents = {n: start_agent(run, *_node(etcd_server.url, etcd_run_id, n, "2", *role), script=WORKER,
                             script_args=script, log=tmp_path / f"{n}.log")
              for n, role in (("n0", ()), ("n1", ()), ("spare0", ("--role", "spare")))}
    try:
        _lose_node(agents, "n1", out, step=4)
    except BaseException:
        _finish(agents, 0)
        raise
    codes = _finish({n: a for n, a in agents.items() if n != "n1"}, 240)
    assert codes == {"n0": 0, "spare0": 0}, _logs(tmp_path)
    assert [(e["node"], e["lost_node"]) for e in events(run, "spare_node_takes_place")] == [("spare0", "n1")], \
        _logs(tmp_path)
    [restart] = events(run, "restart")
    joined = [(e["node"], e["num_nodes"]) for e in events(run, "rendezvous_joined")
              if e["generation"] > restart["generation"]]
    assert sorted(joined) == [("n0", 2), ("spare0", 2)], joined
    lines = trace(out)
    last = {(line["step"], line["rank"]): line for line in lines}  # a step re-done after the restart: as last done
    want = {(line["step"], line["rank"]): line for line in trace(ref)}
    assert sorted(last) == sorted(want)
    assert all((last[k]["indices"], last[k]["losses"]) == (want[k]["indices"], want[k]["losses"]) for k in want)
    assert last[(steps - 1, 1)]["worker"].startswith("spare0."), "rank 1 did not move to the spare node"
    final, expected = json.loads((out / "final.json").read_text()), json.loads((ref / "final.json").read_text())
    assert final["params"] == expected["params"] and final["optimizer"] == expected["optimizer"]
