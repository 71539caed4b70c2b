"""Offline examination of a checkpoint store: list, verify, inspect, collect.

These are the library half of ``resilient checkpoint ...``: they return
frozen dataclasses and never print.  Corruption is a *finding* reported in
the result (a bad manifest, a missing or altered file), never an exception;
:class:`StorageError` propagates, because an unreadable store says nothing
about whether the checkpoint is good.  Verification reads every file
through the same function as a restore (:func:`resilient.checkpoint.verify.check_file`):
manifest schema and paths, then each file's size, digest and decodability.

Listing reads manifests only and does not import torch (``resilient
checkpoint ls`` stays fast); verifying and inspecting decode, and import
:mod:`resilient.checkpoint.verify` (and with it torch) when called.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..core.errors import CheckpointCorruptError, CheckpointMismatchError, StorageError
from .manifest import MANIFEST_FILE, FileEntry, Manifest, parse_manifest, step_of
from .retention import decide_retention
from .storage import GC_MIN_AGE_S, Garbage, Storage

if TYPE_CHECKING:
    from .verify import FileCheck


@dataclass(frozen=True)
class CheckpointInfo:
    """One committed checkpoint as its manifest describes it (no file is read)."""

    name: str
    step: int
    world_size: int | None
    total_bytes: int | None
    n_files: int | None
    created_unix: float | None
    parent: str | None
    manifest_ok: bool
    problem: str | None


@dataclass(frozen=True)
class VerifyReport:
    """Outcome of :func:`verify_checkpoint`; ``problem`` summarises the first failures."""

    name: str
    ok: bool
    files: tuple[FileCheck, ...]
    problem: str | None


@dataclass(frozen=True)
class FileSummary:
    """What one shard holds, from its tensor table and decoded skeleton."""

    path: str
    rank: int | None
    size: int
    digest_ok: bool | None
    n_tensors: int | None
    tensor_bytes: int | None
    keys: tuple[str, ...]
    """Top-level keys of the saved tree (model, optimizer, rng, data, counters, ...)."""
    sections: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Per top-level key: (number of tensors, tensor bytes)."""
    counters: dict[str, Any] | None = None
    """The rank's ``counters`` (step, samples, tokens), if the file has them."""
    data: dict[str, Any] | None = None
    """The rank's data-loader cursor, if the file has one."""
    problem: str | None = None


@dataclass(frozen=True)
class ShardedTensor:
    """One tensor of sharded state as the index describes it."""

    key: str
    """Its place in the state, e.g. ``model/layers.0.weight`` or ``optimizer/state/layers.0.weight/exp_avg``."""
    dtype: str
    shape: tuple[int, ...]
    """The global shape."""
    placements: tuple[str, ...]
    mesh: tuple[int, ...]
    chunks: tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...]
    """(rank whose file holds it, offsets, sizes) of each saved chunk."""


@dataclass(frozen=True)
class CheckpointDetail:
    """Manifest of a checkpoint plus a summary of each of its files."""

    manifest: Manifest
    files: tuple[FileSummary, ...]
    sharded: tuple[ShardedTensor, ...] = ()
    """The tensors of sharded state (FSDP2/DTensor), from the index; empty without sharded state."""


@dataclass(frozen=True)
class GcReport:
    """What :func:`collect` removed (or would remove, in a dry run) and why."""

    dry_run: bool
    garbage: tuple[str, ...]
    """Leftovers of crashed saves and deletions removed (never listed in a dry run)."""
    kept: tuple[str, ...]
    deleted: tuple[str, ...]
    """Checkpoints deleted, or that would be deleted in a dry run."""
    newest_verified: str | None
    failed: tuple[tuple[str, str], ...]
    """(name, problem) of newer checkpoints that failed verification on the way."""
    reason: str
    skipped: tuple[tuple[str, str], ...] = ()
    """(entry, why) of what was left alone: saves that may be under way, checkpoints a job deleted meanwhile."""


def list_checkpoints(storage: Storage) -> list[CheckpointInfo]:
    """Every committed checkpoint, oldest first, from its manifest alone."""
    out = []
    for name in storage.list_committed():
        step = step_of(name)
        assert step is not None, f"storage listed {name!r}, which is not a checkpoint name"
        try:
            manifest = read_manifest(storage, name)
        except CheckpointCorruptError as e:
            out.append(CheckpointInfo(name, step, None, None, None, None, None, False, e.problem))
            continue
        except CheckpointMismatchError as e:  # written by a newer resilient: not corrupt, just unreadable here
            out.append(CheckpointInfo(name, step, None, None, None, None, None, False, str(e)))
            continue
        out.append(
            CheckpointInfo(
                name=name,
                step=step,
                world_size=manifest.world_size,
                total_bytes=manifest.total_bytes,
                n_files=len(manifest.files),
                created_unix=manifest.created_unix,
                parent=manifest.parent,
                manifest_ok=True,
                problem=None,
            )
        )
    return out


def read_manifest(storage: Storage, name: str) -> Manifest:
    """The validated manifest of ``name``.

    Raises :class:`CheckpointCorruptError` if it is missing or invalid,
    :class:`CheckpointMismatchError` if a newer resilient wrote it.
    """
    try:
        raw = storage.read_manifest(name)
    except FileNotFoundError:
        raw = b""
    if not raw:
        raise CheckpointCorruptError(name, MANIFEST_FILE, "manifest is missing")
    return parse_manifest(raw, name)


def verify_checkpoint(storage: Storage, name: str) -> VerifyReport:
    """Check the manifest, then every file's size, digest and decodability.

    Raises :class:`StorageError` when the store cannot be read.
    """
    try:
        manifest = read_manifest(storage, name)
    except CheckpointCorruptError as e:
        return VerifyReport(name=name, ok=False, files=(), problem=f"{MANIFEST_FILE}: {e.problem}")
    except CheckpointMismatchError as e:
        return VerifyReport(name=name, ok=False, files=(), problem=f"{MANIFEST_FILE}: {e}")
    from .verify import check_file

    # Decode even after a digest mismatch: whether the damage is in the
    # header (undecodable) or only in tensor bytes tells the user more.
    checks = [check_file(storage, manifest, entry, decode_unverified=True).check for entry in manifest.files]
    bad = [f"{c.path}: {c.problem}" for c in checks if c.problem]
    return VerifyReport(name=name, ok=not bad, files=tuple(checks), problem="; ".join(bad) or None)


def inspect_checkpoint(storage: Storage, name: str) -> CheckpointDetail:
    """Manifest plus per-file tensor summary; reads (and digests) every file.

    Raises :class:`CheckpointCorruptError` when the manifest is missing or
    invalid (there is nothing to summarise), :class:`CheckpointMismatchError`
    when a newer resilient wrote it, :class:`StorageError` on I/O failure.
    Damaged or missing files are reported in ``FileSummary.problem``.
    """
    manifest = read_manifest(storage, name)
    files = tuple(_summarise(storage, manifest, e) for e in manifest.files)
    return CheckpointDetail(manifest=manifest, files=files, sharded=_sharded(storage, manifest))


def _sharded(storage: Storage, manifest: Manifest) -> tuple[ShardedTensor, ...]:
    """The index's tensors; empty when there is none or it is damaged (its FileSummary says why)."""
    entry = manifest.index_file()
    if entry is None:
        return ()
    import json

    from .shard import DTYPE_NAMES
    from .sharded import parse_index
    from .verify import check_file

    checked = check_file(storage, manifest, entry)
    try:
        index = parse_index(checked.tree, manifest.world_size) if checked.check.ok else {}
    except ValueError:
        return ()
    return tuple(
        ShardedTensor("/".join(map(str, json.loads(t.key))), DTYPE_NAMES[t.dtype], t.shape, t.placements, t.mesh,
                      tuple((c.rank, c.offsets, c.sizes) for c in t.chunks))
        for t in index.values())


def _summarise(storage: Storage, manifest: Manifest, entry: FileEntry) -> FileSummary:
    from .verify import check_file, plain, tensor_totals

    checked = check_file(storage, manifest, entry, decode_unverified=True)
    check, tree = checked.check, checked.tree
    size = check.size_actual if check.size_actual is not None else entry.size
    if not check.decode_ok:
        return FileSummary(entry.path, entry.rank, size, check.digest_ok, None, None, (), problem=check.problem)
    keys: tuple[str, ...] = ()
    sections: dict[str, tuple[int, int]] = {}
    counters = data = None
    if isinstance(tree, dict):
        keys = tuple(str(k) for k in tree)
        sections = {str(k): tensor_totals(v) for k, v in tree.items()}
        counters = plain(tree["counters"]) if isinstance(tree.get("counters"), dict) else None
        data = plain(tree["data"]) if isinstance(tree.get("data"), dict) else None
    return FileSummary(
        path=entry.path,
        rank=entry.rank,
        size=size,
        digest_ok=check.digest_ok and check.size_actual == entry.size,
        n_tensors=len(checked.tensors),
        tensor_bytes=sum(t.numel() * t.element_size() for t in checked.tensors),
        keys=keys,
        sections=sections,
        counters=counters,
        data=data,
        problem=check.problem,
    )


def collect(
    storage: Storage,
    *,
    keep: int,
    permanent_every: int | None,
    dry_run: bool,
    min_age_s: float = GC_MIN_AGE_S,
    verify: Callable[[Storage, str], VerifyReport] = verify_checkpoint,
) -> GcReport:
    """Remove crash leftovers and apply retention, protecting the newest verified checkpoint.

    Checkpoints are verified newest first until one passes; that one is
    always kept.  When none passes, nothing is deleted: deleting then would
    only destroy evidence (or the only copies, if verification itself is
    at fault).  Raises :class:`CheckpointMismatchError`, before touching
    anything, if a newer resilient wrote any of the checkpoints (this build
    cannot judge them), :class:`StorageError` on I/O failure.

    Safe beside a live job: a save written to within ``min_age_s`` is left
    alone (it may be under way), the directory backend takes the location's
    lock for each step, and a checkpoint the job's own retention deleted
    meanwhile is reported as skipped.
    """
    committed = storage.list_committed()
    for name in committed:  # manifests only: cheap next to verifying files
        try:
            read_manifest(storage, name)
        except CheckpointCorruptError:
            pass  # verification below reports it
        except CheckpointMismatchError as e:
            raise CheckpointMismatchError(f"{e}; not collecting garbage in {storage.url} with this version") from e
    failed: list[tuple[str, str]] = []
    gone: list[tuple[str, str]] = []
    newest_verified = None
    for name in reversed(committed):
        report = verify(storage, name)
        if report.ok:
            newest_verified = name
            break
        if name not in storage.list_committed():  # a live job's retention deleted it while it was being read
            gone.append((name, "deleted while it was being verified (the job's own retention)"))
            continue
        failed.append((name, report.problem or "failed verification"))
    committed = [n for n in committed if n not in {g for g, _ in gone}]
    if committed and newest_verified is None:
        return GcReport(
            dry_run=dry_run,
            garbage=(),
            kept=tuple(committed),
            deleted=(),
            newest_verified=None,
            failed=tuple(failed),
            reason=f"none of the {len(committed)} checkpoints passed verification; deleting nothing",
            skipped=tuple(gone),
        )
    decision = decide_retention(committed, keep=keep, permanent_every=permanent_every, newest_verified=newest_verified,
                                pinned=storage.list_pins())
    assert newest_verified is None or newest_verified in decision.keep
    garbage = Garbage()
    deleted: list[str] = []
    if not dry_run:
        garbage = storage.collect_garbage(min_age_s=min_age_s)
        for victim in decision.delete:
            try:
                if storage.delete(victim, keep_pinned=True):
                    deleted.append(victim)
                else:
                    gone.append((victim, "pinned while gc ran (an incident's bundle): kept"))
            except StorageError:
                if victim in storage.list_committed():
                    raise
                gone.append((victim, "already deleted (the job's own retention, or another collection)"))
    return GcReport(
        dry_run=dry_run,
        garbage=garbage.removed,
        kept=decision.keep,
        deleted=decision.delete if dry_run else tuple(deleted),
        newest_verified=newest_verified,
        failed=tuple(failed),
        reason=decision.reason,
        skipped=garbage.skipped + tuple(gone),
    )
