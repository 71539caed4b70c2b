"""What each rung of the recovery ladder costs, and the shrink-or-wait arithmetic built on it.

The recovery decision (:mod:`resilient.elastic.decide`) weighs rungs by time.
The numbers come from measurement once the run has some (the agent times each
re-formation, promotion, shrink, grow and restart it carries out and passes
the latest) and from the defaults below before it has any.  The defaults are
deliberately pessimistic for the in-process rungs, so that a run that has
measured nothing yet does not over-promise them:

- ``restart_s`` = 7 s: the agent benchmark once measured 6.97 s from a kill to the next new
  step under ``resilient run`` (two ranks, CPU, gloo), most of it workers
  starting again and replaying steps since the last commit.  The agent
  replaces it with this run's own measure as soon as it has one (its
  restarts' cost from the ledger; before any, its first start's), so it
  holds only until the first step;
- ``inproc_s`` = 0.5 s: a spike re-formed a gloo group among survivors in
  36 ms; the default leaves an order of magnitude for a bigger job and the
  agent's own notice time (about 0.1 s to reap a death);
- ``spare_s`` = 1 s and ``shrink_s`` = 1 s: a re-formation plus a state
  broadcast to the newcomer, or plus re-planning the batch and the loader;
- ``grow_s`` = 2 s: a re-formation at a step boundary plus a broadcast to
  every joiner.

Shrink or wait.  With a member lost and no spare, the run can go on shrunk at
throughput fraction ``r`` (new world / full world, or a measured value) until
the member returns after ``R`` seconds, then pay ``grow_s`` to grow back; or
hold, doing nothing for ``R``.  Shrinking gains ``r * max(0, R - shrink_s)``
seconds of full-speed work; it is worth it only if that gain exceeds the
grow-back cost.  An unknown ``R`` is a long one: the gain is unbounded and
the run shrinks.  All pure, no clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..core.errors import ConfigError


def _seconds(name: str, value: float) -> None:
    if not (value >= 0 and math.isfinite(value)):
        raise ConfigError(f"RecoveryCosts.{name}={value} must be a finite number of seconds >= 0")


@dataclass(frozen=True, kw_only=True)
class RecoveryCosts:
    """Seconds each rung takes from the decision to the next new step, measured or default."""

    inproc_s: float = 0.5
    """d_inproc: re-form the process group among the same members and retry the step."""
    spare_s: float = 1.0
    """d_spare: promote a warm spare into a lost rank's place, state by broadcast from a peer."""
    shrink_s: float = 1.0
    """d_shrink: re-form on fewer ranks, re-plan the accumulation and the loader's split."""
    grow_s: float = 2.0
    """d_grow: grow back at a step boundary (re-form, broadcast state to the joiners, re-plan)."""
    restart_s: float = 7.0
    """d_restart: group restart from the newest commit, replay included (the agent benchmark's measure: 6.97 s)."""
    repair_s: float | None = None
    """R: expected seconds until a lost member (node or spare) is back; None when unknown (treated as long)."""
    throughput_fraction: float | None = None
    """r: measured throughput of a shrunk world relative to the full one; None uses new world / full world."""

    def __post_init__(self) -> None:
        for name in ("inproc_s", "spare_s", "shrink_s", "grow_s", "restart_s"):
            _seconds(name, getattr(self, name))
        if self.repair_s is not None and not (self.repair_s >= 0 and not math.isnan(self.repair_s)):
            raise ConfigError(
                f"RecoveryCosts.repair_s={self.repair_s} must be >= 0 seconds, or None when the repair time is unknown"
            )
        if self.throughput_fraction is not None and not (0 < self.throughput_fraction <= 1):
            raise ConfigError(
                f"RecoveryCosts.throughput_fraction={self.throughput_fraction} must be in (0, 1]: a shrunk world's "
                "throughput relative to the full one; None derives it from the world sizes"
            )

    def fraction(self, new_world: int, full_world: int) -> float:
        """r for a world of ``new_world`` ranks out of ``full_world``: the measured value, else the ratio."""
        if self.throughput_fraction is not None:
            return self.throughput_fraction
        return min(1.0, new_world / full_world)


@dataclass(frozen=True, kw_only=True)
class ShrinkOrWait:
    """The comparison behind a shrink-versus-wait choice, with every number it used."""

    shrink: bool
    """True when shrinking is worth more than holding for the repair."""
    r: float
    repair_s: float | None
    """R as given; None when unknown (then the gain is unbounded)."""
    shrink_s: float
    grow_s: float
    gain_s: float
    """r * max(0, R - d_shrink): full-speed seconds of work done while shrunk (inf when R is unknown)."""

    def describe(self) -> str:
        """The comparison in one line, e.g. ``shrunk work 0.75*max(0, 600.0 - 1.0) = 449.2 s > d_grow 2.0 s``."""
        if self.repair_s is None:
            return (f"repair time unknown (treated as long): shrunk work at r={self.r:.2f} is unbounded "
                    f"> d_grow {self.grow_s:.1f} s")
        sign = ">" if self.shrink else "<="
        return (f"shrunk work r*max(0, R - d_shrink) = {self.r:.2f}*max(0, {self.repair_s:.1f} - {self.shrink_s:.1f}) "
                f"= {self.gain_s:.1f} s {sign} d_grow {self.grow_s:.1f} s")


def shrink_or_wait(costs: RecoveryCosts, new_world: int, full_world: int) -> ShrinkOrWait:
    """Whether continuing on ``new_world`` of ``full_world`` ranks beats holding for the repair window."""
    if not 0 < new_world <= full_world:
        raise ValueError(f"new_world={new_world} must be in 1..full_world={full_world}")
    r = costs.fraction(new_world, full_world)
    if costs.repair_s is None or math.isinf(costs.repair_s):
        gain = math.inf
    else:
        gain = r * max(0.0, costs.repair_s - costs.shrink_s)
    return ShrinkOrWait(
        shrink=gain > costs.grow_s, r=r, repair_s=None if gain == math.inf else costs.repair_s,
        shrink_s=costs.shrink_s, grow_s=costs.grow_s, gain_s=gain,
    )
