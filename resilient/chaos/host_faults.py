"""Host faults as a drill file gives them: the kinds, their fields and checks, their words, and whether this
machine can produce each one (what each kind does: :mod:`resilient.chaos.host`)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..core.errors import ConfigError

HOST_FAULT_KINDS = ("kill", "freeze", "cpu_quota", "corrupt_checkpoint", "truncate_checkpoint", "fill_disk",
                    "kill_node", "store_outage", "s3_errors", "s3_drop", "s3_slow", "partition", "packet_loss",
                    "latency", "resubmit")
NETWORK_FAULTS = ("partition", "packet_loss", "latency")
"""Host faults of the network between nodes (``[topology] network = "netns"``)."""
STORAGE_FAULTS = ("s3_errors", "s3_drop", "s3_slow")
"""Host faults of the drill's S3 endpoint (``[topology] storage = "s3"``)."""
NEEDS_STORE = ("store_outage",)
"""Host faults that act on the etcd of a drill of several nodes."""
CGROUP_ROOT = Path("/sys/fs/cgroup")


class HostFaultError(ConfigError):
    """A host fault in a drill file is invalid: the message names the key and the fix."""


@dataclass(frozen=True, kw_only=True)
class HostFault:
    kind: str
    rank: int = 0
    step: int | None = None
    """When ``rank`` has completed this step (checkpoint faults: once a commit at or after it exists)."""
    at_s: float | None = None
    """Or this many seconds after the faulted run began."""
    duration_s: float | None = None
    """``freeze``: thawed after this; ``cpu_quota``: lifted after this (None: to the end of the run)."""
    quota: float = 0.25
    """``cpu_quota``: the share of one CPU the rank may use."""
    size_mb: int = 64
    """``fill_disk``: the size of the tmpfs mounted at the checkpoint directory."""
    rate: float = 1.0
    """``s3_errors`` / ``s3_drop``: the share of requests that fail."""
    delay_s: float = 0.5
    """``s3_slow``: how long each request is held."""

    def __post_init__(self) -> None:
        if self.kind not in HOST_FAULT_KINDS:
            raise HostFaultError(f"kind: {self.kind!r} is not a host fault; use one of {', '.join(HOST_FAULT_KINDS)}")
        if (self.step is None) == (self.at_s is None):
            raise HostFaultError(f"{self.kind}: give one trigger, step = N (the rank completed step N) or at_s = S")
        if self.kind in ("corrupt_checkpoint", "truncate_checkpoint") and self.step is None:
            raise HostFaultError(f"{self.kind}: give step = N (the first commit at or after step N is damaged)")
        if self.kind == "freeze" and self.duration_s is None:
            raise HostFaultError("freeze: give duration_s (a rank frozen for good is a hang no drill can end)")
        if self.kind in (*STORAGE_FAULTS, *NETWORK_FAULTS) and self.duration_s is None:
            raise HostFaultError(f"{self.kind}: give duration_s (how long the fault lasts)")
        if not 0 < self.rate <= 1:
            raise HostFaultError(f"{self.kind}: rate = {self.rate}: a share of requests, above 0 and at most 1")
        if not 0 < self.delay_s <= 60:
            raise HostFaultError(f"{self.kind}: delay_s = {self.delay_s}: seconds above 0 and at most 60")
        if self.kind == "store_outage" and self.duration_s is None:
            raise HostFaultError("store_outage: give duration_s (how long etcd is down before it is started again)")
        if self.duration_s is not None and self.duration_s <= 0:
            raise HostFaultError(f"{self.kind}: duration_s = {self.duration_s}: must be seconds > 0")
        if not 0.01 <= self.quota <= 1.0:
            raise HostFaultError(f"cpu_quota: quota = {self.quota}: a share of one CPU between 0.01 and 1")
        if self.rank < 0:
            raise HostFaultError(f"{self.kind}: rank = {self.rank}: must be >= 0")
        if not 1 <= self.size_mb <= 4096:
            raise HostFaultError(f"fill_disk: size_mb = {self.size_mb}: between 1 and 4096 (MB of memory)")

    def describe(self) -> str:
        when = f"after rank {self.rank} completes step {self.step}" if self.step is not None else f"at {self.at_s:g} s"
        return f"{_WHAT[self.kind](self)} {when}"

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None and (k != "size_mb" or self.kind == "fill_disk")
                and (k != "quota" or self.kind == "cpu_quota")
                and (k != "rate" or self.kind in ("s3_errors", "s3_drop", "packet_loss")) and (k != "delay_s" or self.kind in ("s3_slow", "latency"))}


def parse_host_faults(raw: Any) -> tuple[HostFault, ...]:
    """``[[host_faults]]`` tables as faults; HostFaultError naming the table and the key."""
    if not isinstance(raw, list):
        raise HostFaultError("host_faults: write each host fault as a [[host_faults]] table")
    known = {"kind", "rank", "step", "at_s", "duration_s", "quota", "size_mb", "rate", "delay_s"}
    out = []
    for i, table in enumerate(raw):
        where = f"[[host_faults]] #{i + 1}: "
        if not isinstance(table, Mapping):
            raise HostFaultError(f"{where}must be a table")
        unknown = sorted(set(table) - known)
        if unknown:
            raise HostFaultError(f"{where}{unknown[0]}: unknown key; a host fault has {', '.join(sorted(known))}")
        for key in ("rank", "step", "size_mb"):
            if key in table and (isinstance(table[key], bool) or not isinstance(table[key], int)):
                raise HostFaultError(f"{where}{key} = {table[key]!r}: must be an integer")
        floats = ("at_s", "duration_s", "quota", "rate", "delay_s")
        for key in floats:
            if key in table and (isinstance(table[key], bool) or not isinstance(table[key], (int, float))):
                raise HostFaultError(f"{where}{key} = {table[key]!r}: must be a number")
        values: dict[str, Any] = {k: (float(v) if k in floats else v)
                                  for k, v in table.items()}
        try:
            out.append(HostFault(**values))
        except HostFaultError as e:
            raise HostFaultError(f"{where}{e}") from None
    return tuple(out)


def _cgroup_v2() -> bool:
    return (CGROUP_ROOT / "cgroup.controllers").exists()


def unavailable(kind: str) -> str | None:
    """Why this machine cannot produce ``kind`` (None: it can)."""
    if kind in ("kill", "corrupt_checkpoint", "truncate_checkpoint", "kill_node", "store_outage", "resubmit"):
        return None
    if kind in STORAGE_FAULTS:
        from .s3proxy import unavailable as storage_unavailable

        return storage_unavailable()
    if kind in NETWORK_FAULTS:
        from .netns import unavailable as network_unavailable

        return network_unavailable(packet_loss=kind == "packet_loss")
    if os.geteuid() != 0:
        if kind == "fill_disk":
            return f"fill_disk needs root to mount a tmpfs (this runner runs as uid {os.geteuid()})"
        return f"{kind} needs root to create cgroups (this runner runs as uid {os.geteuid()})"
    if kind == "freeze":
        if (CGROUP_ROOT / "freezer" / "freezer.state").exists() or (CGROUP_ROOT / "freezer").is_dir():
            return None
        if _cgroup_v2():
            return "freeze uses the cgroup v1 freezer; this machine has cgroup v2 only (no v1 freezer hierarchy)"
        return f"no cgroup freezer hierarchy under {CGROUP_ROOT}"
    if kind == "cpu_quota":
        if (CGROUP_ROOT / "cpu" / "cpu.cfs_quota_us").exists():
            return None
        if _cgroup_v2() and "cpu" in (CGROUP_ROOT / "cgroup.controllers").read_text().split():
            return None
        return f"no CPU controller: neither {CGROUP_ROOT / 'cpu' / 'cpu.cfs_quota_us'} (v1) nor cpu in cgroup v2"
    if kind == "fill_disk":
        if shutil.which("mount") is None or shutil.which("umount") is None:
            return "fill_disk needs mount and umount (util-linux)"
        try:
            if "tmpfs" not in Path("/proc/filesystems").read_text():
                return "the kernel has no tmpfs"
        except OSError:
            return "cannot read /proc/filesystems"
        return None
    return f"unknown host fault {kind!r}"


def _for(f: HostFault) -> str:
    return f" for {f.duration_s:g} s" if f.duration_s else ""


_WHAT: dict[str, Callable[[HostFault], str]] = {
    "kill": lambda f: f"SIGKILL rank {f.rank}",
    "kill_node": lambda f: f"SIGKILL the agent of rank {f.rank}'s node",
    "store_outage": lambda f: f"stop etcd{_for(f)}",
    "partition": lambda f: f"cut rank {f.rank}'s node off the network{_for(f)}",
    "resubmit": lambda f: "submit the same job again while it runs",
    "latency": lambda f: f"add {f.delay_s * 1e3:g} ms each way to rank {f.rank}'s node{_for(f)}",
    "packet_loss": lambda f: f"drop {f.rate:.0%} of the packets reaching rank {f.rank}'s node{_for(f)}",
    "s3_errors": lambda f: f"answer {f.rate:.0%} of S3 requests 503 SlowDown{_for(f)}",
    "s3_drop": lambda f: f"drop {f.rate:.0%} of S3 connections unanswered{_for(f)}",
    "s3_slow": lambda f: f"hold every S3 request {f.delay_s:g} s{_for(f)}",
    "freeze": lambda f: f"freeze rank {f.rank}{_for(f)}",
    "cpu_quota": lambda f: f"limit rank {f.rank} to {f.quota:g} of a CPU{_for(f)}",
    "fill_disk": lambda f: f"fill the checkpoint disk ({f.size_mb} MB tmpfs){_for(f)}",
    "corrupt_checkpoint": lambda f: "flip bytes in the newest committed checkpoint",
    "truncate_checkpoint": lambda f: "cut the newest committed checkpoint's largest file in half",
}
"""What each kind does, in words (the time it fires is added)."""
