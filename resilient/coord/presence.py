"""Presence: each agent of a launch keeps a key alive on a lease, and notices when a peer's key dies.

An agent writes ``<prefix><node>`` = ``{"state": "running"}`` attached to an
etcd lease of ``ttl_s`` seconds and renews the lease every ``interval_s``.
A node whose agent dies (killed, machine gone, cut off) stops renewing, and
etcd deletes its key ``ttl_s`` later: the survivors, which follow the keys
through an etcd watch (no request while nothing changes), see a node that
was running disappear and report it as lost.
An agent that ends normally first rewrites its key as ``{"state": "left"}``
without a lease, so leaving is never mistaken for being lost.

:func:`lost_nodes` is the pure rule; :class:`Presence` is the thread.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping

from .etcd import EtcdClient
from .store import ControlStoreError
from .watch import PrefixWatch


def lost_nodes(before: Mapping[str, str], now: Mapping[str, str], me: str) -> list[str]:
    """Nodes that were running in ``before`` and have no key in ``now`` (their lease expired); never ``me``."""
    return sorted(n for n, state in before.items() if state == "running" and n not in now and n != me)


class Presence:
    """Keeps this node's presence key alive (a daemon thread) and reports peers whose key expired (a watch)."""

    def __init__(self, client: EtcdClient, prefix: str, node: str, on_lost: Callable[[str], None],
                 on_error: Callable[[str], None], *, watch: PrefixWatch, ttl_s: int = 5,
                 interval_s: float = 1.0) -> None:
        """``watch``: a started watch of a prefix that holds ``prefix`` (the agent's, shared with its other
        readers)."""
        if ttl_s < 2 or not 0 < interval_s < ttl_s:
            raise ValueError(f"presence needs ttl_s >= 2 and 0 < interval_s < ttl_s, got {ttl_s}, {interval_s}")
        self._client = client
        self._prefix = prefix
        self._node = node
        self._on_lost = on_lost
        self._on_error = on_error
        self._ttl = ttl_s
        self._interval = interval_s
        self._lease = 0
        self._seen: dict[str, str] = {}
        self._judging = threading.Lock()
        self._watch = watch
        watch.subscribe(self._judge)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="presence", daemon=True)

    def start(self) -> None:
        """Write the presence key, start following the peers' keys and renewing this one."""
        self._announce()
        self._judge()
        self._thread.start()

    @property
    def lease(self) -> int:
        """The lease this node's presence key lives on (a new one after an outage outlived it)."""
        return self._lease

    def _announce(self) -> None:
        self._lease = self._client.lease_grant(self._ttl)
        self._client.put(self._prefix + self._node, json.dumps({"state": "running"}).encode(), lease=self._lease)

    def _judge(self) -> None:
        """Compare the peers' keys with the last look: a node that was running and has no key now is lost."""
        found = {}
        for key, entry in self._watch.view().under(self._prefix).items():
            try:
                found[key[len(self._prefix):]] = str(json.loads(entry.value).get("state"))
            except (ValueError, AttributeError):
                continue
        with self._judging:
            lost = lost_nodes(self._seen, found, self._node)
            self._seen = found
        for node in lost:
            self._on_lost(node)

    def _loop(self) -> None:
        while not self._done.wait(self._interval):
            try:
                if self._client.lease_keepalive(self._lease) <= 0:
                    self._announce()  # our own lease expired (a long outage): we are back
            except ControlStoreError as e:
                self._on_error(f"{type(e).__name__}: {e}")

    def leave(self) -> None:
        """Stop renewing and mark this node as gone on purpose."""
        self._done.set()
        self._watch.unsubscribe(self._judge)
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        try:
            self._client.put(self._prefix + self._node, json.dumps({"state": "left"}).encode())
            if self._lease:
                self._client.lease_revoke(self._lease)
        except ControlStoreError as e:
            self._on_error(f"{type(e).__name__}: {e}")
