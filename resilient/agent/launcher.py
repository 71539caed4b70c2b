"""Start, watch and stop one node's worker processes.

Mechanism only: the supervisor decides, this module carries it out.  Each
worker is a child in its own session (so that stopping it also stops what
it spawned), with stdout and stderr copied line by line to a per-rank log
file and, prefixed with the rank, to the agent's own stdout, except what a
worker prints after announcing an uncaught exception
(:data:`~resilient.worker.hooks.UNCAUGHT_PREFIX`, printed by the
excepthook its ``Run`` installs once the error file is written): that
traceback is a survivor's consequence as often as it is the cause, so it
goes to the log only and the agent prints the error under the incident,
once it knows which failure came first.  A waiter
thread per worker stamps the moment it exited, so that the first failure
can be told from the casualties that followed it.

Workers die with their agent: on Linux each one asks the kernel for SIGKILL
when its parent dies (``prctl(PR_SET_PDEATHSIG)``), so a SIGKILLed agent
leaves no worker training on alone.  What a worker started itself, and a
worker SIGKILL cannot end, are the next agent's sweep
(:mod:`resilient.agent.sweep`).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from ..worker.hooks import UNCAUGHT_PREFIX
from .forking import Process, Spawner
from .sweep import KILL_WAIT_S, Stuck, stuck_state

PR_SET_PDEATHSIG = 1
"""From <linux/prctl.h>."""


def parent_death_signal() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get SIGKILL when its parent dies; None off Linux.

    The parent-death signal fires when the *thread* that forked the child
    exits, not the process: workers are spawned by the thread that runs
    ``Agent.run`` (the main thread under ``resilient run``), which lives as
    long as the agent; never spawn them from a short-lived helper thread.

    ``preexec_fn`` runs between fork and exec in a copy of a process that
    has other threads, where taking any lock (the dynamic loader's, the
    allocator's, the import lock) can deadlock: so ``prctl`` is resolved
    here, before the fork, and the child does nothing but call it and then
    check its parent, which catches a parent that died before the prctl.
    """
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    parent = os.getpid()
    sigkill = int(signal.SIGKILL)
    getppid, getpid, kill = os.getppid, os.getpid, os.kill

    def set_parent_death_signal() -> None:
        # Cannot fail for a valid signal number; its result is not checked so the child stays minimal.
        prctl(PR_SET_PDEATHSIG, sigkill, 0, 0, 0)
        if getppid() != parent:  # the agent died between fork and prctl: the signal will never come
            kill(getpid(), sigkill)

    return set_parent_death_signal


CAP_SYS_NICE = 23
"""From <linux/capability.h>."""


def why_not_renice(status: Path = Path("/proc/self/status")) -> str | None:
    """Why this process could not set a child's niceness back to 0 once raised, or None (it may).

    Lowering a niceness takes CAP_SYS_NICE, or an RLIMIT_NICE soft limit of 20 (``20 - limit`` is the lowest
    niceness an unprivileged process may set)."""
    try:
        caps = next((line.split()[1] for line in status.read_text().splitlines() if line.startswith("CapEff:")), "0")
        if int(caps, 16) >> CAP_SYS_NICE & 1:
            return None
    except (OSError, ValueError):
        pass
    import resource

    soft, _hard = resource.getrlimit(resource.RLIMIT_NICE)
    if soft == resource.RLIM_INFINITY or soft >= 20:
        return None
    return (f"the agent lacks CAP_SYS_NICE and its RLIMIT_NICE is {soft} (20 needed), so a promoted spare could "
            "not be given the workers' priority back")


PLAIN = Spawner(enabled=False, base_env={})
"""Starts every worker the plain way (``subprocess.Popen``)."""


@dataclass(frozen=True, kw_only=True)
class WorkerSpec:
    """What one worker process runs and with which environment."""

    local_rank: int
    rank: int
    """The global rank; -1 for a spare, which has none until it is promoted."""
    argv: tuple[str, ...]
    env: Mapping[str, str]
    log_file: Path
    echo: bool = True
    """Copy the worker's output to the agent's stdout, prefixed ``[rank N]`` (``[spare ID]``)."""
    worker_id: str = ""
    """The process's name across generations of in-process recovery (``RESILIENT_WORKER_ID``)."""
    slot: int = 0
    """Its heartbeat socket's index on this node (a replacement takes the slot the dead process left)."""
    nice: int = 0
    """The niceness it starts with (a spare's is raised, so that it never slows the workers it stands by for)."""


@dataclass(frozen=True)
class Exit:
    """How and when a worker ended."""

    rank: int
    local_rank: int
    pid: int
    returncode: int
    """As ``subprocess`` reports it: negative for a signal."""
    at: float
    """Clock time at which the exit was observed."""

    @property
    def signal(self) -> int | None:
        return -self.returncode if self.returncode < 0 else None


@dataclass(frozen=True)
class Settled:
    """One reading of a group's members (:meth:`WorkerGroup.settled`)."""

    members: tuple[Worker, ...]
    failed: tuple[Exit, ...]
    """Members that had exited non-zero, earliest first."""
    all_exited: bool
    """Every member had exited (zero or not) at the same reading."""


class Worker:
    """One running worker process."""

    def __init__(self, spec: WorkerSpec, clock: Callable[[], float], echo_to: IO[str],
                 preexec: Callable[[], None] | None = None, changed: threading.Event | None = None,
                 spawner: Spawner | None = None) -> None:
        self.spec = spec
        self.rank = spec.rank
        """Its rank now: in-process recovery promotes a spare (-1) and renumbers the ranks of a shrunk world."""
        self.worker_id = spec.worker_id
        self.changed: threading.Event | None = changed
        """Set when this worker exits, to wake the watch loop at once."""
        self._clock = clock
        spec.log_file.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(spec.log_file, "ab", buffering=0)
        self.proc: Process = (spawner or PLAIN).popen(spec.argv, spec.env, preexec, nice=spec.nice)
        self.pid = self.proc.pid
        self.exit: Exit | None = None
        self.held_lines = 0
        """Lines kept out of the console after the worker announced an uncaught exception (all in its log)."""
        self._echo_to = echo_to
        self._copier = threading.Thread(target=self._copy_output, name=f"rank{spec.rank}-output", daemon=True)
        self._copier.start()
        self._waiter = threading.Thread(target=self._wait, name=f"rank{spec.rank}-wait", daemon=True)
        self._waiter.start()

    def _wait(self) -> None:
        code = self.proc.wait()
        self.exit = Exit(self.rank, self.spec.local_rank, self.pid, code, self._clock())
        if self.changed is not None:
            self.changed.set()

    def _copy_output(self) -> None:
        assert self.proc.stdout is not None
        marker = UNCAUGHT_PREFIX.encode()
        for line in iter(self.proc.stdout.readline, b""):
            prefix = (f"[rank {self.rank}] " if self.rank >= 0 else f"[spare {self.worker_id}] ").encode()
            self._log.write(line)
            if self.held_lines or line.startswith(marker):
                # The worker raised and is exiting: its traceback (and whatever follows) stays in the log, and
                # the agent shows the error under the incident, so the console leads with the first failure.
                self.held_lines += 1
            elif self.spec.echo:
                try:
                    self._echo_to.write((prefix + line).decode(errors="replace"))
                    self._echo_to.flush()
                except (OSError, ValueError):
                    pass  # the agent's stdout went away; the log file still has everything
        self.proc.stdout.close()

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the worker's whole session, if it still runs."""
        if self.exit is not None:
            return
        try:
            os.killpg(self.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def reprioritise(self, nice: int = 0) -> str | None:
        """Give every thread of the worker's session niceness ``nice`` (a promoted spare's back to a member's);
        why not, or None.  Lowering a niceness needs CAP_SYS_NICE (or RLIMIT_NICE room)."""
        if self.exit is not None or self.spec.nice == nice:
            return None
        try:
            os.setpriority(os.PRIO_PGRP, self.pid, nice)  # the session's process group: every thread of it
        except ProcessLookupError:
            return None
        except PermissionError:
            return (f"the agent may not lower a process's niceness (no CAP_SYS_NICE): pid {self.pid} keeps "
                    f"niceness {self.spec.nice}; run the agent with CAP_SYS_NICE or RLIMIT_NICE >= {20 - nice}, or "
                    "--spare-nice 0")
        return None

    def finish(self, timeout: float = 5.0) -> None:
        """Wait for output copying to end and close the log."""
        self._waiter.join(timeout)
        self._copier.join(timeout)
        self._log.close()


class WorkerGroup:
    """The workers of one generation on this node, and its spares.

    Create it on the thread that supervises the workers for their whole
    life (see :func:`parent_death_signal`): spares started later must be
    started from that thread too.  ``workers`` holds the members by rank;
    in-process recovery moves a spare into a lost rank's place
    (:meth:`promote`), renumbers a shrunk world (:meth:`renumber`) and keeps
    the lost processes in ``retired`` until the group stops.
    """

    def __init__(self, specs: Sequence[WorkerSpec], clock: Callable[[], float] = time.monotonic,
                 echo_to: IO[str] | None = None, *, kill_wait_s: float = KILL_WAIT_S,
                 spawner: Spawner | None = None) -> None:
        self._clock = clock
        self._kill_wait_s = kill_wait_s
        self.workers: dict[int, Worker] = {}
        self.spares: dict[str, Worker] = {}
        """Spare processes by worker id, not members of the current generation."""
        self.retired: list[Worker] = []
        """Members lost to a failure that the group went on without."""
        self.attempt = 0
        """The restart count its processes run under (spares started later get it too)."""
        self.stuck: tuple[Stuck, ...] = ()
        """Workers that SIGKILL did not end within ``kill_wait_s`` (set by :meth:`stop`)."""
        self.changed = threading.Event()
        """Set when a worker exits (and by whoever else has news for the watch loop): wait on it, not a sleep."""
        self._out = echo_to if echo_to is not None else sys.stdout
        self._preexec = parent_death_signal()
        self._spawner = spawner
        try:
            for spec in specs:
                self.workers[spec.rank] = Worker(spec, clock, self._out, self._preexec, self.changed, spawner)
        except BaseException:
            self.stop(grace_s=0)
            raise

    def start_spare(self, spec: WorkerSpec) -> Worker:
        """Start a spare process (``spec.rank`` is -1); it waits in ``resilient.Run()`` to be promoted."""
        worker = self.spares[spec.worker_id] = Worker(spec, self._clock, self._out, self._preexec, self.changed,
                                                      self._spawner)
        return worker

    def retire(self, rank: int) -> Worker:
        """Take lost member ``rank`` out of the members (it has exited or been killed)."""
        worker = self.workers.pop(rank)
        self.retired.append(worker)
        return worker

    def promote(self, worker_id: str, rank: int) -> Worker:
        """Make spare ``worker_id`` the member of ``rank`` (a free rank: retire the lost one first)."""
        if rank in self.workers:
            raise ValueError(f"rank {rank} still has a member (pid {self.workers[rank].pid}); retire it first")
        worker = self.spares.pop(worker_id)
        worker.rank = rank
        self.workers[rank] = worker
        return worker

    def renumber(self, rank_map: Mapping[int, int]) -> None:
        """Give the members new ranks (old -> new, every member listed), as a shrink closes up the ranks."""
        if sorted(rank_map) != sorted(self.workers) or len(set(rank_map.values())) != len(rank_map):
            raise ValueError(f"renumber needs a one-to-one map of the members {sorted(self.workers)}, got {rank_map}")
        moved = {rank_map[old]: w for old, w in self.workers.items()}
        for rank, w in moved.items():
            w.rank = rank
        self.workers = moved

    def spare_exits(self) -> list[tuple[str, Exit]]:
        """Spares that exited (a spare is never expected to), earliest first."""
        found = [(i, w.exit) for i, w in self.spares.items() if w.exit is not None]
        return sorted(found, key=lambda pair: pair[1].at)

    def everyone(self) -> list[Worker]:
        """Members, spares and retired members: every process this group started."""
        return [*self.workers.values(), *self.spares.values(), *self.retired]

    def pause(self, seconds: float) -> None:
        """Wait up to ``seconds``, less when a worker exits or news arrives (see :attr:`changed`)."""
        self.changed.wait(seconds)
        self.changed.clear()

    def exits(self) -> list[Exit]:
        """Exits observed so far, earliest first."""
        found = [w.exit for w in self.workers.values() if w.exit is not None]
        return sorted(found, key=lambda e: e.at)

    def running(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.exit is None]

    def settled(self) -> Settled:
        """The members' exits, each read once: a worker's exit lands from its own thread at any moment, so
        "every member exited" and "these exited non-zero" must come from the same reading, or a worker killed
        between two readings counts as exited and not failed (a SIGKILL seen as success)."""
        members = tuple(self.workers.values())
        seen = [w.exit for w in members]
        failed = sorted((e for e in seen if e is not None and e.returncode != 0), key=lambda e: e.at)
        return Settled(members, tuple(failed), all(e is not None for e in seen))

    def unchanged_since(self, settled: Settled) -> bool:
        """The members are the ones ``settled`` read (no promotion, shrink or adoption since)."""
        now = tuple(self.workers.values())
        return len(now) == len(settled.members) and all(a is b for a, b in zip(now, settled.members))

    def signal(self, signum: int) -> None:
        for w in self.everyone():
            w.signal(signum)

    def stop(self, grace_s: float) -> tuple[Stuck, ...]:
        """SIGTERM every worker still running, SIGKILL after ``grace_s``, then reap them all.

        A stopped (SIGSTOPped) worker is continued first so that SIGTERM can act.
        Returns (and keeps in :attr:`stuck`) the workers that SIGKILL did not
        end within ``kill_wait_s``, e.g. a process in uninterruptible sleep
        (``D``) on a dead filesystem or driver, with their state from /proc:
        the caller must not start new workers beside them.
        """
        for spare in self.spares.values():
            spare.signal(signal.SIGKILL)  # it holds nothing of the run's to save: gone at once, not after a grace
        self.signal(signal.SIGTERM)
        self.signal(signal.SIGCONT)
        deadline = self._clock() + grace_s

        def alive() -> bool:
            return any(w.exit is None for w in self.everyone())

        while alive() and self._clock() < deadline:
            self.changed.wait(0.02)  # each worker's waiter sets it when it exits (after recording the exit)
            self.changed.clear()
        if alive():
            self.signal(signal.SIGKILL)
        kill_deadline = time.monotonic() + self._kill_wait_s
        stuck = []
        for w in self.everyone():
            try:
                w.proc.wait(timeout=max(0.0, kill_deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                found = stuck_state(w.pid, w.rank)
                if found is not None:
                    stuck.append(found)
                    continue  # its waiter thread reaps it if it ever ends; the log stays open until then
            w.finish()
        self.stuck = tuple(stuck)
        return self.stuck
