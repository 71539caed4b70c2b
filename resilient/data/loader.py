"""``ElasticLoader``: deterministic, resumable, exactly-once batches.

The loader's position is a single *global* cursor: the number of samples
consumed by all ranks together.  The sample stream is the concatenation of
per-epoch permutations (seeded by ``seed`` and the epoch number), and each
step takes the next ``batch_size * world_size`` positions, rank ``r`` taking
the ``r``-th block.  Every sample of an epoch is therefore consumed exactly
once across ranks, batches that cross an epoch boundary stay full, and a
cursor saved on one world size means the same thing on any other.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
from torch.utils.data import default_collate

from ..errors import CheckpointMismatchError, ConfigError


class MapDataset(Protocol):
    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


class ElasticLoader:
    """Yields this rank's batches; call ``next(loader)`` once per micro-batch on every rank."""

    def __init__(
        self,
        dataset: MapDataset,
        *,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        collate_fn: Callable[[list[Any]], Any] = default_collate,
        rank: int | None = None,
        world_size: int | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
            raise ConfigError("ElasticLoader needs a map-style dataset (with __len__ and __getitem__)")
        if len(dataset) < 1:
            raise ConfigError("ElasticLoader got an empty dataset")
        if batch_size < 1:
            raise ConfigError(f"ElasticLoader batch_size={batch_size} must be >= 1")
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.collate_fn = collate_fn
        self._clock = clock
        self.consumed = 0
        """Samples consumed by all ranks together since the start of the run."""
        self.data_wait_s = 0.0
        """Time this rank spent producing batches (reading and collating)."""
        self.last_indices: list[int] = []
        """Dataset indices of the batch most recently returned on this rank."""
        self._perms: dict[int, torch.Tensor] = {}
        self.report_section: Callable[[str], AbstractContextManager[Any]] | None = None
        """Set by a Run under an agent (``Run.section``): producing a batch is then reported as section "data"."""
        self.rank, self.world_size = 0, 1
        if rank is not None or world_size is not None:
            self.bind(rank or 0, world_size or 1)
        else:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                self.bind(dist.get_rank(), dist.get_world_size())

    def bind(self, rank: int, world_size: int) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(f"ElasticLoader: rank {rank} is not within world size {world_size}")
        self.rank, self.world_size = rank, world_size

    @property
    def epoch(self) -> int:
        return self.consumed // len(self.dataset)

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.world_size

    def _permutation(self, epoch: int) -> torch.Tensor:
        perm = self._perms.get(epoch)
        if perm is None:
            n = len(self.dataset)
            if self.shuffle:
                gen = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % (2**63))
                perm = torch.randperm(n, generator=gen)
            else:
                perm = torch.arange(n)
            self._perms = {e: p for e, p in self._perms.items() if e >= epoch - 1}
            self._perms[epoch] = perm
        return perm

    def indices_at(self, start: int, count: int) -> list[int]:
        """Dataset indices at global stream positions ``start .. start+count-1``."""
        n = len(self.dataset)
        out = []
        for pos in range(start, start + count):
            epoch, offset = divmod(pos, n)
            out.append(int(self._permutation(epoch)[offset]))
        return out

    def __iter__(self) -> ElasticLoader:
        return self

    def __next__(self) -> Any:
        if self.report_section is not None:
            with self.report_section("data"):
                return self._produce()
        return self._produce()

    def _produce(self) -> Any:
        started = self._clock()
        indices = self.indices_at(self.consumed + self.rank * self.batch_size, self.batch_size)
        batch = self.collate_fn([self.dataset[i] for i in indices])
        self.consumed += self.global_batch_size
        self.last_indices = indices
        self.data_wait_s += self._clock() - started
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {
            "consumed": self.consumed,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "dataset_len": len(self.dataset),
            "batch_size": self.batch_size,
            "world_size": self.world_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        n = len(self.dataset)
        mismatches: Sequence[str] = [
            f"{key} {state[key]!r} -> {value!r}"
            for key, value in (("dataset_len", n), ("seed", self.seed), ("shuffle", self.shuffle))
            if state.get(key) != value
        ]
        if mismatches:
            raise CheckpointMismatchError(
                "the data stream changed since the checkpoint (" + ", ".join(mismatches) + "): resuming would "
                "skip or repeat samples. Resume with the same dataset, seed and shuffle setting"
            )
        self.consumed = int(state["consumed"])
