"""Building the :class:`~resilient.metrics.ledger_state.Account` from a ledger's state, without changing it.

The open interval since the last event is attributed as the ledger would
attribute it (:meth:`Ledger.pieces`) on copies: the totals, the tail of the
timeline and the open incident.  Closed timeline buckets are reused from
the timeline's cache, so an account costs little more than the window sum.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .catalogue import CATEGORIES
from .ledger_codec import LOST_TO_ETTR, PRODUCTIVE, REPLAY
from .ledger_state import Account, IncidentCost, WindowAccount

if TYPE_CHECKING:
    from .ledger import Ledger


def _ratios(seconds: list[float], wall: float) -> tuple[float, float]:
    """(goodput, ettr) in [0, 1]; both 0 before any time has passed."""
    if wall <= 0:
        return 0.0, 0.0
    goodput = seconds[PRODUCTIVE] / wall
    ettr = (wall - sum(seconds[c] for c in LOST_TO_ETTR)) / wall
    return min(1.0, max(0.0, goodput)), min(1.0, max(0.0, ettr))


def build_account(ledger: Ledger, now: float) -> Account:
    config = ledger.config
    start = ledger.start_t
    now = float(max(now, ledger.last_t))
    if start is None:
        start = now  # nothing happened yet
    pieces = ledger.pieces(ledger.last_t, now)[0] if now > ledger.last_t and ledger.start_t is not None else []
    seconds = list(ledger.seconds)
    timeline = ledger.timeline.clone_tail()
    pending_replay = 0.0
    for t0, t1, cat in pieces:
        if t1 > t0:
            seconds[cat] += t1 - t0
            timeline.add(t0, t1, cat)
            if cat == REPLAY:
                pending_replay += t1 - t0
    wall = now - start
    goodput, ettr = _ratios(seconds, wall)

    window_start = max(start, now - config.window_s)
    window_seconds = timeline.window(window_start, now) if wall > 0 else [0.0] * len(CATEGORIES)
    window_wall = now - window_start
    w_goodput, w_ettr = _ratios(window_seconds, window_wall)

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

    ideal, source = ledger.ideal()
    return Account(
        now=now,
        wall_s=wall,
        seconds={c: max(0.0, s) for c, s in zip(CATEGORIES, seconds)},
        goodput_ratio=goodput,
        ettr=ettr,
        window=WindowAccount(window_s=config.window_s, wall_s=window_wall,
                             seconds={c: max(0.0, s) for c, s in zip(CATEGORIES, window_seconds)},
                             goodput_ratio=w_goodput, ettr=w_ettr),
        ideal_step_s=ideal,
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
    )
