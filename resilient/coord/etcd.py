"""Our etcd v3 client, standard library only: key-value, transactions and leases over the JSON gateway.

Keys and values travel base64-encoded, 64-bit integers as strings, and
fields equal to their zero value are omitted.  We use a handful of calls:
range, put, txn, deleterange and lease grant/keepalive/timetolive/revoke.  How a call
reaches etcd (failover, retries through an outage, auth, TLS) is
:mod:`.etcd_transport`'s; :class:`EtcdConfig` and ``OutageCallback`` are
re-exported here, where callers have always found them.  :class:`EtcdControlStore`
is the :class:`~.store.ControlStore` protocol over this client.
"""

from __future__ import annotations

import base64
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from .etcd_transport import NOT_FOUND, EtcdConfig, EtcdTransport, OutageCallback
from .keyspace import run_root
from .store import ControlStore, Entry, StoreRequestError
from .txn import Compare, Delete, Put, Txn, TxnResult

__all__ = ["Compacted", "EtcdClient", "EtcdConfig", "OutageCallback", "WatchBatch"]


class Compacted(StoreRequestError):
    """A watch asked for a revision etcd has compacted away: read the keys again, then watch from there."""

    def __init__(self, revision: int) -> None:
        super().__init__(f"etcd compacted its history up to revision {revision}")
        self.revision = revision


@dataclass(frozen=True)
class WatchBatch:
    revision: int
    """The store's revision when etcd sent the batch."""
    events: list[tuple[str, Entry]]
    """``("PUT", entry)`` or ``("DELETE", entry)`` (a deleted entry carries its key and revision only)."""


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _prefix_end(prefix: bytes) -> bytes:
    """etcd's range end for "every key starting with prefix"."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return b"\0"  # every key
    return stripped[:-1] + bytes([stripped[-1] + 1])


def _entry(kv: dict[str, Any]) -> Entry:
    return Entry(
        key=base64.b64decode(kv.get("key", "")).decode("utf-8", "surrogateescape"),
        value=base64.b64decode(kv.get("value", "")),
        mod_revision=int(kv.get("mod_revision", 0)),
        create_revision=int(kv.get("create_revision", 0)),
        version=int(kv.get("version", 0)),
        lease=int(kv.get("lease", 0)),
    )


def _key(key: str) -> bytes:
    return key.encode("utf-8", "surrogateescape")

class EtcdClient(EtcdTransport):
    """An etcd v3 client; thread-safe, one instance may serve every thread of a process.

    A transport with typed operations on top (a subclass rather than a
    member so that one object is handed around and its outage state is one).
    Every method raises what :meth:`EtcdTransport.call` raises.
    """

    # -- key-value ---------------------------------------------------------

    def get(self, key: str) -> Entry | None:
        """The entry under ``key`` or ``None``."""
        kvs = self.call("/v3/kv/range", {"key": _b64(_key(key))}).get("kvs", [])
        return _entry(kvs[0]) if kvs else None

    def get_prefix(self, prefix: str) -> list[Entry]:
        """Every entry whose key starts with ``prefix``, sorted by key."""
        p = _key(prefix)
        body = {"key": _b64(p), "range_end": _b64(_prefix_end(p))}
        return [_entry(kv) for kv in self.call("/v3/kv/range", body).get("kvs", [])]

    def snapshot_prefix(self, prefix: str) -> tuple[list[Entry], int]:
        """Every entry under ``prefix`` and the store's revision they were read at (one read, one revision)."""
        p = _key(prefix)
        result = self.call("/v3/kv/range", {"key": _b64(p), "range_end": _b64(_prefix_end(p))})
        return [_entry(kv) for kv in result.get("kvs", [])], int(result["header"]["revision"])

    def watch_prefix(self, prefix: str, start_revision: int, idle_s: float, stop: threading.Event | None = None,
                     on_open: Callable[[socket.socket], None] | None = None) -> Iterator[WatchBatch]:
        """The changes under ``prefix`` from ``start_revision`` on, one batch per revision, as etcd sends them.

        Ends when the stream does (see :meth:`EtcdTransport.stream`); raises
        :class:`Compacted` when etcd no longer has ``start_revision``.
        """
        p = _key(prefix)
        body = {"create_request": {"key": _b64(p), "range_end": _b64(_prefix_end(p)),
                                   "start_revision": str(start_revision)}}
        for message in self.stream("/v3/watch", body, idle_s, stop, on_open):
            result = message.get("result")
            if not isinstance(result, dict):
                error = message.get("error") or message
                raise StoreRequestError(f"etcd ended a watch of {prefix!r}: {error}")
            if result.get("compact_revision"):
                raise Compacted(int(result["compact_revision"]))
            if result.get("canceled"):
                raise StoreRequestError(f"etcd cancelled a watch of {prefix!r}: {result.get('cancel_reason')}")
            events = [(str(e.get("type", "PUT")), _entry(e["kv"])) for e in result.get("events", [])]
            yield WatchBatch(int(result.get("header", {}).get("revision", 0)), events)

    def first_created(self, prefix: str) -> tuple[Entry | None, int]:
        """The entry under ``prefix`` created first (lowest create revision), and how many keys start with
        ``prefix``: one request, whatever their number."""
        p = _key(prefix)
        body = {"key": _b64(p), "range_end": _b64(_prefix_end(p)), "limit": "1", "sort_order": "ASCEND",
                "sort_target": "CREATE"}
        result = self.call("/v3/kv/range", body)
        kvs = result.get("kvs", [])
        return (_entry(kvs[0]) if kvs else None), int(result.get("count", 0))

    def count_prefix(self, prefix: str) -> int:
        """How many keys start with ``prefix``."""
        p = _key(prefix)
        body = {"key": _b64(p), "range_end": _b64(_prefix_end(p)), "count_only": True}
        return int(self.call("/v3/kv/range", body).get("count", 0))

    def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        """Write ``value``; returns the new revision."""
        body: dict[str, Any] = {"key": _b64(_key(key)), "value": _b64(value), "lease": str(lease)}
        return int(self.call("/v3/kv/put", body)["header"]["revision"])

    def put_if_absent(self, key: str, value: bytes, *, lease: int = 0) -> tuple[bool, Entry]:
        """Create ``key`` if absent: ``(True, new entry)`` or ``(False, existing entry)``."""
        ok, entry = self._txn(key, Compare.absent(key), value, lease)
        assert entry is not None, "etcd returned no entry for a key that exists"
        return ok, entry

    def compare_and_swap(
        self, key: str, expected_mod_revision: int, value: bytes, *, lease: int = 0
    ) -> tuple[bool, Entry | None]:
        """Write if ``key``'s mod_revision is ``expected_mod_revision`` (0: absent).

        Returns ``(True, new entry)`` or ``(False, current entry or None)``.
        """
        return self._txn(key, Compare.unchanged(key, expected_mod_revision), value, lease)

    def _txn(self, key: str, compare: Compare, value: bytes, lease: int) -> tuple[bool, Entry | None]:
        result = self.txn(Txn((compare,), (Put(key, value, lease),), read=(key,)))
        return result.succeeded, result.entries[key]

    def txn(self, txn: Txn) -> TxnResult:
        """Apply ``txn`` in one request: its writes if every comparison holds; its reads either way."""
        compares = []
        for c in txn.compare:
            k = _b64(_key(c.key))
            if c.target == "value":
                assert isinstance(c.expected, bytes)
                compares.append({"key": k, "result": "EQUAL", "target": "VALUE", "value": _b64(c.expected)})
            else:
                field = {"create": "create_revision", "mod": "mod_revision", "version": "version"}[c.target]
                compares.append({"key": k, "result": "EQUAL", "target": c.target.upper(), field: str(c.expected)})
        writes: list[dict[str, Any]] = []
        for op in txn.success:
            if isinstance(op, Put):
                writes.append({"request_put": {"key": _b64(_key(op.key)), "value": _b64(op.value),
                                               "lease": str(op.lease)}})
            else:
                assert isinstance(op, Delete)
                writes.append({"request_delete_range": {"key": _b64(_key(op.key))}})
        reads = [{"request_range": {"key": _b64(_key(k))}} for k in txn.read]
        result = self.call("/v3/kv/txn", {"compare": compares, "success": writes + reads, "failure": reads})
        succeeded = bool(result.get("succeeded", False))
        answers = result.get("responses", [])[len(writes) if succeeded else 0:]
        entries: dict[str, Entry | None] = {}
        for key, answer in zip(txn.read, answers):
            kvs = answer.get("response_range", {}).get("kvs", [])
            entries[key] = _entry(kvs[0]) if kvs else None
        return TxnResult(succeeded, int(result["header"]["revision"]), entries)

    def delete(self, key: str) -> bool:
        """Remove ``key``; ``True`` if it existed."""
        return int(self.call("/v3/kv/deleterange", {"key": _b64(_key(key))}).get("deleted", 0)) > 0

    def delete_prefix(self, prefix: str) -> int:
        """Remove every key starting with ``prefix``; returns how many."""
        p = _key(prefix)
        body = {"key": _b64(p), "range_end": _b64(_prefix_end(p))}
        return int(self.call("/v3/kv/deleterange", body).get("deleted", 0))

    # -- leases --------------------------------------------------------------

    def lease_grant(self, ttl_s: int) -> int:
        """A new lease of ``ttl_s`` seconds; returns its id."""
        return int(self.call("/v3/lease/grant", {"TTL": str(int(ttl_s))})["ID"])

    def lease_keepalive(self, lease_id: int) -> int:
        """Renew a lease; returns its remaining TTL in seconds, 0 when it expired or never existed."""
        result = self.call("/v3/lease/keepalive", {"ID": str(lease_id)})
        if "error" in result:  # a stream reports errors in its body, with HTTP 200
            raise StoreRequestError(f"etcd lease keepalive of {lease_id} failed: {result['error']}")
        return int(result.get("result", {}).get("TTL", 0))

    def lease_ttl(self, lease_id: int) -> int:
        """Seconds left on a lease (etcd's clock); -1 when it expired or never existed."""
        return int(self.call("/v3/lease/timetolive", {"ID": str(lease_id)}).get("TTL", -1))

    def lease_revoke(self, lease_id: int) -> bool:
        """Revoke a lease and delete its keys; ``False`` if it did not exist."""
        try:
            self.call("/v3/lease/revoke", {"ID": str(lease_id)})
        except StoreRequestError as e:
            if e.code == NOT_FOUND:
                return False
            raise
        return True


class EtcdControlStore(ControlStore):
    """A :class:`ControlStore` over etcd v3, every key living under ``prefix``.

    Keys given to and returned by this store are relative to the prefix.
    Writes interrupted by a connection failure are retried by the client; a
    write that reached etcd before the failure may then be applied twice for
    ``put``, or a ``compare_and_swap`` that succeeded may report failure (the
    token moved): callers that need exactly-once must re-read.
    """

    def __init__(self, client: EtcdClient, prefix: str) -> None:
        if not prefix.endswith("/"):
            prefix += "/"
        self._client = client
        self._prefix = prefix

    @classmethod
    def for_run(cls, client: EtcdClient, run_id: str) -> EtcdControlStore:
        """The store of run ``run_id``: keys under its root (:func:`~resilient.coord.keyspace.run_root`)."""
        return cls(client, run_root(run_id))

    @property
    def prefix(self) -> str:
        """The etcd key prefix all keys of this store live under."""
        return self._prefix

    def _strip(self, entry: Entry | None) -> Entry | None:
        return None if entry is None else replace(entry, key=entry.key[len(self._prefix) :])

    def get(self, key: str) -> Entry | None:
        return self._strip(self._client.get(self._prefix + key))

    def get_prefix(self, prefix: str) -> list[Entry]:
        return [e for e in map(self._strip, self._client.get_prefix(self._prefix + prefix)) if e is not None]

    def put(self, key: str, value: bytes) -> int:
        return self._client.put(self._prefix + key, value)

    def put_if_absent(self, key: str, value: bytes) -> tuple[bool, Entry]:
        ok, entry = self._client.put_if_absent(self._prefix + key, value)
        stripped = self._strip(entry)
        assert stripped is not None
        return ok, stripped

    def compare_and_swap(self, key: str, expected_mod_revision: int, value: bytes) -> tuple[bool, Entry | None]:
        ok, entry = self._client.compare_and_swap(self._prefix + key, expected_mod_revision, value)
        return ok, self._strip(entry)

    def delete(self, key: str) -> bool:
        return self._client.delete(self._prefix + key)
