"""Start the tests' own worker processes the way the agent starts its workers: forked from a fork server.

One server per test process (started on first use, closed at exit) imports torch once; each worker script it
forks sees what a fresh ``python SCRIPT`` would show it (``tests/test_forkserver.py``), at a fraction of the cost.
``run_ranks`` starts a world of ranks on this machine as ``torchrun --standalone`` would (the same environment
variables, the rest of the ranks stopped when one fails), without the launcher's own interpreter start.
"""

from __future__ import annotations

import atexit
import os
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from resilient.agent.forking import Process, Spawner
from resilient.agent.launcher import parent_death_signal

REPO = Path(__file__).resolve().parent.parent


def base_env() -> dict[str, str]:
    """The environment the tests' workers start from: this process's now (a fixture may have set a variable)."""
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


_spawner: Spawner | None = None
_lock = threading.Lock()


def spawner() -> Spawner:
    global _spawner
    with _lock:
        if _spawner is None:
            told: list[str] = []
            _spawner = Spawner(enabled=True, base_env=base_env(), unavailable=told.append)
            # The main thread lives as long as the test process: the server dies with it, not with a test's thread.
            _spawner.start(parent_death_signal() if threading.current_thread() is threading.main_thread() else None)
            atexit.register(_spawner.close)
        return _spawner


def popen(argv: Sequence[str], env: Mapping[str, str] | None = None, *, output: IO[str] | IO[bytes] | None = None
          ) -> Process:
    """Start ``argv`` (``sys.executable`` first) with environment ``env`` (:func:`base_env` when None): stdout and
    stderr together on ``output``'s descriptor, or on a pipe read from ``.stdout`` when None."""
    return spawner().popen(list(argv), dict(env) if env is not None else base_env(), None,
                           output=output.fileno() if output is not None else None)


def collect(proc: Process, timeout: float = 180) -> Finished:
    """Wait for a process started with a pipe and read everything it printed (killed after ``timeout``)."""
    chunks: list[bytes] = []
    reader = threading.Thread(target=_drain, args=(proc, chunks), daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        reader.join(timeout=30)
    return Finished(code, b"".join(chunks).decode(errors="replace"))


@dataclass
class Finished:
    """A process run to its end: its exit code and everything it printed (stdout and stderr together)."""

    returncode: int
    output: str


def run(argv: Sequence[str], env: Mapping[str, str] | None = None, *, timeout: float = 180) -> Finished:
    """Run ``argv`` to its end (killed after ``timeout``, which then raises ``subprocess.TimeoutExpired``)."""
    return run_ranks(argv, 1, env, timeout=timeout, world=False)[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(argv: Sequence[str], nproc: int, env: Mapping[str, str] | None = None, *, timeout: float = 180,
              world: bool = True) -> list[Finished]:
    """Run ``nproc`` ranks of ``argv`` to their end, as ``torchrun --standalone --nproc-per-node N`` would: rank,
    world and rendezvous variables set, and once a rank fails, the others stopped (SIGTERM, SIGKILL 5 s later)."""
    run_id = uuid.uuid4().hex[:12]
    port = free_port()
    procs: list[Process] = []
    outputs: list[list[bytes]] = []
    readers: list[threading.Thread] = []
    try:
        for rank in range(nproc):
            rank_env = dict(env or {})
            if world:
                rank_env.update({
                    "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                    "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
                    "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(nproc), "ROLE_NAME": "default",
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": run_id,
                    "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0"})
            proc = popen(argv, {**base_env(), **rank_env})
            procs.append(proc)
            chunks: list[bytes] = []
            outputs.append(chunks)
            reader = threading.Thread(target=_drain, args=(proc, chunks), daemon=True)
            reader.start()
            readers.append(reader)
        deadline = time.monotonic() + timeout
        stop_by: float | None = None
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if now > deadline:
                raise subprocess.TimeoutExpired([str(a) for a in argv], timeout)
            failed = any(p.returncode not in (None, 0) for p in procs)
            if failed and stop_by is None:
                stop_by = now + 5.0
                for p in procs:
                    p.terminate()
            elif stop_by is not None and now > stop_by:
                for p in procs:
                    p.kill()
            time.sleep(0.02)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
        for reader in readers:
            reader.join(timeout=30)
    return [Finished(p.wait(), b"".join(chunks).decode(errors="replace")) for p, chunks in zip(procs, outputs)]


def _drain(proc: Process, chunks: list[bytes]) -> None:
    out = proc.stdout
    assert out is not None
    while chunk := out.read1(65536):  # type: ignore[attr-defined]
        chunks.append(chunk)
    out.close()
