"""Verified reads straight into final storage: a format-4 file read block by block into the live tensors.

A restore used to read each file whole into new memory, hash it, decode it,
and then copy the tensors into the model (and let the optimizer keep the
rest in the read buffer).  Here, with the manifest's block digests
(format 4, :mod:`.digest`):

1. the blocks holding the shard's header are read into a small scratch
   buffer and verified before the header is parsed (a damaged header is
   never trusted, not even to size an allocation);
2. every tensor of the file gets its destination: the live tensor at the
   same key path where one matches (dtype, shape, contiguous, on the CPU),
   else new memory that becomes the restored state;
3. every other block is read with one scatter read (``preadv``) straight
   into the destinations' bytes (alignment padding into scratch) and
   hashed as it lands, several blocks at once on the read pool.  A reader
   that wants only some tensors (a sharded rank's chunks in a peer's file)
   reads only the blocks that hold them; the rest of the file stays unread
   and its tensors come back as empty placeholders.

The restored tree's tensors are then the live ones, so the caller's
``load_state_dict`` copies nothing (a copy onto itself is skipped).  A
block that does not match its digest fails the file, naming the block; the
live tensors may then hold part of it, which is safe because a failed
restore either restores another checkpoint into the same tensors or stops
the run (the agreed verdict of :mod:`.restore`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Collection, Mapping
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any, cast

import torch

from ..core.errors import CheckpointCorruptError, StorageError
from .digest import hash_pool, hash_views
from .manifest import FileEntry, Manifest
from .shard import DTYPES, Header, TensorEntry, header_end, parse_header
from .sharded import walk
from .storage import RangeReader, Storage
from .tree import unflatten

Path = tuple[Any, ...]


def can_place(manifest: Manifest) -> bool:
    """Whether ``manifest``'s files can be read in place (format 4 lists the block digests it needs)."""
    return all(f.blocks for f in manifest.files)


def live_paths(tree: Any) -> dict[Path, torch.Tensor]:
    """The tensors of a live state tree by key path: where a restore may read straight into."""
    return {path: leaf for path, leaf in walk(tree) if isinstance(leaf, torch.Tensor)}


@dataclass(frozen=True)
class Placed:
    """What :func:`read_placed` read: the decoded tree and the bytes it took from the store."""

    tree: Any
    read_bytes: int


def read_placed(storage: Storage, manifest: Manifest, entry: FileEntry, live: Mapping[Path, torch.Tensor],
                only: Collection[Path] | None = None) -> Placed:
    """The decoded tree of ``entry``, its tensors read into ``live``'s at the same key paths where they match
    and into new memory elsewhere, every block verified as it lands.  ``only``: the key paths of the tensors
    wanted (None: all); the others come back as empty placeholders, their blocks unread unless a wanted
    tensor shares them.

    Raises :class:`CheckpointCorruptError` naming the damage, :class:`StorageError` when the store cannot be
    read (FileNotFoundError becomes "file is missing", as in :mod:`.verify`).
    """
    def corrupt(problem: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(manifest.name, entry.path, problem)

    spec = manifest.spec
    block = spec.block_bytes
    try:
        reader = storage.open_ranges(manifest.name, entry.path)
    except FileNotFoundError:
        raise corrupt("file is missing") from None
    except StorageError:
        raise
    except Exception as e:  # every rank must reach the same verdict, whatever broke (as in .verify)
        raise _unreadable(storage, manifest, entry, e) from e
    try:
        if reader.size != entry.size:
            raise corrupt(f"size is {reader.size} bytes, manifest says {entry.size} (truncated or overwritten)")
        # The header's blocks first, verified before a byte of the header is believed.
        head = bytearray(min(block, entry.size))
        _read_block(reader, 0, block, [memoryview(head)], entry, spec.algorithm, corrupt)
        try:
            end = header_end(head)
        except ValueError as e:
            raise corrupt(f"undecodable content ({e})") from None
        if end > len(head):  # a header longer than a block: the blocks up to its end
            more = bytearray(min(-(-end // block) * block, entry.size) - len(head))
            for i in range(0, len(more), block):
                _read_block(reader, (len(head) + i) // block, block, [memoryview(more)[i:i + block]], entry,
                            spec.algorithm, corrupt)
            head += more
        try:
            header = parse_header(head, entry.size)
            dests, wanted = _destinations(header, live, only)
        except ValueError as e:
            raise corrupt(f"undecodable content ({e})") from None
        read = _fill(reader, header, dests, wanted, head, entry, spec.algorithm, block, corrupt)
        try:
            return Placed(unflatten(header.skeleton, dests), len(head) + read)
        except ValueError as e:
            raise corrupt(f"undecodable content ({e})") from None
    except (CheckpointCorruptError, StorageError):
        raise
    except Exception as e:  # an unreadable store or an exhausted resource says nothing of the content
        raise _unreadable(storage, manifest, entry, e) from e
    finally:
        reader.close()


def _unreadable(storage: Storage, manifest: Manifest, entry: FileEntry, e: BaseException) -> StorageError:
    return StorageError(f"could not read {manifest.name}/{entry.path} from {storage.url}: {type(e).__name__}: {e}")


def _destinations(header: Header, live: Mapping[Path, torch.Tensor],
                  only: Collection[Path] | None) -> tuple[list[torch.Tensor], list[bool]]:
    """Each saved tensor's destination (the live tensor at its key path where it matches, else new memory;
    an empty placeholder where it is not wanted), and whether it is wanted."""
    paths = dict(walk_indices(header.skeleton, len(header.entries)))
    wanted_paths = None if only is None else set(only)
    out, wanted = [], []
    for i, e in enumerate(header.entries):
        dtype = DTYPES[e.dtype]
        path = paths.get(i, ())
        target = live.get(path)
        if wanted_paths is not None and path not in wanted_paths:
            out.append(torch.empty(0, dtype=dtype))
            wanted.append(False)
        elif (isinstance(target, torch.Tensor) and target.dtype == dtype and tuple(target.shape) == e.shape
                and target.device.type == "cpu" and target.is_contiguous() and not target.is_sparse):
            out.append(target.detach())
            wanted.append(True)
        else:
            out.append(torch.empty(e.shape, dtype=dtype))
            wanted.append(True)
    return out, wanted


class _Slot(int):
    """A tensor's index standing in for it in a skeleton (an int of its own type: the tree's ints are not)."""


def walk_indices(skeleton: Any, count: int) -> list[tuple[int, Path]]:
    """(tensor index, key path) of every tensor of a shard's skeleton."""
    try:
        tree = unflatten(skeleton, cast(Any, [_Slot(i) for i in range(count)]))
    except ValueError:
        return []  # reported when the real tree is built
    return [(int(leaf), path) for path, leaf in walk(tree) if type(leaf) is _Slot]


def _fill(reader: RangeReader, header: Header, dests: list[torch.Tensor], wanted: list[bool], head: bytearray,
          entry: FileEntry, algorithm: str, block: int, corrupt: Any) -> int:
    """Read the wanted tensors into ``dests``, block by block, verifying each block; the blocks already in
    ``head`` (verified) are copied from there.  Returns the bytes read from the store."""
    pieces = sorted((header.data_start + e.offset, _bytes_of(t, e))  # (file offset, destination bytes)
                    for e, t, w in zip(header.entries, dests, wanted) if w and e.nbytes)
    first, count = -(-len(head) // block), -(-entry.size // block)
    if all(wanted):
        blocks: list[int] = list(range(first, count))
    else:
        needed = {b for start, view in pieces for b in range(start // block, (start + len(view) - 1) // block + 1)}
        blocks = sorted(b for b in needed if b >= first)
    pending: list[tuple[int, Future[bytes]]] = []
    pool = hash_pool("read")
    read = 0
    try:
        for index in blocks:
            lo, hi = index * block, min(entry.size, (index + 1) * block)
            pending.append((index, pool.submit(_read_and_hash, reader, lo, _views(pieces, lo, hi), algorithm)))
            read += hi - lo
        for start, view in pieces:  # what lies in the header's blocks: from the verified scratch
            if start < len(head):
                n = min(len(view), len(head) - start)
                view[:n] = memoryview(head)[start:start + n]
    finally:
        # Every read ends before this returns or raises: none may land in a live tensor after it (a fallback
        # restore writes there next), nor use the reader once it is closed.
        wait([future for _, future in pending])
    for index, future in pending:
        digest = future.result()
        if digest.hex() != entry.blocks[index]:
            raise corrupt(_mismatch(index, entry, block))
    return read


def _views(pieces: list[tuple[int, memoryview]], lo: int, hi: int) -> list[memoryview]:
    """The destination bytes of file range ``[lo, hi)`` in order, what no destination takes into scratch."""
    out = []
    pos = lo
    for start, view in pieces:
        end = start + len(view)
        if end <= lo or start >= hi:
            continue
        a, b = max(lo, start), min(hi, end)
        if a > pos:
            out.append(memoryview(bytearray(a - pos)))
        out.append(view[a - start:b - start])
        pos = b
    if pos < hi:
        out.append(memoryview(bytearray(hi - pos)))
    return out


def _read_and_hash(reader: RangeReader, offset: int, views: list[memoryview], algorithm: str) -> bytes:
    want = sum(len(v) for v in views)
    got = reader.readinto(offset, views)
    if got != want:
        raise OSError(f"{reader.size}-byte file ended after {offset + got} bytes while being read")
    return hash_views(algorithm, views)


def _read_block(reader: RangeReader, index: int, block: int, views: list[memoryview], entry: FileEntry,
                algorithm: str, corrupt: Any) -> None:
    if _read_and_hash(reader, index * block, views, algorithm).hex() != entry.blocks[index]:
        raise corrupt(_mismatch(index, entry, block))


def _mismatch(index: int, entry: FileEntry, block: int) -> str:
    start = index * block
    return (f"digest mismatch (content changed after commit) in block {index} of {len(entry.blocks)} "
            f"(bytes {start}..{min(entry.size, start + block)})")


def _bytes_of(t: torch.Tensor, e: TensorEntry) -> memoryview:
    """The bytes of contiguous CPU tensor ``t`` (``e.nbytes`` of them), writable, without a copy."""
    array = (ctypes.c_uint8 * e.nbytes).from_address(t.data_ptr())
    return memoryview(array).cast("B")
