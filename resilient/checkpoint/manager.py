"""The commit protocol and verified restore, across all ranks of a job.

Saving: every rank snapshots its payloads into host memory at a step
boundary (the only part the training loop waits for), then a background
thread writes and hashes its files into the staging area and reports
(path, size, digest) to rank 0 over the checkpoint group.  Rank 0 writes the
manifest and commits it only if every rank succeeded, tells every rank the
outcome, and applies retention.  A failed save is an event, never a crash,
and never moves "latest".

Restoring: newest committed checkpoint first; every rank verifies the files
it needs (size and digest) before decoding them; ranks agree on the outcome.
A checkpoint that fails verification on any rank is quarantined and the
previous one tried; an I/O error stops the restore without quarantining.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..errors import (
    CheckpointCorruptError,
    CheckpointMismatchError,
    CommitConflictError,
    NoValidCheckpointError,
    ResilientError,
    StorageError,
)
from ..events import EventLog
from .config import CheckpointConfig
from .coordinator import Coordinator
from .manifest import FileEntry, Manifest, checkpoint_name, parse_manifest
from .retention import decide_retention
from .shard import decode
from .snapshot import HostBuffer, Snapshot, snapshot_bytes, take_snapshots
from .storage import Storage, open_storage
from .tree import unflatten

REPLICATED = "replicated"
RANK = "rank"


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


@dataclass(frozen=True)
class Restored:
    manifest: Manifest
    replicated: Any
    rank_state: Any


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
    ) -> None:
        self.config = config
        self.coord = coordinator
        self.events = events
        self.storage = storage if storage is not None else open_storage(config.dir, endpoint_url=config.endpoint_url)
        self.last_committed: Manifest | None = None
        self.results: deque[SaveResult] = deque(maxlen=64)
        """Outcomes of the most recent saves, oldest first."""
        self._buffer = HostBuffer()
        self._inflight: _Job | None = None
        self._thread: threading.Thread | None = None
        # Rank 0 checks the store and sweeps leftovers of crashed saves, then
        # tells everybody the save token (or the error, so all ranks raise).
        hello = None
        if coordinator.is_root:
            hello = {"token": uuid.uuid4().hex[:12], "error": None}
            try:
                self.storage.check_writable()
                removed = self.storage.collect_garbage(keep_token=hello["token"])
                if removed:
                    self.events.emit("checkpoint_garbage_collected", removed=removed)
            except StorageError as e:
                hello["error"] = str(e)
        agreed = json.loads(self.coord.broadcast(json.dumps(hello).encode() if hello else None))
        if agreed["error"]:
            raise StorageError(agreed["error"])
        self.token: str = agreed["token"]

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
                "checkpoint_committed",
                name=name,
                step=job.step,
                bytes=manifest.total_bytes,
                stall_s=round(job.stall_s, 6),
                write_s=round(result.write_s, 6),
                location=self.storage.url,
            )
            if self.coord.is_root:
                self._apply_retention(name)
        else:
            kind = "checkpoint_conflict" if outcome.get("conflict") else "checkpoint_failed"
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
            outcome = self._decide_commit(job, name, staging, [json.loads(r) for r in reports])
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
        )
        raw = manifest.to_bytes()
        try:
            self.storage.commit(staging, raw)
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
            for victim in decision.delete:
                self.storage.delete(victim)
            if decision.delete:
                self.events.emit("checkpoint_retention", deleted=list(decision.delete), reason=decision.reason)
        except (ResilientError, OSError) as e:
            self.events.emit("checkpoint_retention_failed", error=str(e))

    # --------------------------------------------------------------- restore
    def restore(self) -> Restored | None:
        """Load the newest committed checkpoint that verifies on every rank.

        Returns None when nothing was ever committed.  Raises
        :class:`NoValidCheckpointError` when checkpoints exist but none
        verifies, :class:`StorageError` when the store cannot be read.
        """
        listing = json.dumps(self.storage.list_committed()).encode() if self.coord.is_root else None
        names = json.loads(self.coord.broadcast(listing))
        problems: list[str] = []
        for name in reversed(names):
            raw = self._root_read_manifest(name)
            try:
                manifest = parse_manifest(raw, name) if raw else None
                if manifest is None:
                    raise CheckpointCorruptError(name, "manifest.json", "manifest is missing")
            except CheckpointCorruptError as e:
                self._quarantine(name, f"{e.file}: {e.problem}")
                problems.append(str(e))
                continue
            if manifest.world_size != self.coord.world_size and self.config.elastic:
                self.events.emit("checkpoint_resharded", name=name, saved_world_size=manifest.world_size,
                                 world_size=self.coord.world_size, rank_state_from=self.coord.rank % manifest.world_size)
            elif manifest.world_size != self.coord.world_size:
                raise CheckpointMismatchError(
                    f"checkpoint {name} in {self.storage.url} was written by {manifest.world_size} ranks but this "
                    f"job has {self.coord.world_size}; restart with {manifest.world_size} ranks, or point "
                    "CheckpointConfig.dir at a fresh location to start a new run (or set CheckpointConfig(elastic=True) "
                    "to continue on a different number of ranks)"
                )
            status, detail, restored = self._load_local(manifest)
            statuses = self.coord.gather(json.dumps([status, detail]).encode())
            verdict = None
            if statuses is not None:
                parsed = [json.loads(s) for s in statuses]
                bad = [d for s, d in parsed if s == "error"] or [d for s, d in parsed if s == "corrupt"]
                kind = "error" if any(s == "error" for s, _ in parsed) else ("corrupt" if bad else "ok")
                verdict = json.dumps([kind, "; ".join(bad)]).encode()
            kind, why = json.loads(self.coord.broadcast(verdict))
            if kind == "ok":
                assert restored is not None
                self.last_committed = manifest
                if problems:
                    self.events.emit("checkpoint_fallback", restored=name, skipped=problems)
                self.events.emit("checkpoint_restored", name=name, step=manifest.step, location=self.storage.url)
                return restored
            if kind == "error":
                raise StorageError(f"cannot read checkpoint {name} from {self.storage.url}: {why}")
            self._quarantine(name, why)
            problems.append(f"{name}: {why}")
        if names:
            raise NoValidCheckpointError(
                f"none of the {len(names)} committed checkpoints in {self.storage.url} passed verification "
                f"({'; '.join(problems)}); they were quarantined. Refusing to start from scratch silently: "
                "inspect them with `resilient checkpoint ls`, or point CheckpointConfig.dir at a fresh location "
                "to start a new run."
            )
        return None

    def _root_read_manifest(self, name: str) -> bytes:
        payload = None
        if self.coord.is_root:
            payload = self.storage.read_manifest(name)
        return self.coord.broadcast(payload)

    def _load_local(self, manifest: Manifest) -> tuple[str, str, Restored | None]:
        """Read and verify this rank's files: ("ok"|"corrupt"|"error", detail, restored)."""
        try:
            trees = {}
            # Elastic restore: rank r takes the per-rank state of rank r mod the saved world size.
            source_rank = self.coord.rank % manifest.world_size
            for key, entry in ((REPLICATED, manifest.file_for(None)), (RANK, manifest.file_for(source_rank))):
                trees[key] = self._read_verified(manifest, entry)
            return "ok", "", Restored(manifest, trees[REPLICATED], trees[RANK])
        except CheckpointCorruptError as e:
            return "corrupt", f"{e.file}: {e.problem}", None
        except StorageError as e:
            return "error", str(e), None

    def _read_verified(self, manifest: Manifest, entry: FileEntry) -> Any:
        def corrupt(problem: str) -> CheckpointCorruptError:
            return CheckpointCorruptError(manifest.name, entry.path, problem)

        try:
            buf, digest = self.storage.read_file(manifest.name, entry.path, manifest.chunk_bytes)
        except FileNotFoundError:
            raise corrupt("file is missing") from None
        if len(buf) != entry.size:
            raise corrupt(f"size is {len(buf)} bytes, manifest says {entry.size} (truncated or overwritten)")
        if digest != entry.digest:
            raise corrupt(f"digest mismatch (content changed after commit): {digest[:16]}... != {entry.digest[:16]}...")
        try:
            skeleton, tensors = decode(buf)
            return unflatten(skeleton, tensors)
        except ValueError as e:
            raise corrupt(f"undecodable content ({e})") from None

    def _quarantine(self, name: str, reason: str) -> None:
        if not self.coord.is_root:
            return
        try:
            where = self.storage.quarantine(name, reason)
            self.events.emit("checkpoint_quarantined", name=name, reason=reason, moved_to=where)
        except (ResilientError, OSError) as e:
            self.events.emit("checkpoint_quarantine_failed", name=name, reason=reason, error=str(e))
