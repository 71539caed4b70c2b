"""The checkpoint manifest: what a committed checkpoint contains.

A checkpoint exists only once its manifest is committed.  The manifest lists
every file with its size and digest, the step and world size it was taken
at, its parent, fingerprints of the model, the user's config and the
code, and the generation and launch of the job that wrote it.  A
checkpoint of sharded state (:mod:`.sharded`) also lists its index of
chunks, a second file without a rank.

Formats: 4 (written now) lists every file's block digests
(:mod:`.digest`, ``xxh3-128`` by default or ``sha256``), so that a reader
verifies each block as it lands, and may hold an index.  Older ones are
still read: 1 (written before fencing, read as generation 0 of no launch),
2, and 3 (2 plus an index); all three use SHA-256 with the block digests
unlisted.  A newer format is refused with "upgrade", never called corrupt.
:func:`parse_manifest` trusts nothing: schema, names, paths, sizes and
digests (a file's digest must be that of its listed blocks) are all checked
before anything is read.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any, TypeGuard

from ..core.errors import CheckpointCorruptError, CheckpointMismatchError
from .digest import ALGORITHM, HEX_LENGTH, BlockSpec

SCHEMA_BLOCKS = "resilient.checkpoint/4"
"""What saves write: block digests listed, an index where the state is sharded, the digest algorithm chosen."""
SCHEMA = "resilient.checkpoint/2"
SCHEMA_V1 = "resilient.checkpoint/1"
"""Manifests without ``generation``/``launch``; still read."""
SCHEMA_SHARDED = "resilient.checkpoint/3"
"""Schema 2 plus ``index``: the checkpoint holds sharded state."""
_NEWER = re.compile(r"resilient\.checkpoint/([5-9]|[1-9]\d+)")
_READ = (SCHEMA_BLOCKS, SCHEMA_SHARDED, SCHEMA, SCHEMA_V1)
MANIFEST_FILE = "manifest.json"
_NAME = re.compile(r"^step_(\d{10})$")
_HEX = re.compile(r"^[0-9a-f]+$")
_SEGMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def checkpoint_name(step: int) -> str:
    return f"step_{step:010d}"


def step_of(name: str) -> int | None:
    """The step encoded in a checkpoint name, or None if it is not one."""
    m = _NAME.match(name)
    return int(m.group(1)) if m else None


def is_safe_relpath(path: object) -> TypeGuard[str]:
    """True for a relative path of plain segments: no ``..``, no absolute path."""
    if not isinstance(path, str) or not path or path.startswith("/") or "\\" in path:
        return False
    return all(_SEGMENT.match(seg) and seg not in (".", "..") for seg in path.split("/"))


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint. ``rank`` is None for replicated state."""

    path: str
    size: int
    digest: str
    rank: int | None
    blocks: tuple[str, ...] = ()
    """Its blocks' digests (format 4); empty in older formats."""


@dataclass(frozen=True)
class Manifest:
    name: str
    step: int
    world_size: int
    files: tuple[FileEntry, ...]
    parent: str | None
    created_unix: float
    chunk_bytes: int
    fingerprint: dict[str, Any] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)
    generation: int = 0
    """Generation of the job that wrote it (0: no agent, or a schema-1 manifest)."""
    launch: str | None = None
    """Launch id of the job that wrote it (None: no agent, or a schema-1 manifest)."""
    index: str | None = None
    """Path of the sharded-state index (formats 3 and 4); None when the checkpoint holds no sharded state."""
    schema: str = SCHEMA
    digest_algorithm: str = ALGORITHM

    @property
    def spec(self) -> BlockSpec:
        """How its files were digested."""
        return BlockSpec(self.digest_algorithm, self.chunk_bytes)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def file_for(self, rank: int | None) -> FileEntry:
        """Rank ``rank``'s file, or the replicated file for None."""
        for f in self.files:
            if f.rank == rank and f.path != self.index:
                return f
        raise KeyError(rank)

    def index_file(self) -> FileEntry | None:
        """The sharded-state index, if the checkpoint has one."""
        return next((f for f in self.files if f.path == self.index), None) if self.index else None

    def to_bytes(self) -> bytes:
        body = asdict(self)
        body["files"] = [asdict(f) for f in self.files]
        if self.schema != SCHEMA_BLOCKS:  # re-encoding an old manifest must give its original bytes
            for f in body["files"]:
                del f["blocks"]
        if self.schema == SCHEMA_V1:
            del body["generation"], body["launch"]
        if self.schema not in (SCHEMA_SHARDED, SCHEMA_BLOCKS):
            del body["index"]
        body["manifest_digest"] = _content_digest(body)
        return _canonical(body)


def _content_digest(body: dict[str, Any]) -> str:
    """Digest of every field but the digest itself, so any edit is detected."""
    rest = {k: v for k, v in body.items() if k != "manifest_digest"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _canonical(body: dict[str, Any]) -> bytes:
    return (json.dumps(body, indent=1, sort_keys=True) + "\n").encode()


def parse_manifest(raw: bytes, name: str) -> Manifest:
    """Parse and validate a manifest; raise :class:`CheckpointCorruptError` if anything is off."""

    def bad(problem: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(name, MANIFEST_FILE, problem)

    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(f"not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise bad("not a JSON object")
    schema = body.get("schema")
    if schema not in _READ:
        if isinstance(schema, str) and _NEWER.fullmatch(schema):
            raise CheckpointMismatchError(
                f"checkpoint {name} uses schema {schema!r} but this build of resilient reads up to {SCHEMA_BLOCKS!r}: "
                "upgrade resilient to restore it (the checkpoint is left as it is)"
            )
        raise bad(f"unknown schema {schema!r} (expected {SCHEMA_BLOCKS!r})")
    if body.get("manifest_digest") != _content_digest(body):
        raise bad("manifest digest mismatch (the manifest was modified after commit)")
    if raw != _canonical(body):
        raise bad("manifest bytes differ from their canonical form (the file was modified after commit)")
    algorithm = body.get("digest_algorithm")
    if algorithm != ALGORITHM and not (schema == SCHEMA_BLOCKS and algorithm in HEX_LENGTH):
        raise bad(f"unknown digest algorithm {algorithm!r}")
    if body.get("name") != name or step_of(name) is None:
        raise bad(f"manifest names {body.get('name')!r} but lives at {name!r}")
    step, world = body.get("step"), body.get("world_size")
    if not _is_int(step) or step != step_of(name):
        raise bad(f"step {step!r} does not match the checkpoint name")
    if not _is_int(world) or world < 1:
        raise bad(f"world size {world!r} is not a positive integer")
    chunk = body.get("chunk_bytes")
    if not _is_int(chunk) or chunk <= 0:
        raise bad(f"chunk_bytes {chunk!r} is not a positive integer")
    files_raw = body.get("files")
    if not isinstance(files_raw, list):
        raise bad("file list missing")
    spec = BlockSpec(algorithm, chunk)
    files = []
    for f in files_raw:
        if not isinstance(f, dict):
            raise bad("file entry is not an object")
        path, size, digest, rank = f.get("path"), f.get("size"), f.get("digest"), f.get("rank")
        if not is_safe_relpath(path) or path == MANIFEST_FILE:
            raise bad(f"file path {path!r} is not a plain relative path inside the checkpoint")
        if not _is_int(size) or size < 0:
            raise bad(f"file {path}: size {size!r} is not a non-negative integer")
        if not isinstance(digest, str) or not _is_hex(digest, algorithm):
            raise bad(f"file {path}: digest {digest!r} is malformed")
        if rank is not None and (not _is_int(rank) or not 0 <= rank < world):
            raise bad(f"file {path}: rank {rank!r} outside world size {world}")
        blocks = _blocks(f.get("blocks"), spec, size, digest) if schema == SCHEMA_BLOCKS else ()
        if isinstance(blocks, str):
            raise bad(f"file {path}: {blocks}")
        files.append(FileEntry(path=path, size=size, digest=digest, rank=rank, blocks=blocks))
    index = body.get("index") if schema in (SCHEMA_SHARDED, SCHEMA_BLOCKS) else None
    if (schema == SCHEMA_SHARDED or index is not None) and not any(f.path == index and f.rank is None for f in files):
        raise bad(f"index {index!r} is not one of the checkpoint's files without a rank")
    ranks = sorted(f.rank for f in files if f.rank is not None)
    if ranks != list(range(world)) or sum(f.rank is None and f.path != index for f in files) != 1:
        raise bad(f"expected one replicated file and one file per rank 0..{world - 1}, found ranks {ranks}")
    if len({f.path for f in files}) != len(files):
        raise bad("duplicate file paths")
    parent = body.get("parent")
    if parent is not None and step_of(parent) is None:
        raise bad(f"parent {parent!r} is not a checkpoint name")
    created = body.get("created_unix")
    if not isinstance(created, (int, float)):
        raise bad("created_unix missing")
    fingerprint, counters = body.get("fingerprint", {}), body.get("counters", {})
    if not isinstance(fingerprint, dict) or not isinstance(counters, dict):
        raise bad("fingerprint/counters must be objects")
    generation: Any = 0
    launch: Any = None
    if schema != SCHEMA_V1:
        generation, launch = body.get("generation"), body.get("launch")
        if not _is_int(generation) or generation < 0:
            raise bad(f"generation {generation!r} is not a non-negative integer")
        if launch is not None and not isinstance(launch, str):
            raise bad(f"launch {launch!r} is not a string or null")
    return Manifest(
        name=name,
        step=step,
        world_size=world,
        files=tuple(files),
        parent=parent,
        created_unix=float(created),
        chunk_bytes=chunk,
        fingerprint=fingerprint,
        counters=counters,
        generation=generation,
        launch=launch,
        index=index,
        schema=schema,
        digest_algorithm=algorithm,
    )


def _is_hex(value: object, algorithm: str) -> bool:
    return isinstance(value, str) and len(value) == HEX_LENGTH[algorithm] and bool(_HEX.match(value))


def _blocks(raw: object, spec: BlockSpec, size: int, digest: str) -> tuple[str, ...] | str:
    """A format-4 file's block digests, or what is wrong with them."""
    if not isinstance(raw, list) or not all(_is_hex(b, spec.algorithm) for b in raw):
        return "block digests missing or malformed"
    if len(raw) != spec.count(size):
        return f"lists {len(raw)} block digests, its {size} bytes make {spec.count(size)} blocks"
    if spec.combine(raw) != digest:
        return "its digest is not that of its blocks"
    return tuple(raw)


def _is_int(x: object) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool)
