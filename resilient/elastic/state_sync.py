"""Make every rank's training state equal to one rank's, in memory, by broadcast, with no pickle.

After a re-formation (:mod:`resilient.elastic.reform`) the ranks hold
state of different ages: a replacement holds none; a survivor may or may
not have applied the update of the step that failed, and one that failed
*inside* ``optimizer.step()`` (an optimizer with a collective in its step,
as LAMB, Shampoo or ZeRO have) holds part of an update.  Two steps:

* :func:`agree_step`: all-gather each rank's last completed step and
  whether its state is clean, and pick as the source a clean rank that
  completed the most (:func:`decide_source`, pure), so an update applied on
  some survivors is neither applied twice nor lost: everyone takes the
  state after it and continues from there.  A dirty rank (failed inside
  its update, or after it with the rest of its step unfinished) is never
  the source: it receives the whole state like a replacement.  No clean
  rank, or clean survivors more than one step apart, is an error, and the
  run falls back to the rung below (the newest commit).
* :func:`sync_from`: the source's model, optimizer, scheduler, scaler and
  a dict of counters/cursor (``extra``) on every rank.  The structure goes
  as JSON bytes in a uint8 tensor (the pickle-free tree encoding of
  :mod:`resilient.checkpoint.tree`), then the tensors.  Model tensors are
  received in place; so are the optimizer's when the rank already has
  state of the same structure (a survivor), and only a replacement
  allocates.  Small tensors travel packed into byte buckets, large ones
  directly, all as asynchronous broadcasts so gloo overlaps them.

Every rank checks that the source's structure fits its own before any
tensor moves, and the ranks agree on the verdict, so a mismatch is the same
:class:`StateSyncError` on every rank, never a peer left in a broadcast.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..checkpoint.shard import DTYPE_NAMES, DTYPES
from ..checkpoint.tree import flatten, unflatten
from ..core.errors import ResilientError
from ..core.state import unwrap
from ..core.tensors import tensor_bytes
from .observe import ranks_text

DIRECT_BYTES = 1 << 20
"""Tensors at least this large (and contiguous) are broadcast as they are; smaller ones are packed."""
BUCKET_BYTES = 32 << 20
"""Size of a bucket of packed small tensors: few collectives, little extra memory."""


class StateSyncError(ResilientError):
    """Ranks cannot be made equal in process; the message says why (the run falls back to a restart)."""


@dataclass(frozen=True)
class StepAgreement:
    """Which rank's state everyone takes after a failure, and why."""

    source_rank: int
    completed: int
    """The last completed step every rank will hold; training continues at ``completed + 1``."""
    ahead: tuple[int, ...]
    """Clean ranks that had completed ``completed`` (the source is one of them)."""
    behind: tuple[int, ...]
    """Clean survivors one step behind: the failed step's update was not applied there; they receive it."""
    replacements: tuple[int, ...]
    """Ranks without state."""
    reason: str
    dirty: tuple[int, ...] = ()
    """Ranks whose state is partial (they failed inside an update): they receive everything, like a replacement."""


def decide_source(completed: Sequence[int | None], preferred: int | None = None,
                  dirty: Collection[int] = ()) -> StepAgreement:
    """Pure: the source among ranks' last completed steps (None: a replacement without state).

    ``dirty``: ranks whose state is partial (never a source).  The source
    is a clean rank with the highest completed step; ``preferred`` (the
    agent's choice) wins among those.  Raises :class:`StateSyncError` when
    no clean rank holds state or clean survivors are more than one step
    apart.
    """
    spoiled = tuple(sorted(r for r in set(dirty) if 0 <= r < len(completed) and completed[r] is not None))
    held = {r: c for r, c in enumerate(completed) if c is not None and r not in spoiled}
    holders = list(held)
    if not holders:
        if spoiled:
            raise StateSyncError(
                f"no rank holds a clean copy of the state: {ranks_text(spoiled, verb=False)} failed inside an "
                "optimizer update (part of it applied) and every other rank joins without state; restart from "
                "the newest committed checkpoint"
            )
        raise StateSyncError("no rank holds training state; restart from the newest committed checkpoint")
    top, lowest = max(held.values()), min(held.values())
    if top - lowest > 1:
        far = [r for r in holders if held[r] == lowest]
        raise StateSyncError(
            f"ranks {far} completed step {lowest} while others completed step {top}: one interrupted step "
            "cannot explain that, so the replicas diverged; restart from the newest committed checkpoint"
        )
    ahead = tuple(r for r in holders if held[r] == top)
    behind = tuple(r for r in holders if held[r] != top)
    replacements = tuple(r for r, c in enumerate(completed) if c is None)
    if preferred is not None and preferred in ahead:
        source, why = preferred, f"rank {preferred} (the agent's choice) completed step {top}"
    else:
        source = ahead[0]
        why = f"rank {source} is the lowest clean rank that completed step {top}"
        if preferred is not None:
            why += (f"; the agent's choice, rank {preferred}, failed inside an update" if preferred in spoiled
                    else f"; the agent's choice, rank {preferred}, had completed step {completed[preferred]}")
    if behind:
        why += f"; ranks {list(behind)} had not applied step {top}'s update and take it from the source"
    if spoiled:
        why += f"; ranks {list(spoiled)} failed inside an update and take the whole state from the source"
    if replacements:
        why += f"; ranks {list(replacements)} join without state"
    return StepAgreement(source, top, ahead, behind, replacements, why, spoiled)


def agree_step(completed: int | None, clean: bool = True, *, preferred_source: int | None = None,
               group: Any = None) -> StepAgreement:
    """All-gather where each rank stands and decide the source (:func:`decide_source`) identically everywhere.

    ``completed``: the optimizer updates this rank's state holds, None for a
    replacement without state; ``clean``: False when the rank failed inside
    an update (or after it, with its step unfinished), so its state is partial.
    """
    if completed is not None and completed < 0:
        raise ValueError(f"a rank cannot have completed {completed} steps")
    mine = -1 if completed is None else completed
    world = dist.get_world_size(group)
    parts = [torch.zeros(2, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(parts, torch.tensor([mine, 0 if clean else 1], dtype=torch.int64), group=group)
    steps = [None if int(p[0].item()) < 0 else int(p[0].item()) for p in parts]
    spoiled = [r for r, p in enumerate(parts) if int(p[1].item())]
    return decide_source(steps, preferred_source, spoiled)


def sync_from(
    source_rank: int, model: torch.nn.Module, optimizer: Any = None, scheduler: Any = None, scaler: Any = None,
    extra: dict[str, Any] | None = None, *, group: Any = None,
) -> dict[str, Any]:
    """Make this rank's state the source's; return the source's ``extra`` (counters, data cursor).

    Collective: every rank of ``group`` calls it with the same
    ``source_rank`` and the same kinds of objects (an optimizer on one rank
    means one on all).  The model is updated in place; the optimizer,
    scheduler and scaler through their ``load_state_dict`` on the
    receivers.  Raises :class:`StateSyncError` on every rank when a rank's
    model or objects do not fit the source's.
    """
    rank = dist.get_rank(group)
    module = unwrap(model)
    model_state = module.state_dict()
    rest = {
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "scaler": scaler.state_dict() if scaler is not None else None,
        "extra": dict(extra or {}),
    }
    rest_skeleton, rest_tensors = flatten(rest, "state")
    model_table = _table(model_state.values())
    meta = None
    if rank == source_rank:
        meta = json.dumps({"names": list(model_state), "model": model_table, "skeleton": rest_skeleton,
                           "rest": _table(rest_tensors)}).encode()
    source_meta = json.loads(_broadcast_bytes(meta, source_rank, group))

    problem = _misfit(source_meta, list(model_state), model_table)
    in_place = _shape(source_meta["skeleton"]) == _shape(rest_skeleton) and source_meta["rest"] == _table(rest_tensors)
    if rank != source_rank and not in_place and problem is None:
        problem = _kinds_misfit(source_meta["skeleton"], rest_skeleton)
    _agree_ok(problem, rank, group)

    if rank != source_rank and not in_place:
        rest_tensors = [torch.empty(shape, dtype=DTYPES[dtype]) for dtype, shape in source_meta["rest"]]
    _broadcast_tensors(list(model_state.values()) + rest_tensors, source_rank, group)
    if rank == source_rank:
        return dict(extra or {})

    return load_received(unflatten(source_meta["skeleton"], rest_tensors), optimizer, scheduler, scaler)


def load_received(received: dict[str, Any], optimizer: Any, scheduler: Any, scaler: Any) -> dict[str, Any]:
    """Load the source's optimizer, scheduler and scaler state on a receiver; return the source's ``extra``."""
    if optimizer is not None:
        optimizer.load_state_dict(received["optimizer"])
    if scheduler is not None:
        scheduler.load_state_dict(received["scheduler"])
    if scaler is not None:
        scaler.load_state_dict(received["scaler"])
    out: dict[str, Any] = received["extra"]
    return out


def _table(tensors: Any) -> list[list[Any]]:
    table = []
    for t in tensors:
        if t.dtype not in DTYPE_NAMES:
            raise StateSyncError(f"a tensor of dtype {t.dtype} cannot be sent between ranks")
        if t.device.type != "cpu":
            raise StateSyncError(f"state on {t.device} is not supported by the gloo state sync yet; keep it on CPU")
        table.append([DTYPE_NAMES[t.dtype], list(t.shape)])
    return table


def _misfit(source: dict[str, Any], names: list[str], table: list[list[Any]]) -> str | None:
    if source["names"] != names or source["model"] != table:
        theirs = dict(zip(source["names"], source["model"]))
        ours = dict(zip(names, table))
        diff = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
        return (f"the model does not match the source's ({len(diff)} entries differ, e.g. {diff[:3]}); "
                "in-process recovery needs the same model on every rank")
    return None


def _shape(skeleton: Any) -> Any:
    """The skeleton with scalar leaves blanked: what must match for tensors to be received in place."""
    if isinstance(skeleton, list):
        return [_shape(v) for v in skeleton]
    if isinstance(skeleton, dict):
        return {k: (v if k == "__tensor__" else _shape(v)) for k, v in skeleton.items()}
    return None


def _kinds_misfit(source: Any, ours: Any) -> str | None:
    """Which of optimizer/scheduler/scaler one side has and the other lacks (their contents come from the source)."""
    theirs, mine = _kinds(source), _kinds(ours)
    if theirs != mine:
        return (f"the source syncs {sorted(theirs)} but this rank passed {sorted(mine)}; "
                "pass the same kinds of objects on every rank")
    return None


def _kinds(skeleton: Any) -> set[str]:
    pairs = skeleton.get("__dict__", []) if isinstance(skeleton, dict) else []
    return {k for k, v in pairs if v is not None and k != "extra"}


def _agree_ok(problem: str | None, rank: int, group: Any) -> None:
    flag = torch.tensor([0 if problem is None else 1], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if problem is not None:
        raise StateSyncError(f"rank {rank}: {problem}")
    if int(flag.item()):
        raise StateSyncError(f"rank {rank}: another rank's state does not fit the source's (its error says why)")


def _broadcast_bytes(payload: bytes | None, source: int, group: Any) -> bytes:
    size = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64)
    dist.broadcast(size, src=_global(source, group), group=group)
    buf = torch.empty(int(size.item()), dtype=torch.uint8)
    if payload is not None:
        buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    dist.broadcast(buf, src=_global(source, group), group=group)
    return tensor_bytes(buf)


def _global(rank: int, group: Any) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def _broadcast_tensors(tensors: list[torch.Tensor], source: int, group: Any) -> None:
    """Broadcast every tensor from ``source`` into the same-shaped tensors elsewhere, in place."""
    src = _global(source, group)
    is_source = dist.get_rank(group) == source
    works = []
    unpack: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
    bucket: list[torch.Tensor] = []
    filled = 0

    def flush() -> None:
        nonlocal bucket, filled
        if not bucket:
            return
        buf = torch.empty(filled, dtype=torch.uint8)
        if is_source:
            torch.cat([_bytes_of(t) for t in bucket], out=buf)
        works.append(dist.broadcast(buf, src=src, group=group, async_op=True))
        if not is_source:
            unpack.append((buf, bucket))
        bucket, filled = [], 0

    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if nbytes == 0:
            continue
        if nbytes >= DIRECT_BYTES and t.is_contiguous():
            works.append(dist.broadcast(_bytes_of(t), src=src, group=group, async_op=True))
            continue
        if filled + nbytes > BUCKET_BYTES:
            flush()
        bucket.append(t)
        filled += nbytes
    flush()
    for work in works:
        work.wait()
    for buf, members in unpack:
        offset = 0
        for t in members:
            n = t.numel() * t.element_size()
            target = t.detach()
            if target.is_contiguous():
                _bytes_of(target).copy_(buf[offset:offset + n])
            else:
                target.copy_(buf[offset:offset + n].view(t.dtype).view(t.shape))
            offset += n
