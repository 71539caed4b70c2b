"""Worker heartbeats: the datagram format and both of its ends.

A worker reports each section it enters (``init``, ``restore``, ``data``,
``step``, ``checkpoint`` or a user's name) to its node agent as one UTF-8
JSON object in one unix ``SOCK_DGRAM`` datagram::

    {"v": 1, "rank": 0, "local_rank": 0, "pid": 123, "section": "step", "step": 41,
     "seq": 97, "kind": "section", "checkpoint": null, "committed_step": 40}

``kind`` is ``hello`` (first message of a process; only it carries
``checkpoint``, the checkpoint location), ``section`` (entered a section)
or ``bye`` (no more heartbeats will come: finished or stopped).
``committed_step`` is the newest committed checkpoint step the worker knows.

The sender sits in the training loop, so it never blocks and never raises:
a datagram the agent cannot take (no agent, socket gone, queue full) is
dropped and counted; ``seq`` lets the agent see any gap.  Datagrams on
one socket keep their order, but the kernel queues only
``net.unix.max_dgram_qlen`` (default 10) of them per receiving socket: ranks
that share one socket overflow it with their synchronised bursts at step
boundaries (measured here: 8 ranks sending 4 heartbeats every 10 ms lost
40%).  Give each local rank its own socket, one :class:`HeartbeatReceiver`
each (the same load lost nothing).

A worker under the agent sends through :class:`BatchingSender`: each
heartbeat carries the monotonic time of its event; it is sent at once when
the previous datagram left 20 ms ago or more, else queued, and a thread
sends what is queued every 20 ms as one batch datagram
(``{"v", "rank", "local_rank", "pid", "rows": [[kind, section, step, seq,
t, committed_step, tokens, samples, save, checkpoint], ...]}``), so a step
pays about a microsecond per section instead of a system call and a
wake-up of the agent in fast loops, while slower steps report each section
as it is entered.  The receiver hands each heartbeat over with its own
event time (the worker's and the agent's monotonic clocks are the same
clock on one host).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import stat
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import ConfigError, ResilientError

logger = logging.getLogger("resilient.agent")

PROTOCOL_VERSION = 1
KINDS = ("hello", "section", "bye")
MAX_DATAGRAM = 65536
_ROWS_PER_DATAGRAM = 150
"""Rows per batch datagram: about 100 bytes each, well inside MAX_DATAGRAM."""
RECONNECT_INTERVAL_S = 0.05
"""After a failed connect, drop heartbeats for this long before trying again (a failing connect costs ~20 us)."""
SOCKET_PATH_LIMIT = 107
"""Longest unix socket path (bytes) the kernel accepts."""


class HeartbeatError(ResilientError):
    """A datagram is not a valid heartbeat."""


@dataclass(frozen=True)
class Heartbeat:
    """One message from a worker to its agent."""

    rank: int
    local_rank: int
    pid: int
    section: str
    step: int
    seq: int
    kind: str
    checkpoint: str | None = None
    """Checkpoint directory or URL (hello only)."""
    committed_step: int | None = None
    """Newest committed checkpoint step known to the worker."""
    tokens: int = 0
    """The rank's cumulative token counter (``Run.tokens``)."""
    samples: int = 0
    """The rank's cumulative sample counter (``Run.samples``)."""
    save: dict[str, Any] | None = None
    """A save that finished since the last heartbeat: step, duration_s, bytes, ok."""
    t: float | None = None
    """When the worker entered the section, on its ``time.monotonic`` clock (set by batched senders)."""
    v: int = PROTOCOL_VERSION


_INT_FIELDS = ("rank", "local_rank", "pid", "step", "seq")
_COUNTERS = ("tokens", "samples")  # optional: absent means 0


def encode(hb: Heartbeat) -> bytes:
    return json.dumps(asdict(hb), separators=(",", ":")).encode()


_ROW_FIELDS = ("kind", "section", "step", "seq", "t", "committed_step", "tokens", "samples", "save", "checkpoint")


def decode_datagram(data: bytes) -> list[Heartbeat]:
    """One datagram: a single heartbeat, or a batch ``{"v", "rank", "local_rank", "pid", "rows": [[...], ...]}``
    whose rows list :data:`_ROW_FIELDS` in order.  Raises :class:`HeartbeatError` for anything malformed."""
    obj = _loads(data)
    rows = obj.get("rows")
    if rows is None:
        return [_validate(obj)]
    if not isinstance(rows, list):
        raise HeartbeatError(f"field 'rows' must be a list, got {type(rows).__name__}")
    head = {k: obj.get(k) for k in ("v", "rank", "local_rank", "pid")}
    found = []
    for row in rows:
        if not isinstance(row, list) or len(row) != len(_ROW_FIELDS):
            raise HeartbeatError(f"a batch row must be a list of {len(_ROW_FIELDS)} values, got {row!r:.80}")
        found.append(_validate({**head, **dict(zip(_ROW_FIELDS, row))}))
    return found


def _loads(data: bytes) -> Any:
    try:
        obj = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HeartbeatError(f"not UTF-8 JSON: {e}") from None
    if not isinstance(obj, dict):
        raise HeartbeatError(f"not a JSON object but {type(obj).__name__}")
    return obj


def decode(data: bytes) -> Heartbeat:
    """Parse and validate one single-heartbeat datagram; raise :class:`HeartbeatError` saying what is wrong."""
    return _validate(_loads(data))


def _validate(obj: Any) -> Heartbeat:
    if not isinstance(obj, dict):
        raise HeartbeatError(f"not a JSON object but {type(obj).__name__}")
    if obj.get("v") != PROTOCOL_VERSION:
        raise HeartbeatError(f"protocol version {obj.get('v')!r}, this agent speaks {PROTOCOL_VERSION}")
    for key in _INT_FIELDS:
        if not _is_int(obj.get(key)):
            raise HeartbeatError(f"field {key!r} must be an integer, got {obj.get(key)!r}")
    if obj.get("kind") not in KINDS:
        raise HeartbeatError(f"field 'kind' must be one of {KINDS}, got {obj.get('kind')!r}")
    section = obj.get("section")
    if not isinstance(section, str) or not section:
        raise HeartbeatError(f"field 'section' must be a non-empty string, got {section!r}")
    checkpoint = obj.get("checkpoint")
    if checkpoint is not None and not isinstance(checkpoint, str):
        raise HeartbeatError(f"field 'checkpoint' must be a string or null, got {checkpoint!r}")
    committed = obj.get("committed_step")
    if committed is not None and not _is_int(committed):
        raise HeartbeatError(f"field 'committed_step' must be an integer or null, got {committed!r}")
    for key in _COUNTERS:
        if not _is_int(obj.get(key, 0)):
            raise HeartbeatError(f"field {key!r} must be an integer, got {obj.get(key)!r}")
    t = obj.get("t")
    if t is not None and not (isinstance(t, int | float) and not isinstance(t, bool)):
        raise HeartbeatError(f"field 't' must be a number or null, got {t!r}")
    save = obj.get("save")
    if save is not None and not (isinstance(save, dict) and _is_int(save.get("step"))):
        raise HeartbeatError(f"field 'save' must be null or an object with an integer step, got {save!r}")
    return Heartbeat(
        rank=obj["rank"], local_rank=obj["local_rank"], pid=obj["pid"], section=section, step=obj["step"],
        seq=obj["seq"], kind=obj["kind"], checkpoint=checkpoint, committed_step=committed,
        tokens=obj.get("tokens", 0), samples=obj.get("samples", 0), save=save,
        t=float(t) if t is not None else None,
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class HeartbeatSender:
    """The worker's end: fire-and-forget datagrams to the agent's socket.

    ``send`` costs a few microseconds, never blocks and never raises; lost
    datagrams are counted in ``dropped`` (with the last reason in
    ``last_error``).  The socket is connected once (a send then skips the
    path lookup) and reconnected after any failure, so an agent that
    rebinds its socket is found again.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        rank: int,
        local_rank: int,
        pid: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = os.fspath(path)
        self.rank = rank
        self.local_rank = local_rank
        self.pid = os.getpid() if pid is None else pid
        self.sent = 0
        self.dropped = 0
        self.last_error: str | None = None
        self._clock = clock
        self.seq = 0
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        self._connected = False
        self._retry_at = 0.0
        # Everything but section, step, seq and committed step is fixed: format it once.
        self._head = f'{{"v":{PROTOCOL_VERSION},"rank":{int(rank)},"local_rank":{int(local_rank)},"pid":{self.pid},'

        self._sections: dict[str, str] = {}

    def format(self, kind: str, section: str, step: int, *, committed_step: int | None = None,
               checkpoint: str | None = None, tokens: int = 0, samples: int = 0,
               save: dict[str, Any] | None = None, t: float | None = None) -> str:
        """One heartbeat as a JSON line (takes the next sequence number)."""
        self.seq += 1
        quoted = self._sections.get(section)
        if quoted is None:
            quoted = self._sections[section] = json.dumps(section)
        where = "null" if checkpoint is None else json.dumps(checkpoint)
        committed = "null" if committed_step is None else int(committed_step)
        saved = "" if save is None else f',"save":{json.dumps(save)}'
        when = "" if t is None else f',"t":{t!r}'
        return (f'{self._head}"section":{quoted},"step":{int(step)},"seq":{self.seq},"kind":"{kind}",'
                f'"checkpoint":{where},"committed_step":{committed},"tokens":{int(tokens)},'
                f'"samples":{int(samples)}{saved}{when}}}')

    def send(self, kind: str, section: str, step: int, *, committed_step: int | None = None,
             checkpoint: str | None = None, tokens: int = 0, samples: int = 0,
             save: dict[str, Any] | None = None) -> bool:
        """Send one heartbeat; True when the agent's socket took it."""
        try:
            text = self.format(kind, section, step, committed_step=committed_step, checkpoint=checkpoint,
                               tokens=tokens, samples=samples, save=save)
        except Exception as e:  # noqa: BLE001  e.g. a save report that is not JSON: drop, never raise
            self.dropped += 1
            self.last_error = f"{type(e).__name__}: {e}"
            return False
        return self.send_raw(text, 1)

    def send_raw(self, text: str, count: int) -> bool:
        """Send ``count`` formatted heartbeats (lines of ``text``) as one datagram; never raises."""
        try:
            if not self._connected:
                now = self._clock()
                if now < self._retry_at:
                    self.dropped += 1
                    return False
                self._retry_at = now + RECONNECT_INTERVAL_S
                self._sock.connect(self.path)
                self._connected = True
            self._sock.send(text.encode())
        except Exception as e:  # noqa: BLE001  the training loop must never see a heartbeat problem
            if not isinstance(e, BlockingIOError):
                self._connected = False  # the agent's socket may be gone or rebound: reconnect later
            self.dropped += count
            self.last_error = f"{type(e).__name__}: {e}"
            return False
        self.sent += count
        return True

    def close(self) -> None:
        self._sock.close()


class BatchingSender:
    """Queue heartbeats in the training loop; send them in one datagram every ``interval_s`` from a thread.

    Per step the loop pays for a tuple and an append (about a microsecond)
    instead of a system call and a wake-up of the agent per section; each
    heartbeat carries the monotonic time of its event, so the agent's
    timing stays exact and hang detection is late by at most ``interval_s``.
    ``hello`` and ``bye`` are sent at once (with everything queued before
    them).  A process killed between flushes loses at most ``interval_s``
    of heartbeats, which only ever makes the agent see it in an older
    section.
    """

    def __init__(self, sender: HeartbeatSender, interval_s: float = 0.02,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.sender = sender
        self.interval_s = interval_s
        self._clock = clock
        self._pending: deque[tuple[Any, ...]] = deque()  # append and popleft are atomic: no lock in the loop
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_flush = float("-inf")
        s = sender
        self._head = (f'{{"v":{PROTOCOL_VERSION},"rank":{int(s.rank)},"local_rank":{int(s.local_rank)},'
                      f'"pid":{s.pid},"rows":')

    @property
    def sent(self) -> int:
        return self.sender.sent

    @property
    def dropped(self) -> int:
        return self.sender.dropped

    def send(self, kind: str, section: str, step: int, *, committed_step: int | None = None,
             checkpoint: str | None = None, tokens: int = 0, samples: int = 0,
             save: dict[str, Any] | None = None) -> bool:
        """Queue one heartbeat; never raises.

        It goes out at once when it is a ``hello`` or ``bye``, or when the
        last datagram left at least ``interval_s`` ago: with steps longer
        than the interval every section entry is sent as it happens, and
        only faster loops are batched.
        """
        now = self._clock()
        self._pending.append((kind, section, step, committed_step, checkpoint, tokens, samples, save, now))
        if kind != "section" or now - self._last_flush >= self.interval_s:
            self.flush()
        elif self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="resilient-heartbeat-sender", daemon=True)
            self._thread.start()
        return True

    def _loop(self) -> None:
        while not self._closed.wait(self.interval_s):
            self.flush()

    def flush(self) -> None:
        """Send everything queued, in order, in as few datagrams as fit."""
        with self._lock:
            pending = self._pending
            if pending:
                self._last_flush = self._clock()
            while pending:
                rows: list[list[Any]] = []
                while pending and len(rows) < _ROWS_PER_DATAGRAM:
                    kind, section, step, committed, checkpoint, tokens, samples, save, t = pending.popleft()
                    self.sender.seq += 1
                    rows.append([kind, section, step, self.sender.seq, t, committed, tokens, samples, save,
                                 checkpoint])
                try:
                    text = self._head + json.dumps(rows, separators=(",", ":")) + "}"
                except (TypeError, ValueError) as e:  # a save report that is not JSON: drop, never raise
                    self.sender.dropped += len(rows)
                    self.sender.last_error = f"{type(e).__name__}: {e}"
                    continue
                self.sender.send_raw(text, len(rows))

    def close(self) -> None:
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.flush()
        self.sender.close()


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
    ) -> None:
        self.path = os.fspath(path)
        if len(os.fsencode(self.path)) > SOCKET_PATH_LIMIT:
            raise ConfigError(
                f"heartbeat socket path {self.path!r} is longer than the kernel's {SOCKET_PATH_LIMIT}-byte limit "
                "for unix sockets; use a shorter run directory (or RunDir.socket_path)"
            )
        self._on_message = on_message
        self._clock = clock
        self.received = 0
        self.malformed = 0
        self.callback_errors = 0
        self.last_error: str | None = None
        self._closed = threading.Event()
        self._sock = _bind_private(self.path)
        self._thread = threading.Thread(target=self._serve, name="resilient-heartbeats", daemon=True)
        self._thread.start()

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



def _bind_private(path: str) -> socket.socket:
    """Bind a datagram socket at ``path`` that only this user can write to.

    It is bound under a temporary name, chmod-ed, then renamed into place,
    so no other user can ever connect to it (a process-wide umask change
    would race with other threads).  A stale socket at ``path`` is replaced;
    any other kind of file there is refused.
    """
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISSOCK(mode):
            raise ConfigError(f"heartbeat socket path {path} exists and is not a socket; remove it or choose another")
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".{name}.{os.getpid()}.tmp")
    if len(os.fsencode(tmp)) > SOCKET_PATH_LIMIT:
        tmp = path  # no room for a longer name: bind in place (the chmod follows at once)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        if tmp != path and os.path.lexists(tmp):
            os.unlink(tmp)
        if tmp == path and os.path.lexists(path):
            os.unlink(path)
        sock.bind(tmp)
        os.chmod(tmp, 0o600)
        if tmp != path:
            os.replace(tmp, path)
        sock.settimeout(1.0)
    except BaseException:
        sock.close()
        raise
    return sock
