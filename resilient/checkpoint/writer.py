"""This rank's saves in flight: their host buffers, their writer threads and their order.

A save is taken (snapshotted into a host buffer, the only part the training
loop waits for) and then written and committed on a thread of its own.  At
most two are in flight: one being written and, with
``when_busy="second_buffer"``, one queued behind it in the second buffer.
Saves are written in the order they were taken, one at a time, on every
rank, so the commit's collectives on the checkpoint group pair up across
ranks.  What to write and how to commit is the manager's (``write``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .manifest import Manifest
from .pacing import Pending
from .sharded import INDEX
from .snapshot import HostBuffer, Snapshot, take_snapshots


@dataclass(frozen=True)
class SaveResult:
    """Outcome of one save, as every rank sees it."""

    step: int
    name: str
    ok: bool
    error: str | None
    manifest: Manifest | None
    stall_s: float
    """Time the training loop waited: agreeing on the save, waiting for the previous one (``waited_s``) and
    the snapshot; never the time a deferred save was pending."""
    write_s: float
    """Background time from the start of its write (after the save queued ahead, if any) to commit outcome."""
    waited_s: float = 0.0
    """Part of ``stall_s`` spent waiting for earlier saves' outcomes (0 unless the save waited)."""
    deferred_from: int | None = None
    """The due step this save stands in for when it was deferred (taken at ``step`` instead); else None."""
    deferred_slots: int = 0
    """Due steps it stands in for that were not saved at their own step (0 when not deferred)."""
    queued: bool = False
    """Snapshotted into the second buffer while another save was written, and written after it."""


@dataclass
class Job:
    """One taken save, until its outcome is known."""

    step: int
    snapshots: dict[str, Snapshot]
    counters: dict[str, int]
    fingerprint: dict[str, Any]
    stall_s: float
    buffer: HostBuffer
    """Held (``in_use``) until the snapshots are written."""
    waited_s: float = 0.0
    landed: Pending | None = None
    """The deferred save this one stands in for."""
    behind: Job | None = None
    """The save it is queued behind (written first)."""
    index: list[dict[str, Any]] | None = None
    """This rank's chunk table of sharded state (see :mod:`.sharded`); None without sharded state."""
    done: threading.Event = field(default_factory=threading.Event)
    result: SaveResult | None = None
    thread: threading.Thread | None = None


class Writer:
    """Host buffers and the saves in flight of one rank; ``write(job)`` writes, commits and sets ``job.result``."""

    def __init__(self, write: Callable[[Job], None], *, background: bool) -> None:
        self._write = write
        self._background = background
        self.buffers = [HostBuffer()]  # a second one only with when_busy="second_buffer"
        self._jobs: list[Job] = []  # taken and not yet reaped by wait_all, oldest first

    def in_flight(self) -> list[Job]:
        """Saves without an outcome yet, oldest first."""
        return [j for j in self._jobs if not j.done.is_set()]

    def other_buffer(self, busy: HostBuffer, *, create: bool = True) -> HostBuffer:
        """The host buffer that ``busy`` is not; the second one is made on first use (an empty stand-in if not
        ``create``)."""
        if busy is not self.buffers[0]:
            return self.buffers[0]
        if len(self.buffers) == 1:
            if not create:
                return HostBuffer()
            self.buffers.append(HostBuffer())
        return self.buffers[1]

    def take(self, step: int, payloads: dict[str, Any], counters: dict[str, int], fingerprint: dict[str, Any],
             buffer: HostBuffer, *, started: float, waited_s: float, landed: Pending | None,
             behind: Job | None = None) -> Job:
        """Snapshot ``payloads`` into ``buffer`` (the loop's stall) and return the save to start.

        A chunk table under :data:`~.sharded.INDEX` is not a file: it goes with the commit report."""
        index = payloads.get(INDEX)
        payloads = {key: tree for key, tree in payloads.items() if key != INDEX}
        buffer.in_use.acquire()  # free, or held for a moment by prepare()'s allocation
        try:
            snapshots = take_snapshots(payloads, buffer)
        except BaseException:
            buffer.in_use.release()
            raise
        return Job(step, snapshots, dict(counters), fingerprint, stall_s=time.monotonic() - started, buffer=buffer,
                   waited_s=waited_s, landed=landed, behind=behind, index=index)

    def start(self, job: Job, *, wait: bool) -> SaveResult | None:
        """Write ``job`` in the background (its result later), or now when ``wait`` or not in the background."""
        self._jobs.append(job)
        if self._background and not wait:
            job.thread = threading.Thread(target=self._run, args=(job,), name="resilient-ckpt", daemon=False)
            job.thread.start()
            return None
        self._run(job)
        self._jobs.remove(job)
        return job.result

    def _run(self, job: Job) -> None:
        try:
            if job.behind is not None:
                job.behind.done.wait()
            self._write(job)
        finally:  # whoever waits for it (the loop, a queued save) must never wait forever
            job.done.set()

    def wait_all(self) -> tuple[SaveResult | None, float]:
        """Wait for every save in flight: the newest one's result (None if none) and the seconds waited
        (exactly 0.0 when every save already had its outcome)."""
        started = time.monotonic()
        waited = any(not j.done.is_set() for j in self._jobs)
        newest = self._jobs[-1] if self._jobs else None
        for job in self._jobs:
            job.done.wait()
            if job.thread is not None:
                job.thread.join()
        self._jobs.clear()
        return (newest.result if newest else None), (time.monotonic() - started if waited else 0.0)

    def prepare(self, nbytes: int, buffers: list[HostBuffer]) -> threading.Thread | None:
        """Allocate and fault in ``buffers`` for ``nbytes`` on a background thread (None if nothing to do)."""
        todo = [b for b in buffers if nbytes > b.capacity]
        if not todo:
            return None

        def reserve() -> None:
            for buffer in todo:
                with buffer.in_use:
                    buffer.reserve(nbytes)

        thread = threading.Thread(target=reserve, name="resilient-ckpt-prepare", daemon=True)
        thread.start()
        return thread
