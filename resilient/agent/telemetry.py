"""Host telemetry for a slowdown's incident: what the machine did during the slowdown against the baseline.

A :class:`HostSample` holds the host's cumulative CPU times (psutil: user,
system, idle, iowait, steal, in seconds over all CPUs), memory and swap use,
and Linux pressure-stall averages where ``/proc/pressure`` exists.
:func:`compare_samples` turns two pairs of samples, one around the
baseline and one around the slowdown, into the shares an on-call engineer
compares: a rise in iowait points at storage, steal at a noisy neighbour
(a shared VM host), memory pressure at swapping.  GPUs add NVML's view at
the time of the slowdown (temperature, clock throttle reasons) where
nvidia-ml-py is installed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CPU_FIELDS = ("user", "system", "idle", "iowait", "steal")
PRESSURE = Path("/proc/pressure")


@dataclass(frozen=True)
class HostSample:
    """The host at one moment (cumulative counters: compare two samples)."""

    t: float
    cpu: dict[str, float] = field(default_factory=dict)
    memory_used: float | None = None
    """Fraction of memory in use (1 - available / total)."""
    swap_used: float | None = None
    pressure: dict[str, float] = field(default_factory=dict)
    """PSI ``some avg10`` per resource (cpu, io, memory), percent."""


def sample_host() -> HostSample:
    """Read the host's counters now (never raises: a counter that cannot be read is left out)."""
    import psutil

    cpu: dict[str, float] = {}
    try:
        times = psutil.cpu_times()
        cpu = {name: float(getattr(times, name)) for name in CPU_FIELDS if hasattr(times, name)}
    except OSError:
        pass
    memory = swap = None
    try:
        virtual = psutil.virtual_memory()
        memory = 1.0 - virtual.available / virtual.total
        swap = psutil.swap_memory().percent / 100.0
    except (OSError, ZeroDivisionError):
        pass
    return HostSample(time.monotonic(), cpu, memory, swap, _pressure())


def _pressure() -> dict[str, float]:
    found = {}
    for resource in ("cpu", "io", "memory"):
        try:
            line = (PRESSURE / resource).read_text().splitlines()[0]  # "some avg10=0.00 avg60=... total=..."
            found[resource] = float(dict(part.split("=") for part in line.split()[1:])["avg10"])
        except (OSError, IndexError, KeyError, ValueError):
            continue
    return found


def cpu_shares(a: HostSample, b: HostSample) -> dict[str, float]:
    """Each CPU-time field's share of all CPU time between two samples (0..1)."""
    deltas = {k: b.cpu[k] - a.cpu[k] for k in a.cpu if k in b.cpu}
    total = sum(deltas.values())
    return {k: round(v / total, 4) for k, v in deltas.items()} if total > 0 else {}


def compare_samples(baseline: tuple[HostSample, HostSample] | None,
                    now: tuple[HostSample, HostSample]) -> dict[str, Any]:
    """The host around the slowdown (``now``: two samples spanning it) against around the baseline."""
    out: dict[str, Any] = {"now": {"cpu": cpu_shares(*now), "memory_used": now[1].memory_used,
                                   "swap_used": now[1].swap_used, "pressure": now[1].pressure}}
    if baseline is not None:
        out["baseline"] = {"cpu": cpu_shares(*baseline), "memory_used": baseline[1].memory_used,
                           "swap_used": baseline[1].swap_used, "pressure": baseline[1].pressure}
    gpus = _gpu_view()
    if gpus:
        out["gpus"] = gpus
    return out


def _gpu_view() -> list[dict[str, Any]]:
    """NVML's temperature and throttle reasons per GPU (empty without NVML)."""
    from .health import _gpus

    gpus, _note = _gpus()
    return [{"index": g.index, "temperature_c": g.temperature_c, "throttle_reasons": list(g.throttle_reasons or ())}
            for g in gpus]
