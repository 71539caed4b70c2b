"""The recovery ladder: which in-process rung answers a failure, and when a shrunk run grows back.

:func:`decide_recovery` is a pure function of an :class:`Observation` (the
fault, the membership, the spare pool, the survivors' state), the measured
:class:`~resilient.elastic.costs.RecoveryCosts`, a :class:`LadderConfig` and
``now``.  It is one part of the agent's single decision per failure
(:func:`resilient.agent.decision.decide`), which checks the exit-code
contract before it and hands a RESTART to the restart policy after it.
Checks, in order, cheapest rung first:

1. in-process blockers: the script did not opt in (``run.attempt()``), no
   survivor holds the replicated state, a lost rank's shard has no surviving
   replica (sharded state: pure FSDP, or every HSDP replica of it lost),
   survivors' states diverged or disagree on the last completed step, an
   unhealthy node's ranks are alive
   (they must move), or in-process recovery of this step already failed
   ``max_inproc_retries_per_step`` times (no loop of failing re-formations).
   Any of them: RESTART (the restart policy says when, or STOP);
2. every rank alive, a collective failed: RETRY_IN_PLACE among the same members;
3. a warm, healthy, unclaimed spare for every lost rank: PROMOTE_SPARE
   (same rank; no spare is ever named twice, the lowest lost ranks first);
4. the ranks left without a spare: SHRINK (with the promotions that were
   possible; never for sharded state, which cannot be resharded in process)
   when the smaller world is >= MIN and feasible for the batch plan
   and shrinking beats holding (:func:`~resilient.elastic.costs.shrink_or_wait`);
   else WAIT_FOR_REPAIR while a return is expected within ``max_wait_s`` and
   cheaper than a restart; else RESTART.

Ranks dropped by a shrink are the highest lost ranks: a spare then fills the
lowest, and survivors above a dropped rank move down by as little as possible.
Growing back is a separate decision (:mod:`resilient.elastic.grow`).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ..core.errors import ConfigError
from .costs import RecoveryCosts, shrink_or_wait
from .observe import FaultKind, Observation, pick_spares, ranks_text

__all__ = ["Action", "LadderConfig", "Promotion", "RecoveryDecision", "decide_recovery"]


class Action(enum.Enum):
    """The rungs of the recovery ladder, cheapest first."""

    RETRY_IN_PLACE = "retry_in_place"
    PROMOTE_SPARE = "promote_spare"
    SHRINK = "shrink"
    WAIT_FOR_REPAIR = "wait_for_repair"
    RESTART = "restart"
    STOP = "stop"


@dataclass(frozen=True, kw_only=True)
class LadderConfig:
    """Bounds on the ladder: how often in-process recovery is retried, how long a repair is awaited."""

    in_process: bool = True
    """False keeps restart-based recovery only, whatever the script opted into."""
    max_inproc_retries_per_step: int = 1
    """In-process recoveries of one step that may fail before the ladder restarts instead."""
    max_wait_s: float = 300.0
    """Longest hold for a repair, counted from the first WAIT_FOR_REPAIR of a failure; 0 never waits."""
    grow_settle_s: float = 5.0
    """A spare must have been ready this long before the run grows onto it (a flapping node would cost
    a grow and a shrink each time it comes and goes)."""

    def __post_init__(self) -> None:
        if self.max_inproc_retries_per_step < 0:
            raise ConfigError(
                f"LadderConfig.max_inproc_retries_per_step={self.max_inproc_retries_per_step} must be >= 0 "
                "(0 makes a failed in-process recovery fall back to a restart at once)"
            )
        for name in ("max_wait_s", "grow_settle_s"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ConfigError(f"LadderConfig.{name}={value} must be a finite number of seconds >= 0")


@dataclass(frozen=True)
class Promotion:
    """A spare taking a rank: the lost rank it replaces, or a new rank when the world grows."""

    rank: int
    spare: str
    node: str


def _frozen_numbers(numbers: Mapping[str, float]) -> Mapping[str, float]:
    return MappingProxyType(dict(numbers))


def _json_number(value: float) -> float | None:
    # JSON has no infinity; an unbounded number (an unknown repair time) is written as null.
    return None if math.isinf(value) or math.isnan(value) else value


@dataclass(frozen=True, kw_only=True)
class RecoveryDecision:
    """What the ladder does about one failure, and why, with the numbers it compared."""

    action: Action
    reason: str
    """One line for an on-call engineer, with the numbers."""
    step: int
    """The step whose attempt failed: retried in-process, or replayed from a commit by a restart."""
    world_size: int
    """World size once the decision is carried out (the current one for WAIT_FOR_REPAIR, RESTART, STOP)."""
    promotions: tuple[Promotion, ...] = ()
    """Spares promoted into lost ranks (PROMOTE_SPARE, and SHRINK when some lost ranks had a spare)."""
    dropped_ranks: tuple[int, ...] = ()
    """Lost ranks a SHRINK continues without."""
    not_before: float
    """Caller's clock: act at once (``now``) or, for a restart, after its backoff."""
    wait_until: float | None = None
    """WAIT_FOR_REPAIR: hold until a member returns or this time, then decide again."""
    verdict: str | None = None
    """STOP: why the run stops (``do_not_restart``, or the restart policy's verdict)."""
    exit_code: int | None = None
    """STOP by the exit-code contract: the code a rank exited with (78 or 79), which its agent exits with."""
    numbers: Mapping[str, float] = field(default_factory=dict)
    """The quantities the choice compared (costs, r, R, gain), for the event log."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "numbers", _frozen_numbers(self.numbers))
        assert (self.action is Action.STOP) == (self.verdict is not None), (self.action, self.verdict)
        assert (self.action is Action.WAIT_FOR_REPAIR) == (self.wait_until is not None), self.action
        assert not self.dropped_ranks or self.action is Action.SHRINK, self.action

    @property
    def delay_s(self) -> float:
        """RESTART: the restart policy's backoff before the workers start again (0 for any other action)."""
        return float(self.numbers.get("delay_s", 0.0))

    def rank_map(self, old_world: int) -> Mapping[int, int]:
        """Old rank -> new rank for every member after the decision: promoted spares keep the lost rank;
        after a shrink the remaining ranks close up in their old order."""
        dropped = set(self.dropped_ranks)
        kept = [rank for rank in range(old_world) if rank not in dropped]
        return MappingProxyType({old: new for new, old in enumerate(kept)})

    def to_event(self) -> dict[str, Any]:
        """The decision as a JSON-ready dict for the event log (unbounded numbers as null)."""
        return {
            "action": self.action.value,
            "reason": self.reason,
            "step": self.step,
            "world_size": self.world_size,
            "promotions": [{"rank": p.rank, "spare": p.spare, "node": p.node} for p in self.promotions],
            "dropped_ranks": list(self.dropped_ranks),
            "not_before": self.not_before,
            "wait_until": self.wait_until,
            "verdict": self.verdict,
            **({"exit_code": self.exit_code} if self.exit_code is not None else {}),
            "numbers": {name: _json_number(value) for name, value in self.numbers.items()},
        }


def _restart(obs: Observation, why: str, now: float, numbers: Mapping[str, float]) -> RecoveryDecision:
    """In-process recovery cannot answer: a restart (the restart policy, asked next, says when, or stops)."""
    return RecoveryDecision(action=Action.RESTART, reason=why, step=obs.fault.step,
                            world_size=obs.membership.world_size, not_before=now, numbers=numbers)


def _inproc_blockers(obs: Observation, cfg: LadderConfig) -> list[str]:
    """Every reason in-process recovery cannot answer this failure (empty when it can)."""
    blockers: list[str] = []
    fault, members = obs.fault, obs.membership
    survivors = obs.survivors
    if not cfg.in_process:
        blockers.append("in-process recovery is turned off (LadderConfig.in_process=False)")
    if obs.declined is not None:
        blockers.append(f"the workers declined it: {obs.declined}")
    elif not obs.opted_in:
        blockers.append("the script did not opt in (Run(ddp=True) with the step under `with run.attempt():`)")
    if not survivors:
        blockers.append(f"no survivor holds the replicated state (all {members.world_size} ranks lost)")
    elif obs.unreplicated():
        alone = obs.unreplicated()
        why = ("pure FSDP: each shard exists on one rank only" if all(len(g) == 1 for g in obs.replicas or ())
               else "every replica of it was lost")
        blockers.append(f"no survivor holds a copy of the sharded state of {ranks_text(alone, verb=False)} ({why}), "
                        "so only a restart restores it (from the node's memory tier, else the newest commit)")
    if fault.kind is FaultKind.UNHEALTHY:
        moving = sorted(r for r in survivors if members.rank_nodes[r] in fault.nodes)
        if moving:
            nodes = ", ".join(sorted(fault.nodes))
            blockers.append(f"node {nodes} is unhealthy and its {ranks_text(moving)} alive: they must move off it")
    spoiled = sorted(obs.dirty & set(survivors))
    uncopied = obs.without_clean_copy()
    if spoiled and uncopied:
        whose = ("the state" if obs.replicas is None
                 else f"the shards of {ranks_text(uncopied, verb=False)}")
        blockers.append(
            f"{ranks_text(spoiled)} dirty (they failed inside or after optimizer.step() of step {fault.step}, "
            f"part of its update applied or its step unfinished) and no clean survivor holds {whose}, so the "
            "newest commit is the only clean copy")
    diverged = sorted(obs.diverged & set(survivors))
    if diverged:
        blockers.append(f"{ranks_text(diverged, verb=False)} reported diverged in-memory state")
    silent = sorted(set(survivors) - set(obs.survivor_steps))
    if silent:
        blockers.append(f"{ranks_text(silent, verb=False)} reported no last completed step, so consistency is unknown")
    steps = {obs.survivor_steps[r] for r in survivors if r in obs.survivor_steps}
    if len(steps) > 1:
        seen = ", ".join(f"rank {r}: {obs.survivor_steps[r]}" for r in survivors if r in obs.survivor_steps)
        blockers.append(f"survivors disagree on the last completed step ({seen})")
    if obs.inproc_failures >= cfg.max_inproc_retries_per_step:
        blockers.append(
            f"{obs.inproc_failures} in-process recover{'y' if obs.inproc_failures == 1 else 'ies'} of step "
            f"{fault.step} already failed (max_inproc_retries_per_step={cfg.max_inproc_retries_per_step})"
        )
    return blockers


def decide_recovery(obs: Observation, costs: RecoveryCosts, cfg: LadderConfig, now: float) -> RecoveryDecision:
    """The cheapest rung of the ladder that can answer ``obs.fault``, with its reason; see the module doc."""
    fault, members = obs.fault, obs.membership
    what = obs.describe_fault()
    world = members.world_size
    base = {"inproc_s": costs.inproc_s, "restart_s": costs.restart_s}

    blockers = _inproc_blockers(obs, cfg)
    if blockers:
        return _restart(obs, f"in-process recovery impossible: {'; '.join(blockers)}", now, base)

    agreed = obs.survivor_steps[obs.survivors[0]]  # the blockers made sure every survivor reported the same
    if fault.kind is FaultKind.COLLECTIVE_ERROR:
        return RecoveryDecision(
            action=Action.RETRY_IN_PLACE, step=fault.step, world_size=world, not_before=now, numbers=base,
            reason=(f"retry step {fault.step} in place: {what}; all {world} ranks alive and agree on step "
                    f"{agreed}; re-form among the same members (~{costs.inproc_s:.1f} s, a restart "
                    f"~{costs.restart_s:.1f} s)"),
        )

    lost = obs.lost_ranks
    spares = pick_spares(obs.spares, len(lost), avoid_nodes=obs.bad_nodes)
    # The lowest lost ranks get the spares: the ranks a shrink drops are then the highest, so the
    # survivors above them keep their ranks.
    promotions = tuple(Promotion(rank=r, spare=s.id, node=s.node) for r, s in zip(lost, spares))
    promoted = ", ".join(f"spare {p.spare} (node {p.node}) into rank {p.rank}" for p in promotions)
    left = lost[len(promotions):]
    numbers = {**base, "spare_s": costs.spare_s}
    if not left:
        return RecoveryDecision(
            action=Action.PROMOTE_SPARE, step=fault.step, world_size=world, promotions=promotions, not_before=now,
            numbers=numbers,
            reason=(f"promote {promoted} and retry step {fault.step}: {what}; survivors agree on step "
                    f"{agreed}; re-form in-process (~{costs.spare_s:.1f} s, a restart "
                    f"~{costs.restart_s:.1f} s)"),
        )

    no_spare = f"no ready spare for {ranks_text(left, verb=False)}" + (f" (promoting {promoted})" if promotions else "")
    new_world = world - len(left)
    wait_note, wait_until = _wait_window(obs, costs, cfg, now)
    if obs.replicas is not None:
        why_not = f"sharded state cannot be resharded in process, so the run does not shrink to {new_world} ranks"
    elif new_world < members.min_size:
        why_not = f"shrinking {world} -> {new_world} would go below the minimum world size {members.min_size}"
    elif new_world not in members.feasible_world_sizes:
        feasible = ", ".join(map(str, sorted(members.feasible_world_sizes))) or "none"
        why_not = (f"{new_world} ranks cannot keep the global batch (feasible world sizes: {feasible})")
    else:
        sw = shrink_or_wait(costs, new_world, members.full_size)
        numbers = {**numbers, "shrink_s": costs.shrink_s, "grow_s": costs.grow_s, "r": sw.r, "gain_s": sw.gain_s,
                   "repair_s": math.inf if sw.repair_s is None else sw.repair_s}
        if sw.shrink or wait_until is None:
            why = sw.describe() if sw.shrink else f"{sw.describe()}, but {wait_note}"
            return RecoveryDecision(
                action=Action.SHRINK, step=fault.step, world_size=new_world, promotions=promotions,
                dropped_ranks=tuple(left), not_before=now, numbers=numbers,
                reason=(f"shrink {world} -> {new_world} ranks, dropping {ranks_text(left, verb=False)}, and retry "
                        f"step {fault.step}: {what}; {no_spare}; {why}"),
            )
        return RecoveryDecision(
            action=Action.WAIT_FOR_REPAIR, step=fault.step, world_size=world, not_before=now, wait_until=wait_until,
            numbers=numbers,
            reason=(f"wait for repair until t={wait_until:.1f} (expected in {costs.repair_s:.1f} s): {what}; "
                    f"{no_spare}; {sw.describe()}, so holding beats shrinking to {new_world}"),
        )

    # Neither a spare for everyone nor a shrink: hold for the repair, or restart.
    # A restart after a lost node also needs the node back (or another) before it can re-form.
    restart_cost = costs.restart_s
    if fault.kind is FaultKind.NODE_LOST:
        restart_cost += math.inf if costs.repair_s is None else costs.repair_s
    numbers = {**numbers, "restart_cost_s": restart_cost}
    if wait_until is not None:
        assert costs.repair_s is not None
        wait_cost = costs.repair_s + costs.spare_s
        numbers = {**numbers, "repair_s": costs.repair_s, "wait_cost_s": wait_cost}
        if wait_cost < restart_cost:
            return RecoveryDecision(
                action=Action.WAIT_FOR_REPAIR, step=fault.step, world_size=world, not_before=now,
                wait_until=wait_until, numbers=numbers,
                reason=(f"wait for repair until t={wait_until:.1f}: {what}; {no_spare} and {why_not}; waiting "
                        f"R + d_spare = {costs.repair_s:.1f} + {costs.spare_s:.1f} = {wait_cost:.1f} s < restart "
                        f"{restart_cost:.1f} s"),
            )
        wait_note = f"waiting ({wait_cost:.1f} s) is no cheaper than a restart ({restart_cost:.1f} s)"
    return _restart(obs, f"{what}; {no_spare} and {why_not}; {wait_note}", now, numbers)


def _wait_window(obs: Observation, costs: RecoveryCosts, cfg: LadderConfig, now: float) -> tuple[str, float | None]:
    """``(why not, None)`` when holding for a repair is not an option, else ``("", deadline)``."""
    started = now if obs.waiting_since is None else obs.waiting_since
    deadline = started + cfg.max_wait_s
    left = deadline - now
    if cfg.max_wait_s == 0:
        return "waiting for a repair is off (max_wait_s=0)", None
    if costs.repair_s is None or math.isinf(costs.repair_s):
        return "the repair time is unknown, so no wait", None
    if left <= 0:
        return f"the wait bound is spent ({now - started:.1f} s of max_wait_s={cfg.max_wait_s:.1f} s)", None
    if costs.repair_s > left:
        return (f"the expected repair in {costs.repair_s:.1f} s is past the wait bound "
                f"({left:.1f} s left of max_wait_s={cfg.max_wait_s:.1f} s)"), None
    return "", deadline
