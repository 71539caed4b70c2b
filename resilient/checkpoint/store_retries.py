"""A checkpoint store in trouble, reported at its first failed request rather than when a save gives up.

An S3 client retries a 503 or a reset for up to half a minute before the
request fails; until then nothing said the store was sick.  Each retried
request is a :class:`~resilient.checkpoint.storage.StoreRetry`;
:class:`RetryReports` turns them into ``checkpoint_store_retrying`` events:
the first at once, then at most one every ``every_s`` seconds, each with the
number of retries since the one before (an outage of a minute is six events
per rank, not hundreds).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ..core.events import EventKind, EventLog
from .storage import StoreRetry

EVERY_S = 10.0


class RetryReports:
    """Rate-limited ``checkpoint_store_retrying`` events for one store; :meth:`report` is thread-safe."""

    def __init__(self, events: EventLog, location: str, *, every_s: float = EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.events, self.location, self.every_s, self._clock = events, location, every_s, clock
        self._lock = threading.Lock()
        self._last: float | None = None
        self._since = 0
        self.total = 0
        """Retried requests seen."""

    def report(self, retry: StoreRetry) -> None:
        with self._lock:
            self.total += 1
            self._since += 1
            now = self._clock()
            if self._last is not None and now - self._last < self.every_s:
                return
            retries, self._since, self._last = self._since, 0, now
        self.events.emit(
            EventKind.CHECKPOINT_STORE_RETRYING, location=self.location, operation=retry.operation,
            attempt=retry.attempt, attempts=retry.attempts, error=retry.error, retries=retries,
            reason=(f"the checkpoint store {self.location} failed {retry.operation} ({retry.error}) on attempt "
                    f"{retry.attempt} of {retry.attempts}; retrying ({retries} retried request(s) since the last "
                    f"report). Saves fail if it lasts past the retries; check the store's health and request rate"))
