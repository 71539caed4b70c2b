"""Rank 0's half of the commit: every rank's report in, one manifest (or one reason) out.

Each rank writes its files into the staging area and reports them (path,
size, digest), its counters and, for sharded state, its chunk table.  Here
the reports become the manifest: any rank's error aborts the save; the
chunk tables are merged into the sharded index (:mod:`.sharded`), staged
like any file; the manifest is published with the storage's atomic commit
under this job's fence.  The outcome is a JSON-able dict that every rank
receives: ``ok`` with the manifest, or the error and whether the save was
fenced or conflicted.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ..core.errors import CommitConflictError, FencedError, ResilientError
from .digest import BlockSpec
from .fence import Fence
from .manifest import SCHEMA_BLOCKS, FileEntry, Manifest
from .shard import plan_layout
from .sharded import INDEX_FILE, merge
from .storage import Staging, Storage
from .tree import flatten

if TYPE_CHECKING:
    from collections.abc import Callable

    from .writer import Job

_fault_point: Callable[[str, int], None] | None = None
"""Called as a commit reaches its point of no return (every rank's files staged, the manifest built, not yet
published) with ``("commit", step)``: a worker's fault plan hooks in here (:mod:`resilient.chaos`), so that a drill
can crash a save there.  None: nothing is called."""


def set_fault_point(fn: Callable[[str, int], None] | None) -> None:
    global _fault_point
    _fault_point = fn


def decide_commit(storage: Storage, staging: Staging | None, reports: list[dict[str, Any]], *, job: Job, name: str,
                  parent: str | None, world_size: int, spec: BlockSpec, fence: Fence) -> dict[str, Any]:
    """Commit ``job`` as checkpoint ``name`` if every rank's report is good; the outcome for every rank."""
    errors = [r["error"] for r in reports if r["error"]]
    if errors or staging is None:
        if staging is not None:
            storage.abort(staging)
        return {"ok": False, "error": "; ".join(errors) or "staging failed"}
    counters = {k: sum(int(r["counters"].get(k, 0)) for r in reports) for k in ("samples", "tokens")}
    counters["step"] = job.step
    files = [FileEntry(**{**f, "blocks": tuple(f["blocks"])}) for r in reports for f in r["files"]]
    index = None
    if any(r["index"] is not None for r in reports):
        try:
            index = write_index(storage, staging, [r["index"] or [] for r in reports], spec)
        except Exception as e:  # noqa: BLE001  whatever it is, the staged files go and the peers hear why
            storage.abort(staging)
            return {"ok": False, "error": f"index of the sharded state of {name}: {e}"}
        files.append(index)
    manifest = Manifest(
        name=name,
        step=job.step,
        world_size=world_size,
        files=tuple(files),
        parent=parent,
        created_unix=time.time(),
        chunk_bytes=spec.block_bytes,
        fingerprint=job.fingerprint,
        counters=counters,
        generation=fence.generation,
        launch=fence.launch,
        index=index.path if index is not None else None,
        schema=SCHEMA_BLOCKS,
        digest_algorithm=spec.algorithm,
    )
    raw = manifest.to_bytes()
    if _fault_point is not None:
        _fault_point("commit", job.step)
    try:
        storage.commit(staging, raw, fence=fence)
    except FencedError as e:
        storage.abort(staging)
        holder = {"launch": e.holder_launch, "generation": e.holder_generation}
        return {"ok": False, "fenced": True, "holder": holder, "error": str(e)}
    except CommitConflictError as e:
        storage.abort(staging)
        return {"ok": False, "conflict": True, "error": str(e)}
    except (ResilientError, OSError) as e:
        storage.abort(staging)
        return {"ok": False, "error": f"commit of {name} failed: {e}"}
    return {"ok": True, "manifest": raw.decode()}


def write_index(storage: Storage, staging: Staging, tables: list[list[dict[str, Any]]], spec: BlockSpec) -> FileEntry:
    """Merge the ranks' chunk tables into the sharded index and stage it as a shard without tensors."""
    skeleton, tensors = flatten(merge(tables), "index")
    layout = plan_layout(skeleton, tensors)
    got = storage.write_file(staging, INDEX_FILE, [memoryview(layout.header)], spec)
    return FileEntry(path=staging.file_prefix + INDEX_FILE, size=got.size, digest=got.digest, rank=None,
                     blocks=got.blocks)
