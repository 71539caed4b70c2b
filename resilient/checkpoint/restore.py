"""Verified restore across all ranks: newest good checkpoint first, one verdict for all.

Rank 0 lists the committed checkpoints and reads each manifest; both go out
through :meth:`Coordinator.on_root`, so a failure there is the same error on
every rank.  Every rank judges the same manifest bytes.  A checkpoint of
format 4 on a store that reads byte ranges is read in place (:mod:`.placed`):
each rank reads its own file straight into the live tensors, verifying each
block as it lands, and a sharded rank reads only the blocks of a peer's file
that hold its chunks.  From a directory (which every rank of a job shares)
every rank also reads the replicated state itself, in parallel; elsewhere
(S3, or formats 1 to 3) it is read from storage once: rank 0 reads and
verifies it and sends the verified bytes to the others
(:meth:`Coordinator.share`).  Files not read in place go through the one
verified read (:func:`.verify.read_verified`).  Each rank
reports ``ok``, ``corrupt`` or ``error`` whatever went wrong (nothing a
damaged or hostile file does escapes as an exception on one rank only).
Rank 0 combines the reports into one verdict for all: any ``error`` stops
the restore without quarantining (a flaky store must not eat checkpoints),
any ``corrupt`` quarantines the checkpoint and tries the previous one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from ..core.errors import (
    CheckpointCorruptError,
    CheckpointMismatchError,
    NoValidCheckpointError,
    StorageError,
)
from ..core.events import EventKind, EventLog
from . import sharded
from .coordinator import Coordinator
from .fence import Fence
from .manifest import MANIFEST_FILE, FileEntry, Manifest, parse_manifest
from .placed import can_place, live_paths, read_placed
from .shard import decode
from .storage import Storage
from .tree import unflatten
from .verify import Checked, check_file, read_verified

REPLICATED = "replicated"
RANK = "rank"


@dataclass(frozen=True)
class Restored:
    manifest: Manifest
    replicated: Any
    rank_state: Any
    sharded: dict[str, Any] | None = None
    """This rank's DTensors of sharded state by index key (:mod:`.sharded`); None without sharded state."""
    ranks_read: tuple[int, ...] = ()
    """Saved ranks whose files this rank read (its own, and those holding chunks it needs)."""
    read_bytes: int | None = None
    """Bytes this rank read from the store for this restore, the shared files included; None: the whole files
    of ``ranks_read``, and the shared ones on rank 0 (a read that is not in place)."""


Targets = Callable[[], dict[str, Any]]
"""The live DTensors a sharded checkpoint fills, by index key (:func:`.sharded.targets_of`)."""
Live = Callable[[], dict[str, Any]]
"""The live state trees by payload key (REPLICATED, RANK): where an unsharded restore reads in place."""


def restore_newest(storage: Storage, coord: Coordinator, events: EventLog, *, elastic: bool,
                   targets: Targets | None = None, live: Live | None = None,
                   fence: Fence | None = None) -> Restored | None:
    """Load the newest committed checkpoint that verifies on every rank (see the module docstring).

    A checkpoint of sharded state is resharded onto ``targets`` (called
    once it is needed): each rank reads the saved rank files that hold its
    chunks, whatever the world size or mesh they were saved with.  Unsharded
    state is read in place into ``live``'s tensors where it can be.
    Returns None when nothing was ever committed.  Raises
    :class:`NoValidCheckpointError` when checkpoints exist but none
    verifies, :class:`StorageError` when the store cannot be read, the same
    on every rank.
    """
    names = json.loads(coord.on_root(lambda: json.dumps(storage.list_committed()).encode()))
    problems: list[str] = []
    for name in reversed(names):
        raw = coord.on_root(partial(storage.read_manifest, name))
        try:
            if not raw:
                raise CheckpointCorruptError(name, MANIFEST_FILE, "manifest is missing")
            manifest = parse_manifest(raw, name)
        except CheckpointCorruptError as e:
            _quarantine(storage, coord, events, name, f"{e.file}: {e.problem}", fence)
            problems.append(str(e))
            continue
        _check_world(storage, coord, events, manifest, elastic)
        status, detail, restored = _load_local(storage, coord, manifest, targets, live)
        kind, why = agree(coord, status, detail)
        if kind == "ok":
            assert restored is not None
            if problems:
                events.emit(EventKind.CHECKPOINT_FALLBACK, restored=name, skipped=problems)
            read_bytes = restored.read_bytes
            if read_bytes is None:
                read_bytes = _shared_bytes(manifest, coord) + sum(manifest.file_for(r).size for r in restored.ranks_read)
            events.emit(EventKind.CHECKPOINT_RESTORED, name=name, step=manifest.step, location=storage.url,
                        read_bytes=read_bytes)
            return restored
        if kind == "error":
            raise StorageError(f"cannot read checkpoint {name} from {storage.url}: {why}")
        if kind == "mismatch":
            raise CheckpointMismatchError(why)
        _quarantine(storage, coord, events, name, why, fence)
        problems.append(f"{name}: {why}")
    if names:
        raise NoValidCheckpointError(
            f"none of the {len(names)} committed checkpoints in {storage.url} passed verification "
            f"({'; '.join(problems)}); they were quarantined. Refusing to start from scratch silently: "
            "inspect them with `resilient checkpoint ls`, or point CheckpointConfig.dir at a fresh location "
            "to start a new run."
        )
    return None


def _shared_bytes(manifest: Manifest, coord: Coordinator) -> int:
    """Bytes of the files rank 0 reads and shares (the replicated state, the index): on rank 0, else 0."""
    index = manifest.index_file()
    return manifest.file_for(None).size + (index.size if index else 0) if coord.is_root else 0


def _check_world(storage: Storage, coord: Coordinator, events: EventLog, manifest: Manifest, elastic: bool) -> None:
    if manifest.world_size == coord.world_size:
        return
    if elastic:
        events.emit(EventKind.CHECKPOINT_RESHARDED, name=manifest.name, saved_world_size=manifest.world_size,
                    world_size=coord.world_size, rank_state_from=coord.rank % manifest.world_size)
        return
    raise CheckpointMismatchError(
        f"checkpoint {manifest.name} in {storage.url} was written by {manifest.world_size} ranks but this "
        f"job has {coord.world_size}; restart with {manifest.world_size} ranks, or point "
        "CheckpointConfig.dir at a fresh location to start a new run (or set CheckpointConfig(elastic=True) "
        "to continue on a different number of ranks)"
    )


def agree(coord: Coordinator, status: str, detail: str) -> tuple[str, str]:
    """Every rank's ("ok"|"corrupt"|"error"|"mismatch", detail) -> one verdict, the same on every rank."""
    statuses = coord.gather(json.dumps([status, detail]).encode())
    verdict = None
    if statuses is not None:
        parsed = [json.loads(s) for s in statuses]
        errors = [f"rank {r}: {d}" for r, (s, d) in enumerate(parsed) if s == "error"]
        corrupt = [d for s, d in parsed if s == "corrupt"]
        mismatch = [d for s, d in parsed if s == "mismatch"]
        kind = "error" if errors else "corrupt" if corrupt else "mismatch" if mismatch else "ok"
        verdict = json.dumps([kind, "; ".join(errors or corrupt or mismatch[:1])]).encode()
    kind, why = json.loads(coord.broadcast(verdict))
    return str(kind), str(why)


def _load_local(storage: Storage, coord: Coordinator, manifest: Manifest, targets: Targets | None,
                live: Live | None) -> tuple[str, str, Restored | None]:
    """This rank's state: ("ok"|"corrupt"|"error"|"mismatch", detail, restored).

    Never raises: a rank that raised here would leave its peers waiting in
    the next collective until the group's timeout, so every rank takes part
    in the same collectives whatever it found (both shares of a sharded
    checkpoint), and a sharded checkpoint that does not fit the model is a
    "mismatch" that the agreed verdict raises on every rank.  A rank whose
    shared file did not arrive (rank 0 reports why) says "ok" for itself
    and returns no state: the agreed verdict is not "ok" then.
    """
    own = coord.rank % manifest.world_size  # elastic: rank r takes the rank state of saved rank r mod saved
    index_entry = manifest.index_file()
    if index_entry is None and storage.ranged and can_place(manifest):
        return _load_in_place(storage, coord, manifest, own, live)
    replicated_status, detail, replicated = _replicated(storage, coord, manifest, manifest.file_for(None))
    if index_entry is None:
        if replicated_status not in ("ok", "peer"):
            return replicated_status, detail, None
        status, detail, mine = _guarded(lambda: read_verified(storage, manifest, manifest.file_for(own)))
        if status != "ok" or replicated_status == "peer":
            return status, detail, None
        return "ok", "", Restored(manifest, replicated, mine, ranks_read=(own,))
    index_status, index_detail, index_tree = _replicated(storage, coord, manifest, index_entry)
    for status, why in ((replicated_status, detail), (index_status, index_detail)):
        if status not in ("ok", "peer"):
            return status, why, None
    if "peer" in (replicated_status, index_status):
        return "ok", "", None
    return _load_sharded(storage, coord, manifest, replicated, index_tree, own, targets)


def _load_in_place(storage: Storage, coord: Coordinator, manifest: Manifest, own: int,
                   live: Live | None) -> tuple[str, str, Restored | None]:
    """Unsharded state read in place (:mod:`.placed`): the replicated state by every rank where the store
    shares reads, else by rank 0 and sent (its collectives first, on every rank alike); then this rank's own
    file."""
    def trees() -> dict[str, Any]:
        return live() if live is not None else {}

    if storage.shared_reads:  # no collective on this path: a rank may stop at its first problem
        status, detail, got = _guarded(trees)
        if status != "ok":
            return status, detail, None
        status, detail, placed = _guarded(partial(read_placed, storage, manifest, manifest.file_for(None),
                                                  live_paths(got.get(REPLICATED))))
        if status != "ok":
            return status, detail, None
        replicated, shared = placed.tree, placed.read_bytes
    else:
        status, detail, replicated = _replicated(storage, coord, manifest, manifest.file_for(None))
        if status not in ("ok", "peer"):
            return status, detail, None
        shared = _shared_bytes(manifest, coord)
        own_status, detail, got = _guarded(trees)
        if own_status != "ok":
            return own_status, detail, None
    mine_status, detail, mine = _guarded(partial(read_placed, storage, manifest, manifest.file_for(own),
                                                 live_paths(got.get(RANK))))
    if mine_status != "ok" or status == "peer":  # a rank without rank 0's copy says "ok" for itself (above)
        return mine_status, detail, None
    return "ok", "", Restored(manifest, replicated, mine.tree, ranks_read=(own,), read_bytes=shared + mine.read_bytes)


def _load_sharded(storage: Storage, coord: Coordinator, manifest: Manifest, replicated: Any, index_tree: Any,
                  own: int, targets: Targets | None) -> tuple[str, str, Restored | None]:
    """This rank's state of a sharded checkpoint: its own rank file, and its chunks from the files that hold
    them (:mod:`.sharded`)."""
    status, detail, index = _guarded(lambda: _parsed_index(index_tree, manifest, index_entry_path(manifest)))
    if status != "ok":
        return status, detail, None
    if targets is None:
        return "mismatch", (
            f"checkpoint {manifest.name} holds sharded state (FSDP2/DTensor) but this Run's model is not sharded; "
            "shard the model as it was when saved (resilient reshards across world sizes and meshes)"), None
    try:
        live = targets()
        plan = sharded.read_plan(index, live, manifest.name)
    except CheckpointMismatchError as e:
        return "mismatch", str(e), None
    except Exception as e:  # noqa: BLE001  the peers must hear of it
        return "error", f"planning the restore of {manifest.name}: {type(e).__name__}: {e}", None
    needed = sharded.chunks_needed(index, plan)
    ranks = sorted(set(needed) | {own})
    if not (storage.ranged and can_place(manifest)):
        files: dict[int, Any] = {}
        for r in ranks:
            status, detail, files[r] = _guarded(partial(read_verified, storage, manifest, manifest.file_for(r)))
            if status != "ok":
                return status, detail, None
        read_bytes = None
    else:  # in place: its own file whole, of a peer's only the blocks holding the chunks it needs
        places = sharded.in_place(index, live, plan)
        files, read_bytes = {}, _shared_bytes(manifest, coord)
        for r in ranks:
            only = None if r == own else [(sharded.SHARDS, item) for item in needed[r]]
            status, detail, placed = _guarded(partial(read_placed, storage, manifest, manifest.file_for(r),
                                                      places.get(r, {}), only))
            if status != "ok":
                return status, detail, None
            files[r], read_bytes = placed.tree, read_bytes + placed.read_bytes
    status, detail, filled = _guarded(lambda: _assembled(index, live, plan, files, manifest))
    if status != "ok":
        return status, detail, None
    return "ok", "", Restored(manifest, replicated, files[own], filled, tuple(ranks), read_bytes)


def index_entry_path(manifest: Manifest) -> str:
    entry = manifest.index_file()
    assert entry is not None
    return entry.path


def _parsed_index(tree: Any, manifest: Manifest, path: str) -> dict[str, sharded.Saved]:
    try:
        return sharded.parse_index(tree, manifest.world_size)
    except ValueError as e:
        raise CheckpointCorruptError(manifest.name, path, f"malformed sharded index ({e})") from None


def _assembled(index: dict[str, sharded.Saved], live: dict[str, Any], plan: list[Any], files: dict[int, Any],
               manifest: Manifest) -> dict[str, Any]:
    try:
        return sharded.assemble(index, live, plan, files, manifest.name)
    except ValueError as e:
        raise CheckpointCorruptError(manifest.name, index_entry_path(manifest), f"chunks do not fit ({e})") from None


def _replicated(storage: Storage, coord: Coordinator, manifest: Manifest, entry: FileEntry) -> tuple[str, str, Any]:
    """A file every rank needs (the replicated state, the sharded index), read from storage once: rank 0
    reads and verifies it (size, digest, decoding) and sends the verified bytes to the others, which decode
    their own copy.  ("peer", "", None) on a rank whose copy did not come because rank 0 could not read or
    verify it (rank 0 reports that)."""
    if coord.world_size == 1:
        return _guarded(lambda: read_verified(storage, manifest, entry))
    buf: Any = None
    tree: Any = None
    if coord.is_root:
        status, detail, checked = _guarded(lambda: _checked(storage, manifest, entry))
        if checked is not None:
            buf, tree = checked.buf, checked.tree
        header = json.dumps([status, detail, len(buf) if status == "ok" else 0]).encode()
    root_status, _, size = json.loads(coord.broadcast(header if coord.is_root else None))
    if root_status != "ok":
        return (status, detail, None) if coord.is_root else ("peer", "", None)
    got = coord.share(buf, int(size))
    if coord.is_root:
        return "ok", "", tree
    return _guarded(lambda: _decoded(got, manifest, entry))


def _checked(storage: Storage, manifest: Manifest, entry: FileEntry) -> Checked:
    checked = check_file(storage, manifest, entry)
    if checked.check.problem is not None:
        raise CheckpointCorruptError(manifest.name, entry.path, checked.check.problem)
    return checked


def _decoded(buf: bytearray, manifest: Manifest, entry: FileEntry) -> Any:
    try:
        skeleton, tensors = decode(buf)
    except ValueError as e:
        raise CheckpointCorruptError(manifest.name, entry.path, f"undecodable content as received from rank 0 ({e})")
    return unflatten(skeleton, tensors)


def _guarded(read: Callable[[], Any]) -> tuple[str, str, Any]:
    """("ok", "", value), or what went wrong as ("corrupt"|"error", detail, None); never raises."""
    try:
        return "ok", "", read()
    except CheckpointCorruptError as e:
        return "corrupt", f"{e.file}: {e.problem}", None
    except StorageError as e:
        return "error", str(e), None
    except Exception as e:  # noqa: BLE001  a bug or an exhausted resource: say so on every rank
        return "error", f"{type(e).__name__}: {e}", None


def _quarantine(storage: Storage, coord: Coordinator, events: EventLog, name: str, reason: str,
                fence: Fence | None) -> None:
    if not coord.is_root:
        return
    try:
        where = storage.quarantine(name, reason, fence=fence)  # a stale process quarantines nothing
        events.emit(EventKind.CHECKPOINT_QUARANTINED, name=name, reason=reason, moved_to=where)
    except Exception as e:  # noqa: BLE001  the next checkpoint is tried either way; the event says why not moved
        events.emit(EventKind.CHECKPOINT_QUARANTINE_FAILED, name=name, reason=reason, error=str(e))
