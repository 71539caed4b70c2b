"""Pure pieces of the checkpoint format: state trees, shards, manifests, retention, config."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from resilient.checkpoint.config import CheckpointConfig
from resilient.checkpoint.manifest import FileEntry, Manifest, is_safe_relpath, parse_manifest
from resilient.checkpoint.retention import decide_retention
from resilient.checkpoint.shard import decode
from resilient.checkpoint.snapshot import HostBuffer, take_snapshots
from resilient.checkpoint.tree import flatten, unflatten
from resilient.core.errors import CheckpointCorruptError, ConfigError, SerializationError

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int8, torch.bool,
          torch.uint8]

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**63 - 1), st.floats(allow_nan=False), st.text(max_size=8)
)
tensors = st.builds(
    lambda dtype, shape, seed: (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 100).to(dtype),
    st.sampled_from(DTYPES),
    st.lists(st.integers(0, 4), max_size=3).map(tuple),
    st.integers(0, 1000),
)
keys = st.one_of(st.text(max_size=6), st.integers(-5, 5), st.tuples(st.integers(0, 3), st.text(max_size=3)))
trees = st.recursive(
    st.one_of(scalars, tensors),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(keys, inner, max_size=4),
    ),
    max_leaves=12,
)


def assert_tree_equal(a, b):
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_tree_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_tree_equal(x, y)
    else:
        assert a == b


@settings(max_examples=150, deadline=None)
@given(tree=trees)
def test_state_trees_round_trip_through_a_shard_bit_for_bit(tree):
    snaps = take_snapshots({"x": {"root": tree}}, HostBuffer())
    blob = bytearray(snaps["x"].header) + bytearray(snaps["x"].data)
    skeleton, tensors_ = decode(blob)
    assert_tree_equal(unflatten(skeleton, tensors_), {"root": tree})


def test_snapshot_is_independent_of_later_training():
    live = torch.ones(1000)
    snaps = take_snapshots({"x": {"w": live}}, HostBuffer())
    live.add_(1)  # the optimizer moves on after the snapshot
    skeleton, tensors_ = decode(bytearray(snaps["x"].header) + bytearray(snaps["x"].data))
    assert torch.equal(unflatten(skeleton, tensors_)["w"], torch.ones(1000))


def test_unsupported_object_names_its_path():
    with pytest.raises(SerializationError, match=r"state\.opt\.hook: objects of type function"):
        flatten({"opt": {"hook": lambda: None}})


@pytest.mark.parametrize("blob", [b"", b"RSLSHRD1", b"XXXXXXXX" + bytes(8), b"RSLSHRD1" + (10**6).to_bytes(8, "little")])
def test_malformed_shards_are_rejected(blob):
    with pytest.raises(ValueError):
        decode(bytearray(blob))


@pytest.mark.parametrize(
    ("path", "ok"),
    [("rank00000.shard", True), ("tok/rank1.shard", True), ("../x", False), ("/abs", False), ("a/../b", False),
     ("", False), ("a//b", False), (".", False), ("a\\b", False), ("./a", False)],
)
def test_only_plain_relative_paths_are_safe(path, ok):
    assert is_safe_relpath(path) is ok


@settings(max_examples=50, deadline=None)
@given(step=st.integers(0, 10**9), world=st.integers(1, 6), size=st.integers(0, 2**40),
       created=st.floats(0, 2e9, allow_nan=False))
def test_manifests_round_trip(step, world, size, created):
    files = [FileEntry("replicated.shard", size, "a" * 64, None)] + [
        FileEntry(f"rank{r:05d}.shard", size + r, "b" * 64, r) for r in range(world)
    ]
    m = Manifest(name=f"step_{step:010d}", step=step, world_size=world, files=tuple(files), parent=None,
                 created_unix=created, chunk_bytes=1 << 20, fingerprint={"model": "x"}, counters={"step": step})
    assert parse_manifest(m.to_bytes(), m.name) == m
    with pytest.raises(CheckpointCorruptError):
        parse_manifest(m.to_bytes(), f"step_{step + 1:010d}")


def test_retention_keeps_newest_permanent_and_newest_verified():
    names = [f"step_{s:010d}" for s in (10, 20, 30, 40, 50)]
    d = decide_retention(names, keep=2, permanent_every=20, newest_verified="step_0000000010")
    assert d.keep == ("step_0000000010", "step_0000000020", "step_0000000040", "step_0000000050")
    assert d.delete == ("step_0000000030",)
    assert "newest verified step_0000000010" in d.reason


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"every_steps": 0}, "every_steps"), ({"keep": 0}, "keep"), ({"permanent_every": -1}, "permanent_every"),
     ({"chunk_bytes": 10}, "chunk_bytes"), ({"timeout_s": 0}, "timeout_s"), ({"dir": ""}, "dir is empty")],
)
def test_config_errors_name_the_setting(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        CheckpointConfig(**{"dir": "ckpt", **kwargs})


def test_importing_the_package_imports_neither_torch_nor_chaos():
    code = "import sys, resilient, resilient.core.errors; print('torch' in sys.modules, 'resilient.chaos' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
