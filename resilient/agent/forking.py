"""How the agent starts worker processes: forked from its fork server when it can, the plain way when not.

The fork server (:mod:`resilient.worker.forkserver`) is started once per agent, from the thread that starts the
workers (its parent-death signal is that thread's, see :func:`~resilient.agent.launcher.parent_death_signal`),
with the workers' base environment; it imports torch while the agent meets its peers.  A worker it forks costs
milliseconds instead of an interpreter start and ``import torch``.

A worker is started the plain way (``subprocess.Popen``) when the server cannot reproduce what a fresh interpreter
would do for it: its command line is not ``python [-u] [-B] SCRIPT|-m MODULE ...`` with the server's interpreter,
its environment differs from the server's in a variable read at start (``PYTHONHASHSEED``, ``LD_PRELOAD``, ...), or
the server refuses (a thread or CUDA alive in it) or is gone.  The reason is reported once
(``fork_server_unavailable``); ``--no-fork-server`` never starts one.

:class:`Forked` answers what the agent asks of a ``subprocess.Popen`` (``pid``, ``stdout``, ``wait``, ``poll``,
``returncode``): the server reports each exit over the socket, since only a parent can wait for a process.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Protocol

from ..worker.forkserver import receive_message, send_message, split_argv

READY_TIMEOUT_S = 120.0
"""How long a worker start waits for the server to finish its imports before starting the plain way."""

START_TIME_ENV = ("PYTHONHASHSEED", "PYTHONHOME", "PYTHONOPTIMIZE", "PYTHONMALLOC", "PYTHONDEVMODE",
                  "PYTHONWARNINGS", "PYTHONSAFEPATH", "PYTHONNOUSERSITE", "PYTHONUTF8", "PYTHONIOENCODING",
                  "LD_PRELOAD", "LD_LIBRARY_PATH", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "KMP_AFFINITY",
                  "GOMP_CPU_AFFINITY", "MALLOC_CONF", "TORCH_CPP_LOG_LEVEL")
"""Variables a process reads once, at start or at ``import torch``: a worker whose value differs from the
server's cannot be forked from it (``OMP_NUM_THREADS`` can: the child sets torch's threads)."""


class Process(Protocol):
    """What the agent uses of a worker process."""

    pid: int
    stdout: IO[bytes] | None
    returncode: int | None

    def wait(self, timeout: float | None = None) -> int: ...

    def poll(self) -> int | None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


class Forked:
    """A worker forked by the fork server: its exit comes from the server's report."""

    def __init__(self, pid: int, stdout: IO[bytes] | None) -> None:
        self.pid = pid
        self.stdout: IO[bytes] | None = stdout
        self.returncode: int | None = None
        self._done = threading.Event()

    def ended(self, returncode: int) -> None:
        if self.returncode is None:
            self.returncode = returncode
        self._done.set()

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def poll(self) -> int | None:
        return self.returncode

    def send_signal(self, signum: int) -> None:
        """Signal the worker itself (not its session), if it still runs."""
        if self.returncode is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def unforkable(argv: Sequence[str], env: Mapping[str, str], server_env: Mapping[str, str]) -> str | None:
    """Why ``argv`` with ``env`` must be started the plain way rather than forked, or None."""
    if not argv or os.path.realpath(argv[0]) != os.path.realpath(sys.executable):
        return f"the worker's command {argv[0] if argv else '(empty)'!r} is not this Python ({sys.executable})"
    try:
        split_argv(list(argv))
    except ValueError as e:
        return f"the worker's command line: {e}"
    differs = [k for k in START_TIME_ENV if env.get(k) != server_env.get(k)]
    if differs:
        return f"the worker's environment sets {', '.join(differs)} unlike the fork server's (read at start)"
    return None


def _niced(preexec: Callable[[], None] | None, nice: int) -> Callable[[], None] | None:
    """``preexec`` (the minimal, lock-free one of ``parent_death_signal()``), then a bare ``nice`` system call."""
    if not nice:
        return preexec
    raise_by = os.nice

    def then_nice() -> None:
        if preexec is not None:
            preexec()
        raise_by(nice)

    return then_nice


def _close(fd: int) -> None:
    if fd >= 0:
        os.close(fd)


class Spawner:
    """Starts the workers of one agent: forked when the server can, ``subprocess.Popen`` when not."""

    def __init__(self, *, enabled: bool, base_env: Mapping[str, str], preload: Sequence[str] = (),
                 log_file: Path | None = None, unavailable: Callable[[str], None] = lambda reason: None) -> None:
        self.enabled = enabled
        self._base_env = dict(base_env)
        self._preload = tuple(preload)
        self._log_file = log_file
        self._unavailable = unavailable
        self._told: str | None = None
        self._sock: socket.socket | None = None
        self._server: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._ready = threading.Event()
        self._problem: str | None = None
        self._replies: dict[int, dict[str, Any]] = {}
        self._replied = threading.Condition(self._lock)
        self._children: dict[int, Forked] = {}
        self._early: dict[int, int] = {}
        """Exits reported before the reply that named the pid was taken (a worker that ended at once)."""
        self._next_id = 0
        self._reader: threading.Thread | None = None

    @property
    def server_pid(self) -> int | None:
        return self._server.pid if self._server is not None else None

    def start(self, preexec: Callable[[], None] | None) -> None:
        """Start the server (call from the thread that starts the workers); it imports in the background."""
        if not self.enabled or self._server is not None:
            return
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        log = open(self._log_file, "ab") if self._log_file is not None else subprocess.DEVNULL
        try:
            self._server = subprocess.Popen(
                [sys.executable, "-m", "resilient.worker.forkserver", "--fd", str(theirs.fileno()),
                 "--preload", ",".join(self._preload)],
                env=self._base_env, stdin=subprocess.DEVNULL, stdout=log, stderr=log, pass_fds=(theirs.fileno(),),
                start_new_session=True, preexec_fn=preexec)  # noqa: PLW1509  parent_death_signal()'s
        except OSError as e:
            self._problem = f"the fork server did not start: {e}"
            self._ready.set()
            ours.close()
            return
        finally:
            theirs.close()
            if log is not subprocess.DEVNULL:
                log.close()  # type: ignore[union-attr]
        self._sock = ours
        self._reader = threading.Thread(target=self._read, name="fork-server", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._sock is not None
        first = True
        while True:
            try:
                got = receive_message(self._sock)
            except (OSError, ValueError):
                got = None
            if got is None:
                self._gone("the fork server ended" if not first else "the fork server ended before it was ready")
                return
            message, fds = got
            for fd in fds:
                os.close(fd)
            if first:
                first = False
                if not message.get("ready"):
                    self._problem = f"the fork server is not usable: {message.get('problem')}"
                self._ready.set()
                if self._problem is not None:
                    return
                continue
            with self._lock:
                if "exit" in message:
                    child = self._children.pop(message["exit"], None)
                    if child is not None:
                        child.ended(message["returncode"])
                    else:
                        self._early[message["exit"]] = message["returncode"]
                else:
                    self._replies[message["id"]] = message
                    self._replied.notify_all()

    def _gone(self, why: str) -> None:
        """The server is gone: its workers died with it (parent-death signal)."""
        with self._lock:
            if self._problem is None:
                self._problem = why
            for child in self._children.values():
                child.ended(-9)
            self._children.clear()
            self._replied.notify_all()
        self._ready.set()

    def popen(self, argv: Sequence[str], env: Mapping[str, str], preexec: Callable[[], None] | None, *,
              output: int | None = None, nice: int = 0) -> Process:
        """Start one worker: stdin from /dev/null, stdout and stderr together on a pipe (``stdout``), or on
        descriptor ``output`` when given (``stdout`` is then None), in a session of its own, at niceness
        ``nice`` (added to the agent's)."""
        reason = self._why_plain(argv, env)
        if reason is None:
            forked = self._fork(argv, env, output, nice)
            if isinstance(forked, Forked):
                return forked
            reason = forked
        if self.enabled and self._told is None:
            self._told = reason
            self._unavailable(reason)
        return subprocess.Popen(list(argv), env=dict(env), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE if output is None else output, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=_niced(preexec, nice))  # noqa: PLW1509

    def _why_plain(self, argv: Sequence[str], env: Mapping[str, str]) -> str | None:
        if not self.enabled:
            return "--no-fork-server"
        if self._server is None:
            return "the fork server was not started"
        if not self._ready.wait(READY_TIMEOUT_S):
            return f"the fork server was not ready after {READY_TIMEOUT_S:.0f} s"
        if self._problem is not None:
            return self._problem
        return unforkable(argv, env, self._base_env)

    def _fork(self, argv: Sequence[str], env: Mapping[str, str], output: int | None, nice: int) -> Forked | str:
        assert self._sock is not None
        read_end, write_end = os.pipe() if output is None else (-1, os.dup(output))
        devnull = os.open(os.devnull, os.O_RDONLY)
        with self._lock:
            self._next_id += 1
            request_id = self._next_id
        try:
            try:
                with self._send_lock:
                    send_message(self._sock, {"id": request_id, "argv": list(argv), "env": dict(env),
                                              "cwd": os.getcwd(), "nice": nice}, [devnull, write_end, write_end])
            except OSError as e:
                _close(read_end)
                return f"the fork server did not take the request: {e}"
        finally:
            os.close(devnull)
            os.close(write_end)
        with self._lock:
            deadline = time.monotonic() + READY_TIMEOUT_S
            while request_id not in self._replies and self._problem is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._replied.wait(left)
            reply = self._replies.pop(request_id, None)
            if reply is None or "pid" not in reply:
                _close(read_end)
                if reply is None:
                    return self._problem or "the fork server did not answer"
                return f"the fork server refused: {reply.get('refused')}"
            child = Forked(reply["pid"], os.fdopen(read_end, "rb") if read_end >= 0 else None)
            early = self._early.pop(child.pid, None)
            if early is not None:
                child.ended(early)
            else:
                self._children[child.pid] = child
        return child

    def close(self) -> None:
        """End the server (its workers, if any still run, die with it)."""
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()
        if self._server is not None:
            try:
                self._server.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._server.kill()
                self._server.wait()
        if self._reader is not None:
            self._reader.join(timeout=5)
