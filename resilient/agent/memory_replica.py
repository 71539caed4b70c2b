"""A copy of each node's memory tier on one peer node (``--memory-replicas 1``).

A node lost with its agent takes its memory tier with it: the restart that
follows would read the durable tier and do again every step since its last
commit.  With a copy on a peer node it restores a step of the memory tier.

* **Pinned steps.**  Every rank saves the multiples of ``pin_every`` in its
  memory tier's pinned slots (:data:`~resilient.checkpoint.memory.PINNED`,
  ``RESILIENT_MEMORY_PIN_EVERY``), which the other saves never overwrite:
  the same steps on every node, so a copy matches steps the survivors still
  hold.
* **Copies.**  Each agent serves its tier over HTTP on its network address
  (published in its presence key); a request is signed with the run token,
  and so is the index that lists the slots with their digests.  Each agent
  copies its ring predecessor's newest pinned step (the current round's node
  order), every file of it, into ``replicas/<node>/`` of its own tier,
  verified against the signed digests.
* **Staging.**  Before a generation's workers start, the agent makes sure its
  tier holds the files of the ranks this node now runs.  A rank another node
  ran in the round before (a node was lost and the order moved up, or this
  node is new) is fetched from that node, its newest and its newest pinned
  step; from the copy its ring successor kept when that node is gone.  The
  workers' restore then agrees on a step every rank holds
  (:func:`~resilient.checkpoint.memory.restore_memory`), or falls back to the
  durable tier.

Every copy counts against the node's memory limit: one without room is not
made, and the agent says so once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import hmac
import http.client
import json
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from ..checkpoint import memory as mem
from ..checkpoint.digest import ChunkedHasher, hash_pool
from ..events import Emit, EventKind

PIN_EVERY = 10
"""Steps between pinned steps when ``--memory-pin-every`` is not given."""
POLL_S = 0.25
"""How often an agent looks for a newer pinned step of its predecessor."""
TIMEOUT_S = 30.0
"""A request to a peer's tier that takes longer has failed."""
REPLICAS = "replicas"
COPY_SLOTS = mem.PINNED[:2]
"""The slots of a peer's copy: its newest pinned step, and the one before while the next is copied."""
PUBLISHED_AS = "memory"
"""The presence key's field with the address an agent serves its tier on."""
AUTH = "X-Resilient-Auth"
SIGNATURE = "X-Resilient-Signature"
_STEM = re.compile(r"^(rank\d{5}|replicated)$")
_FILE = re.compile(r"^(rank\d{5}|replicated)\.(\d)\.shard$")
_NODE = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
OWN = "own"

Version = tuple[int, int]
"""(step, generation): one saved state of one trajectory."""


def node_stems(node_rank: int, nproc: int) -> tuple[str, ...]:
    """The files a node at ``node_rank`` holds: its ranks' and the node's replicated state."""
    return (*(mem.file_stem(mem.RANK, node_rank * nproc + local) for local in range(nproc)), mem.REPLICATED)


def sign(token: str, what: bytes) -> str:
    return hmac.new(token.encode(), what, hashlib.sha256).hexdigest()


def stems_in(directory: Path) -> list[str]:
    with contextlib.suppress(OSError):
        return sorted({stem for p in directory.glob("*.json") if _STEM.match(stem := p.name.split(".")[0])})
    return []


def records_in(directory: Path, slots: tuple[int, ...] = mem.ALL_SLOTS) -> dict[str, list[mem.SlotRecord]]:
    """Every published slot of ``directory`` (of ``slots``), by file, newest first."""
    found = {stem: mem.read_records(directory, stem, slots) for stem in stems_in(directory)}
    return {stem: records for stem, records in found.items() if records}


def common(records: Mapping[str, Sequence[mem.SlotRecord]], stems: Sequence[str]) -> list[Version]:
    """The versions every one of ``stems`` holds, newest first."""
    held = [{(r.step, r.generation) for r in records.get(stem, ())} for stem in stems]
    return sorted(set.intersection(*held), reverse=True) if held else []


def index_of(root: Path) -> dict[str, Any]:
    """What a tier serves: its own slots and the copies it keeps of peers' pinned steps."""
    replicas: dict[str, Any] = {}
    with contextlib.suppress(OSError):
        for directory in sorted((root / REPLICAS).iterdir()):
            if directory.is_dir() and _NODE.match(directory.name):
                replicas[directory.name] = _encode(records_in(directory, COPY_SLOTS))
    return {OWN: _encode(records_in(root)), REPLICAS: replicas}


def _encode(records: Mapping[str, Sequence[mem.SlotRecord]]) -> dict[str, list[dict[str, Any]]]:
    return {stem: [dataclasses.asdict(r) for r in found] for stem, found in records.items()}


def _decode(body: Mapping[str, Any]) -> dict[str, list[mem.SlotRecord]]:
    out: dict[str, list[mem.SlotRecord]] = {}
    for stem, found in body.items():
        parsed = [mem.SlotRecord.parse(json.dumps({"format": mem.FORMAT, **r}).encode(), stem, int(r.get("slot", -1)))
                  for r in found if isinstance(r, dict)]
        out[stem] = [r for r in parsed if r is not None]
    return out


def place(root: Path, limit: int, directory: Path, record: mem.SlotRecord, slot: int,
          fill: Callable[[memoryview], None]) -> mem.SlotRecord:
    """Write ``record``'s bytes (``fill`` writes them into the view it is given) as slot ``slot`` of its file in
    ``directory``, verified against the record's digest, its manifest last.  Raises
    :class:`~resilient.checkpoint.memory.NoRoom`, or ValueError when the bytes are not the record's."""
    if directory != root:  # a peer's copy: never a tier that was removed meanwhile (the run ended)
        (root / REPLICAS).mkdir(exist_ok=True)
        directory.mkdir(exist_ok=True)
    manifest = directory / f"{record.stem}.{slot}.json"
    manifest.unlink(missing_ok=True)  # the slot holds nothing until it holds this
    shard = directory / f"{record.stem}.{slot}.shard"
    mapped = mem.reserve_file(shard, record.size, root, limit)
    try:
        view = memoryview(mapped)
        try:
            fill(view)
            hasher = ChunkedHasher(record.chunk_bytes, hash_pool("read"))
            hasher.update(view)
            ok = hasher.hexdigest() == record.digest
        finally:
            view.release()
    finally:
        mapped.close()
    if not ok:
        shard.unlink(missing_ok=True)
        raise ValueError(f"{record.stem} at step {record.step}: the bytes do not match their digest")
    placed = dataclasses.replace(record, slot=slot)
    temporary = manifest.with_suffix(".json.tmp")
    temporary.write_bytes(placed.to_json())
    os.replace(temporary, manifest)
    return placed


def free_pinned(records: Sequence[mem.SlotRecord], keep: frozenset[Version] = frozenset(),
                slots: tuple[int, ...] = mem.PINNED) -> int:
    """The slot of ``slots`` to write: one holding nothing, else the one with the oldest step, never one holding
    a version of ``keep`` while another does not."""
    held = {r.slot: r for r in records if r.slot in slots}
    empty = [s for s in slots if s not in held]
    if empty:
        return empty[0]
    return min(slots, key=lambda s: ((held[s].step, held[s].generation) in keep, held[s].step))


# ---------------------------------------------------------------- serving
class TierServer:
    """Serves this node's tier to its peers: ``GET /index`` and ``GET /file/<own|node>/<file>``."""

    def __init__(self, root: Path, host: str, token: str) -> None:
        self.root = root
        served = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                served._answer(self)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._token = token
        self._server = ThreadingHTTPServer((host, 0), Handler)
        self._server.daemon_threads = True
        host_bound, port = str(self._server.server_address[0]), int(self._server.server_address[1])
        self.address = f"[{host_bound}]:{port}" if ":" in host_bound else f"{host_bound}:{port}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="memory-tier-server", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _answer(self, request: BaseHTTPRequestHandler) -> None:
        if not hmac.compare_digest(request.headers.get(AUTH, ""), sign(self._token, request.path.encode())):
            request.send_error(403, "not signed with the run's token")
            return
        if request.path == "/index":
            body = json.dumps(index_of(self.root)).encode()
            request.send_response(200)
            request.send_header("Content-Type", "application/json")
            request.send_header("Content-Length", str(len(body)))
            request.send_header(SIGNATURE, sign(self._token, body))
            request.end_headers()
            request.wfile.write(body)
            return
        where, _, name = request.path.removeprefix("/file/").partition("/")
        if not request.path.startswith("/file/") or not _FILE.match(name) or not (where == OWN or _NODE.match(where)):
            request.send_error(404, "no such file")
            return
        path = self.root / name if where == OWN else self.root / REPLICAS / where / name
        try:
            f = open(path, "rb")  # noqa: SIM115
        except OSError:
            request.send_error(404, "no such file")
            return
        with f:
            size = os.fstat(f.fileno()).st_size
            request.send_response(200)
            request.send_header("Content-Length", str(size))
            request.end_headers()
            request.wfile.flush()
            request.connection.sendfile(f)


class PeerTier:
    """A peer's tier, as its server answers."""

    def __init__(self, address: str, token: str, timeout_s: float = TIMEOUT_S) -> None:
        host, _, port = address.rpartition(":")
        self.address = address
        self._host, self._port = host.strip("[]"), int(port)
        self._token = token
        self._timeout = timeout_s

    def _get(self, path: str) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        conn = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout)
        conn.request("GET", path, headers={AUTH: sign(self._token, path.encode())})
        response = conn.getresponse()
        if response.status != 200:
            conn.close()
            raise OSError(f"{self.address}{path}: HTTP {response.status} {response.reason}")
        return conn, response

    def index(self) -> tuple[dict[str, list[mem.SlotRecord]], dict[str, dict[str, list[mem.SlotRecord]]]]:
        """The peer's own slots and its copies of others', from an index signed with the run token."""
        conn, response = self._get("/index")
        with contextlib.closing(conn):
            body = response.read()
        if not hmac.compare_digest(response.headers.get(SIGNATURE, ""), sign(self._token, body)):
            raise OSError(f"{self.address}: its index is not signed with the run's token")
        parsed = json.loads(body)
        return _decode(parsed[OWN]), {node: _decode(found) for node, found in parsed[REPLICAS].items()}

    def fill(self, where: str, record: mem.SlotRecord) -> Callable[[memoryview], None]:
        """Writes the peer's file of ``record`` into a view of its size."""
        def into(view: memoryview) -> None:
            conn, response = self._get(f"/file/{where}/{record.stem}.{record.slot}.shard")
            with contextlib.closing(conn):
                if int(response.headers.get("Content-Length", -1)) != record.size:
                    raise ValueError(f"{record.stem} at step {record.step}: the peer's file is not "
                                     f"{record.size} bytes (overwritten since its index)")
                got = 0
                while got < record.size:
                    n = response.readinto(view[got:])
                    if not n:
                        raise OSError(f"{self.address}: the file ended after {got} of {record.size} bytes")
                    got += n
        return into


def local_fill(path: Path, record: mem.SlotRecord) -> Callable[[memoryview], None]:
    def into(view: memoryview) -> None:
        with open(path, "rb") as f:
            if f.readinto(view) != record.size:
                raise ValueError(f"{path.name}: not {record.size} bytes")
    return into


# ---------------------------------------------------------------- the agent's side
@dataclasses.dataclass
class Copy:
    """What this node keeps of its predecessor's tier."""

    node: str
    version: Version
    bytes: int
    seconds: float


class MemoryReplication:
    """This node's side of ``--memory-replicas 1``: serve the tier, copy the predecessor's, stage a restart's."""

    def __init__(self, root: Path, limit: int, *, node: str, host: str, token: str, nproc: int, emit: Emit,
                 address_of: Callable[[str], str | None], live: Callable[[], frozenset[str]],
                 poll_s: float = POLL_S) -> None:
        self.root = root
        self.limit = limit
        self.node = node
        self.nproc = nproc
        self._token = token
        self._emit = emit
        self._address_of = address_of
        self._live = live
        self._poll_s = poll_s
        self.server = TierServer(root, host, token)
        self._serving = False
        self._lock = threading.Lock()
        self._members: tuple[str, ...] = ()
        self.copy: Copy | None = None
        self._said: set[str] = set()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="memory-replica", daemon=True)

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
        self._thread.start()

    def close(self) -> None:
        """Stop copying and serving (again: no-op)."""
        self._done.set()
        if self._thread.is_alive():  # a copy in flight ends at its next request; nothing waits on a dead peer
            self._thread.join(timeout=2.0)
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
            self._members = tuple(members)

    def _peer(self, node: str) -> PeerTier | None:
        address = self._address_of(node)
        return PeerTier(address, self._token) if address else None

    def _say_once(self, key: str, why: str, **fields: Any) -> None:
        if key not in self._said:
            self._said.add(key)
            self._emit(EventKind.MEMORY_REPLICA_FAILED, reason=why, **fields)

    # ------------------------------------------------------------ copying the predecessor's pinned steps
    def _loop(self) -> None:
        while not self._done.wait(self._poll_s):
            try:
                self.pull()
            except mem.NoRoom as e:
                self._say_once("room", f"no room for the copy of a peer's memory tier: {e}")
            except (OSError, ValueError, KeyError, TypeError, http.client.HTTPException) as e:
                self._say_once(f"{type(e).__name__}", f"copying a peer's memory tier failed: "
                               f"{type(e).__name__}: {e} (retried every {self._poll_s} s; said once)")

    def predecessor(self) -> tuple[str, int] | None:
        with self._lock:
            members = self._members
        if self.node not in members or len(members) < 2:
            return None
        at = (members.index(self.node) - 1) % len(members)
        return members[at], at

    def pull(self) -> Copy | None:
        """Copy the predecessor's newest pinned step, when newer than the copy held; returns the new copy."""
        found = self.predecessor()
        if found is None:
            return None
        node, at = found
        peer = self._peer(node) if node in self._live() else None
        if peer is None:
            return None
        own, _ = peer.index()
        pinned = {stem: [r for r in found if r.slot in mem.PINNED] for stem, found in own.items()}
        stems = node_stems(at, self.nproc)
        versions = common(pinned, stems)
        held = self.copy
        if not versions or (held is not None and held.node == node and held.version >= versions[0]):
            return None
        version = versions[0]
        started = time.monotonic()
        directory = self.root / REPLICAS / node
        size = 0
        for stem in stems:
            record = next(r for r in pinned[stem] if (r.step, r.generation) == version)
            slot = free_pinned(mem.read_records(directory, stem, COPY_SLOTS), slots=COPY_SLOTS)
            place(self.root, self.limit, directory, record, slot, peer.fill(OWN, record))
            size += record.size
        copy = Copy(node, version, size, time.monotonic() - started)
        first = held is None or held.node != node
        self.copy = copy
        if first:  # once per predecessor; the copies after it are in status
            self._emit(EventKind.MEMORY_REPLICA_HELD, peer=node, step=version[0], generation=version[1], bytes=size,
                       seconds=round(copy.seconds, 3))
            self._drop_others(node)
        return copy

    def _drop_others(self, keep: str) -> None:
        with contextlib.suppress(OSError):
            for directory in (self.root / REPLICAS).iterdir():
                if directory.name != keep:
                    shutil.rmtree(directory, ignore_errors=True)

    # ------------------------------------------------------------ staging a restart
    def stage(self, node_rank: int, members: Sequence[str], previous: Sequence[str], generation: int) -> None:
        """Before this generation's workers start: fetch the files of this node's ranks that another node held in
        the round before (see the module's text).  Emits what it staged, and what it could not."""
        self.follow(members)
        if not previous or list(previous) == list(members):
            return
        started = time.monotonic()
        staged: dict[str, Any] = {}
        missing: dict[str, str] = {}
        live = self._live()
        stems = node_stems(node_rank, self.nproc)
        for stem in stems:  # the replicated state last: its versions follow the ranks'
            owner = self._owner(stem, node_rank, members, previous)
            if owner is None or owner == self.node:
                continue
            ranks = {(r.step, r.generation) for s in stems[:-1] for r in mem.read_records(self.root, s)}
            try:
                got = self._stage_stem(stem, owner, previous, live, ranks if stem == mem.REPLICATED else None)
            except mem.NoRoom as e:
                got = f"no room: {e}"
            except (OSError, ValueError, KeyError, TypeError, http.client.HTTPException) as e:
                got = f"{type(e).__name__}: {e}"
            if isinstance(got, str):
                missing[stem] = got
            else:
                staged[stem] = got
        if staged or missing:
            self._emit(EventKind.MEMORY_REPLICA_STAGED, generation=generation, staged=staged, missing=missing,
                       seconds=round(time.monotonic() - started, 3))

    def _owner(self, stem: str, node_rank: int, members: Sequence[str], previous: Sequence[str]) -> str | None:
        """The node that held ``stem`` in the round before; for the replicated state, any peer when this node
        was not in it."""
        if stem == mem.REPLICATED:
            if self.node in previous:
                return self.node
            others = [m for m in members if m != self.node and m in previous]
            return others[(node_rank - 1) % len(others)] if others else None
        at = int(stem.removeprefix(mem.RANK)) // self.nproc
        return previous[at] if at < len(previous) else None

    def _stage_stem(self, stem: str, owner: str, previous: Sequence[str], live: frozenset[str],
                    matching: set[Version] | None) -> dict[str, Any] | str:
        """Fetch ``stem``'s newest and newest pinned versions from ``owner``, or from the copy its successor in
        the round before kept (``matching``: the newest two of these versions instead, where it has them);
        returns what was staged, or why nothing was."""
        have = {(r.step, r.generation) for r in mem.read_records(self.root, stem)}
        if owner in live and (peer := self._peer(owner)) is not None:
            own, _ = peer.index()
            offered, fill_from = own.get(stem, []), owner
            fill: Callable[[mem.SlotRecord], Callable[[memoryview], None]] = lambda r: peer.fill(OWN, r)
        else:
            keeper = previous[(list(previous).index(owner) + 1) % len(previous)]
            if keeper == owner:
                return f"{owner} is lost and kept no copy elsewhere"
            if keeper == self.node:
                directory = self.root / REPLICAS / owner
                offered, fill_from = mem.read_records(directory, stem, COPY_SLOTS), "this node's copy"
                fill = lambda r: local_fill(directory / f"{r.stem}.{r.slot}.shard", r)
            else:
                remote = self._peer(keeper) if keeper in live else None
                if remote is None:
                    return f"{owner} is lost and {keeper}, which kept its copy, is not reachable"
                _, copies = remote.index()
                offered, fill_from = copies.get(owner, {}).get(stem, []), keeper
                fill = lambda r: remote.fill(owner, r)
        wanted = list({(r.step, r.generation): r for r in
                       offered[:1] + [r for r in offered if r.slot in mem.PINNED][:1]}.values())
        if matching:
            kept = {(r.step, r.generation): r for r in offered if (r.step, r.generation) in matching}
            wanted = list(kept.values())[:len(mem.PINNED)] or wanted
        if not wanted:
            return f"{fill_from} holds no step of it"
        keep = frozenset((r.step, r.generation) for r in wanted)
        for record in wanted:
            if (record.step, record.generation) not in have:
                slot = free_pinned(mem.read_records(self.root, stem, mem.PINNED), keep)
                place(self.root, self.limit, self.root, record, slot, fill(record))
        return {"steps": [r.step for r in wanted], "from": fill_from, "bytes": sum(r.size for r in wanted)}
