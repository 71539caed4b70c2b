"""In-process recovery under ``resilient run``: spares, shrink, and the fall back to a restart.

Real agents, real worker processes on gloo, the script a user writes
(``tests/elastic_worker.py``: ``Run(ddp=True)``, ``run.attempt()``,
``run.micro_batches()``).  An uninterrupted run of the same script is the
reference: with a spare the recovered run must equal it bitwise (every
step's losses and sample ids, the final parameters and optimizer state)
with no step done twice; shrunk, it must consume every sample of the epoch
exactly once, each step's global sample set must equal the reference's,
and its parameters must stay within a stated tolerance of the reference's
(the sums run in another order on fewer ranks).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from resilient.metrics.ledger import Ledger

from .agent_helpers import events, explain, incidents, run_agent

WORKER = Path(__file__).with_name("elastic_worker.py")
STEPS = 8
DIE_STEP = 4


def trace(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "trace.jsonl").read_text().splitlines() if line.strip()]


def by_step(lines: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    found: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for line in lines:
        found[line["step"]].append(line)
    return found


def elastic_run(tmp: Path, name: str, *flags: str, die: tuple[str, str] | None = None,
                extra: tuple[str, ...] = (), steps: int = STEPS) -> tuple[Path, Any]:
    """Run the worker script under the agent; ``die``: (worker id, how) strikes at DIE_STEP."""
    out = tmp / name
    out.mkdir()
    args = ["--steps", str(steps), "--out", str(out), "--ckpt", str(out / "ckpt"), *extra]
    if die is not None:
        args += ["--die-worker", die[0], "--die-step", str(DIE_STEP), "--die-how", die[1]]
    proc = run_agent(out / "run", "--max-restarts", "2", *flags, script=WORKER, script_args=tuple(args),
                     timeout=240)
    return out, proc


@pytest.fixture(scope="module")
def reference2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out, proc = elastic_run(tmp_path_factory.mktemp("ref2"), "ref", "--nproc-per-node", "2")
    assert proc.returncode == 0, explain(proc)
    return out


@pytest.fixture(scope="module")
def reference3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out, proc = elastic_run(tmp_path_factory.mktemp("ref3"), "ref", "--nproc-per-node", "3", extra=("--plain",))
    assert proc.returncode == 0, explain(proc)
    return out


def assert_bitwise_equal(out: Path, reference: Path, world: int = 2) -> None:
    got, want = by_step(trace(out)), by_step(trace(reference))
    assert sorted(got) == list(range(STEPS)) == sorted(want)
    for step in range(STEPS):
        assert len(got[step]) == world, f"step {step} was completed {len(got[step])} times, not once per rank: {got[step]}"
        mine = {line["rank"]: (line["indices"], line["losses"]) for line in got[step]}
        theirs = {line["rank"]: (line["indices"], line["losses"]) for line in want[step]}
        assert mine == theirs, f"step {step} differs from the uninterrupted run"
    final, ref = json.loads((out / "final.json").read_text()), json.loads((reference / "final.json").read_text())
    assert final["params"] == ref["params"]
    assert final["optimizer"] == ref["optimizer"]
    assert (final["scheduler"], final["lr"], final["samples"]) == (ref["scheduler"], ref["lr"], ref["samples"])


@pytest.mark.parametrize("how", ["kill", "start"])
def test_a_spare_replaces_a_killed_rank_with_nothing_redone(tmp_path: Path, reference2: Path, how: str) -> None:
    out, proc = elastic_run(tmp_path, how, "--nproc-per-node", "2", "--spares", "1", die=("w1", how),
                            extra=("--spares-ready", "1"))
    assert proc.returncode == 0, explain(proc)
    run = out / "run"
    assert not events(run, "restart"), "recovered by a restart, not in process"
    decided = events(run, "recovery_decided")
    assert [d["action"] for d in decided] == ["promote_spare"], decided
    assert decided[0]["promotions"] == [{"rank": 1, "spare": "s2", "node": decided[0]["promotions"][0]["node"]}]
    done = events(run, "recovered_in_process")
    assert len(done) == 1 and done[0]["rung"] == "promote_spare" and done[0]["resumed_after_step"] == DIE_STEP, done
    workers = {line["worker"] for line in trace(out) if line["step"] > DIE_STEP and line["rank"] == 1}
    assert workers == {"s2"}, f"rank 1 after the failure was {workers}, not the spare"
    [incident] = incidents(run)
    assert incident["decision"]["action"] == "promote_spare" and incident["recovered"]["rung"] == "promote_spare"
    assert_bitwise_equal(out, reference2)
    # The pool was refilled: a second spare started after the promotion and came up warm.
    started = [e["worker"] for e in events(run, "spare_started")]
    assert started[:1] == ["s2"] and len(started) == 2, started
    assert {e["worker"] for e in events(run, "spare_ready")} >= set(started[:1])
    # The spare waited at a lower priority and was given the workers' back when it took rank 1, before its script
    # started: the script ran at the workers' priority throughout.
    assert {e["nice"] for e in events(run, "spare_started")} == {10}
    lines = trace(out)
    assert {(line["started_nice"], line["nice"]) for line in lines} == {(0, 0)}
    assert not events(run, "spare_priority")


def test_one_machine_keeping_its_run_in_etcd_numbers_its_in_process_generation_by_the_signed_counter(
        tmp_path: Path, reference2: Path, etcd_server: Any, etcd_run_id: str) -> None:
    """One node whose agent keeps the run in etcd (``--store``): the round numbers generation 1 with the run's
    signed counter; the spare takes the killed rank in process and numbers generation 2 from the same counter,
    signed as the rounds and decisions write it; the run ends bitwise equal to the reference."""
    from resilient.coord.etcd import EtcdClient, EtcdConfig
    from resilient.coord.proof import verify

    out, proc = elastic_run(tmp_path, "etcd", "--nproc-per-node", "2", "--spares", "1", "--store", etcd_server.url,
                            "--run-id", etcd_run_id, die=("w1", "kill"), extra=("--spares-ready", "1"))
    assert proc.returncode == 0, explain(proc)
    run = out / "run"
    assert not events(run, "restart") and not events(run, "forged_key"), explain(proc)
    assert [e["generation"] for e in events(run, "generation_continued")] == [2]
    counter = EtcdClient(EtcdConfig.from_url(etcd_server.url)).get(f"/resilient/{etcd_run_id}/generation")
    assert counter is not None
    token = (run / "token").read_text().strip()
    assert verify(token, "generation", counter.value).value == {"generation": 2}
    assert_bitwise_equal(out, reference2)


def test_a_promoted_spare_saves_on_the_interval_its_peers_computed(tmp_path: Path, reference2: Path) -> None:
    # Saves every 2 steps at most; a tiny MTBF makes the computed interval 1 from the second scheduled save (step
    # 4: the first, at 2, is what the ranks measure), just before rank 1 dies in step 4.  The spare must take that
    # interval with the state, or its due steps differ from the survivor's and their save agreement pairs up wrong.
    out, proc = elastic_run(tmp_path, "cadence", "--nproc-per-node", "2", "--spares", "1", "--mtbf", "0.01",
                            die=("w1", "kill"), extra=("--spares-ready", "1", "--every", "2", "--step-sleep", "0.2"))
    assert proc.returncode == 0, explain(proc)
    run = out / "run"
    changes = [(e["rank"], e["step"], e["previous"], e["every"]) for e in events(run, "checkpoint_cadence")]
    assert sorted(changes) == [(0, DIE_STEP, 2, 1), (1, DIE_STEP, 2, 1)], changes
    assert [d["action"] for d in events(run, "recovery_decided")] == ["promote_spare"]
    assert_bitwise_equal(out, reference2)
    from resilient.checkpoint import LocalStorage

    assert LocalStorage(out / "ckpt").list_committed() == [f"step_{s:010d}" for s in (STEPS - 2, STEPS - 1, STEPS)]


def test_a_hung_rank_is_killed_and_replaced_by_the_spare(tmp_path: Path, reference2: Path) -> None:
    out, proc = elastic_run(tmp_path, "hang", "--nproc-per-node", "2", "--spares", "1",
                            "--section-timeout", "step=4", die=("w1", "hang"), extra=("--spares-ready", "1"))
    assert proc.returncode == 0, explain(proc)
    run = out / "run"
    assert not events(run, "restart")
    assert len(events(run, "hang_detected")) == 1
    [incident] = incidents(run)
    assert incident["kind"] == "hang" and incident["rank"] == 1, incident
    assert incident["decision"]["action"] == "promote_spare" and incident["recovered"]["resumed_after_step"] == DIE_STEP
    assert_bitwise_equal(out, reference2)


def global_sets(lines: list[dict[str, Any]]) -> dict[int, list[int]]:
    """Each step's global sample ids, sorted (every rank's micro-batches together)."""
    found: dict[int, list[int]] = defaultdict(list)
    for line in lines:
        for ids in line["indices"]:
            found[line["step"]].extend(ids)
    return {step: sorted(ids) for step, ids in found.items()}


def assert_close(got: list[list[str]], want: list[list[str]], rtol: float, atol: float) -> None:
    for a, b in zip(got, want, strict=True):
        for x, y in zip(map(float.fromhex, a), map(float.fromhex, b), strict=True):
            assert abs(x - y) <= atol + rtol * abs(y), (x, y)


SHRINK_TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}
"""Parameters of a run shrunk 3 -> 2 against the uninterrupted 3-rank run (``--plain``: no dropout, no random
augmentation, so nothing random depends on how a step is cut into micro-batches): the same samples per step,
the gradient summed in another order (3 ranks x 1 micro-batch of 2, then 2 ranks x 3 of 1)."""


def test_without_a_spare_the_run_shrinks_and_keeps_the_global_batch(tmp_path: Path, reference3: Path) -> None:
    out, proc = elastic_run(tmp_path, "shrink", "--nproc-per-node", "2:3", die=("w2", "kill"), extra=("--plain",))
    assert proc.returncode == 0, explain(proc)
    run = out / "run"
    assert not events(run, "restart")
    assert [d["action"] for d in events(run, "recovery_decided")] == ["shrink"]
    [done] = events(run, "recovered_in_process")
    assert done["rung"] == "shrink" and done["world_size"] == 2 and done["resumed_after_step"] == DIE_STEP
    lines, ref = trace(out), trace(reference3)
    got, want = global_sets(lines), global_sets(ref)
    assert got == want, "a step's global sample set differs from the uninterrupted run's"
    everything = sorted(i for ids in got.values() for i in ids)
    assert everything == list(range(48)), "the epoch's samples were not each consumed exactly once"
    after = [line for line in lines if line["step"] > DIE_STEP]
    assert {(line["world"], line["accumulation"]) for line in after} == {(2, 3)}, after[:2]
    final, want_final = json.loads((out / "final.json").read_text()), json.loads((reference3 / "final.json").read_text())
    assert final["params"] != want_final["params"], "bitwise equal: the reduction order did not change?"
    assert_close(final["params"], want_final["params"], **SHRINK_TOLERANCE)
    assert final["samples"] * 1 == final["samples"] and final["step"] == STEPS


@pytest.mark.serial  # "at once": two self-kills in one step, which a loaded machine can spread over two decisions
def test_two_ranks_lost_at_once_with_one_spare_promote_one_and_shrink(tmp_path: Path, reference3: Path) -> None:
    out, proc = elastic_run(tmp_path, "two", "--nproc-per-node", "2:3", "--spares", "1",
                            die=("w1,w2", "start"), extra=("--spares-ready", "1", "--spares-at-end", "2", "--plain"))
    assert proc.returncode == 0, explain(proc)
    run = out / "run"
    assert not events(run, "restart")
    [decided] = events(run, "recovery_decided")
    assert decided["action"] == "shrink" and decided["dropped_ranks"] == [2], decided
    assert [p["rank"] for p in decided["promotions"]] == [1]
    assert global_sets(trace(out)) == global_sets(trace(reference3))
    # The pool: one spare ready, none once it is promoted, then refilled: a spare for --spares 1 and a replacement
    # for the dropped rank start at once (the run may grow back onto one), and the ready count comes back.
    ready, timeline, members = 0, [], set()
    for e in events(run):
        if e["kind"] == "spare_ready":
            ready += 1
        elif e["kind"] == "generation_continued":
            joined = {w for w in e["members"].values() if w.startswith("s")} - members
            members |= joined
            ready -= len(joined)
        else:
            continue
        timeline.append(ready)
    assert timeline[:3] == [1, 0, 1], timeline
    started = [e["worker"] for e in events(run, "spare_started")]
    assert len(started) == 3, started


def test_losing_every_rank_falls_back_to_a_restart_and_stays_bitwise_equal(tmp_path: Path,
                                                                          reference2: Path) -> None:
    out, proc = elastic_run(tmp_path, "all", "--nproc-per-node", "2", "--spares", "1", die=("w0,w1", "start"),
                            extra=("--spares-ready", "1"))
    assert proc.returncode == 0, explain(proc)
    run = out / "run"
    assert len(events(run, "restart")) == 1
    final, ref = json.loads((out / "final.json").read_text()), json.loads((reference2 / "final.json").read_text())
    assert final["params"] == ref["params"] and final["optimizer"] == ref["optimizer"]
    # Workers first after the restart: its spare started once both of its workers had restored and completed two
    # steps since (the restart is over), not beside them.
    [restart] = events(run, "restart")
    after = [e for e in events(run, "workers_started") if e["generation"] > restart["generation"]][0]["generation"]
    [restored] = [e for e in events(run, "restored") if e["generation"] == after]
    spares = [e for e in events(run, "spare_started") if e["generation"] == after]
    assert spares and all(e["time"] >= restored["time"] for e in spares), (restored, spares)
    first = min(e["time"] for e in spares)
    done = {r: [line["step"] for line in trace(out) if line["rank"] == r and restored["time"] < line["time"] < first]
            for r in (0, 1)}
    assert all(len(steps) >= 2 for steps in done.values()), (done, restored, spares)
    # From then on the ladder weighs a restart at what this one cost (its detection to the next new step, as the
    # node's ledger measured it), not at a constant; status shows it.
    [node_dir] = (run / "nodes").iterdir()
    cost = json.loads((node_dir / "status.json").read_text())["recovery"]["restart_cost"]
    assert cost["from"] == "median of 1 restarts", cost
    ledger = Ledger.from_dict(json.loads((node_dir / "ledger.json").read_text())["ledger"])
    [incident] = ledger.account(ledger.last_t).incidents
    assert cost["seconds"] == round(incident.recovery_s + incident.replay_s, 3) > 0, (cost, incident)


def test_a_planned_fault_strikes_once_and_the_spare_that_takes_the_rank_is_not_struck_again(
        tmp_path: Path, reference2: Path) -> None:
    """A chaos plan targets a rank at a step: the process holding it then, not every later holder."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"version": 1, "seed": 0, "faults": [
        {"kind": "kill", "rank": 1, "step": DIE_STEP, "attempt": 0, "section": "step"},
        {"kind": "kill", "rank": 1, "step": 6, "attempt": 0, "section": "step"}]}))
    out, proc = elastic_run(tmp_path, "plan", "--nproc-per-node", "2", "--spares", "2", "--fault-plan", str(plan),
                            extra=("--spares-ready", "0"))
    assert proc.returncode == 0, explain(proc)
    run = out / "run"
    assert not events(run, "restart")
    done = events(run, "recovered_in_process")
    assert [d["resumed_after_step"] for d in done] == [DIE_STEP, 6], done
    holders = [(line["step"], line["worker"]) for line in trace(out) if line["rank"] == 1]
    assert [w for s, w in holders if s < DIE_STEP] == ["w1"] * DIE_STEP
    assert len({w for s, w in holders if DIE_STEP <= s < 6}) == 1 and len({w for s, w in holders if s >= 6}) == 1
    assert_bitwise_equal(out, reference2)


def test_a_member_lost_while_the_group_re_forms_is_folded_into_the_next_generation_in_process(
        tmp_path: Path, reference3: Path) -> None:
    """A second fault during a re-formation: w2 dies at DIE_STEP; while the survivors and the promoted spare form
    the next generation, a planned fault kills w1 as it enters the re-formation.  The agent abandons that
    generation: its members still forming it (w0, and the promoted spare, which holds no state) leave it and
    wait, and the next decision promotes one more spare into w1's rank: no restart, nothing re-done, bitwise the
    uninterrupted run."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"version": 1, "seed": 0, "faults": [
        {"kind": "kill", "rank": 1, "step": DIE_STEP, "attempt": 0, "section": "restore"}]}))
    out, proc = elastic_run(tmp_path, "second", "--nproc-per-node", "3", "--spares", "3", "--fault-plan", str(plan),
                            die=("w2", "kill"), extra=("--spares-ready", "3", "--plain"))
    assert proc.returncode == 0, explain(proc)
    run = out / "run"
    assert not events(run, "restart"), "recovered by a restart, not in process"
    decided = events(run, "recovery_decided")
    assert [d["action"] for d in decided] == ["promote_spare", "promote_spare"], decided
    [first] = decided[0]["promotions"]
    assert first["rank"] == 2, decided[0]
    [second] = decided[1]["promotions"]
    assert second["rank"] == 1 and second["spare"] != first["spare"], decided[1]
    continued = events(run, "generation_continued")
    assert [e["generation"] for e in continued] == [2, 3]
    # The spare promoted into generation 2 was still forming it: it left on the abort and stays rank 2.
    assert continued[1]["members"] == {"0": "w0", "1": second["spare"], "2": first["spare"]}, continued[1]
    assert not events(run, "recovery_abandoned")
    done = events(run, "recovered_in_process")
    assert len(done) == 1 and done[0]["generation"] == 3 and done[0]["resumed_after_step"] == DIE_STEP, done
    assert_bitwise_equal(out, reference3, world=3)


def test_a_shrunk_run_grows_back_when_its_replacement_is_warm(tmp_path: Path) -> None:
    """2:3 without a spare: one rank lost, the run shrinks, the agent starts a replacement, the run grows back.

    Every rank holds at step 6 until the agent decided to grow (so the replacement's warm-up cannot outlast the
    run); the agent places the boundary a few steps ahead of every rank.
    """
    steps, samples = 12, ("--samples", "72", "--plain")
    ref, proc = elastic_run(tmp_path, "ref", "--nproc-per-node", "3", extra=samples, steps=steps)
    assert proc.returncode == 0, explain(proc)
    out, proc = elastic_run(tmp_path, "grow", "--nproc-per-node", "2:3", "--grow-settle", "0.5", die=("w2", "kill"),
                            extra=(*samples, "--hold-at", "6"), steps=steps)
    assert proc.returncode == 0, explain(proc)
    run = out / "run"
    assert not events(run, "restart")
    assert [d["action"] for d in events(run, "recovery_decided")] == ["shrink", "grow"]
    done = events(run, "recovered_in_process")
    assert [d["rung"] for d in done] == ["shrink", "grow"], done
    at = done[1]["at_step"]
    assert at > 6
    lines = trace(out)
    worlds = {line["step"]: line["world"] for line in lines}
    assert [worlds[s] for s in range(steps)] == [3] * DIE_STEP + [2] * (at - DIE_STEP) + [3] * (steps - at), worlds
    assert {line["worker"] for line in lines if line["step"] >= at and line["rank"] == 2} == {"s3"}
    assert global_sets(lines) == global_sets(trace(ref)), "a step's global sample set differs from the reference"
    assert sorted(i for ids in global_sets(lines).values() for i in ids) == list(range(72))
    final, want = json.loads((out / "final.json").read_text()), json.loads((ref / "final.json").read_text())
    assert_close(final["params"], want["params"], **SHRINK_TOLERANCE)
    assert final["step"] == steps and final["world"] == 3


def test_a_rank_lost_after_a_grow_was_decided_and_before_its_boundary_is_folded_in_without_a_restart(
        tmp_path: Path) -> None:
    """A failure racing a grow: 2:3 without a spare, rank 2 lost at step 4 (shrink); every rank holds at step 6
    until the agent decided to grow onto the warm replacement, and w1 is SIGKILLed as that hold ends: the grow's
    generation is published, its boundary still ahead, its joiner promoted.  The grow is abandoned and the loss
    answered in process over the grow's members (w0 and the joiner, which holds no state): no restart, every
    step's global sample set the reference's, every sample once."""
    steps, samples = 14, ("--samples", "84", "--plain")
    ref, proc = elastic_run(tmp_path, "ref", "--nproc-per-node", "3", extra=samples, steps=steps)
    assert proc.returncode == 0, explain(proc)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"version": 1, "seed": 0, "faults": [
        {"kind": "kill", "rank": 2, "step": DIE_STEP, "attempt": 0, "section": "step"}]}))
    out, proc = elastic_run(tmp_path, "race", "--nproc-per-node", "2:3", "--grow-settle", "0.5", "--fault-plan",
                            str(plan), extra=(*samples, "--hold-at", "6", "--step-sleep", "0.2", "--die-worker", "w1",
                                              "--die-step", "6", "--die-how", "after-hold"), steps=steps)
    assert proc.returncode == 0, explain(proc)
    run = out / "run"
    assert not events(run, "restart"), explain(proc)
    decided = [d["action"] for d in events(run, "recovery_decided")]
    # After the loss the replacement may be warm again before the run ends (a second grow) or not.
    assert decided[:3] == ["shrink", "grow", "shrink"] and decided[3:] in ([], ["grow"]), decided
    continued = events(run, "generation_continued")
    assert [(e["generation"], e["action"]) for e in continued][:3] == [(2, "shrink"), (3, "grow"), (4, "shrink")]
    grown = continued[1]["members"]
    # The loss is answered over the grow's members: the joiner stays, as rank 1 of two.
    assert continued[2]["members"] == {"0": "w0", "1": grown["2"]}, continued
    done = events(run, "recovered_in_process")
    assert [d["generation"] for d in done][:2] == [2, 4] and done[1]["resumed_after_step"] == 6, done
    lines = trace(out)
    assert {line["worker"] for line in lines if line["step"] == 6} == {"w0", grown["2"]}, "step 6 not retried by both"
    assert global_sets(lines) == global_sets(trace(ref)), "a step's global sample set differs from the reference"
    assert sorted(i for ids in global_sets(lines).values() for i in ids) == list(range(84)), "a sample twice or never"
    final, want = json.loads((out / "final.json").read_text()), json.loads((ref / "final.json").read_text())
    assert_close(final["params"], want["params"], **SHRINK_TOLERANCE)
    assert final["step"] == steps


def test_a_run_that_ends_before_its_grow_s_boundary_stops_the_joiner_and_succeeds(tmp_path: Path) -> None:
    """2:3 without a spare: rank 2 lost (shrink), every rank holds at step 6 until a grow onto the warm
    replacement is decided (its boundary a few steps ahead), and the script leaves its loop after step 7, as a
    script that stops early does: the members exit 0 before the boundary.  The joiner that waits for them holds
    no state: it is stopped, and the run succeeds without an incident or a restart."""
    out, proc = elastic_run(tmp_path, "early", "--nproc-per-node", "2:3", "--grow-settle", "0.5",
                            die=("w2", "kill"), extra=("--samples", "84", "--plain", "--hold-at", "6",
                                                       "--stop-after", "7"), steps=14)
    assert proc.returncode == 0, explain(proc)
    run = out / "run"
    assert [d["action"] for d in events(run, "recovery_decided")] == ["shrink", "grow"]
    assert not events(run, "restart") and len(incidents(run)) == 1, explain(proc)
    [grown] = [e for e in events(run, "generation_continued") if e["action"] == "grow"]
    joiner = grown["members"]["2"]
    assert f"the run finished before the grow's boundary at step {grown['at_step']}; its joiners ['{joiner}'] " \
           "were stopped" in proc.stderr, explain(proc)
    lines = trace(out)
    assert max(line["step"] for line in lines) == 7 and joiner not in {line["worker"] for line in lines}
    assert [e["verdict"] for e in events(run, "agent_finished")] == ["succeeded"]


def test_a_collective_error_with_every_rank_alive_is_retried_in_place(tmp_path: Path, reference2: Path) -> None:
    """A transient network error: no process dies, every rank's collective fails; the same members re-form."""
    out, proc = elastic_run(tmp_path, "raise", "--nproc-per-node", "2", "--spares", "1", die=("w1", "raise"))
    assert proc.returncode == 0, explain(proc)
    run = out / "run"
    assert not events(run, "restart")
    [decided] = events(run, "recovery_decided")
    assert decided["action"] == "retry_in_place", decided
    [done] = events(run, "recovered_in_process")
    assert done["rung"] == "retry_in_place" and done["resumed_after_step"] == DIE_STEP and done["world_size"] == 2
    [incident] = incidents(run)
    assert incident["kind"] == "collective" and "injected" in incident["summary"]
    assert {line["worker"] for line in trace(out)} == {"w0", "w1"}, "the same processes went on"
    assert_bitwise_equal(out, reference2)
