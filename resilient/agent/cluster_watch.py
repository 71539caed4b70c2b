"""Across machines, how an agent follows the launch's recovery keys (:mod:`resilient.agent.cluster`).

:class:`ClusterWatch` reads them from the agent's etcd watch, not by polling, and
gives the watch loop a :class:`Snapshot`; :class:`ClusterState` is what an
agent keeps while it follows a launch (:meth:`InProcess.follow_launch
<resilient.agent.inproc.InProcess.follow_launch>` starts and stops it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from ..coord.store import ControlStoreError, Entry
from ..core.supervised import ThreadReports
from .cluster import ClusterStore, GenerationView, Involvement, PoolEntry


@dataclass(frozen=True)
class Snapshot:
    """The launch's recovery keys as the watches hold them: ``current`` and the generation's keys from one
    revision (a decision and ``rec/current`` are written in one transaction, so a snapshot that shows a newer
    generation also shows the decision that led there)."""

    current: int | None
    view: GenerationView
    pool: tuple[PoolEntry, ...]
    live: frozenset[str]
    running: frozenset[str] = frozenset()
    """Nodes whose presence key says running: alive and reaching the store."""


class ClusterWatch:
    """Follows the launch's recovery keys, its pool and its nodes' presence in the agent's watch of the run's
    launches (``store.watch``, a :class:`~resilient.coord.watch.PrefixWatch`): no request while nothing
    changes.  A change wakes the watch loop, which reads :attr:`snapshot`.  Its thread keeps the store's
    lease as it should be (a request a second only when the store renews a lease of its own)."""

    def __init__(self, store: ClusterStore, generation: Callable[[], int], wake: Callable[[], None],
                 on_error: Callable[[str], None], keepalive_s: float = 1.0,
                 threads: ThreadReports | None = None) -> None:
        assert store.watch is not None, "across machines the agent's watch of its launches is started first"
        self._store = store
        self._generation = generation
        self._wake = wake
        self._on_error = on_error
        self._keepalive = keepalive_s
        self._watch = store.watch
        # Woken by its own keys only: the launch's other keys (its verdict, stop, restart records) are read on
        # the watch loop's own cadence.
        keys = store.keys
        self._watch.subscribe(wake, under=tuple(store.root + p for p in (keys.recovery(), keys.pool(), keys.nodes())))
        self._lock = threading.Lock()
        self._cached: tuple[tuple[int, int], Snapshot] | None = None
        self._done = threading.Event()
        self._thread = (threads or ThreadReports()).run("cluster-watch", self._loop, stop=self._done)

    def _loop(self) -> None:
        while not self._done.is_set():
            try:
                self._store.keep_pool_alive()
            except (ControlStoreError, OSError, ValueError) as e:
                self._on_error(f"{type(e).__name__}: {e}")
            self._done.wait(self._keepalive)

    def decisions(self) -> list[dict[str, Any]]:
        """Every generation's decision in the launch, as the watch holds them (verified)."""
        store = self._store
        cut = len(store.root)
        found = [replace(e, key=k[cut:]) for k, e in self._watch.view().entries.items()
                 if store.keys.is_decision(k[cut:])]
        return list(store.signed.verified(found).values())

    @property
    def snapshot(self) -> Snapshot | None:
        """The keys as the watches hold them now, for the generation followed now (None before they started)."""
        if not self._watch.running:
            return None
        generation = self._generation()
        view = self._watch.view()
        key = (generation, view.revision)
        with self._lock:
            if self._cached is not None and self._cached[0] == key:
                return self._cached[1]
        store = self._store
        cut = len(store.root)
        keys = store.keys
        base, current_key = keys.recovery_of(generation), keys.current()
        pool_prefix, nodes_prefix = keys.pool(), keys.nodes()
        rec: list[Entry] = []
        pool: list[Entry] = []
        nodes: list[Entry] = []
        for k, e in view.entries.items():
            relative = k[cut:]
            if relative.startswith(base) or relative == current_key:
                rec.append(replace(e, key=relative))
            elif relative.startswith(pool_prefix):
                pool.append(replace(e, key=relative))
            elif relative.startswith(nodes_prefix):
                nodes.append(replace(e, key=relative))
        values = store.signed.verified(rec)
        current = values.get(current_key)
        snapshot = Snapshot(int(current["generation"]) if current is not None else None,
                            store.view_of(generation, values), tuple(store.pool_of(pool)),
                            frozenset(store.live_of(nodes)), frozenset(store.running_of(nodes)))
        with self._lock:
            self._cached = (key, snapshot)
        return snapshot

    def close(self) -> None:
        self._done.set()
        self._watch.unsubscribe(self._wake)
        self._thread.join(timeout=10)


@dataclass
class ClusterState:
    """What this agent keeps about the launch's recovery across machines (on :attr:`InProcess.cluster`)."""

    store: ClusterStore
    watch: ClusterWatch | None = None
    """Its keys as the agent's watch holds them (:mod:`resilient.agent.cluster_watch`)."""
    following: int = 0
    """The generation this node follows (members or not)."""
    world_size: int = 0
    full_size: int = 0
    involved: dict[int, Involvement] = field(default_factory=dict)
    relayed: set[tuple[int, str]] = field(default_factory=set)
    opted_in_published: int = -1
    orphaned_since: float | None = None
    nodes_read: tuple[int, float, GenerationView] | None = None
    """The generation's nodes as last read from the store (generation, when, the view read): their keys are
    outside the watch (:meth:`ClusterStore.reports`)."""
    places_claimed: int = -1
    """A spare node: the newest generation whose lost nodes' places in the restart were all claimed (by other
    spare nodes): not asked again."""

    def close(self) -> None:
        """Stop following the launch: its watch and its store."""
        if self.watch is not None:
            self.watch.close()
        self.store.close()

    def with_nodes(self, view: GenerationView, now: float, every_s: float) -> GenerationView:
        """``view`` with its nodes' members, read from the store at most every ``every_s``; once every rank is
        there and every node opted in they no longer change, and are kept for the generation."""
        read = self.nodes_read
        if read is not None and read[0] == view.generation:
            kept = read[2]
            settled = kept.complete() and all(n.get("opted_in") for n in kept.nodes.values())
            if settled or now - read[1] < every_s:
                return replace(view, nodes=kept.nodes)
        fresh = self.store.reports(view)
        self.nodes_read = (view.generation, now, fresh)
        return replace(view, nodes=fresh.nodes)
