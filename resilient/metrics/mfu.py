"""Model FLOPs utilisation: model FLOPs per step, the device's peak, and their ratio.

FLOPs per step come from the user, from :func:`count_flops` (one forward and
backward under ``torch.utils.flop_counter.FlopCounterMode``), or from
:func:`transformer_flops` (``6 * N * T``, plus ``12 * L * S * D * T`` for
attention when the shape is known).  The peak comes from ``peak_tflops=``
(labelled "configured peak") or from :data:`PEAKS`, keyed on the NVML device
name.  MFU is ``flops_per_step * steps / (seconds * peak)``: the work done
over what the devices could have done in that time.  :func:`account_mfu`
applies it to a ledger account, for the run and for the rolling window:
new (not replayed) steps over the seconds those steps took.  On a CPU, or a device the table does not know, there is no peak unless one
is configured, and MFU is None with the reason.

Importing this module imports neither torch nor pynvml.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..core.errors import ConfigError

DTYPES = ("bf16", "fp16", "tf32", "fp32")
_DTYPE_ALIASES = {
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16", "torch.half": "fp16",
    "tf32": "tf32",
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32", "torch.float": "fp32",
}


@dataclass(frozen=True)
class DevicePeak:
    """Dense (no sparsity) tensor-core peak TFLOP/s of one device, by dtype (None: not supported)."""

    name: str
    bf16: float | None
    fp16: float | None
    tf32: float | None
    fp32: float


# NVIDIA datasheet values, dense (the datasheets' "with sparsity" figures halved); fp32 is the non-tensor
# figure.  Patterns match NVML names such as "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "Tesla
# V100-SXM2-16GB"; the first match wins, so specific variants come before their family.
PEAKS: tuple[tuple[str, DevicePeak], ...] = (
    # B200 (HGX B200 datasheet, per GPU): FP16/BF16 4.5 PF sparse, TF32 2.2 PF sparse, FP32 75 TF.
    (r"\bB200\b", DevicePeak("B200", 2250.0, 2250.0, 1100.0, 75.0)),
    # H200 NVL (H200 datasheet): BF16/FP16 1671 TF sparse, TF32 835 TF sparse, FP32 60 TF.
    (r"\bH200\b.*\bNVL\b", DevicePeak("H200 NVL", 835.5, 835.5, 417.5, 60.0)),
    # H200 SXM (H200 datasheet): BF16/FP16 1979 TF sparse, TF32 989 TF sparse, FP32 67 TF.
    (r"\bH200\b", DevicePeak("H200 SXM", 989.4, 989.4, 494.7, 66.9)),
    # H100 NVL (H100 datasheet): BF16/FP16 1671 TF sparse, TF32 835 TF sparse, FP32 60 TF.
    (r"\bH100\b.*\bNVL\b", DevicePeak("H100 NVL", 835.5, 835.5, 417.5, 60.0)),
    # H100 PCIe (H100 datasheet): BF16/FP16 1513 TF sparse, TF32 756 TF sparse, FP32 51 TF.
    (r"\bH100\b.*\bPCIe\b", DevicePeak("H100 PCIe", 756.5, 756.5, 378.0, 51.2)),
    # H100 SXM (H100 datasheet; NVML "NVIDIA H100 80GB HBM3"): BF16/FP16 1979 TF sparse, TF32 989 sparse.
    (r"\bH100\b", DevicePeak("H100 SXM", 989.4, 989.4, 494.7, 66.9)),
    # A100 40 GB and 80 GB, SXM and PCIe (A100 datasheet): BF16/FP16 312 TF, TF32 156 TF, FP32 19.5 TF.
    (r"\bA100\b", DevicePeak("A100", 312.0, 312.0, 156.0, 19.5)),
    # L40S (L40S datasheet): BF16/FP16 733 TF sparse, TF32 366 TF sparse, FP32 91.6 TF.
    (r"\bL40S\b", DevicePeak("L40S", 362.05, 362.05, 183.0, 91.6)),
    # L40 (L40 datasheet): BF16/FP16 362 TF sparse, TF32 181 TF sparse, FP32 90.5 TF.
    (r"\bL40\b", DevicePeak("L40", 181.0, 181.0, 90.5, 90.5)),
    # L4 (L4 datasheet): BF16/FP16 242 TF sparse, TF32 120 TF sparse, FP32 30.3 TF.
    (r"\bL4\b", DevicePeak("L4", 121.0, 121.0, 60.0, 30.3)),
    # A10G (AWS g5): NVIDIA publishes no separate datasheet; the A10's is used (below).
    # A10 (A10 datasheet): BF16/FP16 250 TF sparse, TF32 125 TF sparse, FP32 31.2 TF.
    (r"\bA10G?\b", DevicePeak("A10", 125.0, 125.0, 62.5, 31.2)),
    # V100 (V100 datasheet): tensor FP16 125 (SXM2) / 112 (PCIe) / 130 (V100S) TF; no bf16 or tf32.
    (r"\bV100S\b", DevicePeak("V100S", None, 130.0, None, 16.4)),
    (r"\bV100\b.*\bPCIE\b", DevicePeak("V100 PCIe", None, 112.0, None, 14.0)),
    (r"\bV100\b", DevicePeak("V100 SXM2", None, 125.0, None, 15.7)),
)


@dataclass(frozen=True)
class Peak:
    """The peak FLOP/s used for MFU, or None with the reason."""

    flops: float | None
    """FLOP/s of one device; None when unknown."""
    source: str | None
    """"configured peak", or "table: <device> <dtype>"; None when unknown."""
    reason: str


def normalise_dtype(dtype: Any, *, allow_tf32: bool = False) -> str:
    """One of :data:`DTYPES` from a name ("bf16", "bfloat16") or a torch dtype.

    float32 counts as tf32 when ``allow_tf32`` (``torch.backends.cuda.matmul.allow_tf32``).
    """
    key = _DTYPE_ALIASES.get(str(dtype).lower())
    if key is None:
        raise ConfigError(f"dtype {dtype!r} has no peak in the table; use one of {', '.join(DTYPES)}")
    return "tf32" if key == "fp32" and allow_tf32 else key


def lookup_device(device_name: str) -> DevicePeak | None:
    """The table entry whose pattern matches the NVML device name, or None."""
    for pattern, peak in PEAKS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return peak
    return None


def resolve_peak(device_name: str | None, dtype: Any = "bf16", *, peak_tflops: float | None = None,
                 allow_tf32: bool = False) -> Peak:
    """The peak FLOP/s of one device: ``peak_tflops`` if given, else the table's value for ``device_name``.

    ``device_name`` is the NVML name (``pynvml.nvmlDeviceGetName``), None on a machine without a GPU.
    """
    if peak_tflops is not None:
        if not peak_tflops > 0:
            raise ConfigError(f"peak_tflops={peak_tflops}: must be > 0 (TFLOP/s of one device)")
        return Peak(peak_tflops * 1e12, "configured peak", f"configured peak {peak_tflops:g} TFLOP/s")
    if device_name is None:
        return Peak(None, None, "no GPU found; MFU needs a peak: pass --peak-tflops (peak_tflops=)")
    entry = lookup_device(device_name)
    if entry is None:
        return Peak(None, None, f"device {device_name!r} is not in the peak table; pass --peak-tflops")
    key = normalise_dtype(dtype, allow_tf32=allow_tf32)
    value = getattr(entry, key)
    if value is None:
        return Peak(None, None, f"{entry.name} has no {key} tensor cores; pass --peak-tflops or another dtype")
    return Peak(value * 1e12, f"table: {entry.name} {key}", f"{entry.name} dense {key} peak {value:g} TFLOP/s")


def device_name(index: int = 0) -> str | None:
    """NVML name of GPU ``index``, or None without a GPU or without ``nvidia-ml-py``."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(index))
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001  no library, no driver, no device: no GPU telemetry, never a crash
        return None
    return name.decode() if isinstance(name, bytes) else str(name)


def transformer_flops(n_params: int, tokens_per_step: int, n_layers: int | None = None, seq_len: int | None = None,
                      d_model: int | None = None) -> float:
    """Training FLOPs of one step of a transformer: ``6 * N * T`` (+ ``12 * L * S * D * T`` for attention).

    ``6 N T``: 2 FLOPs per parameter per token forward, 4 backward.  The
    attention term (scores and weighted sum, forward and backward) needs the
    layer count, sequence length and model width together.
    """
    if n_params <= 0 or tokens_per_step <= 0:
        raise ConfigError(f"transformer_flops(n_params={n_params}, tokens_per_step={tokens_per_step}): both must "
                          "be > 0")
    shape = (n_layers, seq_len, d_model)
    flops = 6.0 * n_params * tokens_per_step
    if all(x is None for x in shape):
        return flops
    if any(x is None or x <= 0 for x in shape):
        raise ConfigError(f"transformer_flops: the attention term needs n_layers, seq_len and d_model all > 0, "
                          f"got {shape}; give all three or none")
    assert n_layers is not None and seq_len is not None and d_model is not None
    return flops + 12.0 * n_layers * seq_len * d_model * tokens_per_step


def count_flops(model: Any, example_inputs: Any, loss_fn: Callable[[Any], Any] | None = None) -> int:
    """FLOPs of one forward and backward of ``model`` on ``example_inputs`` (one rank's batch).

    Counted with ``torch.utils.flop_counter.FlopCounterMode``; multiply by
    the world size for the job.  ``loss_fn(output)`` makes the scalar to
    differentiate (default: ``output.sum()``).  The model's gradients are
    left as they were.  Note: the backward of the first layer computes no
    input gradient when the inputs do not require one, so the count is
    below the ``3 x forward`` that ``6 N T`` assumes.
    """
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    params = [p for p in model.parameters() if p.requires_grad]
    saved = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        with FlopCounterMode(display=False) as counter:
            inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
            out = model(*inputs)
            loss = loss_fn(out) if loss_fn is not None else out.sum()
            if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
                raise ConfigError("count_flops: the loss must be a tensor that requires grad; check loss_fn")
            loss.backward()
    finally:
        for p, g in zip(params, saved):
            p.grad = g
    return int(counter.get_total_flops())


def mfu(flops_per_step: float | None, steps: float, productive_s: float, peak_flops: float | None) -> float | None:
    """``flops_per_step * steps / (productive_s * peak_flops)``; None when a term is unknown or zero time.

    ``flops_per_step`` and ``peak_flops`` must cover the same devices (the
    whole job's FLOPs with the whole job's peak, or one node's with one
    node's).
    """
    if flops_per_step is None or peak_flops is None or productive_s <= 0 or peak_flops <= 0:
        return None
    return flops_per_step * steps / (productive_s * peak_flops)


BUSY_CATEGORIES = ("productive", "slowdown_excess", "degraded")
"""The categories of the seconds that new steps took (replay, waits and recovery are not)."""


def account_mfu(account: Any, flops_per_step: float | None, device_peak: float | None) -> dict[str, float | None]:
    """MFU of the job by scope ("run", "window") from one ledger :class:`~resilient.metrics.ledger_state.Account`.

    New steps x FLOPs per step over (the seconds those steps took x the
    per-device peak x the world size).  Replayed steps are not counted
    (their FLOPs bought no progress); the seconds are productive +
    slowdown excess + degraded.  ``window`` uses the rolling window's new
    steps and seconds.  Both use the current world size for the peak, so a
    scope that spans a change of world size is approximate.
    """
    world = account.world_size or 0
    peak = device_peak * world if device_peak is not None and world else None
    run_steps = account.attempted_steps - account.replayed_steps
    run_busy = sum(account.seconds[c] for c in BUSY_CATEGORIES)
    w = account.window
    window_busy = sum(w.seconds[c] for c in BUSY_CATEGORIES)
    return {"run": mfu(flops_per_step, run_steps, run_busy, peak),
            "window": mfu(flops_per_step, w.new_steps, window_busy, peak)}
