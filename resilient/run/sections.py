"""``Run.section(name)``: the part of the loop a rank is in, as the agent sees it in heartbeats.

Entering a section (:func:`enter`) sends a heartbeat naming it (under an
agent), so a hang there is attributed to it and timed with that section's
timeout, and the step timer charges it from then on; leaving re-enters the
enclosing one (:func:`leave_for`).  Between two updates a rank is in no
section.  ``state.sections`` is this module's to change.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..core.errors import ConfigError

if TYPE_CHECKING:
    from .state import RunState


BETWEEN = ""
"""The section between two updates (at a step boundary): not reported."""
AFTER_STEPS = "after_steps"
"""The section a rank is in once ``Run.steps`` has done its last update (and its final save): the script's own
work after training (an evaluation, an export, a wait for its peers), held to the generous default timeout,
not to the calibrated timeout of the checkpoint it saved last."""


def enter(state: RunState, section: str) -> None:
    """Enter ``section``: the timer charges it from now, the agent hears of it in a heartbeat."""
    state.sections.current = section
    if state.timer is not None:
        state.timer.switch(section)
    if state.hooks is not None:
        state.hooks.enter(section, state.step, state.committed_step(), tokens=state.tokens, samples=state.samples,
                          save=_new_save_report(state))


def leave_for(state: RunState, outer: str) -> None:
    """Back to ``outer`` (a section left): between two updates nothing is reported, the next step reports."""
    if outer != BETWEEN:
        enter(state, outer)
        return
    state.sections.current = BETWEEN
    if state.timer is not None:
        state.timer.switch(BETWEEN)


def between_updates(state: RunState) -> None:
    """At a step boundary, once an update completed: in no section, and nothing said (the next step's entry is).  A
    checkpoint taken at this boundary must not re-enter "step" on its way out, or the agent would see the next
    step start before it does."""
    state.sections.current = BETWEEN


def _new_save_report(state: RunState) -> dict[str, Any] | None:
    """The newest finished save, once: what the agent exports as checkpoint duration and bytes."""
    results = state.checkpoints.results if state.checkpoints is not None else None
    if not results or results[-1] is state.sections.reported_save:
        return None
    result = state.sections.reported_save = results[-1]
    size = result.manifest.total_bytes if result.manifest is not None else 0
    return {"step": result.step, "duration_s": round(result.stall_s + result.write_s, 6), "ok": result.ok,
            "bytes": size, "deferred_from": result.deferred_from, "deferred_slots": result.deferred_slots}


class Section:
    """``Run.section(name)``, and the Run's own sections: enter ``name``, re-enter the enclosing section on the
    way out."""

    __slots__ = ("_name", "_outer", "_state")

    def __init__(self, state: RunState, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise ConfigError(f"Run.section({name!r}): a section needs a non-empty name")
        self._state = state
        self._name = name
        self._outer: str | None = None

    def __enter__(self) -> None:
        outer = self._state.sections.current
        if outer != self._name:  # already inside it (e.g. save() around a save): nothing to report
            self._outer = outer
            enter(self._state, self._name)

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        hooks = self._state.hooks
        if exc is not None and hooks is not None:
            hooks.raised_in(exc, self._name)  # the error file names where it was raised, not where it surfaced
        if self._outer is not None:
            leave_for(self._state, self._outer)
