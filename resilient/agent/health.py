"""Node health: a probe that reads the machine, and a pure assessment of what it read.

:func:`probe` reads memory, free disk where checkpoints go, load, and GPU
telemetry through NVML (``nvidia-ml-py``) when a driver answers.  It creates
nothing and never raises for a field it cannot read: the field becomes None
and a note says why, so a flaky sensor cannot take a node out by itself.
:func:`assess` is pure: it compares an observation with :class:`HealthConfig`
and returns a decision whose reason names each problem and its fix.  An
agent runs both before (re)joining and periodically while running; an
unhealthy node steps out and says why.

Xid errors are not read here: NVML reports them only as events to a listener
registered before they happen, which a one-shot probe cannot be.  Their
lasting effects (uncorrected ECC counts, pending page retirement or row
remapping) are read.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from ..core.errors import ConfigError, ResilientError

GiB = 1024**3
T = TypeVar("T")


class MissingDependencyError(ResilientError, ImportError):
    """An optional package a feature needs is not installed; the message names what to install."""


@dataclass(frozen=True, kw_only=True)
class HealthConfig:
    """Thresholds below which a node is unhealthy."""

    min_free_memory_bytes: int = 1 * GiB
    """Available memory (psutil's ``available``) needed."""
    min_free_disk_bytes: int = 5 * GiB
    """Free space needed on the filesystem of every probed path (where checkpoints go)."""
    max_gpu_temp_c: float = 90.0
    """Hottest acceptable GPU core temperature."""
    min_gpus: int = 0
    """GPUs the node must show; fewer means one fell off the bus or the driver is broken."""
    max_load_per_cpu: float | None = None
    """1-minute load average per CPU above which the node is overloaded; None does not check."""
    fail_on_throttle: frozenset[str] = frozenset({"hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown"})
    """Clock throttle reasons that make a GPU unhealthy (power capping by software is normal)."""

    def __post_init__(self) -> None:
        if self.min_free_memory_bytes < 0 or self.min_free_disk_bytes < 0:
            raise ConfigError("HealthConfig.min_free_memory_bytes and min_free_disk_bytes must be >= 0")
        if not (0 < self.max_gpu_temp_c < 150):
            raise ConfigError(f"HealthConfig.max_gpu_temp_c={self.max_gpu_temp_c} must be in (0, 150) degrees C")
        if self.min_gpus < 0:
            raise ConfigError(f"HealthConfig.min_gpus={self.min_gpus} must be >= 0")
        if self.max_load_per_cpu is not None and not (
            self.max_load_per_cpu > 0 and math.isfinite(self.max_load_per_cpu)
        ):
            raise ConfigError(f"HealthConfig.max_load_per_cpu={self.max_load_per_cpu} must be > 0 (or None)")
        object.__setattr__(self, "fail_on_throttle", frozenset(self.fail_on_throttle))
        unknown = set(self.fail_on_throttle) - set(THROTTLE_REASONS)
        if unknown:
            raise ConfigError(
                f"HealthConfig.fail_on_throttle has unknown reasons {sorted(unknown)}; known: {sorted(THROTTLE_REASONS)}"
            )


@dataclass(frozen=True, kw_only=True)
class DiskObservation:
    """Free space on the filesystem that holds ``path``."""

    path: str
    measured_at: str | None
    """The nearest existing ancestor of ``path`` that was measured (``path`` may not exist yet)."""
    free_bytes: int | None
    total_bytes: int | None
    note: str | None = None


@dataclass(frozen=True, kw_only=True)
class GpuObservation:
    """NVML's view of one GPU; a None field could not be read (see ``notes``)."""

    index: int
    name: str | None
    temperature_c: float | None
    ecc_uncorrected_volatile: int | None
    """Uncorrected ECC errors since the driver loaded."""
    throttle_reasons: tuple[str, ...] | None
    """Active clock throttle reasons, as names from :data:`THROTTLE_REASONS`."""
    retired_pages_pending: bool | None
    """Pages waiting to be retired at the next reset (pre-Ampere GPUs)."""
    row_remap_pending: bool | None
    """Memory rows waiting to be remapped at the next reset (Ampere and later)."""
    row_remap_failed: bool | None
    """A row remapping failed: the GPU needs service."""
    notes: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class HealthObservation:
    """What :func:`probe` read from this node."""

    memory_available_bytes: int
    memory_total_bytes: int
    disks: tuple[DiskObservation, ...]
    load_avg_1m: float | None
    cpu_count: int | None
    gpus: tuple[GpuObservation, ...]
    gpu_note: str | None
    """Why there is no (or partial) GPU telemetry; None when NVML answered."""


@dataclass(frozen=True, kw_only=True)
class HealthDecision:
    """Healthy or not, with every problem named and how to fix it."""

    healthy: bool
    reason: str
    problems: tuple[str, ...]


# NVML bit -> our name; read from pynvml by attribute so an older binding just lacks a name.
THROTTLE_REASONS: dict[str, str] = {
    "gpu_idle": "nvmlClocksThrottleReasonGpuIdle",
    "applications_clocks_setting": "nvmlClocksThrottleReasonApplicationsClocksSetting",
    "sw_power_cap": "nvmlClocksThrottleReasonSwPowerCap",
    "hw_slowdown": "nvmlClocksThrottleReasonHwSlowdown",
    "sync_boost": "nvmlClocksThrottleReasonSyncBoost",
    "sw_thermal_slowdown": "nvmlClocksThrottleReasonSwThermalSlowdown",
    "hw_thermal_slowdown": "nvmlClocksThrottleReasonHwThermalSlowdown",
    "hw_power_brake_slowdown": "nvmlClocksThrottleReasonHwPowerBrakeSlowdown",
    "display_clock_setting": "nvmlClocksThrottleReasonDisplayClockSetting",
}


def format_bytes(n: int) -> str:
    """``1.2 GiB``, ``300.0 MiB``: one decimal, binary units."""
    if abs(n) >= GiB:
        return f"{n / GiB:.1f} GiB"
    return f"{n / 1024**2:.1f} MiB"


def _psutil() -> Any:
    try:
        import psutil
    except ImportError as exc:
        raise MissingDependencyError(
            "node health checks need psutil, which is not installed: pip install psutil"
        ) from exc
    return psutil


def _disk(psutil: Any, path: str) -> DiskObservation:
    if "://" in path:
        return DiskObservation(
            path=path, measured_at=None, free_bytes=None, total_bytes=None, note="not a local path: not measured"
        )
    # The checkpoint directory may not exist yet: measure the filesystem it will be created on.
    probe_at = os.path.abspath(path)
    while not os.path.exists(probe_at) and os.path.dirname(probe_at) != probe_at:
        probe_at = os.path.dirname(probe_at)
    try:
        usage = psutil.disk_usage(probe_at)
    except OSError as exc:
        return DiskObservation(path=path, measured_at=probe_at, free_bytes=None, total_bytes=None, note=str(exc))
    return DiskObservation(path=path, measured_at=probe_at, free_bytes=usage.free, total_bytes=usage.total)


def _field(notes: list[str], what: str, read: Callable[[], T]) -> T | None:
    """``read()``, or None with a note when NVML (or anything under it) refuses."""
    try:
        return read()
    except Exception as exc:  # noqa: BLE001 - a sensor that fails must not crash the agent
        notes.append(f"{what}: {type(exc).__name__}: {exc}")
        return None


def _gpu(nvml: Any, index: int) -> GpuObservation:
    notes: list[str] = []
    handle = nvml.nvmlDeviceGetHandleByIndex(index)

    def name() -> str:
        raw = nvml.nvmlDeviceGetName(handle)
        return raw.decode() if isinstance(raw, bytes) else str(raw)

    def throttle() -> tuple[str, ...]:
        # Newer bindings call them "clocks event reasons"; the bits are the same.
        read = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        read = read or nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        mask = int(read(handle))
        return tuple(ours for ours, attr in THROTTLE_REASONS.items() if mask & int(getattr(nvml, attr, 0)))

    def remap() -> tuple[bool, bool]:
        _corr, _unc, pending, failed = nvml.nvmlDeviceGetRemappedRows(handle)
        return bool(pending), bool(failed)

    remapped = _field(notes, "row remapping", remap)
    return GpuObservation(
        index=index,
        name=_field(notes, "name", name),
        temperature_c=_field(
            notes, "temperature", lambda: float(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU))
        ),
        ecc_uncorrected_volatile=_field(
            notes,
            "uncorrected ECC count",
            lambda: int(
                nvml.nvmlDeviceGetTotalEccErrors(
                    handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
                )
            ),
        ),
        throttle_reasons=_field(notes, "throttle reasons", throttle),
        retired_pages_pending=_field(
            notes,
            "retired pages pending",
            lambda: bool(nvml.nvmlDeviceGetRetiredPagesPendingStatus(handle)),
        ),
        row_remap_pending=None if remapped is None else remapped[0],
        row_remap_failed=None if remapped is None else remapped[1],
        notes=tuple(notes),
    )


def _gpus() -> tuple[tuple[GpuObservation, ...], str | None]:
    try:
        import pynvml
    except ImportError:
        return (), "no GPU telemetry: nvidia-ml-py is not installed (pip install nvidia-ml-py)"
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - NVMLError or a missing libnvidia-ml.so
        return (), f"no GPU telemetry: NVML did not start ({type(exc).__name__}: {exc})"
    try:
        count = int(pynvml.nvmlDeviceGetCount())
        gpus = []
        notes = []
        for index in range(count):
            try:
                gpus.append(_gpu(pynvml, index))
            except Exception as exc:  # noqa: BLE001 - no handle for this GPU (fell off the bus?)
                notes.append(f"GPU {index}: no handle ({type(exc).__name__}: {exc})")
        if count == 0:
            notes.append("NVML started but reports no GPUs")
        return tuple(gpus), "; ".join(notes) or None
    except Exception as exc:  # noqa: BLE001
        return (), f"no GPU telemetry: NVML failed to count GPUs ({type(exc).__name__}: {exc})"
    finally:
        with contextlib.suppress(Exception):  # nothing to do about a failing shutdown
            pynvml.nvmlShutdown()


def probe(paths: Sequence[str | os.PathLike[str]]) -> HealthObservation:
    """Read this node's health; ``paths`` are where checkpoints go (local ones are measured, none is created).

    Raises :class:`MissingDependencyError` when psutil is not installed.
    """
    psutil = _psutil()
    memory = psutil.virtual_memory()
    try:
        load: float | None = float(os.getloadavg()[0])
    except (OSError, AttributeError):  # not on every platform
        load = None
    gpus, gpu_note = _gpus()
    return HealthObservation(
        memory_available_bytes=int(memory.available),
        memory_total_bytes=int(memory.total),
        disks=tuple(_disk(psutil, os.fspath(p)) for p in paths),
        load_avg_1m=load,
        cpu_count=psutil.cpu_count(logical=True),
        gpus=gpus,
        gpu_note=gpu_note,
    )


def _gpu_problems(gpu: GpuObservation, cfg: HealthConfig) -> list[str]:
    label = f"GPU {gpu.index}" + (f" ({gpu.name})" if gpu.name else "")
    problems = []
    if gpu.temperature_c is not None and gpu.temperature_c > cfg.max_gpu_temp_c:
        problems.append(
            f"{label} is at {gpu.temperature_c:g} C, above max_gpu_temp_c {cfg.max_gpu_temp_c:g} C: "
            "check the node's cooling"
        )
    if gpu.ecc_uncorrected_volatile:
        problems.append(
            f"{label} has {gpu.ecc_uncorrected_volatile} uncorrected ECC errors since the driver loaded: "
            "drain the node and reset the GPU"
        )
    if gpu.row_remap_failed:
        problems.append(f"{label} failed to remap a memory row: the GPU needs service")
    if gpu.row_remap_pending or gpu.retired_pages_pending:
        what = "memory rows waiting to be remapped" if gpu.row_remap_pending else "pages waiting to be retired"
        problems.append(f"{label} has {what}: reset the GPU (or reboot the node) before using it")
    bad = sorted(set(gpu.throttle_reasons or ()) & cfg.fail_on_throttle)
    if bad:
        problems.append(f"{label} is throttled ({', '.join(bad)}): check cooling and power")
    return problems


def assess(obs: HealthObservation, cfg: HealthConfig) -> HealthDecision:
    """Healthy or not; a field the probe could not read is never a problem by itself."""
    problems = []
    if obs.memory_available_bytes < cfg.min_free_memory_bytes:
        problems.append(
            f"available memory is {format_bytes(obs.memory_available_bytes)}, below min_free_memory_bytes "
            f"{format_bytes(cfg.min_free_memory_bytes)}: stop what else runs on this node"
        )
    for disk in obs.disks:
        if disk.free_bytes is None:
            if disk.measured_at is not None:  # a local path we could not stat: checkpoints will fail too
                problems.append(f"cannot measure free disk at {disk.path}: {disk.note}")
        elif disk.free_bytes < cfg.min_free_disk_bytes:
            problems.append(
                f"free disk at {disk.path} is {format_bytes(disk.free_bytes)}, below min_free_disk_bytes "
                f"{format_bytes(cfg.min_free_disk_bytes)}: free space or point checkpoints elsewhere"
            )
    if cfg.max_load_per_cpu is not None and obs.load_avg_1m is not None and obs.cpu_count:
        per_cpu = obs.load_avg_1m / obs.cpu_count
        if per_cpu > cfg.max_load_per_cpu:
            problems.append(
                f"load average is {obs.load_avg_1m:.1f} on {obs.cpu_count} CPUs ({per_cpu:.2f} per CPU), above "
                f"max_load_per_cpu {cfg.max_load_per_cpu:g}: something else is using this node"
            )
    if len(obs.gpus) < cfg.min_gpus:
        why = f" ({obs.gpu_note})" if obs.gpu_note else ""
        problems.append(f"expected at least {cfg.min_gpus} GPUs, NVML shows {len(obs.gpus)}{why}")
    for gpu in obs.gpus:
        problems.extend(_gpu_problems(gpu, cfg))
    if problems:
        return HealthDecision(healthy=False, reason="unhealthy: " + "; ".join(problems), problems=tuple(problems))
    summary = f"healthy: {format_bytes(obs.memory_available_bytes)} memory available"
    for disk in obs.disks:
        if disk.free_bytes is not None:
            summary += f", {format_bytes(disk.free_bytes)} free at {disk.path}"
    temps = [g.temperature_c for g in obs.gpus if g.temperature_c is not None]
    if obs.gpus:
        summary += f", {len(obs.gpus)} GPU{'s' if len(obs.gpus) > 1 else ''}"
        if temps:
            summary += f" at most {max(temps):g} C"
    if obs.gpu_note:
        summary += f" ({obs.gpu_note})"
    return HealthDecision(healthy=True, reason=summary, problems=())
