"""Raw tensor bytes without numpy, as the workload's digest and a peer's state sync use them."""

from __future__ import annotations

import numpy
import torch

from resilient.core.tensors import tensor_bytes


def test_tensor_bytes_are_the_elements_in_row_major_order_for_every_dtype():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    for dtype in (torch.float32, torch.float64, torch.float16, torch.int64, torch.uint8, torch.bool):
        t = (base % 2 if dtype is torch.bool else base).to(dtype)
        assert tensor_bytes(t) == t.numpy().tobytes(), dtype
    bf16 = base.to(torch.bfloat16)
    assert tensor_bytes(bf16) == bf16.view(torch.int16).numpy().tobytes()
    strided = base.t()  # not contiguous: its elements in its own row-major order
    assert tensor_bytes(strided) == numpy.ascontiguousarray(strided.numpy()).tobytes()
    assert tensor_bytes(base[1:3, 2:4]) == base[1:3, 2:4].contiguous().numpy().tobytes()
    assert tensor_bytes(torch.empty(0)) == b""
