"""Straggler and slowdown scoring: pure rules on made-up windows (the real-noise traces are in test_straggler_traces)."""

from __future__ import annotations

import math
import random

import pytest

from resilient.core.errors import ConfigError
from resilient.watchdog.cusum import Cusum, CusumRule, advance, noise
from resilient.watchdog.settings import apply, flatten, parse_value
from resilient.watchdog.slowdown import SlowdownConfig, SlowdownDetector
from resilient.watchdog.straggler import StragglerConfig, StragglerDetector
from resilient.watchdog.timing import RankWindow, parse_window


def windows(index: int, compute: dict[int, float], *, data: float = 0.002, comm: float = 0.001,
            checkpoint: float = 0.0) -> dict[int, RankWindow]:
    """One window of every rank: the slowest rank's compute sets everyone's step (the others wait in comm)."""
    slowest = max(compute.values())
    out = {}
    for rank, c in compute.items():
        sections = {"compute": c, "data": data, "comm": comm + slowest - c, "optimizer": 0.002}
        if checkpoint:
            sections["checkpoint"] = checkpoint
        out[rank] = RankWindow(rank=rank, window=index, steps=5, step_s=slowest + data + comm + 0.002 + checkpoint,
                               sections=sections, node=f"n{rank}")
    return out


RULE_ALONE = StragglerConfig(min_evidence_s=0.0)
"""The CUSUM rule's windows alone: these tests pin its latency in windows (the evidence floor has its own test)."""


def noisy(rng: random.Random, ranks: int = 3, base: float = 0.015, sd: float = 0.03) -> dict[int, float]:
    return {r: base * math.exp(rng.gauss(0.0, sd)) for r in range(ranks)}


# ------------------------------------------------------------------ cusum


def test_noise_ignores_a_level_shift_but_sees_the_spread():
    flat = [0.0, 0.1] * 10
    shifted = [0.0, 0.1] * 5 + [1.0, 1.1] * 5
    assert noise(shifted, 0.001) == pytest.approx(noise(flat, 0.001), rel=0.2)
    assert noise([0.0] * 10, 0.01) == 0.01  # the floor
    assert noise([0.0, 1.0], 0.01) == 0.01  # too short to say


def test_cusum_flags_only_after_consecutive_windows_and_clears_with_hysteresis():
    rule = CusumRule(decision=6.0, consecutive=3, clear_after=4)
    s = Cusum()
    s = advance(s, 0.5, 0.02, rule)  # one huge window: clipped to +4, and not 3 in a row
    assert not s.flagged and s.s == pytest.approx(4.0)
    s = advance(s, 0.0, 0.02, rule)  # back to normal: the run of slow windows is broken
    assert s.run == 0 and not s.flagged
    for _ in range(3):
        s = advance(s, 0.2, 0.02, rule)
    assert s.flagged
    for i in range(3):
        s = advance(s, 0.0, 0.02, rule)
        assert s.flagged, f"cleared after {i + 1} quiet windows, clear_after is 4"
    s = advance(s, 0.0, 0.02, rule)
    assert not s.flagged and s.s == 0.0


def test_the_reference_is_half_the_smallest_effect_on_a_quiet_machine():
    rule = CusumRule(min_effect=0.10)
    assert rule.reference(0.001) == pytest.approx(math.log(1.1) / 2)  # 0.5 sigma would be far below
    assert rule.reference(0.2) == pytest.approx(0.1)  # noisy: 0.5 sigma


@pytest.mark.parametrize("field,value", [("decision", 0), ("allowance", -1), ("consecutive", 0),
                                         ("clear_after", 1.5), ("min_effect", float("nan"))])
def test_cusum_rule_refuses_bad_values(field, value):
    with pytest.raises(ConfigError, match=field):
        CusumRule(**{field: value})


# ------------------------------------------------------------------ stragglers


def test_a_slow_rank_is_flagged_in_compute_with_its_numbers_and_cleared_when_it_recovers():
    rng = random.Random(3)
    det = StragglerDetector(RULE_ALONE)
    changes = []
    for w in range(120):
        compute = noisy(rng)
        if 40 <= w < 80:
            compute[2] *= 1.3
        changes += [(w, c) for c in det.observe(windows(w, compute))]
    assert [(c.kind, c.rank, c.section) for _, c in changes] == [("flagged", 2, "compute"), ("cleared", 2, "compute")]
    (flagged_at, flag), (cleared_at, clear) = changes
    assert 40 < flagged_at <= 44 and 80 < cleared_at <= 90
    assert flag.ratio == pytest.approx(1.3, rel=0.06) and flag.node == "n2"
    assert "rank 2 (node n2) is a straggler in compute" in flag.reason
    assert f"({(flag.ratio - 1) * 100:+.0f}%)" in flag.reason and f"{flag.rank_s * 1e3:.1f} ms" in flag.reason
    assert det.flagged() == [] and not any(s.flagged for s in det.scores())


def test_the_committing_rank_is_not_compared_in_checkpoint_and_the_others_are():
    """Seen in every S3 drill: rank 0 commits (manifest, fence, retention), 2.5x its peers' checkpoint time."""
    for slow, flagged in ((0, []), (1, [("flagged", 1, "checkpoint")])):
        rng = random.Random(5)
        det = StragglerDetector(RULE_ALONE)
        changes = []
        for w in range(60):
            ws = windows(w, noisy(rng), checkpoint=0.004)
            ckpt = ws[slow].sections["checkpoint"] * (2.5 if w >= 20 else 1.0) * math.exp(rng.gauss(0.0, 0.03))
            ws[slow] = RankWindow(rank=slow, window=w, steps=5, step_s=ws[slow].step_s + ckpt - 0.004,
                                  sections={**ws[slow].sections, "checkpoint": ckpt}, node=f"n{slow}")
            changes += det.observe(ws)
        assert [(c.kind, c.rank, c.section) for c in changes] == flagged, (slow, changes)
        assert not any(s.rank == 0 and s.section == "checkpoint" for s in det.scores())


def contended(index: int, rng: random.Random, *, extra: float, waited: float) -> dict[int, RankWindow]:
    """Rank 0's optimizer ``extra`` seconds slower per step; it also waited ``waited`` more for a CPU."""
    out = {}
    for rank in range(3):
        opt = 0.0027 * math.exp(rng.gauss(0.0, 0.05)) + (extra if rank == 0 else 0.0)
        out[rank] = RankWindow(rank=rank, window=index, steps=5, step_s=0.078,
                               sections={"compute": 0.015 * math.exp(rng.gauss(0.0, 0.02)), "optimizer": opt,
                                         "comm": 0.001}, node="n0", cpu_wait=0.0004 + (waited if rank == 0 else 0.0))
    return out


def test_a_rank_slower_only_by_waiting_for_a_cpu_is_flagged_only_when_that_persists():
    """Seen live: 3 ranks and the agent on 2 cores, rank 0's optimizer 2.4x its peers' for 15 steps.  The wait
    for a CPU explains the extra time, so 3 windows do not flag it; 12 windows in a row do, saying why."""
    def run(waited: float, slow: range) -> list[tuple[int, object]]:
        rng, det, found = random.Random(11), StragglerDetector(RULE_ALONE), []
        for w in range(60):
            found += [(w, c) for c in det.observe(contended(w, rng, extra=0.0045 if w in slow else 0.0,
                                                            waited=waited if w in slow else 0.0))]
        return found

    # The same extra time without the wait is the rank's own: flagged within a few windows.
    [(at, own)] = [(w, c) for w, c in run(0.0, range(20, 23)) if c.kind == "flagged"]
    assert own.rank == 0 and own.section == "optimizer" and 20 < at <= 23 and "waiting for a CPU" not in own.reason
    # Explained by the scheduler, for 3 windows: nothing.
    assert run(0.0036, range(20, 23)) == []
    # For 30 windows: flagged after 12 of them, with the wait in the reason and the change.
    [(at, flag)] = [(w, c) for w, c in run(0.0036, range(20, 50)) if c.kind == "flagged"]
    assert 20 + 12 <= at <= 20 + 15 and flag.cpu_wait_s == pytest.approx(0.0036, abs=2e-4)
    assert "3.6 ms per step more than its peers waiting for a CPU" in flag.reason
    # Waiting for a CPU that explains only part of the extra time does not hold the flag back.
    [(at, part)] = [(w, c) for w, c in run(0.0005, range(20, 30)) if c.kind == "flagged"]
    assert 20 < at <= 23 and "waiting for a CPU" in part.reason


def throttled(index: int, rng: random.Random, *, quota: bool) -> dict[int, RankWindow]:
    """Windows like those recorded under a CPU quota on this machine (3 ranks, 2 cores): every rank waits 0.4 to
    3.5 ms a step for a CPU; rank 1 under the quota 10 to 110 ms, its throttled time landing in compute in some
    windows and in the all-reduce (never scored) in others, so its compute series is slow one window in two, and
    then by what it waited."""
    out = {}
    for rank in range(3):
        wait = rng.uniform(0.0004, 0.0035)
        compute, comm, step = 0.024 * math.exp(rng.gauss(0.0, 0.03)), 0.004, 0.030
        if quota:
            step, comm = 0.14, 0.075
            if rank == 1:
                wait = rng.uniform(0.010, 0.110)
                if rng.random() < 0.5:  # the throttled time is the wait, and here it landed in compute
                    compute, comm = 0.024 + wait * rng.uniform(0.8, 1.0), 0.003
        out[rank] = RankWindow(rank=rank, window=index, steps=5, step_s=step,
                               sections={"compute": compute, "comm": comm, "optimizer": 0.0007}, node="n0",
                               cpu_wait=wait)
    return out


def test_a_rank_a_cpu_quota_throttles_is_flagged_by_its_wait_for_a_cpu_whatever_section_it_lands_in():
    """Seen in the cpu-quota-rank drill: the compute series of the throttled rank is slow in every other window,
    so no section's flag persisted for 12 windows in a row; its wait for a CPU did, and names it."""
    for seed in range(5):
        rng, det, found = random.Random(seed), StragglerDetector(RULE_ALONE), []
        for w in range(80):
            found += [(w, c) for c in det.observe(throttled(w, rng, quota=w >= 20))]
        flags = [(w, c) for w, c in found if c.kind == "flagged"]
        assert [(c.rank, c.section) for _, c in flags] == [(1, "cpu_wait")], (seed, flags)
        [(at, flag)] = flags
        assert 20 + 12 <= at <= 20 + 20, (seed, at)
        assert "rank 1 (node n0) is a straggler waiting for a CPU (cpu_wait)" in flag.reason
        assert "a CPU quota throttles it" in flag.reason and flag.ratio > 5
    # A healthy run whose ranks take turns waiting for a CPU: never flagged, over 2,000 windows.
    rng, det = random.Random(99), StragglerDetector(RULE_ALONE)
    assert [c for w in range(2000) for c in det.observe(throttled(w, rng, quota=False))] == []
    # The wait is scored only where every rank measured it.
    rng, det = random.Random(3), StragglerDetector(RULE_ALONE)
    for w in range(40):
        ws = throttled(w, rng, quota=w >= 10)
        ws[0] = RankWindow(rank=0, window=w, steps=5, step_s=ws[0].step_s, sections=ws[0].sections, node="n0")
        det.observe(ws)
    assert not any(s.section == "cpu_wait" for s in det.scores())


def test_waiting_in_communication_never_names_a_straggler():
    """The fast ranks wait for the slow one in comm: only the slow rank's compute is flagged, never their comm."""
    rng = random.Random(5)
    det = StragglerDetector(RULE_ALONE)
    seen = []
    for w in range(60):
        compute = noisy(rng)
        compute[0] *= 1.5 if w >= 20 else 1.0
        seen += det.observe(windows(w, compute))
    assert {(c.rank, c.section) for c in seen} == {(0, "compute")}


def test_two_ranks_are_told_apart_by_leaving_each_rank_out_of_its_own_reference():
    rng = random.Random(7)
    det = StragglerDetector(RULE_ALONE)
    seen = []
    for w in range(50):
        compute = noisy(rng, ranks=2)
        compute[1] *= 1.25 if w >= 15 else 1.0
        seen += det.observe(windows(w, compute))
    assert [(c.kind, c.rank) for c in seen] == [("flagged", 1)]


def test_a_rank_the_whole_job_waits_for_in_data_is_a_data_straggler():
    rng = random.Random(11)
    det = StragglerDetector(RULE_ALONE)
    seen = []
    for w in range(60):
        ws = windows(w, noisy(rng))
        if w >= 20:
            ws[1] = RankWindow(rank=1, window=w, steps=5, step_s=ws[1].step_s + 0.006,
                               sections={**ws[1].sections, "data": 0.008}, node="n1")
        seen += det.observe(ws)
    assert [(c.rank, c.section) for c in seen] == [(1, "data")]


def test_turning_the_detector_off_clears_standing_flags_and_stops_scoring():
    rng = random.Random(13)
    det = StragglerDetector(RULE_ALONE)
    for w in range(40):
        compute = noisy(rng)
        compute[1] *= 1.4 if w >= 10 else 1.0
        det.observe(windows(w, compute))
    assert det.flagged() == [(1, "compute")]
    cleared = det.reconfigure(StragglerConfig(enabled=False))
    assert [(c.kind, c.rank) for c in cleared] == [("cleared", 1)]
    compute = noisy(rng)
    compute[1] *= 2.0
    assert det.observe(windows(41, compute)) == [] and det.flagged() == []


def test_straggler_config_validates_its_windows():
    with pytest.raises(ConfigError, match="min_history"):
        StragglerConfig(min_history=2)
    with pytest.raises(ConfigError, match="noise_floor"):
        StragglerConfig(noise_floor=0)


# ------------------------------------------------------------------ slowdowns


def test_a_job_wide_data_slowdown_is_attributed_to_the_input_pipeline_and_costed():
    rng = random.Random(17)
    det = SlowdownDetector()
    seen = []
    for w in range(120):  # 4 windows of warm-up, 40 of baseline, then 30 windows 4 ms slower in data
        seen += [(w, c) for c in det.observe(windows(w, noisy(rng), data=0.002 if not 60 <= w < 90 else 0.006))]
    kinds = [(c.kind, w) for w, c in seen]
    assert [k for k, _ in kinds] == ["began", "ended"], kinds
    began, ended = seen[0][1], seen[1][1]
    assert 60 < seen[0][0] <= 64 and 90 < seen[1][0] <= 100
    assert began.attribution is not None and began.attribution.section == "data" and began.attribution.rank is None
    assert "input pipeline" in began.reason and began.ratio == pytest.approx(0.024 / 0.020, rel=0.06)
    # 30 slow windows of 5 steps, 4 ms each above the baseline: about 0.6 s.
    assert ended.excess_s == pytest.approx(30 * 5 * 0.004, rel=0.15)
    assert "cost" in ended.reason


def test_a_straggler_slows_the_job_and_the_slowdown_names_the_rank_not_the_network():
    rng = random.Random(19)
    det = SlowdownDetector()
    began = None
    for w in range(90):
        compute = noisy(rng)
        compute[2] *= 1.4 if w >= 50 else 1.0
        for c in det.observe(windows(w, compute)):
            began = began or c
    assert began is not None and began.attribution is not None
    assert (began.attribution.rank, began.attribution.section) == (2, "compute")
    assert "rank 2's compute" in began.reason


def test_a_network_slowdown_is_communication_on_every_rank():
    rng = random.Random(23)
    det = SlowdownDetector()
    began = None
    for w in range(90):
        for c in det.observe(windows(w, noisy(rng), comm=0.001 if w < 50 else 0.006)):
            began = began or c
    assert began is not None and began.attribution is not None
    assert (began.attribution.rank, began.attribution.section) == (None, "comm")


def test_a_longer_checkpoint_stall_is_storage():
    rng = random.Random(29)
    det = SlowdownDetector()
    began = None
    for w in range(90):
        for c in det.observe(windows(w, noisy(rng), checkpoint=0.0005 if w < 50 else 0.005)):
            began = began or c
    assert began is not None and began.attribution is not None and began.attribution.section == "checkpoint"
    assert "storage" in began.reason


def test_no_slowdown_on_a_steady_job_and_nothing_before_the_baseline():
    rng = random.Random(31)
    det = SlowdownDetector(SlowdownConfig(warmup_windows=2, baseline_windows=8))
    for w in range(10):
        assert det.observe(windows(w, noisy(rng))) == []
    assert det.baseline_s is not None and det.baseline_s == pytest.approx(0.020, rel=0.05)
    for w in range(10, 400):
        assert det.observe(windows(w, noisy(rng))) == [], w


# ------------------------------------------------------------------ settings and reports


def test_settings_are_read_and_changed_by_dotted_keys_and_validated_by_the_configs():
    configs = (StragglerConfig(), SlowdownConfig())
    flat = flatten(configs)
    assert flat["straggler.rule.decision"] == CusumRule().decision and flat["slowdown.enabled"] is True
    new = apply(configs, {"straggler.rule.decision": 12, "slowdown.enabled": False, "slowdown.baseline_windows": 10})
    assert new[0].rule.decision == 12 and new[1].enabled is False and new[1].baseline_windows == 10
    assert configs[0].rule.decision == CusumRule().decision  # the old ones are untouched
    with pytest.raises(ConfigError, match="unknown detector setting 'straggler.decision'.*straggler.rule.decision"):
        apply(configs, {"straggler.decision": 3})
    with pytest.raises(ConfigError, match="must be an int >= 1"):
        apply(configs, {"straggler.rule.consecutive": 0})
    with pytest.raises(ConfigError, match="expected an int"):
        apply(configs, {"straggler.history": 4.5})
    with pytest.raises(ConfigError, match="expected a bool"):
        apply(configs, {"slowdown.enabled": 1})
    assert parse_value("false") is False and parse_value("12") == 12 and parse_value("0.5") == 0.5


def test_a_malformed_timing_report_is_refused_with_the_field():
    with pytest.raises(ValueError, match="rank 3 is malformed.*'s'"):
        parse_window(3, "n0", {"w": 1, "n": 5, "step": 0.02})
    with pytest.raises(ValueError, match="negative or non-finite"):
        parse_window(3, "n0", {"w": 1, "n": 5, "step": float("nan"), "s": {}})
    w = parse_window(3, "n0", {"w": 1, "n": 5, "step": 0.02, "s": {"compute": 0.01}})
    assert w.sections["compute"] == 0.01 and w.node == "n0" and w.cpu_wait is None
    assert parse_window(3, "n0", {"w": 1, "n": 5, "step": 0.02, "s": {}, "cpu": 0.004}).cpu_wait == 0.004
    with pytest.raises(ValueError, match="negative or non-finite"):
        parse_window(3, "n0", {"w": 1, "n": 5, "step": 0.02, "s": {}, "cpu": -1})


def test_a_slowdowns_ledger_cost_is_read_in_the_category_its_cause_lands_in():
    from resilient.agent.slowness import ledger_cost

    before = {"productive": 10.0, "data_wait": 0.5, "slowdown_excess": 0.2, "checkpoint_stall": 1.0}
    after = {"productive": 20.0, "data_wait": 4.0, "slowdown_excess": 0.7, "checkpoint_stall": 1.0}
    data = ledger_cost(before, after, {"section": "data", "rank": None})
    assert data == {"ledger_s": {"productive": 10.0, "data_wait": 3.5, "slowdown_excess": 0.5},
                    "ledger_category": "data_wait", "ledger_cost_s": 3.5}
    straggler = ledger_cost(before, after, {"section": "compute", "rank": 1})
    assert straggler["ledger_category"] == "slowdown_excess" and straggler["ledger_cost_s"] == 0.5
    storage = ledger_cost(before, after, {"section": "checkpoint", "rank": None})
    assert storage["ledger_category"] == "checkpoint_stall" and storage["ledger_cost_s"] == 0.0
    assert ledger_cost(before, after, None)["ledger_category"] == "slowdown_excess"


def test_a_slow_rank_is_flagged_only_once_its_slow_windows_span_the_evidence_floor():
    """Seen live on 2 cores: a 12 ms step job, rank 1's compute +43% for 3 windows (0.2 s), a flag and an incident
    from what was the host's noise.  By default a flag needs its slow windows to span 3 s of training: a brief
    burst is watched, not flagged; a lasting one is flagged as soon as it has."""
    def run(slow: range, config: StragglerConfig) -> list[tuple[int, str]]:
        rng, det, found = random.Random(3), StragglerDetector(config), []
        for w in range(200):
            compute = noisy(rng)
            if w in slow:
                compute[1] *= 1.45
            found += [(w, c.kind) for c in det.observe(windows(w, compute))]
        return found

    window_s = 5 * (0.015 * 1.45 + 0.005)  # 5 steps of the slow rank's compute and the rest, which all ranks wait
    burst = range(40, 40 + 12)  # 1.5 s
    assert run(burst, RULE_ALONE)[:1] == [(42, "flagged")]  # what the rule alone would have raised
    assert run(burst, StragglerConfig()) == []
    lasting = range(40, 200)
    [(at, kind)] = run(lasting, StragglerConfig())
    floor = StragglerConfig().min_evidence_s
    assert kind == "flagged" and floor * 0.95 <= (at + 1 - 40) * window_s < floor + 2 * window_s, at
    with pytest.raises(ConfigError, match="min_evidence_s"):
        StragglerConfig(min_evidence_s=-1)
