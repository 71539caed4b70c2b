"""Growing back: when a world below its full size takes ready spares at the next step boundary.

:func:`decide_grow` is pure, like the recovery decision it follows: a shrunk
run sees spares arrive (a returned node's agent registers its workers as
spares; the agent starts a fresh one after each promotion) and asks, at each
step, whether to grow.  It grows to the largest world size the batch plan can
keep the global batch at, no larger than the full size and no larger than the
settled spares allow; spares must have been ready ``grow_settle_s`` (a node
that flaps would otherwise cost a grow and a shrink each time).  When the
run's remaining time is known, growth that gains less work than it costs is
skipped.  New members take the ranks above the current world, in order.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .costs import RecoveryCosts
from .decide import LadderConfig, Promotion
from .observe import Membership, Spare, pick_spares


class GrowAction(enum.Enum):
    """What a world below its full size does when members are ready to join."""

    GROW = "grow"
    HOLD = "hold"


@dataclass(frozen=True, kw_only=True)
class GrowDecision:
    """Whether a world below its full size grows at the next step boundary, and onto which spares."""

    action: GrowAction
    reason: str
    world_size: int
    """World size after the boundary (the current one for HOLD)."""
    after_step: int
    """The members join at the boundary after this step completes."""
    joiners: tuple[Promotion, ...] = ()
    """Spares that take the new ranks (current world size upward)."""

    def to_event(self) -> dict[str, Any]:
        """The decision as a JSON-ready dict for the event log."""
        return {
            "action": self.action.value,
            "reason": self.reason,
            "world_size": self.world_size,
            "after_step": self.after_step,
            "joiners": [{"rank": p.rank, "spare": p.spare, "node": p.node} for p in self.joiners],
        }


def decide_grow(
    members: Membership,
    spares: Iterable[Spare],
    *,
    step: int,
    costs: RecoveryCosts,
    cfg: LadderConfig,
    now: float,
    remaining_s: float | None = None,
) -> GrowDecision:
    """Grow after ``step`` to the largest feasible size the settled spares allow, or hold, and why.

    ``remaining_s`` is the run's expected remaining time at the current size when known: growth that
    would gain less work over it than ``grow_s`` costs is not worth it.
    """
    if remaining_s is not None and not remaining_s >= 0:
        raise ValueError(f"remaining_s={remaining_s} must be >= 0 seconds, or None when unknown")
    world, full = members.world_size, members.full_size

    def hold(why: str) -> GrowDecision:
        return GrowDecision(action=GrowAction.HOLD, world_size=world, after_step=step,
                            reason=f"hold at {world} of {full} ranks after step {step}: {why}")

    if world >= full:
        return hold("the world is at its full size")
    ready = pick_spares(spares, full - world, avoid_nodes=frozenset())
    settled = [s for s in ready if s.ready_since is not None and now - s.ready_since >= cfg.grow_settle_s]
    if not settled:
        if not ready:
            return hold("no healthy, warm, unclaimed spare")
        young = ", ".join(f"{s.id} ready for {now - (s.ready_since or now):.1f} s" for s in ready)
        return hold(f"no spare settled yet ({young}; grow_settle_s={cfg.grow_settle_s:.1f} s)")
    limit = min(full, members.max_size, world + len(settled))
    sizes = [n for n in members.feasible_world_sizes if world < n <= limit]
    if not sizes:
        feasible = ", ".join(map(str, sorted(members.feasible_world_sizes))) or "none"
        many = len(settled) > 1
        return hold(f"{len(settled)} settled spare{'s' if many else ''} allow{'' if many else 's'} {world + 1}..{limit} "
                    f"ranks, none of them feasible for the global batch (feasible world sizes: {feasible})")
    target = max(sizes)
    if remaining_s is not None:
        gain = (target - world) / full * remaining_s
        if gain <= costs.grow_s:
            return hold(f"growing to {target} gains {(target - world)}/{full} of {remaining_s:.1f} s remaining = "
                        f"{gain:.1f} s of work <= d_grow {costs.grow_s:.1f} s")
    joiners = tuple(Promotion(rank=world + i, spare=s.id, node=s.node) for i, s in enumerate(settled[: target - world]))
    named = ", ".join(f"spare {p.spare} (node {p.node}) as rank {p.rank}" for p in joiners)
    return GrowDecision(
        action=GrowAction.GROW, world_size=target, after_step=step, joiners=joiners,
        reason=(f"grow {world} -> {target} of {full} ranks after step {step}: {named}; "
                f"re-form at the boundary (~{costs.grow_s:.1f} s)"),
    )
