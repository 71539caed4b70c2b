"""The one verified read of a checkpoint file: size, digest, then a safe decode.

Restore (:mod:`resilient.checkpoint.restore`), ``resilient checkpoint
verify`` and ``resilient checkpoint inspect`` all read files through
:func:`check_file`, so they apply the same checks and describe the same
damage with the same words.  A content problem is a :class:`FileCheck`
with ``problem`` set (or a :class:`CheckpointCorruptError` from
:func:`read_verified`); only an unreadable store raises
(:class:`StorageError`).  Decoding runs only on bytes whose header passed
the limits of :mod:`resilient.checkpoint.shard`, and anything the decoder
raises, whatever it is, is reported as undecodable content.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..core.errors import CheckpointCorruptError, StorageError
from .digest import FileDigest
from .manifest import FileEntry, Manifest
from .shard import decode
from .storage import Storage
from .tree import unflatten

MISSING = "file is missing"


@dataclass(frozen=True)
class FileCheck:
    """Verification of one file; ``None`` in a check means it could not be made."""

    path: str
    rank: int | None
    size_expected: int
    size_actual: int | None
    digest_ok: bool | None
    decode_ok: bool | None
    problem: str | None

    @property
    def ok(self) -> bool:
        return self.problem is None


@dataclass(frozen=True)
class Checked:
    """A :class:`FileCheck` plus what was decoded (None when decoding failed or was skipped)."""

    check: FileCheck
    tree: Any = None
    tensors: tuple[torch.Tensor, ...] = ()
    buf: Any = None
    """The bytes read (the tensors alias them); None when the file could not be read."""


def check_file(storage: Storage, manifest: Manifest, entry: FileEntry, *, decode_unverified: bool = False) -> Checked:
    """Read ``entry`` of ``manifest`` and check size, digest and decoding.

    Bytes that fail the size or digest check are decoded only when
    ``decode_unverified`` (the offline tools do it, to tell a damaged header
    from damaged tensor bytes).  Raises :class:`StorageError` when the store
    cannot be read; any other failure of the read itself (e.g. MemoryError)
    becomes a StorageError too, since it says nothing about the content.
    """
    try:
        buf, got = storage.read_file(manifest.name, entry.path, manifest.spec)
    except FileNotFoundError:
        return Checked(FileCheck(entry.path, entry.rank, entry.size, None, None, None, MISSING))
    except StorageError:
        raise
    except Exception as e:  # every rank must reach the same verdict, whatever broke
        raise StorageError(
            f"could not read {manifest.name}/{entry.path} from {storage.url}: {type(e).__name__}: {e}"
        ) from e
    problems = []
    if len(buf) != entry.size:
        problems.append(f"size is {len(buf)} bytes, manifest says {entry.size} (truncated or overwritten)")
    digest_ok = got.digest == entry.digest
    if not digest_ok:
        problems.append(f"digest mismatch (content changed after commit){_where(got, entry, manifest)}: "
                        f"{got.digest[:16]}... != {entry.digest[:16]}...")
    decode_ok: bool | None = None
    tree: Any = None
    tensors: list[torch.Tensor] = []
    if not problems or decode_unverified:
        try:
            skeleton, tensors = decode(buf)
            tree = unflatten(skeleton, tensors)
            decode_ok = True
        except Exception as e:  # noqa: BLE001  ValueError for what decode checks; anything else is damage too
            decode_ok, tree, tensors = False, None, []
            detail = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
            problems.append(f"undecodable content ({detail})")
    check = FileCheck(entry.path, entry.rank, entry.size, len(buf), digest_ok, decode_ok, "; ".join(problems) or None)
    return Checked(check, tree if check.ok or decode_unverified else None, tuple(tensors), buf)


def _where(got: FileDigest, entry: FileEntry, manifest: Manifest) -> str:
    """Which block differs first, where the manifest lists them (format 4)."""
    bad = got.first_bad_block(entry.blocks)
    if bad is None:
        return ""
    start = bad * manifest.chunk_bytes
    return f" in block {bad} of {len(entry.blocks)} (bytes {start}..{min(entry.size, start + manifest.chunk_bytes)})"


def read_verified(storage: Storage, manifest: Manifest, entry: FileEntry) -> Any:
    """The decoded tree of ``entry``; :class:`CheckpointCorruptError` naming the problem, StorageError on I/O."""
    checked = check_file(storage, manifest, entry)
    if checked.check.problem is not None:
        raise CheckpointCorruptError(manifest.name, entry.path, checked.check.problem)
    return checked.tree


def tensor_totals(node: Any) -> tuple[int, int]:
    """(number of tensors, tensor bytes) in a decoded tree."""
    if isinstance(node, torch.Tensor):
        return 1, node.numel() * node.element_size()
    children = node.values() if isinstance(node, dict) else node if isinstance(node, (list, tuple)) else ()
    count = size = 0
    for child in children:
        c, s = tensor_totals(child)
        count, size = count + c, size + s
    return count, size


def plain(node: Any) -> Any:
    """A JSON-able copy of a small tree; tensors become short descriptions."""
    if isinstance(node, torch.Tensor):
        return node.item() if node.numel() == 1 else f"tensor{tuple(node.shape)} {node.dtype}"
    if isinstance(node, dict):
        return {str(k): plain(v) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return [plain(v) for v in node]
    return node
