"""A copy of each node's memory tier on one peer node (``--memory-replicas 1``).

A node lost with its agent takes its memory tier with it: the restart that
follows would read the durable tier and do again every step since its last
commit.  With a copy on a peer node it restores a step of the memory tier.

* **Pinned steps.**  Every rank saves the multiples of ``pin_every`` in its
  memory tier's pinned slots (:data:`~resilient.checkpoint.memory.PINNED`,
  ``RESILIENT_MEMORY_PIN_EVERY``), which the other saves never overwrite:
  the same steps on every node, so a copy matches steps the survivors still
  hold.
* **Copies.**  Each agent serves its tier (:mod:`.memory_peers`) and copies
  its ring predecessor's newest pinned step (the current round's node
  order), every file of it, into ``replicas/<node>/`` of its own tier,
  never over the newest step it holds whole, and only while the node's own
  saves keep the room they take at most.
* **Staging.**  Before a generation's workers start, the agent makes sure its
  tier holds the files of the ranks this node now runs.  The ranks another
  node ran in the round before (a node was lost and the order moved up, or
  this node is new) are fetched from that node, at the newest step all its
  files hold and its newest pinned one; from the copy its ring successor
  kept, its two newest, when that node is gone; the replicated state, on a
  node new to the run, from a peer at the steps of the ranks staged.  The
  workers' restore then agrees on a step every rank holds
  (:func:`~resilient.checkpoint.memory.restore_memory`), or falls back to the
  durable tier.  A lost node's copy is kept until the round after, since
  other nodes may still be staging from it.

Everything is counted against the node's memory limit.  A copy without room
is not made, and the agent says so once until a copy succeeds again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import mmap
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..checkpoint import memory as mem
from ..core.events import Emit, EventKind
from ..core.supervised import Supervised, ThreadReports
from .memory_peers import (
    COPY_SLOTS,
    OWN,
    REPLICAS,
    Cancelled,
    Fill,
    PeerTier,
    TierServer,
    Version,
    common,
    free_pinned,
    local_fill,
    node_stems,
    place,
    records_in,
    stems_in,
)

PIN_EVERY = 10
"""Steps between pinned steps when ``--memory-pin-every`` is not given."""
POLL_S = 0.25
"""The least time between two looks at the predecessor's tier (each look waits there up to ``WAIT_S`` for its
pinned steps to change, so a new one is seen within a few tens of milliseconds)."""
WAIT_S = 2.0
STAGE_S = 60.0
"""A restart's staging gives up on what it has not fetched after this long (those ranks restore from the
durable tier)."""
PUBLISHED_AS = "memory"
"""The presence key's field with the address an agent serves its tier on."""
_FAILURES = (OSError, ValueError, KeyError, TypeError, http.client.HTTPException)


@dataclasses.dataclass
class Copy:
    """What this node keeps of its predecessor's tier."""

    node: str
    version: Version
    bytes: int
    seconds: float


@dataclasses.dataclass
class Source:
    """Where a restart's staging reads one node's files: the node itself, or the copy another kept."""

    name: str
    offered: dict[str, list[mem.SlotRecord]]
    fill: Callable[[mem.SlotRecord], Fill]


class MemoryReplication:
    """This node's side of ``--memory-replicas 1``: serve the tier, copy the predecessor's, stage a restart's."""

    def __init__(self, root: Path, limit: int, *, node: str, host: str, token: str, nproc: int, emit: Emit,
                 address_of: Callable[[str], str | None], live: Callable[[], frozenset[str]],
                 poll_s: float = POLL_S, threads: ThreadReports | None = None) -> None:
        """``threads``: where the copying thread reports an error it did not expect (it is then started again)."""
        self.root = root
        self.limit = limit
        self.node = node
        self.nproc = nproc
        self._token = token
        self._emit = emit
        self._address_of = address_of
        self._live = live
        self.poll_s = poll_s
        self.server = TierServer(root, host, token)
        self._serving = False
        self._lock = threading.Lock()
        self._members: tuple[str, ...] = ()
        self._kept: set[str] = set()
        """Copies kept besides the predecessor's: the one before's, which other nodes may still be staging from."""
        self.copy: Copy | None = None
        self._seen: tuple[str, str] | None = None
        """(predecessor, the state of its pinned manifests) as the newest look found it."""
        self._said: set[str] = set()
        self._done = threading.Event()
        self._reports = threads or ThreadReports()
        self._thread: Supervised | None = None

    @property
    def address(self) -> str:
        return self.server.address

    def serve(self) -> None:
        """Answer the peers' requests (once)."""
        if not self._serving:
            self._serving = True
            self.server.start()

    def start(self) -> None:
        """Serve, and copy the predecessor's pinned steps as they come."""
        self.serve()
        if self._thread is None:
            self._thread = self._reports.run("memory-replica", self._loop, stop=self._done)

    def close(self) -> None:
        """Stop copying (a copy in flight stops at its next read) and serving; again: nothing."""
        self._done.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout=5.0)
        if self._serving:
            self._serving = False
            self.server.close()

    def view(self) -> dict[str, Any]:
        """``resilient status``'s ``memory.replica`` entry."""
        copy = self.copy
        return {"serving": self.address, "copy_of": copy.node if copy else None,
                "copy_step": copy.version[0] if copy else None, "copy_bytes": copy.bytes if copy else 0}

    def follow(self, members: Sequence[str]) -> None:
        """The round this node runs in now (its node order names the predecessor)."""
        with self._lock:
            if tuple(members) != self._members:
                before = self._predecessor(self._members)
                self._kept = {before[0]} if before is not None else set()
                self._members = tuple(members)

    def _predecessor(self, members: tuple[str, ...]) -> tuple[str, int] | None:
        if self.node not in members or len(members) < 2:
            return None
        at = (members.index(self.node) - 1) % len(members)
        return members[at], at

    def _peer(self, node: str, timeout_s: float | None = None) -> PeerTier | None:
        address = self._address_of(node)
        if not address:
            return None
        return PeerTier(address, self._token) if timeout_s is None else PeerTier(address, self._token, timeout_s)

    def _say_once(self, key: str, why: str) -> None:
        if key not in self._said:
            self._said.add(key)
            self._emit(EventKind.MEMORY_REPLICA_FAILED, reason=why)

    # ------------------------------------------------------------ copying the predecessor's pinned steps
    def _loop(self) -> None:
        while not self._done.is_set():
            started = time.monotonic()
            with self._lock:
                found = self._predecessor(self._members)
            name = found[0] if found is not None else "-"
            try:
                self.pull()
            except Cancelled:
                return
            except mem.NoRoom as e:
                self._say_once(f"room:{name}", f"no room for the copy of {name}'s memory tier: {e}")
            except _FAILURES as e:
                self._say_once(f"{type(e).__name__}:{name}", f"copying {name}'s memory tier failed: "
                               f"{type(e).__name__}: {e} (tried again every {self.poll_s} s; said once until a "
                               "copy succeeds)")
            # A look waits at the peer until its pinned steps change; one that came back at once waits here.
            self._done.wait(max(0.02, self.poll_s - (time.monotonic() - started)))

    def pull(self) -> Copy | None:
        """Copy the predecessor's newest pinned step, when newer than the copy held; returns the new copy."""
        with self._lock:
            found, mine = self._predecessor(self._members), self._position()
        if found is None or mine is None:
            return None
        node, at = found
        if node not in self._live():
            return None  # lost: the copy held is what the restart stages from
        peer = self._peer(node)
        if peer is None:
            self._say_once(f"address:{node}", f"{node} publishes no address for its memory tier (an agent "
                           "without --memory-replicas 1?): no copy of it is kept")
            return None
        seen = self._seen
        own, _ = peer.index(seen[1], WAIT_S) if seen is not None and seen[0] == node else peer.index()
        stems = node_stems(at, self.nproc)
        pinned = {stem: [r for r in own.get(stem, []) if r.slot in mem.PINNED] for stem in stems}
        versions = common(pinned, stems)
        held = self.copy
        if not versions or (held is not None and held.node == node and held.version >= versions[0]):
            self._seen = (node, peer.pinned)
            return None
        version = versions[0]
        directory = self.root / REPLICAS / node
        have = records_in(directory, COPY_SLOTS) if directory.is_dir() else {}
        whole = frozenset(common(have, stems)[:1])  # the newest step held whole: never written over
        plan = []
        for stem in stems:
            if version in {(r.step, r.generation) for r in have.get(stem, [])}:
                continue  # copied by an earlier pass that stopped midway
            record = next(r for r in pinned[stem] if (r.step, r.generation) == version)
            plan.append((record, free_pinned(have.get(stem, []), whole, COPY_SLOTS)))
        if not self._room_for(mine, directory, plan):
            self._seen = (node, peer.pinned)  # looked at again when its pinned steps change
            return None
        started = time.monotonic()
        for record, slot in plan:
            if self._done.is_set():
                raise Cancelled(f"copying {node}'s step {version[0]}")
            place(self.root, self.limit, directory, record, slot, peer.fill(OWN, record, self._done.is_set))
        copy = Copy(node, version, sum(r.size for r, _ in plan), time.monotonic() - started)
        self._seen = (node, peer.pinned)
        first = held is None or held.node != node
        self.copy = copy
        self._said.clear()  # a failure after this one is said again
        if first:  # once per predecessor; the copies after it are in status
            self._emit(EventKind.MEMORY_REPLICA_HELD, peer=node, step=version[0], generation=version[1],
                       bytes=copy.bytes, seconds=round(copy.seconds, 3))
        self._drop_copies(keep={node} | self._kept)
        return copy

    def _position(self) -> int | None:
        return self._members.index(self.node) if self.node in self._members else None

    def _room_for(self, mine: int, directory: Path, plan: list[tuple[mem.SlotRecord, int]]) -> bool:
        """Whether the copy leaves this node's own saves the room they take at most (every slot of each of its
        files at its newest size); NoRoom when it would not; False before this node's first saves."""
        own = records_in(self.root)
        stems = node_stems(mine, self.nproc)
        if any(stem not in own for stem in stems[:-1]):
            return False  # this node's ranks have not saved yet: their need is unknown
        need = sum(_pages(max(r.size for r in own[s])) * len(mem.ALL_SLOTS) for s in stems if s in own)
        replaced = 0
        for record, slot in plan:
            with contextlib.suppress(OSError):
                replaced += (directory / f"{record.stem}.{slot}.shard").stat().st_blocks * 512
        copies = mem.usage(self.root / REPLICAS) - replaced + sum(_pages(r.size) for r, _ in plan)
        if need + copies > self.limit:
            raise mem.NoRoom(f"the copy would hold {copies} bytes and this node's own saves take up to {need}, "
                             f"over the limit of {self.limit} (raise it with --memory-limit)")
        return True

    def _drop_copies(self, keep: set[str]) -> None:
        with contextlib.suppress(OSError):
            for directory in (self.root / REPLICAS).iterdir():
                if directory.name not in keep:
                    shutil.rmtree(directory, ignore_errors=True)

    # ------------------------------------------------------------ staging a restart
    def stage(self, node_rank: int, members: Sequence[str], previous: Sequence[str], generation: int) -> None:
        """Before this generation's workers start: fetch the files of this node's ranks that another node held in
        the round before (see the module's text).  Emits what it staged, and what it could not."""
        members, previous = tuple(members), tuple(previous)
        if not previous or previous == members or len(previous) != len(members):
            self.follow(members)  # nothing moved; or another world size, which the memory tier never restores
            return
        started = time.monotonic()
        deadline = started + STAGE_S
        live = self._live()
        stems = node_stems(node_rank, self.nproc)
        owners: dict[str, list[str]] = {}
        for stem in stems[:-1]:
            owner = previous[int(stem.removeprefix(mem.RANK)) // self.nproc]
            if owner != self.node:
                owners.setdefault(owner, []).append(stem)
        staged: dict[str, Any] = {}
        missing: dict[str, str] = {}
        for owner, group in owners.items():
            self._stage_group(owner, group, previous, live, deadline, None, staged, missing)
        if self.node not in previous:  # new to the run: the replicated state too, at the steps of the ranks staged
            peer = next((m for m in members if m != self.node and m in previous and m in live), None)
            matching = {v for s in stems[:-1] for v in ((r.step, r.generation) for r in mem.read_records(self.root, s))}
            if peer is None:
                missing[mem.REPLICATED] = "no node of the round before is alive"
            else:
                self._stage_group(peer, [mem.REPLICATED], previous, live, deadline, matching, staged, missing)
        self._forget_others(stems, node_stems(previous.index(self.node), self.nproc) if self.node in previous else ())
        self.follow(members)  # after staging: until now the copy thread kept to the round before
        if staged or missing:
            self._emit(EventKind.MEMORY_REPLICA_STAGED, generation=generation, staged=staged, missing=missing,
                       seconds=round(time.monotonic() - started, 3))

    def _stage_group(self, owner: str, stems: list[str], previous: tuple[str, ...], live: frozenset[str],
                     deadline: float, matching: set[Version] | None, staged: dict[str, Any],
                     missing: dict[str, str]) -> None:
        """Fetch ``stems`` (files ``owner`` held) at versions every file of ``owner`` holds whole at the source (a
        copy that stopped midway holds some files of a newer step): the newest and the newest pinned (from a
        copy: its two, both pinned); ``matching``: the newest two of those."""
        try:
            source = self._source(owner, previous, live, deadline)
            whole = node_stems(previous.index(owner), self.nproc)
            versions = common(source.offered, whole)
            pinned = common({s: [r for r in source.offered.get(s, []) if r.slot in mem.PINNED] for s in whole}, whole)
            chosen = list(dict.fromkeys(versions[:1] + pinned[:2]))[:2]
            if matching is not None:
                chosen = [v for v in versions if v in matching][:2] or chosen
            if not chosen:
                raise LookupError(f"{source.name} holds no step that every one of them has")
            keep = frozenset(chosen)
            for stem in stems:
                have = mem.read_records(self.root, stem)
                for version in chosen:
                    if version in {(r.step, r.generation) for r in have}:
                        continue
                    if time.monotonic() > deadline or self._done.is_set():
                        raise TimeoutError(f"gave up after {STAGE_S:g} s")
                    record = next(r for r in source.offered[stem] if (r.step, r.generation) == version)
                    slot = free_pinned(mem.read_records(self.root, stem, mem.PINNED), keep)
                    place(self.root, self.limit, self.root, record, slot, source.fill(record))
                sizes = [r.size for r in source.offered[stem] if (r.step, r.generation) in keep]
                staged[stem] = {"steps": [v[0] for v in chosen], "from": source.name, "bytes": sum(sizes)}
        except (LookupError, TimeoutError, Cancelled, mem.NoRoom, *_FAILURES) as e:
            why = str(e) if isinstance(e, LookupError) else f"{type(e).__name__}: {e}"
            for stem in stems:
                if stem not in staged:
                    missing[stem] = why

    def _source(self, owner: str, previous: tuple[str, ...], live: frozenset[str], deadline: float) -> Source:
        """``owner`` itself when alive; else the copy its ring successor in the round before kept (LookupError
        saying why there is none)."""
        timeout = max(1.0, deadline - time.monotonic())
        peer = self._peer(owner, timeout) if owner in live else None
        if peer is not None:
            own, _ = peer.index()
            return Source(owner, own, lambda r: peer.fill(OWN, r, self._done.is_set))
        keeper = previous[(previous.index(owner) + 1) % len(previous)]
        if keeper == owner:
            raise LookupError(f"{owner} is not reachable and kept no copy elsewhere")
        if keeper == self.node:
            directory = self.root / REPLICAS / owner
            return Source("this node's copy", records_in(directory, COPY_SLOTS),
                          lambda r: local_fill(directory / f"{r.stem}.{r.slot}.shard", r))
        remote = self._peer(keeper, timeout) if keeper in live else None
        if remote is None:
            raise LookupError(f"{owner} is not reachable and {keeper}, which kept its copy, is not either")
        _, copies = remote.index()
        return Source(f"{keeper}'s copy", copies.get(owner, {}), lambda r: remote.fill(owner, r, self._done.is_set))

    def _forget_others(self, now: Sequence[str], before: Sequence[str]) -> None:
        """Remove the files of ranks this node ran neither now nor in the round before (whose new owner may still
        be fetching them): nobody restores them from here again."""
        keep = set(now) | set(before)
        for stem in stems_in(self.root):
            if stem.startswith(mem.RANK) and stem not in keep:
                for slot in mem.ALL_SLOTS:
                    for suffix in ("json", "shard"):
                        (self.root / f"{stem}.{slot}.{suffix}").unlink(missing_ok=True)


def _pages(size: int) -> int:
    return -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
