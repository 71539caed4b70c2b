"""The agent's control endpoint: a unix socket that reads status and accepts a stop.

One JSON request per connection, one JSON answer.  The socket is created
with mode 0600 (only the run's user can connect), and every request that
changes the run must also carry the run's token (``<run_dir>/token``,
mode 0600), so that a socket path alone, e.g. leaked into a container,
is not enough to stop a run.  Reading status needs no token.

Requests::

    {"op": "status"}                                  -> {"ok": true, "status": {...}}
    {"op": "stop", "token": "...", "reason": "..."}   -> {"ok": true, "stop_requested": "..."}
    {"op": "detectors"}                               -> {"ok": true, "detectors": {"straggler.enabled": true, ...}}
    {"op": "detectors", "token": "...", "set": {"straggler.rule.decision": 12}}
                                                      -> {"ok": true, "detectors": {...}} (from the next window)
"""

from __future__ import annotations

import hmac
import json
import os
import socket
import struct
import threading
from collections.abc import Callable, Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.errors import ConfigError, ResilientError
from ..core.supervised import ThreadReports
from .sockets import bind_private

if TYPE_CHECKING:
    from .slowness import SlownessWatch

_MAX_REQUEST = 64 * 1024


class ControlError(ResilientError):
    """A control request failed: no agent listening, refused, or a bad answer."""


class ControlServer:
    """Serve control requests for one agent on ``path`` from a daemon thread."""

    def __init__(self, path: Path, token: str, status: Callable[[], dict[str, Any]],
                 request_stop: Callable[[str], None], detectors: SlownessWatch | None = None,
                 threads: ThreadReports | None = None) -> None:
        """``threads``: where the serving thread reports an error it did not expect (it is then started again)."""
        self.path = path
        self._token = token
        self._status = status
        self._request_stop = request_stop
        self._detectors = detectors
        self._sock = bind_private(str(path), socket.SOCK_STREAM)
        self._sock.listen(8)
        self._sock.settimeout(0.5)
        self._closed = threading.Event()
        self._thread = (threads or ThreadReports()).run("control", self._serve, stop=self._closed)

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                try:
                    answer = self.handle(_read_request(conn))
                except (OSError, ValueError) as e:
                    answer = {"ok": False, "error": f"bad request: {e}"}
                except Exception as e:  # a bug: the client hears of it, the thread's supervisor reports it
                    _answer(conn, {"ok": False, "error": f"the agent could not answer: {type(e).__name__}: {e}"})
                    raise
                _answer(conn, answer)

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        if op == "status":
            return {"ok": True, "status": self._status()}
        if op == "detectors" and self._detectors is not None and not request.get("set"):
            return {"ok": True, "detectors": self._detectors.settings()}
        if op in ("stop", "detectors"):
            given = str(request.get("token", ""))
            if not hmac.compare_digest(given.encode(), self._token.encode()):
                return {"ok": False, "error": "wrong or missing run token: read it from <run_dir>/token"}
        if op == "detectors" and self._detectors is not None:
            changes = request.get("set")
            if not isinstance(changes, dict):
                return {"ok": False, "error": "'set' must be an object of dotted setting -> value"}
            try:
                return {"ok": True, "detectors": self._detectors.request(changes, "control socket")}
            except ConfigError as e:
                return {"ok": False, "error": str(e)}
        if op == "stop":
            reason = str(request.get("reason") or "stop requested through the control socket")
            self._request_stop(reason)
            return {"ok": True, "stop_requested": reason}
        return {"ok": False, "error": f"unknown op {op!r}; use 'status', 'stop' or 'detectors'"}

    def close(self) -> None:
        self._closed.set()
        self._sock.close()
        self._thread.join(timeout=5)
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


def _answer(conn: socket.socket, answer: dict[str, Any]) -> None:
    try:
        conn.sendall(json.dumps(answer, default=str).encode() + b"\n")
    except OSError:
        pass  # the client went away; nothing to tell it


def _read_request(conn: socket.socket) -> dict[str, Any]:
    data = b""
    while not data.endswith(b"\n") and len(data) < _MAX_REQUEST:
        chunk = conn.recv(4096)
        if not chunk:
            break
        data += chunk
    request = json.loads(data.decode())
    if not isinstance(request, dict):
        raise ValueError("the request must be a JSON object")
    return request


def call(path: Path, request: dict[str, Any], timeout_s: float = 10.0, *,
         owners: Collection[int] | None = None) -> dict[str, Any]:
    """Send one request to the agent listening on ``path`` and return its answer.

    Nothing is sent unless the process serving ``path`` runs as one of ``owners`` (default: this user): a socket
    another user put in its place never receives the request (nor the run token in it).
    """
    allowed = {os.geteuid()} if owners is None else set(owners)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        try:
            s.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError) as e:
            raise ControlError(f"no agent is listening on {path} ({e.strerror}); is the run still going?") from None
        served_by = peer_uid(s, path)
        if served_by not in allowed:
            raise ControlError(
                f"{path} is served by uid {served_by}, not by the run's user ({', '.join(map(str, sorted(allowed)))}): "
                "another user's process may have put its socket there; nothing was sent (find it with "
                f"`ss -xlp | grep {path.name}`)")
        s.sendall(json.dumps(request).encode() + b"\n")
        answer = b""
        while not answer.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            answer += chunk
    try:
        return dict(json.loads(answer.decode()))
    except ValueError:
        raise ControlError(f"the agent on {path} sent an unreadable answer") from None


def peer_uid(s: socket.socket, path: Path) -> int:
    """The user id of the process serving a connected unix socket (from the kernel where it says: SO_PEERCRED;
    else the socket file's owner)."""
    if hasattr(socket, "SO_PEERCRED"):
        creds = s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("iII"))
        return int(struct.unpack("iII", creds)[1])
    return os.lstat(path).st_uid
