"""A torch c10d ``Store`` over etcd v3, for torch elastic rendezvous.

``DynamicRendezvousHandler`` hands a c10d store to the agent (wrapped in a
``PrefixStore`` per round); torch uses it to publish the master address and
port (``set``/``get``) and, in its barriers, ``add``/``wait``/``multi_get``.
This store keeps each c10d key under an etcd prefix and follows TCPStore's
semantics: ``get``/``wait``/``multi_get`` block until the keys exist or the
store timeout passes (then ``DistStoreError``, as TCPStore raises);
``compare_set`` returns the value after the operation.

Blocking reads poll with backoff from 5 ms to at most 100 ms rather than
watch: a watch through the JSON gateway is a long-lived stream, polling is
simpler and the control plane is not latency-critical.

The class subclasses ``torch.distributed.Store``, so it is built on first use
(``make_etcd_c10d_store`` or the module attribute ``EtcdC10dStore``) and
importing this module does not import torch.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ..core.errors import ResilientError
from .etcd import EtcdClient, EtcdControlStore
from .store import ControlStore

if TYPE_CHECKING:
    from torch.distributed import Store

POLL_INITIAL_S = 0.005
POLL_MAX_S = 0.1


def _to_bytes(value: str | bytes | Sequence[int]) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


@functools.cache
def _store_class() -> type:
    import torch.distributed as dist

    class EtcdStoreTimeoutError(ResilientError, dist.DistStoreError):
        """Keys did not appear in the etcd c10d store before the timeout (a ``DistStoreError``, as TCPStore)."""

    class EtcdC10dStore(dist.Store):
        """c10d keys under an etcd prefix; see the module docstring for semantics."""

        TimeoutError = EtcdStoreTimeoutError

        def __init__(
            self,
            client: EtcdClient,
            prefix: str,
            timeout: timedelta | None = None,
            *,
            clock: Callable[[], float] = time.monotonic,
            sleep: Callable[[float], None] = time.sleep,
        ) -> None:
            super().__init__()  # required by the pybind trampoline
            self._kv: ControlStore = EtcdControlStore(client, prefix)
            self._clock = clock
            self._sleep = sleep
            if timeout is not None:
                self.set_timeout(timeout)

        def set(self, key: str, value: str | bytes) -> None:
            self._kv.put(key, _to_bytes(value))

        def get(self, key: str) -> bytes:
            return self._wait_values([key], None)[0]

        def multi_get(self, keys: list[str]) -> list[bytes]:
            return self._wait_values(keys, None)

        def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
            for key, value in zip(keys, values, strict=True):
                self.set(key, value)

        def add(self, key: str, value: int) -> int:
            return self._kv.add(key, int(value))

        def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
            expected, desired = _to_bytes(expected_value), _to_bytes(desired_value)
            while True:
                entry = self._kv.get(key)
                if entry is None and expected:
                    return expected  # TCPStore answers the expected value for a missing key
                if entry is not None and entry.value != expected:
                    return entry.value
                ok, _ = self._kv.compare_and_swap(key, 0 if entry is None else entry.mod_revision, desired)
                if ok:
                    return desired

        def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
            self._wait_values(keys, timeout)

        def check(self, keys: list[str]) -> bool:
            return all(self._kv.get(key) is not None for key in keys)

        def delete_key(self, key: str) -> bool:
            return self._kv.delete(key)

        def num_keys(self) -> int:
            return len(self._kv.get_prefix(""))

        def _wait_values(self, keys: Sequence[str], timeout: timedelta | None) -> list[bytes]:
            limit = (self.timeout if timeout is None else timeout).total_seconds()  # type: ignore[attr-defined]
            deadline = self._clock() + limit
            delay = POLL_INITIAL_S
            found: dict[str, bytes] = {}
            while True:
                for key in keys:
                    if key not in found:
                        entry = self._kv.get(key)
                        if entry is not None:
                            found[key] = entry.value
                if len(found) == len(keys):
                    return [found[key] for key in keys]
                left = deadline - self._clock()
                if left <= 0:
                    missing = [k for k in keys if k not in found]
                    raise EtcdStoreTimeoutError(
                        f"wait timeout after {limit * 1000:.0f}ms, keys: {missing} in the etcd c10d store; "
                        "the peer that should set them has not (crashed, or still starting): raise the timeout "
                        "or look at that peer"
                    )
                self._sleep(min(delay, left))
                delay = min(delay * 2, POLL_MAX_S)

    return EtcdC10dStore


def make_etcd_c10d_store(
    client: EtcdClient,
    prefix: str,
    timeout: timedelta | None = None,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Store:
    """A c10d store keeping its keys under etcd key ``prefix``; ``timeout`` bounds blocking reads, measured on
    ``clock``, between whose polls it waits with ``sleep``."""
    store: Store = _store_class()(client, prefix, timeout, clock=clock, sleep=sleep)
    return store


def __getattr__(name: str) -> Any:
    if name == "EtcdC10dStore":
        return _store_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
