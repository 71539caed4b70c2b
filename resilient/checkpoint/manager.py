"""The commit protocol and verified restore, across all ranks of a job.

Saving: every rank snapshots its payloads into host memory at a step
boundary (the only part the training loop waits for), then a background
thread writes and hashes its files into the staging area and reports
(path, size, digest) to rank 0 over the checkpoint group.  Rank 0 writes the
manifest and commits it only if every rank succeeded, tells every rank the
outcome, and applies retention.  A failed save is an event, never a crash,
and never moves "latest".

Fencing: at start rank 0 claims the location's fence with this job's
launch and generation (:mod:`.fence`); a stale process is refused there, and
a commit, retention delete or garbage collection of a process whose fence
has moved since is refused with a ``checkpoint_fenced`` event.

Restoring lives in :mod:`.restore`; this class only holds its outcome.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..errors import CommitConflictError, FencedError, ResilientError
from ..events import EventKind, EventLog
from .config import CheckpointConfig
from .coordinator import Coordinator
from .fence import Fence
from .manifest import FileEntry, Manifest, checkpoint_name, parse_manifest
from .restore import RANK, REPLICATED, Restored, restore_newest
from .retention import decide_retention
from .snapshot import HostBuffer, Snapshot, snapshot_bytes, take_snapshots
from .storage import Storage, open_storage

__all__ = ["RANK", "REPLICATED", "CheckpointManager", "Restored", "SaveResult", "file_name"]


def file_name(key: str, rank: int) -> str:
    return "replicated.shard" if key == REPLICATED else f"rank{rank:05d}.shard"


@dataclass(frozen=True)
class SaveResult:
    """Outcome of one save, as every rank sees it."""

    step: int
    name: str
    ok: bool
    error: str | None
    manifest: Manifest | None
    stall_s: float
    """Time the training loop waited (previous save + snapshot)."""
    write_s: float
    """Background time from snapshot to commit outcome."""


@dataclass
class _Job:
    step: int
    snapshots: dict[str, Snapshot]
    counters: dict[str, int]
    fingerprint: dict[str, Any]
    stall_s: float
    done: threading.Event = field(default_factory=threading.Event)
    result: SaveResult | None = None


class CheckpointManager:
    """Saves and restores checkpoints for one rank of a job."""

    def __init__(
        self,
        config: CheckpointConfig,
        coordinator: Coordinator,
        events: EventLog,
        storage: Storage | None = None,
        fence: Fence | None = None,
    ) -> None:
        """``fence``: this job's launch and generation (default: no agent, generation 0)."""
        self.config = config
        self.coord = coordinator
        self.events = events
        self.storage = storage if storage is not None else open_storage(config.dir, endpoint_url=config.endpoint_url)
        self.fence = fence if fence is not None else Fence()
        self.last_committed: Manifest | None = None
        self.results: deque[SaveResult] = deque(maxlen=64)
        """Outcomes of the most recent saves, oldest first."""
        self._buffer = HostBuffer()
        self._inflight: _Job | None = None
        self._thread: threading.Thread | None = None
        # Rank 0 checks the store, claims the fence and then sweeps leftovers
        # of crashed (or stale) saves; every rank gets the save token, or the
        # same error (a refused claim is a FencedError everywhere).
        self.token: str = self.coord.on_root(self._start).decode()

    def _start(self) -> bytes:
        token = uuid.uuid4().hex[:12]
        self.storage.check_writable()
        previous = self.storage.claim_fence(self.fence)
        if previous != self.fence:
            self.events.emit(EventKind.CHECKPOINT_FENCE_CLAIMED, location=self.storage.url,
                             generation=self.fence.generation, launch=self.fence.launch,
                             previous=previous.to_json() if previous else None)
        try:
            removed = self.storage.collect_garbage(keep_token=token, fence=self.fence)
        except FencedError as e:  # claimed a moment ago and already taken: we are stale
            self._fenced("gc", e, name=None, step=None)
            raise
        if removed:
            self.events.emit(EventKind.CHECKPOINT_GARBAGE_COLLECTED, removed=removed)
        return token.encode()

    def _fenced(self, action: str, e: FencedError, *, name: str | None, step: int | None) -> None:
        holder = {"launch": e.holder_launch, "generation": e.holder_generation}
        self.events.emit(EventKind.CHECKPOINT_FENCED, action=action, name=name, step=step,
                         generation=self.fence.generation, launch=self.fence.launch, holder=holder, error=str(e))

    # ------------------------------------------------------------------ save
    def save(
        self,
        step: int,
        payloads: dict[str, Any],
        *,
        counters: dict[str, int],
        fingerprint: dict[str, Any],
        wait: bool,
    ) -> SaveResult | None:
        """Snapshot ``payloads`` now and commit them as checkpoint ``step``.

        ``payloads`` holds this rank's trees: ``{"rank": ...}`` plus
        ``{"replicated": ...}`` on rank 0.  Returns the result when ``wait``.
        """
        started = time.monotonic()
        self.wait()  # at most one save in flight: its buffer is reused
        self._buffer.in_use.acquire()
        try:
            snapshots = take_snapshots(payloads, self._buffer)
        except BaseException:
            self._buffer.in_use.release()
            raise
        job = _Job(step, snapshots, dict(counters), fingerprint, stall_s=time.monotonic() - started)
        self._inflight = job
        if self.config.async_save and not wait:
            self._thread = threading.Thread(target=self._run_job, args=(job,), name="resilient-ckpt", daemon=False)
            self._thread.start()
            return None
        self._run_job(job)
        self._inflight = None
        return job.result

    def prepare(self, payloads: dict[str, Any]) -> threading.Thread | None:
        """Allocate and fault in the host buffer for state like ``payloads``, in the background.

        Without it the first save pays for fresh memory (about 0.4 s per GiB
        here) inside the training loop.  A save that starts meanwhile waits
        for the buffer, which costs no more than allocating it itself.
        """
        if not self.config.async_save:
            return None
        nbytes = snapshot_bytes(payloads)
        if nbytes <= self._buffer.capacity:
            return None

        def reserve() -> None:
            with self._buffer.in_use:
                self._buffer.reserve(nbytes)

        thread = threading.Thread(target=reserve, name="resilient-ckpt-prepare", daemon=True)
        thread.start()
        return thread

    def wait(self) -> SaveResult | None:
        """Block until the in-flight save (if any) has its outcome; return it."""
        job = self._inflight
        if job is None:
            return None
        job.done.wait()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._inflight = None
        return job.result

    def _run_job(self, job: _Job) -> None:
        started = time.monotonic()
        name = checkpoint_name(job.step)
        try:
            outcome = self._write_and_commit(job, name)
        except Exception as e:  # noqa: BLE001  a peer died or the group broke: record, keep training
            outcome = {"ok": False, "error": f"commit protocol failed on rank {self.coord.rank}: {e}"}
        manifest = parse_manifest(outcome["manifest"].encode(), name) if outcome.get("ok") else None
        result = SaveResult(
            step=job.step,
            name=name,
            ok=bool(outcome.get("ok")),
            error=outcome.get("error"),
            manifest=manifest,
            stall_s=job.stall_s,
            write_s=time.monotonic() - started,
        )
        if manifest is not None:
            self.last_committed = manifest
            self.events.emit(
                EventKind.CHECKPOINT_COMMITTED,
                name=name,
                step=job.step,
                bytes=manifest.total_bytes,
                stall_s=round(job.stall_s, 6),
                write_s=round(result.write_s, 6),
                location=self.storage.url,
            )
            if self.coord.is_root:
                self._apply_retention(name)
        elif outcome.get("fenced"):
            self.events.emit(EventKind.CHECKPOINT_FENCED, action="commit", name=name, step=job.step,
                             generation=self.fence.generation, launch=self.fence.launch, holder=outcome.get("holder"),
                             error=result.error)
        else:
            kind = EventKind.CHECKPOINT_CONFLICT if outcome.get("conflict") else EventKind.CHECKPOINT_FAILED
            self.events.emit(kind, name=name, step=job.step, error=result.error)
        self.results.append(result)
        job.result = result
        job.done.set()

    def _write_and_commit(self, job: _Job, name: str) -> dict[str, Any]:
        rank = self.coord.rank
        files: list[dict[str, Any]] = []
        error = None
        staging = None
        try:
            staging = self.storage.begin(name, self.token)
            for key, snap in job.snapshots.items():
                rel = file_name(key, rank)
                size, digest = self.storage.write_file(staging, rel, snap.segments(), self.config.chunk_bytes)
                files.append(
                    {"path": staging.file_prefix + rel, "size": size, "digest": digest, "rank": None if key == REPLICATED else rank}
                )
        except (ResilientError, OSError) as e:
            error = f"rank {rank}: {e}"
        finally:
            job.snapshots.clear()
            self._buffer.in_use.release()
        report = json.dumps({"error": error, "files": files, "counters": job.counters}).encode()
        reports = self.coord.gather(report)
        outcome: dict[str, Any] | None = None
        if reports is not None:
            try:
                outcome = self._decide_commit(job, name, staging, [json.loads(r) for r in reports])
            except Exception as e:  # noqa: BLE001  the peers wait for an outcome: give them one
                outcome = {"ok": False, "error": f"commit of {name} failed on rank 0: {type(e).__name__}: {e}"}
        return json.loads(self.coord.broadcast(json.dumps(outcome).encode() if outcome is not None else None))

    def _decide_commit(self, job: _Job, name: str, staging: Any, reports: list[dict[str, Any]]) -> dict[str, Any]:
        errors = [r["error"] for r in reports if r["error"]]
        if errors or staging is None:
            if staging is not None:
                self.storage.abort(staging)
            return {"ok": False, "error": "; ".join(errors) or "staging failed"}
        counters = {k: sum(int(r["counters"].get(k, 0)) for r in reports) for k in ("samples", "tokens")}
        counters["step"] = job.step
        manifest = Manifest(
            name=name,
            step=job.step,
            world_size=self.coord.world_size,
            files=tuple(FileEntry(**f) for r in reports for f in r["files"]),
            parent=self.last_committed.name if self.last_committed else None,
            created_unix=time.time(),
            chunk_bytes=self.config.chunk_bytes,
            fingerprint=job.fingerprint,
            counters=counters,
            generation=self.fence.generation,
            launch=self.fence.launch,
        )
        raw = manifest.to_bytes()
        try:
            self.storage.commit(staging, raw, fence=self.fence)
        except FencedError as e:
            self.storage.abort(staging)
            holder = {"launch": e.holder_launch, "generation": e.holder_generation}
            return {"ok": False, "fenced": True, "holder": holder, "error": str(e)}
        except CommitConflictError as e:
            self.storage.abort(staging)
            return {"ok": False, "conflict": True, "error": str(e)}
        except (ResilientError, OSError) as e:
            self.storage.abort(staging)
            return {"ok": False, "error": f"commit of {name} failed: {e}"}
        return {"ok": True, "manifest": raw.decode()}

    def _apply_retention(self, newest: str) -> None:
        try:
            decision = decide_retention(
                self.storage.list_committed(),
                keep=self.config.keep,
                permanent_every=self.config.permanent_every,
                newest_verified=newest,
            )
            deleted = []
            try:
                for victim in decision.delete:
                    self.storage.delete(victim, fence=self.fence)
                    deleted.append(victim)
            finally:
                if deleted:
                    self.events.emit(EventKind.CHECKPOINT_RETENTION, deleted=deleted, reason=decision.reason)
        except FencedError as e:
            self._fenced("retention", e, name=newest, step=None)
        except (ResilientError, OSError) as e:
            self.events.emit(EventKind.CHECKPOINT_RETENTION_FAILED, error=str(e))

    # --------------------------------------------------------------- restore
    def restore(self) -> Restored | None:
        """Load the newest committed checkpoint that verifies on every rank (see :mod:`.restore`).

        Returns None when nothing was ever committed.  Raises
        :class:`NoValidCheckpointError` when checkpoints exist but none
        verifies, :class:`StorageError` when the store cannot be read; the
        same error on every rank.
        """
        restored = restore_newest(self.storage, self.coord, self.events, elastic=self.config.elastic)
        if restored is not None:
            self.last_committed = restored.manifest
        return restored
