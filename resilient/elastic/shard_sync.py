"""Make every rank's sharded state (FSDP2, HSDP) current again from its replicas, in memory, after a re-formation.

The sharded counterpart of :func:`resilient.elastic.state_sync.sync_from`.
A rank's state has two parts:

* **its shards**: the local tensors of every DTensor (parameters and the
  optimizer state that follows them).  Only ranks with the same mesh
  coordinates outside the replicate dimension hold the same shards (a
  *replica group*, :attr:`~resilient.elastic.mesh_rebind.ShardLayout.replicas`).
  A replacement or a rank one update behind takes them from a member of its
  replica group that completed the agreed step, over the mesh's replicate
  group; a replica group whose members all hold it sends nothing;
* **the rest**: unsharded buffers, the optimizer's step counters and param
  groups, scheduler, scaler, counters and cursor, the same on every rank:
  from the agreed source rank to everyone, as for DDP.

Where a shard has no such holder (pure FSDP lost a rank, or every replica
of a shard lost the update) the state cannot be rebuilt in memory: every
rank raises the same :class:`~resilient.elastic.state_sync.StateSyncError`
and the run restarts from the newest commit.  The structure goes first, as
JSON, and every rank checks it fits (same names, dtypes, global shapes and
DTensor-ness) before any tensor moves.  A replacement without optimizer
state allocates it like the parameter it belongs to (``empty_like``: same
mesh and placements) and loads it through ``load_state_dict``.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

from ..checkpoint.shard import DTYPES
from ..checkpoint.tree import flatten, unflatten
from .mesh_rebind import ShardLayout, replica_group
from .state_sync import (
    StateSyncError,
    StepAgreement,
    _agree_ok,
    _broadcast_bytes,
    _broadcast_tensors,
    _kinds_misfit,
    _misfit,
    _shape,
    _table,
    load_received,
)


def shard_sources(agreement: StepAgreement, layout: ShardLayout) -> dict[tuple[int, ...], int]:
    """Pure: the rank each replica group takes its shards from (the agreed source where it is a member).

    Raises :class:`StateSyncError` (the same on every rank) when a group has no member that completed
    the agreed step.
    """
    ahead = set(agreement.ahead)
    sources: dict[tuple[int, ...], int] = {}
    for group in layout.replicas:
        holders = sorted(ahead & set(group))
        if not holders:
            kind = "no replica of it survived" if len(group) > 1 else "no other rank holds it (no replica: pure FSDP)"
            raise StateSyncError(
                f"the shard of rank(s) {list(group)} cannot be rebuilt in memory: {kind} with step "
                f"{agreement.completed} applied; restart from the newest committed checkpoint")
        sources[group] = agreement.source_rank if agreement.source_rank in holders else holders[0]
    return sources


class _Slot:
    """A tensor's place in the source's structure, before it is allocated."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


def sync_sharded(agreement: StepAgreement, layout: ShardLayout, model: torch.nn.Module, optimizer: Any = None,
                 scheduler: Any = None, scaler: Any = None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Make this rank's sharded model and optimizer, scheduler and scaler current; return the source's ``extra``.

    Collective over the (re-formed, rebound) default group: every rank calls it with the same agreement.
    """
    from torch.distributed.tensor import DTensor

    rank, source = dist.get_rank(), agreement.source_rank
    sources = shard_sources(agreement, layout)
    mine = layout.peers_of(rank)
    model_state = model.state_dict()
    rest = {
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "scaler": scaler.state_dict() if scaler is not None else None,
        "extra": dict(extra or {}),
    }
    skeleton, rest_tensors = flatten(rest, "state")
    model_dt = [isinstance(t, DTensor) for t in model_state.values()]
    rest_dt = [isinstance(t, DTensor) for t in rest_tensors]
    model_table, rest_table = _table(model_state.values()), _table(rest_tensors)
    meta = None
    if rank == source:
        meta = json.dumps({"names": list(model_state), "model": model_table, "model_dt": model_dt,
                           "skeleton": skeleton, "rest": rest_table, "rest_dt": rest_dt}).encode()
    theirs = json.loads(_broadcast_bytes(meta, source, None))

    problem = _misfit(theirs, list(model_state), model_table)
    if problem is None and theirs["model_dt"] != model_dt:
        problem = "the source's model is sharded differently from this rank's (DTensor or not per entry)"
    in_place = (_shape(theirs["skeleton"]) == _shape(skeleton) and theirs["rest"] == rest_table
                and theirs["rest_dt"] == rest_dt)
    if problem is None and rank != source and not in_place:
        problem = _kinds_misfit(theirs["skeleton"], skeleton)
        if problem is None and sources[mine] == rank:
            problem = "this rank is its replica group's source but its optimizer state differs from the source's"
    if problem is None and rank != source and not in_place:
        try:
            rest_tensors = _allocate(theirs, optimizer)
        except StateSyncError as e:
            problem = str(e)
    _agree_ok(problem, rank, None)

    plain = [t for t, d in zip(model_state.values(), model_dt) if not d]
    plain += [t for t, d in zip(rest_tensors, theirs["rest_dt"]) if not d]
    _broadcast_tensors(plain, source, None)
    group_source = sources[mine]
    needs = [r for r in mine if r not in agreement.ahead]
    if needs and len(mine) > 1:  # a replica group whose members all hold the step sends nothing
        shards = [_local(t) for t, d in zip(model_state.values(), model_dt) if d]
        shards += [_local(t) for t, d in zip(rest_tensors, theirs["rest_dt"]) if d]
        pg = replica_group(layout)
        _broadcast_tensors(shards, dist.get_group_rank(pg, group_source), pg)
    if rank == source:
        return dict(extra or {})
    return load_received(unflatten(theirs["skeleton"], rest_tensors), optimizer, scheduler, scaler)


def _local(t: Any) -> torch.Tensor:
    """A DTensor's local shard itself (``to_local()`` would add an autograd view of a parameter)."""
    local: torch.Tensor = t._local_tensor
    return local


def _allocate(theirs: dict[str, Any], optimizer: Any) -> list[torch.Tensor]:
    """Tensors shaped like the source's (a rank without optimizer state): DTensor state like its parameter."""
    table, flags = theirs["rest"], theirs["rest_dt"]
    tensors: list[Any] = [None if flag else torch.empty(shape, dtype=DTYPES[dtype])
                          for (dtype, shape), flag in zip(table, flags)]
    if not any(flags):
        return tensors
    slots = unflatten(theirs["skeleton"], [_Slot(i) for i in range(len(table))])  # type: ignore[misc]
    params = [p for group in optimizer.param_groups for p in group["params"]] if optimizer is not None else []
    state = (slots.get("optimizer") or {}).get("state") or {}
    for key, entry in state.items():
        for name, slot in (entry.items() if isinstance(entry, dict) else ()):
            if not isinstance(slot, _Slot) or not flags[slot.index]:
                continue
            if not isinstance(key, int) or not 0 <= key < len(params):
                raise StateSyncError(f"the source's optimizer state names parameter {key!r}, which this rank lacks")
            param = params[key]
            if list(param.shape) != table[slot.index][1]:
                raise StateSyncError(f"optimizer state {name!r} of parameter {key} is not shaped like the parameter")
            tensors[slot.index] = torch.empty_like(param.detach(), dtype=DTYPES[table[slot.index][0]])
    missing = [i for i, t in enumerate(tensors) if t is None]
    if missing:
        raise StateSyncError(f"{len(missing)} sharded tensors of the source's state are not optimizer state of a "
                             "parameter; this rank cannot allocate them")
    return tensors
