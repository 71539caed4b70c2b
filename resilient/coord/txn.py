"""One etcd transaction, described as data: the comparisons it makes, the writes it does when they all hold.

etcd applies a transaction at one revision, all of it or none of it: the
comparisons are evaluated together and, only if every one holds, every
write is made.  Whatever a transaction reads (:attr:`Txn.read`) is read in
the same revision, after its writes when it succeeded, so a caller learns
why a transaction failed without a second, later read.  The etcd client
(:meth:`resilient.coord.etcd.EtcdClient.txn`) sends it through the JSON
gateway; the in-memory model the protocol tests run against applies the
same data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .store import Entry

Target = Literal["create", "mod", "version", "value"]


@dataclass(frozen=True)
class Compare:
    """``key``'s ``target`` equals ``expected``.  A key that does not exist has every revision at 0."""

    key: str
    target: Target
    expected: int | bytes

    @staticmethod
    def absent(key: str) -> Compare:
        return Compare(key, "create", 0)

    @staticmethod
    def unchanged(key: str, mod_revision: int) -> Compare:
        """``key`` was last written at ``mod_revision`` (0: it still does not exist)."""
        return Compare(key, "mod", mod_revision)

    def holds(self, entry: Entry | None) -> bool:
        """Evaluate against ``entry`` (None: the key does not exist)."""
        if self.target == "value":
            return entry is not None and entry.value == self.expected
        if entry is None:
            return self.expected == 0
        actual = {"create": entry.create_revision, "mod": entry.mod_revision, "version": entry.version}[self.target]
        return actual == self.expected


@dataclass(frozen=True)
class Put:
    key: str
    value: bytes
    lease: int = 0
    """Attach the key to this lease (0: none); a lease that no longer exists fails the whole transaction."""


@dataclass(frozen=True)
class Delete:
    key: str


@dataclass(frozen=True)
class Txn:
    compare: tuple[Compare, ...]
    success: tuple[Put | Delete, ...]
    read: tuple[str, ...] = ()
    """Keys read at the transaction's revision, on success (after the writes) and on failure alike."""


@dataclass(frozen=True)
class TxnResult:
    succeeded: bool
    revision: int
    """The store's revision after the transaction."""
    entries: dict[str, Entry | None] = field(default_factory=dict)
    """Every key of :attr:`Txn.read`: its entry, or None where it does not exist."""
