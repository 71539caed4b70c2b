"""Building the :class:`~resilient.metrics.ledger_state.Account` from a ledger's state, without changing it.

The open interval since the last event is attributed as the ledger would
attribute it (the caller's :meth:`Ledger.open_pieces`) on copies: the totals, the tail of the
timeline and the open incident.  Closed timeline buckets are reused from
the timeline's cache, so an account costs little more than the window sum.
:func:`totals` is the raw arithmetic (sums and the window, nothing
clamped); :func:`build_account` turns it into the frozen ``Account``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .catalogue import CATEGORIES
from .ledger_codec import LOST_TO_ETTR, PRODUCTIVE, REPLAY, LedgerBooks, Piece
from .ledger_state import Account, IncidentCost, WindowAccount
from .timeline import Timeline


@dataclass(frozen=True)
class Totals:
    """The account's raw sums as of ``now``, before the ratios are formed and anything is clamped.

    :class:`~resilient.metrics.ledger_state.Account` shows these with each
    second count floored at 0 and each ratio clamped to [0, 1] (float
    rounding in re-labelled intervals can leave a category an ulp below 0);
    the property tests check the invariants here, where nothing hides them.
    """

    now: float
    wall_s: float
    seconds: tuple[float, ...]
    """By category index (catalogue.CATEGORIES); they sum to ``wall_s``."""
    window_wall_s: float
    window_seconds: tuple[float, ...]
    window_new_steps: float
    pending_replay_s: float
    """Replay seconds of the open interval since the last event (not yet in the ledger's incident)."""

    def goodput(self, window: bool = False) -> float:
        """Productive over wall seconds (0 before any time has passed); not clamped."""
        seconds, wall = (self.window_seconds, self.window_wall_s) if window else (self.seconds, self.wall_s)
        return seconds[PRODUCTIVE] / wall if wall > 0 else 0.0

    def ettr(self, window: bool = False) -> float:
        """Wall seconds not lost to init, detection, recovery, replay or idling, over wall seconds; not clamped."""
        seconds, wall = (self.window_seconds, self.window_wall_s) if window else (self.seconds, self.wall_s)
        return (wall - sum(seconds[c] for c in LOST_TO_ETTR)) / wall if wall > 0 else 0.0


def totals(ledger: LedgerBooks, now: float, pieces: list[Piece], timeline: Timeline | None = None) -> Totals:
    """The raw sums as of ``now`` (>= the last event; earlier is read as the last event). Pure.

    ``pieces``: the open interval since the last event, attributed
    (:meth:`Ledger.open_pieces <resilient.metrics.ledger.Ledger.open_pieces>`).
    ``timeline``: a :meth:`Timeline.clone_tail` of the ledger's timeline to
    add the open interval to (the caller keeps it); by default a private one.
    """
    start = ledger.start_t
    now = float(max(now, ledger.last_t))
    if start is None:
        start = now  # nothing happened yet
    seconds = list(ledger.seconds)
    timeline = timeline if timeline is not None else ledger.timeline.clone_tail()
    pending_replay = 0.0
    for t0, t1, cat in pieces:
        if t1 > t0:
            seconds[cat] += t1 - t0
            timeline.add(t0, t1, cat)
            if cat == REPLAY:
                pending_replay += t1 - t0
    wall = now - start
    window_start = max(start, now - ledger.config.window_s)
    window_seconds, window_new_steps = timeline.window(window_start, now) if wall > 0 else (
        [0.0] * len(CATEGORIES), 0.0)
    return Totals(now=now, wall_s=wall, seconds=tuple(seconds), window_wall_s=now - window_start,
                  window_seconds=tuple(window_seconds), window_new_steps=window_new_steps,
                  pending_replay_s=pending_replay)


def _unit(x: float) -> float:
    return min(1.0, max(0.0, x))


def build_account(ledger: LedgerBooks, now: float, pieces: list[Piece],
                  ideal: tuple[float | None, str | None]) -> Account:
    """The frozen account as of ``now``: :func:`totals` with ``pieces``, clamped, and ``ideal`` (step time, source)."""
    config = ledger.config
    timeline = ledger.timeline.clone_tail()
    raw = totals(ledger, now, pieces, timeline)
    now, pending_replay = raw.now, raw.pending_replay_s

    incidents = []
    for i, inc in enumerate(ledger.incidents):
        replay_s = inc.replay_s
        if inc.state == "replaying" and i == len(ledger.incidents) - 1:
            replay_s += pending_replay
        recovered = inc.recovered_t if inc.recovered_t is not None else now
        detection_s, recovery_s = inc.detected_t - inc.started_t, recovered - inc.detected_t
        incidents.append(IncidentCost(
            id=inc.id, kind=inc.kind, detection_s=detection_s, recovery_s=recovery_s, replay_s=replay_s,
            total_s=detection_s + recovery_s + replay_s, started_t=inc.started_t, detected_t=inc.detected_t,
            open=inc.state != "closed"))

    ideal_s, source = ideal
    return Account(
        now=now,
        wall_s=raw.wall_s,
        seconds={c: max(0.0, s) for c, s in zip(CATEGORIES, raw.seconds)},
        goodput_ratio=_unit(raw.goodput()),
        ettr=_unit(raw.ettr()),
        window=WindowAccount(window_s=config.window_s, wall_s=raw.window_wall_s,
                             seconds={c: max(0.0, s) for c, s in zip(CATEGORIES, raw.window_seconds)},
                             goodput_ratio=_unit(raw.goodput(window=True)), ettr=_unit(raw.ettr(window=True)),
                             new_steps=raw.window_new_steps),
        ideal_step_s=ideal_s,
        ideal_source=source,
        committed_step=ledger.committed_step,
        committed_tokens=ledger.committed_tokens,
        committed_samples=ledger.committed_samples,
        attempted_steps=ledger.attempted_steps,
        attempted_tokens=ledger.attempted_tokens,
        replayed_steps=ledger.replayed_steps,
        replayed_tokens=ledger.replayed_tokens,
        last_progress_t=ledger.last_progress_t,
        last_commit_t=ledger.last_commit_t,
        step_histograms={rank: (tuple(h[0]), h[1], h[2]) for rank, h in sorted(ledger.histograms.items())},
        incidents=tuple(incidents),
        timeline=timeline.buckets(shared_with=ledger.timeline),
        generation=ledger.generation,
        world_size=ledger.world_size,
        full_world_size=ledger.full_world_size,
        clamped_events=ledger.clamped_events,
        saves_deferred=ledger.saves_deferred,
        deferred_steps=ledger.deferred_steps,
        resumes_diverged=ledger.resumes_diverged,
        diverged_from_step=ledger.diverged_from_step,
    )
