"""``Run.section(name)``: the part of the loop a rank is in, as the agent sees it in heartbeats.

Entering a section sends a heartbeat naming it (under an agent), so a hang
there is attributed to it and timed with that section's timeout; leaving
re-enters the enclosing one.  Between two updates a rank is in no section.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..core.errors import ConfigError

if TYPE_CHECKING:
    from .state import RunState


BETWEEN = ""
"""The section between two updates (at a step boundary): not reported."""
AFTER_STEPS = "after_steps"
"""The section a rank is in once ``Run.steps`` has done its last update (and its final save): the script's own
work after training (an evaluation, an export, a wait for its peers), held to the generous default timeout,
not to the calibrated timeout of the checkpoint it saved last."""


class Section:
    """``Run.section(name)``: enter ``name``, re-enter the enclosing section on the way out."""

    __slots__ = ("_name", "_outer", "_state")

    def __init__(self, state: RunState, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise ConfigError(f"Run.section({name!r}): a section needs a non-empty name")
        self._state = state
        self._name = name
        self._outer: str | None = None

    def __enter__(self) -> None:
        outer = self._state.current_section
        if outer != self._name:  # already inside it (e.g. save() around a save): nothing to report
            self._outer = outer
            self._state.enter(self._name)

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        hooks = self._state.hooks
        if exc is not None and hooks is not None:
            hooks.raised_in(exc, self._name)  # the error file names where it was raised, not where it surfaced
        if self._outer is not None:
            self._state.leave_for(self._outer)
