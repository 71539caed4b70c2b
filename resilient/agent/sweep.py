"""The processes an agent leaves behind, and the sweep the next agent makes.

Workers die with their agent: each is started with a parent-death signal
(:mod:`resilient.agent.launcher`).  That covers the workers themselves, not
what they started (a helper process in the worker's process group is
reparented to init and lives on), and not a worker that SIGKILL cannot end
(a process in uninterruptible sleep, ``D``).  So the agent also keeps a
record in its node directory::

    <run_dir>/nodes/<node>/agent.lock   flock()ed for the agent's lifetime
    <run_dir>/nodes/<node>/pids.json    {"agent": {pid, start_ticks}, "generation": G,
                                         "workers": [{rank, pid, start_ticks}, ...],
                                         "finished": false}

and a new agent on the same run directory and node id first takes the lock
(refusing to start, naming the pid, while the earlier agent still holds it),
then SIGKILLs the process group of every recorded worker that is still there.
An agent that ends marks its record ``finished``; a record that is not was
left by an agent that died (SIGKILL, a lost machine restarted under the same
node id), which the new agent reports (:attr:`SweepResult.lost`).
A pid is only trusted together with its start time (``/proc/<pid>/stat``
field 22, clock ticks since boot), so a reused pid is never signalled.

A process group outlives its leader while any member lives, and the kernel
does not hand out a pid that is still some group's id; so when the recorded
worker is gone (and no other process has its pid), what is left in its
group can only be what that worker started.
"""

from __future__ import annotations

import fcntl
import os
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.errors import ResilientError
from ..core.fsutil import read_json, write_json_atomic
from ..watchdog.procfs import ProcStat, read_stat

KILL_WAIT_S = 10.0
"""How long a SIGKILLed process may take to disappear before it counts as stuck."""
GIVE_UP_AFTER_S = 60.0
"""How long the agent waits for stuck processes before it stops with the verdict ``unhealthy``."""


class AgentAlreadyRunningError(ResilientError):
    """Another agent is running on the same run directory and node id."""


@dataclass(frozen=True)
class Stuck:
    """A process SIGKILL did not end within the bound."""

    pid: int
    rank: int | None
    state: str
    """Its state from /proc, e.g. ``D (disk sleep)``."""
    start_ticks: int

    def describe(self) -> str:
        who = f"worker pid {self.pid}" + (f" (rank {self.rank})" if self.rank is not None else "")
        return f"{who} still exists after SIGKILL, in state {self.state}"


@dataclass(frozen=True)
class SweepResult:
    """What a new agent found of an earlier one."""

    previous_agent: int | None
    """The earlier agent's pid, if one left a record."""
    killed: tuple[int, ...]
    """Processes that were alive and were SIGKILLed."""
    stuck: tuple[Stuck, ...]
    """Of those, the ones still there after :data:`KILL_WAIT_S`."""
    lost: bool = False
    """The earlier agent died without ending (its record is not marked finished)."""
    generation: int | None = None
    """The generation the earlier agent's workers last ran."""


def group_members(pgid: int, proc_root: Path = Path("/proc")) -> list[ProcStat]:
    """Every live (not zombie) process of process group ``pgid``."""
    found = []
    for entry in proc_root.iterdir():
        if entry.name.isdigit():
            st = read_stat(int(entry.name), proc_root)
            if st is not None and st.pgid == pgid and st.state not in ("Z", "X"):
                found.append(st)
    return found


def same_process(pid: int, start_ticks: int, proc_root: Path = Path("/proc")) -> ProcStat | None:
    """The recorded process if it still exists and is not a zombie (its pid was not reused), else None."""
    st = read_stat(pid, proc_root)
    if st is None or st.start_ticks != start_ticks or st.state in ("Z", "X"):
        return None
    return st


class NodeProcesses:
    """This agent's claim on its node directory and its record of the processes it started.

    ``proc_root``, ``killpg``, ``clock`` and ``sleep`` are injected so that
    the waiting and the verdict can be tested with a made-up ``/proc``.
    """

    def __init__(self, node_dir: Path, *, proc_root: Path = Path("/proc"),
                 killpg: Callable[[int, int], None] = os.killpg, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.node_dir = node_dir
        self.pid_file = node_dir / "pids.json"
        self.lock_file = node_dir / "agent.lock"
        self._proc = proc_root
        self._killpg = killpg
        self._clock = clock
        self._sleep = sleep
        self._lock_fd: int | None = None
        self._me: dict[str, int] | None = None

    # ------------------------------------------------------------ claim
    def claim(self) -> SweepResult:
        """Take the node directory for this agent and sweep what an earlier agent left.

        Raises :class:`AgentAlreadyRunningError` when another agent holds it.
        """
        fd = os.open(self.lock_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise AgentAlreadyRunningError(self._busy_message()) from None
        self._lock_fd = fd
        earlier = read_json(self.pid_file) or {}
        result = self._sweep(earlier)
        me = os.getpid()
        st = read_stat(me, self._proc)
        self._me = {"pid": me, "start_ticks": st.start_ticks if st else 0}
        self._write(None, {})
        return result

    def _busy_message(self) -> str:
        agent = (read_json(self.pid_file) or {}).get("agent") or {}
        pid = agent.get("pid")
        who = f"agent pid {pid}" if pid else "another agent"
        return (f"{who} is still running on {self.node_dir.parent.parent} as node {self.node_dir.name}: stop it "
                f"first (`resilient stop --run-dir {self.node_dir.parent.parent}` or kill {pid or 'it'}), "
                "or give this agent another --node-id or --run-dir")

    def _sweep(self, earlier: Mapping[str, Any]) -> SweepResult:
        agent = earlier.get("agent") or {}
        killed: list[int] = []
        targets: dict[int, tuple[int | None, int]] = {}  # pid -> (rank, start ticks)
        for w in earlier.get("workers") or []:
            pid, ticks, rank = int(w["pid"]), int(w["start_ticks"]), w.get("rank")
            leader = read_stat(pid, self._proc)
            if leader is not None and leader.start_ticks != ticks:
                continue  # the pid was reused: the worker and its whole group are long gone
            members = group_members(pid, self._proc)
            if not members:
                continue
            try:
                self._killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            for m in members:
                killed.append(m.pid)
                targets[m.pid] = (rank if m.pid == pid else None, m.start_ticks)
        stuck = self.wait_gone(targets, KILL_WAIT_S)
        lost = bool(agent) and earlier.get("finished") is False
        return SweepResult(previous_agent=agent.get("pid"), killed=tuple(killed), stuck=stuck, lost=lost,
                           generation=earlier.get("generation"))

    # ------------------------------------------------------------ record
    def record_workers(self, generation: int, pids: Mapping[int, int]) -> None:
        """Remember the workers just started (rank -> pid) so that a later agent can sweep them."""
        workers = {}
        for rank, pid in pids.items():
            st = read_stat(pid, self._proc)
            if st is not None:
                workers[rank] = {"rank": rank, "pid": pid, "start_ticks": st.start_ticks}
        self._write(generation, workers)

    def workers_stopped(self, generation: int, stuck: Sequence[Stuck]) -> None:
        """The generation's workers are reaped, except ``stuck`` ones, which stay on record."""
        keep = {s.rank if s.rank is not None else -s.pid: {"rank": s.rank, "pid": s.pid, "start_ticks": s.start_ticks}
                for s in stuck}
        self._write(generation, keep)

    def _write(self, generation: int | None, workers: Mapping[int, Mapping[str, Any]]) -> None:
        write_json_atomic(self.pid_file, {"agent": self._me, "generation": generation,
                                          "workers": [workers[k] for k in sorted(workers)], "finished": False})

    def release(self) -> None:
        """At the agent's end: mark the record finished (stuck workers stay recorded) and let the lock go."""
        if self._lock_fd is not None:
            record = read_json(self.pid_file) or {}
            if self._me is not None and record.get("agent") == self._me:
                write_json_atomic(self.pid_file, {**record, "finished": True})
            os.close(self._lock_fd)
            self._lock_fd = None

    # ------------------------------------------------------------ waiting
    def wait_gone(self, processes: Mapping[int, tuple[int | None, int]], timeout_s: float) -> tuple[Stuck, ...]:
        """Wait up to ``timeout_s`` for ``{pid: (rank, start_ticks)}`` to disappear; return the ones still there."""
        deadline = self._clock() + timeout_s
        while True:
            left = {p: v for p, v in processes.items() if same_process(p, v[1], self._proc) is not None}
            if not left or self._clock() >= deadline:
                break
            self._sleep(0.02)
        stuck = []
        for pid, (rank, ticks) in sorted(left.items()):
            st = same_process(pid, ticks, self._proc)
            if st is not None:
                stuck.append(Stuck(pid, rank, st.state_name, ticks))
        return tuple(stuck)

    def wait_stuck(self, stuck: Sequence[Stuck], timeout_s: float = GIVE_UP_AFTER_S) -> tuple[Stuck, ...]:
        """Wait for processes found stuck earlier; return those still there after ``timeout_s``."""
        return self.wait_gone({s.pid: (s.rank, s.start_ticks) for s in stuck}, timeout_s)


def stuck_state(pid: int, rank: int | None, proc_root: Path = Path("/proc")) -> Stuck | None:
    """``pid`` as a :class:`Stuck` record if it still exists (and is not a zombie), else None."""
    st = read_stat(pid, proc_root)
    if st is None or st.state in ("Z", "X"):
        return None
    return Stuck(pid, rank, st.state_name, st.start_ticks)
