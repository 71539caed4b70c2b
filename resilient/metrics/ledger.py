"""The goodput ledger: where every second of a node's wall time went.

One :class:`Ledger` per node agent, fed in time order with the node's wall
clock (never compared across hosts).  Pure and deterministic: no clock
reads, no I/O; every method takes its time ``t``.  :meth:`Ledger.to_dict`
and :meth:`Ledger.from_dict` save and restore the complete state (plain
JSON), so an agent that restarts continues the same account, float for
float.

Attribution (node level; exactly one category at a time):

- Before the run's first generation, and from its spawn to the first
  ``step`` section: ``init``.  Any later generation (``restart=True``, or
  after a failure, a membership change or an agent restart): from spawn to
  the first ``step`` section is ``recovery`` (init and restore of the new
  workers included).
- ``failure(t, last_progress_t)``: ``[last_progress_t, t]`` is re-labelled
  ``failure_detection`` (whatever it was first attributed to), then
  ``recovery`` until the first ``step`` section of a later generation;
  heartbeats of the failed generation no longer count.  ``last_progress_t``
  is clamped to the current generation's start and the previous failure
  (an incident never takes time from another), and to the oldest interval
  still kept (``max_relabel_segments``).
- A ``step`` section (or a user section) at a step index at or below the
  highest step completed before the last rollback (a failure, a new
  generation, or the step index going back): ``replay``; its steps and
  tokens count as replayed, never as progress.
- A new step: its time up to the ideal step time is ``productive``, beyond it
  ``slowdown_excess``; with ``world_size < full_world_size`` the productive
  part keeps ``world/full`` of it and the rest is ``degraded``.  The ideal
  is the one known when the step started; before one is known (user-set or
  ``min_steps_for_ideal`` measured) step time is all productive.  The
  measured ideal is recomputed on every new step while the reservoir holds
  fewer than 64 durations, then every ``len(reservoir) // 32`` new steps.
- ``data`` section: ``data_wait``; ``checkpoint``: ``checkpoint_stall``;
  ``init``/``restore`` after a generation's first step: ``recovery``; user
  sections: like a step (their time adds to the step's).
- Between ``generation_ended`` and the next ``generation_started``:
  ``recovery`` after an outcome ``failed`` or ``membership`` (or a reported
  failure), ``idle`` otherwise; after ``finished``: ``idle``.  A later
  ``agent_started`` marks the gap since the last event ``idle``.
- ``save_deferred``: a scheduled save was taken late (the writer was busy);
  it moves no time, only the counts of deferred saves and of steps they
  were late by (the extra steps a failure then could cost).
- ``resume_accepted``: a resume that was not where the saving run was went
  on because the run accepts it (``--resume-check accept``); it moves no
  time, only counts such resumes and keeps the earliest step from which the
  run differs from the one that saved.
- The lead rank (lowest rank seen in the generation) drives the timeline;
  every rank feeds its own step histogram; tokens are summed over ranks.

A step is complete when its rank next reports a higher step index (or the
generation ends ``succeeded``); its duration is its time in ``step`` and user
sections.  Committed tokens are the ranks' cumulative counters at the
committed step's boundary, remembered until committed; they change only in
:meth:`Ledger.commit`.

Out-of-order events (``t`` before the previous event) are clamped to the
previous event's time and counted in ``clamped_events``: the sum invariant
holds whatever the agent feeds.
"""

from __future__ import annotations

import bisect
from typing import Any

from ..core.events import OutcomeKind
from .catalogue import STEP_BUCKETS
from .ideal import measured_ideal, split_new_step_time
from .ledger_account import build_account
from .ledger_codec import (
    DETECTION,
    IDLE,
    INIT,
    RECOVERY,
    REPLAY,
    SECTION_CATEGORY,
    LedgerBooks,
    Phase,
    Piece,
    _Incident,
    _Rank,
    ledger_from_dict,
    ledger_to_dict,
)
from .ledger_state import Account, IncidentCost, LedgerConfig, WindowAccount
from .timeline import Timeline

__all__ = ["Account", "IncidentCost", "Ledger", "LedgerConfig", "WindowAccount"]

_TRAINING = (Phase.SPAWNING, Phase.RUNNING)


class Ledger(LedgerBooks):
    """A node's goodput account, fed by its agent (see the module docstring for the rules).

    Its fields are :class:`~.ledger_codec.LedgerBooks`'; the methods here are the events that write them.
    """

    # ------------------------------------------------------------------ events
    def agent_started(self, t: float) -> None:
        """An agent process starts: the run's start, or (later) the end of an agent outage (idle)."""
        t = float(t)
        if self.start_t is None:
            self._start(t)
            return
        t = self._clamp(t)
        self._record(self.last_t, t, IDLE)
        self.last_t = t
        self.phase, self.hold = Phase.WAITING, RECOVERY if self.generations_seen else INIT
        self.ranks, self.lead = {}, None

    def generation_started(self, t: float, generation: int, world_size: int, full_world_size: int,
                           restart: bool) -> None:
        """Workers of ``generation`` were spawned (``restart``: after a failure or membership change)."""
        t = self._begin(t)
        recovering = restart or self.generations_seen > 0
        self.generations_seen += 1
        self.generation, self.world_size = generation, world_size
        self.full_world_size = max(full_world_size, world_size)
        self.ranks, self.lead = {}, None
        self.lead_step, self.lead_section, self.lead_work, self.lead_stepped = 0, "init", 0.0, False
        self.replay_mark = max(self.replay_mark, self.high_water)
        self.phase, self.hold = Phase.SPAWNING, RECOVERY if recovering else INIT
        self.segments.clear()
        self.floor = t

    def section(self, t: float, rank: int, section: str, step: int, tokens: int = 0, samples: int = 0) -> None:
        """Heartbeat: ``rank`` entered ``section`` at step index ``step`` with these cumulative counters."""
        t = self._begin(t)
        if self.phase not in _TRAINING:
            return  # no generation, or a failed one: its heartbeats tell nothing new
        r = self.ranks.get(rank)
        if r is None:
            r = self.ranks[rank] = _Rank(section, step, t, 0.0, False, tokens, samples)
            self._boundary(step, rank, tokens, samples)
        else:
            if r.section not in SECTION_CATEGORY:
                r.work += t - r.since
            if step != r.step:
                if step < r.step:
                    self.replay_mark = max(self.replay_mark, self.high_water)  # rolled back in place
                elif r.stepped:
                    self._rank_step_done(rank, r, tokens)
                r.step, r.work, r.stepped, r.tok0, r.smp0 = step, 0.0, False, tokens, samples
                self._boundary(step, rank, tokens, samples)
            r.section, r.since = section, t
        if section == "step":
            r.stepped = True
        lead = self.lead
        if lead is None or rank < lead:
            self.lead = rank
            self.lead_step = step  # a new lead: not a rollback, whatever its index
            self._lead_enters(step)
        elif rank != lead:
            return
        elif step != self.lead_step:
            if step > self.lead_step and self.lead_stepped and self.phase is Phase.RUNNING:
                self._step_done(t)
            self._lead_enters(step)
        self.lead_section = section
        if section == "step":
            self.lead_stepped = True
            if self.phase is Phase.SPAWNING:
                self._first_step(t, step)

    def commit(self, t: float, step: int) -> None:
        """A newer committed checkpoint (after ``step`` updates) was seen."""
        t = self._begin(t)
        if step < 0 or (self.committed_step is not None and step <= self.committed_step):
            return
        self.committed_step, self.last_commit_t = step, t
        counters = self.tokens_at.get(step)
        if counters:
            self.committed_tokens = sum(c[0] for c in counters.values())
            self.committed_samples = sum(c[1] for c in counters.values())
        self.tokens_at = {s: c for s, c in self.tokens_at.items() if s > step}

    def save_deferred(self, t: float, due_step: int, step: int, slots: int = 1) -> None:
        """The save due at ``due_step`` (and ``slots - 1`` later due steps) was taken at ``step``."""
        self._begin(t)
        self.saves_deferred += max(1, slots)
        self.deferred_steps += max(0, step - due_step)

    def resume_accepted(self, t: float, step: int) -> None:
        """A rank resumed at ``step`` elsewhere than the saving run was there, and the run accepted it."""
        self._begin(t)
        self.resumes_diverged += 1
        if self.diverged_from_step is None or step < self.diverged_from_step:
            self.diverged_from_step = step

    def failure(self, t: float, last_progress_t: float, incident_id: str, kind: str) -> None:
        """A failure detected at ``t``; the failing rank last made progress at ``last_progress_t``."""
        t = self._begin(t)
        floor = self.floor
        if self.segments and len(self.segments) == self.segments.maxlen:
            floor = max(floor, self.segments[0][0])
        a = min(max(last_progress_t, floor), t)
        prev = self.incidents[-1] if self.incidents else None
        self._relabel(a, t, prev)
        if prev is not None and prev.state != "closed":
            if prev.state == "recovering":
                prev.recovered_t = a
            prev.state = "closed"
        self.incidents.append(_Incident(incident_id, kind, a, t, None, 0.0, self.high_water, "recovering"))
        self.replay_mark = max(self.replay_mark, self.high_water)
        self.phase, self.hold = Phase.RECOVERING, RECOVERY
        self.segments.clear()
        self.floor = t

    def generation_ended(self, t: float, outcome: OutcomeKind | str) -> None:
        """All workers of the generation stopped (``succeeded``, ``failed``, ``membership``, ...).

        Raises ValueError for a string that names no :class:`~resilient.core.events.OutcomeKind`.
        """
        kind = OutcomeKind(outcome)
        t = self._begin(t)
        if self.phase is Phase.RUNNING and kind is OutcomeKind.SUCCEEDED:
            for rank, r in self.ranks.items():  # the last step of each rank is complete
                if r.stepped:
                    if r.section not in SECTION_CATEGORY:
                        r.work += t - r.since
                    self._rank_step_done(rank, r, r.tok0)
            if self.lead_stepped:
                self._step_done(t)
        failed = self.phase is Phase.RECOVERING or kind.restarts_workers
        self.phase, self.hold = Phase.BETWEEN, RECOVERY if failed else IDLE
        self.ranks, self.lead = {}, None

    def finished(self, t: float) -> None:
        """The run ended on this node; later time is idle."""
        t = self._begin(t)
        self.phase, self.hold = Phase.FINISHED, IDLE
        for inc in self.incidents:
            if inc.state == "recovering":
                inc.recovered_t = t
            inc.state = "closed"

    def freeze_ideal(self, t: float, frozen: bool) -> None:
        """Hold the measured ideal (``frozen``) while the agent sees a slowdown, or let it follow the steps again.

        The ideal is measured from recent steps, so a lasting slowdown would
        become the new ideal and its cost would vanish from
        ``slowdown_excess``; held, the slow steps are not folded in and their
        time beyond the pre-slowdown ideal stays excess.
        """
        del t  # no time moves: only how later steps are measured changes
        self.ideal_frozen = int(frozen)

    # ------------------------------------------------------------------ reading
    def account(self, now: float) -> Account:
        """The account as of ``now`` (>= the last event; earlier is read as the last event). Pure."""
        return build_account(self, now, self.open_pieces(now), self.ideal())

    def open_pieces(self, now: float) -> list[Piece]:
        """The interval since the last event up to ``now``, attributed as the next event would. Pure."""
        if now <= self.last_t or self.start_t is None:
            return []
        return self.pieces(self.last_t, now)[0]

    def ideal(self) -> tuple[float | None, str | None]:
        """The ideal step time now and where it comes from ("user", "measured" or None)."""
        if self.config.ideal_step_s is not None:
            return self.config.ideal_step_s, "user"
        return (self.measured, "measured") if self.measured is not None else (None, None)

    def to_dict(self) -> dict[str, Any]:
        """The complete state as plain JSON types; :meth:`from_dict` continues from it exactly."""
        return ledger_to_dict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, config: LedgerConfig | None = None) -> Ledger:
        """A ledger continuing from :meth:`to_dict`'s output (with its saved config unless one is given)."""
        return ledger_from_dict(cls, d, config)

    # ------------------------------------------------------------------ internals
    def _start(self, t: float) -> None:
        self.start_t = self.last_t = self.floor = t
        self.timeline = Timeline(t, self.config.timeline_bucket_s, self.config.timeline_max_buckets)

    def _clamp(self, t: float) -> float:
        if t < self.last_t:
            self.clamped_events += 1
            return self.last_t
        return t

    def _begin(self, t: float) -> float:
        """Common prologue of an event: start the run if needed, clamp ``t``, attribute up to it."""
        t = float(t)
        if self.start_t is None:
            self._start(t)
            return t
        t = self._clamp(t)
        if t > self.last_t:
            pieces, work = self.pieces(self.last_t, t)
            for t0, t1, cat in pieces:
                self._record(t0, t1, cat)
            self.lead_work += work
            self.last_t = t
        return t

    def pieces(self, a: float, b: float) -> tuple[list[Piece], float]:
        """How ``[a, b]`` (after the last event) is attributed in the current state; and its step work. Pure."""
        if self.phase is not Phase.RUNNING:
            return [(a, b, self.hold)], 0.0
        cat = SECTION_CATEGORY.get(self.lead_section)
        if cat is not None:
            return [(a, b, cat)], 0.0
        dt = b - a
        if self.lead_step <= self.replay_mark:
            return [(a, b, REPLAY)], dt
        return split_new_step_time(a, b, ideal=self.lead_ideal, work=self.lead_work, world_size=self.world_size,
                                   full_world_size=self.full_world_size), dt

    def _record(self, t0: float, t1: float, cat: int) -> None:
        d = t1 - t0
        if d <= 0:
            return
        self.seconds[cat] += d
        self.timeline.add(t0, t1, cat)
        segments = self.segments
        if segments and segments[-1][2] == cat and segments[-1][1] == t0:
            segments[-1][1] = t1
        else:
            segments.append([t0, t1, cat])
        if cat == REPLAY and self.incidents and self.incidents[-1].state == "replaying":
            self.incidents[-1].replay_s += d

    def _relabel(self, a: float, t: float, prev: _Incident | None) -> None:
        """Move ``[a, t]`` to failure detection, from whatever it was attributed to."""
        for s0, s1, cat in self.segments:
            lo, hi = max(s0, a), min(s1, t)
            if hi <= lo or cat == DETECTION:
                continue
            d = hi - lo
            self.seconds[cat] -= d
            self.seconds[DETECTION] += d
            self.timeline.move(lo, hi, cat, DETECTION)
            if cat == REPLAY and prev is not None and prev.state == "replaying":
                prev.replay_s = max(0.0, prev.replay_s - d)

    def _lead_enters(self, step: int) -> None:
        """The lead rank starts step index ``step``."""
        if step < self.lead_step:
            self.replay_mark = max(self.replay_mark, self.high_water)
        self.lead_step, self.lead_work, self.lead_stepped = step, 0.0, False
        self.lead_ideal = self.ideal()[0]
        inc = self.incidents[-1] if self.incidents else None
        if inc is not None and inc.state == "replaying" and step > inc.mark:
            inc.state = "closed"  # past the pre-failure high-water mark: the lost work is re-done

    def _first_step(self, t: float, step: int) -> None:
        """The generation's first ``step`` section: recovery (or init) ends."""
        self.phase = Phase.RUNNING
        self.lead_work = 0.0
        inc = self.incidents[-1] if self.incidents else None
        if inc is not None and inc.state == "recovering":
            inc.recovered_t = t
            inc.state = "replaying" if step <= inc.mark else "closed"

    def _step_done(self, t: float) -> None:
        """The lead rank completed step ``lead_step``."""
        step, work = self.lead_step, self.lead_work
        self.attempted_steps += 1
        self.timeline.add_step(t, work, new=step > self.replay_mark)
        if step <= self.replay_mark:
            self.replayed_steps += 1
            return
        self.high_water = max(self.high_water, step)
        self.last_progress_t = t
        if self.ideal_frozen:
            return
        self.reservoir.append(work)
        # Recomputing costs O(reservoir): do it on every new step while few are known, then on every
        # (reservoir / 32)-th, so a full 512-step reservoir costs about 32 elements per step.
        if self.config.ideal_step_s is None and (
                self.attempted_steps - self.replayed_steps) % max(1, len(self.reservoir) // 32) == 0:
            self.measured = measured_ideal(self.reservoir, self.config.min_steps_for_ideal)

    def _rank_step_done(self, rank: int, r: _Rank, tokens: int) -> None:
        hist = self.histograms.get(rank)
        if hist is None:
            hist = self.histograms[rank] = [[0] * (len(STEP_BUCKETS) + 1), 0.0, 0]
        hist[0][bisect.bisect_left(STEP_BUCKETS, r.work)] += 1
        hist[1] += r.work
        hist[2] += 1
        done = tokens - r.tok0
        self.attempted_tokens += done
        if r.step <= self.replay_mark:
            self.replayed_tokens += done

    def _boundary(self, step: int, rank: int, tokens: int, samples: int) -> None:
        """Remember ``rank``'s counters at the start of ``step`` until that step is committed."""
        if self.committed_step is not None and step <= self.committed_step:
            return
        at = self.tokens_at.get(step)
        if at is None:
            at = self.tokens_at[step] = {}
            if len(self.tokens_at) > self.config.max_uncommitted_steps:
                del self.tokens_at[next(iter(self.tokens_at))]
        at[rank] = (tokens, samples)
