"""Faults the drill runner injects from outside the workers: cgroups and the checkpoint store.

A worker fault (:mod:`resilient.faults.plan`) fires inside the rank, at a
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
:func:`~resilient.chaos.host_faults.unavailable` says why this machine cannot
produce a kind; a drill that needs one is then skipped with that reason, never
faked.  Each kind is an object (:mod:`resilient.chaos.host_kinds`) that injects
it and says how to undo it.  :class:`HostInjector` records each injection (and
each lift) as an event in ``host_faults.jsonl`` beside the run, which the score
reads with the agent's events; it keeps what it must undo on a stack, and
:meth:`HostInjector.close` undoes all of it in reverse order, every undo tried
even when one before it failed, also when the drill failed.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .host_faults import CGROUP_ROOT, HostFault
from .host_kinds import KINDS, Scene


@dataclass
class _Lasting:
    fault: HostFault
    undo: Callable[[], dict[str, Any]]
    until: float | None


class UndoStack:
    """What was done and must be undone: lifted one by one as each runs its time, the rest in reverse order
    at the end, every undo tried even when one before it raised."""

    def __init__(self, lifted: Callable[[HostFault, dict[str, Any]], None]) -> None:
        self._lasting: list[_Lasting] = []
        self._lifted = lifted

    def __len__(self) -> int:
        return len(self._lasting)

    def push(self, fault: HostFault, undo: Callable[[], dict[str, Any]], until: float | None) -> None:
        self._lasting.append(_Lasting(fault, undo, until))

    def lift_due(self, now: float) -> None:
        """Undo what has run its time, oldest first (an undo that raises is not retried: it propagates)."""
        for entry in [e for e in self._lasting if e.until is not None and now >= e.until]:
            self._lasting.remove(entry)
            self._lifted(entry.fault, entry.undo())

    def unwind(self) -> list[str]:
        """Undo everything left, newest first; returns what could not be undone (the fault and the error)."""
        failed = []
        while self._lasting:
            entry = self._lasting.pop()
            try:
                self._lifted(entry.fault, entry.undo())
            except Exception as e:  # noqa: BLE001  every undo is tried; what failed is reported, not lost
                failed.append(f"{entry.fault.describe()}: not undone: {type(e).__name__}: {e}")
        return failed


class HostInjector:
    """Fires a drill's host faults as the faulted run reaches them, records them, and undoes them on close."""

    def __init__(self, faults: tuple[HostFault, ...], run_out: Path, ckpt_dir: Path, label: str,
                 store: Any = None, s3: Any = None, network: Any = None, resubmit: Any = None) -> None:
        self.faults = faults
        self.scene = Scene(run_out, ckpt_dir, label, store=store, s3=s3, network=network, resubmit=resubmit)
        self.log = run_out / "host_faults.jsonl"
        self.started = time.monotonic()
        self._fired: set[int] = set()
        self._undo = UndoStack(lambda fault, detail: self._record("fault_lifted", fault, detail))
        self._done: dict[int, int] = {}
        """Highest completed step by rank, from the trace."""
        self._trace_at = 0
        self._mounted = False

    # ------------------------------------------------------------ mounts
    def prepare(self) -> None:
        """Mount what the faults need before the run starts: a tmpfs at the checkpoint directory (fill_disk)."""
        sizes = [f.size_mb for f in self.faults if f.kind == "fill_disk"]
        if not sizes:
            return
        self.scene.ckpt_dir.mkdir(parents=True, exist_ok=True)
        if any(self.scene.ckpt_dir.iterdir()):
            raise RuntimeError(f"{self.scene.ckpt_dir} is not empty: a tmpfs mounted over it would hide a checkpoint")
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={max(sizes)}m,mode=0755", "tmpfs",
                               str(self.scene.ckpt_dir)], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"could not mount a tmpfs at {self.scene.ckpt_dir}: {done.stderr.strip()}")
        self._mounted = True

    def unmount(self) -> list[str]:
        """Unmount what :meth:`prepare` mounted (after the run's processes are gone); returns what is still mounted."""
        if self._mounted:
            subprocess.run(["umount", str(self.scene.ckpt_dir)], capture_output=True, check=False)
        return self.mounts()

    def mounts(self) -> list[str]:
        """This injector's mounts still in the mount table."""
        if not self._mounted:
            return []
        target = str(self.scene.ckpt_dir.resolve())
        try:
            table = Path("/proc/self/mounts").read_text().splitlines()
        except OSError:
            return []
        return [line.split()[1] for line in table if len(line.split()) > 1 and line.split()[1] == target]

    # ------------------------------------------------------------ progress
    def _read_trace(self) -> None:
        path = self.scene.run_out / "trace.jsonl"
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
        return KINDS[fault.kind].due(fault, self.scene, self._done.get(fault.rank, -1) >= fault.step)

    # ------------------------------------------------------------ acting
    def poll(self) -> None:
        """Fire what is due, lift what has run its time."""
        self._read_trace()
        for i, fault in enumerate(self.faults):
            if i not in self._fired and self._due(fault):
                at = time.time()  # the moment the fault begins (stopping a server takes a while)
                done = KINDS[fault.kind].inject(fault, self.scene)
                if done is None:
                    continue  # its target is not there yet: the next poll tries again
                self._fired.add(i)
                if done.undo is not None:
                    self._undo.push(fault, done.undo, done.until)
                self._record("fault_injected", fault, done.detail, at)
        self._undo.lift_due(time.monotonic())

    def killed_nodes(self) -> set[str]:
        """The nodes whose agents a ``kill_node`` fault killed (their exit status is the drill's doing)."""
        return {str(e["node"]) for e in self.events() if e.get("kind") == "fault_injected" and "node" in e
                and (e.get("fault") or {}).get("kind") == "kill_node"}

    def cut_nodes(self) -> set[str]:
        """The nodes a ``partition`` cut off (replaced while away, they end as the fencing says, not as a node
        that saw the whole run)."""
        return {str(e["node"]) for e in self.events() if e.get("kind") == "fault_injected" and "node" in e
                and (e.get("fault") or {}).get("kind") == "partition"}

    def _record(self, kind: str, fault: HostFault, detail: dict[str, Any], at: float | None = None) -> None:
        line = {"time": time.time() if at is None else at, "kind": kind, "source": "host", "fault": fault.to_dict(),
                "description": fault.describe(), **detail}
        with open(self.log, "a") as f:
            f.write(json.dumps(line) + "\n")

    def close(self) -> list[str]:
        """Undo every fault still in place, newest first (thaw, lift and remove cgroups, remove a disk filler,
        mend the network, clear the S3 proxy, start etcd again); returns what could not be undone.  The tmpfs
        is unmounted by :meth:`unmount`, once the run's processes are gone."""
        return self._undo.unwind()

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
                found += [str(p) for p in hierarchy.glob(f"{self.scene.cgroup_prefix}*") if p.is_dir()]
        return sorted(set(found))
