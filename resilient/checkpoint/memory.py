"""The memory tier: each rank's state at recent step boundaries, in shared memory its node's agent owns.

A restarted worker restores from here when it holds a step newer than the
newest durable commit: no store to read, and the steps since the last
durable commit are not done again.  The agent names the directory
(``RESILIENT_MEMORY_DIR``, in ``/dev/shm``) and its byte limit
(``RESILIENT_MEMORY_LIMIT``); the directory outlives the workers and a
killed agent, and is removed when the run ends on the node.

Layout, per rank ``r`` and slot ``k`` (three turning slots 0-2, and pinned slots 3-5 for the steps that
are multiples of ``RESILIENT_MEMORY_PIN_EVERY`` when the agent keeps a copy on a peer node, three more)::

    rank{r:05d}.{k}.shard    the rank's state, in the shard format of a durable file
    rank{r:05d}.{k}.json     its manifest: step, world size, generation, fingerprint, size, digest
    replicated.{k}.shard     the replicated state (model, optimizer), written by the node's local rank 0
    replicated.{k}.json

A save takes the slot (of its kind) holding the oldest step, removes its manifest first,
copies the state straight into the slot's mapping (the only part the loop
waits for), then hashes it and publishes the manifest on a background
thread (written to a temporary name and renamed, so a manifest is either
whole or absent).  A slot whose manifest is missing, or whose bytes do not
match its digest, holds nothing.  The next save first waits for the
previous one's manifest, so a rank always holds its two newest published
steps while it writes a third; ranks of a job are at most one step apart
(every step's gradients pass through all of them), so a step every rank
holds survives any crash.  Space is reserved with ``posix_fallocate``
before a slot is mapped (a tmpfs out of room would otherwise kill the
writer with SIGBUS mid-copy), under a lock shared by the node's ranks,
against the limit: a rank without room says so and saves nothing here.

Restoring (:func:`restore_memory`) agrees on the newest step every rank
holds that is newer than the durable commit, verifies it on every rank
(read into private memory, so that nothing restored aliases a slot a later
save overwrites) and falls back to the durable tier, with an event, when
any rank's copy fails.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import mmap
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..core.errors import CheckpointCorruptError
from ..core.events import EventKind, EventLog
from .coordinator import Coordinator
from .digest import DEFAULT, DEFAULT_CHUNK_BYTES, HEX_LENGTH, SHA256, ChunkedHasher, hash_pool
from .shard import decode, plan_layout
from .snapshot import copy_tensors
from .tree import flatten, unflatten

FORMAT = "resilient.memory/1"
SLOTS = 3
PINNED = (3, 4, 5)
"""Slots of the pinned steps (multiples of ``RESILIENT_MEMORY_PIN_EVERY``): the same steps on every node, kept
while the other slots turn over, so a copy on a peer node (:mod:`resilient.agent.memory_replica`) matches steps
the survivors still hold.  Three, as the turning slots are: when every save is a pinned one, a rank still holds
its two newest published steps while it writes a third."""
ALL_SLOTS = (*range(SLOTS), *PINNED)
REPLICATED = "replicated"
RANK = "rank"
DIR_ENV = "RESILIENT_MEMORY_DIR"
LIMIT_ENV = "RESILIENT_MEMORY_LIMIT"
PIN_EVERY_ENV = "RESILIENT_MEMORY_PIN_EVERY"
EVERY_ENV = "RESILIENT_MEMORY_EVERY"
"""Steps between memory saves; ``auto`` (or unset) chooses from the measured cost (:func:`resilient.run.memory.decide_interval`)."""


def file_stem(key: str, rank: int) -> str:
    return REPLICATED if key == REPLICATED else f"rank{rank:05d}"


@dataclass(frozen=True)
class SlotRecord:
    """A published slot: what its manifest says."""

    stem: str
    slot: int
    step: int
    world_size: int
    generation: int
    fingerprint: str | None
    """A digest of the writing Run's fingerprint (model, config, code): another one never restores it."""
    size: int
    digest: str
    chunk_bytes: int
    counters: dict[str, int]
    created_unix: float
    algorithm: str = SHA256
    """How ``digest`` was made (:mod:`.digest`; a manifest without it was written with SHA-256)."""

    def to_json(self) -> bytes:
        return json.dumps({"format": FORMAT, **self.__dict__}, sort_keys=True).encode()

    @classmethod
    def parse(cls, raw: bytes, stem: str, slot: int) -> SlotRecord | None:
        """The record, or None for anything that is not a whole manifest of ``stem``'s slot ``slot``."""
        try:
            body = json.loads(raw)
            if not isinstance(body, dict) or body.get("format") != FORMAT:
                return None
            record = cls(stem=str(body["stem"]), slot=int(body["slot"]), step=int(body["step"]),
                         world_size=int(body["world_size"]), generation=int(body["generation"]),
                         fingerprint=body["fingerprint"] if isinstance(body["fingerprint"], str) else None, size=int(body["size"]),
                         digest=str(body["digest"]), chunk_bytes=int(body["chunk_bytes"]),
                         counters={str(k): int(v) for k, v in dict(body["counters"]).items()},
                         created_unix=float(body["created_unix"]), algorithm=str(body.get("algorithm", SHA256)))
        except (ValueError, TypeError, KeyError, AttributeError):
            return None
        ok = (record.stem == stem and record.slot == slot and record.step >= 0 and record.size > 0
              and record.chunk_bytes > 0 and record.world_size > 0 and record.algorithm in HEX_LENGTH)
        return record if ok else None


def read_records(root: Path, stem: str, slots: tuple[int, ...] = ALL_SLOTS) -> list[SlotRecord]:
    """The published slots of ``stem`` in ``root`` (of ``slots``: all, pinned included), newest step first."""
    records = []
    for slot in slots:
        try:
            raw = (root / f"{stem}.{slot}.json").read_bytes()
        except OSError:
            continue
        record = SlotRecord.parse(raw, stem, slot)
        if record is not None:
            records.append(record)
    return sorted(records, key=lambda r: -r.step)


def usage(root: Path) -> int:
    """Bytes the memory tier's files in ``root`` hold (allocated, not apparent), its folders' (a peer's copy)
    included."""
    total = 0
    with contextlib.suppress(OSError):
        for entry in os.scandir(root):
            with contextlib.suppress(OSError):
                if entry.is_file(follow_symlinks=False):
                    total += entry.stat(follow_symlinks=False).st_blocks * 512
                elif entry.is_dir(follow_symlinks=False):
                    total += usage(Path(entry.path))
    return total


@contextlib.contextmanager
def locked(root: Path) -> Iterator[None]:
    """The node's tier lock: held while space is counted and reserved, by its ranks and its agent."""
    fd = os.open(root / ".lock", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class NoRoom(Exception):
    """A slot could not be reserved: the node's limit or its shared memory is full."""


class _Slot:
    """One slot's file, mapped for writing."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.size = 0
        self._map: mmap.mmap | None = None
        self.buf: torch.Tensor | None = None

    def reserve(self, size: int, root: Path, limit: int) -> None:
        """Make the file exactly ``size`` bytes, its pages allocated, and map it (NoRoom when that cannot be)."""
        if size == self.size and self._map is not None:
            return
        self.release()
        self._map = reserve_file(self.path, size, root, limit)
        self.size = size
        self.buf = torch.frombuffer(self._map, dtype=torch.uint8)

    def view(self) -> memoryview:
        assert self._map is not None
        return memoryview(self._map)

    def release(self) -> None:
        self.buf = None
        if self._map is not None:
            self._map.close()
            self._map = None
        self.size = 0


def reserve_file(path: Path, size: int, root: Path, limit: int) -> mmap.mmap:
    """``path`` made exactly ``size`` bytes, its pages allocated, within the limit of the node's tier at ``root``,
    and mapped for writing (:class:`NoRoom` when that cannot be)."""
    with locked(root):
        have = 0
        with contextlib.suppress(FileNotFoundError):
            have = path.stat().st_blocks * 512
        need = usage(root) - have + -(-size // mmap.PAGESIZE) * mmap.PAGESIZE  # tmpfs allocates whole pages
        if need > limit:
            raise NoRoom(f"the node's memory tier would hold {need} bytes, over its limit of {limit} "
                         "(raise it with --memory-limit)")
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, 0)  # nothing of an older layout stays behind the new end
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                os.ftruncate(fd, 0)
                if e.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
                    raise NoRoom(f"{path.parent} has no room for {size} more bytes ({e.strerror})") from None
                raise
            return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)


@dataclass
class SaveCost:
    """What one memory save cost: the loop's stall (waiting for the previous one, the copy) and the hashing."""

    step: int
    bytes: int
    stall_s: float
    hash_s: float = 0.0


class MemoryTier:
    """One rank's side of its node's memory tier."""

    def __init__(self, root: str | os.PathLike[str], *, limit: int, local_rank: int, events: EventLog,
                 generation: int = 0, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        self.root = Path(root)
        self.limit = limit
        self.local_rank = local_rank
        self.events = events
        self.generation = generation
        self.chunk_bytes = chunk_bytes
        self.off: str | None = None
        """Why this rank saves nothing here (no room); None while it saves."""
        self._slots: dict[str, _Slot] = {}
        self._held: dict[str, dict[int, int]] = {}
        """Published slots of the files this rank writes: stem -> {slot: step} (read from disk on first use)."""
        self._jobs: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self._publisher: threading.Thread | None = None
        self._failure: BaseException | None = None
        self.costs: list[SaveCost] = []
        """The newest saves' costs, oldest first (the cadence reads them)."""
        self.root.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------ saving
    def save(self, step: int, payloads: dict[str, Any], *, rank: int, world_size: int, fingerprint: str | None,
             counters: dict[str, int], pin: bool = False) -> SaveCost | None:
        """Copy ``payloads`` (``{"rank": ..., "replicated": ...}``) into free slots as step ``step``; ``pin``: into
        a pinned slot (:data:`PINNED`), kept while the others turn over.

        Returns the cost, or None when this rank saves nothing here (:attr:`off`).  The manifest is published
        in the background; :meth:`wait` waits for it.
        """
        if self.off is not None:
            return None
        started = time.perf_counter()
        self.wait()
        plans = {}
        for key, tree in payloads.items():
            if key == REPLICATED and self.local_rank != 0:
                continue
            skeleton, tensors = flatten(tree, key)
            plans[file_stem(key, rank)] = (plan_layout(skeleton, tensors), tensors)
        written = []
        try:
            for stem, (layout, tensors) in plans.items():
                held = self._held_of(stem)
                for stale in [slot for slot, at in held.items() if at >= step]:
                    self._unpublish(stem, stale)  # a future the run went back from: never to be restored
                slot = self._free_slot(stem, PINNED if pin else tuple(range(SLOTS)))
                self._unpublish(stem, slot)  # invalid from here until published
                target = self._slots.setdefault(f"{stem}.{slot}", _Slot(self.root / f"{stem}.{slot}.shard"))
                size = len(layout.header) + layout.data_bytes
                target.reserve(size, self.root, self.limit)
                _copy_into(target, layout, tensors)
                written.append((stem, slot, target, size))
        except NoRoom as e:
            self._turn_off(str(e), step)
            return None
        cost = SaveCost(step, sum(size for *_, size in written), time.perf_counter() - started)
        record = {"world_size": world_size, "generation": self.generation, "fingerprint": fingerprint,
                  "counters": counters}
        if self._publisher is None:
            self._publisher = threading.Thread(target=self._publish_loop, name="resilient-memory", daemon=True)
            self._publisher.start()
        self._idle.clear()
        self._jobs.put((step, written, record, cost))
        self.costs = [*self.costs[-7:], cost]
        return cost

    def _held_of(self, stem: str) -> dict[int, int]:
        if stem not in self._held:
            self._held[stem] = {r.slot: r.step for r in read_records(self.root, stem)}  # pinned slots too
        return self._held[stem]

    def _unpublish(self, stem: str, slot: int) -> None:
        (self.root / f"{stem}.{slot}.json").unlink(missing_ok=True)
        self._held_of(stem).pop(slot, None)

    def _free_slot(self, stem: str, slots: tuple[int, ...] = tuple(range(SLOTS))) -> int:
        """The slot of ``stem`` among ``slots`` to write next: one without a published step, else the oldest
        step's."""
        held = self._held_of(stem)
        empty = [s for s in slots if s not in held]
        return empty[0] if empty else min(slots, key=lambda s: held[s])

    def _publish_loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                self._publish(*job)
            finally:
                self._idle.set()

    def _publish(self, step: int, written: list[tuple[str, int, _Slot, int]], record: dict[str, Any],
                 cost: SaveCost) -> None:
        started = time.perf_counter()
        try:
            for stem, slot, target, size in written:
                hasher = ChunkedHasher(self.chunk_bytes, hash_pool("write"), DEFAULT)
                view = target.view()
                hasher.update(view[:size])
                digest = hasher.hexdigest()
                del view
                entry = SlotRecord(stem=stem, slot=slot, step=step, size=size, digest=digest,
                                   chunk_bytes=self.chunk_bytes, created_unix=time.time(), algorithm=DEFAULT, **record)
                final = self.root / f"{stem}.{slot}.json"
                temporary = final.with_suffix(".json.tmp")
                temporary.write_bytes(entry.to_json())
                os.replace(temporary, final)
                self._held_of(stem)[slot] = step
        except BaseException as e:  # noqa: BLE001  reported by the next save or wait, never lost
            self._failure = e
        cost.hash_s = time.perf_counter() - started

    def wait(self) -> None:
        """Wait for the save in flight to be published (a failure to publish turns the tier off, with why)."""
        self._idle.wait()
        failure, self._failure = self._failure, None
        if failure is not None:
            self._turn_off(f"publishing a save failed: {type(failure).__name__}: {failure}", None)

    def _turn_off(self, why: str, step: int | None) -> None:
        self.off = why
        for slot in self._slots.values():
            slot.release()
        self.events.emit(EventKind.MEMORY_TIER_OFF, reason=why, step=step, directory=str(self.root),
                         limit_bytes=self.limit, used_bytes=usage(self.root))

    def forget(self, rank: int) -> None:
        """Remove rank ``rank``'s slots (this process no longer holds that rank: an in-process regroup)."""
        self.wait()
        for name in [n for n in self._slots if n.startswith(file_stem(RANK, rank) + ".")]:
            self._slots.pop(name).release()
        self._held.pop(file_stem(RANK, rank), None)
        for slot in ALL_SLOTS:
            for suffix in ("json", "shard"):
                (self.root / f"{file_stem(RANK, rank)}.{slot}.{suffix}").unlink(missing_ok=True)

    def close(self) -> None:
        self.wait()
        if self._publisher is not None:
            self._jobs.put(None)
            self._publisher.join()
            self._publisher = None
        for slot in self._slots.values():
            slot.release()
        self._slots.clear()

    # ------------------------------------------------------------ restoring
    def holdings(self, *, rank: int, world_size: int, fingerprint: str | None) -> list[tuple[int, int]]:
        """(step, generation) pairs this rank could restore from here, newest first: its own state and its
        node's replicated state both published at that step by that generation, of a job of this world size and
        fingerprint, not of a later generation.  A pair names one trajectory: the ranks restore the same one."""
        def fits(r: SlotRecord) -> bool:
            return r.world_size == world_size and r.fingerprint == fingerprint and r.generation <= self.generation

        own = {(r.step, r.generation) for r in read_records(self.root, file_stem(RANK, rank)) if fits(r)}
        shared = {(r.step, r.generation) for r in read_records(self.root, REPLICATED) if fits(r)}
        return sorted(own & shared, reverse=True)

    def load(self, step: int, generation: int, rank: int) -> tuple[Any, Any, dict[str, int]]:
        """The replicated tree, this rank's tree and the counters of ``step`` as ``generation`` saved it,
        verified, in private memory.

        Raises :class:`CheckpointCorruptError` naming the file and the problem.
        """
        trees = {}
        counters: dict[str, int] = {}
        for stem in (REPLICATED, file_stem(RANK, rank)):
            record = next((r for r in read_records(self.root, stem) if (r.step, r.generation) == (step, generation)),
                          None)
            name = f"memory:{stem}@{step}"
            if record is None:
                raise CheckpointCorruptError(name, None, "the slot was overwritten or removed since it was listed")
            path = self.root / f"{stem}.{record.slot}.shard"
            buf = bytearray(record.size)
            try:
                with open(path, "rb") as f:
                    got = f.readinto(buf)
            except OSError as e:
                raise CheckpointCorruptError(name, path.name, f"unreadable ({e.strerror})") from None
            if got != record.size:
                raise CheckpointCorruptError(name, path.name, f"{got} bytes, its manifest says {record.size}")
            hasher = ChunkedHasher(record.chunk_bytes, hash_pool("read"), record.algorithm)
            hasher.update(buf)
            if hasher.hexdigest() != record.digest:
                raise CheckpointCorruptError(name, path.name, "digest mismatch (the bytes changed after the save)")
            try:
                skeleton, tensors = decode(buf)
                trees[stem] = unflatten(skeleton, tensors)
            except Exception as e:  # noqa: BLE001  damage whatever the decoder says
                raise CheckpointCorruptError(name, path.name, f"undecodable content ({e})") from None
            if stem != REPLICATED:
                counters = record.counters
        return trees[REPLICATED], trees[file_stem(RANK, rank)], counters


def _copy_into(target: _Slot, layout: Any, tensors: list[torch.Tensor]) -> None:
    buf = target.buf
    assert buf is not None
    header = len(layout.header)
    buf[:header].copy_(torch.frombuffer(bytearray(layout.header), dtype=torch.uint8))
    if copy_tensors(buf, header, layout, tensors):
        torch.cuda.synchronize()


# ---------------------------------------------------------------- restore across ranks
@dataclass(frozen=True)
class MemoryRestored:
    step: int
    replicated: Any
    rank_state: Any
    counters: dict[str, int]
    prepared: Any = None
    """What ``restore_memory``'s ``prepare`` made of the loaded state (the sharded tensors, for one)."""


def restore_memory(tier: MemoryTier, coord: Coordinator, events: EventLog, *, fingerprint: str | None,
                   not_before: int | None, agree: Callable[[Coordinator, str, str], tuple[str, str]],
                   prepare: Callable[[Any, Any], Any] | None = None) -> MemoryRestored | None:
    """The newest step every rank holds in its memory tier (saved by the same generation everywhere), not older
    than ``not_before`` (the durable commit's step), verified on every rank; None (the durable tier then) when
    there is none.

    Collective on ``coord``: rank 0 intersects the ranks' holdings, every rank loads the chosen step, and the
    ranks' verdicts are combined by ``agree`` (the durable restore's).  ``prepare(replicated, rank_state)``, where
    given, runs on every rank before the verdict (its error fails the step everywhere, as damage does).  A step
    that fails anywhere is reported and the next older common one tried; one older than the durable commit never
    is.
    """
    mine = tier.holdings(rank=coord.rank, world_size=coord.world_size, fingerprint=fingerprint)
    gathered = coord.gather(json.dumps(mine).encode())
    chosen = None
    if gathered is not None:
        common = set.intersection(*({(int(s), int(g)) for s, g in json.loads(raw)} for raw in gathered))
        chosen = json.dumps(sorted((p for p in common if not_before is None or p[0] >= not_before), reverse=True))
    candidates = json.loads(coord.broadcast(chosen.encode() if chosen is not None else None))
    problems: list[str] = []
    for step, generation in candidates:
        status, detail, loaded, prepared = "ok", "", None, None
        try:
            loaded = tier.load(step, generation, coord.rank)
            if prepare is not None:
                prepared = prepare(loaded[0], loaded[1])
        except CheckpointCorruptError as e:
            status, detail = "corrupt", f"rank {coord.rank}: {e.file}: {e.problem}"
        except Exception as e:  # noqa: BLE001  the peers must hear of it
            status, detail = "error", f"rank {coord.rank}: {type(e).__name__}: {e}"
        kind, why = agree(coord, status, detail)
        if kind == "ok":
            assert loaded is not None
            events.emit(EventKind.MEMORY_TIER_RESTORED, step=step, generation=generation, durable_step=not_before,
                        skipped=problems, directory=str(tier.root))
            return MemoryRestored(step, loaded[0], loaded[1], loaded[2], prepared)
        problems.append(f"step {step}: {why}")
    if problems:
        events.emit(EventKind.MEMORY_TIER_FALLBACK, durable_step=not_before, problems=problems,
                    directory=str(tier.root))
    return None
