"""Property tests of the goodput ledger over random, plausible event sequences (hypothesis).

A small simulated job (lockstep ranks, lead rank 0, rollback to the last
commit on every restart) produces the events an agent would feed: agent
starts and restarts, generations with shrinking world sizes, per-rank
section streams, failures whose last progress lies in the past, commits,
graceful ends, late (out-of-order) events.  The simulation also knows which
steps are replays, so the tests check the ledger against it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from resilient.core.events import FAILURE_KINDS, OutcomeKind
from resilient.metrics.ledger import Ledger, LedgerConfig
from resilient.metrics.ledger_account import totals

TOK, SMP = 100, 8
CONFIGS = (
    LedgerConfig(),
    LedgerConfig(ideal_step_s=0.75, window_s=10.0),
    LedgerConfig(window_s=30.0, timeline_max_buckets=8, min_steps_for_ideal=2, reservoir=4),
)
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass
class Event:
    name: str
    args: tuple[Any, ...]
    lead_replaying: bool = False
    """The interval up to this event is lead-rank work on a replayed step (never productive)."""


@dataclass
class Sim:
    t: float
    full: int
    gen: int = 0
    running: bool = False
    world: int = 0
    step: int = 0
    started: bool = False  # the lead entered "step" in this generation
    hw: int = -1  # highest step the lead completed
    mark: int = -1  # hw when the generation started: steps <= mark are replays
    committed: int = -1
    lead_section: str = "init"
    lead_step: int = 0
    lead_stepped: bool = False
    new_steps: set[int] = field(default_factory=set)
    replays: int = 0
    events: list[Event] = field(default_factory=list)

    def emit(self, name: str, *args: Any) -> None:
        replaying = (self.running and self.started and self.lead_section not in ("data", "checkpoint", "init",
                                                                                 "restore")
                     and self.lead_step <= self.mark)
        self.events.append(Event(name, args, replaying))

    def section(self, rank: int, name: str, step: int) -> None:
        self.emit("section", self.t, rank, name, step, step * TOK, step * SMP)
        if rank != 0:
            return
        if step > self.lead_step and self.lead_stepped and self.started:
            if self.lead_step <= self.mark:
                self.replays += 1
            else:
                self.new_steps.add(self.lead_step)
                self.hw = max(self.hw, self.lead_step)
        if step != self.lead_step:
            self.lead_stepped = False
        self.lead_step, self.lead_section = step, name
        if name == "step":
            self.lead_stepped = self.started = True

    def end(self, outcome: str) -> None:
        if self.running and outcome == "succeeded" and self.started and self.lead_stepped:
            if self.lead_step <= self.mark:
                self.replays += 1
            else:
                self.new_steps.add(self.lead_step)
                self.hw = max(self.hw, self.lead_step)
        self.emit("generation_ended", self.t, outcome)
        self.running = False


@st.composite
def runs(draw: st.DrawFn, max_ops: int = 30) -> tuple[list[Event], float, Sim]:
    gap = st.one_of(st.just(0.0), st.floats(0.001, 3.0), st.sampled_from([0.25, 0.5, 1.0]))
    sim = Sim(t=draw(st.sampled_from([0.0, 1000.25, 1.7e9])), full=draw(st.integers(1, 3)))

    def tick(s: st.SearchStrategy[float] = gap) -> None:
        sim.t += draw(s)

    sim.emit("agent_started", sim.t)
    for _ in range(draw(st.integers(1, max_ops))):
        op = draw(st.sampled_from(["gen", "steps", "steps", "steps", "fail", "commit", "end", "agent", "late",
                                   "finish"]))
        if op == "gen" or (op == "steps" and not sim.running):
            if sim.running:
                tick()
                sim.end("membership")
            sim.gen += 1
            sim.world = draw(st.integers(1, sim.full)) if sim.gen > 1 else sim.full
            tick()
            sim.emit("generation_started", sim.t, sim.gen, sim.world, sim.full, sim.gen > 1)
            sim.running, sim.started, sim.mark = True, False, sim.hw
            sim.step = max(sim.committed, 0)
            sim.lead_step, sim.lead_section, sim.lead_stepped = 0, "init", False
            for r in range(sim.world):
                tick()
                sim.section(r, "init", 0)
                sim.section(r, "restore", sim.step)
        if op == "steps":
            for _ in range(draw(st.integers(1, 6))):
                for r in range(sim.world):
                    if draw(st.booleans()):
                        sim.section(r, "data", sim.step)
                        tick()
                    sim.section(r, "step", sim.step)
                    tick()
                if draw(st.integers(0, 4)) == 0:
                    sim.section(0, "eval", sim.step)
                    tick()
                sim.step += 1
                if draw(st.integers(0, 3)) == 0:
                    for r in range(sim.world):
                        sim.section(r, "checkpoint", sim.step)
                    tick()
        elif op == "fail" and sim.running:
            tick()
            last_progress = sim.t - draw(st.floats(0.0, 20.0))
            sim.emit("failure", sim.t, last_progress, f"inc-{len(sim.events)}", draw(st.sampled_from(
                FAILURE_KINDS)))
            tick()
            sim.end("failed")
        elif op == "commit" and sim.running and sim.step > max(sim.committed, 0):
            sim.committed = draw(st.integers(max(sim.committed + 1, 0), sim.step))
            sim.emit("commit", sim.t, sim.committed)
        elif op == "end" and sim.running:
            tick()
            # every way a generation ends without a failure report (a failure is the "fail" op above)
            sim.end(draw(st.sampled_from([k.value for k in OutcomeKind if k is not OutcomeKind.FAILED])))
        elif op == "agent":
            tick(st.floats(0.0, 30.0))
            sim.emit("agent_started", sim.t)
            sim.running = False
        elif op == "late":  # an event stamped before the previous one: clamped
            late = sim.t - draw(st.floats(0.001, 5.0))
            if sim.running:
                sim.emit("section", late, 0, sim.lead_section, sim.lead_step, sim.lead_step * TOK,
                         sim.lead_step * SMP)
            elif sim.committed >= 0:
                sim.emit("commit", late, sim.committed)  # not newer: changes nothing but the clock check
        elif op == "finish":
            tick()
            if sim.running:
                sim.end("succeeded")
            sim.emit("finished", sim.t)
    return sim.events, sim.t + draw(st.floats(0.0, 100.0)), sim


def feed(ledger: Ledger, events: list[Event]) -> None:
    for e in events:
        getattr(ledger, e.name)(*e.args)


def check_sums(ledger: Ledger, now: float) -> None:
    """The invariants, on the raw sums (nothing clamped) and on the account built from them.

    Float rounding is allowed to the same relative 1e-9 of wall time as the
    sum; a real accounting error (time counted twice, re-labelled from the
    wrong category, a window reading outside the run) is seconds, not ulps.
    """
    raw = totals(ledger, now, ledger.open_pieces(now))
    tol = 1e-9 * max(raw.wall_s, 1.0)
    assert abs(math.fsum(raw.seconds) - raw.wall_s) <= tol, (raw.seconds, raw.wall_s)
    assert min(raw.seconds) >= -tol, raw.seconds
    assert abs(math.fsum(raw.window_seconds) - raw.window_wall_s) <= tol, (raw.window_seconds, raw.window_wall_s)
    assert abs(raw.window_wall_s - min(raw.wall_s, ledger.config.window_s)) <= tol, raw
    for run_s, window_s in zip(raw.seconds, raw.window_seconds):
        assert -tol <= window_s <= run_s + tol, (raw.seconds, raw.window_seconds)  # the window is part of the run
    new_steps = ledger.attempted_steps - ledger.replayed_steps
    assert -1e-9 <= raw.window_new_steps <= new_steps + 1e-9, (raw.window_new_steps, new_steps)
    eps = 1e-9
    for window in (False, True):
        assert -eps <= raw.goodput(window) <= 1.0 + eps, raw
        assert -eps <= raw.ettr(window) <= 1.0 + eps, raw
        assert raw.goodput(window) <= raw.ettr(window) + eps, raw  # productive time is never lost time
    acct = ledger.account(now)
    assert acct.wall_s == raw.wall_s and acct.window.wall_s == raw.window_wall_s
    assert list(acct.seconds.values()) == [max(0.0, x) for x in raw.seconds]
    assert (acct.goodput_ratio, acct.ettr) == (min(1.0, max(0.0, raw.goodput())), min(1.0, max(0.0, raw.ettr())))


@SETTINGS
@given(run=runs(), config=st.sampled_from(CONFIGS), later=st.floats(0.0, 1e4))
def test_categories_sum_to_wall_time_at_every_prefix(run, config, later):
    events, now, _ = run
    ledger = Ledger(config)
    for e in events:
        getattr(ledger, e.name)(*e.args)
        check_sums(ledger, ledger.last_t)
    check_sums(ledger, now)
    check_sums(ledger, now + later)
    assert ledger.account(now).wall_s == now - events[0].args[0]


@SETTINGS
@given(run=runs(), config=st.sampled_from(CONFIGS))
def test_replayed_work_is_never_progress(run, config):
    events, now, sim = run
    ledger = Ledger(config)
    before = ledger.account(0.0)
    for e in events:
        getattr(ledger, e.name)(*e.args)
        after = ledger.account(ledger.last_t)
        if e.name != "commit":
            assert (after.committed_step, after.committed_tokens, after.committed_samples) == (
                before.committed_step, before.committed_tokens, before.committed_samples)
        if e.lead_replaying and e.name not in ("failure", "agent_started"):
            for cat in ("productive", "degraded", "slowdown_excess"):
                assert after.seconds[cat] == before.seconds[cat], (cat, e)
            assert after.seconds["replay"] >= before.seconds["replay"]
        assert after.replayed_steps <= after.attempted_steps
        before = after
    acct = ledger.account(now)
    assert acct.replayed_steps == sim.replays
    assert acct.attempted_steps - acct.replayed_steps == len(sim.new_steps)
    assert acct.committed_step == (sim.committed if sim.committed >= 0 else None)


@SETTINGS
@given(run=runs(), config=st.sampled_from(CONFIGS), cuts=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=3))
def test_account_is_identical_after_a_restart_midway(run, config, cuts):
    events, now, _ = run
    straight = Ledger(config)
    feed(straight, events)
    expected = straight.account(now)
    for frac in cuts:
        cut = int(frac * len(events))
        first = Ledger(config)
        feed(first, events[:cut])
        resumed = Ledger.from_dict(json.loads(json.dumps(first.to_dict())))
        feed(resumed, events[cut:])
        assert resumed.account(now) == expected
        assert resumed.to_dict() == straight.to_dict()


def _width(acct: Any) -> float:
    return acct.timeline[-1].t1 - acct.timeline[-1].t0 if acct.timeline else 0.0


@SETTINGS
@given(run=runs(max_ops=15), config=st.sampled_from((*CONFIGS[1:], LedgerConfig(window_s=50.0))),
       skip=st.integers(0, 5))
def test_window_ratios_cover_only_the_last_window(run, config, skip):
    """Whatever came before, a window filled by one kind of time reads as that kind only."""
    events, _, _ = run
    ledger = Ledger(config)
    feed(ledger, events)
    t = ledger.last_t
    ledger.finished(t)
    # Idle for a window and two bucket widths: the window (and the bucket straddling its start) is all idle.
    idle_end = t + config.window_s + 2 * max(_width(ledger.account(t)), config.timeline_bucket_s)
    acct = ledger.account(idle_end)
    if idle_end - t >= config.window_s + _width(acct):
        event("idle window checked")
        raw = totals(ledger, idle_end, ledger.open_pieces(idle_end))
        assert raw.goodput(window=True) == 0.0 and abs(raw.ettr(window=True)) <= 1e-9
        assert abs(acct.window.seconds["idle"] - config.window_s) <= 1e-9 * idle_end
    # Then a window and more of new 1 s steps against a 1 s ideal: the window is all productive.
    good = Ledger.from_dict(ledger.to_dict(), config=LedgerConfig(ideal_step_s=1.0, window_s=config.window_s,
                                                                  timeline_max_buckets=config.timeline_max_buckets))
    good.generation_started(idle_end, 99, 1, 1, restart=True)
    first = good.high_water + 1 + skip
    n = int(config.window_s + 2 * _width(acct)) + 4
    for i in range(n):
        good.section(idle_end + i, 0, "step", first + i, 0, 0)
    acct = good.account(idle_end + n - 1)
    if n - 1 >= config.window_s + _width(acct):
        event("productive window checked")
        raw = totals(good, idle_end + n - 1, good.open_pieces(idle_end + n - 1))
        assert abs(raw.goodput(window=True) - 1.0) <= 1e-9
        # One new step a second: the window holds window_s of them (its edges within a bucket and a step).
        assert abs(raw.window_new_steps - config.window_s) <= 1.0 + _width(acct), raw.window_new_steps
        assert acct.window.seconds["idle"] == 0.0
