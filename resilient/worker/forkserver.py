"""The fork server: one process per agent that has imported torch, and forks every worker from there.

A worker's ``import torch`` costs seconds of CPU (3.6 s on a small machine); a fork of a process that has done it
costs milliseconds.  The agent starts this module once (``python -m resilient.worker.forkserver --fd N``), with
the workers' base environment, and asks it over a unix socket for each worker (:mod:`resilient.agent.forking`).

What a forked worker sees is what a fresh ``python [-u] [-B] SCRIPT ARGS`` (or ``-m MODULE``) would have shown it:
its own session, SIGKILL when this server dies (and this server dies with its agent), stdin, stdout and stderr on
the descriptors the agent sent, the worker's environment, ``sys.argv``, ``sys.path[0]`` as Python sets it (the
script's directory; the working directory for ``-m``), the script run as ``__main__``, signal dispositions and the
random module reseeded as at start, numpy's global generator reseeded, torch's intra-op threads as its
``OMP_NUM_THREADS`` asks.  An uncaught exception prints its traceback and exits 1; ``sys.exit`` and the interpreter's
shutdown (``atexit``, non-daemon threads) behave as in any Python process.

It refuses to fork while a Python thread besides its main one is alive or CUDA is initialised, which no fork
survives; the agent then starts the workers the plain way.  Messages are one JSON object per datagram-sized frame, prefixed
with its length; descriptors travel with a request (``SCM_RIGHTS``).

Requests ``{"id", "argv", "env", "cwd", "nice"}`` (argv the Python command line, ``argv[0]`` the interpreter;
``nice`` added to the child's niceness before its threads exist) with three descriptors get ``{"id", "pid"}`` or ``{"id", "refused": why}``; an exit is reported as ``{"exit": pid,
"returncode": N}`` (negative for a signal, as ``subprocess`` does).  End of file on the socket ends the server, and
with it (parent-death signal) every worker still running.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import os
import select
import signal
import socket
import struct
import sys
import threading
from types import TracebackType
from typing import Any, NoReturn

HEADER = struct.Struct("!I")
MAX_FDS = 3
PR_SET_PDEATHSIG = 1
SURVIVED: dict[signal.Signals, Any] = {signal.SIGTERM: signal.SIG_DFL, signal.SIGINT: signal.default_int_handler,
                                       signal.SIGHUP: signal.SIG_DFL}
"""Signals the server ignores, with what a fresh interpreter has for them (a worker gets those back, unless the
server was started with one ignored: see :data:`RESTORED`)."""
RESTORED: dict[signal.Signals, Any] = dict(SURVIVED)
"""What a worker gets for each of :data:`SURVIVED`: a signal the server inherited ignored (an agent started by
``nohup``, or in the background of a shell without job control) stays ignored, as it would in a fresh
interpreter its agent started; set when the server starts."""


def send_message(sock: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> None:
    """One length-prefixed JSON frame, with ``fds`` attached to its first byte."""
    body = json.dumps(message).encode()
    frame = HEADER.pack(len(body)) + body
    if fds:
        sent = socket.send_fds(sock, [frame], fds)
        frame = frame[sent:]
    if frame:
        sock.sendall(frame)


def receive_message(sock: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """The next frame and the descriptors that came with it; None at end of file."""
    data, fds, _flags, _addr = socket.recv_fds(sock, HEADER.size, MAX_FDS)
    if not data:
        return None
    while len(data) < HEADER.size:
        more = sock.recv(HEADER.size - len(data))
        if not more:
            return None
        data += more
    (size,) = HEADER.unpack(data)
    body = b""
    while len(body) < size:
        more = sock.recv(size - len(body))
        if not more:
            return None
        body += more
    return json.loads(body), list(fds)


def why_not_fork() -> str | None:
    """Why a fork now would give a broken child, or None.

    A Python thread alive here could hold any lock at the fork (the child would inherit it held forever).
    Native threads are let be: those an import starts are math libraries' pools (OpenBLAS's, under numpy), which
    stop themselves around a fork and start again in the child when first needed.
    """
    if threading.active_count() > 1:
        names = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
        return f"the fork server has {len(names)} Python threads besides its main one ({', '.join(names)})"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "the fork server has initialised CUDA"
    return None


STATUS_LOST = 255
"""The exit code reported for a worker whose wait status could not be read (never 0: that would be a success)."""


class Server:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.children: set[int] = set()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)
        # A scheduler that ends a job signals every process in it (Slurm: the whole cgroup): the server must
        # outlive that, or its workers die by its parent-death signal instead of the stop they were sent. It ends
        # when its agent closes the socket, or dies with the agent.
        for signum in SURVIVED:
            if signal.getsignal(signum) == signal.SIG_IGN:
                RESTORED[signum] = signal.SIG_IGN
            signal.signal(signum, signal.SIG_IGN)

    def serve(self) -> None:
        """Answer requests and report exits until the agent closes the socket."""
        while True:
            readable, _, _ = select.select([self.sock.fileno(), self.wake_r], [], [])
            if self.wake_r in readable:
                os.read(self.wake_r, 4096)
            self.reap()
            if self.sock.fileno() in readable:
                got = receive_message(self.sock)
                if got is None:
                    return
                request, fds = got
                self.fork(request, fds)

    def reap(self) -> None:
        for pid in list(self.children):
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:  # reaped by someone else: its status is lost, and lost is not success
                done, status = pid, STATUS_LOST << 8
            if done:
                self.children.discard(pid)
                send_message(self.sock, {"exit": pid, "returncode": returncode(status)})

    def fork(self, request: dict[str, Any], fds: list[int]) -> None:
        problem = why_not_fork() if len(fds) == 3 else f"the request came with {len(fds)} descriptors, not 3"
        if problem is not None:
            for fd in fds:
                os.close(fd)
            send_message(self.sock, {"id": request["id"], "refused": problem})
            return
        server = os.getpid()
        pid = os.fork()
        if pid == 0:
            # The socket object lives on in this copy: detach it, or its finaliser closes the number at exit,
            # by then some other file's (a gloo socket's, say).
            become_worker(request, fds, server, close=(self.sock.detach(), self.wake_r, self.wake_w))
            raise AssertionError("unreachable")  # become_worker ends the process
        for fd in fds:
            os.close(fd)
        self.children.add(pid)
        send_message(self.sock, {"id": request["id"], "pid": pid})


def returncode(status: int) -> int:
    """A wait status as ``subprocess`` reports it."""
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def become_worker(request: dict[str, Any], fds: list[int], server: int, close: tuple[int, ...]) -> None:
    """In the forked child: take the worker's place, run its script and end the process the way Python would."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for signum, disposition in RESTORED.items():
        signal.signal(signum, disposition)
    for fd in close:
        os.close(fd)
    os.setsid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != server:  # the server died between the fork and the prctl
        os._exit(137)
    if request.get("nice"):
        os.nice(int(request["nice"]))  # before any thread of the worker's exists: every one inherits it
    for number, fd in enumerate(fds):
        os.dup2(fd, number)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    env: dict[str, str] = request["env"]
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(env)
    options, target_kind, target, args = split_argv(list(request["argv"]))
    unbuffered = "-u" in options or bool(env.get("PYTHONUNBUFFERED"))
    sys.dont_write_bytecode = "-B" in options or bool(env.get("PYTHONDONTWRITEBYTECODE"))
    reopen_stdio(unbuffered)
    adopt_environment(env)
    run_main(target_kind, target, args)


def run_main(target_kind: str, target: str, args: list[str]) -> NoReturn:
    """Run a script (or ``-m`` module) as ``__main__`` with ``sys.argv`` and ``sys.path[0]`` as Python sets them,
    and end the process the way Python would: its exit code, or 1 with the traceback for an uncaught exception."""
    import runpy

    try:
        if target_kind == "module":
            sys.argv = ["-m", *args]  # runpy puts the module's path in sys.argv[0]
            sys.path[0] = os.getcwd()
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [target, *args]
            sys.path[0] = os.path.dirname(os.path.realpath(target))
            runpy.run_path(target, run_name="__main__")
    except (SystemExit, KeyboardInterrupt):
        raise  # the interpreter ends the process with its code (or as interrupted), after atexit, as always
    except BaseException as e:  # noqa: BLE001  an uncaught exception: shown as Python shows it, exit 1
        shown = script_frames(e.__traceback__)
        sys.excepthook(type(e), e.with_traceback(shown), shown)
        raise SystemExit(1) from None
    # Falling off the end: the process ends as Python's would (the caller's stack has nothing to undo).
    raise SystemExit(0)


_OURS = ("runpy.py", "forkserver.py", os.path.join("worker", "standby.py"))
"""The frames above a script's own: runpy's, this server's, and a spare's wait for its promotion."""


def script_frames(tb: TracebackType | None) -> TracebackType | None:
    """The traceback from the script's first frame on, without the frames of what started it (see :data:`_OURS`)."""
    while tb is not None and (tb.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>")
                              or tb.tb_frame.f_code.co_filename.endswith(_OURS)):
        tb = tb.tb_next
    return tb


def split_argv(argv: list[str]) -> tuple[set[str], str, str, list[str]]:
    """``[python, options..., SCRIPT | -m MODULE, args...]`` as (options, "script"|"module", target, args).

    Raises ValueError naming what a fork cannot reproduce (the agent checks before it asks).
    """
    options: set[str] = set()
    i = 1
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "-":
        flag = argv[i]
        if flag == "-m":
            if i + 1 >= len(argv):
                raise ValueError("-m without a module")
            return options, "module", argv[i + 1], argv[i + 2:]
        if flag in ("-u", "-B"):
            options.add(flag)
            i += 1
            continue
        raise ValueError(f"the interpreter option {flag} (only -u and -B are reproduced in a fork)")
    if i >= len(argv) or argv[i] == "-":
        raise ValueError("no script to run")
    return options, "script", argv[i], argv[i + 1:]


def reopen_stdio(unbuffered: bool) -> None:
    """Text streams on descriptors 0-2 as a fresh interpreter makes them for pipes (``-u``: unbuffered)."""
    import io

    def writer(fd: int, errors: str, line_buffering: bool) -> io.TextIOWrapper:
        raw = io.FileIO(fd, "w", closefd=False)
        binary: Any = raw if unbuffered else io.BufferedWriter(raw)
        return io.TextIOWrapper(binary, encoding="utf-8", errors=errors, line_buffering=line_buffering,
                                write_through=unbuffered)

    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding="utf-8")
    sys.stdout = writer(1, "strict", False)
    sys.stderr = writer(2, "backslashreplace", True)
    for name in ("stdin", "stdout", "stderr"):  # faulthandler and the like look for the originals
        setattr(sys, f"__{name}__", getattr(sys, name))


def adopt_environment(env: dict[str, str]) -> None:
    """What a fresh interpreter would have taken from the worker's environment at start."""
    import random

    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    for entry in reversed([p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]):
        if entry not in sys.path:
            sys.path.insert(1, entry)
    torch = sys.modules.get("torch")
    threads = env.get("OMP_NUM_THREADS", "")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))


WARM = ("torch._dynamo", "torch.distributed.checkpoint")
"""Imported at first use by nearly every script, at a cost each restarted worker would pay again: constructing any
``torch.optim`` optimizer imports ``torch._dynamo`` (0.9 s of a restart on a small machine, more than the rest of
it), a sharded restore ``torch.distributed.checkpoint``.  Neither starts a thread or touches CUDA at import."""


PRELOADED = ("torch", "torch.distributed", "resilient.run")
"""Imported first, by name: the worker side sits below the Run it serves and never imports it itself."""


def preload(modules: list[str]) -> None:
    """What every worker imports: torch, its distributed package, this project's Run, what a first optimizer or
    sharded restore imports (:data:`WARM`), and the user's."""
    for name in (*PRELOADED, *WARM, *modules):
        importlib.import_module(name)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m resilient.worker.forkserver")
    parser.add_argument("--fd", type=int, required=True, help="the agent's end of the socket pair")
    parser.add_argument("--preload", default="", help="modules to import before the first fork, comma-separated")
    args = parser.parse_args(argv)
    sock = socket.socket(fileno=args.fd)
    try:
        preload([m for m in args.preload.split(",") if m])
    except BaseException as e:  # noqa: BLE001  anything a preloaded module raises is the agent's reason
        send_message(sock, {"ready": False, "problem": f"preloading failed: {type(e).__name__}: {e}"})
        return
    problem = why_not_fork()
    send_message(sock, {"ready": problem is None, "problem": problem, "pid": os.getpid()})
    if problem is None:
        Server(sock).serve()


if __name__ == "__main__":
    main()
