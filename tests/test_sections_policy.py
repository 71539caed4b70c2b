"""Section timeouts: validation, calibration after warm-up, and the hang decision, on a fake clock."""

from __future__ import annotations

import pytest

from resilient.core.errors import ConfigError
from resilient.watchdog.sections import (
    RankView,
    SectionStats,
    SectionTimeouts,
    calibration_summary,
    decide_hang,
    explain_timeout,
    for_storage,
    observe,
    timeout_for,
)


def stats_of(section: str, *durations: float, stats: SectionStats | None = None) -> SectionStats:
    stats = stats or SectionStats()
    for d in durations:
        stats = observe(stats, section, d)
    return stats


def test_initial_then_calibrated_after_warmup() -> None:
    cfg = SectionTimeouts(warmup=5, factor=3.0, floor_s=1.0)
    stats = stats_of("step", 2.0, 2.67, 1.5, 2.1)
    assert timeout_for("step", stats, cfg) == (600.0, "initial")
    assert explain_timeout("step", stats, cfg) == "initial: 4 of 5 warm-up observations so far"
    stats = observe(stats, "step", 0.5)
    seconds, source = timeout_for("step", stats, cfg)
    assert source == "calibrated"
    assert seconds == pytest.approx(8.01)
    assert explain_timeout("step", stats, cfg) == "calibrated: max 2.67 s x 3 after 5 observations"


def test_calibration_never_below_floor_and_only_grows() -> None:
    cfg = SectionTimeouts(warmup=2, factor=3.0, floor_s=5.0)
    stats = stats_of("step", 0.05, 0.04)
    assert timeout_for("step", stats, cfg) == (5.0, "calibrated")
    assert "raised to the floor 5 s" in explain_timeout("step", stats, cfg)
    stats = stats_of("step", 4.0, 0.01, stats=stats)
    assert timeout_for("step", stats, cfg) == (12.0, "calibrated")


def test_saves_to_an_object_store_get_a_floor_that_outlasts_the_clients_retries() -> None:
    """Seen in the s3-outage drill: a save retrying against a store answering 503 was taken for a hang at 5 s."""
    cfg = SectionTimeouts(warmup=2, factor=3.0, floor_s=5.0)
    stats = stats_of("checkpoint", 0.05, 0.04, stats=stats_of("step", 0.05, 0.04))
    remote = for_storage(cfg, "s3://bucket/ckpt")
    assert timeout_for("checkpoint", stats, remote) == (90.0, "calibrated")
    assert "raised to the floor 90 s (the section's own)" in explain_timeout("checkpoint", stats, remote)
    assert timeout_for("step", stats, remote) == (5.0, "calibrated")  # only the saves
    assert for_storage(cfg, "/mnt/ckpt") is cfg and for_storage(cfg, None) is cfg  # a local disk: as configured
    told = SectionTimeouts(warmup=2, explicit={"checkpoint": 10.0})
    assert timeout_for("checkpoint", stats, for_storage(told, "s3://b/p")) == (10.0, "explicit")  # the user asked
    view = {0: RankView(section="checkpoint", step=20, entered_at=0.0, pid=1)}
    assert decide_hang(view, stats, cfg, now=30.0) is not None  # local: 30 s in a save is a hang
    assert decide_hang(view, stats, remote, now=30.0) is None  # on S3 it may be the client's backoff
    assert decide_hang(view, stats, remote, now=91.0) is not None


def test_explicit_overrides_calibration_and_unknown_sections_use_default() -> None:
    cfg = SectionTimeouts(explicit={"checkpoint": 42.0}, initial={"default": 100.0, "step": 50.0}, floor_s=1.0)
    stats = stats_of("checkpoint", *[1.0] * 10)
    assert timeout_for("checkpoint", stats, cfg) == (42.0, "explicit")
    assert timeout_for("eval", stats, cfg) == (100.0, "initial")
    assert timeout_for("step", stats, cfg) == (50.0, "initial")


def test_config_is_frozen_against_caller_mutation() -> None:
    explicit = {"step": 10.0}
    cfg = SectionTimeouts(explicit=explicit)
    explicit["step"] = -1.0
    assert cfg.explicit["step"] == 10.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"explicit": {"step": 0.0}}, "explicit['step']=0.0 must be a positive"),
        ({"initial": {"default": 600.0, "data": -1.0}}, "initial['data']=-1.0"),
        ({"initial": {"step": 600.0}}, "needs a 'default' entry"),
        ({"warmup": 0}, "warmup=0 must be >= 1"),
        ({"factor": 0.9}, "factor=0.9 must be >= 1"),
        ({"floor_s": 0.0}, "floor_s=0.0 must be a positive"),
        ({"floor_s": 30.0, "initial": {"default": 600.0, "data": 10.0}}, "floor_s=30.0 exceeds initial['data']=10.0"),
        ({"explicit": {"step": float("inf")}}, "must be a positive number"),
    ],
)
def test_invalid_configs_name_the_problem(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SectionTimeouts(**kwargs)  # type: ignore[arg-type]


def test_explicit_below_floor_is_allowed() -> None:
    assert timeout_for("step", SectionStats(), SectionTimeouts(explicit={"step": 0.5}, floor_s=5.0)).seconds == 0.5


def test_observe_rejects_negative_and_does_not_mutate() -> None:
    before = SectionStats()
    after = observe(before, "step", 1.0)
    assert before.get("step").count == 0 and after.get("step").count == 1
    with pytest.raises(ValueError):
        observe(after, "step", -0.1)


def test_no_hang_while_within_timeouts_and_exactly_at_timeout() -> None:
    cfg = SectionTimeouts(explicit={"step": 8.0})
    ranks = {0: RankView("step", 57, entered_at=100.0, pid=11), 1: RankView("data", 57, entered_at=99.0, pid=12)}
    assert decide_hang(ranks, SectionStats(), cfg, now=108.0) is None
    assert decide_hang({}, SectionStats(), cfg, now=1e9) is None


def test_a_hang_is_decided_at_the_first_check_past_the_timeout_with_the_overrun_it_saw() -> None:
    """The agent asks once per monitor interval: no check up to the timeout decides, the first one after it does,
    and the overrun it reports is what that check saw (less than one interval)."""
    cfg = SectionTimeouts(explicit={"step": 4.0})
    view = {1: RankView("step", 22, entered_at=10.0, pid=7)}
    checks = [10.0 + 0.25 * k for k in range(40)]  # every 0.25 s (exact in binary)
    decided = [now for now in checks if decide_hang(view, SectionStats(), cfg, now) is not None]
    assert decided[0] == 14.25  # 14.0 is exactly at the timeout: not yet
    assert decided == checks[checks.index(14.25):]  # and from then on at every check
    first = decide_hang(view, SectionStats(), cfg, now=14.25)
    assert first is not None and (first.rank, first.elapsed_s, first.timeout_s, first.overrun_s) == (1, 4.25, 4.0, 0.25)


def test_hang_names_the_most_overrun_rank_with_calibration_evidence() -> None:
    cfg = SectionTimeouts(warmup=5, factor=3.0, floor_s=1.0)
    stats = stats_of("step", 1.0, 2.67, 2.0, 1.2, 1.1)
    ranks = {
        0: RankView("step", 57, entered_at=100.0, pid=11),  # 10.0 s in: overrun ~2 s
        1: RankView("step", 57, entered_at=97.6, pid=12),  # 12.4 s in: overrun ~4.4 s
        2: RankView("data", 58, entered_at=109.0, pid=13),  # 1 s into data, initial 600 s
    }
    decision = decide_hang(ranks, stats, cfg, now=110.0)
    assert decision is not None
    assert (decision.rank, decision.pid, decision.section, decision.step) == (1, 12, "step", 57)
    assert decision.source == "calibrated"
    assert decision.timeout_s == pytest.approx(8.01)
    assert decision.overrun_s == pytest.approx(12.4 - 8.01)
    assert decision.also_overrun == (0,)
    assert decision.reason == (
        "rank 1 has been in section 'step' (step 57) for 12.4 s; timeout 8.0 s "
        "(calibrated: max 2.67 s x 3 after 5 observations); also past their timeouts: rank 0"
    )


def test_hang_before_calibration_and_ties_go_to_lowest_rank() -> None:
    cfg = SectionTimeouts(initial={"default": 30.0, "init": 60.0}, floor_s=1.0)
    ranks = {3: RankView("init", 0, entered_at=0.0, pid=3), 2: RankView("init", 0, entered_at=0.0, pid=2)}
    decision = decide_hang(ranks, SectionStats(), cfg, now=61.0)
    assert decision is not None and decision.rank == 2 and decision.also_overrun == (3,)
    assert decision.reason.startswith("rank 2 has been in section 'init' (step 0) for 61.0 s; timeout 60.0 s (initial")


def test_calibration_summary_orders_runtime_sections_first() -> None:
    cfg = SectionTimeouts(explicit={"eval": 120.0}, warmup=1, floor_s=1.0)
    stats = stats_of("step", 0.5)
    stats = stats_of("zz_user", 0.1, stats=stats)
    rows = calibration_summary(stats, cfg)
    assert [r.section for r in rows] == ["init", "restore", "data", "step", "checkpoint", "eval", "zz_user"]
    step = rows[3]
    assert (step.timeout_s, step.source, step.count, step.max_s) == (1.5, "calibrated", 1, 0.5)
    assert rows[5].detail == "explicit"
