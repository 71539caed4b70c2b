"""The control-store protocol: a small revisioned key-value store for the control plane.

The agent keeps membership, the global restart budget, generations and the
latest-commit pointer in a :class:`ControlStore`.  Two implementations share
one contract, tested by the same tests:

* :class:`~resilient.coord.etcd.EtcdControlStore`: keys under a prefix in
  etcd v3, a run's root (:mod:`.keyspace`) on many machines, beside the etcd
  client;
* :class:`MemoryControlStore`: a thread-safe in-process store, the embedded
  default on one machine.

Every write bumps a store-wide revision; an entry carries the revision of
its last write (``mod_revision``) and of its creation (``create_revision``),
exactly as etcd does.  ``compare_and_swap`` on ``mod_revision`` is the
fencing primitive everything else is built from.  This module also owns the
store errors, so callers can catch them without importing a backend.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace

from ..core.errors import ResilientError


class ControlStoreError(ResilientError):
    """Base class of control-store failures."""


class StoreUnavailableError(ControlStoreError):
    """The store could not be reached for longer than the configured outage tolerance."""


class StoreAuthError(ControlStoreError):
    """The store refused our credentials or certificates, or the user lacks a permission."""


class StoreRequestError(ControlStoreError):
    """The store rejected a request (bad argument, unknown lease, ...); ``code`` is the gRPC code."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Entry:
    """One key as read from a store; revisions follow etcd (0 means never written)."""

    key: str
    value: bytes
    mod_revision: int
    create_revision: int
    version: int = 1
    lease: int = 0


class ControlStore(ABC):
    """A revisioned key-value store. Keys are ``str``, values ``bytes``.

    Every method may raise :class:`StoreUnavailableError` (unreachable past the
    outage tolerance), :class:`StoreAuthError` or :class:`StoreRequestError`;
    the in-memory store never does.
    """

    @abstractmethod
    def get(self, key: str) -> Entry | None:
        """The entry under ``key``, or ``None`` when absent."""

    @abstractmethod
    def get_prefix(self, prefix: str) -> list[Entry]:
        """Every entry whose key starts with ``prefix``, sorted by key."""

    @abstractmethod
    def put(self, key: str, value: bytes) -> int:
        """Write unconditionally; returns the new ``mod_revision``."""

    @abstractmethod
    def put_if_absent(self, key: str, value: bytes) -> tuple[bool, Entry]:
        """Create ``key`` only if absent: ``(True, new entry)`` or ``(False, existing entry)``."""

    @abstractmethod
    def compare_and_swap(self, key: str, expected_mod_revision: int, value: bytes) -> tuple[bool, Entry | None]:
        """Write only if ``key``'s ``mod_revision`` equals ``expected_mod_revision`` (0: key absent).

        Returns ``(True, new entry)`` or ``(False, current entry or None when absent)``.
        """

    @abstractmethod
    def delete(self, key: str) -> bool:
        """Remove ``key``; ``True`` if it existed."""

    def add(self, key: str, delta: int) -> int:
        """Atomically add ``delta`` to the decimal integer under ``key`` (absent: 0); returns the new value.

        A compare-and-swap loop, so concurrent adders never lose an update.
        Raises :class:`StoreRequestError` when the value is not an integer.
        """
        current = self.get(key)
        while True:
            base = 0 if current is None else _parse_int(key, current.value)
            new = base + delta
            ok, seen = self.compare_and_swap(key, 0 if current is None else current.mod_revision, str(new).encode())
            if ok:
                return new
            current = seen


def _parse_int(key: str, value: bytes) -> int:
    try:
        return int(value.decode())
    except (UnicodeDecodeError, ValueError):
        msg = f"key {key!r} holds {value[:40]!r}, not a decimal integer; add() needs a counter key"
        raise StoreRequestError(msg) from None


class MemoryControlStore(ControlStore):
    """The embedded single-machine store: a dict behind a lock, with etcd's revision semantics."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, Entry] = {}
        self._revision = 0

    def _write(self, key: str, value: bytes) -> Entry:
        self._revision += 1
        old = self._data.get(key)
        if old is None:
            entry = Entry(key, bytes(value), self._revision, self._revision, 1)
        else:
            entry = replace(old, value=bytes(value), mod_revision=self._revision, version=old.version + 1)
        self._data[key] = entry
        return entry

    def get(self, key: str) -> Entry | None:
        with self._lock:
            return self._data.get(key)

    def get_prefix(self, prefix: str) -> list[Entry]:
        with self._lock:
            return [self._data[k] for k in sorted(self._data) if k.startswith(prefix)]

    def put(self, key: str, value: bytes) -> int:
        with self._lock:
            return self._write(key, value).mod_revision

    def put_if_absent(self, key: str, value: bytes) -> tuple[bool, Entry]:
        with self._lock:
            old = self._data.get(key)
            if old is not None:
                return False, old
            return True, self._write(key, value)

    def compare_and_swap(self, key: str, expected_mod_revision: int, value: bytes) -> tuple[bool, Entry | None]:
        with self._lock:
            old = self._data.get(key)
            if (0 if old is None else old.mod_revision) != expected_mod_revision:
                return False, old
            return True, self._write(key, value)

    def delete(self, key: str) -> bool:
        with self._lock:
            if self._data.pop(key, None) is None:
                return False
            self._revision += 1
            return True


