"""Unix sockets only this user can reach: one bind for the heartbeat and control sockets."""

from __future__ import annotations

import os
import socket
import stat

from ..core.errors import ConfigError

SOCKET_PATH_LIMIT = 107
"""Longest unix socket path (bytes) the kernel accepts."""


def bind_private(path: str, kind: socket.SocketKind) -> socket.socket:
    """Bind a unix socket of ``kind`` at ``path`` that only this user can connect or write to.

    It is bound under a temporary name, chmod-ed to 0600, then renamed into
    place, so no other user can ever reach it (a process-wide umask change
    would race with other threads).  A stale socket at ``path`` (left by a
    process that died) is replaced; any other kind of file there is refused.
    The socket has a 1 s timeout so serving threads can notice a close.
    """
    if len(os.fsencode(path)) > SOCKET_PATH_LIMIT:
        raise ConfigError(
            f"socket path {path!r} is longer than the kernel's {SOCKET_PATH_LIMIT}-byte limit for unix sockets; "
            "use a shorter run directory (or RunDir.socket_path)"
        )
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISSOCK(mode):
            raise ConfigError(f"socket path {path} exists and is not a socket; remove it or choose another")
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".{name}.{os.getpid()}.tmp")
    if len(os.fsencode(tmp)) > SOCKET_PATH_LIMIT:
        tmp = path  # no room for a longer name: bind in place (the chmod follows at once)
    sock = socket.socket(socket.AF_UNIX, kind)
    try:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        sock.bind(tmp)
        os.chmod(tmp, 0o600)
        if tmp != path:
            os.replace(tmp, path)
        sock.settimeout(1.0)
    except BaseException:
        sock.close()
        raise
    return sock
