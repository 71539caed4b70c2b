"""``ElasticLoader``: deterministic, resumable, exactly-once batches.

The loader's position is a single *global* cursor: the number of samples
consumed by all ranks together.  The sample stream is the concatenation of
per-epoch permutations (seeded by ``seed`` and the epoch number), and each
step takes the next ``batch_size * world_size`` positions, rank ``r`` taking
the ``r``-th block.  Every sample of an epoch is therefore consumed exactly
once across ranks, batches that cross an epoch boundary stay full, and a
cursor saved on one world size means the same thing on any other.

A script that lets the :class:`~resilient.run.Run` split the step
(``run.micro_batches()``) takes its batches under the batch contract
instead: every step consumes the run's fixed global batch
(:attr:`ElasticLoader.global_batch`, ``batch_size`` times the world size at
the run's first start, kept in the checkpoint), split over the current
ranks in micro-batches by :func:`resilient.elastic.batch.plan_batch`, so the
step's samples are the same at any world size.

Reading and collating run in the training process (``num_workers=0``, the
default) or in torch ``DataLoader`` worker processes with prefetch and
pinning (:mod:`resilient.data.workers`).  Either way ``consumed`` counts only
the batches the loop received: what the workers prefetched and the loop did
not take is not counted, and is dropped when the position changes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol, Self

from torch.utils.data import default_collate

from ..core.errors import CheckpointMismatchError, ConfigError
from ..elastic.batch import BatchPlan, BatchRule, as_rule, plan_batch
from .fetch import fetch_in_process
from .plan import Layout, StreamPlan
from .workers import LoaderOptions, WorkerPipeline


class MapDataset(Protocol):
    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


class ElasticLoader:
    """Yields this rank's batches: ``next(loader)`` once per batch on every rank, or a step's ``micro_batches()``."""

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
        batch_rule: BatchRule | str = BatchRule.REFUSE,
    ) -> None:
        """``num_workers`` .. ``timeout`` mean what they mean for ``torch.utils.data.DataLoader``.

        With ``num_workers=0`` (and no ``pin_memory``) samples are read in the
        training process, without a DataLoader.  ``batch_rule`` says what
        :meth:`micro_batches` does at a world size that cannot split the
        global batch into equal micro-batches (:class:`~resilient.elastic.batch.BatchRule`).
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
        self.batch_rule = as_rule(batch_rule)
        self._global_batch: int | None = None
        self._batch_plan: BatchPlan | None = None
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
        self.held: dict[int, tuple[list[int], Any]] | None = None
        """Input-path isolation (``resilient diagnose input``): while set, each micro-batch slot's newest batch is
        kept here, and with :attr:`replaying` it is handed out again instead of read (the cursor still moves)."""
        self.replaying = False
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
        """Serve rank ``rank`` of ``world_size``; the first bind fixes the global batch (unless a checkpoint sets it)."""
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(f"ElasticLoader: rank {rank} is not within world size {world_size}")
        self.rank, self.world_size = rank, world_size
        if self._global_batch is None:
            self._global_batch = self.batch_size * world_size

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
        """Samples one round of ``next(loader)`` on every rank consumes: ``batch_size`` x the current world size."""
        return self.batch_size * self.world_size

    @property
    def global_batch(self) -> int:
        """Samples each step of :meth:`micro_batches` consumes, at any world size.

        ``batch_size`` times the world size of the first :meth:`bind` (the
        run's first start), or the value a restored checkpoint carries.
        """
        return self._global_batch if self._global_batch is not None else self.batch_size * self.world_size

    @property
    def plan(self) -> BatchPlan:
        """How a step's global batch is split at the current world size (may be infeasible: see its reason)."""
        plan = self._batch_plan
        if plan is None or (plan.global_batch, plan.micro_batch, plan.world_size, plan.rule) != \
                (self.global_batch, self.batch_size, self.world_size, self.batch_rule):
            plan = self._batch_plan = plan_batch(self.global_batch, self.batch_size, self.world_size, self.batch_rule)
        return plan

    def micro_batches(self, *, weighted: bool = False) -> Iterator[Any]:
        """This rank's micro-batches of the step at the cursor, under :attr:`plan`; the cursor moves on at the last.

        The step takes stream positions ``[consumed, consumed + global_batch)``
        and rank ``r`` its slots of them (:mod:`resilient.elastic.batch`).
        ``weighted=True`` yields ``(batch, weight)``: multiply the batch's
        mean loss by ``weight`` (needed when the plan is not even; with an
        even plan the weight is ``1 / accumulation``).  Abandoning the
        iteration before the last micro-batch leaves the cursor at the step's
        start.
        """
        plan = self.plan.require()
        if not plan.even and not weighted:
            raise ConfigError(
                f"ElasticLoader: {plan.reason}; micro-batches of unequal size need their losses weighted: iterate "
                "micro_batches(weighted=True) and multiply each micro-batch's mean loss by its weight"
            )
        return self._micro_batches(plan, self.consumed, weighted)

    def _micro_batches(self, plan: BatchPlan, cursor: int, weighted: bool) -> Iterator[Any]:
        layout = Layout(plan.slots(self.rank), plan.global_batch)
        last = len(layout.slots) - 1
        for k in range(len(layout.slots)):
            if self.consumed != cursor:
                raise ConfigError(
                    f"ElasticLoader: the cursor moved from {cursor} to {self.consumed} while the micro-batches of the "
                    "step were being taken; call neither next(loader) nor load_state_dict/rewind inside that loop"
                )
            batch = self._take(cursor, k, layout, cursor + plan.global_batch if k == last else cursor)
            yield (batch, plan.weight(self.rank, k)) if weighted else batch

    def rewind(self, consumed: int) -> None:
        """Put the cursor back to ``consumed`` (an attempt's start): the batches from there are served again.

        Batches the workers prefetched from the later position are dropped.
        """
        if isinstance(consumed, bool) or not isinstance(consumed, int) or consumed < 0:
            raise ConfigError(f"ElasticLoader.rewind({consumed!r}): the cursor is an int >= 0")
        self.consumed = consumed

    def indices_at(self, start: int, count: int) -> list[int]:
        """Dataset indices at global stream positions ``start .. start+count-1``."""
        return self._plan.indices(start, count)

    def __iter__(self) -> ElasticLoader:
        return self

    def __next__(self) -> Any:
        layout = Layout.classic(self.rank, self.batch_size, self.world_size)
        return self._take(self.consumed, 0, layout, self.consumed + layout.stride)

    def _take(self, cursor: int, k: int, layout: Layout, after: int) -> Any:
        """Batch ``k`` of the step at ``cursor``; once it is received the cursor is ``after``."""
        if self.report_section is not None:
            with self.report_section("data"):
                indices, batch = self._fetch(cursor, k, layout)
        else:
            indices, batch = self._fetch(cursor, k, layout)
        self.consumed = after
        self.last_indices = indices
        return batch

    def _fetch(self, cursor: int, k: int, layout: Layout) -> tuple[list[int], Any]:
        started = self._clock()
        try:
            if self.held is not None:
                if self.replaying and k in self.held:
                    return self.held[k]  # resident in memory: no reading, no collating, no transfer
                self.held[k] = self._read(cursor, k, layout)
                return self.held[k]
            return self._read(cursor, k, layout)
        finally:
            self.data_wait_s += self._clock() - started

    def _read(self, cursor: int, k: int, layout: Layout) -> tuple[list[int], Any]:
        if self.options.in_process:
            offset, size = layout.slots[k]
            indices = self.indices_at(cursor + offset, size)
            return indices, fetch_in_process(self.dataset, self.collate_fn, cursor + offset, indices)
        if self._pipeline is None:
            self._pipeline = WorkerPipeline(self.dataset, self.collate_fn, self._plan, self.batch_size, self.options)
        carried = self._pipeline.next_batch(cursor, k, self.rank, layout)
        return carried.indices, carried.data

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
            "global_batch": self.global_batch,
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
        # The run's global batch outlives a change of world size; a checkpoint from before it was saved
        # carries the batch of the ranks that wrote it.
        saved = state.get("global_batch")
        self._global_batch = int(saved) if saved is not None else int(state["batch_size"]) * int(state["world_size"])
