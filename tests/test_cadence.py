"""The durable tier's computed save interval (Young/Daly): the policy by table and by property, the failure rate
the agent gives, the goodput report's comparison, and two gloo ranks agreeing on the interval as they train."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from resilient.agent.failure_rate import count_failures, failure_rate_env
from resilient.checkpoint import LocalStorage
from resilient.checkpoint.cadence import (
    Cadence,
    FailureRate,
    SaveCost,
    alternatives,
    daly_optimum_s,
    decide_every,
    estimate_mtbf,
    lost_share,
    priced_alternatives,
)
from resilient.checkpoint.config import CheckpointConfig
from resilient.checkpoint.inspect import verify_checkpoint
from resilient.core.errors import ConfigError
from resilient.metrics.report import render_cadence

from .agent_helpers import events, explain, run_agent
from .helpers import assert_same_run, read_trace, run_worker

# ------------------------------------------------------------------- the model


def test_daly_optimum_by_hand_and_at_its_limits():
    # C = 10 s, M = 3600 s: sqrt(2 C M) = 268.328; x = sqrt(10 / 7200) = 0.037268;
    # 268.328 * (1 + 0.012423 + 0.000154) - 10 = 261.70
    assert daly_optimum_s(10.0, 3600.0) == pytest.approx(261.70, abs=0.01)
    assert daly_optimum_s(30.0, 10.0) == 10.0, "a save costing twice the MTBF or more: save once per MTBF"
    assert daly_optimum_s(0.0, 100.0) == 0.0


@given(cost=st.floats(1e-4, 10.0), mtbf=st.floats(60.0, 1e6))
def test_daly_is_near_young_and_young_minimises_the_first_order_loss(cost, mtbf):
    assume(cost * 100 <= mtbf)  # Daly's correction is small only while a save costs little against the MTBF
    young = math.sqrt(2 * cost * mtbf)
    assert daly_optimum_s(cost, mtbf) == pytest.approx(young, rel=0.15)
    best = lost_share(young, cost_s=cost, mtbf_s=mtbf)
    for factor in (0.5, 0.9, 1.1, 2.0):
        assert lost_share(young * factor, cost_s=cost, mtbf_s=mtbf) > best


# ------------------------------------------------------------------- the interval, by table


def costs(stall: float, write: float, n: int = 3) -> list[SaveCost]:
    return [SaveCost(stall, write)] * n


@pytest.mark.parametrize(
    ("saves", "step_s", "mtbf_s", "bound", "every", "reason"),
    [
        ([], 0.1, None, 100, 100, "no failure rate known: every 100 steps"),
        ([], 0.1, 3600.0, 100, 100, "no save measured yet"),
        (costs(0.05, 0.5), None, 3600.0, 100, 100, "no save measured yet"),
        # sqrt(2 * 0.05 * 3600) = 18.974 s; Daly: * (1 + 0.000878) - 0.05 = 18.94 s over 0.1 s steps: 189 steps.
        (costs(0.05, 0.5), 0.1, 3600.0, 100, 100, "capped at every_steps=100"),
        (costs(0.05, 0.5), 0.1, 3600.0, 500, 189, "Young/Daly's optimum is 18.9 s, every 189 step(s)"),
        # sqrt(2 * 0.002 * 10) = 0.2 s: 2 steps of 0.1 s, but the write takes 0.75 s: 8 steps.
        (costs(0.002, 0.75), 0.1, 10.0, 100, 8, "raised to 8 so that the 0.75 s write ends before the next"),
        ([SaveCost(0.01, 0.1), SaveCost(0.5, 0.1), SaveCost(0.02, 0.1)], 1.0, 10_000.0, 1000, 20,
         "a save stalls the loop 20.0 ms"),  # the median, not the outlier
    ],
)
def test_decide_every(saves, step_s, mtbf_s, bound, every, reason):
    got = decide_every(saves, step_s, mtbf_s, bound=bound, mtbf_source="--mtbf")
    assert got.every == every
    assert reason in got.reason, got.reason


@settings(max_examples=300)
@given(stall=st.floats(0.0, 5.0), write=st.floats(0.0, 60.0), step_s=st.floats(1e-3, 30.0),
       mtbf_s=st.floats(1.0, 1e7), bound=st.integers(1, 10_000))
def test_the_interval_stays_within_the_bound_and_lets_the_writer_finish_unless_capped(stall, write, step_s, mtbf_s,
                                                                                     bound):
    got = decide_every(costs(stall, write), step_s, mtbf_s, bound=bound)
    assert 1 <= got.every <= bound
    if got.every < bound:
        assert got.every * step_s >= write - 1e-9, got.reason
        assert got.every >= round(daly_optimum_s(stall, mtbf_s) / step_s), got.reason


def test_cadence_proposes_nothing_until_it_has_a_rate_and_a_measured_save():
    c = Cadence(50, FailureRate(None, "--mtbf auto: no failure in 30 s of the run's history"))
    c.step_done(0.1)
    c.saved(SaveCost(0.01, 0.2))
    assert c.proposal() is None, "no failure rate: no proposal (the ranks keep the bound)"
    c = Cadence(50, FailureRate(100.0, "--mtbf"))
    assert c.proposal() is None
    c.step_done(0.1)
    assert c.proposal() is None, "no save measured yet"
    c.saved(SaveCost(0.01, 0.2))
    proposal = c.proposal()
    assert proposal is not None and proposal.every == 14  # sqrt(2 * 0.01 * 100) = 1.414 s (Daly 1.4) / 0.1 s
    assert not c.adopt(0), "0: nobody proposed; the interval stays"
    assert c.adopt(14) and c.every == 14 and not c.adopt(14)


def test_mtbf_is_validated():
    with pytest.raises(ConfigError, match="mtbf_s=0.0 must be a number of seconds > 0"):
        CheckpointConfig(dir="x", mtbf_s=0.0)
    with pytest.raises(ConfigError, match="mtbf_s=nan"):
        CheckpointConfig(dir="x", mtbf_s=float("nan"))
    with pytest.warns(UserWarning, match="has no effect with every_steps=None"):
        CheckpointConfig(dir="x", every_steps=None, mtbf_s=60.0)


# ------------------------------------------------------------------- the agent's failure rate


def incident(id: str, failure: str, **more) -> dict:
    return {"id": id, "failure": failure, **more}


def test_the_history_counts_each_failure_that_restarted_workers_once():
    records = [incident("g1-a", "signal"), incident("g1-a", "signal"),  # the store's copy and the file
               incident("g2-b", "hang"), incident("g3-c", "exit", recovered={"rung": "spare"}),
               incident("g4-d", "unhealthy"), incident("g5-e", "node_lost")]
    assert count_failures(records) == 3
    assert estimate_mtbf(3, 900.0) == (300.0, "3 failure(s) in 900 s of the run's history")
    assert estimate_mtbf(0, 900.0) == (None, "no failure in 900 s of the run's history")


def test_failure_rate_env():
    assert failure_rate_env(mtbf_s=None, from_history=False, records=[], exposure_s=10.0) == {}
    assert failure_rate_env(mtbf_s=7200.0, from_history=False, records=[], exposure_s=10.0) == {
        "RESILIENT_MTBF": "7200.0", "RESILIENT_MTBF_SOURCE": "--mtbf"}
    assert failure_rate_env(mtbf_s=None, from_history=True, records=[], exposure_s=10.0) == {
        "RESILIENT_MTBF": "0", "RESILIENT_MTBF_SOURCE": "--mtbf auto: no failure in 10 s of the run's history"}
    env = failure_rate_env(mtbf_s=None, from_history=True, records=[incident("a", "signal")], exposure_s=40.0)
    assert env == {"RESILIENT_MTBF": "40.0",
                   "RESILIENT_MTBF_SOURCE": "--mtbf auto: 1 failure(s) in 40 s of the run's history"}


# ------------------------------------------------------------------- the report's comparison


def test_alternatives_price_the_chosen_interval_against_the_bound_half_and_twice():
    priced = alternatives(20, bound=100, step_s=0.5, cost_s=1.0, mtbf_s=3600.0)
    assert [(a.every, a.label) for a in priced] == [(1, "every step"), (10, "half"), (20, "chosen"), (40, "twice"),
                                                    (100, "every_steps")]
    chosen = next(a for a in priced if a.label == "chosen")
    assert chosen.stall_s_per_h == pytest.approx(3600 * 1.0 / 10.0)  # a 1 s stall every 10 s
    assert chosen.redo_s_per_h == pytest.approx(3600 * 10.0 / 7200)  # half of 10 s redone once an hour
    assert priced_alternatives({"every": 20, "bound": 100, "step_s": None, "cost_s": 1.0, "mtbf_s": 10.0}) == []
    assert [p["every"] for p in priced_alternatives({"every": 20, "bound": 100, "step_s": 0.5, "cost_s": 1.0,
                                                     "mtbf_s": 3600.0})] == [1, 10, 20, 40, 100]


# ------------------------------------------------------------------- two gloo ranks

STEPS, BOUND, MTBF = 60, 20, 0.05
TRAIN = ("--steps", str(STEPS), "--step-sleep", "0.03", "--every", str(BOUND), "--keep", "100")


def rank_events(prefix: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in Path(f"{prefix}.rank{rank}").read_text().splitlines()]


def test_two_ranks_agree_on_the_computed_interval_and_train_as_without_it(tmp_path):
    ckpt, ev = tmp_path / "ckpt", tmp_path / "events"
    run_worker(tmp_path / "ref", *TRAIN, "--dir", str(tmp_path / "ref_ckpt"), nproc=2, timeout=240)
    run_worker(tmp_path / "t", *TRAIN, "--dir", str(ckpt), "--mtbf", str(MTBF), "--events", str(ev), nproc=2,
               timeout=240)
    ranks = [rank_events(ev, r) for r in (0, 1)]
    changes = [[e for e in r if e["kind"] == "checkpoint_cadence"] for r in ranks]
    # The first scheduled save (step 20) has nothing measured; at the second (40) both ranks have measured one and
    # agree on the largest proposal.  The MTBF is tiny, so the optimum is far below the bound.
    assert [[(e["step"], e["previous"], e["every"]) for e in c] for c in changes] == \
        [[(2 * BOUND, BOUND, changes[0][0]["every"])]] * 2, changes
    change = changes[0][0]
    every = change["every"]
    assert 1 <= every < BOUND
    assert change["mtbf_source"] == "CheckpointConfig.mtbf_s" and change["mtbf_s"] == MTBF
    mine = [c[0] for c in changes if c[0]["reason"].startswith("a save stalls")]
    assert mine, "neither rank's own proposal was taken: the agreed interval is the largest proposal"
    for e in mine:  # the numbers in the event chose the interval
        assert e["every"] == decide_every([SaveCost(e["cost_s"], e["write_s"])], e["step_s"], e["mtbf_s"],
                                          bound=BOUND).every
        assert e["optimum_s"] == pytest.approx(daly_optimum_s(e["cost_s"], e["mtbf_s"]), abs=1e-5)
    committed = [[e["step"] for e in r if e["kind"] == "checkpoint_committed"] for r in ranks]
    expected = [BOUND, 2 * BOUND, *range(2 * BOUND + every - 2 * BOUND % every, STEPS, every)]
    assert committed[0] == committed[1] == [*expected, STEPS], committed
    storage = LocalStorage(ckpt)
    assert [int(n.split("_")[1]) for n in storage.list_committed()] == [*expected, STEPS]
    assert all(verify_checkpoint(storage, n).ok for n in storage.list_committed())
    # Saving on the computed interval changes nothing that is trained.
    assert_same_run(read_trace(tmp_path / "ref"), read_trace(tmp_path / "t"))
    # The goodput report prices the interval the run chose from that event's own numbers.
    text = "\n".join(render_cadence(change, priced_alternatives(change), []))
    assert f"checkpoint cadence: every {every} steps since step {2 * BOUND}" in text
    assert f"{every} (chosen)" in text and f"{BOUND} (every_steps)" in text


def test_agent_with_mtbf_auto_gives_the_restarted_workers_the_rate_of_the_run_s_history(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"version": 1, "seed": 0, "faults": [
        {"kind": "kill", "rank": 1, "step": 13, "attempt": 0, "section": "step"}]}))
    run_dir = tmp_path / "run"
    proc = run_agent(run_dir, "--nproc-per-node", "2", "--node-id", "n0", "--fault-plan", str(plan),
                     "--mtbf", "auto", script_args=("--steps", "30", "--every", "5", "--dir", str(tmp_path / "ckpt"),
                                                    "--trace", str(tmp_path / "trace")))
    assert proc.returncode == 0, explain(proc)
    starts = read_trace(tmp_path / "trace", 0).starts
    assert len(starts) == 2, starts
    assert (starts[0]["mtbf"], starts[0]["mtbf_source"]) == (
        "0", starts[0]["mtbf_source"]) and "--mtbf auto: no failure in" in starts[0]["mtbf_source"], starts[0]
    mtbf = float(starts[1]["mtbf"])
    assert starts[1]["mtbf_source"] == f"--mtbf auto: 1 failure(s) in {mtbf:.0f} s of the run's history"
    assert 0.5 < mtbf < 240, f"one failure in a run that lasted seconds: {mtbf}"
    [incident] = events(run_dir, "incident")
    assert incident["failure"] == "signal"


def test_a_bad_mtbf_is_refused_before_anything_starts(tmp_path):
    proc = run_agent(tmp_path / "run", "--mtbf", "soon", script_args=("--steps", "1", "--trace", str(tmp_path / "t")))
    assert proc.returncode != 0 and "--mtbf 'soon': give a number of seconds, or auto" in proc.stderr, explain(proc)
    assert not (tmp_path / "t.rank0").exists()


def test_agent_with_a_given_mtbf_computes_the_interval_and_the_goodput_report_prices_it(tmp_path):
    """`resilient run --mtbf SECONDS` reaches the workers; their change is forwarded to the run's events, and
    `resilient report goodput` prices it, in its table and in goodput.json."""
    run_dir = tmp_path / "run"
    proc = run_agent(run_dir, "--nproc-per-node", "2", "--node-id", "n0", "--mtbf", str(MTBF),
                     script_args=("--steps", "50", "--every", str(BOUND), "--step-sleep", "0.02", "--keep", "100",
                                  "--dir", str(tmp_path / "ckpt"), "--trace", str(tmp_path / "trace")))
    assert proc.returncode == 0, explain(proc)
    # The first change comes at the first agreement after the bound's second save (step 2 x BOUND); the interval
    # is computed from measured times (a save's stall and write against the step), so it may change again later.
    # Every change is the ranks' agreement: both ranks make it, at the same step, to the same interval.
    changes = events(run_dir, "checkpoint_cadence")
    steps = sorted({e["step"] for e in changes})
    assert steps and steps[0] == 2 * BOUND, changes
    for step in steps:
        agreed = sorted((e["rank"], e["every"]) for e in changes if e["step"] == step)
        assert agreed == [(0, agreed[0][1]), (1, agreed[0][1])], (step, changes)
    change = changes[-1]  # the interval in force at the end, which the report prices
    assert all(e["mtbf_s"] == MTBF and e["mtbf_source"] == "--mtbf" and 1 <= e["every"] < BOUND for e in changes)
    report = subprocess.run([sys.executable, "-m", "resilient", "report", "goodput", str(run_dir), "--no-png"],
                            capture_output=True, text=True, timeout=120, check=False)
    assert report.returncode == 0, report.stderr
    assert f"checkpoint cadence: every {change['every']} steps since step {change['step']}" in report.stdout, \
        report.stdout
    assert f"{change['every']} (chosen)" in report.stdout and f"{BOUND} (every_steps)" in report.stdout
    saved = json.loads((run_dir / "goodput.json").read_text())["checkpoint_cadence"]
    assert saved["event"]["every"] == change["every"]
    assert [a["label"] for a in saved["alternatives"] if a["every"] == change["every"]] == ["chosen"]
    assert saved["alternatives"] == priced_alternatives(saved["event"])
