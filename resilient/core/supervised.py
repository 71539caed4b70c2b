"""Background threads that cannot die silently: an unexpected error is reported and the thread's loop starts again.

The agent leans on a few threads (its presence and probes, the peer watch,
the recovery keys' keep-alive, the status writers, the memory replica).  A
loop catches what it expects (the store being away, a peer closing); anything
else used to end its thread with nothing said, leaving an agent that looks
alive and no longer judges nodes or renews its lease.  :class:`Supervised`
runs such a loop: when it raises, ``on_crash(name, error, traceback)`` is
called and the loop is started again after a pause that doubles from
:data:`FIRST_PAUSE_S` up to :data:`MAX_PAUSE_S`.  A loop that raised
:data:`GIVE_UP_AFTER` times within :data:`GIVE_UP_WINDOW_S` is taken for
broken for good: ``on_fatal(name, error)`` is called once and the thread
ends (the agent stops the run with a verdict that names the thread).

A loop returns normally when its owner is done with it; the thread then ends.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable

FIRST_PAUSE_S = 0.2
MAX_PAUSE_S = 10.0
GIVE_UP_AFTER = 5
"""Crashes within :data:`GIVE_UP_WINDOW_S` after which a loop is not started again."""
GIVE_UP_WINDOW_S = 120.0

CrashCallback = Callable[[str, str, str], None]
"""``(thread name, error, traceback)``: the loop raised and is started again."""
FatalCallback = Callable[[str, str], None]
"""``(thread name, error)``: the loop kept raising; it is not started again."""


def quiet(*_: str) -> None:
    """Reports nothing (the default for callers that have nowhere to report)."""


class Supervised:
    """Runs ``loop`` on a daemon thread named ``name``, starting it again after each unexpected error."""

    def __init__(self, name: str, loop: Callable[[], None], *, on_crash: CrashCallback = quiet,
                 on_fatal: FatalCallback = quiet, stop: threading.Event | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``stop``: set by the owner when it is done (a pause before a restart ends at once, and no restart
        follows)."""
        self.name = name
        self._loop = loop
        self._on_crash = on_crash
        self._on_fatal = on_fatal
        self._stop = stop if stop is not None else threading.Event()
        self._clock = clock
        self.crashes = 0
        """Errors the loop raised so far (each reported through ``on_crash``)."""
        self.gave_up = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> Supervised:
        self._thread.start()
        return self

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        recent: list[float] = []
        while not self._stop.is_set():
            try:
                self._loop()
                return
            except Exception as e:  # noqa: BLE001  reported, and the loop starts again
                error = f"{type(e).__name__}: {e}"
                trace = "".join(traceback.format_exception(e))
            self.crashes += 1
            now = self._clock()
            recent = [t for t in recent if now - t < GIVE_UP_WINDOW_S] + [now]
            if len(recent) >= GIVE_UP_AFTER:
                self.gave_up = True
                _call(self._on_fatal, self.name, f"{len(recent)} errors in {GIVE_UP_WINDOW_S:g} s, the last: {error}")
                return
            _call(self._on_crash, self.name, error, trace)
            self._stop.wait(min(MAX_PAUSE_S, FIRST_PAUSE_S * 2 ** (len(recent) - 1)))


def _call(callback: Callable[..., None], *args: str) -> None:
    try:
        callback(*args)
    except Exception:  # noqa: BLE001, S110  a failing report must not end the thread it reports on
        pass


class ThreadReports:
    """Where an agent's supervised threads report: ``crashed`` (an error, the loop starts again) and ``failed``
    (it kept raising and is not started again)."""

    def __init__(self, crashed: CrashCallback = quiet, failed: FatalCallback = quiet) -> None:
        self.crashed = crashed
        self.failed = failed

    def run(self, name: str, loop: Callable[[], None], stop: threading.Event | None = None) -> Supervised:
        """Start ``loop`` on a supervised thread that reports here."""
        return Supervised(name, loop, on_crash=self.crashed, on_fatal=self.failed, stop=stop).start()
