"""The S3 backend: checkpoints as objects under ``s3://bucket/prefix``.

Layout (``PREFIX`` may be empty)::

    PREFIX/step_0000000100/manifest.json         commit point of the checkpoint
    PREFIX/step_0000000100/TOKEN/rank_00000.bin  data written by the save attempt TOKEN
    PREFIX/.quarantine/step_0000000150.TS.PID/   copy of a checkpoint that failed verification
    PREFIX/fence.json                            who may write here (see :mod:`.fence`)

S3 has no rename, so a checkpoint is committed by a conditional PUT of its
manifest (``If-None-Match: *``) once every data object is uploaded: exactly
one writer can create it, and readers never see a manifest whose files are
missing.  Data objects live under the attempt's token, so two attempts at
the same step never overwrite each other; whatever a crashed attempt left
behind is found by :meth:`S3Storage.collect_garbage`.  Deleting and
quarantining remove the manifest before anything else, so a checkpoint
leaves the committed set in one step.

S3 has no lock either, so the fence check around a commit is read, PUT,
read again: a commit whose fence moved before the PUT publishes nothing; one
whose fence moved between the first read and the re-read deletes the
manifest it just put (and says so).  What remains is a window, from that
PUT to that delete, in which a reader can list the stale checkpoint, and a
stale writer that dies inside it leaves its manifest behind.  Deletes and
garbage collection read the fence before touching anything, so a claim that
lands during one of them is noticed only by the next.

A restore reads byte ranges (:meth:`S3Storage.open_ranges`: one ranged GET
per block, conditional on the object's ETag), so a rank reads its own file
in place and only the blocks of a peer's file that hold its chunks; the
replicated state is still read once, by rank 0, and sent to the others
(every rank's GET of it would multiply the transfer by the world size).

boto3 is imported only when an S3 location is opened; every boto3/botocore
failure surfaces as :class:`StorageError` naming the object and a fix.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

from ..core.errors import CommitConflictError, StorageError
from .digest import BlockSpec, ChunkedHasher, FileDigest, hash_pool
from .fence import Fence, check_claim, fence_moved, parse_fence, refused
from .manifest import MANIFEST_FILE, step_of
from .s3_client import ABSENT, CONFLICT, S3Bucket
from .s3_support import ViewsReader, group_views
from .storage import PINS_DIR, Garbage, RangeReader, Staging, Storage, pieces, staged_files

MULTIPART_THRESHOLD = 16 << 20  # larger objects go up as parallel multipart parts
PART_BYTES = 8 << 20  # smallest part we build; S3's minimum is 5 MiB (except the last)
MAX_PARTS = 10_000  # S3's limit per upload
RANGE_BYTES = 32 << 20  # reads above 2x this use parallel ranged GETs
WORKERS = 4
QUARANTINE_DIR = ".quarantine"
QUARANTINE_FILE = "QUARANTINE.json"
FENCE_OBJECT = "fence.json"


def _referenced_tokens(raw: bytes) -> set[str] | None:
    """First path segments of a manifest's files (the tokens), or None if it does not parse."""
    try:
        return {str(f["path"]).split("/", 1)[0] for f in json.loads(raw)["files"]}
    except (ValueError, TypeError, KeyError):
        return None


class _S3Ranges(RangeReader):
    """Ranges of one object by ranged GETs, each conditional on the ETag it had when opened."""

    def __init__(self, store: S3Storage, key: str, size: int, etag: str) -> None:
        self._store, self._key, self._etag = store, key, etag
        self.size = size

    def readinto(self, offset: int, views: Sequence[memoryview]) -> int:
        views = [v for v in views if len(v)]
        want = min(sum(len(v) for v in views), self.size - offset)
        if want <= 0:
            return 0
        if len(views) == 1 and want == len(views[0]):
            self._store._fetch(self._key, self._etag, views[0], offset)  # straight into its place
            return want
        got = bytearray(want)
        self._store._fetch(self._key, self._etag, memoryview(got), offset)
        pos = 0
        for view in views:
            n = min(len(view), want - pos)
            view[:n] = memoryview(got)[pos:pos + n]
            pos += n
        return want

    def close(self) -> None:
        pass


class S3Storage(S3Bucket, Storage):
    """Checkpoints in an S3 (or S3-compatible) bucket; see the module docstring for the layout."""

    ranged = True

    def _has_manifest(self, name: str) -> bool:
        key = self._key(name, MANIFEST_FILE)
        return self._call("head_object", key, absent=ABSENT, Key=key) is not None

    # --------------------------------------------------------------- write
    def check_writable(self) -> None:
        # A real write, not a HEAD: it proves the bucket exists and that these
        # credentials may write there, before the first save depends on it.
        key = f"{self._root}.probe-{uuid.uuid4().hex[:12]}"
        self._call("put_object", key, Key=key, Body=b"ok")
        self._call("delete_object", key, Key=key)

    def _fence_key(self) -> str:
        return f"{self._root}{FENCE_OBJECT}"

    def read_fence(self) -> Fence | None:
        key = self._fence_key()
        resp = self._call("get_object", key, absent=ABSENT, Key=key)
        if resp is None:
            return None
        return parse_fence(resp["Body"].read(), self._where(key))

    def claim_fence(self, claimant: Fence) -> Fence | None:
        holder = self.read_fence()
        check_claim(holder, claimant, self.url)
        if holder != claimant:
            key = self._fence_key()
            body = json.dumps(claimant.to_json()).encode()
            self._call("put_object", key, Key=key, Body=body, ContentType="application/json")
        return holder

    def _check_fence(self, fence: Fence | None, action: str) -> None:
        if fence is None:
            return
        holder = self.read_fence()
        if fence_moved(holder, fence):
            raise refused(action, holder, fence, self.url)

    def list_committed(self) -> list[str]:
        names = [n for n in self._ls(self._root)[1] if step_of(n) is not None]
        with ThreadPoolExecutor(8, thread_name_prefix="resilient-s3") as pool:
            present = list(pool.map(self._has_manifest, names))
        return sorted((n for n, ok in zip(names, present) if ok), key=lambda n: step_of(n) or 0)

    def begin(self, name: str, token: str) -> Staging:
        if not token or "/" in token:
            raise StorageError(f"invalid save token {token!r}")
        return Staging(name=name, token=token, file_prefix=f"{token}/")  # nothing to create on S3

    def write_file(self, staging: Staging, relpath: str, segments: Sequence[memoryview], spec: BlockSpec) -> FileDigest:
        key = self._key(staging.name, staging.file_prefix + relpath)
        views = pieces(segments)
        hasher = ChunkedHasher(spec.block_bytes, hash_pool("write"), spec.algorithm)
        if sum(len(v) for v in views) <= MULTIPART_THRESHOLD:
            for v in views:
                hasher.update(v)
            self._call("put_object", key, Key=key, Body=ViewsReader(views))
        else:
            self._multipart_upload(key, views, hasher)
        return hasher.result()

    def _multipart_upload(self, key: str, views: list[memoryview], hasher: ChunkedHasher) -> None:
        size = sum(len(v) for v in views)
        target = max(PART_BYTES, -(-size // MAX_PARTS))
        upload_id = self._call("create_multipart_upload", key, Key=key)["UploadId"]
        pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="resilient-s3")
        try:
            futures = []
            for number, part in enumerate(group_views(views, target), start=1):
                futures.append(pool.submit(self._upload_part, key, upload_id, number, part))
                for v in part:
                    hasher.update(v)  # hashing overlaps the parts already uploading
            wait(futures, return_when=FIRST_EXCEPTION)
            etags = [f.result() for f in futures]  # raises the first failure
            pool.shutdown()
            parts = [{"PartNumber": n, "ETag": etag} for n, etag in enumerate(etags, start=1)]
            self._call("complete_multipart_upload", key, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts})
        except BaseException:
            # Stop queued parts and let running ones finish first, so none lands after the abort.
            pool.shutdown(wait=True, cancel_futures=True)
            with contextlib.suppress(StorageError):  # collect_garbage retries; the first error matters more
                self._abort_upload(key, upload_id)
            raise

    def _upload_part(self, key: str, upload_id: str, number: int, part: list[memoryview]) -> str:
        resp = self._call("upload_part", key, Key=key, UploadId=upload_id, PartNumber=number, Body=ViewsReader(part))
        return str(resp["ETag"])

    def _check_staged(self, staging: Staging, manifest: bytes) -> None:
        """Refuse to publish a manifest whose files are not all uploaded in full."""
        named = staged_files(manifest)
        if named is None:
            return  # not ours to validate; readers run parse_manifest
        files = {self._key(staging.name, path): size for path, size in named.items()}
        stored = dict(self._objects(self._key(staging.name) + "/"))
        for key, size in files.items():
            if stored.get(key) != size:
                have = "missing" if key not in stored else f"{stored[key]} bytes"
                raise StorageError(
                    f"refusing to commit {staging.name}: {self._where(key)} is {have}, manifest says {size} bytes"
                )

    def commit(self, staging: Staging, manifest: bytes, fence: Fence | None = None) -> None:
        key = self._key(staging.name, MANIFEST_FILE)
        self._check_fence(fence, f"commit of {staging.name}")
        self._check_staged(staging, manifest)
        done = self._call(
            "put_object", key, absent=CONFLICT, Key=key, Body=manifest, IfNoneMatch="*", ContentType="application/json"
        )
        if done is None and self.read_manifest(staging.name) != manifest:
            # An identical manifest means our own first attempt landed and the SDK retried it.
            raise CommitConflictError(f"checkpoint {staging.name} is already committed at {self._where(key)}")
        if fence is None:
            return
        holder = self.read_fence()
        if fence_moved(holder, fence):
            # A newer generation claimed the location while we published: take it back.
            self._call("delete_object", key, Key=key)
            raise refused(
                f"commit of {staging.name} (its manifest was published, then deleted again)", holder, fence, self.url
            )

    def abort(self, staging: Staging) -> None:
        with contextlib.suppress(Exception):  # best effort by contract; collect_garbage finishes the job
            tokens = _referenced_tokens(self.read_manifest(staging.name))
            if tokens is not None and staging.token in tokens:
                return  # the commit landed after all (e.g. its response was lost): keep it
            prefix = self._key(staging.name, staging.file_prefix)
            self._delete_keys([k for k, _ in self._objects(prefix)])
            self._abort_uploads(prefix)

    # ---------------------------------------------------------------- read
    def read_manifest(self, name: str) -> bytes:
        key = self._key(name, MANIFEST_FILE)
        resp = self._call("get_object", key, absent=ABSENT, Key=key)
        if resp is None:
            return b""
        buf = bytearray(resp["ContentLength"])
        self._fetch(key, resp["ETag"], memoryview(buf), 0, resp["Body"])
        return bytes(buf)

    def open_ranges(self, name: str, path: str) -> RangeReader:
        key = self._key(name, path)
        head = self._call("head_object", key, absent=ABSENT, Key=key)
        if head is None:
            raise FileNotFoundError(errno.ENOENT, f"no such object {self._where(key)}")
        return _S3Ranges(self, key, int(head["ContentLength"]), str(head["ETag"]))

    def read_file(self, name: str, path: str, spec: BlockSpec) -> tuple[bytearray, FileDigest]:
        key = self._key(name, path)
        resp = self._call("get_object", key, absent=ABSENT, Key=key)
        if resp is None:
            raise FileNotFoundError(errno.ENOENT, f"no such object {self._where(key)}")
        size, etag = int(resp["ContentLength"]), str(resp["ETag"])
        buf = bytearray(size)
        view = memoryview(buf)
        hasher = ChunkedHasher(spec.block_bytes, algorithm=spec.algorithm)
        if size <= 2 * RANGE_BYTES:
            self._fetch(key, etag, view, 0, resp["Body"])
            hasher.update(view)
            return buf, hasher.result()
        # Big object: the open response streams the first range while ranged GETs
        # fetch the rest in parallel; ranges are hashed in order as they arrive.
        bounds = [(s, min(size, s + RANGE_BYTES)) for s in range(0, size, RANGE_BYTES)]
        with ThreadPoolExecutor(WORKERS, thread_name_prefix="resilient-s3") as pool:
            futures = [
                pool.submit(self._fetch, key, etag, view[s:e], s, resp["Body"] if s == 0 else None) for s, e in bounds
            ]
            try:
                for (s, e), future in zip(bounds, futures):
                    future.result()
                    hasher.update(view[s:e])
            except BaseException:
                pool.shutdown(wait=True, cancel_futures=True)
                raise
        return buf, hasher.result()

    # ----------------------------------------------------- remove and move
    def quarantine(self, name: str, reason: str, fence: Fence | None = None) -> str:
        self._check_fence(fence, f"quarantine of {name}")
        if not self._has_manifest(name):
            raise StorageError(f"cannot quarantine {name}: it is not committed in {self.url}")
        entry = f"{name}.{time.strftime('%Y%m%dT%H%M%S')}.{os.getpid()}"
        src, dst = self._key(name) + "/", f"{self._root}{QUARANTINE_DIR}/{entry}/"
        objects = self._objects(src)
        with ThreadPoolExecutor(WORKERS, thread_name_prefix="resilient-s3") as pool:
            for future in [pool.submit(self._copy, k, dst + k[len(src) :], size) for k, size in objects]:
                future.result()
        note = json.dumps({"checkpoint": name, "reason": reason, "time_unix": time.time()}, indent=1).encode()
        self._call(
            "put_object", dst + QUARANTINE_FILE, Key=dst + QUARANTINE_FILE, Body=note, ContentType="application/json"
        )
        manifest = src + MANIFEST_FILE
        self._call("delete_object", manifest, Key=manifest)  # leaves the committed set here
        self._delete_keys([k for k, _ in objects if k != manifest])
        return self._where(dst)

    def delete(self, name: str, fence: Fence | None = None, *, keep_pinned: bool = False) -> bool:
        self._check_fence(fence, f"deletion of {name}")
        if keep_pinned and self._ls(f"{self._root}{PINS_DIR}/{name}/")[0]:
            return False  # pinned after retention read the pins (read again just before: S3 has no lock)
        manifest = self._key(name, MANIFEST_FILE)
        committed = self._has_manifest(name)
        if committed:
            self._call("delete_object", manifest, Key=manifest)  # leaves the committed set atomically
        rest = [k for k, _ in self._objects(self._key(name) + "/")]
        if not committed and not rest:
            raise StorageError(f"cannot delete {name}: there is no such checkpoint in {self.url}")
        self._delete_keys(rest)
        return True

    def collect_garbage(self, keep_token: str | None = None, fence: Fence | None = None, *,
                        min_age_s: float = 0.0) -> Garbage:
        # S3 has no lock to take: a save in progress is told apart by its age (its newest object's LastModified;
        # S3 refuses requests from a clock more than 15 minutes off, so this host's clock is close enough).
        self._check_fence(fence, "garbage collection")
        removed: list[str] = []
        skipped: list[tuple[str, str]] = []
        now = time.time()

        def young(shown: str, written: list[float]) -> bool:
            age = now - max(written, default=0.0)
            if min_age_s > 0 and age < min_age_s:
                skipped.append((shown, f"written {max(0.0, age):.0f} s ago, within the minimum age of {min_age_s:g} s: "
                                       "a save may be under way"))
                return True
            return False

        for name in (n for n in self._ls(self._root)[1] if step_of(n) is not None):
            raw = self.read_manifest(name)
            keep = _referenced_tokens(raw) if raw else set()
            if keep is None:
                continue  # unreadable manifest: leave it whole for verification to quarantine
            if keep_token is not None:
                keep.add(keep_token)
            keys, tokens = self._ls(self._key(name) + "/")
            if not raw and keys:  # stray objects of an uncommitted name (e.g. a half-finished delete)
                if not young(f"{name}/ (objects outside a save)", list(self._written(self._key(name) + "/").values())):
                    self._delete_keys(keys)
                    removed += [key[len(self._root) :] for key in keys]
            for token in tokens:
                if token in keep:
                    continue
                written = self._written(self._key(name, token) + "/")
                if young(f"{name}/{token}/", list(written.values())):
                    continue
                self._delete_keys(list(written))
                removed.append(f"{name}/{token}/")
        aborted, busy = self._abort_uploads(self._root, keep_token, min_age_s=min_age_s, now=now)
        return Garbage(removed=tuple(removed + aborted), skipped=tuple(skipped + busy))

    def list_quarantined(self) -> list[str]:
        return sorted(self._ls(f"{self._root}{QUARANTINE_DIR}/")[1])

    def _pin_key(self, name: str, holder: str) -> str:
        return f"{self._root}{PINS_DIR}/{name}/{holder}.json"

    def pin(self, name: str, holder: str, record: bytes) -> None:
        key = self._pin_key(name, holder)
        self._call("put_object", key, Key=key, Body=record, ContentType="application/json")
        if not self._has_manifest(name):  # retention deleted it first: leave no pin of nothing behind
            self._call("delete_object", key, Key=key)
            raise StorageError(f"cannot pin {name}: it is not committed in {self.url} (retention deleted it?)")

    def unpin(self, name: str, holder: str) -> bool:
        key = self._pin_key(name, holder)
        if self._call("head_object", key, absent=ABSENT, Key=key) is None:
            return False
        self._call("delete_object", key, Key=key)
        return True

    def list_pins(self) -> dict[str, list[str]]:
        prefix = f"{self._root}{PINS_DIR}/"
        pins: dict[str, list[str]] = {}
        for key, _ in self._objects(prefix):
            name, _, holder = key[len(prefix):].partition("/")
            if holder.endswith(".json"):
                pins.setdefault(name, []).append(holder[:-len(".json")])
        return {name: sorted(holders) for name, holders in pins.items()}
