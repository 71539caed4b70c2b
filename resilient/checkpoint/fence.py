"""The checkpoint fence: which generation of which launch may write a location.

A node agent starts every membership change in a new generation; a rank of
an older generation that is still alive (stopped, partitioned, slow to
die: a *zombie*) must not publish, delete or collect checkpoints once a
newer one runs.  Each checkpoint location holds one fence,
``{launch, generation}``.  Rank 0 claims it at start (:func:`decide_claim`
says whether it may); every commit, retention delete and garbage
collection first checks that the fence still holds exactly our claim
(:func:`fence_moved`), under the backend's lock where it has one.

:class:`LocalFence` is the mechanism for a POSIX directory: ``.fence.json``
guarded by an ``fcntl.flock`` on ``.fence.lock``.  The S3 backend keeps a
``fence.json`` object (see :mod:`resilient.checkpoint.s3`).
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ..core.errors import FencedError, StorageError
from ..core.fsutil import write_json_atomic

FENCE_FILE = ".fence.json"
LOCK_FILE = ".fence.lock"
OPERATOR_LOCK_WAIT_S = 60.0
"""How long an operator's command (``resilient checkpoint gc``) waits for the fence lock of a directory before it
gives up: a job holds it only while it publishes or deletes a checkpoint."""


@dataclass(frozen=True, kw_only=True)
class Fence:
    """Who writes a location: a launch of the run and a generation within it."""

    launch: str | None = None
    """Launch id from the agent; None without an agent."""
    generation: int = 0
    """Membership generation within the launch; 0 without an agent."""

    def to_json(self) -> dict[str, Any]:
        return {"launch": self.launch, "generation": self.generation}

    def describe(self) -> str:
        return f"generation {self.generation} of launch {self.launch or '(none)'}"


@dataclass(frozen=True)
class ClaimDecision:
    ok: bool
    reason: str


def decide_claim(holder: Fence | None, claimant: Fence) -> ClaimDecision:
    """May ``claimant`` take the fence that ``holder`` holds?

    Generations only move forward within a launch, so a lower generation of
    the holder's own launch is stale and refused.  Launch ids carry no order:
    a different launch (a resubmission, or a plain run without an agent)
    always takes the fence, and so does the same or a newer generation.
    """
    if holder is None:
        return ClaimDecision(True, "no fence yet: taking it")
    if holder.launch is not None and holder.launch == claimant.launch and holder.generation > claimant.generation:
        return ClaimDecision(
            False,
            f"the fence is held by {holder.describe()}, newer than this process's {claimant.describe()}: "
            "this process is stale and must exit (a newer generation of the run has started)",
        )
    if holder.launch != claimant.launch:
        return ClaimDecision(True, f"{claimant.describe()} supersedes {holder.describe()} (another launch)")
    return ClaimDecision(True, f"{claimant.describe()} takes the fence from {holder.describe()}")


def check_claim(holder: Fence | None, claimant: Fence, where: str) -> None:
    """Raise :class:`FencedError` when ``claimant`` may not take the fence of location ``where``."""
    decision = decide_claim(holder, claimant)
    if not decision.ok:
        raise FencedError(
            f"cannot claim checkpoints in {where}: {decision.reason}",
            holder_launch=holder.launch if holder else None,
            holder_generation=holder.generation if holder else None,
        )


def fence_moved(holder: Fence | None, ours: Fence) -> str | None:
    """Why we may no longer write (the fence holds another claim), or None while it is ours.

    A location with no fence at all was never claimed by a newer writer
    (claims are only ever replaced, never removed), so it counts as ours.
    """
    if holder is None or holder == ours:
        return None
    return f"the fence is now held by {holder.describe()}, not this process's {ours.describe()}"


def refused(action: str, holder: Fence | None, ours: Fence, where: str) -> FencedError:
    why = fence_moved(holder, ours) or "the fence moved"
    return FencedError(
        f"{action} in {where} refused: {why}; this process is stale and must exit",
        holder_launch=holder.launch if holder else None,
        holder_generation=holder.generation if holder else None,
    )


def parse_fence(raw: bytes | str | None, where: str) -> Fence | None:
    """The fence stored at ``where``; None when there is none. StorageError when it is damaged."""
    if raw is None or raw in (b"", ""):
        return None
    try:
        body = json.loads(raw)
        launch, generation = body["launch"], body["generation"]
        ok = (launch is None or isinstance(launch, str)) and isinstance(generation, int) and generation >= 0
    except (ValueError, TypeError, KeyError):
        ok = False
    if not ok or isinstance(generation, bool):
        raise StorageError(
            f"the checkpoint fence {where} is damaged ({str(raw)[:80]!r}); remove it only when no older "
            "job can still write to this location"
        )
    return Fence(launch=launch, generation=generation)


class LocalFence:
    """``ROOT/.fence.json`` under an exclusive ``flock`` of ``ROOT/.fence.lock``.

    The lock serialises claims, commits and deletions of every process that
    shares the directory (flock works across processes, and across threads
    that open the lock file separately), so a check of the fence and the
    rename that publishes a checkpoint happen as one step.
    """

    def __init__(self, root: str) -> None:
        self.root = root
        self.path = os.path.join(root, FENCE_FILE)
        self._lock_path = os.path.join(root, LOCK_FILE)

    @contextmanager
    def locked(self, wait_s: float | None = None) -> Iterator[Fence | None]:
        """Hold the lock; yield the current fence.  ``wait_s``: give up after this long (StorageError), for an
        operator's command, which must not wait forever behind a stopped job that holds the lock."""
        try:
            fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise StorageError(f"could not open the fence lock {self._lock_path}: {e.strerror or e}") from e
        try:
            if wait_s is None:
                fcntl.flock(fd, fcntl.LOCK_EX)
            else:
                self._lock_within(fd, wait_s)
            yield self.read()
        finally:
            os.close(fd)  # releases the lock

    def _lock_within(self, fd: int, wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise StorageError(
                        f"the fence lock {self._lock_path} stayed held for {wait_s:g} s: a job is committing or "
                        "deleting there (or a stopped process holds the lock); try again, or find the holder with "
                        f"`fuser {self._lock_path}`"
                    ) from None
                time.sleep(0.05)

    def read(self) -> Fence | None:
        try:
            with open(self.path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StorageError(f"could not read the checkpoint fence {self.path}: {e.strerror or e}") from e
        return parse_fence(raw, self.path)

    def claim(self, claimant: Fence) -> Fence | None:
        """Take the fence for ``claimant``; return the previous holder. FencedError if refused."""
        with self.locked() as holder:
            check_claim(holder, claimant, self.root)
            if holder != claimant:
                try:
                    write_json_atomic(self.path, claimant.to_json())
                except OSError as e:
                    raise StorageError(f"could not write the checkpoint fence {self.path}: {e.strerror or e}") from e
            return holder

    @contextmanager
    def held(self, ours: Fence | None, action: str) -> Iterator[None]:
        """Run the body under the lock if the fence is still ours; FencedError otherwise.

        ``ours`` None skips the check but not the lock (an operator's tool, not a job): a job's commit or
        deletion never runs in the middle of it.  The operator waits at most :data:`OPERATOR_LOCK_WAIT_S`.
        """
        if ours is None:
            with self.locked(wait_s=OPERATOR_LOCK_WAIT_S):
                yield
            return
        with self.locked() as holder:
            if fence_moved(holder, ours):
                raise refused(action, holder, ours, self.root)
            yield
