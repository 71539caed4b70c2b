"""The sample stream: which dataset index sits at each global stream position.

The stream is the concatenation of per-epoch permutations of
``range(dataset_len)``, each seeded by ``seed`` and the epoch number (or the
identity when not shuffling).  Position ``p`` is offset ``p % n`` of epoch
``p // n``.  A step of a ``world_size``-rank job takes the next
``batch_size * world_size`` positions and rank ``r`` takes the ``r``-th block
of ``batch_size`` (:meth:`Layout.classic`).  Under a
batch plan (:mod:`resilient.elastic.batch`) a step takes the run's fixed
global batch and a rank takes several micro-batches of it: a
:class:`Layout` says where a rank's batches lie in every step, for both.

Pure apart from a small cache of permutations (the only state), so the
loader's in-process path and the batch sampler that feeds worker processes
compute the same indices from the same code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Layout:
    """Where one rank's batches lie in each step: ``(offset, size)`` of each within the step, and the step's length."""

    slots: tuple[tuple[int, int], ...]
    """This rank's batches of one step, in the order it takes them: offset from the step's cursor, and size."""
    stride: int
    """Positions one step consumes (all ranks together): the next step's cursor is this much further."""

    @staticmethod
    def classic(rank: int, batch_size: int, world_size: int) -> Layout:
        """One batch per step and rank, the ``rank``-th block of ``batch_size`` (``next(loader)``)."""
        return Layout(((rank * batch_size, batch_size),), batch_size * world_size)


class StreamPlan:
    """Maps global stream positions to dataset indices for one (dataset length, seed, shuffle)."""

    def __init__(self, dataset_len: int, seed: int, shuffle: bool) -> None:
        self.dataset_len = dataset_len
        self.seed = seed
        self.shuffle = shuffle
        self._perms: dict[int, torch.Tensor] = {}

    def permutation(self, epoch: int) -> torch.Tensor:
        perm = self._perms.get(epoch)
        if perm is None:
            n = self.dataset_len
            if self.shuffle:
                gen = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % (2**63))
                perm = torch.randperm(n, generator=gen)
            else:
                perm = torch.arange(n)
            # Readers move forward through the stream, at most one epoch boundary at a time: keep two epochs.
            self._perms = {e: p for e, p in self._perms.items() if e >= epoch - 1}
            self._perms[epoch] = perm
        return perm

    def indices(self, start: int, count: int) -> list[int]:
        """Dataset indices at global stream positions ``start .. start+count-1``."""
        n = self.dataset_len
        out: list[int] = []
        pos, end = start, start + count
        while pos < end:
            epoch, offset = divmod(pos, n)
            take = min(end - pos, n - offset)  # a slice of one epoch's permutation at a time
            out += self.permutation(epoch)[offset : offset + take].tolist()
            pos += take
        return out
