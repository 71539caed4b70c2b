"""Tensor helpers that need no numpy (PyTorch's CPU wheel does not bring it, and an agent image may lack it)."""

from __future__ import annotations

import ctypes
from typing import Any


def tensor_bytes(t: Any) -> bytes:
    """The raw bytes of ``t``'s elements in row-major order (a contiguous CPU copy of it; any dtype)."""
    c = t.detach().cpu().contiguous()
    size = c.numel() * c.element_size()
    return ctypes.string_at(c.data_ptr(), size) if size else b""
