"""Damaged checkpoints are detected, quarantined, and the previous commit is used.

Every test runs on the local backend and on a real S3-compatible server.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import resilient
from resilient.checkpoint import manifest as mf
from resilient.checkpoint.digest import digest_bytes
from resilient.checkpoint.inspect import verify_checkpoint
from resilient.checkpoint.storage import LocalStorage

from .stores import LocalStore
from .tiny import params, same, tiny_run, train

NEWEST, PREVIOUS = "step_0000000006", "step_0000000003"


@pytest.fixture
def pristine(store):
    """A location holding commits at steps 3 and 6, and the parameters after step 3."""
    run = tiny_run(store.url, store.endpoint)
    train(run, 3)
    run.close()
    after_3 = params(run)
    train(run, 6)
    run.close()
    return store, after_3


def restore_expecting_fallback(store, after_3, reason_part: str, **run_args) -> None:
    events = resilient.EventLog()
    run = tiny_run(store.url, store.endpoint, events=events, **run_args)
    assert run.restored_from == PREVIOUS and run.step == 3
    assert same(params(run), after_3)
    (quarantined,) = events.of_kind("checkpoint_quarantined")
    assert quarantined.fields["name"] == NEWEST
    assert reason_part in quarantined.fields["reason"], quarantined.fields["reason"]
    assert events.of_kind("checkpoint_fallback")
    # The quarantined checkpoint is kept for inspection, out of the committed set.
    assert run.checkpoints.storage.list_committed() == [PREVIOUS]
    assert run.checkpoints.storage.list_quarantined()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_flipped_byte_in_any_file_is_detected(pristine, data):
    template, after_3 = pristine
    store = template.clone()
    rel = data.draw(st.sampled_from(store.keys(NEWEST)), label="file")
    blob = bytearray(store.read(NEWEST, rel))
    offset = data.draw(st.integers(0, len(blob) - 1), label="offset")
    blob[offset] ^= data.draw(st.integers(1, 255), label="xor")
    store.write(NEWEST, rel, bytes(blob))
    restore_expecting_fallback(store, after_3, "manifest" if rel.endswith("manifest.json") else rel)


def test_truncated_shard_is_detected(pristine):
    store, after_3 = pristine
    rel = next(k for k in store.keys(NEWEST) if k.endswith("replicated.shard"))
    store.write(NEWEST, rel, store.read(NEWEST, rel)[:-100])
    restore_expecting_fallback(store, after_3, "truncated")


def test_missing_shard_is_detected(pristine):
    store, after_3 = pristine
    rel = next(k for k in store.keys(NEWEST) if k.endswith("rank00000.shard"))
    store.delete(NEWEST, rel)
    restore_expecting_fallback(store, after_3, "missing")


def rewrite_manifest(store, edit) -> None:
    """Edit the newest manifest and re-seal it, as a buggy or hostile writer could."""
    body = json.loads(store.read(NEWEST, "manifest.json"))
    edit(body)
    body["manifest_digest"] = mf._content_digest(body)
    store.write(NEWEST, "manifest.json", mf._canonical(body))


@pytest.mark.parametrize("bad_path", ["../escape.shard", "/etc/passwd", "a/../../b", "./x", ""])
def test_manifest_path_outside_the_checkpoint_is_rejected(pristine, bad_path):
    store, after_3 = pristine
    rewrite_manifest(store, lambda body: body["files"][0].__setitem__("path", bad_path))
    restore_expecting_fallback(store, after_3, "not a plain relative path")


def test_newer_schema_is_a_clear_error_and_the_checkpoint_is_left_alone(pristine):
    store, _ = pristine
    rewrite_manifest(store, lambda body: body.__setitem__("schema", "resilient.checkpoint/7"))
    with pytest.raises(resilient.CheckpointMismatchError, match="upgrade resilient"):
        tiny_run(store.url, store.endpoint)
    assert "manifest.json" in store.keys(NEWEST)


def test_unknown_schema_string_is_corruption(pristine):
    store, after_3 = pristine
    rewrite_manifest(store, lambda body: body.__setitem__("schema", "something-else"))
    restore_expecting_fallback(store, after_3, "unknown schema")


def test_every_checkpoint_corrupt_refuses_to_start_from_scratch(pristine):
    store, _ = pristine
    for name in (PREVIOUS, NEWEST):
        rel = next(k for k in store.keys(name) if k.endswith("replicated.shard"))
        store.write(name, rel, b"garbage")
    with pytest.raises(resilient.NoValidCheckpointError, match="Refusing to start from scratch"):
        tiny_run(store.url, store.endpoint)


def test_different_model_shape_is_a_clear_error_and_nothing_is_quarantined(pristine):
    store, _ = pristine
    events = resilient.EventLog()
    with pytest.raises(resilient.CheckpointMismatchError, match=f"{NEWEST} does not fit this model"):
        tiny_run(store.url, store.endpoint, hidden=32, events=events)
    assert not events.of_kind("checkpoint_quarantined")
    assert "manifest.json" in store.keys(NEWEST)


def test_different_world_size_is_a_clear_error(pristine):
    store, _ = pristine

    def two_ranks(body):
        body["world_size"] = 2
        got = digest_bytes(b"x", body["chunk_bytes"], body["digest_algorithm"])
        body["files"].append({"path": "rank00001.shard", "size": 1, "digest": got.digest, "blocks": list(got.blocks),
                              "rank": 1})

    rewrite_manifest(store, two_ranks)
    with pytest.raises(resilient.CheckpointMismatchError, match="written by 2 ranks but this job has 1"):
        tiny_run(store.url, store.endpoint)


# ----------------------------------------------- every format, every kind of damage
FORMATS = ("xxh3-128", "sha256", "v2-sha256-unlisted", "v1-sha256-unlisted")
"""Format 4 with each digest, and manifests of formats 2 and 1, written before block digests were listed (1:
before fencing too)."""
BLOCK = 4096


def _as_older_format(store: LocalStore, name: str, schema: str) -> None:
    """Rewrite a format-4 SHA-256 manifest as format 2 (or 1) wrote it: no block digests, no index key (and no
    generation or launch)."""
    body = json.loads(store.read(name, "manifest.json"))
    assert body["digest_algorithm"] == "sha256-chunked" and body["index"] is None
    body["schema"] = schema
    del body["index"]
    if schema == mf.SCHEMA_V1:
        del body["generation"], body["launch"]
    for entry in body["files"]:
        del entry["blocks"]
    body["manifest_digest"] = mf._content_digest(body)
    store.write(name, "manifest.json", mf._canonical(body))


@pytest.fixture(scope="module")
def pristine_formats(tmp_path_factory):
    """Per format: a local location with commits at 3 and 6 (files of several blocks), and the parameters after
    step 3."""
    out = {}
    for fmt in FORMATS:
        store = LocalStore(tmp_path_factory.mktemp(fmt) / "ckpt")
        digest = "xxh3-128" if fmt == "xxh3-128" else "sha256"
        run = tiny_run(store.url, hidden=256, chunk_bytes=BLOCK, digest=digest)
        train(run, 3)
        run.close()
        after_3 = params(run)
        train(run, 6)
        run.close()
        if fmt.startswith("v"):
            for name in (PREVIOUS, NEWEST):
                _as_older_format(store, name, mf.SCHEMA if fmt.startswith("v2") else mf.SCHEMA_V1)
        out[fmt] = (store, after_3)
    return out


def _damage(store: LocalStore, data: st.DataObject) -> str:
    """One kind of damage to one file of the newest checkpoint; returns what the verdict must name."""
    rel = data.draw(st.sampled_from([k for k in store.keys(NEWEST) if k.endswith(".shard")]), label="file")
    blob = bytearray(store.read(NEWEST, rel))
    blocks = -(-len(blob) // BLOCK)
    kind = data.draw(st.sampled_from(["flip", "truncate", "extend", "swap", "stale", "header"]), label="kind")
    if kind == "flip":
        offset = data.draw(st.integers(0, len(blob) - 1), label="offset")
        blob[offset] ^= 1 << data.draw(st.integers(0, 7), label="bit")
    elif kind == "truncate":
        del blob[data.draw(st.integers(0, len(blob) - 1), label="length"):]
    elif kind == "extend":
        blob += bytes(data.draw(st.integers(1, 2 * BLOCK), label="extra"))
    elif kind in ("swap", "stale") and blocks >= 2:
        a, b = data.draw(st.lists(st.integers(0, blocks - 2), min_size=2, max_size=2, unique=True), label="blocks")
        ra, rb = slice(a * BLOCK, (a + 1) * BLOCK), slice(b * BLOCK, (b + 1) * BLOCK)
        if kind == "swap":
            if blob[ra] == blob[rb]:  # identical blocks (zero padding): swapping changes nothing, so no damage
                blob[ra.start] ^= 0xFF
            blob[ra], blob[rb] = blob[rb], blob[ra]
        else:  # a block of the same file in the checkpoint before: a write that landed half-way
            stale = bytearray(store.read(PREVIOUS, rel)[ra])
            if stale == blob[ra]:  # unchanged since (the header's block, say): a stale copy of it is no damage
                stale[0] ^= 0xFF
            blob[ra] = stale
    else:  # a forged header: another tensor table in the same bytes
        start = blob.index(b'"tensors":') + len(b'"tensors":')
        offset = blob.index(b'"offset":', start) + len(b'"offset":')
        blob[offset] = ord("1") if blob[offset] != ord("1") else ord("2")
    store.write(NEWEST, rel, bytes(blob))
    return rel


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), fmt=st.sampled_from(FORMATS))
def test_every_kind_of_damage_in_every_format_is_detected_and_the_restore_falls_back(pristine_formats, data, fmt):
    template, after_3 = pristine_formats[fmt]
    store = template.clone()
    rel = _damage(store, data)
    report = verify_checkpoint(LocalStorage(store.url), NEWEST)
    assert not report.ok and rel in (report.problem or ""), report
    assert verify_checkpoint(LocalStorage(store.url), PREVIOUS).ok
    restore_expecting_fallback(store, after_3, rel, hidden=256)


@pytest.mark.parametrize("fmt", ["xxh3-128", "sha256"])
def test_a_forged_block_digest_in_a_resealed_manifest_is_detected(pristine_formats, fmt):
    """Format 4: a manifest whose listed blocks do not give the file's digest is corrupt, whatever else holds."""
    template, after_3 = pristine_formats[fmt]
    store = template.clone()

    def forge(body):
        entry = body["files"][0]
        entry["blocks"][-1] = "0" * len(entry["blocks"][-1])

    rewrite_manifest(store, forge)
    restore_expecting_fallback(store, after_3, "its digest is not that of its blocks", hidden=256)
