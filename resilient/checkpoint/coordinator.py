"""Small collectives the checkpoint protocol needs, on a dedicated group.

Checkpoint commits run on a background thread while the training loop runs
its own collectives, so they use a separate gloo process group: calls on one
group stay in the same order on every rank, whatever the other group does.
Payloads are bytes carried in uint8 tensors (never pickled objects).

Work that only rank 0 does (listing, reading a manifest, claiming the
fence) goes through :meth:`Coordinator.on_root`: its outcome, a result *or*
an error, is broadcast, so a failure on rank 0 becomes the same error on
every rank at once instead of a peer waiting in a collective until the
group times out.

The training loop's own decisions (whether a due save is taken now, see
:mod:`.pacing`) use a second gloo group, the *loop group*: the background
thread may be inside a commit on the checkpoint group at that moment, and
two threads issuing collectives on one group would pair different calls on
different ranks.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from ..core import errors

_OK, _FAILED = b"\x00", b"\x01"
_REBUILT: dict[str, type[errors.ResilientError]] = {
    cls.__name__: cls
    for cls in (
        errors.StorageError,
        errors.CheckpointMismatchError,
        errors.NoValidCheckpointError,
        errors.CommitConflictError,
        errors.ConfigError,
        errors.CheckpointError,
    )
}


class Coordinator:
    """Collectives among the ranks of one job; the single-process case is trivial."""

    def __init__(self, rank: int = 0, world_size: int = 1, group: Any = None, loop_group: Any = None) -> None:
        """``group``: the commit thread's collectives; ``loop_group``: the training thread's (:meth:`agree_max`)."""
        self.rank = rank
        self.world_size = world_size
        self._group = group
        self._loop_group = loop_group

    @classmethod
    def from_environment(cls, timeout_s: float) -> Coordinator:
        """Use ``torch.distributed`` when initialised, otherwise a single process."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return cls()
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        loop_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        return cls(dist.get_rank(), dist.get_world_size(), group, loop_group)

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    @property
    def groups(self) -> tuple[Any, ...]:
        """The process groups this coordinator made (none for a single process)."""
        return tuple(g for g in (self._group, self._loop_group) if g is not None)

    def gather(self, payload: bytes) -> list[bytes] | None:
        """Every rank's payload on rank 0 (in rank order); None elsewhere."""
        if self.world_size == 1:
            return [payload]
        import torch.distributed as dist

        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(sizes, torch.tensor([len(payload)], dtype=torch.int64), group=self._group)
        longest = max(int(s.item()) for s in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        if payload:
            mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        # Only rank 0 receives the payloads (a commit report can be large: chunk tables of sharded state).
        parts = [torch.zeros(longest, dtype=torch.uint8) for _ in range(self.world_size)] if self.is_root else None
        dist.gather(mine, parts, dst=self._global_root(), group=self._group)
        if parts is None:
            return None
        return [_to_bytes(p[: int(s.item())]) for p, s in zip(parts, sizes)]

    def broadcast(self, payload: bytes | None) -> bytes:
        """Rank 0's ``payload`` on every rank."""
        if self.world_size == 1:
            assert payload is not None
            return payload
        import torch.distributed as dist

        size = torch.tensor([len(payload) if self.is_root and payload is not None else 0], dtype=torch.int64)
        dist.broadcast(size, src=self._global_root(), group=self._group)
        buf = torch.zeros(int(size.item()), dtype=torch.uint8)
        if self.is_root and payload:
            buf[:] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        dist.broadcast(buf, src=self._global_root(), group=self._group)
        return _to_bytes(buf)

    def share(self, buf: Any, size: int) -> Any:
        """Rank 0's writable buffer of ``size`` bytes on every rank: sent as it is (no copy on rank 0), received
        into a new ``bytearray`` elsewhere.  Every rank must call it with the same ``size``."""
        if self.world_size == 1 or size == 0:
            return buf if self.is_root else bytearray(size)
        import torch.distributed as dist

        target = buf if self.is_root else bytearray(size)
        dist.broadcast(torch.frombuffer(target, dtype=torch.uint8), src=self._global_root(), group=self._group)
        return target

    def on_root(self, work: Callable[[], bytes]) -> bytes:
        """Run ``work`` on rank 0 and return its bytes on every rank.

        If ``work`` raises (anything), every rank raises the same error
        (:func:`rebuild_error`): same type for resilient's own errors, a
        :class:`~resilient.core.errors.CheckpointError` naming the original type otherwise.
        """
        payload = None
        failure: BaseException | None = None
        if self.is_root:
            try:
                payload = _OK + work()
            except Exception as e:  # noqa: BLE001  whatever it is, the peers must hear of it
                failure = e
                payload = _FAILED + describe_error(e)
        got = self.broadcast(payload)
        if got[:1] == _FAILED:
            raise rebuild_error(got[1:]) from failure
        return got[1:]

    def all_ok(self, ok: bool) -> bool:
        """True when ``ok`` holds on every rank."""
        if self.world_size == 1:
            return ok
        import torch.distributed as dist

        flag = torch.tensor([1 if ok else 0], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._group)
        return bool(flag.item())

    def agree_max(self, values: tuple[int, ...]) -> tuple[int, ...]:
        """The element-wise maximum of ``values`` over all ranks, on the loop group (training thread only).

        Raises :class:`~resilient.core.errors.CheckpointError` when this
        coordinator was made without a loop group on more than one rank.
        """
        if self.world_size == 1:
            return tuple(values)
        if self._loop_group is None:
            raise errors.CheckpointError(
                "this Coordinator has no loop group, so ranks cannot agree on a save from the training loop; "
                "create it with Coordinator.from_environment() or pass loop_group="
            )
        import torch.distributed as dist

        flags = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._loop_group)
        return tuple(int(v) for v in flags.tolist())

    def _global_root(self) -> int:
        import torch.distributed as dist

        return dist.get_global_rank(self._group, 0)


def _to_bytes(t: torch.Tensor) -> bytes:
    out = bytearray(t.numel())
    if out:
        torch.frombuffer(out, dtype=torch.uint8).copy_(t)
    return bytes(out)


def describe_error(e: BaseException) -> bytes:
    """An error as JSON bytes that :func:`rebuild_error` turns back into the same error."""
    body: dict[str, Any] = {"type": type(e).__name__, "message": str(e)}
    if isinstance(e, errors.FencedError):
        body |= {"holder_launch": e.holder_launch, "holder_generation": e.holder_generation}
    return json.dumps(body).encode()


def rebuild_error(raw: bytes) -> errors.ResilientError:
    body = json.loads(raw)
    kind, message = body["type"], body["message"]
    if kind == "FencedError":
        return errors.FencedError(
            message, holder_launch=body.get("holder_launch"), holder_generation=body.get("holder_generation")
        )
    cls = _REBUILT.get(kind)
    if cls is not None:
        return cls(message)
    return errors.CheckpointError(f"rank 0 failed with {kind}: {message}")
