"""S3 plumbing under the checkpoint backend: the client, errors that name a fix, listing, copying.

:class:`S3Bucket` knows objects and keys, not checkpoints; the storage
protocol on top of it is :class:`resilient.checkpoint.s3.S3Storage`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ..core.errors import StorageError
from .s3_support import import_boto, parse_url
from .storage import StoreRetry

COPY_LIMIT = 5 << 30  # copy_object's limit; larger objects are copied part by part
COPY_PART_BYTES = 512 << 20
LIST_PAGE = 1000
READ_ATTEMPTS = 3  # a body that breaks mid-stream is fetched again (the SDK retries only the request)
ABSENT = ("NoSuchKey", "404", "NotFound")
CONFLICT = ("PreconditionFailed", "ConditionalRequestConflict", "412", "409")
_UNAVAILABLE = ("SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "Throttling",
                "ThrottlingException", "RequestLimitExceeded", "503", "500")
"""Answers of a store in trouble (retried by the SDK, then reported as such), not of a wrong bucket or key."""
_AUTH = ("AccessDenied", "403", "Forbidden", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken")


def _code(e: Any) -> str:
    return str(e.response.get("Error", {}).get("Code", "?"))


def _retryable(response: Any, caught: Any) -> str | None:
    """What failed in one attempt the SDK may retry (an exception, a 5xx, a throttle); None for an answer."""
    if caught is not None:
        return f"{type(caught).__name__}: {caught}"
    if not response:
        return None
    http, parsed = response
    status = int(getattr(http, "status_code", 0) or 0)
    code = str((parsed or {}).get("Error", {}).get("Code", ""))
    if status >= 500 or status == 429 or code in _UNAVAILABLE:
        return f"{status} {code}".strip()
    return None


def _operation(operation: Any) -> str:
    """An SDK operation model's name the way the client spells it (``PutObject``: ``put_object``)."""
    name = str(getattr(operation, "name", "") or "?")
    return "".join(f"_{c.lower()}" if c.isupper() and i else c.lower() for i, c in enumerate(name))



class S3Bucket:
    """A bucket and prefix with one configured client; every failure is a :class:`StorageError`."""

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
        self.max_attempts = max_attempts
        self.read_timeout = read_timeout
        """Retries after the first attempt (the SDK's ``retries.max_attempts``: a request is tried this plus once)."""
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

    def observe_retries(self, report: Callable[[StoreRetry], None]) -> None:
        """Call ``report`` for every request the SDK is about to retry (a 5xx, a throttle, a timeout, a reset).

        The SDK decides alone, and reports only the last failure; this hook on its ``needs-retry`` event sees
        each one, so a store in trouble is known at its first failed request, not when the retries run out."""
        def needs_retry(attempts: int = 0, response: Any = None, caught_exception: Any = None,
                        operation: Any = None, **_: Any) -> None:
            error = _retryable(response, caught_exception)
            if error is not None and attempts <= self.max_attempts:
                report(StoreRetry(operation=_operation(operation), attempt=attempts, attempts=self.max_attempts + 1,
                                  error=error))
            # None: no opinion; the SDK's own handler decides whether and when to retry

        self._client.meta.events.register("needs-retry.s3", needs_retry)

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
            elif code in _UNAVAILABLE or int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0) >= 500:
                why = (
                    f"the store is throttling or unavailable ({code}: {message}) after {self.max_attempts + 1} attempts; "
                    "nothing was committed by this request. If it lasts, check the store's health and request "
                    "rate (fewer ranks writing at once, a larger CheckpointConfig interval)"
                )
            else:
                why = f"S3 error {code}: {message}; check the bucket, prefix and permissions"
        elif isinstance(e, (bx.NoCredentialsError, bx.PartialCredentialsError)):
            why = f"{e}; set AWS_PROFILE or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, or run with an instance role"
        elif isinstance(e, bx.ReadTimeoutError):
            why = (
                f"the store did not answer within the read timeout ({self.read_timeout:g} s) in "
                f"{self.max_attempts + 1} attempts ({e}); it is overloaded or the network to it is slow: "
                "nothing was committed by this request"
            )
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

    def _written(self, prefix: str) -> dict[str, float]:
        """Key -> when it was last written (Unix time, the store's clock) of every object under ``prefix``."""
        return {o["Key"]: o["LastModified"].timestamp()
                for p in self._pages("list_objects_v2", prefix) for o in p.get("Contents", [])}

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

    def _abort_uploads(self, prefix: str, keep_token: str | None = None, *, min_age_s: float = 0.0,
                       now: float = 0.0) -> tuple[list[str], list[tuple[str, str]]]:
        """Abort incomplete multipart uploads (but ``keep_token``'s, and those that uploaded a part within
        ``min_age_s`` of ``now``: those are skipped, with why)."""
        removed, skipped = [], []
        for page in self._pages("list_multipart_uploads", prefix):
            for up in page.get("Uploads", []):
                rel = up["Key"][len(self._root) :]
                if keep_token is not None and rel.split("/")[1:2] == [keep_token]:
                    continue
                if min_age_s > 0:
                    age = now - self._upload_written(up)
                    if age < min_age_s:
                        skipped.append((f"{rel} (incomplete multipart upload)",
                                        f"written {max(0.0, age):.0f} s ago, within the minimum age of {min_age_s:g} s: "
                                        "a save may be under way"))
                        continue
                self._abort_upload(up["Key"], up["UploadId"])
                removed.append(f"{rel} (incomplete multipart upload)")
        return removed, skipped

    def _upload_written(self, up: dict[str, Any]) -> float:
        """When an incomplete multipart upload last wrote: its newest part, else its start."""
        newest = up["Initiated"].timestamp()
        for page in self._client.get_paginator("list_parts").paginate(Bucket=self.bucket, Key=up["Key"],
                                                                    UploadId=up["UploadId"]):
            for part in page.get("Parts", []):
                newest = max(newest, part["LastModified"].timestamp())
        return newest

    def _abort_upload(self, key: str, upload_id: str) -> None:
        self._call("abort_multipart_upload", key, absent=("NoSuchUpload",), Key=key, UploadId=upload_id)

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
