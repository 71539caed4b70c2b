"""Fetching one rank's batch: in the training process, or in torch DataLoader workers.

Both paths read ``dataset[i]`` for each index of the batch and call the
user's ``collate_fn`` on the list, so they produce the same batch.  The
worker path hands torch's ``DataLoader`` three small objects:

- :class:`CursorBatchSampler` (main process): yields ``[(position, index),
  ...]`` for this rank's batches, starting at the cursor it was reset to and
  following a :class:`~resilient.data.plan.Layout` step after step; it is
  infinite, like the stream.
- :class:`PositionedDataset` (worker): ``dataset[index]``, carrying the
  position and index along with the sample.
- :class:`CarryingCollate` (worker): the user's collate on the samples,
  returned as a :class:`Batch` that still carries positions and indices, so
  the loader knows exactly which batch it received.

A sample or collate that raises becomes a :class:`Failure` record instead
of an exception in the worker: the loader raises :class:`DataFetchError`
when (and only when) the training loop asks for that batch, with the dataset
index, the stream position and the original exception, and the worker
stays usable.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from torch.utils.data import Dataset, Sampler, get_worker_info

from ..core.errors import DataFetchError
from .plan import Layout, StreamPlan


class Batch(NamedTuple):
    """A collated batch and the stream positions and dataset indices it was made from."""

    positions: list[int]
    indices: list[int]
    data: Any


class Failure(NamedTuple):
    """What went wrong while making a batch, as plain strings (it crosses a process boundary)."""

    position: int
    dataset_index: int | None
    cause_type: str
    cause: str
    where: str
    traceback: str
    batch_start: int = -1
    """Stream position of the first sample of the failed batch (set by the collate step)."""

    def error(self) -> DataFetchError:
        index = self.dataset_index
        what = f"dataset[{index}] at stream position {self.position}" if index is not None \
            else f"collate_fn on the batch starting at stream position {self.position}"
        message = f"ElasticLoader: {what} raised {self.cause_type}: {self.cause} ({self.where})"
        if self.traceback:
            message += f"\n\nTraceback in the worker process:\n{self.traceback.rstrip()}"
        return DataFetchError(message, position=self.position, index=index, cause_type=self.cause_type,
                              cause=self.cause)


def _failure(position: int, index: int | None, exc: Exception, *, with_traceback: bool) -> Failure:
    info = get_worker_info()
    where = f"in DataLoader worker {info.id}" if info is not None else "in the training process"
    tb = "".join(traceback.format_exception(exc)) if with_traceback else ""
    return Failure(position, index, type(exc).__qualname__, str(exc), where, tb)


def fetch_in_process(dataset: Any, collate_fn: Callable[[list[Any]], Any], start: int, indices: list[int]) -> Any:
    """Today's in-process path: read and collate, raising :class:`DataFetchError` chained to the cause."""
    samples = []
    for offset, index in enumerate(indices):
        try:
            samples.append(dataset[index])
        except Exception as exc:
            raise _failure(start + offset, index, exc, with_traceback=False).error() from exc
    try:
        return collate_fn(samples)
    except Exception as exc:
        raise _failure(start, None, exc, with_traceback=False).error() from exc


class PositionedDataset(Dataset[Any]):
    """Worker side: ``dataset[index]`` for a ``(position, index)`` key, with the key carried along."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> tuple[int, int, Any] | Failure:  # type: ignore[override]
        position, index = key
        try:
            return position, index, self.dataset[index]
        except Exception as exc:  # noqa: BLE001 - any error of the user's dataset becomes a record for the loop
            return _failure(position, index, exc, with_traceback=True)


class CarryingCollate:
    """Worker side: the user's ``collate_fn``, returning a :class:`Batch` (or the first :class:`Failure`)."""

    def __init__(self, collate_fn: Callable[[list[Any]], Any]) -> None:
        self.collate_fn = collate_fn

    def __call__(self, items: list[tuple[int, int, Any] | Failure]) -> Batch | Failure:
        positions = [item[0] for item in items]  # a Failure's first field is its position too
        samples: list[tuple[int, int, Any]] = []
        for item in items:
            if isinstance(item, Failure):
                return item._replace(batch_start=positions[0])
            samples.append(item)
        try:
            data = self.collate_fn([sample for _, _, sample in samples])
        except Exception as exc:  # noqa: BLE001 - any error of the user's collate_fn becomes a record for the loop
            return _failure(positions[0], None, exc, with_traceback=True)._replace(batch_start=positions[0])
        return Batch(positions, [index for _, index, _ in samples], data)


class CursorBatchSampler(Sampler[list[tuple[int, int]]]):
    """Main-process side: this rank's batches of ``(position, index)`` from the cursor it was last reset to.

    ``DataLoader`` calls ``iter()`` on it when an iterator is created or (with
    persistent workers) reset; each ``iter()`` snapshots the cursor, the
    layout (where this rank's batches lie in each step: one batch per step for
    ``next(loader)``, the plan's micro-batches for ``micro_batches()``) and the
    batch of the step to start at, so changing them later affects only the
    next reset.
    """

    def __init__(self, plan: StreamPlan, batch_size: int) -> None:
        self.plan = plan
        self.consumed = 0
        self.layout = Layout.classic(0, batch_size, 1)
        self.first = 0

    def reset(self, consumed: int, layout: Layout, first: int = 0) -> None:
        """Start at batch ``first`` of the step whose cursor is ``consumed``."""
        assert 0 <= first < len(layout.slots), (first, layout)
        self.consumed, self.layout, self.first = consumed, layout, first

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        return self._stream(self.consumed, self.layout, self.first)

    def _stream(self, cursor: int, layout: Layout, k: int) -> Iterator[list[tuple[int, int]]]:
        while True:  # the stream is infinite: epochs concatenate
            offset, size = layout.slots[k]
            start = cursor + offset
            yield list(zip(range(start, start + size), self.plan.indices(start, size), strict=True))
            k += 1
            if k == len(layout.slots):
                k, cursor = 0, cursor + layout.stride
