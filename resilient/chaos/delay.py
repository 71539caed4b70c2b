"""A delaying TCP proxy inside a node's network namespace: latency between nodes without netem.

``python -m resilient.chaos.delay --port P --control FILE --mark M`` runs in a
drill node's namespace (:mod:`resilient.chaos.netns`), where iptables'
``nat`` table redirects to ``P`` every TCP connection the node makes to, or
accepts from, the bridge's subnet (``REDIRECT``: the kernel keeps the
original destination, which the proxy reads back with ``SO_ORIGINAL_DST``).
The proxy connects onward to that destination from a socket marked ``M``
(``SO_MARK``), which the rules let pass, and carries the bytes both ways,
each chunk the current delay after it arrived, in order.  The delay is the
number of milliseconds in ``FILE`` (read ten times a second; 0 or no file:
none; each change taken is written back to ``FILE.applied``), so a drill
can put the proxy in place before the node's first connection (a redirect
applies to new connections only, and gloo connects once) and add the
latency later.  Every connection of the node (gloo's
pairs, its store, etcd) then has that much more each way, and bandwidth is
kept: the delay is a queue, not a sleep per chunk.

It prints ``ready`` once it listens, and runs until killed.
"""

from __future__ import annotations

import argparse
import collections
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable

from ..core.fsutil import write_text_atomic

SO_ORIGINAL_DST = 80
CHUNK = 65536


def original_destination(conn: socket.socket) -> tuple[str, int]:
    raw = conn.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    port, packed = struct.unpack_from("!2xH4s", raw)
    return socket.inet_ntoa(packed), int(port)


def applied_path(control: str) -> str:
    """Where the proxy says which delay it applies: the control file's name with ``.applied`` after it."""
    return control + ".applied"


class Delay:
    """The delay now, from the control file (:meth:`watch` re-reads it ten times a second on a thread).

    Each change it takes is written back to :func:`applied_path` (milliseconds, as read), so whoever set the
    delay can tell when the proxy applies it: chunks that arrive after that wait the new delay.
    """

    def __init__(self, path: str) -> None:
        self.path, self.s = path, 0.0
        self._applied: float | None = None

    def watch(self) -> Delay:
        threading.Thread(target=self._watch, daemon=True).start()
        return self

    def _watch(self) -> None:
        while True:
            self.read()
            time.sleep(0.1)

    def read(self) -> None:
        """Take the control file's delay (0 when it is missing or unreadable) and say so when it changed."""
        try:
            with open(self.path) as f:
                ms = max(0.0, float(f.read().strip() or 0))
        except (OSError, ValueError):
            ms = 0.0
        self.s = ms / 1e3
        if ms != self._applied:
            write_text_atomic(applied_path(self.path), f"{ms!r}")
            self._applied = ms


def pump(src: socket.socket, dst: socket.socket, delay: Delay, *, clock: Callable[[], float] = time.monotonic,
         sleep: Callable[[float], None] = time.sleep) -> None:
    """Copy ``src`` to ``dst``, each chunk the delay after it was read; close ``dst``'s writing side at EOF."""
    queue: collections.deque[tuple[float, bytes]] = collections.deque()
    ready = threading.Condition()
    done = False

    def writer() -> None:
        while True:
            with ready:
                while not queue and not done:
                    ready.wait()
                if not queue and done:
                    break
                due, data = queue.popleft()
            wait = due - clock()
            if wait > 0:
                sleep(wait)
            try:
                dst.sendall(data)
            except OSError:
                break
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    out = threading.Thread(target=writer, daemon=True)
    out.start()
    try:
        while True:
            try:
                data = src.recv(CHUNK)
            except OSError:
                data = b""
            with ready:
                if not data:
                    done = True
                    ready.notify()
                    break
                queue.append((clock() + delay.s, data))
                ready.notify()
    finally:
        out.join()


def serve(port: int, delay: Delay, mark: int) -> None:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("0.0.0.0", port))  # inside the node's namespace: its own loopback and veth only
    listener.listen(256)
    print("ready", flush=True)
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=_carry, args=(conn, delay, mark), daemon=True).start()


def _carry(conn: socket.socket, delay: Delay, mark: int) -> None:
    try:
        host, port = original_destination(conn)
        onward = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        onward.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, mark)  # let through by the redirect rules
        onward.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        onward.connect((host, port))
    except OSError:
        conn.close()
        return
    back = threading.Thread(target=pump, args=(onward, conn, delay), daemon=True)
    back.start()
    pump(conn, onward, delay)
    back.join()
    for s in (conn, onward):
        s.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--control", required=True, help="a file holding the delay in ms")
    p.add_argument("--mark", type=int, required=True)
    args = p.parse_args(argv)
    serve(args.port, Delay(args.control).watch(), args.mark)
    return 0


if __name__ == "__main__":
    sys.exit(main())
