"""The timing windows an agent has received and not yet scored: its own ranks' and, across machines, its peers'.

Windows are filed by (generation, window index).  :meth:`WindowTable.ready`
hands out, oldest first, two kinds of batch:

- **local**: a window every rank of this node reported (the slowdown
  detector's: the job's step time is the same on every node); each is also
  kept in the outbox, the newest :data:`OUTBOX_WINDOWS`, for the peers;
- **world**: a window every rank of the world reported (the straggler
  detector's), where ``world`` is the process group's size the windows
  carry; windows that do not say (an older runtime) are scored among this
  node's ranks.

A peer's windows (its outbox as read from the store) are filed beside this
node's own; a peer a generation ahead waits for this node to get there.
Windows a node marks disturbed (a spare of that node was warming up when it
completed them) are remembered, so the scorer leaves them out
(:meth:`WindowTable.disturbed`).  A
window some rank never reports is dropped once a later one is handed out,
and at most :data:`PENDING_WINDOWS` wait.  Thread-safe: windows arrive on
the receivers' and the peer watch's threads, batches leave on the watch
loop.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from ..watchdog.timing import RankWindow, parse_window, window_payload

PENDING_WINDOWS = 64
"""Windows kept waiting for their last rank; older ones are dropped."""
OUTBOX_WINDOWS = 16
"""This node's newest windows offered to its peers (the peer watch publishes once a second: 16 windows of 5
steps cover a second of 12 ms steps)."""

Batch = dict[int, RankWindow]
"""One window of several ranks: rank -> its window."""


class WindowTable:
    """Timing windows by generation and index, handed out once complete."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self._lock = threading.Lock()
        self._pending: dict[tuple[int, int], Batch] = {}
        self._generation: int | None = None
        self._done_world = -1
        self._done_local = -1
        self._outbox: deque[tuple[Batch, bool]] = deque(maxlen=OUTBOX_WINDOWS)
        self._disturbed: set[tuple[int, int]] = set()
        """(generation, window) some node completed while a spare of its own warmed up."""
        self._peer_upto: dict[str, tuple[int, int]] = {}
        """Per peer node, the (generation, window) up to which its windows were taken (peer watch thread only)."""
        self.malformed = 0
        """Windows refused (a malformed report of a rank here, or of a peer's)."""

    def start(self, generation: int) -> None:
        """A new generation: what was pending for earlier ones is dropped, the outbox emptied."""
        with self._lock:
            self._generation, self._done_world, self._done_local = generation, -1, -1
            self._outbox.clear()
            for key in [k for k in self._pending if k[0] < generation]:
                del self._pending[key]
            self._disturbed = {k for k in self._disturbed if k[0] >= generation}

    def file(self, generation: int, window: RankWindow) -> None:
        """One window of a rank of this node."""
        with self._lock:
            self._file(generation, window)

    def refused(self) -> None:
        with self._lock:
            self.malformed += 1

    def _file(self, generation: int, window: RankWindow) -> None:
        self._pending.setdefault((generation, window.window), {}).setdefault(window.rank, window)
        if len(self._pending) > PENDING_WINDOWS:
            del self._pending[min(self._pending)]

    def ready(self, generation: int, ranks: Collection[int], disturbed: bool = False) -> tuple[list[Batch], list[Batch]]:
        """The world batches and the local batches of ``generation`` complete since the last call, oldest first;
        ``ranks``: this node's live ranks; ``disturbed``: the local windows completing now are marked so."""
        local, world_batches, local_batches = set(ranks), [], []
        with self._lock:
            for key in sorted(k for k in self._pending if k[0] == generation):
                ws = self._pending[key]
                if not local or not local <= set(ws):
                    continue
                if key[1] > self._done_local:
                    local_batches.append({r: ws[r] for r in local})
                    self._done_local = key[1]
                    self._outbox.append((local_batches[-1], disturbed))
                    if disturbed:
                        self._disturbed.add(key)
                world = max((w.world or 0 for w in ws.values()), default=0)
                if key[1] > self._done_world and len(ws) >= max(world, len(local)):
                    world_batches.append(dict(ws) if world else {r: ws[r] for r in local})
                    self._done_world = key[1]
            done = min(self._done_world, self._done_local)
            for key in [k for k in self._pending if k[0] < generation or (k[0] == generation and k[1] <= done)]:
                del self._pending[key]
        return world_batches, local_batches

    # ------------------------------------------------------------ across machines (the peer watch's thread)
    def outbox(self) -> dict[str, Any] | None:
        """This node's newest windows, for its peers (:meth:`take_peers`); None before any."""
        with self._lock:
            if self._generation is None or not self._outbox:
                return None
            record: dict[str, Any] = {
                "node": self.node_id, "generation": self._generation,
                "windows": [[r, window_payload(w)] for ws, _ in self._outbox for r, w in sorted(ws.items())]}
            marked = [min(w.window for w in ws.values()) for ws, disturbed in self._outbox if disturbed]
            if marked:
                record["disturbed"] = marked
            return record

    def disturbed(self, generation: int, window: int) -> bool:
        """Some node completed this window while a spare of its own warmed up (not to be scored for stragglers)."""
        with self._lock:
            return (generation, window) in self._disturbed

    def take_peers(self, records: Iterable[Mapping[str, Any]]) -> None:
        """File the windows of the other nodes' ranks (their :meth:`outbox` records, read from the store)."""
        for record in records:
            node, generation = record.get("node"), record.get("generation")
            if not isinstance(node, str) or node == self.node_id or not isinstance(generation, int):
                continue
            taken_gen, taken = self._peer_upto.get(node, (generation, -1))
            newest = taken if taken_gen == generation else -1
            top = newest
            marked = record.get("disturbed") or ()
            with self._lock:  # before the windows: a batch they complete is known disturbed when handed out
                self._disturbed.update((generation, int(w)) for w in marked if isinstance(w, int))
            for item in record.get("windows") or ():
                try:
                    rank, payload = item
                    if int(payload["w"]) <= newest:
                        continue
                    window = parse_window(int(rank), node, payload)
                except (TypeError, ValueError, KeyError):
                    self.refused()
                    continue
                top = max(top, window.window)
                with self._lock:  # a peer may be a generation ahead: its windows wait for this node's poll
                    current = self._generation
                    if current is None or generation > current or \
                            (generation == current and window.window > self._done_world):
                        self._file(generation, window)
            self._peer_upto[node] = (generation, top)
