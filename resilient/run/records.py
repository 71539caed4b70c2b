"""What a rank's Run records of the step it is in: where it stands in the update, and what going back to the
step's start needs.

- :class:`StepPosition`: before, inside or after the optimizer's update (a rank inside or after it is
  never a source of state in a recovery: :mod:`.recovery`);
- :class:`AttemptStart`: what ``run.attempt()`` copies at its entry, for a retry of the step
  (:mod:`.attempt`);
- :class:`PendingVerdict`: a step's non-finite check, set on the device and not read yet, with the start to go
  back to (``nonfinite_verdict="late"``: :mod:`.nonfinite`);
- :class:`OwnGradients`: a watch on this rank's own gradients, on the retry of a step found non-finite.

:class:`~.state.RunState` holds them and the Run's parts pass them around; this module imports nothing of the
Run but the streams' records (:mod:`.streams`), so that every part can name them, the state included.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..core.state import unwrap

if TYPE_CHECKING:
    from .streams import Fetched


class StepPosition(enum.Enum):
    """Where a rank is inside the step's optimizer update (DESIGN.md, "A step is atomic to the outside")."""

    BEFORE = "before"
    """The update was not entered: the rank's state is the step's start, once the attempt is rewound (clean)."""
    INSIDE = "inside"
    """Inside ``optimizer.step()``: part of the update may be applied (an optimizer with a collective in its
    step applies one part, waits for its peers, applies the rest).  Dirty: never a source of state."""
    AFTER = "after"
    """The update was applied but the rest of the step body did not finish (the scheduler, the counters, the
    ``state=`` objects may lag it, and what the body would still have done is unknown).  Dirty too."""


@dataclass(frozen=True)
class AttemptStart:
    """What a retry of the step needs, recorded when ``run.attempt()`` is entered."""

    step: int
    consumed: int | None
    """The loader's cursor at the step's start (None: no loader)."""
    samples: int
    tokens: int
    python_rng: Any
    numpy_rng: Any
    """numpy's global generator state; None when numpy is not imported."""
    user: dict[str, Any]
    """A copy of each ``state=`` object's state at the step's start."""
    scheduler: Any
    scaler: Any
    hyper: list[dict[str, Any]]
    """The optimizer's hyperparameters (every param group's entries but its parameters): a scheduler or the
    script may set them inside the step."""
    generators: dict[str, Any]
    """The states of ``Run(generators=...)`` at the step's start."""
    fetched: Fetched | None = None
    """The newest ``run.prefetch`` record at the attempt's start: another one at its end fetched ahead inside it."""
    retryable: bool = True
    """False: nothing can retry this attempt (no in-process recovery, ``nonfinite`` not "retry"), so the copies
    above were not taken."""


@dataclass
class PendingVerdict:
    """A step's non-finite check, set on the device and not read yet."""

    step: int
    host: torch.Tensor
    """The flag's copy on the host (1.0: not finite), filled asynchronously on CUDA."""
    ready: Any
    """The CUDA event recorded after that copy (None where the copy is synchronous)."""
    start: AttemptStart | None
    """The step's attempt start, to go back to (None: the update was outside ``run.attempt()``)."""
    bad: bool | None = None


class OwnGradients:
    """Whether this rank's own backward makes a non-finite gradient, before data parallelism averages the ranks'
    gradients (after it, every rank holds the same NaN, whichever rank's samples made it).

    A hook on each (unsharded) parameter sees the gradient its backward computed, before it is accumulated
    and all-reduced, and keeps a flag on the device; the host reads the flags only when a verdict is given.
    The Run watches only the retries of a step found non-finite, so it costs the healthy steps nothing.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self._flags: list[torch.Tensor] = []
        self._handles = [p.register_hook(self._seen) for p in unwrap(model).parameters()
                         if p.requires_grad and not callable(getattr(p, "to_local", None))]

    def _seen(self, grad: torch.Tensor) -> None:
        self._flags.append(torch.logical_not(grad.detach().isfinite().all()))

    def verdict(self) -> bool | None:
        """True: a gradient this rank's backward made was not finite; False: none was; None: nothing watched."""
        if not self._flags:
            return None
        return bool(torch.stack(self._flags).any().item())

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self._flags = [], []
