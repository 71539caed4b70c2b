"""The replica audit: every ``audit_every`` steps, data-parallel ranks compare fingerprints of their parameters.

Replicated training keeps every rank's parameters bit-identical: the same
initial broadcast, the same averaged gradients, the same optimizer.  A rank
that drifts (a per-rank seed bug in initialisation, silent data corruption
in memory or on a device, a parameter edited on one rank only) goes on
training with a loss curve that looks fine.  At a step boundary every rank
computes, per parameter, two 64-bit sums of the parameter's bit pattern (all
elements, and every other element; reductions on the parameter's device,
nothing copied), gathers every rank's fingerprints, and compares them: the
ranks that differ from the majority, and the tensors they differ in, are
named.  Every rank reaches the same verdict; the lowest rank reports it
(an ``audit`` heartbeat under the agent, which records an incident of kind
``replica_mismatch``; a ``replica_mismatch`` event in any case).

Cost: two reductions over the parameters and one small all-gather every
``audit_every`` steps.  Only replicated (DDP) models are audited: sharded
ones hold different shards by design.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

import torch

from ..core.errors import ConfigError
from ..core.events import EventKind
from ..core.state import unwrap
from .attempt import is_recoverable
from .saving import settled

if TYPE_CHECKING:
    from .state import RunState

MAX_TENSORS = 10
"""Tensors named in a report (the count of all that differ is reported too)."""
_BITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def fingerprints(module: torch.nn.Module) -> tuple[list[str], torch.Tensor]:
    """The names of ``module``'s parameters and a ``[n, 2]`` int64 tensor of their fingerprints."""
    names, rows = [], []
    for name, p in module.named_parameters():
        bits = p.detach().reshape(-1).view(_BITS[p.element_size()])
        rows.append(torch.stack([bits.sum(dtype=torch.int64), bits[::2].sum(dtype=torch.int64)]))
        names.append(name)
    return names, torch.stack(rows) if rows else torch.zeros(0, 2, dtype=torch.int64)


def compare(names: list[str], gathered: list[torch.Tensor]) -> dict[str, Any] | None:
    """None when every rank agrees; else the ranks outside the majority and the tensors where they differ."""
    tensors = []
    odd: set[int] = set()
    for i, name in enumerate(names):
        rows = [tuple(int(v) for v in g[i].tolist()) for g in gathered]
        common, _ = Counter(rows).most_common(1)[0]
        ranks = [r for r, row in enumerate(rows) if row != common]
        if ranks:
            odd.update(ranks)
            tensors.append({"tensor": name, "ranks": ranks})
    if not tensors:
        return None
    return {"ranks": sorted(odd), "tensors": tensors[:MAX_TENSORS], "tensors_differing": len(tensors),
            "of_tensors": len(names), "world_size": len(gathered)}


def audit(state: RunState, step: int) -> dict[str, Any] | None:
    """Compare the run's replicated parameters across its data-parallel ranks at ``step``; report a mismatch."""
    import torch.distributed as dist

    names, mine = fingerprints(unwrap(state.model))
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    found = compare(names, [g.cpu() for g in gathered])
    if found is None:
        return None
    described = ", ".join(f"{t['tensor']} (rank {', '.join(map(str, t['ranks']))})" for t in found["tensors"][:3])
    found["step"] = step
    found["reason"] = (f"replica audit at step {step}: rank(s) {', '.join(map(str, found['ranks']))} of "
                       f"{found['world_size']} hold parameters that differ from the other replicas in "
                       f"{found['tensors_differing']} of {found['of_tensors']} tensors, e.g. {described}")
    state.events.emit(EventKind.REPLICA_MISMATCH, **found)
    if state.hooks is not None and state.rank == 0:
        state.hooks.audit(found)
    return found


def checked_every(every: object) -> int:
    """``Run(audit_every=...)`` validated: an int >= 0."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise ConfigError(f"Run(audit_every={every!r}) must be a number of steps >= 0 (0: no replica audit)")
    return every


def due(state: RunState) -> bool:
    """Whether the boundary before update ``state.step`` is an audit point of a replicated multi-rank run."""
    every = state.audit_every
    return bool(every) and state.step > 0 and state.step % every == 0 and state.world_size > 1 \
        and state.ddp_options is not None and not state.sharded


def at_boundary(state: RunState) -> None:
    """The replica audit at this boundary.  A peer lost during its collective, with in-process recovery on, is
    left to this step's attempt: its first collective meets the same broken group and the attempt recovers it
    (this rank is clean, no update begun).  Anything else propagates."""
    settled(state, "before the replica audit")
    try:
        audit(state, state.step)
    except Exception as exc:
        if state.inproc is None or not is_recoverable(exc):
            raise
        state.events.emit(EventKind.REPLICA_AUDIT_INTERRUPTED, step=state.step, error=str(exc)[:500])
