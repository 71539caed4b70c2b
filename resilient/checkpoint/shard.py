"""The shard file format: a JSON header followed by raw tensor bytes.

Layout::

    b"RSLSHRD1"                 8-byte magic
    header length               8-byte little-endian unsigned
    header                      UTF-8 JSON: skeleton + tensor table
    zero padding                up to a 64-byte boundary
    data                        tensor bytes at 64-byte-aligned offsets

The skeleton comes from :mod:`resilient.checkpoint.tree`; each tensor entry
gives dtype, shape, offset and byte count within the data section.  Reading
checks the header's byte size and nesting depth before parsing it, then its
tensor count and every entry against the file before touching the bytes,
so a damaged or hostile header is reported (``ValueError``), never trusted
and never a crash.
"""

from __future__ import annotations

import json
import mmap
import re
import struct
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import torch

from .tree import MAX_DEPTH

MAGIC = b"RSLSHRD1"
ALIGN = 64
FORMAT_VERSION = 1
MAX_HEADER_BYTES = 1 << 30
"""Largest header read: far above any real one (about 100 bytes per tensor plus the skeleton)."""
MAX_HEADER_DEPTH = MAX_DEPTH + 4  # the skeleton sits inside {"skeleton": ...}; shapes are [..] in {..} in [..]
MAX_TENSORS = 1 << 24
MAX_DIMS = 64
_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"')
_BRACKETS = bytes.maketrans(b"[{]}", b"\x01\x01\x02\x02")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[{]}")

DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
for _name in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64"):
    if hasattr(torch, _name):
        DTYPES[_name] = getattr(torch, _name)
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class ShardLayout:
    """Where each tensor goes in the data section, and the encoded header."""

    header: bytes
    entries: tuple[TensorEntry, ...]
    data_bytes: int


def plan_layout(skeleton: Any, tensors: list[torch.Tensor]) -> ShardLayout:
    """Assign aligned offsets to ``tensors`` and encode the header (with padding)."""
    entries = []
    offset = 0
    for t in tensors:
        if t.dtype not in DTYPE_NAMES:
            raise TypeError(f"tensor dtype {t.dtype} cannot be checkpointed")
        nbytes = t.numel() * t.element_size()
        entries.append(TensorEntry(DTYPE_NAMES[t.dtype], tuple(t.shape), offset, nbytes))
        offset = _align(offset + nbytes)
    table = [{"dtype": e.dtype, "shape": list(e.shape), "offset": e.offset, "nbytes": e.nbytes} for e in entries]
    body = json.dumps(
        {"format": FORMAT_VERSION, "skeleton": skeleton, "tensors": table, "data_bytes": offset},
        separators=(",", ":"),
    ).encode()
    prefix = MAGIC + struct.pack("<Q", len(body)) + body
    header = prefix + b"\0" * (_align(len(prefix)) - len(prefix))
    return ShardLayout(header=header, entries=tuple(entries), data_bytes=offset)


@dataclass(frozen=True)
class Header:
    """A shard's parsed and checked header: where each tensor's bytes are."""

    skeleton: Any
    entries: tuple[TensorEntry, ...]
    data_start: int
    """Offset of the data section in the file."""


def header_end(prefix: bytes | bytearray | memoryview) -> int:
    """Where the data section starts, from the file's first 16 bytes (ValueError: not a shard file)."""
    view = memoryview(prefix).cast("B")
    if len(view) < 16 or bytes(view[:8]) != MAGIC:
        raise ValueError("not a shard file (bad magic bytes)")
    (hlen,) = struct.unpack("<Q", view[8:16])
    if hlen > MAX_HEADER_BYTES:
        raise ValueError(f"header of {hlen} bytes is larger than the {MAX_HEADER_BYTES} a shard may have")
    return _align(16 + hlen)


def parse_header(buf: bytes | bytearray | memoryview | mmap.mmap, file_size: int) -> Header:
    """Parse and check the header at the start of ``buf`` (which holds at least its bytes) of a shard of
    ``file_size`` bytes: every entry fits the data section, which ends where the file does.

    Raises ``ValueError`` describing the first inconsistency found.
    """
    view = memoryview(buf).cast("B")
    header_end(view)
    (hlen,) = struct.unpack("<Q", view[8:16])
    if 16 + hlen > min(len(view), file_size):
        raise ValueError(f"header length {hlen} runs past the end of the file")
    raw = bytes(view[16 : 16 + hlen])
    depth = nesting_depth(raw)
    if depth > MAX_HEADER_DEPTH:
        raise ValueError(f"header nests {depth} levels deep, more than the {MAX_HEADER_DEPTH} a shard may have")
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"header is not valid JSON ({e})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT_VERSION:
        raise ValueError(f"unsupported shard format {header.get('format') if isinstance(header, dict) else header!r}")
    data_start = _align(16 + hlen)
    data_bytes = header.get("data_bytes")
    if not isinstance(data_bytes, int) or data_start + data_bytes != file_size:
        raise ValueError(f"file is {file_size} bytes but its header describes {data_start}+{data_bytes}")
    table = header.get("tensors")
    if not isinstance(table, list):
        raise ValueError("tensor table missing")  # noqa: TRY004  a content problem, reported as ValueError like all
    if len(table) > MAX_TENSORS:
        raise ValueError(f"tensor table lists {len(table)} tensors, more than the {MAX_TENSORS} a shard may have")
    entries = tuple(_entry(data_bytes, i, entry) for i, entry in enumerate(table))
    return Header(header.get("skeleton"), entries, data_start)


def decode(buf: bytearray | memoryview | mmap.mmap) -> tuple[Any, list[torch.Tensor]]:
    """Parse a whole shard held in a writable buffer; tensors alias ``buf``.

    Raises ``ValueError`` describing the first inconsistency found.
    """
    header = parse_header(buf, len(memoryview(buf)))
    return header.skeleton, [_tensor_at(buf, header.data_start, e) for e in header.entries]


def _entry(data_bytes: int, i: int, e: Any) -> TensorEntry:
    if not isinstance(e, dict) or e.get("dtype") not in DTYPES:
        raise ValueError(f"tensor {i}: unknown dtype {e.get('dtype') if isinstance(e, dict) else e!r}")
    shape, offset, nbytes = e.get("shape"), e.get("offset"), e.get("nbytes")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise ValueError(f"tensor {i}: bad shape {shape!r}")
    if not isinstance(offset, int) or not isinstance(nbytes, int) or offset < 0 or offset % ALIGN:
        raise ValueError(f"tensor {i}: bad offset {offset!r}")
    numel = 1
    for s in shape:
        numel *= s
    if numel * DTYPES[e["dtype"]].itemsize != nbytes or offset + nbytes > data_bytes:
        raise ValueError(f"tensor {i}: {nbytes} bytes at {offset} do not fit shape {shape} of {e['dtype']}")
    return TensorEntry(e["dtype"], tuple(shape), offset, nbytes)


def _tensor_at(buf: Any, data_start: int, e: TensorEntry) -> torch.Tensor:
    dtype = DTYPES[e.dtype]
    if e.nbytes == 0:
        return torch.empty(e.shape, dtype=dtype)
    flat = torch.frombuffer(buf, dtype=torch.uint8, count=e.nbytes, offset=data_start + e.offset)
    return flat.view(dtype).view(e.shape)


def nesting_depth(raw: bytes) -> int:
    """Deepest bracket nesting of JSON text, counted without parsing it (strings skipped).

    Unbalanced text may count wrong; it then fails to parse anyway.
    """
    brackets = _STRINGS.sub(b"", raw).translate(_BRACKETS, _NOT_BRACKETS)
    if not brackets:
        return 0
    return max(accumulate(1 if b == 1 else -1 for b in brackets))
