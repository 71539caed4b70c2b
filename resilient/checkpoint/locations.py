"""Where checkpoints live: a location (a directory path or ``s3://bucket/prefix``) opened as its backend.

Above both backends, so that neither imports the other.
"""

from __future__ import annotations

import os

from ..core.errors import StorageError
from .storage import LocalStorage, Storage


def open_storage(url: str | os.PathLike[str], *, endpoint_url: str | None = None) -> Storage:
    """A backend for ``url``: ``s3://bucket/prefix`` or a local directory path."""
    text = os.fspath(url)
    if text.startswith("s3://"):
        from .s3 import S3Storage  # boto3 and the S3 client load only for an S3 location

        return S3Storage(text, endpoint_url=endpoint_url)
    if "://" in text:
        raise StorageError(f"unsupported checkpoint location {text!r}: use a directory path or s3://bucket/prefix")
    return LocalStorage(text)
