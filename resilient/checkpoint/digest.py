"""Chunked SHA-256 digests that hash in parallel with I/O.

A file's digest is the SHA-256 of the concatenated SHA-256 digests of its
fixed-size chunks (the last one may be short).  Chunks are hashed on a small
thread pool (``hashlib`` releases the GIL on large buffers), so hashing
overlaps the write or read it belongs to instead of adding to it, and a
multi-core host hashes several chunks at once.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import Executor, Future, ThreadPoolExecutor

ALGORITHM = "sha256-chunked"
DEFAULT_CHUNK_BYTES = 16 << 20

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


def _sha256(views: list[memoryview]) -> bytes:
    h = hashlib.sha256()
    for view in views:
        h.update(view)
    return h.digest()


class ChunkedHasher:
    """Incremental chunked digest; feed with :meth:`update`, finish with :meth:`hexdigest`.

    Buffers passed to :meth:`update` must stay unchanged until
    :meth:`hexdigest` returns: chunks are hashed in place on the pool, and a
    chunk that straddles two buffers is hashed from views of both, never
    from a copy (copying straddling chunks cost more than the disk write).
    """

    def __init__(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES, executor: Executor | None = None) -> None:
        if chunk_bytes <= 0:
            raise ValueError("chunk_bytes must be positive")
        self.chunk_bytes = chunk_bytes
        self._executor = executor if executor is not None else hash_pool()
        self._futures: list[Future[bytes]] = []
        self._pending: list[memoryview] = []
        self._pending_bytes = 0
        self.size = 0

    def update(self, data: memoryview | bytes | bytearray) -> None:
        view = memoryview(data).cast("B")
        self.size += len(view)
        while len(view):
            take = min(len(view), self.chunk_bytes - self._pending_bytes)
            self._pending.append(view[:take])
            self._pending_bytes += take
            view = view[take:]
            if self._pending_bytes == self.chunk_bytes:
                self._futures.append(self._executor.submit(_sha256, self._pending))
                self._pending, self._pending_bytes = [], 0

    def hexdigest(self) -> str:
        if self._pending or not self._futures:
            self._futures.append(self._executor.submit(_sha256, self._pending))
            self._pending, self._pending_bytes = [], 0
        outer = hashlib.sha256()
        for future in self._futures:
            outer.update(future.result())
        return outer.hexdigest()


def digest_bytes(data: bytes | bytearray | memoryview, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> str:
    """Digest of an in-memory buffer (used by tests and small files)."""
    hasher = ChunkedHasher(chunk_bytes)
    hasher.update(data)
    return hasher.hexdigest()
