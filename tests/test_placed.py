"""Reads in place (:mod:`resilient.checkpoint.placed`): a format-4 file read block by block straight into the
live tensors, each block verified as it lands."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import resilient
from resilient.checkpoint.digest import BlockSpec
from resilient.checkpoint.manifest import SCHEMA_BLOCKS, FileEntry, Manifest
from resilient.checkpoint.placed import read_placed, walk_indices
from resilient.checkpoint.shard import parse_header, plan_layout
from resilient.checkpoint.storage import LocalStorage, RangeReader
from resilient.checkpoint.tree import flatten
from resilient.core.errors import CheckpointCorruptError

from .tiny import params, same, tiny_run, train

NAME = "step_0000000001"
DTYPES = [torch.float32, torch.float64, torch.int64, torch.bfloat16, torch.uint8, torch.bool]


def _commit(root, tree, block: int, rel: str = "rank00000.shard") -> tuple[LocalStorage, Manifest]:
    """``tree`` written as a one-file checkpoint of format 4 with blocks of ``block`` bytes."""
    storage = LocalStorage(root)
    skeleton, tensors = flatten(tree)
    layout = plan_layout(skeleton, tensors)
    data = bytearray(layout.data_bytes)
    for entry, t in zip(layout.entries, tensors):
        if entry.nbytes:
            data[entry.offset:entry.offset + entry.nbytes] = bytes(t.reshape(-1).view(torch.uint8).numpy())
    spec = BlockSpec(block_bytes=block)
    staging = storage.begin(NAME, "tok")
    got = storage.write_file(staging, rel, [memoryview(layout.header), memoryview(data)], spec)
    other = storage.write_file(staging, "replicated.shard", [memoryview(layout.header), memoryview(data)], spec)
    files = (FileEntry(rel, got.size, got.digest, 0, got.blocks),
             FileEntry("replicated.shard", other.size, other.digest, None, other.blocks))
    manifest = Manifest(name=NAME, step=1, world_size=1, files=files, parent=None, created_unix=0.0,
                        chunk_bytes=block, schema=SCHEMA_BLOCKS, digest_algorithm=spec.algorithm)
    storage.commit(staging, manifest.to_bytes())
    return storage, manifest


def _random_tree(draw) -> dict:
    tensors = {}
    for i in range(draw(st.integers(1, 8))):
        dtype = draw(st.sampled_from(DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 37), min_size=0, max_size=3)))
        t = (torch.rand(shape, dtype=torch.float64) * 200 - 100).to(dtype)
        tensors[f"t{i}"] = t
    return {"tensors": tensors, "meta": {"step": 3, "names": list(tensors)}}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), block=st.sampled_from([64, 128, 4096]), long_header=st.booleans())
def test_read_in_place_gives_the_saved_tree_and_fills_every_live_tensor_that_fits(tmp_path_factory, data, block,
                                                                                long_header):
    tree = _random_tree(data.draw)
    if long_header:  # a skeleton over several blocks: the header's blocks are all read and verified first
        tree["meta"]["padding"] = "x" * 3 * block
    storage, manifest = _commit(tmp_path_factory.mktemp("placed"), tree, block)
    live, kept = {}, {}
    for key, t in tree["tensors"].items():
        fits = data.draw(st.sampled_from(["same", "other shape", "none"]), label=f"live {key}")
        if fits == "same":
            live[("tensors", key)] = kept[key] = torch.zeros_like(t)
        elif fits == "other shape":
            live[("tensors", key)] = torch.zeros(t.numel() + 1, dtype=t.dtype)
    got = read_placed(storage, manifest, manifest.file_for(0), live)
    assert got.read_bytes == manifest.file_for(0).size
    assert got.tree["meta"] == tree["meta"]
    for key, t in tree["tensors"].items():
        assert got.tree["tensors"][key].dtype == t.dtype and torch.equal(got.tree["tensors"][key], t)
        if key in kept:
            assert torch.equal(kept[key], t)
            if t.numel():
                assert got.tree["tensors"][key].data_ptr() == kept[key].data_ptr(), "read into the live tensor"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), block=st.sampled_from([64, 256, 4096]))
def test_a_read_of_some_tensors_reads_only_the_blocks_that_hold_them(tmp_path_factory, data, block):
    """A sharded rank reads only its chunks of a peer's file: the wanted tensors come back whole and verified,
    the rest as empty placeholders, and no block that holds none of them past the header's is read."""
    tree = _random_tree(data.draw)
    storage, manifest = _commit(tmp_path_factory.mktemp("partial"), tree, block)
    entry = manifest.file_for(0)
    names = sorted(tree["tensors"])
    wanted = data.draw(st.lists(st.sampled_from(names), unique=True), label="wanted")
    got = read_placed(storage, manifest, entry, {}, [("tensors", k) for k in wanted])
    for key, t in tree["tensors"].items():
        if key in wanted:
            assert torch.equal(got.tree["tensors"][key], t)
        else:
            assert got.tree["tensors"][key].numel() == 0
    raw = (Path(storage.root) / NAME / entry.path).read_bytes()
    header = parse_header(raw, len(raw))
    blocks = set(range(-(-header.data_start // block)))  # the header's, read and verified first
    paths = dict(walk_indices(header.skeleton, len(header.entries)))
    for i, e in enumerate(header.entries):
        if e.nbytes and paths[i][-1] in wanted:
            start = header.data_start + e.offset
            blocks |= set(range(start // block, (start + e.nbytes - 1) // block + 1))
    assert got.read_bytes == sum(min(len(raw), (b + 1) * block) - b * block for b in blocks)


def test_a_damaged_block_names_itself_and_a_missing_file_is_missing(tmp_path):
    tree = {"w": torch.arange(4096, dtype=torch.float32)}
    storage, manifest = _commit(tmp_path, tree, 4096)
    path = tmp_path / NAME / "rank00000.shard"
    blob = bytearray(path.read_bytes())
    blob[3 * 4096 + 5] ^= 0x10
    path.write_bytes(bytes(blob))
    with pytest.raises(CheckpointCorruptError, match=r"in block 3 of 5 \(bytes 12288\.\.16384\)"):
        read_placed(storage, manifest, manifest.file_for(0), {})
    path.write_bytes(bytes(blob[:-1]))
    with pytest.raises(CheckpointCorruptError, match="truncated"):
        read_placed(storage, manifest, manifest.file_for(0), {})
    path.unlink()
    with pytest.raises(CheckpointCorruptError, match="file is missing"):
        read_placed(storage, manifest, manifest.file_for(0), {})


def test_a_store_without_ranged_reads_serves_ranges_from_one_whole_read(tmp_path):
    """The default reader (S3 today) gives the same bytes as the local one's scatter reads."""
    tree = {"w": torch.randn(3000), "b": torch.arange(7)}
    storage, manifest = _commit(tmp_path, tree, 512)
    entry = manifest.file_for(0)
    whole = (tmp_path / NAME / entry.path).read_bytes()
    for reader in (storage.open_ranges(NAME, entry.path), RangeReader(whole)):
        a, b = bytearray(100), bytearray(37)
        assert reader.readinto(1000, [memoryview(a), memoryview(b)]) == 137
        assert bytes(a + b) == whole[1000:1137]
        assert reader.readinto(len(whole) - 10, [memoryview(bytearray(50))]) == 10
        reader.close()


def test_a_restore_reads_in_place_and_a_fallback_overwrites_a_damaged_read(tmp_path, monkeypatch):
    """The Run's restore of a local format-4 checkpoint never reads a file whole into new memory; when the
    newest checkpoint's last block is damaged after its first blocks landed in the live tensors, the previous
    commit is restored over them, bitwise."""
    url = str(tmp_path / "ckpt")
    run = tiny_run(url, hidden=256, chunk_bytes=4096)
    train(run, 3)
    run.close()
    after_3 = params(run)
    train(run, 6)
    run.close()
    after_6 = params(run)

    def whole_read(self, name, path, spec):
        raise AssertionError(f"{name}/{path} was read whole")

    monkeypatch.setattr(LocalStorage, "read_file", whole_read)
    resumed = tiny_run(url, hidden=256, chunk_bytes=4096)
    assert resumed.restored_from == "step_0000000006" and same(params(resumed), after_6)
    replicated = tmp_path / "ckpt" / "step_0000000006" / "replicated.shard"
    blob = bytearray(replicated.read_bytes())
    blob[-1] ^= 0x01
    replicated.write_bytes(bytes(blob))
    events = resilient.EventLog()
    again = tiny_run(url, hidden=256, chunk_bytes=4096, events=events)
    assert again.restored_from == "step_0000000003" and same(params(again), after_3)
    (quarantined,) = events.of_kind("checkpoint_quarantined")
    assert "replicated.shard: digest mismatch" in quarantined.fields["reason"]


def test_no_read_lands_after_a_damaged_block_fails_the_file(tmp_path):
    """A block found damaged while later blocks are still being read: the read waits for them all before it
    raises, so nothing lands in a live tensor once the restore has moved on (a fallback writes there next) and
    the reader is never used after it is closed."""
    _, manifest = _commit(tmp_path, {"w": torch.arange(8192, dtype=torch.float32)}, 4096)
    path = tmp_path / NAME / "rank00000.shard"
    blob = bytearray(path.read_bytes())
    blob[4096 + 1] ^= 0x01  # block 1, the first read after the header's
    path.write_bytes(bytes(blob))
    landed: list[int] = []
    closed: list[bool] = []

    class Slow(LocalStorage):
        def open_ranges(self, name, path):
            reader = super().open_ranges(name, path)
            read, close = reader.readinto, reader.close

            def slow(offset, views):
                if offset >= 2 * 4096:
                    threading.Event().wait(0.2)  # the later blocks are still in flight when block 1 fails
                n = read(offset, views)
                landed.append(offset)
                assert not closed, "read after close"
                return n

            def closing():
                closed.append(True)
                close()

            reader.readinto, reader.close = slow, closing
            return reader

    with pytest.raises(CheckpointCorruptError, match="block 1 of"):
        read_placed(Slow(tmp_path), manifest, manifest.file_for(0), {})
    raised_with = sorted(landed)
    threading.Event().wait(0.5)
    assert sorted(landed) == raised_with == [b * 4096 for b in range(9)], "a read landed after the raise"
