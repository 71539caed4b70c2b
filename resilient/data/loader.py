"""``ElasticLoader``: deterministic, resumable, exactly-once batches.

The loader's position is a single *global* cursor: the number of samples
consumed by all ranks together.  The sample stream is the concatenation of
per-epoch permutations (seeded by ``seed`` and the epoch number), and each
step takes the next ``batch_size * world_size`` positions, rank ``r`` taking
the ``r``-th block.  Every sample of an epoch is therefore consumed exactly
once across ranks, batches that cross an epoch boundary stay full, and a
cursor saved on one world size means the same thing on any other.

Reading and collating run in the training process (``num_workers=0``, the
default) or in torch ``DataLoader`` worker processes with prefetch and
pinning (:mod:`resilient.data.workers`).  Either way ``consumed`` counts only
the batches the loop received: what the workers prefetched and the loop did
not take is not counted, and is dropped when the position changes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol, Self

from torch.utils.data import default_collate

from ..errors import CheckpointMismatchError, ConfigError
from .fetch import fetch_in_process
from .plan import StreamPlan, batch_start
from .workers import LoaderOptions, WorkerPipeline


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
        num_workers: int = 0,
        prefetch_factor: int | None = None,
        pin_memory: bool = False,
        persistent_workers: bool = False,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        timeout: float = 0,
    ) -> None:
        """``num_workers`` .. ``timeout`` mean what they mean for ``torch.utils.data.DataLoader``.

        With ``num_workers=0`` (and no ``pin_memory``) samples are read in the
        training process, without a DataLoader.
        """
        if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
            raise ConfigError("ElasticLoader needs a map-style dataset (with __len__ and __getitem__)")
        if len(dataset) < 1:
            raise ConfigError("ElasticLoader got an empty dataset")
        if batch_size < 1:
            raise ConfigError(f"ElasticLoader batch_size={batch_size} must be >= 1")
        self.options = LoaderOptions(
            num_workers=num_workers, prefetch_factor=prefetch_factor, pin_memory=pin_memory,
            persistent_workers=persistent_workers, worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context, timeout=timeout,
        )
        self.dataset = dataset
        self.batch_size = batch_size
        self.collate_fn = collate_fn
        self._clock = clock
        self.consumed = 0
        """Samples consumed by all ranks together since the start of the run."""
        self.data_wait_s = 0.0
        """Time the loop waited in ``next()`` for its batches (with workers: not the workers' reading time)."""
        self.last_indices: list[int] = []
        """Dataset indices of the batch most recently returned on this rank."""
        self._plan = StreamPlan(len(dataset), seed, shuffle)
        self._pipeline: WorkerPipeline | None = None
        self.report_section: Callable[[str], AbstractContextManager[Any]] | None = None
        """Set by a Run under an agent (``Run.section``): waiting for a batch is then reported as section "data"."""
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
    def seed(self) -> int:
        return self._plan.seed

    @property
    def shuffle(self) -> bool:
        return self._plan.shuffle

    @property
    def epoch(self) -> int:
        return self.consumed // len(self.dataset)

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.world_size

    def indices_at(self, start: int, count: int) -> list[int]:
        """Dataset indices at global stream positions ``start .. start+count-1``."""
        return self._plan.indices(start, count)

    def __iter__(self) -> ElasticLoader:
        return self

    def __next__(self) -> Any:
        if self.report_section is not None:
            with self.report_section("data"):
                return self._produce()
        return self._produce()

    def _produce(self) -> Any:
        started = self._clock()
        try:
            if self.options.in_process:
                start = batch_start(self.consumed, self.rank, self.batch_size)
                indices = self.indices_at(start, self.batch_size)
                batch = fetch_in_process(self.dataset, self.collate_fn, start, indices)
            else:
                if self._pipeline is None:
                    self._pipeline = WorkerPipeline(self.dataset, self.collate_fn, self._plan, self.batch_size,
                                                    self.options)
                carried = self._pipeline.next_batch(self.consumed, self.rank, self.world_size)
                indices, batch = carried.indices, carried.data
        finally:
            self.data_wait_s += self._clock() - started
        self.consumed += self.global_batch_size
        self.last_indices = indices
        return batch

    def close(self) -> None:
        """Stop the worker processes, if any; a later ``next()`` starts them again."""
        pipeline, self._pipeline = self._pipeline, None
        if pipeline is not None:
            pipeline.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Workers also stop when torch's iterator is collected; closing here makes that prompt.
        if getattr(self, "_pipeline", None) is not None:
            self.close()

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
