"""Growing back on one machine: a world below full size takes settled spares at a step boundary.

Both steps work through :class:`~resilient.agent.inproc.InProcess`'s public
side: the ladder's grow rule (:func:`~resilient.elastic.grow.decide_grow`)
over the node's spares and the batch plan, then the assignments published
on the agent's store, the members asked to join at the boundary, the
joiners promoted, and the recovery followed until everyone rejoined.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..elastic.grow import GrowAction, GrowDecision, decide_grow
from ..elastic.observe import Membership
from ..elastic.reform import Member, grow_key, plan_assignments
from .inproc_state import Recovering

if TYPE_CHECKING:
    from .inproc import InProcess
    from .launcher import WorkerGroup


def consider_grow(inp: InProcess, group: WorkerGroup, step: int, now: float, *,
                  remaining_s: float | None = None) -> GrowDecision | None:
    """Whether a world below full size grows onto settled spares at the boundary before ``step``
    (``remaining_s``: the run's training time after it, when known)."""
    c = inp.config
    spares, feasible = inp.spare_view(group)
    world = len(group.workers)
    members = Membership(rank_nodes=(c.node_id,) * world, min_size=min(c.min_ranks, world),
                         max_size=c.nproc_per_node, full_size=c.nproc_per_node, feasible_world_sizes=feasible)
    decision = decide_grow(members, spares, step=step, costs=inp.costs(), cfg=inp.ladder, now=now,
                           remaining_s=remaining_s)
    if decision.action is not GrowAction.GROW:
        return None
    inp.note_decision(f"grow: {decision.reason}", decision.to_event())
    return decision


def carry_out_grow(inp: InProcess, group: WorkerGroup, decision: GrowDecision, generation: int, previous: int,
                   at_step: int, now: float) -> dict[int, int]:
    """Publish ``generation`` (the members plus the joiners), then ask the members to join it before ``at_step``;
    returns rank -> pid."""
    members = [Member(worker_id=w.worker_id, new_rank=r, old_rank=r) for r, w in sorted(group.workers.items())]
    members += [Member(worker_id=p.spare, new_rank=p.rank, old_rank=None) for p in decision.joiners]
    joining = {p.spare for p in decision.joiners}
    standby = [i for i in group.spares if i not in joining]
    inp.publish(plan_assignments(generation, members, 0, inp.host, inp.port, standby))
    # After the assignments: a member that sees the key finds its assignment waiting.
    inp.signal_grow(grow_key(previous), generation, at_step)
    for p in decision.joiners:
        inp.promote(group, p.spare, p.rank)
    inp.start_recovery(Recovering(
        generation=generation, rung="grow", world_size=decision.world_size,
        promotions=tuple((p.rank, p.spare) for p in decision.joiners), dropped=(),
        members={m.worker_id: m.new_rank for m in members}, detected_at=now,
        deadline=now + 2 * inp.config.recovery_timeout_s + 10, incident_id=None, step=at_step))
    return {r: w.pid for r, w in group.workers.items()}
