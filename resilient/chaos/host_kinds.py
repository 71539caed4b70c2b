"""What each host fault does: one small object per kind that injects it and says how to undo it.

A kind's :meth:`Kind.inject` acts on the drill's :class:`Scene` (the run's files, its processes, its
servers and network) and returns an :class:`Injection`: what to record, and, for a fault that lasts, the
call that lifts it and when.  None means "not yet": the target is not there (a rank between generations),
and the injector tries again at its next poll.  :class:`~resilient.chaos.host.HostInjector` keeps the
injections that last on a stack and undoes them in reverse order.
"""

from __future__ import annotations

import abc
import errno
import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..watchdog.procfs import read_stat
from .host_faults import CGROUP_ROOT, HostFault

FILLER = ".drill-disk-filler"
MANIFEST = "manifest.json"
PERIOD_US = 100_000


@dataclass(frozen=True)
class Injection:
    """What injecting a fault did."""

    detail: dict[str, Any]
    """Recorded with the ``fault_injected`` event."""
    undo: Callable[[], dict[str, Any]] | None = None
    """Lifts the fault; returns what the ``fault_lifted`` event records.  None: nothing to undo."""
    until: float | None = None
    """Monotonic time at which it is lifted; None: when the drill ends."""


@dataclass
class Scene:
    """What a host fault acts on: the faulted run's files, its servers and its network."""

    run_out: Path
    ckpt_dir: Path
    label: str
    store: Any = None
    """The drill's etcd (``stop()`` and ``start()``, same ports and data), for ``store_outage``."""
    s3: Any = None
    """The drill's S3 fault proxy (:class:`resilient.chaos.s3proxy.FaultProxy`), for the storage faults."""
    network: Any = None
    """The nodes' namespaces (:class:`resilient.chaos.netns.Network`), for the network faults."""
    resubmit: Callable[[], dict[str, Any]] | None = None
    """Starts the job again (``resubmit``): returns what to record of it."""
    cgroups: list[str] = field(default_factory=list)
    """Names of the cgroups made so far (each fault's own)."""

    @property
    def cgroup_prefix(self) -> str:
        return f"resilient-drill-{self.label}-{os.getpid()}-"

    def new_cgroup_name(self, kind: str) -> str:
        name = f"{self.cgroup_prefix}{len(self.cgroups)}-{kind}"
        self.cgroups.append(name)
        return name

    def member(self, rank: int) -> tuple[str, int, int | None] | None:
        """(node, worker pid, agent pid) of the member with ``rank``, from the agents' pids.json files."""
        for path in sorted((self.run_out / "run" / "nodes").glob("*/pids.json")):
            try:
                pids = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            for w in pids.get("workers") or []:
                if w.get("rank") == rank:
                    agent = (pids.get("agent") or {}).get("pid")
                    return path.parent.name, int(w["pid"]), None if agent is None else int(agent)
        return None

    def commit(self, step: int) -> Path | None:
        """The newest committed checkpoint at or after ``step`` (its manifest written), or None."""
        found = []
        for d in self.ckpt_dir.glob("step_*"):
            try:
                n = int(d.name.split("_", 1)[1])
            except ValueError:
                continue
            if n >= step and (d / MANIFEST).exists():
                found.append((n, d))
        return max(found)[1] if found else None


def _until(fault: HostFault) -> float | None:
    return None if fault.duration_s is None else time.monotonic() + fault.duration_s


def _alive(pid: int) -> bool:
    st = read_stat(pid)
    return st is not None and st.state not in ("Z", "X")


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


class Kind(abc.ABC):
    """A kind of host fault: each subclass injects one (and says how to undo it)."""

    names: tuple[str, ...] = ()

    def due(self, fault: HostFault, scene: Scene, progressed: bool) -> bool:
        """Whether a fault triggered by a step fires now; ``progressed``: its rank has completed that step."""
        return progressed

    @abc.abstractmethod
    def inject(self, fault: HostFault, scene: Scene) -> Injection | None:
        """Inject ``fault`` now: what to undo and record, or None when its target is not there yet (try later)."""


class KillRank(Kind):
    names = ("kill",)

    def inject(self, fault: HostFault, scene: Scene) -> Injection | None:
        member = scene.member(fault.rank)
        if member is None or not _alive(member[1]):
            return None  # not started yet, or gone (its generation is restarting): the next one is the target
        try:
            os.kill(member[1], signal.SIGKILL)
        except ProcessLookupError:
            return None
        return Injection({"pid": member[1]})


class KillNode(Kind):
    names = ("kill_node",)

    def inject(self, fault: HostFault, scene: Scene) -> Injection | None:
        member = scene.member(fault.rank)
        if member is None or member[2] is None or not _alive(member[2]):
            return None
        try:
            os.kill(member[2], signal.SIGKILL)
        except ProcessLookupError:
            return None
        return Injection({"node": member[0], "agent_pid": member[2]})


class Cgroup:
    """One cgroup made for one fault: a process moved in, moved back and the cgroup removed on release."""

    def __init__(self, hierarchy: Path, name: str, pid: int) -> None:
        self.hierarchy, self.path, self.pid = hierarchy, hierarchy / name, pid
        self.path.mkdir()
        _write(self.path / "cgroup.procs", str(pid))

    def release(self) -> None:
        """Move every process back to the hierarchy's root and remove the cgroup (its processes may be gone)."""
        if not self.path.exists():
            return
        try:
            pids = (self.path / "cgroup.procs").read_text().split()
        except OSError:
            pids = []
        for pid in pids:
            try:
                _write(self.hierarchy / "cgroup.procs", pid)
            except OSError:
                pass  # exited meanwhile
        deadline = time.monotonic() + 5.0
        while True:
            try:
                self.path.rmdir()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


class Freeze(Kind):
    """The rank's process frozen in a cgroup v1 freezer cgroup; thawed (and the cgroup removed) on undo."""

    names = ("freeze",)

    def inject(self, fault: HostFault, scene: Scene) -> Injection | None:
        member = scene.member(fault.rank)
        if member is None:
            return None
        group = Cgroup(CGROUP_ROOT / "freezer", scene.new_cgroup_name(fault.kind), member[1])

        def thaw() -> dict[str, Any]:
            try:
                if group.path.exists():
                    _write(group.path / "freezer.state", "THAWED")
            finally:
                group.release()
            return {"pid": group.pid}

        try:
            _write(group.path / "freezer.state", "FROZEN")
        except BaseException:
            group.release()
            raise
        return Injection({"pid": group.pid, "cgroup": str(group.path)}, thaw, _until(fault))


class CpuQuota(Kind):
    """The rank's process limited to a share of one CPU (cgroup v1 ``cpu.cfs_quota_us``, or v2 ``cpu.max``)."""

    names = ("cpu_quota",)

    def inject(self, fault: HostFault, scene: Scene) -> Injection | None:
        member = scene.member(fault.rank)
        if member is None:
            return None
        name, quota_us = scene.new_cgroup_name(fault.kind), max(1000, int(fault.quota * PERIOD_US))
        v1 = (CGROUP_ROOT / "cpu" / "cpu.cfs_quota_us").exists()
        group = Cgroup(CGROUP_ROOT / "cpu" if v1 else CGROUP_ROOT, name, member[1])
        try:
            if v1:
                _write(group.path / "cpu.cfs_period_us", str(PERIOD_US))
                _write(group.path / "cpu.cfs_quota_us", str(quota_us))
            else:
                _write(group.path / "cpu.max", f"{quota_us} {PERIOD_US}")
        except BaseException:
            group.release()
            raise

        def lift() -> dict[str, Any]:
            group.release()
            return {"pid": group.pid}

        return Injection({"pid": group.pid, "cgroup": str(group.path), "quota_us": quota_us, "period_us": PERIOD_US},
                         lift, _until(fault))


class FillDisk(Kind):
    """The checkpoint directory (a tmpfs the injector mounted) filled to the last byte; the filler removed on undo."""

    names = ("fill_disk",)

    def inject(self, fault: HostFault, scene: Scene) -> Injection | None:
        filler = scene.ckpt_dir / FILLER
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        written = 0
        try:
            for size in (1 << 20, 65536, 4096, 512, 1):  # unbuffered: every write meets ENOSPC itself
                chunk = bytes(size)
                while True:
                    try:
                        n = os.write(fd, chunk)
                    except OSError as e:
                        if e.errno != errno.ENOSPC:
                            raise
                        break
                    written += n
                    if n < size:
                        break
        finally:
            os.close(fd)
        st = os.statvfs(scene.ckpt_dir)

        def empty() -> dict[str, Any]:
            filler.unlink(missing_ok=True)
            return {}

        return Injection({"filler_bytes": written, "free_bytes": st.f_bavail * st.f_frsize}, empty, _until(fault))


class DamageCheckpoint(Kind):
    """The largest file of the newest commit at or after ``step``: bytes flipped in its middle, or cut in half."""

    names = ("corrupt_checkpoint", "truncate_checkpoint")

    def due(self, fault: HostFault, scene: Scene, progressed: bool) -> bool:
        assert fault.step is not None
        return scene.commit(fault.step) is not None

    def inject(self, fault: HostFault, scene: Scene) -> Injection | None:
        assert fault.step is not None
        commit = scene.commit(fault.step)
        if commit is None:
            return None
        files = [p for p in commit.rglob("*") if p.is_file() and p.name != MANIFEST]
        target = max(files, key=lambda p: (p.stat().st_size, str(p)))
        size = target.stat().st_size
        where = {"checkpoint": commit.name, "file": str(target.relative_to(commit))}
        if fault.kind == "truncate_checkpoint":
            os.truncate(target, size // 2)
            return Injection({**where, "bytes": size, "now_bytes": size // 2})
        with open(target, "r+b") as f:
            f.seek(size // 2)
            chunk = f.read(16)
            f.seek(size // 2)
            f.write(bytes(b ^ 0xFF for b in chunk))
            f.flush()
            os.fsync(f.fileno())
        return Injection({**where, "flipped_bytes": len(chunk), "at": size // 2})


class StoreOutage(Kind):
    names = ("store_outage",)

    def inject(self, fault: HostFault, scene: Scene) -> Injection | None:
        if scene.store is None:
            raise RuntimeError("store_outage needs the drill's etcd: give [topology] nodes > 1")
        store = scene.store
        store.stop()

        def start() -> dict[str, Any]:
            store.start()  # same ports and data
            return {}

        return Injection({"store": getattr(store, "url", "etcd")}, start, _until(fault))


class StorageTrouble(Kind):
    """The drill's S3 proxy answers 503s, drops connections or holds requests."""

    names = ("s3_errors", "s3_drop", "s3_slow")

    def inject(self, fault: HostFault, scene: Scene) -> Injection | None:
        if scene.s3 is None:
            raise RuntimeError(f"{fault.kind} needs the drill's S3 endpoint: give [topology] storage = \"s3\"")
        proxy = scene.s3
        proxy.set_fault(fault.kind.removeprefix("s3_"), rate=fault.rate, delay_s=fault.delay_s)

        def clear() -> dict[str, Any]:
            proxy.clear()
            return {"requests": proxy.counts()}

        return Injection({"proxy": proxy.url}, clear, _until(fault))


class NetworkTrouble(Kind):
    """The network of the node that runs ``rank``: cut off, losing packets, or further away."""

    names = ("partition", "packet_loss", "latency")

    def inject(self, fault: HostFault, scene: Scene) -> Injection | None:
        if scene.network is None:
            raise RuntimeError(f"{fault.kind} needs the nodes' namespaces: give [topology] network = \"netns\"")
        member = scene.member(fault.rank)
        if member is None:
            return None
        net, node = scene.network, member[0]
        if fault.kind == "partition":
            net.cut(node)
        elif fault.kind == "latency":
            net.set_delay(node, fault.delay_s)
        else:
            net.drop(node, fault.rate)

        def mend() -> dict[str, Any]:
            if fault.kind == "partition":
                net.mend(node)
                return {"node": node}
            if fault.kind == "latency":
                net.set_delay(node, 0.0)
                return {"node": node}
            dropped = net.dropped_packets(node)
            net.undrop(node)
            return {"node": node, "dropped_packets": dropped}

        return Injection({"node": node, "address": net.addresses[node]}, mend, _until(fault))


class Resubmit(Kind):
    names = ("resubmit",)

    def inject(self, fault: HostFault, scene: Scene) -> Injection | None:
        if scene.resubmit is None:
            raise RuntimeError("resubmit needs the runner (it starts the job again)")
        return Injection(dict(scene.resubmit()))


KINDS: dict[str, Kind] = {name: kind for kind in (KillRank(), KillNode(), Freeze(), CpuQuota(), FillDisk(),
                                                  DamageCheckpoint(), StoreOutage(), StorageTrouble(),
                                                  NetworkTrouble(), Resubmit())
                          for name in kind.names}
"""Every host fault kind's object, by name."""
