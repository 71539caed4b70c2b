"""Acting on a persistent straggler by cost: replace it with a spare, drop it (shrink), or keep it. Pure.

A straggler costs the whole job: in a synchronous step every rank waits for
the slowest, so the job's step is ``lost = rank_s - peers_s`` seconds longer
than it would be without it.  Over the steps still to do that is
``lost * remaining`` seconds.  The ways out, with what each costs:

- **swap**: a warm spare takes the rank's place in process (the ladder's
  PROMOTE_SPARE), paying ``spare_s`` once; afterwards the job steps at its
  peers' pace: it saves ``lost`` per step.
- **shrink**: the rank is dropped and the same global batch is spread over
  one rank fewer (the ladder's SHRINK), paying ``shrink_s``; afterwards a
  step takes about ``(step_s - lost) * world / (world - 1)`` (the work of the
  dropped rank shared out; a pessimistic estimate, communication does not
  grow), so it saves only when the straggler is slower than that.

Which of the two exists is the recovery ladder's to say (the agent asks it
first, :meth:`~resilient.agent.inproc.InProcess.preview`): a ready spare is
always promoted, so with one only the swap is weighed.  Of the options whose
saving over the remaining steps is at least ``margin`` times their cost, the
one that saves most net of its cost is taken; otherwise the rank stays and
the reason gives the numbers.  Where the script did not opt into in-process
recovery (``run.attempt()``) neither exists: a restart would start the same
rank on the same node again.  After ``max_evictions`` on a node the agent
stops: a slowness that follows the rank to its replacement is the rank's
work (its data, its extra duties), not its hardware.  ``remaining`` comes from ``Run.steps(total)``; when
the script gave none, ``horizon_steps`` is assumed and the reason says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from ..core.errors import ConfigError
from .costs import RecoveryCosts


@dataclass(frozen=True, kw_only=True)
class EvictConfig:
    """When a persistent straggler is acted on."""

    enabled: bool = True
    """False: stragglers are reported, never replaced or dropped."""
    after_windows: int = 6
    """A flag must have stood this many windows (5 steps each) before the cost is weighed."""
    margin: float = 2.0
    """The expected saving must be at least this many times the action's cost."""
    horizon_steps: int = 1000
    """Steps assumed still to do when the script did not say how many (``Run.steps(total)``)."""
    max_evictions: int = 3
    """Stragglers replaced or dropped on a node, at most, for the agent's life."""

    def __post_init__(self) -> None:
        for name in ("after_windows", "horizon_steps", "max_evictions"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"EvictConfig.{name}={value!r} must be an int >= 1")
        if not (isinstance(self.margin, (int, float)) and math.isfinite(self.margin) and self.margin >= 1):
            raise ConfigError(f"EvictConfig.margin={self.margin!r} must be a number >= 1 (a saving at least "
                              "as large as the cost)")


@dataclass(frozen=True)
class StragglerCase:
    """What the agent knows of a persistent straggler and of the ways out."""

    rank: int
    section: str
    rank_s: float
    """The straggler's seconds per step in ``section``."""
    peers_s: float
    """Its peers' median seconds per step there."""
    step_s: float
    """The job's seconds per step now."""
    world: int
    remaining_steps: int | None
    """Steps still to do, from ``Run.steps(total)``; None when the script did not say."""
    spares_ready: int
    """Warm spares the ladder would promote into the rank (0 when it would not)."""
    can_shrink: bool
    """The ladder would drop the rank and go on with one rank fewer (MIN, batch plan and state allow it)."""
    opted_in: bool
    """Every rank runs under ``run.attempt()``: in-process replacement or shrink is possible."""
    evictions_done: int = 0
    """Stragglers already replaced or dropped on this node."""
    ladder: str = ""
    """The ladder's answer to losing the rank, in words, when it is neither a swap nor a shrink."""


@dataclass(frozen=True)
class EvictDecision:
    """Keep, swap for a spare, or shrink without the straggler; with the arithmetic behind it."""

    action: Literal["keep", "swap", "shrink"]
    reason: str
    lost_s: float
    """Seconds per step the job loses to the straggler."""
    remaining_steps: int
    saved_s: float
    """Expected seconds saved over the remaining steps by the action taken (0 for keep)."""
    cost_s: float


def decide_eviction(case: StragglerCase, costs: RecoveryCosts, config: EvictConfig) -> EvictDecision:
    """Weigh swapping and shrinking against keeping a persistent straggler.  Pure."""
    lost = min(max(0.0, case.rank_s - case.peers_s), case.step_s)
    remaining = case.remaining_steps if case.remaining_steps is not None else config.horizon_steps
    horizon = "" if case.remaining_steps is not None else \
        f" (the script did not say how many steps remain: {config.horizon_steps} assumed)"
    who = f"rank {case.rank} ({case.section} {case.rank_s * 1e3:.1f} ms per step against {case.peers_s * 1e3:.1f})"
    if not config.enabled:
        return EvictDecision("keep", f"{who} is kept: acting on stragglers is off", lost, remaining, 0.0, 0.0)
    if not case.opted_in:
        return EvictDecision("keep", f"{who} is kept: the script did not opt into in-process recovery "
                             "(run.attempt()), and a restart would start the same rank here again",
                             lost, remaining, 0.0, 0.0)
    if case.evictions_done >= config.max_evictions:
        return EvictDecision("keep", f"{who} is kept: {case.evictions_done} stragglers were already replaced or "
                             f"dropped on this node (max_evictions): a slowness that follows the rank is its work's, "
                             "not its hardware's", lost, remaining, 0.0, 0.0)
    options: list[tuple[Literal["swap", "shrink"], float, float, str]] = []
    if case.spares_ready > 0:
        saved = lost * remaining
        options.append(("swap", saved, costs.spare_s, f"a spare saves {lost * 1e3:.1f} ms per step"))
    elif case.can_shrink and case.world > 1:
        after = (case.step_s - lost) * case.world / (case.world - 1)
        per_step = case.step_s - after
        options.append(("shrink", max(0.0, per_step) * remaining, costs.shrink_s,
                        f"{case.world - 1} ranks step in about {after * 1e3:.1f} ms against {case.step_s * 1e3:.1f}"))
    if not options:
        why = f": {case.ladder}" if case.ladder else ""
        return EvictDecision("keep", f"{who} is kept: no spare is ready and the world cannot shrink{why}", lost,
                             remaining, 0.0, 0.0)
    worth = [o for o in options if o[1] >= config.margin * o[2] and o[1] > o[2]]
    action, saved, cost, how = max(worth or options, key=lambda o: o[1] - o[2])
    over = f"{saved:.1f} s over {remaining} steps{horizon} against {cost:.1f} s to {action}"
    if not worth:
        return EvictDecision("keep", f"{who} is kept: {how}, {over} (needs {config.margin:g}x)", lost, remaining,
                             0.0, cost)
    verb = "replaced by a spare" if action == "swap" else "dropped (the world shrinks)"
    return EvictDecision(action, f"{who} is {verb}: {how}, {over}", lost, remaining, saved, cost)
