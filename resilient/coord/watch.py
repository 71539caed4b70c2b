"""A local copy of the keys under a prefix, kept current by an etcd watch instead of polling.

:class:`PrefixWatch` reads the prefix once, at one revision, then follows
etcd's watch from the next revision on its own thread: every change is
applied to the copy as etcd sends it, a revision's changes together, and
``on_change`` is called after each batch.  Readers take :meth:`view`, the
copy at one revision.

Steady state costs the store nothing but an open stream.  The stream's
socket keeps TCP keepalive on, so a stream to an etcd that vanished
without a reset ends within seconds at no request
(:data:`~resilient.coord.etcd_transport.STREAM_KEEPALIVE`); a stream that
stays silent for ``idle_s`` (60 s) is also closed and opened again from
the last revision applied, as a backstop: one request a minute at rest.  After a
broken stream the watch resumes from its revision, so no change is missed;
when etcd has compacted that revision away it reads the prefix again.
While etcd cannot be reached the copy stays as it was, :attr:`stale_since`
says since when, and ``on_error`` hears of it once per outage.

The thread never ends before :meth:`close`: an error it does not expect (a
malformed answer, a bug of its own) is handed to ``on_crash`` with its
traceback, and the watch reads the prefix again at a new revision, tells
every listener (any key may have changed meanwhile) and follows on from
there, pausing longer after each crash in a row (up to
:data:`CRASH_BACKOFF_MAX_S`).  A listener that raises is its own bug, not the
copy's: it is reported to ``on_crash`` (once per listener and error, the
repeats counted in :attr:`listener_errors`), the other listeners are still
told, and the watch follows on without reading anything again.
"""

from __future__ import annotations

import socket
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from .etcd import Compacted, EtcdClient
from .store import ControlStoreError, Entry

IDLE_S = 60.0
"""A watch's stream silent this long is opened again from its revision (a backstop: TCP keepalive ends a stream
to a vanished etcd sooner)."""
CRASH_BACKOFF_MAX_S = 10.0
"""The longest pause between two tries after unexpected errors in a row."""


@dataclass(frozen=True)
class View:
    """The copy at one revision: key -> entry (read-only)."""

    revision: int
    entries: Mapping[str, Entry]

    def under(self, prefix: str) -> dict[str, Entry]:
        return {k: e for k, e in self.entries.items() if k.startswith(prefix)}


class PrefixWatch:
    def __init__(self, client: EtcdClient, prefix: str, *, on_change: Callable[[], None] = lambda: None,
                 on_error: Callable[[str], None] = lambda _: None,
                 on_crash: Callable[[str, str], None] = lambda _error, _trace: None, idle_s: float = IDLE_S,
                 retry_s: float = 0.2, clock: Callable[[], float] = time.monotonic) -> None:
        self._client = client
        self.prefix = prefix
        self._listeners: list[tuple[Callable[[], None], tuple[str, ...] | None]] = [(on_change, None)]
        self._on_error = on_error
        self._on_crash = on_crash
        self.crashes = 0
        """Unexpected errors the thread survived."""
        self.listener_errors = 0
        """Errors raised by listeners (each distinct one reported once)."""
        self._listener_said: set[tuple[int, str]] = set()
        self._crashes_in_a_row = 0
        self._idle = idle_s
        self._retry = retry_s
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[str, Entry] = {}
        self._revision = 0
        """The newest revision applied to the copy (the stream resumes after it)."""
        self._view = View(0, MappingProxyType({}))
        """The copy as last read; made again by :meth:`view` only after a change (a change costs what it changes,
        not a copy of every key: a large launch's watch sees a change per node)."""
        self.stale_since: float | None = None
        self.streams = 0
        """Streams opened (the first and every resume), for the load they cost."""
        self._done = threading.Event()
        self._socket: socket.socket | None = None
        self._thread = threading.Thread(target=self._loop, name=f"watch {prefix}", daemon=True)

    def start(self) -> PrefixWatch:
        """Read the prefix (raises :class:`ControlStoreError` when etcd cannot be reached) and start following."""
        self._read()
        self._thread.start()
        return self

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    @property
    def fresh(self) -> bool:
        """Following the store now: started, and its stream not broken by an outage."""
        return self.running and self.stale_since is None

    def subscribe(self, on_change: Callable[[], None], *, under: tuple[str, ...] | None = None) -> None:
        """Call ``on_change`` too after each change (on the watch's thread); ``under``: only after a change of a
        key under one of these prefixes (a reader of a few kinds of key is not woken by the others)."""
        self._listeners.append((on_change, under))

    def unsubscribe(self, on_change: Callable[[], None]) -> None:
        self._listeners = [(f, u) for f, u in self._listeners if f != on_change]

    def _changed(self, keys: list[str] | None = None) -> None:
        """``keys``: the keys that changed (None: any may have, the copy was read again)."""
        for listener, under in list(self._listeners):
            if under is None or keys is None or any(k.startswith(under) for k in keys):
                try:
                    listener()
                except Exception as e:  # noqa: BLE001  the listener's bug: said, and the others still told
                    self._listener_failed(listener, e)

    def _listener_failed(self, listener: Callable[[], None], e: Exception) -> None:
        self.listener_errors += 1
        error = f"{type(e).__name__}: {e}"
        if (id(listener), error) in self._listener_said:
            return
        self._listener_said.add((id(listener), error))
        name = getattr(listener, "__qualname__", repr(listener))
        try:
            self._on_crash(f"a listener of the watch of {self.prefix} ({name}) raised {error}",
                           "".join(traceback.format_exception(e)))
        except Exception:  # noqa: BLE001, S110  a failing report must not end the watch it reports on
            pass

    def view(self) -> View:
        with self._lock:
            if self._view.revision != self._revision:
                self._view = View(self._revision, MappingProxyType(dict(self._entries)))
            return self._view

    def _read(self) -> None:
        entries, revision = self._client.snapshot_prefix(self.prefix)
        with self._lock:
            self._entries = {e.key: e for e in entries}
            self._revision = revision
            self._view = View(revision, MappingProxyType(dict(self._entries)))

    def _loop(self) -> None:
        read_again = False
        while not self._done.is_set():
            try:
                if read_again:  # until a read at a new revision told every listener
                    read_again = not self._read_again()
                    continue
                self._follow()
            except Exception as e:  # noqa: BLE001  the watch outlives what it did not expect, and says so
                self._crashed(e)
                read_again = True

    def _follow(self) -> None:
        try:
            self.streams += 1
            for batch in self._client.watch_prefix(self.prefix, self._revision + 1, self._idle, self._done,
                                                   self._opened):
                self._apply(batch.events)
                self._crashes_in_a_row = 0
                if self.stale_since is not None:
                    self.stale_since = None
        except Compacted:
            self._read_again()
        except (ControlStoreError, OSError, ValueError) as e:
            self._failed(e)

    def _read_again(self) -> bool:
        """Read the prefix at a new revision and tell every listener (any key may have changed); False when etcd
        could not be read."""
        try:
            self._read()
        except ControlStoreError as e:
            self._failed(e)
            return False
        self._changed()
        return True

    def _crashed(self, e: Exception) -> None:
        self.crashes += 1
        self._crashes_in_a_row += 1
        trace = "".join(traceback.format_exception(e))
        try:
            self._on_crash(f"watch of {self.prefix}: {type(e).__name__}: {e}", trace)
        except Exception:  # noqa: BLE001, S110  a failing report must not end the watch it reports on
            pass
        self._done.wait(min(CRASH_BACKOFF_MAX_S, self._retry * 2 ** min(self._crashes_in_a_row - 1, 16)))

    def _failed(self, e: Exception) -> None:
        if self.stale_since is None:
            self.stale_since = self._clock()
            self._on_error(f"watch of {self.prefix}: {type(e).__name__}: {e}")
        self._done.wait(self._retry)

    def _apply(self, events: list[tuple[str, Entry]]) -> None:
        if not events:
            return
        with self._lock:
            for kind, entry in events:
                if kind == "DELETE":
                    self._entries.pop(entry.key, None)
                else:
                    self._entries[entry.key] = entry
            # Resume after the newest change applied (the header's revision may be ahead of changes still coming).
            self._revision = max(self._revision, max(e.mod_revision for _, e in events))
        self._changed([entry.key for _, entry in events])

    def _opened(self, sock: socket.socket) -> None:
        self._socket = sock
        if self._done.is_set():
            self._shut()

    def _shut(self) -> None:
        sock = self._socket
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed

    def close(self) -> None:
        self._done.set()
        self._shut()
        if self._thread.is_alive():
            self._thread.join(timeout=self._idle + 5)
