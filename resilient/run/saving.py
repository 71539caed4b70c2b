"""When a Run saves: the cadence at step boundaries, ``run.save()``, the save on finish, a graceful stop.

What a save holds is :mod:`.payloads`; the checkpoint manager
(:mod:`resilient.checkpoint.manager`) writes and commits it.  A save is
taken only at a boundary between two updates, so a checkpoint never holds
half a step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..core.errors import ConfigError
from ..core.events import EventKind
from . import nonfinite
from .payloads import capture_payloads
from .sections import Section

if TYPE_CHECKING:
    from ..checkpoint.manager import SaveResult
    from ..worker.hooks import WorkerHooks
    from .state import RunState


def payloads(state: RunState) -> dict[str, Any]:
    """What this rank saves now."""
    return capture_payloads(state)


def _scheduled(state: RunState) -> bool:
    ckpt = state.checkpoints
    every = ckpt.every if ckpt is not None else None  # from the save's cost and the failure rate where given
    return every is not None and state.step % every == 0 and state.last_saved_step != state.step


def due(state: RunState) -> bool:
    """Whether this boundary may save: a scheduled save, or a deferred one pending."""
    ckpt = state.checkpoints
    return ckpt is not None and state.step != 0 and (_scheduled(state) or ckpt.pending is not None)


def measure(state: RunState) -> None:
    """At a boundary, before anything else: the step's time to the cadence (which may change the interval), and
    the save's size once, after the first update (when the optimizer state exists)."""
    ckpt = state.checkpoints
    if ckpt is None or state.step == 0:
        return
    if not state.prepared:
        state.prepared = True
        ckpt.prepare(payloads(state))
    ckpt.step_done(state.last_step_s)


def at_boundary(state: RunState) -> None:
    """Save if the cadence says this boundary is due (or a deferred save is pending); :func:`measure` first."""
    ckpt = state.checkpoints
    if ckpt is None or state.step == 0:
        return
    due = _scheduled(state)
    if due or ckpt.pending is not None:  # paced by config.when_busy: see resilient/checkpoint/pacing.py
        settled(state, "before a checkpoint")
        with Section(state, "checkpoint"):
            decision = ckpt.save_due(state.step, due=due, payloads=lambda: payloads(state),
                                     fingerprint=state.fingerprint,
                                     counters={"samples": state.samples, "tokens": state.tokens})
        if decision is not None and decision.action != "defer":
            state.last_saved_step = state.step


def settled(state: RunState, when: str) -> None:
    """Raise when the newest update was found non-finite (``nonfinite_verdict="late"``): what follows would keep
    or send a state whose last update was skipped.  The loop reads the verdict before such a boundary already;
    this is the guarantee, not the way (a raise here is a restart from the newest commit, not a retry)."""
    bad = nonfinite.settle(state, wait=True)
    if bad is not None:
        raise nonfinite.late_error(state, bad, when)


def save(state: RunState, *, wait: bool) -> SaveResult | None:
    """Save the state after ``state.step`` updates (``wait``: until committed)."""
    assert state.checkpoints is not None
    settled(state, "before a checkpoint")
    state.last_saved_step = state.step
    with Section(state, "checkpoint"):
        return state.checkpoints.save(
            state.step,
            payloads(state),
            counters={"samples": state.samples, "tokens": state.tokens},
            fingerprint=state.fingerprint,
            wait=wait,
        )


def commit(state: RunState) -> SaveResult:
    """``run.save()``: commit the state after ``step`` updates, unless that state is committed already."""
    if state.checkpoints is None:
        raise ConfigError("Run.save() needs checkpoint=CheckpointConfig(...) when the Run is created")
    settled(state, "before run.save()")  # inside run.attempt() the step before is retried; else it restarts
    with Section(state, "checkpoint"):
        state.checkpoints.wait()
        results = state.checkpoints.results
        if results and results[-1].step == state.step and results[-1].ok:
            return results[-1]  # this state is already committed
        result = save(state, wait=True)
    assert result is not None
    return result


def at_finish(state: RunState) -> None:
    """After the last update: the save on finish, when configured and this step is not saved yet."""
    ckpt = state.checkpoints
    if ckpt is not None and ckpt.config.save_on_finish and state.last_saved_step != state.step:
        save(state, wait=False)


def stop_at_boundary(state: RunState, hooks: WorkerHooks) -> None:
    """Stop at this boundary if the agent asked for it and ``state.step`` reached the stop step.

    The agent picks a stop step ahead of every rank so that all ranks
    commit the same step together.  A rank that is already past it stops
    at its current boundary instead; if its peers stop at another step,
    their commits do not match and the commit fails (or waits for its
    timeout), so the agent must choose the stop step with room to spare.
    """
    request = hooks.take_stop_request()
    if request is None or state.step < request.stop_at_step:
        return
    result = commit(state) if state.checkpoints is not None else None
    committed = result.name if result is not None and result.ok else None
    state.events.emit(EventKind.GRACEFUL_STOP, step=state.step, stop_at_step=request.stop_at_step,
                      reason=request.reason, committed=committed, error=result.error if result is not None else None)
    hooks.bye(state.step, state.committed_step())
    raise SystemExit(0)
