"""Ending this node's workers' connections to a lost node, so that a collective blocked on it fails now.

A peer that loses power sends no reset: a survivor's gloo collective waits
on a socket that will never answer, until its timeout (minutes), and gloo
has no abort.  Once the launch judges a node lost
(:mod:`resilient.coord.liveness`), its agent finds each of its workers'
established TCP connections to that node's address (``/proc/<pid>/fd``
against ``/proc/<pid>/net/tcp``), takes a copy of the socket
(``pidfd_getfd``, Linux 5.6+) and shuts it down: the blocked receive
returns at once, the collective raises in the worker, and the rank leaves
it as a survivor of an in-process recovery instead of hanging.

Only connections to the lost node's addresses are touched, and only when
those differ from this node's own (on one host a dead process's sockets
are reset by the kernel, and no address tells the peers apart).
"""

from __future__ import annotations

import ctypes
import errno
import ipaddress
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from ..watchdog.procfs import read_stat

_PIDFD_GETFD = 438
"""The syscall's number (the same on x86-64 and arm64)."""

_ESTABLISHED = "01"


def addresses_of(host: str) -> frozenset[str]:
    """The IP addresses ``host`` resolves to (empty when it does not)."""
    try:
        return frozenset(str(ipaddress.ip_address(info[4][0])) for info in socket.getaddrinfo(host, None))
    except (OSError, ValueError):
        return frozenset()


def _decode(hex_address: str) -> str:
    """An address of ``/proc/net/tcp{,6}`` (``0100007F:1F90``) as text, without its port."""
    raw = bytes.fromhex(hex_address.split(":")[0])
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    address = ipaddress.IPv6Address(words)
    return str(address.ipv4_mapped or address)


def connections(pid: int) -> dict[int, str]:
    """The established TCP connections of process ``pid``: fd -> remote address."""
    inodes: dict[str, int] = {}
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes[target[8:-1]] = int(fd)
    except OSError:
        return {}
    found: dict[int, str] = {}
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == _ESTABLISHED and fields[9] in inodes:
                found[inodes[fields[9]]] = _decode(fields[2])
    return found


def _peer_address(sock: socket.socket) -> str | None:
    try:
        peer = sock.getpeername()
    except OSError:
        return None
    if not isinstance(peer, tuple):
        return None
    try:
        address = ipaddress.ip_address(str(peer[0]).split("%")[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(address)


@dataclass(frozen=True)
class Severed:
    pid: int
    sockets: int
    problem: str | None = None


def _shut(pid: int, fds: list[int], lost: frozenset[str]) -> Severed:
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        pidfd = os.pidfd_open(pid)
    except OSError as e:
        return Severed(pid, 0, f"pidfd_open: {os.strerror(e.errno or errno.EIO)}")
    done = 0
    try:
        for fd in fds:
            copy = libc.syscall(_PIDFD_GETFD, pidfd, fd, 0)
            if copy < 0:
                code = ctypes.get_errno()
                return Severed(pid, done, f"pidfd_getfd: {os.strerror(code)} (Linux 5.6 or later, and the right "
                                          "to trace the worker, are needed)")
            try:
                sock = socket.socket(fileno=copy)
            except OSError:  # the number was closed and reused for something else meanwhile
                os.close(copy)
                continue
            try:
                # The worker may have closed the fd and reused its number since /proc was read: only a connection
                # to the lost node is shut.
                if _peer_address(sock) in lost:
                    sock.shutdown(socket.SHUT_RDWR)
                    done += 1
            except OSError:
                pass  # it closed meanwhile
            finally:
                sock.close()
    finally:
        os.close(pidfd)
    return Severed(pid, done)


def sever(pids: list[int], lost_host: str, own_host: str) -> list[Severed]:
    """Shut down every established connection of ``pids`` to ``lost_host``'s addresses (none when they are this
    node's own, ``own_host``)."""
    lost = addresses_of(lost_host)
    if not lost or lost & addresses_of(own_host):
        return []
    results = []
    for pid in pids:
        fds = [fd for fd, remote in connections(pid).items() if remote in lost]
        if fds:
            results.append(_shut(pid, fds, lost))
    return results


def children(parent: int | None = None) -> list[int]:
    """The processes whose parent is ``parent`` (this one by default): the node's workers and spares."""
    parent = os.getpid() if parent is None else parent
    stats = (read_stat(int(entry)) for entry in os.listdir("/proc") if entry.isdigit())
    return [stat.pid for stat in stats if stat is not None and stat.ppid == parent]
