"""The agent's end of the heartbeat protocol (:mod:`resilient.worker.protocol`).

One :class:`HeartbeatReceiver` per local rank binds a private unix datagram
socket and hands every valid heartbeat, with its event time, to a callback
on its own thread.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable

from ..core.supervised import ThreadReports
from ..worker.protocol import MAX_DATAGRAM, Heartbeat, HeartbeatError, decode_datagram
from .sockets import bind_private

logger = logging.getLogger("resilient.agent")
MARK = b"\x00resilient-settle"
"""A datagram the receiver sends itself (:meth:`HeartbeatReceiver.settle`); never a heartbeat (those are JSON)."""


class HeartbeatReceiver:
    """The agent's end: binds ``path`` (mode 0600) and calls ``on_message`` from a daemon thread.

    ``on_message(heartbeat, received_at)`` gets the receiver's clock reading
    for each valid datagram; malformed ones are counted in ``malformed``
    (last problem in ``last_error``) and dropped, as are exceptions raised
    by ``on_message`` (counted in ``callback_errors`` and logged).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        on_message: Callable[[Heartbeat, float], None],
        *,
        clock: Callable[[], float] = time.monotonic,
        threads: ThreadReports | None = None,
    ) -> None:
        """``threads``: where the receiving thread reports an error it did not expect (it is then started again,
        :mod:`resilient.core.supervised`)."""
        self.path = os.fspath(path)
        self._on_message = on_message
        self._clock = clock
        self.received = 0
        self.malformed = 0
        self.callback_errors = 0
        self.last_error: str | None = None
        self._closed = threading.Event()
        self._settled = threading.Condition()
        self._marks_seen = 0
        self._sock = bind_private(self.path, socket.SOCK_DGRAM)
        self._thread = (threads or ThreadReports()).run("heartbeats", self._serve, stop=self._closed)

    def _serve(self) -> None:
        sock = self._sock
        while not self._closed.is_set():
            try:
                data = sock.recv(MAX_DATAGRAM)
            except TimeoutError:
                continue
            except OSError:
                if self._closed.is_set():
                    return
                raise
            received_at = self._clock()
            if self._closed.is_set():
                return
            if data == MARK:
                with self._settled:
                    self._marks_seen += 1
                    self._settled.notify_all()
                continue
            try:
                heartbeats = decode_datagram(data)
            except HeartbeatError as e:
                self.malformed += 1
                self.last_error = str(e)
                continue
            for hb in heartbeats:
                self.received += 1
                # A batched heartbeat carries the worker's own monotonic time of the event (same host, same
                # clock as ours); it cannot be later than its arrival.
                when = received_at if hb.t is None else min(hb.t, received_at)
                try:
                    self._on_message(hb, when)
                except Exception:  # one bad callback must not stop heartbeat intake
                    self.callback_errors += 1
                    logger.exception("heartbeat callback failed for rank %s", hb.rank)

    def settle(self, timeout: float = 1.0) -> bool:
        """Return once every heartbeat queued on the socket now has been handed on (False: not within ``timeout``).

        A datagram a worker sent is in this socket's queue from the moment its ``sendto`` returned, so once a
        worker's exit is seen, settling makes the tracker hold everything it sent before it died (its last
        section and step), whichever thread got there first.  A marker sent to the socket itself is handled in
        order after them.
        """
        with self._settled:
            wanted = self._marks_seen + 1
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
                s.settimeout(timeout)
                s.sendto(MARK, self.path)
        except OSError:
            return False
        with self._settled:
            return self._settled.wait_for(lambda: self._marks_seen >= wanted or self._closed.is_set(), timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread, close the socket and remove its path."""
        if self._closed.is_set():
            return
        self._closed.set()
        try:  # wake the thread up now rather than at its next timeout
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
                s.setblocking(False)
                s.sendto(b"", self.path)
        except OSError:
            pass
        self._thread.join(timeout)
        self._sock.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
