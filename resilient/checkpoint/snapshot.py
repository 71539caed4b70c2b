"""Consistent host-memory snapshots of training state.

The step loop pays only for :func:`take_snapshot`: one copy of every tensor
into a preallocated, already-touched host buffer (pinned when CUDA is in
use).  Fresh memory is several times slower to write than memory that has
been touched once, so the buffer is kept between checkpoints and grown only
when the state grows.  Everything after the copy (encoding, hashing,
writing, commit) runs in the background from the buffer.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

from .shard import ShardLayout, plan_layout
from .tree import flatten


class HostBuffer:
    """A reusable uint8 host buffer; at most one snapshot uses it at a time."""

    def __init__(self) -> None:
        self._tensor: torch.Tensor | None = None
        self.in_use = threading.Lock()

    @property
    def capacity(self) -> int:
        return 0 if self._tensor is None else self._tensor.numel()

    def reserve(self, nbytes: int) -> torch.Tensor:
        """Return a buffer of at least ``nbytes`` bytes, touching new pages once."""
        if self._tensor is None or self._tensor.numel() < nbytes:
            size = max(nbytes, 4096)
            pin = torch.cuda.is_available() and torch.cuda.is_initialized()
            self._tensor = None
            tensor = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
            tensor.zero_()  # fault the pages in now, not during the first copy
            self._tensor = tensor
        return self._tensor


@dataclass
class Snapshot:
    """The encoded shard of one payload, backed by a :class:`HostBuffer` region."""

    header: bytes
    data: memoryview
    owner: torch.Tensor  # keeps the buffer that ``data`` points into alive

    @property
    def size(self) -> int:
        return len(self.header) + len(self.data)

    def segments(self) -> list[memoryview]:
        return [memoryview(self.header), self.data]


def _plan(payloads: dict[str, Any]) -> tuple[dict[str, tuple[ShardLayout, list[torch.Tensor], int]], int]:
    """Each payload's layout, tensors and offset in the host buffer, and the bytes needed."""
    plans = {}
    total = 0
    for key, tree in payloads.items():
        skeleton, tensors = flatten(tree, key)
        layout = plan_layout(skeleton, tensors)
        plans[key] = (layout, tensors, total)
        total += layout.data_bytes
    return plans, total


def snapshot_bytes(payloads: dict[str, Any]) -> int:
    """Host-buffer bytes that :func:`take_snapshots` would need for ``payloads``."""
    return _plan(payloads)[1]


def take_snapshots(payloads: dict[str, Any], buffer: HostBuffer) -> dict[str, Snapshot]:
    """Copy each payload tree into one region of ``buffer``; return their shards.

    On return the snapshots are independent of the live tensors, so training
    may mutate them.  The caller holds ``buffer.in_use`` until the snapshots
    have been written.
    """
    plans, total = _plan(payloads)
    host = buffer.reserve(total)
    needs_sync = False
    out = {}
    for key, (layout, tensors, base) in plans.items():
        needs_sync |= copy_tensors(host, base, layout, tensors)
        region = host[base : base + layout.data_bytes]
        out[key] = Snapshot(header=layout.header, data=_view(region), owner=host)
    if needs_sync:
        torch.cuda.synchronize()
    return out


def copy_tensors(host: torch.Tensor, base: int, layout: ShardLayout, tensors: list[torch.Tensor]) -> bool:
    """Copy ``tensors`` into the uint8 ``host`` at ``base`` + their layout offsets; True when a copy came from a
    device (the caller synchronises once, after all of them)."""
    needs_sync = False
    for entry, t in zip(layout.entries, tensors):
        if entry.nbytes == 0:
            continue
        start = base + entry.offset
        dst = host[start : start + entry.nbytes].view(t.dtype).view(t.shape)
        src = t.detach()
        if src.device.type != "cpu":
            needs_sync = True
            dst.copy_(src, non_blocking=True)
        else:
            dst.copy_(src)
    return needs_sync


def _view(region: torch.Tensor) -> memoryview:
    """A byte view of a contiguous uint8 CPU tensor, without numpy."""
    if region.numel() == 0:
        return memoryview(b"")
    import ctypes

    array = (ctypes.c_uint8 * region.numel()).from_address(region.data_ptr())
    return memoryview(array).cast("B")
