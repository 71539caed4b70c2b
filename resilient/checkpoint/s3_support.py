"""Plumbing for the S3 backend: the boto3 import, URL parsing, and byte views as upload bodies.

Kept apart from :mod:`resilient.checkpoint.s3` so that file reads as the
storage protocol alone.
"""

from __future__ import annotations

import os
from bisect import bisect_right
from collections.abc import Iterator, Sequence
from typing import Any

from ..core.errors import StorageError

MIN_BOTOCORE = (1, 36)


def import_boto() -> tuple[Any, Any]:
    try:
        import boto3
        import botocore
        from botocore.config import Config
    except ImportError as e:
        raise StorageError(
            f"s3:// checkpoint locations need boto3, which is not installed ({e}): pip install 'resilient-train[s3]'"
        ) from e
    # Conditional PUT (the commit) and the checksum settings below arrived in botocore 1.36;
    # an older one would fail only at commit time, after every file was uploaded.
    if tuple(int(x) for x in botocore.__version__.split(".")[:2]) < MIN_BOTOCORE:
        raise StorageError(
            f"botocore {botocore.__version__} is too old for s3:// checkpoints (need >= 1.36): "
            "pip install -U 'resilient-train[s3]' boto3"
        )
    return boto3, Config


def parse_url(url: str) -> tuple[str, str]:
    if not url.startswith("s3://"):
        raise StorageError(f"{url!r} is not an S3 location: use s3://bucket/prefix")
    bucket, _, prefix = url[len("s3://") :].partition("/")
    if not bucket:
        raise StorageError(f"{url!r} names no bucket: use s3://bucket/prefix")
    return bucket, "/".join(seg for seg in prefix.split("/") if seg)


class ViewsReader:
    """A seekable read-only file over byte views, so boto3 can send them without a joined copy."""

    def __init__(self, views: Sequence[memoryview]) -> None:
        self._views = list(views)
        self._starts = []
        total = 0
        for v in self._views:
            self._starts.append(total)
            total += len(v)
        self._len, self._pos = total, 0

    def __len__(self) -> int:
        return self._len

    def read(self, size: int | None = -1) -> bytes:
        end = self._len if size is None or size < 0 else min(self._len, self._pos + size)
        out = []
        while self._pos < end:
            i = bisect_right(self._starts, self._pos) - 1
            off = self._pos - self._starts[i]
            take = min(end - self._pos, len(self._views[i]) - off)
            out.append(self._views[i][off : off + take])
            self._pos += take
        return b"".join(out)

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._len}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True


def group_views(views: Sequence[memoryview], target: int) -> Iterator[list[memoryview]]:
    """Consecutive views gathered into parts of at least ``target`` bytes (the last may be short)."""
    part: list[memoryview] = []
    filled = 0
    for v in views:
        part.append(v)
        filled += len(v)
        if filled >= target:
            yield part
            part, filled = [], 0
    if part:
        yield part
