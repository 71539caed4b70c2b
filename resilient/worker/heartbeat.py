"""The worker's end of the heartbeat protocol (:mod:`resilient.worker.protocol`).

:class:`HeartbeatSender` sends one datagram per call and never blocks or
raises; :class:`BatchingSender` queues heartbeats in the training loop and
sends them in one datagram every 100 ms from a thread.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from .protocol import PROTOCOL_VERSION, REPORTS, ROWS_PER_DATAGRAM

RECONNECT_INTERVAL_S = 0.05
"""After a failed connect, drop heartbeats for this long before trying again (a failing connect costs ~20 us)."""


@dataclass(frozen=True)
class HeartbeatCounts:
    """Heartbeats a worker sent to its agent, and those lost on the way (counted, never raised)."""

    sent: int
    dropped: int


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
        generation: int = 0,
        pid: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = os.fspath(path)
        self.rank = rank
        self.local_rank = local_rank
        self.generation = generation
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
        self._head = ""
        self._sections: dict[str, str] = {}
        self.rejoin(generation, rank)

    def rejoin(self, generation: int, rank: int) -> None:
        """Send as ``rank`` of ``generation`` from now on (after an in-process re-formation)."""
        self.generation, self.rank = generation, rank
        # Everything but section, step, seq and committed step is fixed between re-formations: format it once.
        self._head = (f'{{"v":{PROTOCOL_VERSION},"g":{int(generation)},"rank":{int(rank)},'
                      f'"local_rank":{int(self.local_rank)},"pid":{self.pid},')

    def format(self, kind: str, section: str, step: int, *, committed_step: int | None = None,
               checkpoint: str | None = None, tokens: int = 0, samples: int = 0,
               save: dict[str, Any] | None = None, t: float | None = None,
               **reports: dict[str, Any] | None) -> str:
        """One heartbeat as a JSON line (takes the next sequence number); ``reports``: the object of a kind that
        carries one (``restored=``, ``recovery=``, ``timing=``, ``audit=``, ``notice=``)."""
        self.seq += 1
        quoted = self._sections.get(section)
        if quoted is None:
            quoted = self._sections[section] = json.dumps(section)
        where = "null" if checkpoint is None else json.dumps(checkpoint)
        committed = "null" if committed_step is None else int(committed_step)
        saved = "" if save is None else f',"save":{json.dumps(save)}'
        when = "" if t is None else f',"t":{t!r}'
        report = ""
        for name, value in reports.items():
            assert name in REPORTS, f"a heartbeat carries no {name!r}"
            report += "" if value is None else f',"{name}":{json.dumps(value)}'
        return (f'{self._head}"section":{quoted},"step":{int(step)},"seq":{self.seq},"kind":"{kind}",'
                f'"checkpoint":{where},"committed_step":{committed},"tokens":{int(tokens)},'
                f'"samples":{int(samples)}{saved}{when}{report}}}')

    def send(self, kind: str, section: str, step: int, *, committed_step: int | None = None,
             checkpoint: str | None = None, tokens: int = 0, samples: int = 0,
             save: dict[str, Any] | None = None, **reports: dict[str, Any] | None) -> bool:
        """Send one heartbeat; True when the agent's socket took it."""
        try:
            text = self.format(kind, section, step, committed_step=committed_step, checkpoint=checkpoint,
                               tokens=tokens, samples=samples, save=save, **cast("dict[str, Any]", reports))
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


BATCH_INTERVAL_S = 0.1
"""Heartbeats of a fast loop go out in one datagram this often: each costs the agent a wake-up of its receiver
thread (at 20 ms, 1.8% of a core per rank with 10 ms steps; at 100 ms, 0.9%), which a busy node's workers pay.
A hang is seen at most this much later, against timeouts of seconds; every heartbeat carries its own time."""

SLOW_SECTION_S = 0.02
"""A section entry that ends a section of at least this long goes out at once: a loop whose sections take 20 ms
or more sends as it goes (50 datagrams a second per rank at most), so a survivor stopped right after a peer's
death has told the agent every step it completed, and the replayed steps and goodput are counted from what
happened, not from what was still queued; only faster loops are batched."""


class BatchingSender:
    """Queue heartbeats in the training loop; send them in one datagram every ``interval_s`` from a thread.

    Per step the loop pays for a tuple and an append (about a microsecond)
    instead of a system call and a wake-up of the agent per section; each
    heartbeat carries the monotonic time of its event, so the agent's
    timing stays exact and hang detection is late by at most ``interval_s``.
    ``hello`` and ``bye`` are sent at once (with everything queued before
    them), and so is a section entry after a section of ``slow_section_s``
    or more.  A process killed between flushes loses at most ``interval_s``
    of heartbeats of sections shorter than that, which only ever makes the
    agent see it in an older section.
    """

    def __init__(self, sender: HeartbeatSender, interval_s: float = BATCH_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic, slow_section_s: float = SLOW_SECTION_S) -> None:
        self.sender = sender
        self.interval_s = interval_s
        self.slow_section_s = slow_section_s
        self._clock = clock
        self._pending: deque[tuple[Any, ...]] = deque()  # append and popleft are atomic: no lock in the loop
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_flush = float("-inf")
        self._last_row = float("-inf")
        self._head = ""
        self._format_head()

    def _format_head(self) -> None:
        s = self.sender
        self._head = (f'{{"v":{PROTOCOL_VERSION},"g":{int(s.generation)},"rank":{int(s.rank)},'
                      f'"local_rank":{int(s.local_rank)},"pid":{s.pid},"rows":')

    def rejoin(self, generation: int, rank: int) -> None:
        """Send what is queued under the old header, then send as ``rank`` of ``generation``."""
        with self._lock:
            self._flush_locked()
            self.sender.rejoin(generation, rank)
            self._format_head()

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

        It goes out at once when it is a ``hello`` or ``bye``, when the
        last datagram left at least ``interval_s`` ago, or when the section
        it ends took ``slow_section_s`` or more: with sections that long
        every entry is sent as it happens, and only faster loops are
        batched.
        """
        if self._closed.is_set():  # after close (a bye): nothing sends any more, so count it as lost now
            self.sender.dropped += 1
            self.sender.last_error = "the sender is closed"
            return False
        now = self._clock()
        self._pending.append((kind, section, step, committed_step, checkpoint, tokens, samples, save, now))
        previous, self._last_row = self._last_row, now
        if kind != "section" or now - self._last_flush >= self.interval_s or now - previous >= self.slow_section_s:
            self.flush()
        elif self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="resilient-heartbeat-sender", daemon=True)
            self._thread.start()
        return True

    def send_single(self, kind: str, section: str, step: int, *, committed_step: int | None = None,
                    **reports: dict[str, Any] | None) -> bool:
        """Send what is queued, then one heartbeat in a datagram of its own (``restored``, ``recovery``, ``timing``,
        ``audit``, ``notice``); never raises.

        A report that older agents do not know travels alone, so an older
        agent drops that datagram only, never a batch of heartbeats with it.
        """
        if self._closed.is_set():
            self.sender.dropped += 1
            self.sender.last_error = "the sender is closed"
            return False
        with self._lock:
            self._flush_locked()
            self._last_flush = self._clock()
            return self.sender.send(kind, section, step, committed_step=committed_step,
                                    **cast("dict[str, Any]", reports))

    def _loop(self) -> None:
        while not self._closed.wait(self.interval_s):
            self.flush()

    def flush(self) -> None:
        """Send everything queued, in order, in as few datagrams as fit."""
        with self._lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        """Send everything queued (the caller holds the lock)."""
        pending = self._pending
        if pending:
            self._last_flush = self._clock()
        while pending:
            rows: list[list[Any]] = []
            while pending and len(rows) < ROWS_PER_DATAGRAM:
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
