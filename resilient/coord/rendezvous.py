"""torch elastic rendezvous over etcd v3: a ``RendezvousBackend`` and a ready handler.

torch's ``DynamicRendezvousHandler`` keeps the whole rendezvous state in one
opaque blob and needs a backend that stores it with compare-and-set.  Ours
keeps the blob under ``<key_prefix>/<run_id>`` and uses the key's etcd
``mod_revision`` as the fencing token: a write succeeds only if nobody wrote
since the writer's last read.  (torch ships an etcd *v2* backend; etcd 3.4+
disables v2 by default, hence this one.)

torch is imported only when a backend or handler is built, never at module
import: ``EtcdRendezvousBackend`` is resolved lazily by the module
``__getattr__`` (the class subclasses torch's ``RendezvousBackend``, so it
cannot exist before torch is imported); ``make_etcd_rendezvous_backend`` and
``create_etcd_rendezvous_handler`` are plain functions.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from .etcd import EtcdClient, EtcdConfig, OutageCallback
from .keyspace import TORCH_STATE, TORCH_STATES, c10d, rendezvous_space, run_root, torch_state
from .store import ControlStoreError, StoreUnavailableError

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, RendezvousBackend

DEFAULT_KEY_PREFIX = TORCH_STATES
BACKEND_NAME = "resilient-etcd-v3"


@functools.cache
def _backend_class() -> type:
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend

    class EtcdRendezvousBackend(RendezvousBackend):
        """Holds torch's rendezvous state in etcd v3; the fencing token is the key's ``mod_revision``.

        ``ttl_s``: when set, the state is attached to a lease so that it
        disappears ``ttl_s`` (at least ``ttl_s / 2``) seconds after the last
        write; ``None`` keeps it until deleted.
        """

        def __init__(
            self,
            client: EtcdClient,
            run_id: str,
            key_prefix: str = DEFAULT_KEY_PREFIX,
            ttl_s: int | None = None,
            *,
            clock: Callable[[], float] = time.monotonic,
        ) -> None:
            if not run_id or "/" in run_id:
                raise ValueError(f"run id {run_id!r} is invalid: use a non-empty name without '/'")
            if ttl_s is not None and ttl_s < 2:
                raise ValueError(f"ttl_s={ttl_s} is too short for a rendezvous state: use >= 2 s or None")
            self._client = client
            self.key = torch_state(key_prefix, run_id)
            self._ttl_s = ttl_s
            self._clock = clock
            self._lease = 0
            self._lease_at = 0.0
            self._lease_lock = threading.Lock()

        @property
        def name(self) -> str:
            """See base class."""
            return BACKEND_NAME

        def get_state(self) -> tuple[bytes, Any] | None:
            """See base class."""
            entry = self._guard(lambda: self._client.get(self.key))
            return None if entry is None else (entry.value, entry.mod_revision)

        def set_state(self, state: bytes, token: Any | None = None) -> tuple[bytes, Any, bool] | None:
            """See base class."""
            if token is None:
                ok, entry = self._guard(lambda: self._client.put_if_absent(self.key, state, lease=self._lease_id()))
                return entry.value, entry.mod_revision, ok
            try:
                revision = int(token)
            except (TypeError, ValueError):
                revision = 0
            if revision <= 0:  # a token we never issued cannot match
                current = self.get_state()
                return None if current is None else (*current, False)
            done, seen = self._guard(
                lambda: self._client.compare_and_swap(self.key, revision, state, lease=self._lease_id())
            )
            return None if seen is None else (seen.value, seen.mod_revision, done)

        def _lease_id(self) -> int:
            """A lease granted at most ttl/2 ago, so a write keeps the state for at least ttl/2."""
            if self._ttl_s is None:
                return 0
            with self._lease_lock:
                if self._lease == 0 or self._clock() - self._lease_at > self._ttl_s / 2:
                    self._lease = self._client.lease_grant(self._ttl_s)
                    self._lease_at = self._clock()
                return self._lease

        def _guard(self, op: Callable[[], Any]) -> Any:
            try:
                return op()
            except StoreUnavailableError as e:
                raise RendezvousConnectionError(f"the rendezvous store is unreachable: {e}") from e
            except ControlStoreError as e:
                raise RendezvousConnectionError(f"the rendezvous store failed: {e}") from e

    return EtcdRendezvousBackend


def make_etcd_rendezvous_backend(
    client: EtcdClient, run_id: str, key_prefix: str = DEFAULT_KEY_PREFIX, ttl_s: int | None = None
) -> RendezvousBackend:
    """An ``EtcdRendezvousBackend`` holding run ``run_id``'s state under ``key_prefix``."""
    backend: RendezvousBackend = _backend_class()(client, run_id, key_prefix, ttl_s)
    return backend


def __getattr__(name: str) -> Any:
    if name == "EtcdRendezvousBackend":
        return _backend_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def create_etcd_rendezvous_handler(
    etcd_config: EtcdConfig,
    run_id: str,
    min_nodes: int,
    max_nodes: int,
    local_addr: str | None = None,
    join_timeout_s: float = 600.0,
    last_call_s: float = 30.0,
    close_s: float = 30.0,
    keep_alive_interval_s: float = 5.0,
    keep_alive_max_attempt: int = 3,
    *,
    store_timeout_s: float = 300.0,
    on_outage: OutageCallback | None = None,
    client: EtcdClient | None = None,
    launch_id: str | None = None,
) -> DynamicRendezvousHandler:
    """A torch ``DynamicRendezvousHandler`` whose state and c10d store live in etcd.

    With ``launch_id`` the rendezvous belongs to that launch of the run: its
    state is ``<rendezvous_space>rdzv`` and the store given to the handler
    (used to publish the master address) is under ``<rendezvous_space>c10d/``
    (:func:`~resilient.coord.keyspace.rendezvous_space`), so a rendezvous
    closed when one launch ended cannot refuse the next.  Without it (a rendezvous
    outside a run's launches) the state is ``/resilient/rdzv/<run_id>`` and
    the store ``/resilient/<run_id>/c10d/``.  ``client`` defaults to a new
    :class:`EtcdClient` over ``etcd_config`` reporting outages to ``on_outage``.
    """
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, RendezvousTimeout

    from .etcd_store import make_etcd_c10d_store

    if not 1 <= min_nodes <= max_nodes:
        from ..core.errors import ConfigError

        raise ConfigError(f"nodes {min_nodes}:{max_nodes} are invalid: need 1 <= min_nodes <= max_nodes")
    if client is None:
        client = EtcdClient(etcd_config, on_outage=on_outage)
    if launch_id is None:
        backend = make_etcd_rendezvous_backend(client, run_id)
        space, torch_run_id = run_root(run_id), run_id
    else:
        space, torch_run_id = rendezvous_space(run_id, launch_id), f"{run_id}.{launch_id}"
        backend = make_etcd_rendezvous_backend(client, TORCH_STATE, key_prefix=space)
    store = make_etcd_c10d_store(client, c10d(space), timedelta(seconds=store_timeout_s))
    timeout = RendezvousTimeout(
        join=timedelta(seconds=join_timeout_s),
        last_call=timedelta(seconds=last_call_s),
        close=timedelta(seconds=close_s),
    )
    return DynamicRendezvousHandler.from_backend(
        torch_run_id,
        store,
        backend,
        min_nodes,
        max_nodes,
        local_addr=local_addr,
        timeout=timeout,
        # torch annotates int but only builds timedelta(seconds=...) from it, which takes floats
        keep_alive_interval=keep_alive_interval_s,  # type: ignore[arg-type]
        keep_alive_max_attempt=keep_alive_max_attempt,
    )
