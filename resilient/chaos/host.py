"""Faults the drill runner injects from outside the workers: cgroups and the checkpoint store.

A worker fault (:mod:`resilient.chaos.plan`) fires inside the rank, at a
section of a step.  These come from the host, as the world does it to a
training job:

- ``kill``: the rank's process is sent SIGKILL (the game day's faults,
  :mod:`resilient.chaos.gameday`: a machine that dies under it);
- ``freeze``: the rank's process is put in a cgroup v1 freezer cgroup and
  frozen (a VM paused, a node stalled); thawed after ``duration_s``.  A
  frozen process cannot even die: a SIGKILL waits for the thaw.
- ``cpu_quota``: the rank's process gets ``quota`` of one CPU through a CPU
  cgroup (v1 ``cpu.cfs_quota_us``, or v2 ``cpu.max`` where that is what the
  machine has), lifted after ``duration_s`` (never, when left out).
- ``fill_disk``: the checkpoint directory is a tmpfs of ``size_mb`` mounted
  for the run (:meth:`HostInjector.prepare`); at the trigger a file fills
  it to the last byte, so saves fail with ENOSPC, and it is removed after
  ``duration_s`` (never, when left out);
- ``kill_node``: the agent of the node that runs ``rank`` is sent SIGKILL,
  and its workers and spares die with it (a machine lost, with its agent):
  the other nodes see its lease lapse;
- ``store_outage``: the run's etcd (started by the runner for a drill of
  several nodes) is stopped, and started again after ``duration_s`` on the
  same ports with the same data (a control plane that goes away);
- ``s3_errors`` / ``s3_drop`` / ``s3_slow``: for ``duration_s`` the proxy in
  front of the drill's S3 server (:mod:`resilient.chaos.s3proxy`) answers a
  share ``rate`` of requests ``503 SlowDown``, closes a share ``rate`` of
  connections unanswered, or holds every request ``delay_s``;
- ``partition`` / ``packet_loss`` / ``latency``: the network of the node
  that runs ``rank`` (each node in a namespace of its own,
  :mod:`resilient.chaos.netns`) is cut off for ``duration_s``, drops a share
  ``rate`` of the packets it receives, or holds every byte to and from it
  ``delay_s`` each way;
- ``resubmit``: the same job is submitted again (a new launch, its own run
  directory, the same checkpoint location) while the first still runs: a
  scheduler that thought it dead.  The first is then a zombie of an older
  launch, and the checkpoint fence must refuse its saves;
- ``corrupt_checkpoint`` / ``truncate_checkpoint``: the largest file of the
  newest committed checkpoint at or after ``step`` has bytes flipped in its
  middle, or is cut to half its length, after its commit (bit rot, a torn
  copy).  The next restore must refuse it and use an older one.

A fault is triggered when ``rank`` has completed ``step`` (read from the
bundled workload's trace), or ``at_s`` seconds after the faulted run began.
:func:`unavailable` says why this machine cannot produce a kind; a drill
that needs one is then skipped with that reason, never faked.
:class:`HostInjector` records each injection (and each lift) as an event in
``host_faults.jsonl`` beside the run, which the score reads with the agent's
events; :meth:`HostInjector.close` thaws, lifts and removes every cgroup it
made, also when the drill failed.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..watchdog.procfs import read_stat

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
FILLER = ".drill-disk-filler"
MANIFEST = "manifest.json"
PERIOD_US = 100_000


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
        if self.kind == "kill":
            what = f"SIGKILL rank {self.rank}"
        elif self.kind == "kill_node":
            what = f"SIGKILL the agent of rank {self.rank}'s node"
        elif self.kind == "store_outage":
            what = f"stop etcd for {self.duration_s:g} s"
        elif self.kind == "partition":
            what = f"cut rank {self.rank}'s node off the network for {self.duration_s:g} s"
        elif self.kind == "resubmit":
            what = "submit the same job again while it runs"
        elif self.kind == "latency":
            what = f"add {self.delay_s * 1e3:g} ms each way to rank {self.rank}'s node for {self.duration_s:g} s"
        elif self.kind == "packet_loss":
            what = f"drop {self.rate:.0%} of the packets reaching rank {self.rank}'s node for {self.duration_s:g} s"
        elif self.kind == "s3_errors":
            what = f"answer {self.rate:.0%} of S3 requests 503 SlowDown for {self.duration_s:g} s"
        elif self.kind == "s3_drop":
            what = f"drop {self.rate:.0%} of S3 connections unanswered for {self.duration_s:g} s"
        elif self.kind == "s3_slow":
            what = f"hold every S3 request {self.delay_s:g} s for {self.duration_s:g} s"
        elif self.kind == "freeze":
            what = f"freeze rank {self.rank} for {self.duration_s:g} s"
        elif self.kind == "cpu_quota":
            what = f"limit rank {self.rank} to {self.quota:g} of a CPU" + \
                (f" for {self.duration_s:g} s" if self.duration_s else "")
        elif self.kind == "fill_disk":
            what = f"fill the checkpoint disk ({self.size_mb} MB tmpfs)" + \
                (f" for {self.duration_s:g} s" if self.duration_s else "")
        elif self.kind == "corrupt_checkpoint":
            what = "flip bytes in the newest committed checkpoint"
        else:
            what = "cut the newest committed checkpoint's largest file in half"
        return f"{what} {when}"

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


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


class _Cgroup:
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


class HostInjector:
    """Fires a drill's host faults as the faulted run reaches them, records them, and undoes them on close."""

    def __init__(self, faults: tuple[HostFault, ...], run_out: Path, ckpt_dir: Path, label: str,
                 store: Any = None, s3: Any = None, network: Any = None, resubmit: Any = None) -> None:
        self.faults = faults
        self.store = store
        self.s3 = s3
        """The drill's S3 fault proxy (:class:`resilient.chaos.s3proxy.FaultProxy`), for the storage faults."""
        self._troubled: list[tuple[float, HostFault]] = []
        self.resubmit = resubmit
        """Starts the job again (``resubmit``): returns what to record of it."""
        self.network = network
        """The nodes' namespaces (:class:`resilient.chaos.netns.Network`), for the network faults."""
        self._cut: list[tuple[float, HostFault, str]] = []
        """The drill's etcd (``stop()`` and ``start()``, same ports and data), for ``store_outage``."""
        self._down: list[tuple[float, HostFault]] = []
        self.run_out, self.ckpt_dir, self.label = run_out, ckpt_dir, label
        self.log = run_out / "host_faults.jsonl"
        self.started = time.monotonic()
        self._fired: set[int] = set()
        self._undo: list[tuple[float | None, HostFault, _Cgroup]] = []
        self._done: dict[int, int] = {}
        """Highest completed step by rank, from the trace."""
        self._trace_at = 0
        self._prefix = f"resilient-drill-{label}-{os.getpid()}-"
        self._made: list[str] = []
        self._mounted = False
        self._filled: list[tuple[float | None, HostFault]] = []

    # ------------------------------------------------------------ mounts
    def prepare(self) -> None:
        """Mount what the faults need before the run starts: a tmpfs at the checkpoint directory (fill_disk)."""
        sizes = [f.size_mb for f in self.faults if f.kind == "fill_disk"]
        if not sizes:
            return
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        if any(self.ckpt_dir.iterdir()):
            raise RuntimeError(f"{self.ckpt_dir} is not empty: a tmpfs mounted over it would hide a checkpoint")
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={max(sizes)}m,mode=0755", "tmpfs",
                               str(self.ckpt_dir)], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"could not mount a tmpfs at {self.ckpt_dir}: {done.stderr.strip()}")
        self._mounted = True

    def unmount(self) -> list[str]:
        """Unmount what :meth:`prepare` mounted (after the run's processes are gone); returns what is still mounted."""
        if self._mounted:
            subprocess.run(["umount", str(self.ckpt_dir)], capture_output=True, check=False)
        return self.mounts()

    def mounts(self) -> list[str]:
        """This injector's mounts still in the mount table."""
        if not self._mounted:
            return []
        target = str(self.ckpt_dir.resolve())
        try:
            table = Path("/proc/self/mounts").read_text().splitlines()
        except OSError:
            return []
        return [line.split()[1] for line in table if len(line.split()) > 1 and line.split()[1] == target]

    def _fill(self) -> dict[str, Any]:
        """Write a file until the filesystem has no byte left (unbuffered: every write meets ENOSPC itself)."""
        fd = os.open(self.ckpt_dir / FILLER, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        written = 0
        try:
            for size in (1 << 20, 65536, 4096, 512, 1):
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
        st = os.statvfs(self.ckpt_dir)
        return {"filler_bytes": written, "free_bytes": st.f_bavail * st.f_frsize}

    # ------------------------------------------------------------ progress
    def _read_trace(self) -> None:
        path = self.run_out / "trace.jsonl"
        try:
            with open(path, "rb") as f:
                f.seek(self._trace_at)
                chunk = f.read()
        except FileNotFoundError:
            return
        end = chunk.rfind(b"\n") + 1  # a line being written is read next time
        self._trace_at += end
        for line in chunk[:end].splitlines():
            try:
                rec = json.loads(line)
                rank, step = int(rec["rank"]), int(rec["step"])
            except (ValueError, KeyError, TypeError):
                continue
            self._done[rank] = max(step, self._done.get(rank, -1))

    def _due(self, fault: HostFault) -> bool:
        if fault.at_s is not None:
            return time.monotonic() - self.started >= fault.at_s
        assert fault.step is not None
        if fault.kind in ("corrupt_checkpoint", "truncate_checkpoint"):
            return self._commit(fault.step) is not None
        return self._done.get(fault.rank, -1) >= fault.step

    def _commit(self, step: int) -> Path | None:
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

    def _member(self, rank: int) -> tuple[str, int, int | None] | None:
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

    def _pid(self, rank: int) -> int | None:
        """The pid of the member with ``rank``, on whichever node runs it."""
        member = self._member(rank)
        return None if member is None else member[1]

    # ------------------------------------------------------------ acting
    def poll(self) -> None:
        """Fire what is due, lift what has run its time."""
        self._read_trace()
        for i, fault in enumerate(self.faults):
            if i not in self._fired and self._due(fault):
                at = time.time()  # the moment the fault begins (stopping a server takes a while)
                detail = self._fire(fault)
                if detail is not None:
                    self._fired.add(i)
                    self._record("fault_injected", fault, detail, at)
        now = time.monotonic()
        for cut in list(self._cut):
            if now >= cut[0]:
                self._mend(cut[1], cut[2])
                self._cut.remove(cut)
        for troubled in list(self._troubled):
            if now >= troubled[0]:
                self._clear_s3(troubled[1])
                self._troubled.remove(troubled)
        for down in list(self._down):
            if now >= down[0]:
                self._restore_store(down[1])
                self._down.remove(down)
        for filled in list(self._filled):
            if filled[0] is not None and now >= filled[0]:
                self._unfill(filled[1])
                self._filled.remove(filled)
        for entry in list(self._undo):
            until, fault, group = entry
            if until is not None and now >= until:
                self._lift(fault, group)
                self._undo.remove(entry)

    def _fire(self, fault: HostFault) -> dict[str, Any] | None:
        if fault.kind == "fill_disk":
            self._filled.append((None if fault.duration_s is None else time.monotonic() + fault.duration_s, fault))
            return self._fill()
        if fault.kind in ("corrupt_checkpoint", "truncate_checkpoint"):
            assert fault.step is not None
            commit = self._commit(fault.step)
            assert commit is not None
            files = [p for p in commit.rglob("*") if p.is_file() and p.name != MANIFEST]
            target = max(files, key=lambda p: (p.stat().st_size, str(p)))
            size = target.stat().st_size
            if fault.kind == "truncate_checkpoint":
                os.truncate(target, size // 2)
                return {"checkpoint": commit.name, "file": str(target.relative_to(commit)), "bytes": size,
                        "now_bytes": size // 2}
            with open(target, "r+b") as f:
                f.seek(size // 2)
                chunk = f.read(16)
                f.seek(size // 2)
                f.write(bytes(b ^ 0xFF for b in chunk))
                f.flush()
                os.fsync(f.fileno())
            return {"checkpoint": commit.name, "file": str(target.relative_to(commit)), "flipped_bytes": len(chunk),
                    "at": size // 2}
        if fault.kind == "resubmit":
            if self.resubmit is None:
                raise RuntimeError("resubmit needs the runner (it starts the job again)")
            return dict(self.resubmit())
        if fault.kind in NETWORK_FAULTS:
            if self.network is None:
                raise RuntimeError(f"{fault.kind} needs the nodes' namespaces: give [topology] network = \"netns\"")
            member = self._member(fault.rank)
            if member is None:
                return None
            node = member[0]
            assert fault.duration_s is not None
            if fault.kind == "partition":
                self.network.cut(node)
            elif fault.kind == "latency":
                self.network.set_delay(node, fault.delay_s)
            else:
                self.network.drop(node, fault.rate)
            self._cut.append((time.monotonic() + fault.duration_s, fault, node))
            return {"node": node, "address": self.network.addresses[node]}
        if fault.kind in STORAGE_FAULTS:
            if self.s3 is None:
                raise RuntimeError(f"{fault.kind} needs the drill's S3 endpoint: give [topology] storage = \"s3\"")
            assert fault.duration_s is not None
            self.s3.set_fault(fault.kind.removeprefix("s3_"), rate=fault.rate, delay_s=fault.delay_s)
            self._troubled.append((time.monotonic() + fault.duration_s, fault))
            return {"proxy": self.s3.url}
        if fault.kind == "store_outage":
            if self.store is None:
                raise RuntimeError("store_outage needs the drill's etcd: give [topology] nodes > 1")
            assert fault.duration_s is not None
            self.store.stop()
            self._down.append((time.monotonic() + fault.duration_s, fault))
            return {"store": getattr(self.store, "url", "etcd")}
        if fault.kind == "kill_node":
            member = self._member(fault.rank)
            if member is None or member[2] is None:
                return None
            node, agent = member[0], member[2]
            st = read_stat(agent)
            if st is None or st.state in ("Z", "X"):
                return None
            try:
                os.kill(agent, signal.SIGKILL)
            except ProcessLookupError:
                return None
            return {"node": node, "agent_pid": agent}
        pid = self._pid(fault.rank)
        if pid is None:
            return None  # the rank's process is not known yet: try again at the next poll
        if fault.kind == "kill":
            st = read_stat(pid)
            if st is None or st.state in ("Z", "X"):
                return None  # that process is gone (its generation is restarting): the next one is the target
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                return None
            return {"pid": pid}
        name = f"{self._prefix}{len(self._made)}-{fault.kind}"
        self._made.append(name)
        until = None if fault.duration_s is None else time.monotonic() + fault.duration_s
        if fault.kind == "freeze":
            group = _Cgroup(CGROUP_ROOT / "freezer", name, pid)
            _write(group.path / "freezer.state", "FROZEN")
            self._undo.append((until, fault, group))
            return {"pid": pid, "cgroup": str(group.path)}
        quota_us = max(1000, int(fault.quota * PERIOD_US))
        if (CGROUP_ROOT / "cpu" / "cpu.cfs_quota_us").exists():
            group = _Cgroup(CGROUP_ROOT / "cpu", name, pid)
            _write(group.path / "cpu.cfs_period_us", str(PERIOD_US))
            _write(group.path / "cpu.cfs_quota_us", str(quota_us))
        else:
            group = _Cgroup(CGROUP_ROOT, name, pid)
            _write(group.path / "cpu.max", f"{quota_us} {PERIOD_US}")
        self._undo.append((until, fault, group))
        return {"pid": pid, "cgroup": str(group.path), "quota_us": quota_us, "period_us": PERIOD_US}

    def _mend(self, fault: HostFault, node: str) -> None:
        if fault.kind == "partition":
            self.network.mend(node)
            self._record("fault_lifted", fault, {"node": node})
        elif fault.kind == "latency":
            self.network.set_delay(node, 0.0)
            self._record("fault_lifted", fault, {"node": node})
        else:
            dropped = self.network.dropped_packets(node)
            self.network.undrop(node)
            self._record("fault_lifted", fault, {"node": node, "dropped_packets": dropped})

    def _clear_s3(self, fault: HostFault) -> None:
        self.s3.clear()
        self._record("fault_lifted", fault, {"requests": self.s3.counts()})

    def _restore_store(self, fault: HostFault) -> None:
        self.store.start()
        self._record("fault_lifted", fault, {})

    def killed_nodes(self) -> set[str]:
        """The nodes whose agents a ``kill_node`` fault killed (their exit status is the drill's doing)."""
        return {str(e["node"]) for e in self.events() if e.get("kind") == "fault_injected" and "node" in e
                and (e.get("fault") or {}).get("kind") == "kill_node"}

    def cut_nodes(self) -> set[str]:
        """The nodes a ``partition`` cut off (replaced while away, they end as the fencing says, not as a node
        that saw the whole run)."""
        return {str(e["node"]) for e in self.events() if e.get("kind") == "fault_injected" and "node" in e
                and (e.get("fault") or {}).get("kind") == "partition"}

    def _unfill(self, fault: HostFault) -> None:
        (self.ckpt_dir / FILLER).unlink(missing_ok=True)
        self._record("fault_lifted", fault, {})

    def _lift(self, fault: HostFault, group: _Cgroup) -> None:
        if fault.kind == "freeze" and group.path.exists():
            _write(group.path / "freezer.state", "THAWED")
        group.release()
        self._record("fault_lifted", fault, {"pid": group.pid})

    def _record(self, kind: str, fault: HostFault, detail: dict[str, Any], at: float | None = None) -> None:
        line = {"time": time.time() if at is None else at, "kind": kind, "source": "host", "fault": fault.to_dict(),
                "description": fault.describe(), **detail}
        with open(self.log, "a") as f:
            f.write(json.dumps(line) + "\n")

    def close(self) -> list[str]:
        """Thaw, lift and remove every cgroup still in place, remove a disk filler; returns the cgroups that could
        not be removed (the tmpfs is unmounted by :meth:`unmount`, once the run's processes are gone)."""
        for _, fault in self._filled:
            self._unfill(fault)
        self._filled.clear()
        for _, fault in self._troubled:
            self._clear_s3(fault)
        self._troubled.clear()
        for _, fault, node in self._cut:
            self._mend(fault, node)
        self._cut.clear()
        for _, fault in self._down:
            self._restore_store(fault)  # a store left down would make the teardown's agents wait on it
        self._down.clear()
        left = []
        for _, fault, group in self._undo:
            try:
                self._lift(fault, group)
            except OSError:
                left.append(str(group.path))
        self._undo.clear()
        return left

    def events(self) -> list[dict[str, Any]]:
        try:
            return [json.loads(line) for line in self.log.read_text().splitlines() if line.strip()]
        except FileNotFoundError:
            return []


    def leftovers(self) -> list[str]:
        """Cgroups this injector made that still exist (a teardown that missed one is reported)."""
        found = []
        for hierarchy in (CGROUP_ROOT / "freezer", CGROUP_ROOT / "cpu", CGROUP_ROOT):
            if hierarchy.is_dir():
                found += [str(p) for p in hierarchy.glob(f"{self._prefix}*") if p.is_dir()]
        return sorted(set(found))
