"""Where checkpoints live: the storage protocol and the local-directory backend.

A backend stores files of a checkpoint being written (its *staging* area)
and then publishes the checkpoint in one atomic step, the commit.  Readers
see only committed checkpoints.  Layout of the local backend::

    ROOT/step_0000000100/manifest.json   committed checkpoint (a directory)
    ROOT/.staging/step_0000000200.TOKEN/  a save in progress
    ROOT/.quarantine/step_0000000150.TS/  failed verification, with QUARANTINE.json
    ROOT/.trash/...                       being deleted by retention
    ROOT/.fence.json, ROOT/.fence.lock    who may write here (see :mod:`.fence`)

The commit renames the fully written and fsynced staging directory to its
final name and fsyncs ROOT, so a crash leaves either the old state or the
new checkpoint, never a torn one.  The rename, retention deletes and
garbage collection run under the fence lock, after checking that the fence
still holds the writer's claim (an operator's command, which holds no
claim, takes the lock all the same).  Before the rename the commit checks
that every file its manifest names is staged at its size, and garbage
collection takes a staging area out of ``.staging/`` by a rename under the
lock, so a collection can fail a save but never publish one half deleted.
"""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import shutil
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..core.errors import CommitConflictError, StorageError
from ..core.fsutil import fsync_dir, write_text_atomic
from .digest import BlockSpec, ChunkedHasher, FileDigest, hash_pool
from .fence import Fence, LocalFence
from .manifest import MANIFEST_FILE, step_of

WRITE_PIECE = 16 << 20
PINS_DIR = ".pins"
"""Where pins live in a location (``.pins/<checkpoint>/<holder>.json``): outside the committed set."""

GC_MIN_AGE_S = 3600.0
"""``resilient checkpoint gc`` leaves a save that may still be under way alone: a staging area (on S3, a save's
objects or an incomplete upload) written to within this long is skipped and reported (``--min-age``)."""

ReadBuffer = bytearray | mmap.mmap
"""A file's content: writable, so tensors can be decoded from it without a copy."""


@dataclass(frozen=True)
class Staging:
    """A save in progress. Manifest paths of its files are ``file_prefix + relpath``."""

    name: str
    token: str
    file_prefix: str


@dataclass(frozen=True)
class Garbage:
    """What garbage collection removed, and what it left alone and why."""

    removed: tuple[str, ...] = ()
    skipped: tuple[tuple[str, str], ...] = ()
    """(entry, why) of leftovers it did not touch: written to within the minimum age (a save may be under way)."""


def staged_files(manifest: bytes) -> dict[str, int] | None:
    """Path -> size of every file a manifest names (None when it is not one this module can read: the readers'
    parse reports that)."""
    try:
        return {str(f["path"]): int(f["size"]) for f in json.loads(manifest)["files"]}
    except (ValueError, TypeError, KeyError):
        return None


@dataclass(frozen=True)
class StoreRetry:
    """One request to the store that failed and is being tried again (the store is in trouble, for now)."""

    operation: str
    """The request (``put_object``, ``upload_part``, ...)."""
    attempt: int
    """The attempt that failed (1: the first)."""
    attempts: int
    """Attempts the client makes before the request fails."""
    error: str
    """What the store answered (``503 SlowDown``), or the exception of a request that got no answer."""


class RangeReader:
    """Byte ranges of one committed file, read into given buffers (:meth:`Storage.open_ranges`).

    This one serves them from the whole file read once (any store); a store that can read ranges itself
    overrides :meth:`Storage.open_ranges`.  Safe to use from several threads at once.
    """

    def __init__(self, data: ReadBuffer | bytes) -> None:
        self._data = memoryview(data).cast("B")
        self.size = len(self._data)

    def readinto(self, offset: int, views: Sequence[memoryview]) -> int:
        """Fill ``views`` in order with the bytes from ``offset``; the bytes read (fewer at the file's end)."""
        pos = offset
        for view in views:
            n = max(0, min(len(view), self.size - pos))
            view[:n] = self._data[pos:pos + n]
            pos += n
            if n < len(view):
                break
        return pos - offset

    def close(self) -> None:
        self._data.release()


class _LocalRanges(RangeReader):
    """Ranges of a local file by ``preadv``: one scatter read per range, no intermediate buffer."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_RDONLY)
        self.size = os.fstat(self._fd).st_size

    def readinto(self, offset: int, views: Sequence[memoryview]) -> int:
        done = 0
        views = [v for v in views if len(v)]
        while views:
            n = os.preadv(self._fd, views, offset + done)
            if n == 0:
                break
            done += n
            while views and n >= len(views[0]):
                n -= len(views[0])
                views.pop(0)
            if views and n:
                views[0] = views[0][n:]
        return done

    def close(self) -> None:
        os.close(self._fd)


class Storage(ABC):
    """A checkpoint store. Every method raises :class:`StorageError` on I/O failure."""

    url: str
    ranged = False
    """Reads byte ranges without reading the whole file (:meth:`open_ranges`): a restore then reads each rank's
    own file, and a sharded rank's chunks, in place (:mod:`.placed`)."""
    shared_reads = False
    """Every rank reading one file costs about what one read does (a directory: the page cache or a shared
    filesystem): each rank then reads the replicated state itself, instead of receiving it from rank 0."""

    def observe_retries(self, report: Callable[[StoreRetry], None]) -> None:
        """Have ``report`` called (on the requesting thread) for every request the store's client retries.

        A store without retries of its own (a local directory) never calls it."""

    def check_writable(self) -> None:
        """Raise :class:`StorageError` now if saves cannot succeed (called once at start)."""

    @abstractmethod
    def claim_fence(self, claimant: Fence) -> Fence | None:
        """Take the location's fence for ``claimant``; return the previous holder.

        Raises :class:`FencedError` when a newer generation of the same launch holds it.
        """

    @abstractmethod
    def read_fence(self) -> Fence | None:
        """The current fence holder; None when the location was never claimed."""

    @abstractmethod
    def list_committed(self) -> list[str]:
        """Names of committed checkpoints, oldest step first."""

    @abstractmethod
    def begin(self, name: str, token: str) -> Staging:
        """Prepare a staging area for checkpoint ``name``; safe to call from every rank."""

    @abstractmethod
    def write_file(self, staging: Staging, relpath: str, segments: Sequence[memoryview], spec: BlockSpec) -> FileDigest:
        """Durably write the concatenated ``segments``; return their size and digests, hashed while writing."""

    @abstractmethod
    def commit(self, staging: Staging, manifest: bytes, fence: Fence | None = None) -> None:
        """Publish the staged checkpoint atomically with ``manifest``.

        Raises :class:`CommitConflictError` if ``staging.name`` is already
        committed, :class:`FencedError` (publishing nothing) if ``fence`` is
        given and the location's fence no longer holds it.
        """

    @abstractmethod
    def abort(self, staging: Staging) -> None:
        """Remove what a failed save staged (best effort, never raises)."""

    @abstractmethod
    def read_manifest(self, name: str) -> bytes:
        """Raw manifest bytes of a committed checkpoint."""

    @abstractmethod
    def read_file(self, name: str, path: str, spec: BlockSpec) -> tuple[ReadBuffer, FileDigest]:
        """Whole content of a checkpoint file and its digests, hashed while reading."""

    def open_ranges(self, name: str, path: str) -> RangeReader:
        """A reader of byte ranges of a committed checkpoint's file (FileNotFoundError when there is none).

        This default reads the file whole once; a store that reads ranges overrides it."""
        buf, _ = self.read_file(name, path, BlockSpec())
        return RangeReader(buf)

    @abstractmethod
    def quarantine(self, name: str, reason: str, fence: Fence | None = None) -> str:
        """Move a committed checkpoint out of the committed set; return where it went.

        Raises :class:`FencedError` (moving nothing) if ``fence`` is given and no longer held.
        """

    @abstractmethod
    def delete(self, name: str, fence: Fence | None = None, *, keep_pinned: bool = False) -> bool:
        """Remove a committed checkpoint; it leaves the committed set first.  ``keep_pinned`` (retention): leave
        it when it is pinned now (on a directory, checked under the lock a pin is written under); False then.

        Raises :class:`FencedError` (deleting nothing) if ``fence`` is given and no longer held.
        """

    @abstractmethod
    def collect_garbage(self, keep_token: str | None = None, fence: Fence | None = None, *,
                        min_age_s: float = 0.0) -> Garbage:
        """Remove leftovers of crashed saves and deletions (except ``keep_token``'s).

        A save written to within ``min_age_s`` may still be under way (an operator's collection, beside a live
        job): it is skipped, and reported.  Raises :class:`FencedError` (removing nothing) if ``fence`` is given
        and no longer held.
        """

    @abstractmethod
    def list_quarantined(self) -> list[str]:
        """Entries in quarantine, oldest first."""

    @abstractmethod
    def pin(self, name: str, holder: str, record: bytes) -> None:
        """Keep checkpoint ``name`` from retention until ``holder`` (an incident's id) lets go of it.  StorageError
        when ``name`` is not committed (retention deleted it first): no pin is left behind."""

    @abstractmethod
    def unpin(self, name: str, holder: str) -> bool:
        """``holder`` lets go of ``name``; False when it held no pin on it."""

    @abstractmethod
    def list_pins(self) -> dict[str, list[str]]:
        """Pinned checkpoints and their holders."""


def pieces(segments: Sequence[memoryview], size: int = WRITE_PIECE) -> list[memoryview]:
    """Split byte segments into views of at most ``size`` bytes, without copying."""
    out = []
    for seg in segments:
        view = memoryview(seg).cast("B")
        for start in range(0, len(view), size):
            out.append(view[start : start + size])
    return out


def _anonymous(size: int) -> mmap.mmap:
    """A private anonymous mapping of ``size`` bytes, its pages populated now where the OS supports it."""
    populate = getattr(mmap, "MAP_POPULATE", 0)
    if populate:
        try:
            return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate)
        except OSError:
            pass  # e.g. a lock limit: fault the pages in while reading instead
    return mmap.mmap(-1, size)


def _storage_error(action: str, path: str, e: OSError) -> StorageError:
    fix = {
        errno.ENOSPC: "free space on that filesystem or point CheckpointConfig.dir at a larger one",
        errno.EDQUOT: "raise the quota or point CheckpointConfig.dir elsewhere",
        errno.EACCES: "make the directory writable by this user or choose another CheckpointConfig.dir",
        errno.EROFS: "the filesystem is read-only; choose another CheckpointConfig.dir",
        errno.EPERM: "make the directory writable by this user or choose another CheckpointConfig.dir",
    }.get(e.errno or 0, "check the filesystem and retry")
    return StorageError(f"could not {action} {path}: {e.strerror or e} ({fix})")


class LocalStorage(Storage):
    """Checkpoints in a directory on a local or shared POSIX filesystem."""

    ranged = True
    shared_reads = True

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = os.path.abspath(os.fspath(root))
        self.url = self.root
        self._staging_root = os.path.join(self.root, ".staging")
        self._quarantine_root = os.path.join(self.root, ".quarantine")
        self._trash_root = os.path.join(self.root, ".trash")
        self._fence = LocalFence(self.root)

    def _mkdirs(self, path: str) -> None:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise _storage_error("create directory", path, e) from e

    def check_writable(self) -> None:
        self._mkdirs(self._staging_root)
        probe = os.path.join(self._staging_root, f".probe.{os.getpid()}")
        try:
            with open(probe, "wb") as f:
                f.write(b"ok")
            os.remove(probe)
        except OSError as e:
            raise _storage_error("write to", self.root, e) from e

    def claim_fence(self, claimant: Fence) -> Fence | None:
        self._mkdirs(self.root)
        return self._fence.claim(claimant)

    def read_fence(self) -> Fence | None:
        return self._fence.read()

    def list_committed(self) -> list[str]:
        try:
            entries = os.listdir(self.root)
        except FileNotFoundError:
            return []
        except OSError as e:
            raise _storage_error("list", self.root, e) from e
        names = [n for n in entries if step_of(n) is not None and os.path.isdir(os.path.join(self.root, n))]
        return sorted(names, key=lambda n: step_of(n) or 0)

    def _staging_dir(self, staging: Staging) -> str:
        return os.path.join(self._staging_root, f"{staging.name}.{staging.token}")

    def begin(self, name: str, token: str) -> Staging:
        staging = Staging(name=name, token=token, file_prefix="")
        self._mkdirs(self._staging_dir(staging))
        return staging

    def write_file(self, staging: Staging, relpath: str, segments: Sequence[memoryview], spec: BlockSpec) -> FileDigest:
        path = os.path.join(self._staging_dir(staging), relpath)
        hasher = ChunkedHasher(spec.block_bytes, hash_pool("write"), spec.algorithm)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                for piece in pieces(segments):
                    hasher.update(piece)  # hashed on the pool while we write
                    written = 0
                    while written < len(piece):
                        written += os.write(fd, piece[written:])
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            raise _storage_error("write", path, e) from e
        return hasher.result()

    def commit(self, staging: Staging, manifest: bytes, fence: Fence | None = None) -> None:
        src = self._staging_dir(staging)
        dst = os.path.join(self.root, staging.name)
        mpath = os.path.join(src, MANIFEST_FILE)
        # The fence is checked first and held until the rename is durable: a
        # newer generation cannot claim in between, and a stale writer whose
        # staging area was already collected is told why, not "file not found".
        with self._fence.held(fence, f"commit of {staging.name}"):
            self._check_staged(staging, src, manifest)
            try:
                fd = os.open(mpath, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                try:
                    os.write(fd, manifest)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                fsync_dir(src)
            except OSError as e:
                raise _storage_error("write manifest", mpath, e) from e
            if os.path.exists(dst):
                raise CommitConflictError(f"checkpoint {staging.name} is already committed at {dst}")
            try:
                os.rename(src, dst)  # the commit point
            except OSError as e:
                if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
                    raise CommitConflictError(f"checkpoint {staging.name} is already committed at {dst}") from e
                raise _storage_error("publish", dst, e) from e
            fsync_dir(self.root)

    def _check_staged(self, staging: Staging, src: str, manifest: bytes) -> None:
        """Refuse to publish a manifest whose files are not all in the staging area in full (under the lock, which
        garbage collection takes as well: what is checked here is what the rename publishes)."""
        files = staged_files(manifest)
        for path, size in (files or {}).items():
            full = os.path.join(src, path)
            try:
                have = f"{os.stat(full).st_size} bytes"
            except FileNotFoundError:
                have = "missing"
            except OSError as e:
                raise _storage_error("check", full, e) from e
            if have != f"{size} bytes":
                raise StorageError(f"refusing to commit {staging.name}: {full} is {have}, manifest says {size} bytes "
                                   "(was its staging area collected while the save ran?)")

    def abort(self, staging: Staging) -> None:
        shutil.rmtree(self._staging_dir(staging), ignore_errors=True)

    def read_manifest(self, name: str) -> bytes:
        path = os.path.join(self.root, name, MANIFEST_FILE)
        try:
            with open(path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return b""
        except OSError as e:
            raise _storage_error("read", path, e) from e

    def read_file(self, name: str, path: str, spec: BlockSpec) -> tuple[ReadBuffer, FileDigest]:
        # Read into an anonymous mapping: unlike a bytearray it is not
        # zero-filled first, and unlike a mapping of the file the bytes we
        # verify are the bytes we use (no later SIGBUS or change under us,
        # and no copy-on-write faults in the first optimizer step).  Its pages
        # are populated up front where the OS can (one call instead of a fault
        # per page inside the read: about half the time of a warm read here).
        full = os.path.join(self.root, name, path)
        hasher = ChunkedHasher(spec.block_bytes, algorithm=spec.algorithm)
        try:
            with open(full, "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                buf: ReadBuffer = _anonymous(size) if size else bytearray()
                view = memoryview(buf)
                pos = 0
                while pos < size:
                    n = f.readinto(view[pos : min(size, pos + WRITE_PIECE)])
                    if not n:
                        raise OSError(errno.EIO, "file shrank while being read")
                    hasher.update(view[pos : pos + n])  # hashed on the pool while the next piece is read
                    pos += n
                digest = hasher.result()
                view.release()
        except FileNotFoundError:
            raise
        except OSError as e:
            raise _storage_error("read", full, e) from e
        return buf, digest

    def open_ranges(self, name: str, path: str) -> RangeReader:
        full = os.path.join(self.root, name, path)
        try:
            return _LocalRanges(full)
        except FileNotFoundError:
            raise
        except OSError as e:
            raise _storage_error("read", full, e) from e

    def quarantine(self, name: str, reason: str, fence: Fence | None = None) -> str:
        self._mkdirs(self._quarantine_root)
        dst = os.path.join(self._quarantine_root, f"{name}.{time.strftime('%Y%m%dT%H%M%S')}.{os.getpid()}")
        with self._fence.held(fence, f"quarantine of {name}"):
            return self._quarantine(name, reason, dst)

    def _quarantine(self, name: str, reason: str, dst: str) -> str:
        try:
            os.rename(os.path.join(self.root, name), dst)
            fsync_dir(self.root)
            with open(os.path.join(dst, "QUARANTINE.json"), "w", encoding="utf-8") as f:
                json.dump({"checkpoint": name, "reason": reason, "time_unix": time.time()}, f, indent=1)
        except OSError as e:
            raise _storage_error("quarantine", name, e) from e
        return dst

    def delete(self, name: str, fence: Fence | None = None, *, keep_pinned: bool = False) -> bool:
        self._mkdirs(self._trash_root)
        trash = os.path.join(self._trash_root, f"{name}.{os.getpid()}.{time.monotonic_ns()}")
        with self._fence.held(fence, f"deletion of {name}"):
            if keep_pinned and self.list_pins().get(name):
                return False  # pinned after retention read the pins: a pin is written under this lock too
            try:
                os.rename(os.path.join(self.root, name), trash)  # leaves the committed set atomically
                fsync_dir(self.root)
            except OSError as e:
                raise _storage_error("delete", name, e) from e
        shutil.rmtree(trash, ignore_errors=True)
        return True

    def collect_garbage(self, keep_token: str | None = None, fence: Fence | None = None, *,
                        min_age_s: float = 0.0) -> Garbage:
        # Under the lock, a staging area leaves .staging/ by a rename (a commit, under the same lock, then fails
        # on its missing files instead of publishing them half deleted); the files go after the lock is released.
        doomed: list[tuple[str, str]] = []
        skipped: list[tuple[str, str]] = []
        with self._fence.held(fence, "garbage collection"):
            for entry in _entries(self._trash_root):
                doomed.append((os.path.join(".trash", entry), os.path.join(self._trash_root, entry)))
            now = self._fs_now() if min_age_s > 0 else 0.0
            staged: list[tuple[str, str]] = []
            for entry in _entries(self._staging_root):
                if keep_token is not None and entry.endswith("." + keep_token):
                    continue
                shown, path = os.path.join(".staging", entry), os.path.join(self._staging_root, entry)
                if min_age_s > 0:
                    age = now - _newest_mtime(path)
                    if age < min_age_s:
                        skipped.append((shown, f"written {max(0.0, age):.0f} s ago, within the minimum age of "
                                               f"{min_age_s:g} s: a save may be under way"))
                        continue
                moved = os.path.join(self._trash_root, f"{entry}.gc.{os.getpid()}.{time.monotonic_ns()}")
                try:
                    self._mkdirs(self._trash_root)
                    os.rename(path, moved)
                except FileNotFoundError:
                    continue  # gone meanwhile (its job aborted it)
                except OSError as e:
                    raise _storage_error("collect", path, e) from e
                staged.append((shown, moved))
            doomed = staged + doomed
        for _, path in doomed:
            shutil.rmtree(path, ignore_errors=True)
        return Garbage(removed=tuple(shown for shown, _ in doomed), skipped=tuple(skipped))

    def _fs_now(self) -> float:
        """The file system's clock (a probe file's mtime), which the staging areas' ages are measured on."""
        probe = os.path.join(self._staging_root, f".clock.{os.getpid()}.{time.monotonic_ns()}")
        try:
            with open(probe, "wb"):
                pass
            try:
                return os.stat(probe).st_mtime
            finally:
                os.remove(probe)
        except FileNotFoundError:
            return time.time()  # no staging area at all: nothing is measured against it
        except OSError as e:
            raise _storage_error("write to", self._staging_root, e) from e

    def list_quarantined(self) -> list[str]:
        try:
            return sorted(os.listdir(self._quarantine_root))
        except FileNotFoundError:
            return []

    def pin(self, name: str, holder: str, record: bytes) -> None:
        path = os.path.join(self.root, PINS_DIR, name, f"{holder}.json")
        with self._fence.held(None, f"pin of {name}"):  # no retention deletion in between (it checks pins under it)
            if not os.path.isfile(os.path.join(self.root, name, MANIFEST_FILE)):
                raise StorageError(f"cannot pin {name}: it is not committed in {self.root} (retention deleted it?)")
            self._mkdirs(os.path.dirname(path))
            try:
                write_text_atomic(path, record.decode())
            except OSError as e:
                raise _storage_error("pin", name, e) from e

    def unpin(self, name: str, holder: str) -> bool:
        path = os.path.join(self.root, PINS_DIR, name, f"{holder}.json")
        try:
            os.remove(path)
        except FileNotFoundError:
            return False
        except OSError as e:
            raise _storage_error("unpin", name, e) from e
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(path))  # the last holder's: the checkpoint is no longer pinned
        return True

    def list_pins(self) -> dict[str, list[str]]:
        root = os.path.join(self.root, PINS_DIR)
        try:
            names = os.listdir(root)
        except FileNotFoundError:
            return {}
        except OSError as e:
            raise _storage_error("list the pins of", self.root, e) from e
        pins = {n: sorted(h[:-len(".json")] for h in os.listdir(os.path.join(root, n)) if h.endswith(".json"))
                for n in names if os.path.isdir(os.path.join(root, n))}
        return {n: holders for n, holders in pins.items() if holders}


def _entries(parent: str) -> list[str]:
    try:
        return sorted(e for e in os.listdir(parent) if not e.startswith(".clock."))
    except FileNotFoundError:
        return []


def _newest_mtime(path: str) -> float:
    """The newest modification time in a tree (its directories' and files'): when a save last wrote to it."""
    newest = 0.0
    for root, dirs, files in os.walk(path):
        for name in (root, *(os.path.join(root, n) for n in (*dirs, *files))):
            with contextlib.suppress(FileNotFoundError):
                newest = max(newest, os.lstat(name).st_mtime)
    return newest
