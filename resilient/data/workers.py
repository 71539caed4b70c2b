"""Worker processes, prefetch and pinning for ``ElasticLoader``: torch's ``DataLoader``, driven by the cursor.

``ElasticLoader`` owns the cursor; this module owns one ``DataLoader`` over
:class:`~resilient.data.fetch.PositionedDataset` with a
:class:`~resilient.data.fetch.CursorBatchSampler`, and the iterator over it.

Staleness.  The iterator prefetches batches from the cursor position it was
started at.  :meth:`WorkerPipeline.next_batch` is told where the loop is
(the step's cursor, which of this rank's batches of the step, the rank and
the :class:`~resilient.data.plan.Layout`: one batch per step for
``next(loader)``, the batch plan's micro-batches for ``micro_batches()``);
when that is not where the iterator stands (a ``load_state_dict``, a
``rewind``, a ``bind`` to another world size, a switch between the two ways
of taking batches, a failed batch, any change of ``consumed``) the iterator
is restarted from the new position and every prefetched batch is dropped:

- without persistent workers, the old iterator is dropped (torch shuts its
  workers down) and a new one starts;
- with persistent workers, ``iter(DataLoader)`` resets the same iterator:
  torch sends each worker a resume marker behind its queued tasks and
  discards everything that arrives before all markers are back, so no batch
  of the old position can follow.

Every received batch carries its stream positions, and a batch that does not
start where the loop is raises ``AssertionError``: a stale batch can never be
returned, even if the above were to change in a later torch.

The DataLoader gets its own ``torch.Generator`` (seeded from the loader's
seed, rank and start position), because by default it draws its worker base
seed from the global torch RNG, and a resumed run must draw exactly the
random numbers the uninterrupted run drew.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader

from ..core.errors import ConfigError
from .fetch import Batch, CarryingCollate, CursorBatchSampler, Failure, PositionedDataset
from .plan import Layout, StreamPlan


@dataclass(frozen=True, kw_only=True)
class LoaderOptions:
    """The ``DataLoader`` settings ``ElasticLoader`` passes through; same meaning as in torch."""

    num_workers: int = 0
    """Worker processes that read and collate batches; 0 reads them in the training process."""
    prefetch_factor: int | None = None
    """Batches each worker loads ahead (torch's default, 2, when None); only with workers."""
    pin_memory: bool = False
    """Copy batches into page-locked memory (a no-op with a warning from torch without an accelerator)."""
    persistent_workers: bool = False
    """Keep the workers alive across restarts of the stream (a restore, a world-size change)."""
    worker_init_fn: Callable[[int], None] | None = None
    """Called in each worker with its id, after seeding and before reading."""
    multiprocessing_context: str | Any = None
    """Start method ("fork", "spawn", "forkserver") or a multiprocessing context; torch's default when None."""
    timeout: float = 0
    """Seconds to wait for a batch from the workers before raising; 0 waits forever."""

    def __post_init__(self) -> None:
        n = self.num_workers
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ConfigError(f"ElasticLoader num_workers={n!r} must be an int >= 0 (0 reads in the training process)")
        if self.prefetch_factor is not None:
            if n == 0:
                raise ConfigError(
                    f"ElasticLoader prefetch_factor={self.prefetch_factor} needs worker processes: set num_workers > 0, "
                    "or leave prefetch_factor=None")
            if isinstance(self.prefetch_factor, bool) or not isinstance(self.prefetch_factor, int) \
                    or self.prefetch_factor < 1:
                raise ConfigError(f"ElasticLoader prefetch_factor={self.prefetch_factor!r} must be an int >= 1")
        if self.persistent_workers and n == 0:
            raise ConfigError("ElasticLoader persistent_workers=True needs num_workers > 0")
        if not isinstance(self.timeout, (int, float)) or self.timeout < 0:
            raise ConfigError(f"ElasticLoader timeout={self.timeout!r} must be a number of seconds >= 0 (0: no limit)")
        if self.timeout > 0 and n == 0:
            raise ConfigError(f"ElasticLoader timeout={self.timeout} applies to worker processes: set num_workers > 0")
        if self.worker_init_fn is not None and (n == 0 or not callable(self.worker_init_fn)):
            raise ConfigError("ElasticLoader worker_init_fn must be a callable taking the worker id, with num_workers > 0")
        ctx = self.multiprocessing_context
        if ctx is not None:
            if n == 0:
                raise ConfigError(
                    f"ElasticLoader multiprocessing_context={ctx!r} needs worker processes: set num_workers > 0")
            methods = multiprocessing.get_all_start_methods()
            if isinstance(ctx, str) and ctx not in methods:
                raise ConfigError(f"ElasticLoader multiprocessing_context={ctx!r} is not a start method here; "
                                  f"use one of {methods}")
            if not isinstance(ctx, (str, multiprocessing.context.BaseContext)):
                raise ConfigError(f"ElasticLoader multiprocessing_context={ctx!r} must be a start method name or a "
                                  "multiprocessing context")

    @property
    def in_process(self) -> bool:
        """True when batches are read in the training process without torch's DataLoader (today's path)."""
        return self.num_workers == 0 and not self.pin_memory


class WorkerPipeline:
    """One ``DataLoader`` and its iterator, restarted whenever the loop's position is not the iterator's."""

    def __init__(self, dataset: Any, collate_fn: Callable[[list[Any]], Any], plan: StreamPlan, batch_size: int,
                 options: LoaderOptions) -> None:
        self._plan = plan
        self._sampler = CursorBatchSampler(plan, batch_size)
        self._options = options
        self._generator = torch.Generator()
        self._dataset = PositionedDataset(dataset)
        self._collate = CarryingCollate(collate_fn)
        self._loader: DataLoader[Any] | None = None
        self._iterator: Any = None
        self._expect: tuple[int, int, int, Layout] | None = None
        """(step cursor, batch of the step, rank, layout) the running iterator delivers next; None: none running."""
        self.restarts = 0
        """Times the iterator was (re)started: the first start, then every change of position."""

    def next_batch(self, consumed: int, k: int, rank: int, layout: Layout) -> Batch:
        """Batch ``k`` of the step at cursor ``consumed`` laid out by ``layout``; DataFetchError if reading it failed."""
        start = consumed + layout.slots[k][0]
        if self._iterator is None or self._expect != (consumed, k, rank, layout):
            self._restart(consumed, k, rank, layout)
        try:
            item = next(self._iterator)
        except BaseException:
            # A dead worker, a timeout, an interrupt: start over (new workers) at this position next time.
            self._drop()
            raise
        got = item.batch_start if isinstance(item, Failure) else item.positions[0]
        if got != start:
            raise AssertionError(f"ElasticLoader received the batch at stream position {got}, expected {start}")
        if isinstance(item, Failure):
            self._expect = None  # the iterator has moved past the failed batch: a retry restarts it here
            raise item.error()
        last = k + 1 == len(layout.slots)
        self._expect = (consumed + layout.stride, 0, rank, layout) if last else (consumed, k + 1, rank, layout)
        return item

    def _build(self) -> DataLoader[Any]:
        o = self._options
        return DataLoader(
            self._dataset, batch_sampler=self._sampler, collate_fn=self._collate,
            num_workers=o.num_workers, prefetch_factor=o.prefetch_factor, pin_memory=o.pin_memory,
            persistent_workers=o.persistent_workers, worker_init_fn=o.worker_init_fn,
            multiprocessing_context=o.multiprocessing_context, timeout=o.timeout, generator=self._generator,
        )

    def _restart(self, consumed: int, k: int, rank: int, layout: Layout) -> None:
        if not self._options.persistent_workers:
            self._iterator = None  # drop the old one first: its workers shut down before new ones start
        if self._loader is None:
            self._loader = self._build()
        self._sampler.reset(consumed, layout, k)
        key = (self._plan.seed, rank, consumed) if k == 0 else (self._plan.seed, rank, consumed, k)
        self._generator.manual_seed(hash(key) % (2**63))
        self._iterator = iter(self._loader)
        self._expect = (consumed, k, rank, layout)
        self.restarts += 1

    def _drop(self) -> None:
        # Releasing the DataLoader releases its persistent iterator too; torch stops the workers on release.
        self._iterator = None
        self._loader = None
        self._expect = None

    def close(self) -> None:
        """Stop the workers; a later :meth:`next_batch` starts new ones."""
        self._drop()
