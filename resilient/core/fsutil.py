"""Small file helpers shared by every part: atomic, durable JSON files."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_json_atomic(path: str | os.PathLike[str], data: Any, *, indent: int | None = 1) -> None:
    """Replace ``path`` with ``data`` as JSON: readers see the old file or the new one, never half a file.

    The temporary file is fsynced before the rename and the directory after
    it, so a crash (or power loss) leaves one of the two complete versions.
    """
    write_text_atomic(path, json.dumps(data, indent=indent, default=str) + "\n")


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Replace ``path`` with ``text`` atomically and durably (see :func:`write_json_atomic`)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(path.parent)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory so that a rename or a new entry in it survives a crash."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_json(path: str | os.PathLike[str]) -> Any | None:
    """The JSON in ``path``, or None when it does not exist or is not (yet) valid."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return None
