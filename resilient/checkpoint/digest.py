"""Block digests that hash in parallel with I/O.

A file is cut into fixed-size blocks (the last one may be short); each
block has a digest, and the file's digest is the digest of its blocks'
digests, concatenated.  A manifest of format 4 lists every block's digest,
so a reader verifies each block as it lands, and a rank that needs only a
byte range of a file reads and verifies only the blocks around it.

Two algorithms:

* ``xxh3-128`` (the default): detects corruption (a flipped bit, a torn or
  swapped block, a truncated file) at memory speed, about 10 GB/s on one
  core; it is not a defence against someone who can rewrite both the
  checkpoint and its manifest.
* ``sha256``: tamper evidence where that matters (a manifest kept or
  signed elsewhere), at about 1.3 GB/s per core.  Manifests of formats 1 to
  3 all use it, with their block digests unlisted.

Blocks are hashed on a small thread pool (both libraries release the GIL on
large buffers), so hashing overlaps the write or read it belongs to instead
of adding to it.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

SHA256 = "sha256-chunked"
XXH3 = "xxh3-128-chunked"
ALGORITHM = SHA256
"""What manifests of formats 1 to 3 use."""
DEFAULT = XXH3
CHOICES = {"xxh3-128": XXH3, "sha256": SHA256}
"""``CheckpointConfig.digest`` -> the algorithm a manifest names."""
DEFAULT_CHUNK_BYTES = 4 << 20
"""Block size: a few MiB, so that a ranged read verifies little it did not need, and a manifest lists about 9 KB
of digests per GiB of state."""
HEX_LENGTH = {XXH3: 32, SHA256: 64}


class _Hash(Protocol):
    def update(self, data: Any, /) -> None: ...

    def digest(self) -> bytes: ...


def _xxh3() -> _Hash:
    import xxhash

    return xxhash.xxh3_128()


_NEW: dict[str, Callable[[], _Hash]] = {XXH3: _xxh3, SHA256: hashlib.sha256}


def algorithm_named(choice: str) -> str:
    """The manifest's name for a ``CheckpointConfig.digest`` choice (ValueError naming the choices)."""
    try:
        return CHOICES[choice]
    except KeyError:
        raise ValueError(f"unknown digest {choice!r}: choose one of {', '.join(CHOICES)}") from None


@dataclass(frozen=True)
class BlockSpec:
    """How a file is digested: the algorithm and the block size."""

    algorithm: str = DEFAULT
    block_bytes: int = DEFAULT_CHUNK_BYTES

    def __post_init__(self) -> None:
        if self.algorithm not in _NEW:
            raise ValueError(f"unknown digest algorithm {self.algorithm!r}")
        if self.block_bytes <= 0:
            raise ValueError("block_bytes must be positive")

    def count(self, size: int) -> int:
        """Blocks of a file of ``size`` bytes (an empty file has one, of nothing)."""
        return max(1, -(-size // self.block_bytes))

    def combine(self, blocks: Sequence[str]) -> str:
        """The file digest of its blocks' digests (hex)."""
        outer = _NEW[self.algorithm]()
        for block in blocks:
            outer.update(bytes.fromhex(block))
        return outer.digest().hex()


@dataclass(frozen=True)
class FileDigest:
    """A file's size, digest and its blocks' digests (hex)."""

    size: int
    digest: str
    blocks: tuple[str, ...]

    def first_bad_block(self, expected: Sequence[str]) -> int | None:
        """The first block whose digest differs from ``expected``'s (None: none does, or none is listed)."""
        for i, (got, want) in enumerate(zip(self.blocks, expected)):
            if got != want:
                return i
        if expected and len(self.blocks) != len(expected):
            return min(len(self.blocks), len(expected))
        return None


_pools: dict[str, ThreadPoolExecutor] = {}


def hash_pool(purpose: str = "read") -> Executor:
    """The process-wide hashing pool for ``purpose`` (created on first use, never at import).

    Writes leave one core to the thread that copies data into the page cache
    (with both cores hashing, the writer starved and durable throughput fell);
    reads hash on every core, since the hashing threads do the reading.
    """
    pool = _pools.get(purpose)
    if pool is None:
        cores = os.cpu_count() or 1
        workers = max(1, min(4, cores - 1)) if purpose == "write" else max(1, min(4, cores))
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"resilient-hash-{purpose}")
        _pools[purpose] = pool
    return pool


def hash_views(algorithm: str, views: Sequence[memoryview | bytes]) -> bytes:
    """The digest of the concatenation of ``views`` (one block)."""
    h = _NEW[algorithm]()
    for view in views:
        h.update(view)
    return h.digest()


class ChunkedHasher:
    """Incremental block digest; feed with :meth:`update`, finish with :meth:`result` (or :meth:`hexdigest`).

    Buffers passed to :meth:`update` must stay unchanged until the result is
    taken: blocks are hashed in place on the pool, and a block that
    straddles two buffers is hashed from views of both, never from a copy
    (copying straddling blocks cost more than the disk write).
    """

    def __init__(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES, executor: Executor | None = None,
                 algorithm: str = DEFAULT) -> None:
        self.spec = BlockSpec(algorithm, chunk_bytes)
        self._executor = executor if executor is not None else hash_pool()
        self._futures: list[Future[bytes]] = []
        self._pending: list[memoryview] = []
        self._pending_bytes = 0
        self._result: FileDigest | None = None
        self.size = 0

    def update(self, data: memoryview | bytes | bytearray) -> None:
        if self._result is not None:
            raise RuntimeError("update() after the digest was taken")
        view = memoryview(data).cast("B")
        self.size += len(view)
        block = self.spec.block_bytes
        while len(view):
            take = min(len(view), block - self._pending_bytes)
            self._pending.append(view[:take])
            self._pending_bytes += take
            view = view[take:]
            if self._pending_bytes == block:
                self._submit()

    def _submit(self) -> None:
        self._futures.append(self._executor.submit(hash_views, self.spec.algorithm, self._pending))
        self._pending, self._pending_bytes = [], 0

    def result(self) -> FileDigest:
        if self._result is None:
            if self._pending or not self._futures:
                self._submit()
            blocks = tuple(f.result().hex() for f in self._futures)
            self._result = FileDigest(self.size, self.spec.combine(blocks), blocks)
        return self._result

    def hexdigest(self) -> str:
        return self.result().digest


def digest_bytes(data: bytes | bytearray | memoryview, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 algorithm: str = DEFAULT) -> FileDigest:
    """Digest of an in-memory buffer (used by tests and small files)."""
    hasher = ChunkedHasher(chunk_bytes, algorithm=algorithm)
    hasher.update(data)
    return hasher.result()
