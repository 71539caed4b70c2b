"""A Run replaying an incident (``resilient incident replay``): restore the bundled checkpoint, run to the failing
step and through it, and write what happened there.

The replay gives each rank ``RESILIENT_REPLAY`` (read by :func:`resilient.worker.env.replay_plan`): a JSON file
naming the checkpoint to restore (the bundle's copy, or the pinned original), the failing step, and where each
rank writes its result.  The Run then restores from that checkpoint instead of the script's location, saves
nothing, and ends its loop once the failing step is behind it.  A rank that raises writes the exception, the
step and its data position (the samples it read); one that gets through writes that it did, with the same
position.  The samples come from the loader's restored cursor and the seeds from the step, as in the run.
"""

from __future__ import annotations

import dataclasses
import sys
import traceback
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from ..core.fsutil import write_json_atomic
from .attempt import data_position

if TYPE_CHECKING:
    from ..checkpoint.config import CheckpointConfig
    from ..worker.env import ReplayPlan
    from .state import RunState


def checkpoint_config(plan: ReplayPlan, config: CheckpointConfig | None) -> CheckpointConfig | None:
    """The script's checkpoint config pointed at the replay's checkpoint, saving nothing; restored at any size."""
    if config is None:
        return None
    return dataclasses.replace(config, dir=plan.checkpoint, endpoint_url=None, every_steps=None,
                               save_on_finish=False, elastic=True)


class Replay:
    """This rank's side of a replay: the failing step's position, and the result when it is behind or raised."""

    def __init__(self, plan: ReplayPlan, state: RunState) -> None:
        self.plan, self.state = plan, state
        self.position: dict[str, Any] | None = None
        self.written = False
        self._previous = sys.excepthook
        sys.excepthook = self._excepthook

    def _path(self) -> Path:
        return Path(self.plan.results) / f"rank{self.state.rank}.json"

    def at_boundary(self) -> bool:
        """At each boundary: True once the failing step is behind (the loop ends)."""
        if self.state.step == self.plan.step:
            self.position = data_position(self.state)
        if self.state.step <= self.plan.step:
            return False
        self.write({"raised": None, "through": True})
        return True

    def write(self, outcome: dict[str, Any]) -> None:
        if self.written:
            return
        self.written = True
        state = self.state
        write_json_atomic(self._path(), {**outcome, "rank": state.rank, "world_size": state.world_size,
                                         "step": state.step, "restored_from": state.restored_from,
                                         "loss": state.last_loss,
                                         "position": self.position or data_position(state)})

    def _excepthook(self, exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        try:
            module = exc_type.__module__
            name = exc_type.__qualname__ if module == "builtins" else f"{module}.{exc_type.__qualname__}"
            if self.position is None or self.state.step != self.plan.step:
                self.position = data_position(self.state)
            self.write({"raised": {"exc_type": name, "message": str(exc),
                                   "traceback": "".join(traceback.format_exception(exc_type, exc, tb))},
                        "through": False})
        except Exception as e:  # noqa: BLE001 - the original error is still printed below
            print(f"resilient: the replay could not write its result: {e}", file=sys.stderr)
        self._previous(exc_type, exc, tb)
