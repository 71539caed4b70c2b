"""The watch loop's side of in-process recovery across machines (the store's side: :mod:`resilient.agent.cluster`).

Every agent of a launch follows the chain of generations through the
store, whether it holds members, only spares (``--role spare``, or a node
whose ranks a shrink dropped) or both:

* :func:`report_lost`: a member of this node died (or hung and was killed):
  say so in the store and hold until the generation's decision;
* :func:`tick`, on every pass of the watch loop: relay this node's
  survivors' ``waiting`` reports and its spares' readiness (the pool), then
  carry out the decision of the current generation once one is in the
  store (:func:`_apply`), or, when this node is involved, is the
  generation's collector (the node that marked it failed; the next ones in
  turn, a settle time later each) and every member is
  accounted for (waiting or lost; members still silent after the settle
  time are presumed lost with their node), decide, taking the claim only
  when the ladder acts (:func:`~resilient.agent.cluster_decide.decide`, the
  same :func:`~resilient.elastic.decide.decide_recovery` as on one machine,
  over the whole membership and the pool; a hold for a repair writes
  nothing and is weighed again on the next pass); the node
  holding rank 0 grows a shrunk world onto settled pool spares
  (:func:`_grow`).  Which of these a pass does, and why, is one pure
  function, :func:`next_moves`, over the facts the pass gathered
  (:class:`TickFacts`); :func:`tick` carries its moves out.

The group of the next generation forms on the deciding agent's recovery
store; each agent publishes its own workers' assignments on its own.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

from ..coord import claims
from ..coord.store import ControlStoreError
from ..core.events import EventKind, OutcomeKind
from ..elastic.grow import GrowAction, decide_grow
from ..elastic.observe import FaultKind, Spare
from ..elastic.reform import Member, grow_key, plan_assignments
from .cluster import Involvement, collectors
from .cluster_decide import decide, membership_of
from .cluster_watch import ClusterState, Snapshot
from .continuation import continue_as, grow_boundary, joiners_waiting
from .outcome import Hold, Outcome, settle_s
from .policy import Failure
from .rendezvous import Assignment

if TYPE_CHECKING:
    from .context import GenerationContext
    from .incidents import Incident
    from .launcher import WorkerGroup

GROW_LEAD_S = 1.0
"""Across machines the members learn of a grow through the store's poll: the boundary is placed further ahead."""


def _store_error(ctx: GenerationContext, e: Exception) -> None:
    ctx.emit(EventKind.STORE_UNREACHABLE, error=f"{type(e).__name__}: {e}")


def start(ctx: GenerationContext, group: WorkerGroup, a: Assignment) -> None:
    """A generation formed by the rendezvous (or a spare node's first): publish this node's members."""
    inp = ctx.inproc
    assert inp is not None and inp.cluster is not None
    cs = inp.cluster
    cs.following = a.generation
    cs.world_size = a.num_nodes * ctx.config.nproc_per_node
    cs.full_size = max(cs.full_size, cs.world_size)
    cs.opted_in_published = -1
    if not group.workers:
        return
    try:
        _publish_node(ctx, group, cs, a.generation, opted_in=False)
        if 0 in group.workers:
            cs.store.set_current(a.generation)
    except ControlStoreError as e:
        _store_error(ctx, e)


def _publish_node(ctx: GenerationContext, group: WorkerGroup, cs: ClusterState, generation: int, *,
                  opted_in: bool) -> None:
    inp = ctx.inproc
    assert inp is not None
    cs.store.publish_node(generation, {r: w.worker_id for r, w in group.workers.items()}, world_size=cs.world_size,
                          store=f"{inp.host}:{inp.port}", opted_in=opted_in, batch=inp.batch_plan(),
                          replicas=inp.replicas())


REPORTED_KIND = {FaultKind.HANG: "hang", FaultKind.STRAGGLER: "straggler"}
"""How a lost member's fault is written for the deciding agent (any other kind: a crash)."""


def report_lost(ctx: GenerationContext, group: WorkerGroup, a: Assignment, *, lost: dict[int, str], kind: FaultKind,
                failure: Failure, incident: Incident, exit_codes: tuple[int, ...], detected_at: float,
                last_progress_at: float) -> Hold | None:
    """Members of this node are gone: tell the others and hold for the decision (None: restart instead)."""
    inp = ctx.inproc
    assert inp is not None and inp.cluster is not None
    cs = inp.cluster
    try:
        view = cs.store.view(a.generation)
        if not view.nodes or not all(n.get("opted_in") for n in view.nodes.values()):
            return None  # some node's script did not opt in: every node restarts as it always has
        for rank, worker in lost.items():
            cs.store.report(a.generation, "lost", worker, {
                "rank": rank, "kind": REPORTED_KIND.get(kind, "crash"), "exit_codes": list(exit_codes),
                "step": failure.step, "detail": failure.describe()[:300]})
    except ControlStoreError as e:
        _store_error(ctx, e)
        return None
    now = ctx.clock()
    inv = cs.involved.setdefault(a.generation, Involvement(since=now))
    inv.failure, inv.incident, inv.detected_at, inv.last_progress_at = failure, incident, detected_at, last_progress_at
    return Hold(lost, kind, failure.step or 0, exit_codes, failure, incident, detected_at, last_progress_at, now,
                settling=True)


class Move(Enum):
    """One thing a pass of :func:`tick` does, in the order :func:`next_moves` lists them."""

    END_JOINERS = "end_joiners"
    """End the generation as the run did: this node holds only a grow's joiners and the launch ended."""
    ABANDON = "abandon"
    """Abandon the recovery this node's members are forming: a member of that generation was lost or left it."""
    APPLY = "apply"
    """Carry out this node's part of the generation's decision."""
    IDLE = "idle"
    """No members here (only spares): start again after a restart, take a lost node's place, or end."""
    DECIDE = "decide"
    """Decide how the generation is recovered (claiming it once the ladder acts; a hold claims nothing)."""
    CLEAR_STALE_CLAIM = "clear_stale_claim"
    """Remove a claim naming this agent that it does not hold (a create in doubt that landed late)."""
    GIVE_UP = "give_up"
    """The claim's holder published no decision in time: the generation ends as a failure (a restart)."""
    GROW = "grow"
    """Consider growing the world onto settled pool spares."""


@dataclass(frozen=True)
class TickFacts:
    """What one pass of :func:`tick` saw: this node's part and the store's keys of the launch as its watch holds
    them (one snapshot)."""

    generation: int
    """The generation this node runs."""
    current: bool
    """The snapshot is of that generation."""
    joiners_only: bool = False
    """Every member here is a grow's joiner still waiting for its boundary (they hold no state)."""
    launch_ended: bool = False
    """The launch is marked ended (read only when :attr:`joiners_only`)."""
    forming_failed: bool = False
    """This node's members are still forming this generation, and the store shows a member of it lost or waiting."""
    collector: str | None = None
    """The node that reads the survivors' reports and decides (None: not known; this node may)."""
    collector_turn: int = 0
    """This node's place among the generation's collectors (0: it collects first)."""
    settle_s: float = 5.0
    """How long after the one before it each next collector waits."""
    decided: bool = False
    members_here: bool = True
    involved: bool = False
    """A failure of this generation concerns this node (it reported a loss, or relayed a survivor's wait)."""
    claim: str | None = None
    """The node holding the generation's claim, if any."""
    me: str = ""
    involved_for_s: float = 0.0
    recovery_timeout_s: float = 60.0
    may_grow: bool = False
    """This node holds rank 0, no recovery is under way, and the world is below its full size."""


def next_moves(f: TickFacts) -> tuple[tuple[Move, ...], str]:
    """The moves of one pass, and why (pure: :func:`tick` gathers the facts and carries the moves out)."""
    if not f.current:
        return (), "the store's copy is of another generation"
    if f.joiners_only and f.launch_ended:
        return (Move.END_JOINERS,), "the run ended before the grow's boundary this node's joiners wait for"
    first: tuple[Move, ...] = ()
    why = ""
    if f.forming_failed:
        first, why = (Move.ABANDON,), "a member of the generation being formed was lost or left it; "
    if f.decided:
        return (*first, Move.APPLY), why + "the generation's decision is in the store"
    if not f.members_here:
        return (*first, Move.IDLE), why + "only spares here"
    if f.involved:
        if f.claim is None:
            if f.collector is None or f.collector == f.me or f.involved_for_s >= f.collector_turn * f.settle_s:
                return (*first, Move.DECIDE), why + "a failure of this generation, and no claim yet"
            return first, why + f"node {f.collector} collects the survivors' reports and decides"
        if f.claim == f.me:
            return (*first, Move.CLEAR_STALE_CLAIM), why + "a claim naming this agent, which holds none between passes"
        if f.involved_for_s > f.recovery_timeout_s:
            return (*first, Move.GIVE_UP), (f"node {f.claim} claimed the decision after generation {f.generation} "
                                            f"and published none within {f.recovery_timeout_s:g} s")
        return first, why + f"node {f.claim} is deciding"
    if f.may_grow:
        return (*first, Move.GROW), why + "the world is below its full size"
    return first, why + "nothing to do"


def tick(ctx: GenerationContext, group: WorkerGroup, a: Assignment, gdir: Any,
         now: float) -> Assignment | Outcome | str | None:
    """One pass: relay, then follow, decide or grow (see the module doc): the facts gathered, the moves chosen by
    :func:`next_moves`, each carried out in turn (what the last returns is the pass's news)."""
    inp = ctx.inproc
    assert inp is not None and inp.cluster is not None
    cs = inp.cluster
    try:
        _relay(ctx, group, a, cs, now)
    except ControlStoreError as e:
        _store_error(ctx, e)
    snap = cs.watch.snapshot if cs.watch is not None else None  # read once: one consistent view
    if snap is None:
        return None
    moves, reason = next_moves(_facts(ctx, group, a, snap, now))
    news: Assignment | Outcome | str | None = None
    for move in moves:
        news = _carry_out(ctx, group, a, gdir, snap, move, reason, now)
    return news


def _facts(ctx: GenerationContext, group: WorkerGroup, a: Assignment, snap: Snapshot, now: float) -> TickFacts:
    inp = ctx.inproc
    assert inp is not None and inp.cluster is not None
    cs, view, recovering = inp.cluster, snap.view, inp.recovering
    current = view.generation == a.generation
    joiners_only = ended = False
    if current and recovering is not None and recovering.rung == "grow" and group.workers:
        waiting = joiners_waiting(group, recovering, inp.rejoined(recovering.generation))
        joiners_only = len(waiting) == len(group.workers)
        ended = joiners_only and ctx.shared.ended()  # the watched copy: read only in this rare case
    inv = cs.involved.get(a.generation)
    turns = collectors(view.failed_by, snap.running & snap.live, ctx.config.node_id) if inv is not None else []
    me = ctx.config.node_id
    return TickFacts(
        generation=a.generation, current=current, joiners_only=joiners_only, launch_ended=ended,
        forming_failed=recovering is not None and recovering.generation == a.generation
        and view.failing(),
        decided=view.decision is not None, members_here=bool(group.workers), involved=inv is not None,
        claim=None if view.claim is None else str(view.claim.get("node") or "?"), me=me,
        collector=turns[0] if turns else None, collector_turn=turns.index(me) if me in turns else 0,
        settle_s=settle_s(ctx),
        involved_for_s=now - inv.since if inv is not None else 0.0, recovery_timeout_s=ctx.config.recovery_timeout_s,
        may_grow=0 in group.workers and recovering is None and cs.world_size < cs.full_size)


def _carry_out(ctx: GenerationContext, group: WorkerGroup, a: Assignment, gdir: Any, snap: Snapshot, move: Move,
               reason: str, now: float) -> Assignment | Outcome | str | None:
    """One move of a pass (:func:`next_moves` chose it, for ``reason``)."""
    inp = ctx.inproc
    assert inp is not None and inp.cluster is not None
    cs, view = inp.cluster, snap.view
    match move:
        case Move.END_JOINERS:
            recovering = inp.recovering
            assert recovering is not None
            inp.forget_grow(recovering.generation)
            return Outcome(OutcomeKind.SUCCEEDED, f"the run ended on the other nodes before the boundary at step "
                                                  f"{recovering.step} of the grow this node's joiners waited for")
        case Move.ABANDON:
            # Its members still forming it leave, say they wait, and the next decision folds this failure in.
            inp.abandon_recovery(another_failure=True)
            return None
        case Move.APPLY:
            assert view.decision is not None
            return _apply(ctx, group, a, gdir, view.decision, now)
        case Move.IDLE:
            return _idle(ctx, cs, a, snap, now)
        case Move.DECIDE:
            inv = cs.involved[a.generation]
            try:
                body = decide(ctx, a, view, inv, now)
            except ControlStoreError as e:
                _store_error(ctx, e)
                return f"the store failed while deciding how to recover generation {a.generation}: {e}"
            return _apply(ctx, group, a, gdir, body, now) if isinstance(body, dict) else body
        case Move.CLEAR_STALE_CLAIM:
            try:
                cs.store.clear_stale_claim(a.generation)
            except ControlStoreError as e:
                _store_error(ctx, e)
            return None
        case Move.GIVE_UP:
            return reason
        case Move.GROW:
            try:
                return _grow(ctx, group, a, gdir, snap, now)
            except ControlStoreError as e:
                _store_error(ctx, e)
                return None
    raise AssertionError(f"not a move: {move!r}")


ORPHANED_S = 30.0
"""A node with only spares ends once no node holding the run's ranks has been alive for this long."""

NODES_EVERY_S = 1.0
"""How often a node with only spares, or the node holding rank 0 considering a grow, reads the generation's
nodes from the store (outside the watch) until every one published and opted in."""


def _idle(ctx: GenerationContext, cs: ClusterState, a: Assignment, snap: Snapshot, now: float) -> Outcome | None:
    """A node with only spares: start again after a restart it took no part in; end when the run is gone."""
    if snap.current is not None and snap.current > a.generation:
        return Outcome(OutcomeKind.MEMBERSHIP, f"the run went on to generation {snap.current} by a restart; this "
                                               "node's spares start again in it")
    try:
        place = _take_place(ctx, cs, a, snap, now)
        nodes = set(cs.with_nodes(snap.view, now, NODES_EVERY_S).nodes)
    except ControlStoreError as e:
        _store_error(ctx, e)
        place, nodes = None, set()
    if place is not None:
        return place
    if snap.live and nodes and not nodes & snap.live:
        cs.orphaned_since = cs.orphaned_since or now
        if now - cs.orphaned_since > ORPHANED_S:
            return Outcome(OutcomeKind.VERDICT, f"no node holding the run's ranks (generation {a.generation}: "
                                                f"{', '.join(sorted(nodes))}) has been alive for "
                                                f"{ORPHANED_S:.0f} s; this node's spares are no longer needed")
    else:
        cs.orphaned_since = None
    return None


def _take_place(ctx: GenerationContext, cs: ClusterState, a: Assignment, snap: Snapshot,
                now: float) -> Outcome | None:
    """The run restarts after generation ``a`` without some of its nodes (lost: their peers no longer reach them):
    a spare node takes one lost node's place in the restart's rendezvous, so that the run restarts at its size
    at once instead of waiting for the node to come back.  Each lost node's place is claimed once in the store;
    a spare node takes at most one."""
    if cs.places_claimed >= a.generation or not snap.live:
        return None
    if ctx.shared.restarted(a.generation) is None:
        return None  # not a restart (yet): an in-process recovery may still take this node's spares
    nodes = set(cs.with_nodes(snap.view, now, NODES_EVERY_S).nodes)
    lost = sorted(nodes - snap.live)
    if not lost or not nodes & snap.live:
        return None  # none lost; or none left to restart with (the run ends, see _idle)
    for slot, node in enumerate(lost):
        if ctx.shared.take_place(a.generation, slot):
            return Outcome(OutcomeKind.MEMBERSHIP, f"the run restarts after generation {a.generation} without node "
                                                   f"{node} (lost): this spare node takes its place",
                           takes_place_of=node)
    cs.places_claimed = a.generation
    return None


def _relay(ctx: GenerationContext, group: WorkerGroup, a: Assignment, cs: ClusterState, now: float) -> None:
    """This node's news for the others: survivors that wait, members that opted in, spares ready or gone."""
    inp = ctx.inproc
    assert inp is not None
    for worker, report in inp.waiting_now(a.generation, [w.worker_id for w in group.workers.values()]).items():
        if (a.generation, worker) not in cs.relayed:
            cs.involved.setdefault(a.generation, Involvement(since=now))
            cs.store.report(a.generation, "waiting", worker, report)  # a store error: relayed again next pass
            cs.relayed.add((a.generation, worker))
    ids = [w.worker_id for w in group.workers.values()]
    if ids and cs.opted_in_published != a.generation and inp.opted_in(ids):
        _publish_node(ctx, group, cs, a.generation, opted_in=True)
        cs.opted_in_published = a.generation
    for worker, ready_wall in inp.ready_spares_wall(list(group.spares)).items():
        if worker not in cs.store.registered:
            cs.store.register_spare(worker, ready_wall)
    for worker in sorted(cs.store.registered - set(group.spares)):
        cs.store.unregister_spare(worker)  # it exited, or it was promoted: out of the pool either way


def _grow(ctx: GenerationContext, group: WorkerGroup, a: Assignment, gdir: Any, snap: Snapshot,
          now: float) -> Assignment | None:
    """The node holding rank 0 grows a shrunk world onto settled pool spares, a little ahead of every rank."""
    inp = ctx.inproc
    assert inp is not None and inp.cluster is not None
    cs = inp.cluster
    view = snap.view
    pool = [s for s in snap.pool if s.claimed is None and s.node in snap.live]
    if not pool or view.failing() or view.claim is not None:
        return None  # nothing to grow onto, or a failure of this generation is being answered
    view = cs.with_nodes(view, now, NODES_EVERY_S)
    if not view.complete() or not all(n.get("opted_in") for n in view.nodes.values()):
        return None
    boundary = grow_boundary(ctx, group, a, now, GROW_LEAD_S)
    if boundary is None:
        return None
    at_step = boundary.at_step
    members = view.members()
    spares = [Spare(id=s.worker, node=s.node, ready_since=now - max(0.0, time.time() - s.ready_wall)) for s in pool]
    decision = decide_grow(membership_of(ctx, view, members), spares, step=at_step, costs=inp.costs(), cfg=inp.ladder,
                           now=now, remaining_s=boundary.remaining_s)
    if decision.action is not GrowAction.GROW:
        return None
    held = cs.store.claim(a.generation, "grow")
    if held is None:
        return None
    by_id = {s.worker: s for s in pool}
    try:
        counter, counter_revision = cs.store.counter()
        if counter != a.generation:
            cs.store.release_claim(held)  # a restart is under way: this generation is not the one to grow
            return None
        generation = a.generation + 1
        new_members = [{"worker_id": w, "node": n, "new_rank": r, "old_rank": r}
                       for r, (w, n) in sorted(members.items())]
        new_members += [{"worker_id": p.spare, "node": p.node, "new_rank": p.rank, "old_rank": None}
                        for p in decision.joiners]
        body = {"action": "grow", "reason": f"{decision.reason} (at step {at_step})", "node": ctx.config.node_id,
                "generation": generation, "world_size": decision.world_size, "step": at_step, "at_step": at_step,
                "members": new_members, "source_rank": 0, "store": f"{inp.host}:{inp.port}", "incident": None,
                "promotions": [{"rank": p.rank, "spare": p.spare, "node": p.node} for p in decision.joiners],
                "dropped": []}
        outcome = cs.store.commit(held, a.generation, body, spares=[by_id[p.spare] for p in decision.joiners],
                                  counter_revision=counter_revision)
        if outcome is not claims.Outcome.COMMITTED:
            if outcome in (claims.Outcome.SPARES_MOVED, claims.Outcome.COUNTER_MOVED):
                cs.store.release_claim(held)  # grow later, over the pool as it is then
            return None  # or another agent's decision arrives through the watch
    except ControlStoreError:
        try:
            cs.store.release_claim(held)
        except ControlStoreError:
            pass  # the store is out: the claim goes with this agent's lease
        raise
    inp.note_decision(f"grow: {decision.reason}", decision.to_event())
    result = _apply(ctx, group, a, gdir, body, now)
    return result if isinstance(result, Assignment) else None


def _apply(ctx: GenerationContext, group: WorkerGroup, a: Assignment, gdir: Any, body: dict[str, Any],
           now: float) -> Assignment | Outcome | str:
    """Carry out this node's part of the decision that follows generation ``a``."""
    inp = ctx.inproc
    assert inp is not None and inp.cluster is not None
    cs = inp.cluster
    action = str(body.get("action"))
    if action not in ("retry_in_place", "promote_spare", "shrink", "grow"):
        why = f"node {body.get('node')} decided {action} after generation {a.generation}: {body.get('reason')}"
        if not group.workers:
            return Outcome(OutcomeKind.MEMBERSHIP, why)
        return why
    generation = int(body["generation"])
    me = ctx.config.node_id
    members = [Member(worker_id=m["worker_id"], new_rank=int(m["new_rank"]), old_rank=m["old_rank"])
               for m in body["members"]]
    mine = {m["worker_id"]: int(m["new_rank"]) for m in body["members"] if m["node"] == me}
    for rank, worker in list(group.workers.items()):
        if worker.worker_id not in mine:
            if worker.exit is None:  # dropped while alive (presumed lost): it must not wait for a group forever
                worker.signal(signal.SIGKILL)
            group.retire(rank)
    group.renumber({r: mine[w.worker_id] for r, w in group.workers.items()})
    for worker_id, rank in mine.items():
        if worker_id in group.spares:
            inp.promote(group, worker_id, rank)
    host, port = str(body["store"]).rsplit(":", 1)
    local = set(mine) | set(group.spares)
    standby = [w for w in group.spares if w not in mine]
    plans = plan_assignments(generation, members, int(body["source_rank"]), host, int(port), standby)
    inp.publish([p for p in plans if p.worker_id in local])
    if action == "grow":
        inp.signal_grow(grow_key(a.generation), generation, int(body["at_step"]))
    cs.following, cs.world_size = generation, int(body["world_size"])
    inv = cs.involved.pop(a.generation, None)
    cs.involved = {g: v for g, v in cs.involved.items() if g > a.generation}
    cs.relayed = {(g, w) for g, w in cs.relayed if g > a.generation}
    pids = {r: w.pid for r, w in group.workers.items()}
    if mine:
        inp.under_way(generation=generation, rung=action, world_size=cs.world_size,
                      promotions=tuple((int(p["rank"]), str(p["spare"])) for p in body["promotions"]
                                       if p["spare"] in mine),
                      dropped=tuple(body["dropped"]), members=mine,
                      detected_at=inv.since if inv is not None else now,
                      incident_id=body["incident"] if body.get("node") == me else None, step=int(body["step"]))
        if inv is not None and action != "grow":
            ctx.accounting.failure(inv.detected_at or inv.since, inv.last_progress_at or inv.since,
                                   str(body.get("incident") or f"g{a.generation:04d}"),
                                   inv.incident.kind if inv.incident is not None else "collective")
    moved = continue_as(ctx, group, a, gdir, generation, pids, action, str(body["reason"]),
                        world_size=cs.world_size, decided_by=body.get("node"))
    try:
        if group.workers:
            _publish_node(ctx, group, cs, generation, opted_in=True)
    except ControlStoreError as e:
        _store_error(ctx, e)
    return moved
