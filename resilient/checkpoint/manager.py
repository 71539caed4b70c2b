"""The commit protocol and verified restore, across all ranks of a job.

Saving: every rank snapshots its payloads into host memory at a step
boundary (the only part the training loop waits for), then a background
thread (:mod:`.writer`) writes and hashes its files into the staging area and reports
(path, size, digest) to rank 0 over the checkpoint group.  Rank 0 writes the
manifest and commits it only if every rank succeeded, tells every rank the
outcome, and applies retention.  A failed save is an event, never a crash,
and never moves "latest".  A scheduled save that falls due while the
previous one is still being written is paced by ``config.when_busy`` (pure
policy in :mod:`.pacing`, agreed by all ranks): deferred, queued in a second
buffer, or waited for.  Explicit saves always wait for the writer.

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
from collections.abc import Callable
from typing import Any

from ..core.errors import CheckpointError, FencedError, ResilientError
from ..core.events import EventKind, EventLog
from .cadence import Cadence, FailureRate, Interval, SaveCost
from .commit import decide_commit
from .config import CheckpointConfig
from .coordinator import Coordinator
from .fence import Fence
from .locations import open_storage
from .manifest import Manifest, checkpoint_name, parse_manifest
from .pacing import Busy, Pending, SaveDecision, decide_save, local_busy, second_buffer_fits
from .restore import RANK, REPLICATED, Live, Restored, Targets, restore_newest
from .retention import decide_retention
from .snapshot import HostBuffer, snapshot_bytes
from .storage import Storage
from .store_retries import RetryReports
from .writer import Job, SaveResult, Writer

__all__ = ["RANK", "REPLICATED", "CheckpointManager", "Restored", "SaveResult", "file_name"]


def file_name(key: str, rank: int) -> str:
    return "replicated.shard" if key == REPLICATED else f"rank{rank:05d}.shard"


class CheckpointManager:
    """Saves and restores checkpoints for one rank of a job."""

    def __init__(
        self,
        config: CheckpointConfig,
        coordinator: Coordinator,
        events: EventLog,
        storage: Storage | None = None,
        fence: Fence | None = None,
        *,
        claim: bool = True,
        failure_rate: FailureRate | None = None,
    ) -> None:
        """``fence``: this job's launch and generation (default: no agent, generation 0).

        ``failure_rate``: the interval between scheduled saves is computed
        (:mod:`.cadence`), ``config.every_steps`` the longest; None: every
        ``config.every_steps`` steps.

        ``claim=False``: neither claim the fence nor sweep leftovers (a spare
        restores while the members train: it must not remove their staged
        files); such a manager saves only after :meth:`regroup`.
        """
        self.config = config
        self.coord = coordinator
        self.events = events
        self.storage = storage if storage is not None else open_storage(config.dir, endpoint_url=config.endpoint_url)
        self.fence = fence if fence is not None else Fence()
        self.last_committed: Manifest | None = None
        self.results: deque[SaveResult] = deque(maxlen=64)
        """Outcomes of the most recent saves, oldest first."""
        self.pending: Pending | None = None
        """A scheduled save deferred because the writer was busy (see :mod:`.pacing`)."""
        self.cadence = Cadence(config.every_steps, failure_rate) \
            if failure_rate is not None and config.every_steps is not None else None
        """The computed interval between scheduled saves; None: ``config.every_steps``."""
        self._writer = Writer(self._write_job, background=config.async_save)
        self._retries = RetryReports(events, self.storage.url)
        self.storage.observe_retries(self._retries.report)
        # Rank 0 checks the store, claims the fence and then sweeps leftovers
        # of crashed (or stale) saves; every rank gets the save token, or the
        # same error (a refused claim is a FencedError everywhere).
        self.token: str = self.coord.on_root(self._start).decode() if claim else ""

    def regroup(self, coordinator: Coordinator) -> None:
        """Save with ``coordinator`` (a re-formed group's) from now on; collective on its ranks.

        Call it with no save in flight (:meth:`wait`).  The ranks take the
        save token and fence of the lowest rank that holds a claim, so a
        promoted spare (which claimed nothing) stages where its peers do.
        """
        assert not self._writer.in_flight(), "regroup() with a save in flight"
        self.coord = coordinator
        mine = json.dumps({"token": self.token, "fence": self.fence.to_json()}).encode()
        gathered = coordinator.gather(mine)

        def first_holder() -> bytes:  # on rank 0, which holds every rank's claim
            assert gathered is not None
            for raw in gathered:
                if json.loads(raw)["token"]:
                    return raw
            raise CheckpointError("no rank of the re-formed group holds a checkpoint claim (all are spares): "
                                  "restart the group so that rank 0 claims the location")

        agreed = json.loads(coordinator.on_root(first_holder))  # an error there is the same error on every rank
        self.token, self.fence = agreed["token"], Fence(**agreed["fence"])

    def _start(self) -> bytes:
        token = uuid.uuid4().hex[:12]
        self.storage.check_writable()
        previous = self.storage.claim_fence(self.fence)
        if previous != self.fence:
            self.events.emit(EventKind.CHECKPOINT_FENCE_CLAIMED, location=self.storage.url,
                             generation=self.fence.generation, launch=self.fence.launch,
                             previous=previous.to_json() if previous else None)
        try:
            removed = list(self.storage.collect_garbage(keep_token=token, fence=self.fence).removed)
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
    @property
    def every(self) -> int | None:
        """Steps between scheduled saves now: the same on every rank; None: saves only on request."""
        return self.cadence.every if self.cadence is not None else self.config.every_steps

    def step_done(self, seconds: float | None) -> None:
        """A step took ``seconds`` (for the computed interval)."""
        if self.cadence is not None:
            self.cadence.step_done(seconds)

    def _proposal(self) -> tuple[Interval | None, int]:
        proposal = self.cadence.proposal() if self.cadence is not None else None
        return proposal, proposal.every if proposal is not None else 0

    def _adopt(self, agreed: int, proposal: Interval | None, step: int) -> None:
        """Take the interval the ranks agreed on (their largest proposal), with an event when it changes."""
        if self.cadence is None:
            return
        previous = self.cadence.every
        if not self.cadence.adopt(agreed):
            return
        mine = proposal if proposal is not None else Interval(0, "this rank has measured no save yet")
        reason = mine.reason if mine.every == agreed else (
            f"the largest of the ranks' proposals; this rank proposed {mine.every or 'nothing'}: {mine.reason}")
        self.events.emit(EventKind.CHECKPOINT_CADENCE, step=step, every=agreed, previous=previous,
                         bound=self.cadence.bound, reason=reason, cost_s=_round(mine.cost_s),
                         write_s=_round(mine.write_s), step_s=_round(mine.step_s), mtbf_s=_round(mine.mtbf_s),
                         optimum_s=_round(mine.optimum_s), mtbf_source=self.cadence.rate.source)

    def save(
        self,
        step: int,
        payloads: dict[str, Any],
        *,
        counters: dict[str, int],
        fingerprint: dict[str, Any],
        wait: bool,
    ) -> SaveResult | None:
        """Snapshot ``payloads`` now and commit them as checkpoint ``step``: an explicit save.

        ``payloads`` holds this rank's trees: ``{"rank": ...}`` plus
        ``{"replicated": ...}`` on rank 0.  It first waits for every save in
        flight (an explicit save, e.g. the final one or a graceful stop's,
        must happen whatever the writer is doing) and takes the pending save
        if there is one.  Returns the result when ``wait``.
        """
        started = time.monotonic()
        waited = self._writer.wait_all()[1]
        landed, self.pending = self.pending, None
        if landed is not None:
            self._landed(landed, step, "an explicit save (Run.save, a graceful stop or the final save)")
        job = self._writer.take(step, payloads, counters, fingerprint, self._writer.buffers[0], started=started,
                                waited_s=waited, landed=landed)
        return self._writer.start(job, wait=wait)

    def save_due(
        self,
        step: int,
        *,
        due: bool,
        payloads: Callable[[], dict[str, Any]],
        counters: dict[str, int],
        fingerprint: dict[str, Any],
    ) -> SaveDecision | None:
        """At a step boundary: take the scheduled save if ``due`` or pending, paced by ``config.when_busy``.

        Collective at every boundary where a save is due or pending (the
        ranks agree there, see :mod:`.pacing`); nothing happens otherwise.
        ``payloads`` is called only when a snapshot (or its size) is needed.
        Returns the decision, or None when there was nothing to decide.
        """
        if not due and self.pending is None:
            return None
        policy = self.config.when_busy
        proposal, mine = self._proposal()
        if policy == "wait" or not self.config.async_save:
            if self.cadence is not None:  # the same on every rank (the config's, or the agent's flag)
                self._adopt(self.coord.agree_max((mine,))[0], proposal, step)
            self.save(step, payloads(), counters=counters, fingerprint=fingerprint, wait=False)
            return SaveDecision("snapshot", f"when_busy={policy!r}, async_save={self.config.async_save}: "
                                "waited for the writer", None)
        started = time.monotonic()
        captured: dict[str, Any] | None = None
        in_flight = self._writer.in_flight()
        fits, note = False, None
        if policy == "second_buffer" and len(in_flight) == 1:
            captured = payloads()
            fits, note = self._second_buffer_fits(captured, in_flight[0].buffer)
        level = local_busy(in_flight=len(in_flight), policy=policy, second_buffer_fits=fits)
        agreed, busy_step, every = self.coord.agree_max((int(level), in_flight[0].step if in_flight else -1, mine))
        self._adopt(every, proposal, step)
        decision = decide_save(step=step, due=due, pending=self.pending, busy=Busy(agreed),
                               busy_step=busy_step if busy_step >= 0 else None, policy=policy)
        self.pending = decision.pending
        if decision.action == "defer":
            if due:
                assert decision.pending is not None
                self.events.emit(EventKind.CHECKPOINT_DEFERRED, step=step, pending_since=decision.pending.due_step,
                                 reason=decision.reason, policy=policy,
                                 memory=note if level is Busy.NO_MEMORY else None)
            return decision
        if decision.landed is not None:
            self._landed(decision.landed, step, decision.reason)
        behind, buffer = None, self._writer.buffers[0]
        if decision.action == "queue" and in_flight:  # this rank's writer is busy: queue behind it
            behind = in_flight[-1]
            buffer = self._writer.other_buffer(behind.buffer)
        else:
            self._writer.wait_all()  # every save already has its outcome (agreed FREE): reaps, never waits
        job = self._writer.take(step, captured if captured is not None else payloads(), counters, fingerprint,
                                buffer, started=started, waited_s=0.0, landed=decision.landed, behind=behind)
        self._writer.start(job, wait=False)
        return decision

    @property
    def in_flight(self) -> int:
        """Saves of this rank without an outcome yet (at most two: one written, one queued)."""
        return len(self._writer.in_flight())

    def _landed(self, landed: Pending, step: int, reason: str) -> None:
        self.events.emit(EventKind.CHECKPOINT_DEFERRED_LANDED, due_step=landed.due_step, step=step,
                         steps_late=step - landed.due_step, slots=landed.slots, reason=reason)

    def _second_buffer_fits(self, payloads: dict[str, Any], busy: HostBuffer) -> tuple[bool, str]:
        import psutil

        need = snapshot_bytes(payloads) - self._writer.other_buffer(busy, create=False).capacity
        return second_buffer_fits(need, int(psutil.virtual_memory().available))

    def prepare(self, payloads: dict[str, Any]) -> threading.Thread | None:
        """Allocate and fault in the host buffer(s) for state like ``payloads``, in the background.

        Without it the first save pays for fresh memory (about 0.4 s per GiB
        here) inside the training loop.  A save that starts meanwhile waits
        for the buffer, which costs no more than allocating it itself.  With
        ``when_busy="second_buffer"`` the second buffer is made too if it
        fits in available memory (else on first use, if it fits then).
        """
        if not self.config.async_save:
            return None
        first = self._writer.buffers[0]
        buffers = [first]
        if self.config.when_busy == "second_buffer" and self._second_buffer_fits(payloads, first)[0]:
            buffers.append(self._writer.other_buffer(first))
        return self._writer.prepare(snapshot_bytes(payloads), buffers)

    def wait(self) -> SaveResult | None:
        """Block until every save in flight has its outcome; return the newest one's (None if none was)."""
        return self._writer.wait_all()[0]

    def _write_job(self, job: Job) -> None:
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
            waited_s=job.waited_s,
            deferred_from=job.landed.due_step if job.landed is not None else None,
            deferred_slots=job.landed.slots if job.landed is not None else 0,
            queued=job.behind is not None,
        )
        if manifest is not None:
            self.last_committed = manifest
            if self.cadence is not None:
                self.cadence.saved(SaveCost(job.stall_s, result.write_s))
            self.events.emit(
                EventKind.CHECKPOINT_COMMITTED,
                name=name,
                step=job.step,
                bytes=manifest.total_bytes,
                stall_s=round(job.stall_s, 6),
                write_s=round(result.write_s, 6),
                location=self.storage.url,
                waited_s=round(job.waited_s, 6),
                deferred_from=result.deferred_from,
                queued=result.queued,
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

    def _write_and_commit(self, job: Job, name: str) -> dict[str, Any]:
        rank = self.coord.rank
        files: list[dict[str, Any]] = []
        error = None
        staging = None
        try:
            staging = self.storage.begin(name, self.token)
            for key, snap in job.snapshots.items():
                rel = file_name(key, rank)
                got = self.storage.write_file(staging, rel, snap.segments(), self.config.spec)
                files.append({"path": staging.file_prefix + rel, "size": got.size, "digest": got.digest,
                              "blocks": got.blocks, "rank": None if key == REPLICATED else rank})
        except (ResilientError, OSError) as e:
            error = f"rank {rank}: {e}"
        finally:
            job.snapshots.clear()
            job.buffer.in_use.release()
        report = json.dumps({"error": error, "files": files, "counters": job.counters, "index": job.index}).encode()
        reports = self.coord.gather(report)
        outcome: dict[str, Any] | None = None
        if reports is not None:
            try:
                outcome = self._decide_commit(job, name, staging, [json.loads(r) for r in reports])
            except Exception as e:  # noqa: BLE001  the peers wait for an outcome: give them one
                outcome = {"ok": False, "error": f"commit of {name} failed on rank 0: {type(e).__name__}: {e}"}
        return json.loads(self.coord.broadcast(json.dumps(outcome).encode() if outcome is not None else None))

    def _decide_commit(self, job: Job, name: str, staging: Any, reports: list[dict[str, Any]]) -> dict[str, Any]:
        parent = self.last_committed.name if self.last_committed else None
        return decide_commit(self.storage, staging, reports, job=job, name=name, parent=parent,
                             world_size=self.coord.world_size, spec=self.config.spec, fence=self.fence)

    def _apply_retention(self, newest: str) -> None:
        try:
            decision = decide_retention(
                self.storage.list_committed(),
                keep=self.config.keep,
                permanent_every=self.config.permanent_every,
                newest_verified=newest,
                pinned=self.storage.list_pins(),  # unreadable pins: nothing is deleted (the error is an event)
            )
            deleted = []
            try:
                for victim in decision.delete:
                    if self.storage.delete(victim, fence=self.fence, keep_pinned=True):
                        deleted.append(victim)  # else pinned since the pins were read: kept
            finally:
                if deleted:
                    self.events.emit(EventKind.CHECKPOINT_RETENTION, deleted=deleted, reason=decision.reason)
        except FencedError as e:
            self._fenced("retention", e, name=newest, step=None)
        except (ResilientError, OSError) as e:
            self.events.emit(EventKind.CHECKPOINT_RETENTION_FAILED, error=str(e))

    # --------------------------------------------------------------- restore
    def newest(self) -> Manifest | None:
        """The newest committed checkpoint's manifest, unverified (None when there is none, or it does not
        parse: :meth:`restore` then quarantines it); the same on every rank."""
        def read() -> bytes:
            names = self.storage.list_committed()
            if not names:
                return b""
            return names[-1].encode() + b"\n" + (self.storage.read_manifest(names[-1]) or b"")

        name, _, raw = self.coord.on_root(read).partition(b"\n")
        if not raw:
            return None
        try:
            return parse_manifest(raw, name.decode())
        except CheckpointError:
            return None

    def restore(self, targets: Targets | None = None, live: Live | None = None) -> Restored | None:
        """Load the newest committed checkpoint that verifies on every rank (see :mod:`.restore`).

        ``targets``: the live DTensors that a checkpoint of sharded state is resharded onto; ``live``: the live
        state trees by payload key, which unsharded state is read into where it can be.

        Returns None when nothing was ever committed.  Raises
        :class:`NoValidCheckpointError` when checkpoints exist but none
        verifies, :class:`StorageError` when the store cannot be read; the
        same error on every rank.
        """
        restored = restore_newest(self.storage, self.coord, self.events, elastic=self.config.elastic,
                                  targets=targets, live=live, fence=self.fence)
        if restored is not None:
            self.last_committed = restored.manifest
        return restored


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)
