"""The S3 backend: checkpoints as objects under ``s3://bucket/prefix``.

Layout (``PREFIX`` may be empty)::

    PREFIX/step_0000000100/manifest.json         commit point of the checkpoint
    PREFIX/step_0000000100/TOKEN/rank_00000.bin  data written by the save attempt TOKEN
    PREFIX/.quarantine/step_0000000150.TS.PID/   copy of a checkpoint that failed verification

S3 has no rename, so a checkpoint is committed by a conditional PUT of its
manifest (``If-None-Match: *``) once every data object is uploaded: exactly
one writer can create it, and readers never see a manifest whose files are
missing.  Data objects live under the attempt's token, so two attempts at
the same step never overwrite each other; whatever a crashed attempt left
behind is found by :meth:`S3Storage.collect_garbage`.  Deleting and
quarantining remove the manifest before anything else, so a checkpoint
leaves the committed set in one step.

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
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any

from ..errors import CommitConflictError, StorageError
from .digest import ChunkedHasher, hash_pool
from .manifest import MANIFEST_FILE, step_of
from .s3_support import ViewsReader, group_views, import_boto, parse_url
from .storage import Staging, Storage, pieces

MULTIPART_THRESHOLD = 16 << 20  # larger objects go up as parallel multipart parts
PART_BYTES = 8 << 20  # smallest part we build; S3's minimum is 5 MiB (except the last)
MAX_PARTS = 10_000  # S3's limit per upload
RANGE_BYTES = 32 << 20  # reads above 2x this use parallel ranged GETs
COPY_LIMIT = 5 << 30  # copy_object's limit; larger objects are copied part by part
COPY_PART_BYTES = 512 << 20
WORKERS = 4
LIST_PAGE = 1000
READ_ATTEMPTS = 3  # a body that breaks mid-stream is fetched again (the SDK retries only the request)
QUARANTINE_DIR = ".quarantine"
QUARANTINE_FILE = "QUARANTINE.json"
_ABSENT = ("NoSuchKey", "404", "NotFound")
_CONFLICT = ("PreconditionFailed", "ConditionalRequestConflict", "412", "409")
_AUTH = ("AccessDenied", "403", "Forbidden", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken")


def _code(e: Any) -> str:
    return str(e.response.get("Error", {}).get("Code", "?"))


def _referenced_tokens(raw: bytes) -> set[str] | None:
    """First path segments of a manifest's files (the tokens), or None if it does not parse."""
    try:
        return {str(f["path"]).split("/", 1)[0] for f in json.loads(raw)["files"]}
    except (ValueError, TypeError, KeyError):
        return None


class S3Storage(Storage):
    """Checkpoints in an S3 (or S3-compatible) bucket; see the module docstring for the layout."""

    def __init__(
        self,
        url: str,
        *,
        endpoint_url: str | None = None,
        connect_timeout: float = 10.0,
        read_timeout: float = 120.0,
        max_attempts: int = 5,
    ) -> None:
        self.bucket, self.prefix = parse_url(url)
        self.url = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        self._root = f"{self.prefix}/" if self.prefix else ""
        boto3, Config = import_boto()
        config = Config(
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            retries={"max_attempts": max_attempts, "mode": "standard"},
            max_pool_connections=16,
            # Our own chunked SHA-256 is verified on every restore; the SDK's newer
            # default CRC headers are rejected by several S3-compatible stores.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            # Custom endpoints (MinIO, Ceph, moto) rarely serve virtual-host buckets.
            s3={"addressing_style": "path"} if endpoint_url else None,
        )
        try:
            session = boto3.session.Session()
            self._client = session.client(
                "s3", region_name=session.region_name or "us-east-1", endpoint_url=endpoint_url, config=config
            )
        except Exception as e:  # bad endpoint URL, broken AWS config file, ...
            raise StorageError(
                f"cannot set up an S3 client for {self.url}: {e} (check endpoint_url and the AWS config)"
            ) from e

    # ------------------------------------------------------------ plumbing
    def _key(self, name: str, path: str = "") -> str:
        return f"{self._root}{name}/{path}" if path else f"{self._root}{name}"

    def _where(self, key: str | None) -> str:
        return f"s3://{self.bucket}/{key}" if key is not None else f"s3://{self.bucket}"

    def _error(self, action: str, key: str | None, e: Exception) -> StorageError:
        import botocore.exceptions as bx

        where = self._where(key)
        if isinstance(e, bx.ClientError):
            code, message = _code(e), e.response.get("Error", {}).get("Message", e)
            if code == "NoSuchBucket":
                why = f"bucket {self.bucket} does not exist; create it or fix CheckpointConfig.dir"
            elif code in _AUTH:
                why = (
                    f"access denied ({code}); check the AWS credentials (AWS_PROFILE, AWS_ACCESS_KEY_ID, "
                    f"instance role) and that they may read, write and list bucket {self.bucket}"
                )
            else:
                why = f"S3 error {code}: {message}; check the bucket, prefix and permissions"
        elif isinstance(e, (bx.NoCredentialsError, bx.PartialCredentialsError)):
            why = f"{e}; set AWS_PROFILE or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, or run with an instance role"
        elif isinstance(e, (bx.ConnectionError, bx.HTTPClientError)):
            why = (
                f"cannot reach S3 at {self._client.meta.endpoint_url} ({e}); check CheckpointConfig.endpoint_url, "
                "the network and proxy settings"
            )
        else:
            why = f"{type(e).__name__}: {e}"
        return StorageError(f"S3 {action} of {where} failed: {why}")

    def _call(self, op: str, key: str | None = None, *, absent: tuple[str, ...] = (), **kwargs: Any) -> Any:
        """One S3 request; None if it fails with a code in ``absent``, StorageError on any other failure."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return getattr(self._client, op)(Bucket=self.bucket, **kwargs)
        except ClientError as e:
            if _code(e) in absent:
                return None
            raise self._error(op, key, e) from e
        except BotoCoreError as e:
            raise self._error(op, key, e) from e

    def _pages(self, op: str, prefix: str, **kwargs: Any) -> Iterator[dict[str, Any]]:
        from botocore.exceptions import BotoCoreError, ClientError

        pages = self._client.get_paginator(op).paginate(
            Bucket=self.bucket, Prefix=prefix, PaginationConfig={"PageSize": LIST_PAGE}, **kwargs
        )
        try:
            yield from pages
        except (BotoCoreError, ClientError) as e:
            raise self._error("list", prefix, e) from e

    def _objects(self, prefix: str) -> list[tuple[str, int]]:
        """(key, size) of every object under ``prefix``."""
        return [(o["Key"], o["Size"]) for p in self._pages("list_objects_v2", prefix) for o in p.get("Contents", [])]

    def _ls(self, prefix: str) -> tuple[list[str], list[str]]:
        """Keys directly under ``prefix`` and names of its "subdirectories"."""
        keys, dirs = [], []
        for page in self._pages("list_objects_v2", prefix, Delimiter="/"):
            keys += [o["Key"] for o in page.get("Contents", [])]
            dirs += [p["Prefix"][len(prefix) :].rstrip("/") for p in page.get("CommonPrefixes", [])]
        return keys, dirs

    def _delete_keys(self, keys: Sequence[str]) -> None:
        for start in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            batch = keys[start : start + 1000]
            resp = self._call(
                "delete_objects", batch[0], Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True}
            )
            if resp.get("Errors"):
                err = resp["Errors"][0]
                raise StorageError(
                    f"could not delete {len(resp['Errors'])} objects, e.g. {self._where(err.get('Key'))}: "
                    f"{err.get('Code')} {err.get('Message')}; check that the credentials allow s3:DeleteObject"
                )

    def _abort_uploads(self, prefix: str, keep_token: str | None = None) -> list[str]:
        removed = []
        for page in self._pages("list_multipart_uploads", prefix):
            for up in page.get("Uploads", []):
                rel = up["Key"][len(self._root) :]
                if keep_token is not None and rel.split("/")[1:2] == [keep_token]:
                    continue
                self._abort_upload(up["Key"], up["UploadId"])
                removed.append(f"{rel} (incomplete multipart upload)")
        return removed

    def _abort_upload(self, key: str, upload_id: str) -> None:
        self._call("abort_multipart_upload", key, absent=("NoSuchUpload",), Key=key, UploadId=upload_id)

    def _has_manifest(self, name: str) -> bool:
        key = self._key(name, MANIFEST_FILE)
        return self._call("head_object", key, absent=_ABSENT, Key=key) is not None

    # --------------------------------------------------------------- write
    def check_writable(self) -> None:
        # A real write, not a HEAD: it proves the bucket exists and that these
        # credentials may write there, before the first save depends on it.
        key = f"{self._root}.probe-{uuid.uuid4().hex[:12]}"
        self._call("put_object", key, Key=key, Body=b"ok")
        self._call("delete_object", key, Key=key)

    def list_committed(self) -> list[str]:
        names = [n for n in self._ls(self._root)[1] if step_of(n) is not None]
        with ThreadPoolExecutor(8, thread_name_prefix="resilient-s3") as pool:
            present = list(pool.map(self._has_manifest, names))
        return sorted((n for n, ok in zip(names, present) if ok), key=lambda n: step_of(n) or 0)

    def begin(self, name: str, token: str) -> Staging:
        if not token or "/" in token:
            raise StorageError(f"invalid save token {token!r}")
        return Staging(name=name, token=token, file_prefix=f"{token}/")  # nothing to create on S3

    def write_file(
        self, staging: Staging, relpath: str, segments: Sequence[memoryview], chunk_bytes: int
    ) -> tuple[int, str]:
        key = self._key(staging.name, staging.file_prefix + relpath)
        views = pieces(segments)
        hasher = ChunkedHasher(chunk_bytes, hash_pool("write"))
        if sum(len(v) for v in views) <= MULTIPART_THRESHOLD:
            for v in views:
                hasher.update(v)
            self._call("put_object", key, Key=key, Body=ViewsReader(views))
        else:
            self._multipart_upload(key, views, hasher)
        return hasher.size, hasher.hexdigest()

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
        try:
            files = {self._key(staging.name, str(f["path"])): int(f["size"]) for f in json.loads(manifest)["files"]}
        except (ValueError, TypeError, KeyError):
            return  # not ours to validate; readers run parse_manifest
        stored = dict(self._objects(self._key(staging.name) + "/"))
        for key, size in files.items():
            if stored.get(key) != size:
                have = "missing" if key not in stored else f"{stored[key]} bytes"
                raise StorageError(
                    f"refusing to commit {staging.name}: {self._where(key)} is {have}, manifest says {size} bytes"
                )

    def commit(self, staging: Staging, manifest: bytes) -> None:
        key = self._key(staging.name, MANIFEST_FILE)
        self._check_staged(staging, manifest)
        done = self._call(
            "put_object", key, absent=_CONFLICT, Key=key, Body=manifest, IfNoneMatch="*", ContentType="application/json"
        )
        if done is None and self.read_manifest(staging.name) != manifest:
            # An identical manifest means our own first attempt landed and the SDK retried it.
            raise CommitConflictError(f"checkpoint {staging.name} is already committed at {self._where(key)}")

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
        resp = self._call("get_object", key, absent=_ABSENT, Key=key)
        if resp is None:
            return b""
        buf = bytearray(resp["ContentLength"])
        self._fetch(key, resp["ETag"], memoryview(buf), 0, resp["Body"])
        return bytes(buf)

    def read_file(self, name: str, path: str, chunk_bytes: int) -> tuple[bytearray, str]:
        key = self._key(name, path)
        resp = self._call("get_object", key, absent=_ABSENT, Key=key)
        if resp is None:
            raise FileNotFoundError(errno.ENOENT, f"no such object {self._where(key)}")
        size, etag = int(resp["ContentLength"]), str(resp["ETag"])
        buf = bytearray(size)
        view = memoryview(buf)
        hasher = ChunkedHasher(chunk_bytes)
        if size <= 2 * RANGE_BYTES:
            self._fetch(key, etag, view, 0, resp["Body"])
            hasher.update(view)
            return buf, hasher.hexdigest()
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
        return buf, hasher.hexdigest()

    def _fetch(self, key: str, etag: str, dest: memoryview, start: int, body: Any = None) -> None:
        """Fill ``dest`` with the object's bytes from ``start``, from ``body`` or a ranged GET."""
        from botocore.exceptions import BotoCoreError

        for attempt in range(READ_ATTEMPTS):
            if body is None:
                rng = f"bytes={start}-{start + len(dest) - 1}"
                body = self._call("get_object", key, Key=key, Range=rng, IfMatch=etag)["Body"]
            pos = 0
            try:
                while pos < len(dest):
                    chunk = body.read(min(1 << 20, len(dest) - pos))
                    if not chunk:
                        raise StorageError(
                            f"{self._where(key)} ended after {start + pos} bytes; it changed while being read, retry"
                        )
                    dest[pos : pos + len(chunk)] = chunk
                    pos += len(chunk)
                return
            except BotoCoreError as e:
                if attempt + 1 == READ_ATTEMPTS:
                    raise self._error("read", key, e) from e
            finally:
                body.close()
                body = None

    # ----------------------------------------------------- remove and move
    def quarantine(self, name: str, reason: str) -> str:
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

    def _copy(self, src: str, dst: str, size: int) -> None:
        source = {"Bucket": self.bucket, "Key": src}
        if size <= COPY_LIMIT:
            self._call("copy_object", dst, Key=dst, CopySource=source)
            return
        upload_id = self._call("create_multipart_upload", dst, Key=dst)["UploadId"]
        try:
            parts = []
            for number, s in enumerate(range(0, size, COPY_PART_BYTES), start=1):
                rng = f"bytes={s}-{min(size, s + COPY_PART_BYTES) - 1}"
                part = {"UploadId": upload_id, "PartNumber": number, "CopySource": source, "CopySourceRange": rng}
                resp = self._call("upload_part_copy", dst, Key=dst, **part)
                parts.append({"PartNumber": number, "ETag": resp["CopyPartResult"]["ETag"]})
            self._call("complete_multipart_upload", dst, Key=dst, UploadId=upload_id, MultipartUpload={"Parts": parts})
        except BaseException:
            with contextlib.suppress(StorageError):
                self._abort_upload(dst, upload_id)
            raise

    def delete(self, name: str) -> None:
        manifest = self._key(name, MANIFEST_FILE)
        committed = self._has_manifest(name)
        if committed:
            self._call("delete_object", manifest, Key=manifest)  # leaves the committed set atomically
        rest = [k for k, _ in self._objects(self._key(name) + "/")]
        if not committed and not rest:
            raise StorageError(f"cannot delete {name}: there is no such checkpoint in {self.url}")
        self._delete_keys(rest)

    def collect_garbage(self, keep_token: str | None = None) -> list[str]:
        removed = []
        for name in (n for n in self._ls(self._root)[1] if step_of(n) is not None):
            raw = self.read_manifest(name)
            keep = _referenced_tokens(raw) if raw else set()
            if keep is None:
                continue  # unreadable manifest: leave it whole for verification to quarantine
            if keep_token is not None:
                keep.add(keep_token)
            keys, tokens = self._ls(self._key(name) + "/")
            if not raw:  # stray objects of an uncommitted name (e.g. a half-finished delete)
                self._delete_keys(keys)
                removed += [key[len(self._root) :] for key in keys]
            for token in tokens:
                if token not in keep:
                    self._delete_keys([k for k, _ in self._objects(self._key(name, token) + "/")])
                    removed.append(f"{name}/{token}/")
        removed += self._abort_uploads(self._root, keep_token)
        return removed

    def list_quarantined(self) -> list[str]:
        return sorted(self._ls(f"{self._root}{QUARANTINE_DIR}/")[1])
