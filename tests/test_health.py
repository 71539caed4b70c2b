"""Node health: the probe on this real machine, and the pure assessment on made-up observations."""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from resilient.agent import health
from resilient.agent.health import (
    DiskObservation,
    GiB,
    GpuObservation,
    HealthConfig,
    HealthObservation,
    MissingDependencyError,
    assess,
    probe,
)
from resilient.core.errors import ConfigError


def test_probe_on_this_machine_reads_memory_disk_and_explains_missing_gpus(tmp_path: Path) -> None:
    missing = tmp_path / "not" / "yet" / "ckpt"
    obs = probe([tmp_path, str(missing), "s3://bucket/run"])
    assert 0 < obs.memory_available_bytes <= obs.memory_total_bytes
    here, future, remote = obs.disks
    assert here.path == str(tmp_path) and here.measured_at == str(tmp_path)
    assert here.free_bytes is not None and 0 < here.free_bytes <= (here.total_bytes or 0)
    # A checkpoint directory that does not exist yet is measured on the filesystem it will be created on...
    assert future.measured_at == str(tmp_path) and future.free_bytes is not None
    # ...and the probe creates nothing.
    assert not (tmp_path / "not").exists()
    assert remote.free_bytes is None and remote.measured_at is None and "not a local path" in (remote.note or "")
    assert obs.cpu_count and obs.cpu_count >= 1
    assert obs.load_avg_1m is not None and obs.load_avg_1m >= 0
    if os.path.exists("/dev/nvidiactl"):
        pytest.skip("this machine has an NVIDIA driver; the no-GPU expectations below do not apply")
    assert obs.gpus == ()
    assert obs.gpu_note is not None and obs.gpu_note.startswith("no GPU telemetry: ")
    assert "NVML" in obs.gpu_note or "nvidia-ml-py" in obs.gpu_note
    decision = assess(obs, HealthConfig(min_free_memory_bytes=0, min_free_disk_bytes=0))
    assert decision.healthy, decision.reason
    assert decision.reason.startswith("healthy: ") and "no GPU telemetry" in decision.reason


def test_probe_without_psutil_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "psutil", None)  # makes `import psutil` fail, as if not installed
    with pytest.raises(MissingDependencyError, match="pip install psutil"):
        probe(["/"])


OK_GPU = GpuObservation(
    index=0,
    name="NVIDIA H100 80GB HBM3",
    temperature_c=61.0,
    ecc_uncorrected_volatile=0,
    throttle_reasons=("sw_power_cap",),
    retired_pages_pending=None,
    row_remap_pending=False,
    row_remap_failed=False,
)
OK = HealthObservation(
    memory_available_bytes=200 * GiB,
    memory_total_bytes=256 * GiB,
    disks=(DiskObservation(path="/ckpt", measured_at="/ckpt", free_bytes=500 * GiB, total_bytes=1000 * GiB),),
    load_avg_1m=3.0,
    cpu_count=32,
    gpus=(OK_GPU, replace(OK_GPU, index=1, temperature_c=66.0)),
    gpu_note=None,
)


def test_healthy_node_reason_summarises() -> None:
    decision = assess(OK, HealthConfig(min_gpus=2))
    assert decision.healthy and decision.problems == ()
    assert decision.reason == "healthy: 200.0 GiB memory available, 500.0 GiB free at /ckpt, 2 GPUs at most 66 C"


def test_low_disk_and_memory_are_named_with_a_fix() -> None:
    obs = replace(
        OK,
        memory_available_bytes=512 * 1024**2,
        disks=(DiskObservation(path="/ckpt", measured_at="/ckpt", free_bytes=int(1.2 * GiB), total_bytes=GiB * 100),),
    )
    decision = assess(obs, HealthConfig())
    assert not decision.healthy
    assert decision.problems == (
        "available memory is 512.0 MiB, below min_free_memory_bytes 1.0 GiB: stop what else runs on this node",
        "free disk at /ckpt is 1.2 GiB, below min_free_disk_bytes 5.0 GiB: free space or point checkpoints elsewhere",
    )
    assert decision.reason == "unhealthy: " + "; ".join(decision.problems)


def test_unmeasurable_local_disk_is_a_problem_but_remote_is_not() -> None:
    obs = replace(
        OK,
        disks=(
            DiskObservation(
                path="/ckpt", measured_at="/ckpt", free_bytes=None, total_bytes=None, note="Permission denied"
            ),
            DiskObservation(path="s3://b/p", measured_at=None, free_bytes=None, total_bytes=None, note="not local"),
        ),
    )
    assert assess(obs, HealthConfig()).problems == ("cannot measure free disk at /ckpt: Permission denied",)


def test_gpu_problems() -> None:
    hot = replace(OK_GPU, index=3, temperature_c=92.0, throttle_reasons=("hw_thermal_slowdown", "sw_power_cap"))
    ecc = replace(OK_GPU, index=4, ecc_uncorrected_volatile=2, row_remap_pending=True)
    broken = replace(OK_GPU, index=5, name=None, row_remap_failed=True, retired_pages_pending=True)
    decision = assess(replace(OK, gpus=(hot, ecc, broken)), HealthConfig())
    assert not decision.healthy
    assert decision.problems == (
        "GPU 3 (NVIDIA H100 80GB HBM3) is at 92 C, above max_gpu_temp_c 90 C: check the node's cooling",
        "GPU 3 (NVIDIA H100 80GB HBM3) is throttled (hw_thermal_slowdown): check cooling and power",
        (
            "GPU 4 (NVIDIA H100 80GB HBM3) has 2 uncorrected ECC errors since the driver loaded: "
            "drain the node and reset the GPU"
        ),
        (
            "GPU 4 (NVIDIA H100 80GB HBM3) has memory rows waiting to be remapped: "
            "reset the GPU (or reboot the node) before using it"
        ),
        "GPU 5 failed to remap a memory row: the GPU needs service",
        "GPU 5 has pages waiting to be retired: reset the GPU (or reboot the node) before using it",
    )


def test_unreadable_gpu_fields_are_not_problems_and_missing_gpus_are() -> None:
    blind = GpuObservation(
        index=0,
        name=None,
        temperature_c=None,
        ecc_uncorrected_volatile=None,
        throttle_reasons=None,
        retired_pages_pending=None,
        row_remap_pending=None,
        row_remap_failed=None,
        notes=("temperature: NVMLError_NotSupported: Not Supported",),
    )
    assert assess(replace(OK, gpus=(blind,)), HealthConfig()).healthy
    decision = assess(
        replace(OK, gpus=(), gpu_note="no GPU telemetry: NVML did not start (x)"), HealthConfig(min_gpus=8)
    )
    assert decision.problems == ("expected at least 8 GPUs, NVML shows 0 (no GPU telemetry: NVML did not start (x))",)


def test_load_check_is_opt_in() -> None:
    busy = replace(OK, load_avg_1m=96.0, cpu_count=32)
    assert assess(busy, HealthConfig()).healthy
    decision = assess(busy, HealthConfig(max_load_per_cpu=2.0))
    assert decision.problems == (
        "load average is 96.0 on 32 CPUs (3.00 per CPU), above max_load_per_cpu 2: something else is using this node",
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_free_disk_bytes": -1}, "must be >= 0"),
        ({"max_gpu_temp_c": 0}, "max_gpu_temp_c=0"),
        ({"min_gpus": -1}, "min_gpus=-1"),
        ({"max_load_per_cpu": 0.0}, "max_load_per_cpu=0.0"),
        ({"fail_on_throttle": frozenset({"too_hot"})}, "unknown reasons \\['too_hot'\\]"),
    ],
)
def test_invalid_health_config(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        HealthConfig(**kwargs)


class _NoDriverForSomeFields:
    """Stands in for a GPU driver (this machine has none): fields a real NVML may refuse raise NVMLError."""

    def __init__(self) -> None:
        import pynvml

        self._pynvml = pynvml
        self.NVML_TEMPERATURE_GPU = pynvml.NVML_TEMPERATURE_GPU
        self.NVML_MEMORY_ERROR_TYPE_UNCORRECTED = pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        self.NVML_VOLATILE_ECC = pynvml.NVML_VOLATILE_ECC
        self.nvmlClocksThrottleReasonHwSlowdown = pynvml.nvmlClocksThrottleReasonHwSlowdown
        self.nvmlClocksThrottleReasonSwPowerCap = pynvml.nvmlClocksThrottleReasonSwPowerCap

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetName(self, handle: int) -> bytes:
        return b"Tesla T4"

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:
        return 71

    def nvmlDeviceGetTotalEccErrors(self, handle: int, kind: int, counter: int) -> int:
        raise self._pynvml.NVMLError(self._pynvml.NVML_ERROR_NOT_SUPPORTED)

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: int) -> int:
        return int(self.nvmlClocksThrottleReasonHwSlowdown | self.nvmlClocksThrottleReasonSwPowerCap)

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: int) -> int:
        return 0

    def nvmlDeviceGetRemappedRows(self, handle: int) -> tuple[int, int, int, int]:
        raise self._pynvml.NVMLError(self._pynvml.NVML_ERROR_NOT_SUPPORTED)


def test_gpu_field_errors_degrade_to_none_with_notes() -> None:
    # nvidia-ml-py is in the dev extras: without a driver it imports, and its error classes are what we need.
    gpu = health._gpu(_NoDriverForSomeFields(), 0)
    assert (gpu.name, gpu.temperature_c, gpu.retired_pages_pending) == ("Tesla T4", 71.0, False)
    assert gpu.throttle_reasons == ("sw_power_cap", "hw_slowdown")
    assert gpu.ecc_uncorrected_volatile is None and gpu.row_remap_pending is None and gpu.row_remap_failed is None
    assert len(gpu.notes) == 2
    assert gpu.notes[0].startswith("row remapping: NVMLError_NotSupported")
    assert gpu.notes[1].startswith("uncorrected ECC count: NVMLError_NotSupported")
    assert assess(replace(OK, gpus=(gpu,)), HealthConfig()).problems == (
        "GPU 0 (Tesla T4) is throttled (hw_slowdown): check cooling and power",
    )
