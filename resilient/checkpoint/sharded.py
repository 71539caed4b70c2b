"""Sharded state (FSDP2, DTensor, HSDP) inside the same checkpoint files and commit.

A sharded model's state dict (``get_state_dict``) holds DTensors: each rank
owns a chunk (offsets and sizes in the global tensor) of every parameter
and optimizer state tensor.  Saving splits the state into

* the *replicated tree*: the state dicts with every DTensor replaced by
  ``None``, saved once by rank 0 (param groups, step counters, unsharded
  buffers);
* this rank's *local chunks*: plain tensors written into its own rank file
  (under ``"shards"``), one per DTensor whose chunk it writes.  A chunk held
  by several ranks (HSDP replicas) is written by one of them only;
* its *chunk table*: JSON describing those chunks (rank 0's lists every
  DTensor, so that even an empty one is known).  Rank 0 merges every
  rank's table into the checkpoint's index (``sharded.index``, a shard file
  without tensors, listed in the manifest), checking that the chunks cover
  every tensor exactly.

Restoring at any world size or mesh takes DCP's resharding plan
(``create_default_local_load_plan``) of the live model's DTensors against
the index, reads and verifies only the rank files the plan needs, and
copies the overlapping regions; where a saved chunk is exactly the chunk
this rank needs, the tensor is used as read, without a copy.  Nothing here
unpickles: the index is JSON in our shard format, the chunks raw tensors.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..core.errors import CheckpointMismatchError, ConfigError
from .shard import DTYPE_NAMES, DTYPES

SHARDS = "shards"
"""Key of this rank's local chunks in its rank tree."""
INDEX = "shard_index"
"""Payload key of this rank's chunk table (taken out before the snapshot; merged on rank 0)."""
INDEX_FILE = "sharded.index"
INDEX_FORMAT = 1


def is_dtensor(obj: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(obj, DTensor)


def is_sharded(model: torch.nn.Module) -> bool:
    """True when any parameter of ``model`` is a DTensor (FSDP2 ``fully_shard``, tensor parallel, HSDP)."""
    return any(is_dtensor(p) for p in model.parameters())


def walk(tree: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """Every leaf of a tree of dicts, lists and tuples with its key path."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from walk(value, (*path, key))
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            yield from walk(value, (*path, i))
    else:
        yield path, tree


def key_of(path: tuple[Any, ...]) -> str:
    """The index key of a leaf: its key path as JSON (fqns contain dots, so no dotted names)."""
    return json.dumps(list(path), separators=(",", ":"))


def _replace(tree: Any, keep: Any) -> Any:
    """``tree`` with every leaf ``x`` replaced by ``keep(path, x)``."""

    def go(node: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(node, dict):
            return {k: go(v, (*path, k)) for k, v in node.items()}
        if isinstance(node, list):
            return [go(v, (*path, i)) for i, v in enumerate(node)]
        if isinstance(node, tuple):
            return tuple(go(v, (*path, i)) for i, v in enumerate(node))
        return keep(path, node)

    return go(tree, ())


@dataclass(frozen=True)
class Split:
    replicated: Any
    """The tree with every DTensor replaced by None."""
    local: list[torch.Tensor]
    """The chunks this rank writes, in table order."""
    table: list[dict[str, Any]]
    """One entry per chunk this rank writes, and on rank 0 one per DTensor (with ``item`` None where it
    writes nothing)."""


def split(tree: Any, rank: int) -> Split:
    """Split a state tree holding DTensors (see the module docstring)."""
    local: list[torch.Tensor] = []
    table: list[dict[str, Any]] = []
    ordinal = 0

    def keep(path: tuple[Any, ...], leaf: Any) -> Any:
        nonlocal ordinal
        if not is_dtensor(leaf):
            return leaf
        if leaf.dtype not in DTYPE_NAMES:
            raise ConfigError(f"cannot save {key_of(path)}: dtype {leaf.dtype} is not supported in checkpoints")
        chunks = leaf.__create_chunk_list__()  # what DCP writes for it: this rank's chunk of the global tensor
        if len(chunks) != 1:
            raise ConfigError(f"cannot save {key_of(path)}: a DTensor with {len(chunks)} local chunks")
        chunk = chunks[0]
        entry: dict[str, Any] = {"key": key_of(path), "dtype": DTYPE_NAMES[leaf.dtype], "shape": list(leaf.shape),
                                 "placements": [str(p) for p in leaf.placements],
                                 "mesh": list(leaf.device_mesh.shape), "offsets": list(chunk.offsets),
                                 "sizes": list(chunk.sizes), "item": None}
        if _writes(leaf, ordinal) and leaf.to_local().numel() > 0:
            entry["item"] = len(local)
            local.append(leaf.to_local())
        ordinal += 1
        if entry["item"] is not None or rank == 0:
            table.append(entry)
        return None

    replicated = _replace(tree, keep)
    return Split(replicated, local, table)


LAYOUT = "shard_layout"
"""Key of the layout of a rank's local tensors in its memory-tier rank tree (:func:`split_local`)."""


def _layout_of(dt: Any) -> dict[str, Any]:
    chunks = dt.__create_chunk_list__()
    if len(chunks) != 1:
        raise ConfigError(f"cannot keep a DTensor with {len(chunks)} local chunks")
    return {"dtype": DTYPE_NAMES.get(dt.dtype, str(dt.dtype)), "shape": list(dt.shape),
            "placements": [str(p) for p in dt.placements], "mesh": list(dt.device_mesh.shape),
            "offsets": list(chunks[0].offsets), "sizes": list(chunks[0].sizes)}


def split_local(tree: Any) -> tuple[Any, list[torch.Tensor], list[dict[str, Any]]]:
    """The memory tier's split of a state tree holding DTensors: the replicated tree (every DTensor None), and
    every DTensor's local tensor on this rank with its layout, whether or not this rank writes that chunk to a
    durable checkpoint (a restart at the same world and mesh puts each back where it was, with no reshard)."""
    local: list[torch.Tensor] = []
    layout: list[dict[str, Any]] = []

    def keep(path: tuple[Any, ...], leaf: Any) -> Any:
        if not is_dtensor(leaf):
            return leaf
        layout.append({"key": key_of(path), **_layout_of(leaf)})
        local.append(leaf.to_local())
        return None

    return _replace(tree, keep), local, layout


def put_back_local(targets: dict[str, Any], local: list[Any], layout: list[Any]) -> dict[str, Any]:
    """New DTensors like ``targets`` (the live ones, by key) holding a rank's local tensors as
    :func:`split_local` kept them.  Raises ValueError naming the first difference when they were kept under
    another layout (another mesh, world or model): the caller restores from the durable tier then."""
    from torch.distributed.tensor import DTensor

    if not isinstance(local, list) or not isinstance(layout, list) or len(local) != len(layout):
        raise ValueError("the kept local tensors do not match their layout")
    kept = {str(entry.get("key")): (entry, tensor) for entry, tensor in zip(layout, local) if isinstance(entry, dict)}
    if set(kept) != set(targets):
        raise ValueError(f"kept {len(kept)} sharded tensors, the live state has {len(targets)} (another model)")
    out = {}
    for key, target in targets.items():
        entry, tensor = kept[key]
        live = _layout_of(target)
        saved = {name: entry.get(name) for name in live}
        if saved != live:
            raise ValueError(f"{key} was kept as {saved}, the live tensor is {live}")
        if not isinstance(tensor, torch.Tensor) or tensor.shape != target.to_local().shape:
            raise ValueError(f"{key}: the kept local tensor is not {list(target.to_local().shape)}")
        out[key] = DTensor.from_local(tensor.to(target.device), target.device_mesh, target.placements,
                                      run_check=False, shape=target.shape, stride=target.stride())
    return out


def _writes(dt: Any, ordinal: int) -> bool:
    """Whether this rank writes its chunk of ``dt``: along every mesh dimension that replicates it, the
    replica at coordinate ``ordinal % size`` writes, so replicas share the writing."""
    if any(p.is_partial() for p in dt.placements):  # on every rank alike, before anything else
        raise ConfigError("cannot save a DTensor with a Partial placement: reduce it first")
    coordinate = dt.device_mesh.get_coordinate()
    if coordinate is None:
        return False
    for dim, placement in enumerate(dt.placements):
        if placement.is_shard():
            continue
        if coordinate[dim] != ordinal % dt.device_mesh.shape[dim]:
            return False
    return True


def merge(tables: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Every rank's chunk table -> the checkpoint's index; raises ConfigError if they do not fit together."""
    tensors: dict[str, dict[str, Any]] = {}
    for rank, table in enumerate(tables):
        for e in table:
            t = tensors.setdefault(e["key"], {"key": e["key"], "dtype": e["dtype"], "shape": e["shape"],
                                              "placements": e["placements"], "mesh": e["mesh"], "chunks": []})
            if (t["dtype"], t["shape"]) != (e["dtype"], e["shape"]):
                raise ConfigError(f"{e['key']}: rank {rank} holds {e['dtype']}{e['shape']}, another rank "
                                  f"{t['dtype']}{t['shape']}; every rank must hold the same state")
            if e["item"] is not None:
                t["chunks"].append({"offsets": e["offsets"], "sizes": e["sizes"], "rank": rank, "item": e["item"]})
    for t in tensors.values():
        covered = sum(_numel(c["sizes"]) for c in t["chunks"])
        if covered != _numel(t["shape"]):
            raise ConfigError(f"{t['key']}: the ranks' chunks hold {covered} of its {_numel(t['shape'])} elements; "
                              "every element must be saved by exactly one rank")
    return {"format": INDEX_FORMAT, "tensors": list(tensors.values())}


def _numel(sizes: list[int]) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


@dataclass(frozen=True)
class Chunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    rank: int
    item: int


@dataclass(frozen=True)
class Saved:
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    placements: tuple[str, ...]
    mesh: tuple[int, ...]
    chunks: tuple[Chunk, ...]


def parse_index(tree: Any, world_size: int) -> dict[str, Saved]:
    """The index as saved; raises ValueError on anything malformed (the file is then corrupt)."""
    if not isinstance(tree, dict) or tree.get("format") != INDEX_FORMAT or not isinstance(tree.get("tensors"), list):
        raise ValueError(f"not a sharded index of format {INDEX_FORMAT}")
    out: dict[str, Saved] = {}
    items: set[tuple[int, int]] = set()
    for t in tree["tensors"]:
        try:
            key = t["key"]
            if not isinstance(key, str) or not isinstance(json.loads(key), list) or key in out:
                raise ValueError(f"key {key!r} is not a new JSON key path")
            shape = _ints(t["shape"])
            chunks = []
            for c in t["chunks"]:
                offsets, sizes = _ints(c["offsets"]), _ints(c["sizes"])
                rank, item = _ints([c["rank"], c["item"]])
                if len(offsets) != len(shape) or len(sizes) != len(shape) or any(
                        o + s > g for o, s, g in zip(offsets, sizes, shape)):
                    raise ValueError(f"chunk {offsets}+{sizes} outside shape {shape}")
                if rank >= world_size or (rank, item) in items:
                    raise ValueError(f"chunk of rank {rank} item {item}: no such rank, or listed twice")
                items.add((rank, item))
                chunks.append(Chunk(offsets, sizes, rank, item))
            if not isinstance(t["placements"], list) or t["dtype"] not in DTYPES:
                raise ValueError(f"placements {t['placements']!r} or dtype {t['dtype']!r}")
            saved = Saved(key, DTYPES[t["dtype"]], shape, tuple(map(str, t["placements"])), _ints(t["mesh"]),
                          tuple(chunks))
        except (KeyError, TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"malformed index entry ({type(e).__name__}: {e})") from None
        if len({c.offsets for c in saved.chunks}) != len(saved.chunks):
            raise ValueError(f"{saved.key}: two chunks at the same offsets")
        if sum(_numel(list(c.sizes)) for c in saved.chunks) != _numel(list(shape)):
            raise ValueError(f"{saved.key}: its chunks do not cover the tensor")
        out[saved.key] = saved
    return out


def _ints(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                              for v in value):
        raise ValueError(f"{value!r} is not a list of non-negative integers")
    return tuple(value)


def targets_of(tree: Any) -> dict[str, Any]:
    """The DTensors of a live state tree by index key: what a restore fills."""
    return {key_of(path): leaf for path, leaf in walk(tree) if is_dtensor(leaf)}


def read_plan(index: dict[str, Saved], targets: dict[str, Any], checkpoint: str) -> list[Any]:
    """DCP's resharding plan: the reads that fill each target's local chunk from the saved chunks."""
    from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    missing = sorted(set(targets) - set(index))
    extra = sorted(set(index) - set(targets))
    if missing or extra:
        raise CheckpointMismatchError(
            f"checkpoint {checkpoint} does not fit this model's sharded state (missing {missing[:5]}, "
            f"unexpected {extra[:5]}); restore it with the model and optimizer it was trained with")
    for key, dt in targets.items():
        saved = index[key]
        if tuple(dt.shape) != saved.shape or dt.dtype != saved.dtype:
            raise CheckpointMismatchError(
                f"checkpoint {checkpoint}: {key} was saved as {saved.dtype}{list(saved.shape)} but this model has "
                f"{dt.dtype}{list(dt.shape)}; restore it with the model configuration it was trained with")
    metadata = Metadata(state_dict_metadata={
        key: TensorStorageMetadata(
            properties=TensorProperties(dtype=saved.dtype), size=torch.Size(saved.shape),
            chunks=[ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes))
                    for c in saved.chunks])
        for key, saved in index.items()})
    return list(create_default_local_load_plan(targets, metadata).items)


def chunks_needed(index: dict[str, Saved], plan: list[Any]) -> dict[int, set[int]]:
    """The saved chunks ``plan`` reads: by saved rank (whose file holds them), their items."""
    by_offsets = _chunks_by_offsets(index)
    out: dict[int, set[int]] = {}
    for item in plan:
        chunk = by_offsets[(item.storage_index.fqn, tuple(item.storage_index.offset))]
        out.setdefault(chunk.rank, set()).add(chunk.item)
    return out


def _chunks_by_offsets(index: dict[str, Saved]) -> dict[tuple[str, tuple[int, ...]], Chunk]:
    return {(key, c.offsets): c for key, saved in index.items() for c in saved.chunks}


def in_place(index: dict[str, Saved], targets: dict[str, Any], plan: list[Any]) -> dict[int, dict[Any, Any]]:
    """Where a saved chunk is exactly a target's local chunk, that local tensor as the place to read it into:
    by saved rank, the key path of the chunk in its rank file (``("shards", item)``) -> the live local tensor.
    :func:`assemble` then finds each such chunk already in place (as read, no copy)."""
    by_offsets = _chunks_by_offsets(index)
    out: dict[int, dict[Any, Any]] = {}
    for item in plan:
        key = item.dest_index.fqn
        local = targets[key].to_local()
        chunk = by_offsets[(key, tuple(item.storage_index.offset))]
        if tuple(item.lengths) == tuple(local.shape) == chunk.sizes and not any(item.dest_offsets):
            out.setdefault(chunk.rank, {})[(SHARDS, chunk.item)] = local
    return out


def assemble(index: dict[str, Saved], targets: dict[str, Any], plan: list[Any], files: dict[int, Any],
             checkpoint: str) -> dict[str, Any]:
    """New DTensors like ``targets``, their local chunks filled by ``plan`` from the decoded rank ``files``.

    Raises ValueError when a file's chunk does not have the shape and dtype
    the index gives it (the checkpoint is then corrupt).
    """
    from torch.distributed.tensor import DTensor

    by_offsets = _chunks_by_offsets(index)
    reads: dict[str, list[Any]] = {}
    for item in plan:
        reads.setdefault(item.dest_index.fqn, []).append(item)
    out = {}
    for key, target in targets.items():
        want = tuple(target.to_local().shape)
        _check_fill(key, want, reads.get(key, []))
        local: torch.Tensor | None = None
        for item in reads.get(key, []):
            chunk = by_offsets[(key, tuple(item.storage_index.offset))]
            src = _chunk_tensor(files[chunk.rank], chunk, index[key].dtype, checkpoint, key)
            whole = tuple(item.lengths) == want == chunk.sizes and not any(item.dest_offsets)
            if whole and local is None:
                local = src  # exactly the chunk needed: as read, no copy
                continue
            if local is None:
                local = torch.empty(want, dtype=target.dtype)
            dst, part = local, src
            for dim, (d, s, n) in enumerate(zip(item.dest_offsets, item.storage_offsets, item.lengths)):
                dst, part = dst.narrow(dim, d, n), part.narrow(dim, s, n)
            dst.copy_(part)
        if local is None:
            local = torch.empty(want, dtype=target.dtype)  # an empty chunk: nothing to read
        out[key] = DTensor.from_local(local.to(target.device), target.device_mesh, target.placements,
                                      run_check=False, shape=target.shape, stride=target.stride())
    return out


def _check_fill(key: str, want: tuple[int, ...], reads: list[Any]) -> None:
    """The reads fill the local chunk exactly: disjoint regions whose volumes add up to it (else ValueError:
    the index has overlapping chunks, or a hole)."""
    boxes = [(tuple(r.dest_offsets), tuple(r.lengths)) for r in reads]
    if sum(_numel(list(n)) for _, n in boxes) != _numel(list(want)):
        raise ValueError(f"the saved chunks of {key} do not fill this rank's chunk {list(want)} exactly")
    for i, (a, m) in enumerate(boxes):
        for b, n in boxes[i + 1:]:
            if all(x < y + k and y < x + j for x, j, y, k in zip(a, m, b, n)) and _numel(list(m)) and _numel(list(n)):
                raise ValueError(f"saved chunks of {key} overlap")


def _chunk_tensor(tree: Any, chunk: Chunk, dtype: torch.dtype, checkpoint: str, key: str) -> torch.Tensor:
    shards = tree.get(SHARDS) if isinstance(tree, dict) else None
    if not isinstance(shards, list) or chunk.item >= len(shards) or not isinstance(shards[chunk.item], torch.Tensor):
        raise ValueError(f"rank file {chunk.rank} has no chunk {chunk.item} for {key}")
    t = shards[chunk.item]
    if tuple(t.shape) != chunk.sizes or t.dtype != dtype:
        raise ValueError(f"rank file {chunk.rank} chunk {chunk.item} is {t.dtype}{list(t.shape)}, the index says "
                         f"{dtype}{list(chunk.sizes)} for {key}")
    return t


def rebuild(replicated: Any, filled: dict[str, Any]) -> Any:
    """The saved replicated tree with its DTensor places (None) filled from ``filled``."""
    return _replace(replicated, lambda path, leaf: filled.get(key_of(path), leaf) if leaf is None else leaf)
