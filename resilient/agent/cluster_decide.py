"""The decision across machines: what follows a generation that failed (:mod:`resilient.agent.cluster_flow`).

Taken over what every node published: the members, who waits, who was
lost, who fell silent (presumed lost with their node once the settle time
passed), the pool's spares and the batch plan.  The decision is the same
one as on one machine (:func:`resilient.agent.decision.decide`: the
exit-code contract, the ladder, the restart policy).

The collector asks the ladder first without claiming anything: while it
holds for a repair, the collector asks again on every pass of its watch
loop, and such a pass writes nothing (a write under the launch's recovery
keys would wake every agent's watch, the collector's own included, and its
loop would pass again at once).  The loop still passes once a monitor
interval, so the hold is weighed again as its bound nears, and a spare
joining the pool or a node's presence changing wakes it sooner.  Only when
the ladder acts does the collector take the generation's claim and ask
again under it, over the pool as it is then.  The decision is committed in
one transaction with the spares it promotes and the run's generation
counter (:mod:`resilient.coord.claims`): a spare another decision took, or
a restart that moved the counter, makes the commit fail whole, and the
ladder is asked again over the pool as it is.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ..coord import claims
from ..coord.store import ControlStoreError
from ..elastic.batch import feasible_world_sizes
from ..elastic.decide import Action, RecoveryDecision
from ..elastic.observe import Fault, FaultKind, Membership, Observation, Spare
from .cluster import GenerationView, Involvement, PoolEntry, folded_at_step
from .decision import Restarts
from .incidents import Incident
from .inproc import FOLDED_PER_STEP
from .inproc_state import clean_position
from .outcome import settle_s
from .policy import Failure

if TYPE_CHECKING:
    from .context import GenerationContext
    from .rendezvous import Assignment


def decide(ctx: GenerationContext, a: Assignment, view: GenerationView, inv: Involvement,
           now: float) -> dict[str, Any] | str | None:
    """What follows generation ``a``, once every member is accounted for (or the settle time passed): the
    decision's body as published, a problem (restart), or None (not yet, the ladder holds for a repair, or
    another agent decides).  The ladder is asked before the generation is claimed, so a hold writes nothing."""
    inp = ctx.inproc
    assert inp is not None and inp.cluster is not None
    cs = inp.cluster
    view = cs.store.reports(view)  # the nodes and the waits are outside the watch: read by the collector alone
    members = view.members()
    accounted = set(view.waiting) | set(view.lost)
    missing = {r: wn for r, wn in members.items() if wn[0] not in accounted}
    if not view.complete():
        if now - inv.since < settle_s(ctx):
            return None
        return f"generation {a.generation}'s membership was never published by every node"
    if missing:
        # A member that neither waits nor was reported lost is lost only with its node (judged lost from its
        # peers' probes, or its presence lease): a live node's member may be outside any collective for a while
        # (it fails in its next).
        live = cs.store.live_nodes()
        alive = sorted(r for r, (_, node) in missing.items() if node in live)
        if alive:
            if now - inv.since < ctx.config.recovery_timeout_s:
                return None
            return (f"ranks {alive} on live nodes neither left the failed group of generation {a.generation} nor "
                    f"failed within {ctx.config.recovery_timeout_s:g} s")
    failed = _failed(ctx, view, inv, now, members, missing)
    _, obs = observation(ctx, view, members, failed.fault, failed.survivor_steps, cs.store.live_nodes(), now,
                         inv.wait_since, failed.dirty)
    ahead = inp.decide_cluster(failed.failure, failed.restarts, obs)  # asked holding nothing: a hold writes nothing
    if ahead.action is Action.WAIT_FOR_REPAIR:
        inp.report_cluster(ahead, obs)
        if inv.wait_since is None:
            inv.wait_since = now
        return None
    held = cs.store.claim(a.generation, "recover")
    if held is None:
        return None  # another agent decides; its decision arrives through the watch
    try:
        return _decided(ctx, a, view, inv, now, members, failed, held)
    except ControlStoreError:
        try:  # never leave the generation claimed by an agent that is not deciding (a commit in doubt included)
            cs.store.release_claim(held)
        except ControlStoreError:
            pass  # the store is out: the claim goes with this agent's lease if it is out for long
        raise


@dataclass(frozen=True)
class _Failed:
    """The failure of a generation as every node reported it, what the ladder is asked about."""

    kind: FaultKind
    step: int
    """The newest step any member reached (the one whose attempt failed)."""
    detail: str
    fault: Fault
    failure: Failure
    """This node's view of it (its own member's failure, else its collectives failed or a node went silent)."""
    restarts: Restarts
    """The run's restart history when the failure was read, for the restart policy's rungs."""
    survivor_steps: dict[int, int]
    """Each survivor's last completed step (members without state take the newest)."""
    dirty: frozenset[int]
    """Survivors whose state is partial (they failed inside or after the optimizer's update)."""


def _failed(ctx: GenerationContext, view: GenerationView, inv: Involvement, now: float,
            members: dict[int, tuple[str, str]], missing: dict[int, tuple[str, str]]) -> _Failed:
    """The fault, its step and the survivors' states from the members' reports (``view``, read whole), with
    ``missing`` (members that neither wait nor were reported lost) presumed lost."""
    rank_of = {w: r for r, (w, _) in members.items()}
    lost = {int(b["rank"]) for b in view.lost.values()} | set(missing)
    speaking = {str(b.get("node")) for b in [*view.waiting.values(), *view.lost.values()]}
    silent = frozenset(n for _, n in missing.values() if n not in speaking)
    if any(b.get("kind") == "hang" for b in view.lost.values()):
        kind = FaultKind.HANG
    elif view.lost and all(b.get("kind") == "straggler" for b in view.lost.values()):
        kind = FaultKind.STRAGGLER
    elif view.lost or (missing and not silent):
        kind = FaultKind.CRASH
    elif silent:
        kind = FaultKind.NODE_LOST
    else:
        kind = FaultKind.COLLECTIVE_ERROR
    steps = {rank_of[w]: int(b.get("step") or 0) for w, b in view.waiting.items()
             if w in rank_of and not b.get("stateless")}
    if steps:  # members without state (a promoted spare whose generation failed as it formed) take the source's
        steps.update({rank_of[w]: max(steps.values()) for w, b in view.waiting.items()
                      if w in rank_of and b.get("stateless")})
    dirty = frozenset(rank_of[w] for w, b in view.waiting.items() if w in rank_of and not clean_position(b))
    step = max([*steps.values(), *(int(b.get("step") or 0) for b in view.lost.values())], default=0)
    codes = frozenset(c for b in view.lost.values() for c in b.get("exit_codes") or () if c)
    detail = describe(view, missing, silent, kind, step)
    fault = Fault(kind=kind, step=step, ranks=frozenset(lost) if kind is not FaultKind.COLLECTIVE_ERROR else frozenset(),
                  nodes=silent, exit_codes=codes, detail=detail)
    # This node's own view when none of its members died: its collectives failed (or a node went silent).
    failure = inv.failure or Failure(kind="node_lost" if kind is FaultKind.NODE_LOST else "collective", time=now,
                                     node=", ".join(sorted(silent)) or ctx.config.node_id, step=step, detail=detail)
    return _Failed(kind=kind, step=step, detail=detail, fault=fault, failure=failure,
                   restarts=ctx.generations.restarts(),
                   survivor_steps={r: s for r, s in steps.items() if r not in lost}, dirty=dirty - lost)


def _decided(ctx: GenerationContext, a: Assignment, view: GenerationView, inv: Involvement, now: float,
             members: dict[int, tuple[str, str]], failed: _Failed, held: claims.Claim) -> dict[str, Any] | None:
    """The decision, once this agent holds the generation's claim (the ladder is asked again: the pool may have
    moved since it was asked without it), committed in one transaction with the spares it promotes; None when it
    was not (another agent's decision, a claim lost, the ladder says wait after all)."""
    inp = ctx.inproc
    assert inp is not None and inp.cluster is not None
    cs = inp.cluster
    world = len(members)
    kind, step, detail = failed.kind, failed.step, failed.detail
    live = cs.store.live_nodes()
    for _ in range(3):
        pool, obs = observation(ctx, view, members, failed.fault, failed.survivor_steps, live, now,
                                inv.wait_since, failed.dirty)
        decision = inp.decide_cluster(failed.failure, failed.restarts, obs)
        inp.report_cluster(decision, obs)
        if decision.action is Action.WAIT_FOR_REPAIR:
            if inv.wait_since is None:
                inv.wait_since = now
            cs.store.release_claim(held)
            return None
        if decision.action not in (Action.RETRY_IN_PLACE, Action.PROMOTE_SPARE, Action.SHRINK):
            body: dict[str, Any] = {"action": decision.action.value, "reason": decision.reason,
                                    "node": ctx.config.node_id}
            return body if _committed(cs.store.commit(held, a.generation, body), cs, held) else None
        counter, counter_revision = cs.store.counter()
        if counter != a.generation:
            body = {"action": "restart", "node": ctx.config.node_id,
                    "reason": f"the run's generation counter moved to {counter} while generation {a.generation} "
                              "was being recovered in process (a restart ran meanwhile)"}
            return body if _committed(cs.store.commit(held, a.generation, body), cs, held) else None
        generation = a.generation + 1
        by_id = {s.worker: s for s in pool}
        promoted = {p.rank: p for p in decision.promotions}
        new_members: list[dict[str, Any]] = []
        for old, new in sorted(decision.rank_map(world).items(), key=lambda kv: kv[1]):
            if old in promoted:
                new_members.append({"worker_id": promoted[old].spare, "node": promoted[old].node, "new_rank": new,
                                    "old_rank": None})
            else:
                new_members.append({"worker_id": members[old][0], "node": members[old][1], "new_rank": new,
                                    "old_rank": old})
        incident = incident_of(ctx, a, inv, kind, step, detail, decision, generation)
        body = {"action": decision.action.value, "reason": decision.reason, "node": ctx.config.node_id,
                "generation": generation, "world_size": decision.world_size, "step": step, "members": new_members,
                "source_rank": min(m["new_rank"] for m in new_members if m["old_rank"] is not None),
                "store": f"{inp.host}:{inp.port}", "incident": incident.id,
                "promotions": [{"rank": p.rank, "spare": p.spare, "node": p.node} for p in decision.promotions],
                "dropped": list(decision.dropped_ranks)}
        outcome = cs.store.commit(held, a.generation, body, spares=[by_id[p.spare] for p in decision.promotions],
                                  counter_revision=counter_revision)
        if outcome is claims.Outcome.SPARES_MOVED:
            continue  # a spare was taken or left meanwhile: decide again over the pool as it is now
        if not _committed(outcome, cs, held):
            return None
        ctx.books.record_incident(incident)
        return body
    cs.store.release_claim(held)
    return None


def _committed(outcome: claims.Outcome, cs: Any, held: claims.Claim) -> bool:
    """True when this agent's decision is the generation's; otherwise the claim is given back where it is still
    held (the counter moved, or the pool kept moving) and the watch brings whatever was decided."""
    if outcome is claims.Outcome.COMMITTED:
        return True
    if outcome in (claims.Outcome.COUNTER_MOVED, claims.Outcome.SPARES_MOVED):
        cs.store.release_claim(held)
    return False


def observation(ctx: GenerationContext, view: GenerationView, members: dict[int, tuple[str, str]], fault: Fault,
                survivor_steps: dict[int, int], live: set[str], now: float,
                waiting_since: float | None, dirty: frozenset[int] = frozenset()) -> tuple[list[PoolEntry], Observation]:
    """What the ladder decides over across machines: every node's members and opt-in, the pool's spares on live
    nodes (read now), the batch plan; with the pool entries the spares came from."""
    assert ctx.inproc is not None and ctx.inproc.cluster is not None
    workers = {w for w, _ in members.values()}
    pool = [s for s in ctx.inproc.cluster.store.pool() if s.node in live and s.worker not in workers]
    spares = [Spare(id=s.worker, node=s.node, ready_since=now - max(0.0, time.time() - s.ready_wall),
                    claimed=s.claimed is not None) for s in pool]
    opted = all(n.get("opted_in") for n in view.nodes.values()) and ctx.config.in_process
    replicas = next((n["replicas"] for n in view.nodes.values() if n.get("replicas") is not None), None)
    return pool, Observation(fault=fault, membership=membership_of(ctx, view, members), spares=spares,
                             survivor_steps=survivor_steps, opted_in=opted, dirty=dirty,
                             declined=ctx.inproc.declined, inproc_failures=inproc_failures(ctx, fault.step),
                             waiting_since=waiting_since, replicas=replicas)


def inproc_failures(ctx: GenerationContext, step: int) -> int:
    """In-process recoveries of ``step`` that failed, counted across the launch: this agent's own count, or the
    failures folded into later decisions past ``FOLDED_PER_STEP`` whoever decided them (each agent counts only
    the recoveries it followed, and successive decisions may be taken by different agents)."""
    assert ctx.inproc is not None and ctx.inproc.cluster is not None
    watch = ctx.inproc.cluster.watch
    folded = folded_at_step(watch.decisions(), step) if watch is not None else 0
    return max(ctx.inproc.failed_recoveries(step), folded - FOLDED_PER_STEP)


def preview(ctx: GenerationContext, a: Assignment, lost: dict[int, str], kind: FaultKind,
            failure: Failure) -> tuple[RecoveryDecision, int, bool]:
    """What the ladder across machines would answer to losing ``lost`` of this node now, reported nowhere, with
    the world's size and whether every node's script opted in.  The store is read (ControlStoreError when it
    is out).  Every survivor is taken to agree on ``failure.step``: the other nodes' steps are theirs to report
    when a rank is lost, and the decision checks them."""
    inp = ctx.inproc
    assert inp is not None and inp.cluster is not None
    view = inp.cluster.store.view(a.generation)
    members = view.members()
    step = failure.step or 0
    fault = Fault(kind=kind, step=step, ranks=frozenset(lost), detail=failure.describe())
    _, obs = observation(ctx, view, members, fault,
                         {r: step for r in members if r not in lost}, inp.cluster.store.live_nodes(), ctx.clock(), None)
    return inp.decide_cluster(failure, ctx.generations.restarts(), obs), len(members), obs.opted_in


def describe(view: GenerationView, missing: dict[int, tuple[str, str]], silent: frozenset[str], kind: FaultKind,
              step: int) -> str:
    parts = [str(b.get("detail")) for b in view.lost.values()]
    if silent:
        parts.append(f"node {', '.join(sorted(silent))} was lost with ranks {sorted(missing)} (its agent answers "
                     "neither its peers' probes nor the store)")
    if kind is FaultKind.COLLECTIVE_ERROR:
        first = next(iter(view.waiting.values()), {})
        parts.append(f"every rank's collective failed at step {step}, none died: {str(first.get('error'))[:200]}")
    return "; ".join(parts)[:600]


def membership_of(ctx: GenerationContext, view: GenerationView, members: dict[int, tuple[str, str]]) -> Membership:
    c = ctx.config
    assert ctx.inproc is not None and ctx.inproc.cluster is not None
    world = len(members)
    max_size = c.max_nodes * c.nproc_per_node
    batch = next((n["batch"] for n in view.nodes.values() if n.get("batch")), None)
    full = max(ctx.inproc.cluster.full_size, world)
    if batch is not None:
        full = max(world, int(batch["global_batch"]) // int(batch["micro_batch"]))
        feasible = feasible_world_sizes(int(batch["global_batch"]), int(batch["micro_batch"]), 1, max(max_size, full),
                                        batch.get("batch_rule") or "refuse")
    else:
        feasible = frozenset({world})
    return Membership(rank_nodes=tuple(members[r][1] for r in range(world)),
                      min_size=min(c.min_nodes * c.nproc_per_node, world), max_size=max(max_size, full, world),
                      full_size=full, feasible_world_sizes=feasible)


def incident_of(ctx: GenerationContext, a: Assignment, inv: Involvement, kind: FaultKind, step: int, detail: str,
              decision: Any, generation: int) -> Incident:
    incident = inv.incident or Incident(
        id=f"g{a.generation:04d}-{ctx.config.node_id}", node=ctx.config.node_id, generation=a.generation,
        kind="node_lost" if kind is FaultKind.NODE_LOST else "collective",
        rank=None, pid=None, section="step", step=step, summary=detail)
    return replace(incident, decision={"action": decision.action.value, "reason": decision.reason, "verdict": None,
                                       "delay_s": 0.0, "generation": generation})
