"""An in-memory model of etcd's key-value and lease semantics, for property-based tests of the protocols on it.

What it keeps of etcd: one store-wide revision, bumped once per write
request (a transaction's writes share one revision); ``create_revision``,
``mod_revision`` and ``version`` per key; transactions whose comparisons
are evaluated and writes applied atomically, with reads at the same
revision; leases with a TTL on a clock the test drives, whose expiry
deletes their keys; a put on a lease that does not exist fails the whole
request.  It offers the methods of :class:`resilient.coord.etcd.EtcdClient`
the protocols use, so the same code runs on it and on a real etcd (the
tests that check the model against etcd are in ``test_claims_protocol``).

:class:`Flaky` wraps it with the faults a network adds: a request lost
before it arrived, and one that applied but whose answer was lost.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from resilient.coord.etcd_transport import NOT_FOUND
from resilient.coord.store import Entry, StoreRequestError, StoreUnavailableError
from resilient.coord.txn import Compare, Delete, Put, Txn, TxnResult


@dataclass
class _Lease:
    ttl: int
    deadline: float
    keys: set[str] = field(default_factory=set)


class EtcdModel:
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self.revision = 1
        self._data: dict[str, Entry] = {}
        self._leases: dict[int, _Lease] = {}
        self._next_lease = 1000
        self.requests = 0

    # -- internals (lock held) ------------------------------------------------
    def _expire(self) -> None:
        now = self._clock()
        for lease_id in [i for i, lease in self._leases.items() if lease.deadline <= now]:
            self._revoke(lease_id)

    def _revoke(self, lease_id: int) -> None:
        lease = self._leases.pop(lease_id)
        if any(k in self._data for k in lease.keys):
            self.revision += 1
            for key in lease.keys:
                self._data.pop(key, None)

    def _remove(self, key: str) -> None:
        old = self._data.pop(key, None)
        if old is not None and old.lease in self._leases:
            self._leases[old.lease].keys.discard(key)

    def _put(self, key: str, value: bytes, lease: int) -> None:
        old = self._data.get(key)
        if old is not None and old.lease in self._leases:
            self._leases[old.lease].keys.discard(key)
        if old is None:
            entry = Entry(key, bytes(value), self.revision, self.revision, 1, lease)
        else:
            entry = replace(old, value=bytes(value), mod_revision=self.revision, version=old.version + 1, lease=lease)
        self._data[key] = entry
        if lease:
            self._leases[lease].keys.add(key)

    def _check_leases(self, puts: list[Put]) -> None:
        for op in puts:
            if op.lease and op.lease not in self._leases:
                raise StoreRequestError(f"etcd rejected the request: lease {op.lease} not found", NOT_FOUND)

    def _request(self) -> None:
        self.requests += 1
        self._expire()

    # -- the client's methods ------------------------------------------------
    def get(self, key: str) -> Entry | None:
        with self._lock:
            self._request()
            return self._data.get(key)

    def get_prefix(self, prefix: str) -> list[Entry]:
        with self._lock:
            self._request()
            return [self._data[k] for k in sorted(self._data) if k.startswith(prefix)]

    def first_created(self, prefix: str) -> tuple[Entry | None, int]:
        with self._lock:
            self._request()
            under = [e for k, e in self._data.items() if k.startswith(prefix)]
            return min(under, key=lambda e: e.create_revision, default=None), len(under)

    def delete_prefix(self, prefix: str) -> int:
        with self._lock:
            self._request()
            gone = [k for k in self._data if k.startswith(prefix)]
            if gone:
                self.revision += 1
                for key in gone:
                    self._remove(key)
            return len(gone)

    def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        return self.txn(Txn((), (Put(key, value, lease),))).revision

    def put_if_absent(self, key: str, value: bytes, *, lease: int = 0) -> tuple[bool, Entry]:
        result = self.txn(Txn((Compare.absent(key),), (Put(key, value, lease),), read=(key,)))
        entry = result.entries[key]
        assert entry is not None
        return result.succeeded, entry

    def compare_and_swap(self, key: str, expected_mod_revision: int, value: bytes, *,
                         lease: int = 0) -> tuple[bool, Entry | None]:
        result = self.txn(Txn((Compare.unchanged(key, expected_mod_revision),), (Put(key, value, lease),),
                              read=(key,)))
        return result.succeeded, result.entries[key]

    def delete(self, key: str) -> bool:
        with self._lock:
            self._request()
            if key not in self._data:
                return False
            self.revision += 1
            self._remove(key)
            return True

    def txn(self, txn: Txn) -> TxnResult:
        with self._lock:
            self._request()
            ok = all(c.holds(self._data.get(c.key)) for c in txn.compare)
            changes = [op for op in txn.success if isinstance(op, Put) or op.key in self._data] if ok else []
            if changes:  # etcd moves the revision only for a request that changes something
                self._check_leases([op for op in changes if isinstance(op, Put)])
                self.revision += 1
                for op in changes:
                    if isinstance(op, Put):
                        self._put(op.key, op.value, op.lease)
                    else:
                        assert isinstance(op, Delete)
                        self._remove(op.key)
            return TxnResult(ok, self.revision, {k: self._data.get(k) for k in txn.read})

    def lease_grant(self, ttl_s: int) -> int:
        with self._lock:
            self._request()
            self._next_lease += 1
            self._leases[self._next_lease] = _Lease(int(ttl_s), self._clock() + ttl_s)
            return self._next_lease

    def lease_keepalive(self, lease_id: int) -> int:
        with self._lock:
            self._request()
            lease = self._leases.get(lease_id)
            if lease is None:
                return 0
            lease.deadline = self._clock() + lease.ttl
            return lease.ttl

    def lease_revoke(self, lease_id: int) -> bool:
        with self._lock:
            self._request()
            if lease_id not in self._leases:
                return False
            self._revoke(lease_id)
            return True

    def expire_lease(self, lease_id: int) -> None:
        """The lease's TTL ran out (its holder stopped renewing, or was cut off from the store)."""
        with self._lock:
            if lease_id in self._leases:
                self._revoke(lease_id)

    def close(self) -> None:
        pass


class Flaky:
    """An :class:`EtcdModel` seen through a network: the next request may be lost before or after it applied."""

    def __init__(self, model: EtcdModel) -> None:
        self.model = model
        self.next_fault: str | None = None
        """``"lost"``: the request never arrived; ``"unanswered"``: it applied and its answer was lost;
        ``"retried"``: it applied, its answer was lost and the transport sent it again; ``"delayed"``: the
        caller gave up on it, and it applies later (:meth:`deliver`)."""
        self.pending: list[Callable[[], object]] = []
        self.skip = 0
        """Requests that pass unharmed before :attr:`next_fault` strikes."""

    def _through(self, call: Callable[[], object]) -> object:
        if self.next_fault is not None and self.skip > 0:
            self.skip -= 1  # the fault waits for a later request of the same operation
            return call()
        fault, self.next_fault = self.next_fault, None
        if fault == "lost":
            raise StoreUnavailableError("model: the request was lost")
        if fault == "unanswered":
            call()
            raise StoreUnavailableError("model: the answer was lost")
        if fault == "delayed":
            self.pending.append(call)
            raise StoreUnavailableError("model: no answer in time (the request is still on its way)")
        if fault == "retried":
            call()
        return call()

    def deliver(self) -> None:
        """The delayed requests arrive now, in order (each applies or fails as it would have then)."""
        pending, self.pending = self.pending, []
        for call in pending:
            try:
                call()
            except StoreRequestError:
                pass  # e.g. its lease is gone by now: etcd refuses it whole

    def txn(self, txn: Txn) -> TxnResult:
        result = self._through(lambda: self.model.txn(txn))
        assert isinstance(result, TxnResult)
        return result

    def __getattr__(self, name: str) -> object:
        return getattr(self.model, name)
