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


def restore_expecting_fallback(store, after_3, reason_part: str) -> None:
    events = resilient.EventLog()
    run = tiny_run(store.url, store.endpoint, events=events)
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
        body["files"].append({"path": "rank00001.shard", "size": 1, "digest": "0" * 64, "rank": 1})

    rewrite_manifest(store, two_ranks)
    with pytest.raises(resilient.CheckpointMismatchError, match="written by 2 ranks but this job has 1"):
        tiny_run(store.url, store.endpoint)
