"""S3Storage against a real (moto) S3 server: layout, commit protocol, cleanup, errors."""

from __future__ import annotations

import json
import os
import socket
import sys
import time

import boto3
import pytest
from botocore.exceptions import ClientError

from resilient.checkpoint import s3, s3_client
from resilient.checkpoint.digest import BlockSpec, digest_bytes
from resilient.checkpoint.locations import open_storage
from resilient.checkpoint.manifest import SCHEMA_BLOCKS, FileEntry, Manifest, checkpoint_name, parse_manifest
from resilient.checkpoint.s3 import S3Storage
from resilient.checkpoint.storage import Staging, StoreRetry
from resilient.checkpoint.store_retries import RetryReports
from resilient.core.errors import CommitConflictError, StorageError
from resilient.core.events import EventLog

CHUNK = BlockSpec(block_bytes=1 << 20)
MiB = 1 << 20


def store_for(s3_url: tuple[str, str], **kwargs: object) -> S3Storage:
    url, endpoint = s3_url
    return S3Storage(url, endpoint_url=endpoint, **kwargs)  # type: ignore[arg-type]


def client_for(s3_url: tuple[str, str]):  # type: ignore[no-untyped-def]
    return boto3.client("s3", endpoint_url=s3_url[1], region_name="us-east-1")


def bucket_of(s3_url: tuple[str, str]) -> str:
    return s3_url[0][len("s3://") :].split("/")[0]


def keys(s3_url: tuple[str, str], prefix: str = "") -> list[str]:
    resp = client_for(s3_url).list_objects_v2(Bucket=bucket_of(s3_url), Prefix=prefix)
    return sorted(o["Key"] for o in resp.get("Contents", []))


def stage(store: S3Storage, step: int, token: str, files: dict[str, bytes] | None = None) -> tuple[Staging, bytes]:
    """Write a world-size-1 checkpoint's files and build (but not commit) its manifest."""
    name = checkpoint_name(step)
    staging = store.begin(name, token)
    files = files or {"replicated.bin": b"r" * 10, "rank_00000.bin": os.urandom(1000)}
    entries = []
    for (rel, data), rank in zip(files.items(), (None, 0)):
        got = store.write_file(staging, rel, [memoryview(data)], CHUNK)
        entries.append(FileEntry(path=staging.file_prefix + rel, size=got.size, digest=got.digest, rank=rank,
                                 blocks=got.blocks))
    manifest = Manifest(
        name=name,
        step=step,
        world_size=1,
        files=tuple(entries),
        parent=None,
        created_unix=time.time(),
        chunk_bytes=CHUNK.block_bytes,
        schema=SCHEMA_BLOCKS,
        digest_algorithm=CHUNK.algorithm,
    )
    return staging, manifest.to_bytes()


def commit(store: S3Storage, step: int, token: str = "tok1") -> tuple[Staging, bytes]:
    staging, raw = stage(store, step, token)
    store.commit(staging, raw)
    return staging, raw


def test_small_file_roundtrip(s3_url: tuple[str, str]) -> None:
    store = store_for(s3_url)
    staging = store.begin("step_0000000001", "tokA")
    assert staging.file_prefix == "tokA/"
    header, body = b"hdr" * 7, os.urandom(3 * MiB + 5)
    digest = store.write_file(staging, "rank_00000.bin", [memoryview(header), memoryview(body)], CHUNK)
    assert digest.size == len(header) + len(body)
    assert digest == digest_bytes(header + body, CHUNK.block_bytes)
    assert len(digest.blocks) == 4  # 3 MiB + 26 bytes in blocks of 1 MiB
    assert keys(s3_url) == ["ckpts/step_0000000001/tokA/rank_00000.bin"]
    buf, got = store.read_file("step_0000000001", "tokA/rank_00000.bin", CHUNK)
    assert isinstance(buf, bytearray) and buf == header + body and got == digest


def test_empty_file_roundtrip(s3_url: tuple[str, str]) -> None:
    store = store_for(s3_url)
    staging = store.begin("step_0000000001", "tokA")
    empty = digest_bytes(b"", CHUNK.block_bytes)
    assert empty.size == 0 and len(empty.blocks) == 1
    assert store.write_file(staging, "empty.bin", [], CHUNK) == empty
    assert store.read_file("step_0000000001", "tokA/empty.bin", CHUNK) == (bytearray(), empty)


def test_large_file_multipart(s3_url: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    store = store_for(s3_url)
    staging = store.begin("step_0000000002", "tokB")
    # Odd segment sizes: pieces() yields short views at every segment boundary.
    segments = [b"H" * 100, os.urandom(20 * MiB + 3), os.urandom(21 * MiB), b"T" * 7]
    data = b"".join(segments)
    digest = store.write_file(staging, "rank_00000.bin", [memoryview(s) for s in segments], CHUNK)
    assert digest.size == len(data) and digest == digest_bytes(data, CHUNK.block_bytes)
    key = "ckpts/step_0000000002/tokB/rank_00000.bin"
    head = client_for(s3_url).head_object(Bucket=bucket_of(s3_url), Key=key)
    assert head["ContentLength"] == len(data)
    assert "-" in head["ETag"], "expected a multipart upload"
    uploads = client_for(s3_url).list_multipart_uploads(Bucket=bucket_of(s3_url)).get("Uploads", [])
    assert uploads == []
    buf, got = store.read_file("step_0000000002", "tokB/rank_00000.bin", CHUNK)
    assert buf == data and got == digest
    monkeypatch.setattr(s3, "RANGE_BYTES", 4 * MiB)  # force parallel ranged GETs
    buf, got = store.read_file("step_0000000002", "tokB/rank_00000.bin", BlockSpec(block_bytes=3 * MiB))
    assert buf == data and got == digest_bytes(data, 3 * MiB)


def test_ranges_are_read_into_their_places(s3_url: tuple[str, str]) -> None:
    """A restore's reads in place: each range lands in the views it is given, one view straight from the GET,
    several through one GET; the end of the object shortens a read; a missing object is FileNotFoundError."""
    store = store_for(s3_url)
    staging = store.begin("step_0000000004", "tokR")
    data = os.urandom(3 * MiB + 11)
    store.write_file(staging, "rank_00000.bin", [memoryview(data)], CHUNK)
    reader = store.open_ranges("step_0000000004", "tokR/rank_00000.bin")
    assert reader.size == len(data)
    one = bytearray(MiB)
    assert reader.readinto(5, [memoryview(one)]) == MiB and one == data[5:5 + MiB]
    a, b, c = bytearray(10), bytearray(0), bytearray(MiB)
    assert reader.readinto(MiB, [memoryview(a), memoryview(b), memoryview(c)]) == MiB + 10
    assert bytes(a + c) == data[MiB:2 * MiB + 10]
    tail = bytearray(100)
    assert reader.readinto(len(data) - 11, [memoryview(tail)]) == 11 and tail[:11] == data[-11:]
    reader.close()
    with pytest.raises(FileNotFoundError):
        store.open_ranges("step_0000000004", "tokR/absent.bin")


def test_failed_multipart_upload_is_aborted(s3_url: tuple[str, str]) -> None:
    store = store_for(s3_url)
    real = store._client.upload_part

    def flaky(**kwargs):  # type: ignore[no-untyped-def]
        if kwargs["PartNumber"] == 2:
            raise ClientError({"Error": {"Code": "InternalError", "Message": "injected"}}, "UploadPart")
        return real(**kwargs)

    store._client.upload_part = flaky  # type: ignore[method-assign]
    staging = store.begin("step_0000000003", "tokC")
    with pytest.raises(StorageError, match="InternalError"):
        store.write_file(staging, "rank_00000.bin", [memoryview(os.urandom(40 * MiB))], CHUNK)
    assert client_for(s3_url).list_multipart_uploads(Bucket=bucket_of(s3_url)).get("Uploads", []) == []
    assert keys(s3_url) == []


def test_commit_lists_in_step_order(s3_url: tuple[str, str]) -> None:
    store = store_for(s3_url)
    assert store.list_committed() == []
    raws = {step: commit(store, step)[1] for step in (100, 20, 3)}
    assert store.list_committed() == [checkpoint_name(s) for s in (3, 20, 100)]
    assert store.read_manifest(checkpoint_name(20)) == raws[20]
    manifest = parse_manifest(store.read_manifest(checkpoint_name(20)), checkpoint_name(20))
    for entry in manifest.files:
        buf, digest = store.read_file(manifest.name, entry.path, manifest.spec)
        assert (len(buf), digest.digest, digest.blocks) == (entry.size, entry.digest, entry.blocks)
    assert store.read_manifest(checkpoint_name(999)) == b""


def test_second_commit_conflicts(s3_url: tuple[str, str]) -> None:
    store = store_for(s3_url)
    first, raw = commit(store, 5, token="tokA")
    store.commit(first, raw)  # same manifest again: our own commit retried, not a conflict
    other, other_raw = stage(store, 5, "tokB")
    with pytest.raises(CommitConflictError, match="already committed"):
        store.commit(other, other_raw)
    store.abort(other)
    assert store.read_manifest(checkpoint_name(5)) == raw
    assert keys(s3_url, "ckpts/step_0000000005/tokB/") == []
    assert len(keys(s3_url, "ckpts/step_0000000005/tokA/")) == 2


def test_commit_refuses_missing_file(s3_url: tuple[str, str]) -> None:
    store = store_for(s3_url)
    staging, raw = stage(store, 6, "tokA")
    client_for(s3_url).delete_object(Bucket=bucket_of(s3_url), Key="ckpts/step_0000000006/tokA/rank_00000.bin")
    with pytest.raises(StorageError, match="refusing to commit"):
        store.commit(staging, raw)
    assert store.list_committed() == []


def test_abort_removes_staging_but_not_a_landed_commit(s3_url: tuple[str, str]) -> None:
    store = store_for(s3_url)
    staging, _ = stage(store, 7, "tokA")
    store.abort(staging)
    assert keys(s3_url) == []
    committed, _ = commit(store, 8, "tokB")
    store.abort(committed)  # e.g. the commit's response was lost: the data must stay
    assert store.list_committed() == [checkpoint_name(8)]
    assert len(keys(s3_url, "ckpts/step_0000000008/")) == 3


def test_uncommitted_staging_is_invisible_and_collected(s3_url: tuple[str, str]) -> None:
    store = store_for(s3_url)
    stage(store, 5, "crashed")
    stage(store, 6, "current")
    commit(store, 7, "done")
    stage(store, 7, "loser")  # lost the commit race and crashed before aborting
    c = client_for(s3_url)
    c.put_object(Bucket=bucket_of(s3_url), Key="ckpts/step_0000000009/leftover.bin", Body=b"x")
    upload = c.create_multipart_upload(Bucket=bucket_of(s3_url), Key="ckpts/step_0000000010/crashed/rank_00000.bin")
    current = c.create_multipart_upload(Bucket=bucket_of(s3_url), Key="ckpts/step_0000000010/current/rank_00000.bin")
    # Each upload has a part (moto dates every upload's start 2010-11-10: an upload's age is its newest part's).
    for up in (upload, current):
        c.upload_part(Bucket=bucket_of(s3_url), Key=up["Key"], UploadId=up["UploadId"], PartNumber=1, Body=b"y" * 10)
    assert store.list_committed() == [checkpoint_name(7)]

    assert store.collect_garbage(keep_token="current", min_age_s=3600).removed == (), "every save here is fresh"
    removed = store.collect_garbage(keep_token="current").removed
    assert sorted(removed) == [
        "step_0000000005/crashed/",
        "step_0000000007/loser/",
        "step_0000000009/leftover.bin",
        "step_0000000010/crashed/rank_00000.bin (incomplete multipart upload)",
    ]
    assert keys(s3_url, "ckpts/step_0000000005/") == []
    assert len(keys(s3_url, "ckpts/step_0000000006/current/")) == 2
    assert keys(s3_url, "ckpts/step_0000000007/loser/") == []
    assert len(keys(s3_url, "ckpts/step_0000000007/")) == 3
    left = [u["UploadId"] for u in c.list_multipart_uploads(Bucket=bucket_of(s3_url)).get("Uploads", [])]
    assert upload["UploadId"] not in left and len(left) == 1
    assert store.list_committed() == [checkpoint_name(7)]
    assert store.collect_garbage(keep_token="current").removed == ()
    young = store.collect_garbage(min_age_s=3600)
    assert young.removed == () and [entry for entry, _ in young.skipped] == [
        "step_0000000006/current/", "step_0000000010/current/rank_00000.bin (incomplete multipart upload)"]
    assert all("within the minimum age of 3600 s: a save may be under way" in why for _, why in young.skipped)
    assert list(store.collect_garbage().removed) == [
        "step_0000000006/current/",
        "step_0000000010/current/rank_00000.bin (incomplete multipart upload)",
    ]


def test_quarantine_moves_checkpoint(s3_url: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    store = store_for(s3_url)
    commit(store, 10)
    kept, _ = commit(store, 11)
    big = os.urandom(12 * MiB + 1)
    store.write_file(kept, "extra.bin", [memoryview(big)], CHUNK)
    monkeypatch.setattr(s3_client, "COPY_LIMIT", 1 * MiB)  # exercise the part-by-part copy too
    monkeypatch.setattr(s3_client, "COPY_PART_BYTES", 5 * MiB)
    before = time.time()
    where = store.quarantine(checkpoint_name(11), "digest mismatch")
    after = time.time()
    entry = where.rstrip("/").rsplit("/", 1)[1]
    assert where == f"s3://{bucket_of(s3_url)}/ckpts/.quarantine/{entry}/"
    assert entry.startswith("step_0000000011.")
    assert store.list_committed() == [checkpoint_name(10)]
    assert store.list_quarantined() == [entry]
    assert keys(s3_url, "ckpts/step_0000000011/") == []
    moved = keys(s3_url, f"ckpts/.quarantine/{entry}/")
    assert [k.rsplit("/", 1)[1] for k in moved] == [
        "QUARANTINE.json",
        "manifest.json",
        "extra.bin",
        "rank_00000.bin",
        "replicated.bin",
    ]
    c = client_for(s3_url)
    note = json.loads(
        c.get_object(Bucket=bucket_of(s3_url), Key=f"ckpts/.quarantine/{entry}/QUARANTINE.json")["Body"].read()
    )
    assert note["checkpoint"] == checkpoint_name(11) and note["reason"] == "digest mismatch"
    assert before <= note["time_unix"] <= after
    copied = c.get_object(Bucket=bucket_of(s3_url), Key=f"ckpts/.quarantine/{entry}/tok1/extra.bin")["Body"].read()
    assert copied == big
    with pytest.raises(FileNotFoundError):
        store.read_file(checkpoint_name(11), "tok1/rank_00000.bin", CHUNK)
    with pytest.raises(StorageError, match="not committed"):
        store.quarantine(checkpoint_name(11), "again")


def test_delete(s3_url: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(s3_client, "LIST_PAGE", 2)  # paginate every listing
    store = store_for(s3_url)
    for step in (1, 2, 3, 4, 5):
        commit(store, step)
    assert store.list_committed() == [checkpoint_name(s) for s in (1, 2, 3, 4, 5)]
    store.delete(checkpoint_name(3))
    assert store.list_committed() == [checkpoint_name(s) for s in (1, 2, 4, 5)]
    assert keys(s3_url, "ckpts/step_0000000003") == []
    with pytest.raises(StorageError, match="no such checkpoint"):
        store.delete(checkpoint_name(3))


def test_bucket_without_prefix(s3_url: tuple[str, str]) -> None:
    url = f"s3://{bucket_of(s3_url)}"
    store = open_storage(url, endpoint_url=s3_url[1])
    assert isinstance(store, S3Storage) and store.url == url
    commit(store, 1)  # type: ignore[arg-type]
    assert store.list_committed() == [checkpoint_name(1)]
    assert keys(s3_url)[0] == "step_0000000001/manifest.json"


def test_missing_object_is_file_not_found(s3_url: tuple[str, str]) -> None:
    with pytest.raises(FileNotFoundError):
        store_for(s3_url).read_file(checkpoint_name(1), "tok/rank_00000.bin", CHUNK)


def test_missing_bucket_is_explained(s3_url: tuple[str, str]) -> None:
    store = S3Storage("s3://no-such-bucket-for-resilient/x", endpoint_url=s3_url[1])
    expected = "bucket no-such-bucket-for-resilient does not exist; create it or fix CheckpointConfig.dir"
    with pytest.raises(StorageError, match=expected):
        store.list_committed()
    with pytest.raises(StorageError, match=expected):
        store.write_file(store.begin("step_0000000001", "t"), "a.bin", [memoryview(b"abc")], CHUNK)


def test_an_unreachable_endpoint_is_tried_max_attempts_plus_once_and_named(
    s3_url: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once we leave: nothing listens there
    store = S3Storage(
        "s3://bucket/x", endpoint_url=f"http://127.0.0.1:{port}", connect_timeout=1, read_timeout=1, max_attempts=2
    )
    retried: list[StoreRetry] = []
    store.observe_retries(retried.append)
    dialled: list[object] = []
    connect = socket.socket.connect

    def counted(self: socket.socket, address: object) -> None:
        dialled.append(address)
        connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", counted)
    with pytest.raises(StorageError, match="cannot reach S3 at http://127.0.0.1"):
        store.list_committed()
    # Refused each time: the first attempt and max_attempts retries, each reported, then the error.
    assert dialled.count(("127.0.0.1", port)) == 3, dialled
    assert [(r.operation, r.attempt, r.attempts) for r in retried] == [("list_objects_v2", 1, 3),
                                                                       ("list_objects_v2", 2, 3)], retried


def test_missing_boto3_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "boto3", None)
    with pytest.raises(StorageError, match=r"pip install 'resilient-train\[s3\]'"):
        S3Storage("s3://bucket/x")


def test_bad_url() -> None:
    with pytest.raises(StorageError, match="names no bucket"):
        S3Storage("s3:///prefix")


def test_a_store_in_trouble_is_named_as_such_and_retries_absorb_a_flaky_one(s3_url: tuple[str, str]) -> None:
    """Through the drills' fault proxy in front of the real server: 503s and dropped connections."""
    from urllib.parse import urlsplit

    from resilient.chaos.s3proxy import FaultProxy

    up = urlsplit(s3_url[1])
    proxy = FaultProxy((str(up.hostname), int(up.port or 80)), seed=3)
    try:
        store = store_for((s3_url[0], proxy.url), max_attempts=3)
        retried: list[StoreRetry] = []
        store.observe_retries(retried.append)
        body = [memoryview(os.urandom(4096))]
        staging = store.begin("step_0000000001", "tokA")
        before = proxy.counts()["forwarded"]
        proxy.set_fault("errors", rate=1.0)
        with pytest.raises(StorageError) as err:
            store.write_file(staging, "a.bin", body, CHUNK)
        assert "the store is throttling or unavailable (SlowDown" in str(err.value), str(err.value)
        assert "after 4 attempts" in str(err.value) and "permissions" not in str(err.value)
        # The first attempt and its 3 retries, and no more: nothing got through.
        assert proxy.counts()["errors"] == 4 and proxy.counts()["forwarded"] == before, proxy.counts()
        # Each retry was seen as it happened, not only the last failure.
        assert [(r.operation, r.attempt, r.attempts, r.error) for r in retried] == \
            [("put_object", n, 4, "503 SlowDown") for n in (1, 2, 3)]
        proxy.set_fault("drop", rate=1.0)
        with pytest.raises(StorageError, match="cannot reach S3"):
            store.write_file(staging, "a.bin", body, CHUNK)
        assert [r.attempt for r in retried[3:]] == [1, 2, 3] and "Connection" in retried[3].error, retried[3:]
        proxy.set_fault("drop", rate=0.3)
        for i in range(10):  # a fault-tolerant client: each write lands despite the drops
            store.write_file(staging, f"f{i}.bin", body, CHUNK)
        proxy.set_fault("errors", rate=0.3)
        for i in range(10, 20):
            store.write_file(staging, f"f{i}.bin", body, CHUNK)
        counts = proxy.counts()
        assert counts["drop"] > 3 + 0 and counts["errors"] > 3, counts  # the shares struck (beyond the 1.0 phases)
        # Every struck request was retried, but the last attempt of each of the two that failed.
        assert len(retried) == counts["errors"] + counts["drop"] - 2, (len(retried), counts)
        proxy.set_fault("slow", delay_s=0.3)
        started = time.monotonic()
        store.write_file(staging, "slow.bin", body, CHUNK)
        assert time.monotonic() - started >= 0.3
        proxy.clear()
        assert sorted(k.rsplit("/", 1)[1] for k in keys(s3_url)) == sorted(
            [f"f{i}.bin" for i in range(20)] + ["slow.bin"])
        # Held past the client's read timeout: a timeout, named as such, after the first attempt and one retry.
        impatient = store_for((s3_url[0], proxy.url), max_attempts=1, read_timeout=1)
        late: list[StoreRetry] = []
        impatient.observe_retries(late.append)
        proxy.set_fault("slow", delay_s=3.0)
        before = proxy.counts()["slow"]
        with pytest.raises(StorageError) as err:
            impatient.write_file(staging, "late.bin", body, CHUNK)
        assert "did not answer within the read timeout (1 s) in 2 attempts" in str(err.value), str(err.value)
        assert proxy.counts()["slow"] - before == 2
        assert [(r.attempt, r.attempts) for r in late] == [(1, 2)] and "ReadTimeout" in late[0].error, late
    finally:
        proxy.close()


def test_retries_are_reported_at_once_then_at_most_every_ten_seconds_with_their_count() -> None:
    events, now = EventLog(), [100.0]
    reports = RetryReports(events, "s3://b/p", clock=lambda: now[0])
    for t in (100.0, 101.0, 105.0, 110.5, 111.0):
        now[0] = t
        reports.report(StoreRetry(operation="put_object", attempt=1, attempts=6, error="503 SlowDown"))
    seen = [e.fields for e in events.of_kind("checkpoint_store_retrying")]
    assert [f["retries"] for f in seen] == [1, 3] and reports.total == 5
    assert seen[0]["location"] == "s3://b/p" and seen[0]["error"] == "503 SlowDown"
    assert "failed put_object (503 SlowDown) on attempt 1 of 6; retrying" in seen[0]["reason"]
