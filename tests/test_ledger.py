"""The goodput ledger on hand-made event sequences, with exact numbers."""

from __future__ import annotations

import json

import pytest

from resilient.core.errors import ConfigError
from resilient.metrics.catalogue import CATEGORIES, STEP_BUCKETS
from resilient.metrics.ideal import measured_ideal
from resilient.metrics.ledger import Ledger, LedgerConfig
from resilient.metrics.ledger_codec import LedgerStateError

TOK = 100  # tokens per rank per step
SMP = 8


def steps(ledger: Ledger, t: float, first: int, last: int, dt: float = 1.0, ranks: int = 1) -> float:
    """Ranks enter "step" for ``first..last`` every ``dt`` seconds from ``t``; returns the time after the last."""
    for s in range(first, last + 1):
        for r in range(ranks):
            ledger.section(t, r, "step", s, s * TOK, s * SMP)
        t += dt
    return t


def assert_sums(acct) -> None:
    assert sum(acct.seconds.values()) == pytest.approx(acct.wall_s, rel=1e-9, abs=1e-12)
    assert set(acct.seconds) == set(CATEGORIES)


def nonzero(acct) -> dict[str, float]:
    return {k: v for k, v in acct.seconds.items() if v}


def started(config: LedgerConfig | None = None, world: int = 1, full: int = 1, init_s: float = 10.0) -> Ledger:
    ledger = Ledger(config or LedgerConfig(ideal_step_s=1.0))
    ledger.agent_started(0.0)
    ledger.generation_started(0.0, 1, world, full, restart=False)
    for r in range(world):
        ledger.section(0.0, r, "init", 0, 0, 0)
    return ledger


def test_hang_costs_41_seconds_12_detect_9_restart_20_replayed():
    ledger = started()
    steps(ledger, 10.0, 0, 10)  # step s starts at 10 + s
    ledger.commit(20.5, 10)  # the checkpoint at step 10 committed while step 10 ran
    steps(ledger, 21.0, 11, 30)  # step 30 starts at 40 and hangs
    ledger.failure(52.0, 40.0, "hang-1", "hang")  # 12 s after the last progress (step 29 done at 40)
    ledger.generation_ended(53.0, "failed")
    ledger.generation_started(55.0, 2, 1, 1, restart=True)
    ledger.section(55.0, 0, "init", 0, 0, 0)
    ledger.section(56.0, 0, "restore", 10, 10 * TOK, 10 * SMP)
    steps(ledger, 61.0, 10, 31)  # replays 10..29 (20 s), step 30 anew at 81, step 31 at 82
    acct = ledger.account(82.0)

    (inc,) = acct.incidents
    assert (inc.id, inc.kind) == ("hang-1", "hang")
    assert (inc.detection_s, inc.recovery_s, inc.replay_s, inc.total_s) == (12.0, 9.0, 20.0, 41.0)
    assert (inc.started_t, inc.detected_t, inc.open) == (40.0, 52.0, False)
    assert nonzero(acct) == {"init": 10.0, "productive": 31.0, "failure_detection": 12.0, "recovery": 9.0,
                             "replay": 20.0}
    assert acct.wall_s == 82.0
    assert acct.goodput_ratio == 31.0 / 82.0
    assert acct.ettr == 31.0 / 82.0
    assert (acct.committed_step, acct.committed_tokens, acct.committed_samples) == (10, 10 * TOK, 10 * SMP)
    assert (acct.attempted_steps, acct.replayed_steps) == (51, 20)
    assert (acct.attempted_tokens, acct.replayed_tokens) == (51 * TOK, 20 * TOK)
    assert acct.last_progress_t == 82.0 and acct.last_commit_t == 20.5
    assert (acct.generation, acct.world_size, acct.full_world_size) == (2, 1, 1)


def test_incident_is_open_while_recovering_and_replaying():
    ledger = started()
    steps(ledger, 10.0, 0, 5)  # step 5 starts at 15
    ledger.failure(17.0, 15.0, "x", "exit")
    acct = ledger.account(20.0)
    assert acct.incidents[0].open and acct.incidents[0].recovery_s == 3.0
    ledger.generation_ended(18.0, "failed")
    ledger.generation_started(19.0, 2, 1, 1, restart=True)
    ledger.section(19.0, 0, "restore", 2, 2 * TOK, 2 * SMP)
    steps(ledger, 20.0, 2, 3)  # replaying 2 (and 3, entered at 21)
    acct = ledger.account(21.5)
    inc = acct.incidents[0]
    assert inc.open and (inc.detection_s, inc.recovery_s, inc.replay_s) == (2.0, 3.0, 1.5)
    assert nonzero(acct) == {"init": 10.0, "productive": 5.0, "failure_detection": 2.0, "recovery": 3.0,
                             "replay": 1.5}


def test_crash_with_replay_data_wait_and_checkpoint_stall():
    ledger = started()
    t = 10.0
    for s in range(4):  # each step: 0.5 s data wait, 1 s compute; a 2 s checkpoint stall at step 2
        if s == 2:
            ledger.section(t, 0, "checkpoint", s, s * TOK, s * SMP)
            t += 2.0
        ledger.section(t, 0, "data", s, s * TOK, s * SMP)
        ledger.section(t + 0.5, 0, "step", s, s * TOK, s * SMP)
        t += 1.5
    ledger.commit(t, 2)  # t == 18
    ledger.section(t, 0, "data", 4, 4 * TOK, 4 * SMP)  # step 3 done at 18
    ledger.failure(18.25, 18.0, "crash", "exit")  # the worker died 0.25 s after its last progress
    ledger.generation_ended(18.5, "failed")
    ledger.generation_started(19.0, 2, 1, 1, restart=True)
    ledger.section(19.0, 0, "restore", 2, 2 * TOK, 2 * SMP)
    ledger.section(21.0, 0, "step", 2, 2 * TOK, 2 * SMP)  # replay of 2 and 3
    ledger.section(22.0, 0, "data", 3, 3 * TOK, 3 * SMP)
    ledger.section(22.5, 0, "step", 3, 3 * TOK, 3 * SMP)
    ledger.section(23.5, 0, "step", 4, 4 * TOK, 4 * SMP)  # new again
    acct = ledger.account(24.5)
    assert_sums(acct)
    # step 0's data wait comes before the run's first step section: still init
    assert nonzero(acct) == {"init": 10.5, "data_wait": 2.0, "checkpoint_stall": 2.0, "productive": 5.0,
                             "failure_detection": 0.25, "recovery": 2.75, "replay": 2.0}
    inc = acct.incidents[0]
    assert (inc.detection_s, inc.recovery_s, inc.replay_s, inc.total_s) == (0.25, 2.75, 2.0, 5.0)
    assert (acct.committed_step, acct.committed_tokens) == (2, 2 * TOK)
    assert (acct.attempted_steps, acct.replayed_steps) == (6, 2)
    assert acct.step_histograms[0][2] == 6  # every completed step of rank 0, replays included


def test_degraded_world_two_of_three_and_slowdown_excess():
    ledger = started(world=2, full=3)
    t = steps(ledger, 10.0, 0, 4, dt=1.5, ranks=2)  # 1.5 s steps against a 1 s ideal
    acct = ledger.account(t - 1.5)  # four complete steps, the fifth just entered
    assert acct.seconds["productive"] == pytest.approx(4 * 2 / 3)
    assert acct.seconds["degraded"] == pytest.approx(4 * 1 / 3)
    assert acct.seconds["slowdown_excess"] == pytest.approx(4 * 0.5)
    assert acct.ideal_source == "user" and acct.ideal_step_s == 1.0
    assert_sums(acct)
    assert acct.attempted_tokens == 2 * 4 * TOK  # both ranks, summed
    assert sorted(acct.step_histograms) == [0, 1]


def test_a_slower_input_pipeline_costs_data_wait_not_slow_steps():
    """The cost the agent reads for a slowdown attributed to data (``ledger_cost``): all the wait of the slowdown's
    steps is ``data_wait``, its excess over the earlier wait included; the steps themselves stay productive."""
    from resilient.agent.slowness import ledger_cost

    ledger = started()
    t = 10.0

    def step(s: int, wait: float) -> None:  # wait for the batch, then one ideal (1 s) step
        nonlocal t
        ledger.section(t, 0, "data", s, s * TOK, s * SMP)
        ledger.section(t + wait, 0, "step", s, s * TOK, s * SMP)
        t += wait + 1.0

    for s in range(5):
        step(s, 0.25)
    before = dict(ledger.account(t).seconds)  # the slowdown begins: each batch now takes 1 s more
    for s in range(5, 15):
        step(s, 1.25)
    ledger.section(t, 0, "data", 15, 15 * TOK, 15 * SMP)  # step 14 done
    cost = ledger_cost(before, dict(ledger.account(t).seconds), {"section": "data", "rank": None})
    excess, usual = 10 * 1.0, 10 * 0.25  # above the earlier wait, and the earlier wait itself
    assert cost == {"ledger_s": {"productive": 10.0, "data_wait": excess + usual}, "ledger_category": "data_wait",
                    "ledger_cost_s": excess + usual}


def test_measured_ideal_median_plus_3_mad_rule():
    # median 1, MAD 0.25, bound 1.75: 5.0 is dropped, the mean of the rest is 1.0
    assert measured_ideal([1.0, 1.25, 0.75, 1.0, 5.0]) == 1.0
    assert measured_ideal([1.0, 2.0], min_steps=3) is None
    assert measured_ideal([2.0, 2.0, 2.0, 2.0, 2.0, 2.5]) == 2.0  # MAD 0: only steps at the median count


def test_measured_ideal_drives_excess():
    ledger = started(LedgerConfig(min_steps_for_ideal=5))
    t = 10.0
    for s, d in enumerate([1.0, 1.25, 0.75, 1.0, 5.0]):
        ledger.section(t, 0, "step", s, 0, 0)
        t += d
    acct = ledger.account(t)
    assert acct.ideal_step_s is None and acct.ideal_source is None  # step 4 is still running
    ledger.section(t, 0, "step", 5, 0, 0)  # t == 19: step 4 (5 s) done, the ideal is measured
    acct = ledger.account(t)
    assert (acct.ideal_step_s, acct.ideal_source) == (1.0, "measured")
    assert nonzero(acct) == {"init": 10.0, "productive": 9.0}  # before an ideal, step time is productive
    ledger.section(t + 3.0, 0, "step", 6, 0, 0)  # a 3 s step against the 1 s ideal
    acct = ledger.account(t + 3.0)
    assert nonzero(acct) == {"init": 10.0, "productive": 10.0, "slowdown_excess": 2.0}


def test_user_sections_add_to_the_step():
    ledger = started()
    ledger.section(10.0, 0, "step", 0, 0, 0)
    ledger.section(10.5, 0, "eval", 0, 0, 0)  # the user's own section inside step 0
    ledger.section(12.0, 0, "step", 1, TOK, SMP)
    acct = ledger.account(12.0)
    assert nonzero(acct) == {"init": 10.0, "productive": 1.0, "slowdown_excess": 1.0}
    assert acct.step_histograms[0] == (tuple(1 if b == 2.5 else 0 for b in (*STEP_BUCKETS, float("inf"))), 2.0, 1)


def test_gaps_between_generations_agent_restart_and_finish():
    ledger = started()
    t = steps(ledger, 10.0, 0, 2)  # step 2 entered at 12
    ledger.section(t, 0, "checkpoint", 3, 3 * TOK, 3 * SMP)
    ledger.generation_ended(14.0, "succeeded")  # graceful: the gap after it is idle
    ledger.agent_started(20.0)  # an agent restart: the outage is idle too
    ledger.generation_started(22.0, 2, 1, 1, restart=False)  # a later generation still recovers
    ledger.section(22.0, 0, "restore", 3, 3 * TOK, 3 * SMP)
    ledger.section(23.0, 0, "step", 3, 3 * TOK, 3 * SMP)
    ledger.finished(24.0)
    acct = ledger.account(30.0)
    assert nonzero(acct) == {"init": 10.0, "productive": 4.0, "checkpoint_stall": 1.0, "idle": 12.0,
                             "recovery": 3.0}
    assert acct.attempted_steps == 3  # step 2 ended by the checkpoint section; step 3 never completed
    assert acct.replayed_steps == 0


def test_membership_change_is_recovery_and_steps_continue():
    ledger = started(world=3, full=3)
    steps(ledger, 10.0, 0, 2, ranks=3)
    ledger.generation_ended(13.0, "membership")
    ledger.generation_started(14.0, 2, 2, 3, restart=True)
    for r in (1, 0):  # the lead is the lowest rank, whichever reports first
        ledger.section(14.0, r, "init", 3, 3 * TOK, 3 * SMP)
    steps(ledger, 15.0, 3, 4, ranks=2)
    acct = ledger.account(16.0)
    assert acct.seconds["recovery"] == 2.0
    assert acct.seconds["productive"] == pytest.approx(3.0 + 2 / 3)
    assert acct.seconds["degraded"] == pytest.approx(1 / 3)
    assert acct.replayed_steps == 0 and acct.attempted_steps == 3  # step 2 was cut short by the change
    assert acct.world_size == 2 and acct.full_world_size == 3


def test_committed_tokens_change_only_on_commit():
    ledger = started(world=2, full=2)
    steps(ledger, 10.0, 0, 6, ranks=2)
    assert ledger.account(17.0).committed_tokens == 0
    ledger.commit(17.0, 5)
    acct = ledger.account(17.0)
    assert (acct.committed_step, acct.committed_tokens, acct.committed_samples) == (5, 2 * 5 * TOK, 2 * 5 * SMP)
    ledger.commit(18.0, 3)  # older than the newest: ignored
    assert ledger.account(18.0).committed_step == 5
    assert all(s > 5 for s in ledger.tokens_at)  # committed steps' counters are dropped


def test_out_of_order_events_are_clamped_and_counted():
    ledger = started()
    steps(ledger, 10.0, 0, 3)
    ledger.section(11.5, 0, "data", 4, 4 * TOK, 4 * SMP)  # earlier than the last event (13)
    ledger.commit(12.0, 2)
    acct = ledger.account(5.0)  # an earlier now reads as the last event
    assert ledger.clamped_events == 2 and acct.clamped_events == 2
    assert acct.now == 13.0 and acct.wall_s == 13.0
    assert_sums(acct)


def test_failure_before_generation_start_is_clamped_to_it():
    ledger = started()
    steps(ledger, 10.0, 0, 1)
    ledger.failure(12.0, 11.0, "a", "exit")
    ledger.generation_ended(12.0, "failed")
    ledger.generation_started(13.0, 2, 1, 1, restart=True)
    ledger.failure(20.0, 5.0, "b", "hang")  # never stepped; last progress reported before the spawn
    acct = ledger.account(20.0)
    a, b = acct.incidents
    assert (a.detection_s, a.recovery_s, a.open) == (1.0, 1.0, False)  # a's recovery ends where b's cost starts
    assert (b.started_t, b.detection_s) == (13.0, 7.0)
    assert nonzero(acct) == {"init": 10.0, "productive": 1.0, "failure_detection": 8.0, "recovery": 1.0}


def test_timeline_coarsening_keeps_sums():
    ledger = started(LedgerConfig(ideal_step_s=1.0, timeline_max_buckets=4))
    t = steps(ledger, 10.0, 0, 20, dt=1.25)  # 36 s of run in at most 4 buckets
    acct = ledger.account(t)
    widths = {b.t1 - b.t0 for b in acct.timeline}
    assert len(acct.timeline) <= 4 and widths == {16.0}
    for c in CATEGORIES:
        assert sum(b.seconds[c] for b in acct.timeline) == pytest.approx(acct.seconds[c], abs=1e-9)
    assert sum(b.steps for b in acct.timeline) == acct.attempted_steps == 20
    assert acct.timeline[0].t0 == 0.0


def test_window_ratios_cover_the_last_window_only():
    ledger = started(LedgerConfig(ideal_step_s=1.0, window_s=20.0))
    steps(ledger, 10.0, 0, 40)  # init 10 s, then 40 s of productive steps
    acct = ledger.account(50.0)
    assert acct.goodput_ratio == 40.0 / 50.0
    assert acct.window.wall_s == 20.0 and acct.window.goodput_ratio == 1.0 and acct.window.ettr == 1.0
    acct = ledger.account(60.0)  # 10 s more inside step 40: 1 s productive, 9 s excess
    assert acct.window.seconds["productive"] == 11.0 and acct.window.seconds["slowdown_excess"] == 9.0


def test_round_trip_through_json_continues_exactly():
    ledger = started()
    steps(ledger, 10.0, 0, 5)
    ledger.failure(16.5, 15.0, "x", "exit")
    copy = Ledger.from_dict(json.loads(json.dumps(ledger.to_dict())))
    for led in (ledger, copy):
        led.generation_ended(17.0, "failed")
        led.generation_started(18.0, 2, 1, 1, restart=True)
        steps(led, 19.0, 3, 7)
    assert copy.account(30.0) == ledger.account(30.0)
    assert copy.to_dict() == ledger.to_dict()


def test_bad_saved_state_and_config_errors():
    with pytest.raises(LedgerStateError, match="format"):
        Ledger.from_dict({"format": 99})
    bad = Ledger().to_dict()
    del bad["ranks"]
    with pytest.raises(LedgerStateError, match="damaged"):
        Ledger.from_dict(bad)
    with pytest.raises(ConfigError, match="ideal_step_s"):
        LedgerConfig(ideal_step_s=0.0)
    with pytest.raises(ConfigError, match="min_steps_for_ideal"):
        LedgerConfig(reservoir=4, min_steps_for_ideal=5)


def test_empty_ledger_account():
    acct = Ledger().account(100.0)
    assert acct.wall_s == 0.0 and acct.goodput_ratio == 0.0 and acct.timeline == ()


def test_metrics_package_imports_stay_light():
    import subprocess
    import sys

    code = ("import sys, resilient.metrics as m, resilient.metrics.ledger, resilient.metrics.mfu; m.Ledger; m.mfu; "
            "heavy = [n for n in ('torch', 'prometheus_client', 'matplotlib') if n in sys.modules]; "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_the_metrics_package_imports_no_higher_layer():
    """resilient.metrics sits below the agent, the CLI and the worker: it imports only itself and the basics
    (errors, events and their kinds, file helpers), which import nothing of the project.

    Read from the source (function-level imports included), not from
    sys.modules, so a lazy import on a rarely used path is caught too.
    """
    import ast
    from pathlib import Path

    import resilient.metrics

    allowed = {"resilient", "resilient.core.errors", "resilient.core.events", "resilient.core.fsutil", "resilient.core.lazy"}
    package = Path(resilient.metrics.__file__).parent
    found = []
    for path in sorted(package.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level == 0:
                    targets = [node.module or ""]
                else:  # relative to resilient.metrics (level 1) or resilient (level 2)
                    base = ["resilient", "metrics"][: 3 - node.level]
                    targets = [".".join([*base, node.module] if node.module else base)]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            for target in targets:
                inside = target == "resilient" or target.startswith("resilient.")
                if inside and not target.startswith("resilient.metrics") and target not in allowed:
                    found.append(f"{path.name}:{node.lineno} imports {target}")
    assert not found, found
    assert len(list(package.glob("*.py"))) >= 10
    for basic in ("errors", "events", "fsutil"):  # the basics stand on nothing of the project
        tree = ast.parse((package.parent / "core" / f"{basic}.py").read_text())
        inner = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and (n.level or
                 (n.module or "").startswith("resilient"))]
        assert not inner, f"{basic}.py imports the project at lines {inner}"


def test_an_outcome_outside_the_vocabulary_is_refused_not_counted_as_a_clean_end():
    ledger = started()
    with pytest.raises(ValueError, match="'stoped' is not a valid OutcomeKind"):
        ledger.generation_ended(5.0, "stoped")


def test_deferred_saves_are_counted_with_the_steps_they_were_late_and_move_no_time():
    ledger = started()
    t = steps(ledger, 10.0, 0, 10)
    before = ledger.account(t)
    ledger.save_deferred(t, due_step=4, step=7)  # due at 4, taken at 7
    ledger.save_deferred(t, due_step=8, step=10, slots=2)  # due at 8 and 9, taken at 10
    acct = ledger.account(t)
    assert (acct.saves_deferred, acct.deferred_steps) == (3, 5)
    assert acct.seconds == before.seconds
    restored = Ledger.from_dict(json.loads(json.dumps(ledger.to_dict())))
    assert (restored.account(t).saves_deferred, restored.account(t).deferred_steps) == (3, 5)
    # A ledger saved before deferred saves were counted still loads, with none counted.
    old = ledger.to_dict()
    del old["saves_deferred"], old["deferred_steps"]
    assert Ledger.from_dict(old).account(t).saves_deferred == 0


def test_deferred_saves_are_exported_and_reported():
    from resilient.metrics.exporter import NodeView, families
    from resilient.metrics.report import NodeReport, render

    ledger = started()
    t = steps(ledger, 10.0, 0, 5)
    ledger.save_deferred(t, due_step=2, step=5)
    acct = ledger.account(t)
    samples = {s.name: s.value for fam in families(NodeView(run_id="r", node="n", now=t, account=acct))
               for s in fam.samples}
    assert samples["resilient_checkpoint_saves_deferred_total"] == 1.0
    assert samples["resilient_checkpoint_deferred_steps_total"] == 3.0
    text = render([NodeReport("n", acct)], [])
    assert "checkpoints: 1 scheduled saves deferred (writer busy), taken 3 steps late in all" in text


def test_every_gauge_of_the_catalogue_is_exported_from_the_first_scrape_nan_until_known():
    """A run in its first seconds: no step, no commit, no baseline, no slowdown, no MFU.  Every gauge without
    per-rank labels is in the scrape already (NaN where nothing is known yet), so a panel or an alert rule finds
    it; what is known has its value."""
    import math

    from resilient.metrics.catalogue import METRICS
    from resilient.metrics.exporter import NodeView, families

    ledger = Ledger(LedgerConfig())  # no ideal step time given, none measured yet
    ledger.agent_started(0.0)
    view = NodeView(run_id="r", node="n", now=1.0, account=ledger.account(1.0), slowness={})
    exported: dict[str, list] = {}
    for fam in families(view):
        for s in fam.samples:
            exported.setdefault(s.name, []).append(s)
    per_rank = {"rank", "section"}
    for metric in METRICS:
        if metric.type != "gauge" or per_rank & set(metric.labels):
            continue
        assert metric.name in exported, f"{metric.name} is missing from the first scrape"
    value = {name: [s.value for s in samples] for name, samples in exported.items()}
    assert all(math.isnan(v) for v in value["resilient_baseline_step_seconds"])
    assert all(math.isnan(v) for v in value["resilient_slowdown_ratio"])
    assert len(value["resilient_goodput_ratio"]) == 2  # run and window
    assert value["resilient_slowdown_active"] == [0.0] and value["resilient_stall_threshold_seconds"] == [600.0]
    assert all(math.isnan(v) for v in value["resilient_checkpoint_age_seconds"]), "no commit yet"
