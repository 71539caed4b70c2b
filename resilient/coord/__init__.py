"""The control plane: a revisioned key-value store (etcd v3 or in-memory) and torch rendezvous over etcd.

* :mod:`.store`: the :class:`ControlStore` protocol, :class:`MemoryControlStore`
  (embedded default), and the store errors;
* :mod:`.etcd`: :class:`EtcdClient`, our standard-library etcd v3 client (key-value, leases), and
  :class:`EtcdControlStore`, the store protocol over it;
* :mod:`.etcd_transport`: how its requests reach etcd (failover, outage retries, auth, TLS);
* :mod:`.keyspace`: the name of every key the project keeps in the store, and their parsers;
* :mod:`.rendezvous`: torch elastic ``RendezvousBackend`` over etcd and
  :func:`create_etcd_rendezvous_handler`;
* :mod:`.etcd_store`: a torch c10d ``Store`` over etcd.

Names load their module on first use; importing this package imports
neither torch nor any backend.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..core.lazy import lazy_getattr

_EXPORTS = {
    "ControlStore": "resilient.coord.store",
    "ControlStoreError": "resilient.coord.store",
    "Entry": "resilient.coord.store",
    "EtcdControlStore": "resilient.coord.etcd",
    "MemoryControlStore": "resilient.coord.store",
    "StoreAuthError": "resilient.coord.store",
    "StoreRequestError": "resilient.coord.store",
    "StoreUnavailableError": "resilient.coord.store",
    "EtcdClient": "resilient.coord.etcd",
    "EtcdConfig": "resilient.coord.etcd",
    "EtcdTransport": "resilient.coord.etcd_transport",
    "create_etcd_rendezvous_handler": "resilient.coord.rendezvous",
    "make_etcd_rendezvous_backend": "resilient.coord.rendezvous",
    "make_etcd_c10d_store": "resilient.coord.etcd_store",
}

__all__ = [
    "ControlStore",
    "ControlStoreError",
    "Entry",
    "EtcdClient",
    "EtcdConfig",
    "EtcdControlStore",
    "MemoryControlStore",
    "StoreAuthError",
    "StoreRequestError",
    "StoreUnavailableError",
    "create_etcd_rendezvous_handler",
    "make_etcd_c10d_store",
    "make_etcd_rendezvous_backend",
]

__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())

if TYPE_CHECKING:
    from .etcd import EtcdClient, EtcdConfig, EtcdControlStore
    from .etcd_store import make_etcd_c10d_store
    from .rendezvous import create_etcd_rendezvous_handler, make_etcd_rendezvous_backend
    from .store import (
        ControlStore,
        ControlStoreError,
        Entry,
        MemoryControlStore,
        StoreAuthError,
        StoreRequestError,
        StoreUnavailableError,
    )
