"""What a generation's watch loop hands on: how the generation ended on this node (:class:`Outcome`), or
members lost with no rung of the ladder acted on yet (:class:`Hold`, decided again each tick)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..core.events import OutcomeKind
from ..elastic.decide import RecoveryDecision
from ..elastic.observe import FaultKind
from .incidents import Incident
from .policy import Failure

if TYPE_CHECKING:
    from .context import GenerationContext


@dataclass(frozen=True)
class Outcome:
    """How a generation ended on this node."""

    kind: OutcomeKind
    reason: str
    failure: Failure | None = None
    incident: Incident | None = None
    detected_at: float = 0.0
    """Agent clock when the failure was detected."""
    last_progress_at: float = 0.0
    """Agent clock of the failing rank's last sign of progress (its last heartbeat)."""
    takes_place_of: str | None = None
    """A spare node's generation ended to take this lost node's place in the run's restart (it joins the
    rendezvous as a node of the run)."""
    exit_codes: tuple[int, ...] = ()
    """Every failed rank's non-zero exit status (the exit-code contract is checked over all of them)."""
    decision: RecoveryDecision | None = None
    """The one decision already taken on this failure (:mod:`.decision`, with the ladder on offer): restart or
    stop, which the lifecycle carries out as it is.  None: the lifecycle takes it, without the ladder."""


@dataclass
class Hold:
    """Members lost with no rung to act on yet: the ladder said wait for a spare; decided again each tick."""

    lost: dict[int, str]
    kind: FaultKind
    step: int
    exit_codes: tuple[int, ...]
    failure: Failure
    incident: Incident
    detected_at: float
    last_progress_at: float
    since: float
    """When the hold began (the ladder's ``waiting_since`` once it said wait for repair)."""
    settling: bool = False
    """Not decided yet: waiting for every live member to report that it left the failed group, so that
    members lost together (two ranks killed at once) are decided together."""


def settle_s(ctx: GenerationContext) -> float:
    """Longest wait for every survivor to say it left the failed group before the ladder decides anyway."""
    return min(5.0, ctx.config.recovery_timeout_s / 4)
