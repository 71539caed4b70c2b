"""Node to node access to memory tiers (``--memory-replicas``): the HTTP server, its client, and placing a copy.

Each agent serves its tier directory on its network address: ``GET /index``
lists its own slots and the copies it keeps of peers' pinned steps, with
every manifest (step, generation, size, digest); ``GET /file/<own|node>/<file>``
sends one slot's bytes.  A request carries an HMAC of its path made with the
run token and the index an HMAC of its body, so only the run's agents read a
tier, and the digests a copy is checked against are the run's.  A copy is
written into a mapping reserved against the node's limit, checked against
its digest, and its manifest written last (:func:`place`).
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
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from ..checkpoint import memory as mem
from ..checkpoint.digest import ChunkedHasher, hash_pool

TIMEOUT_S = 30.0
"""A request to a peer's tier whose connection or any one read takes longer has failed."""
WAIT_MAX_S = 10.0
"""The longest an index request waits for the peer's pinned steps to change (``/index?since=V&wait=S``)."""
WATCH_S = 0.02
"""How often a waiting index request looks at the tier's pinned manifests."""
VERSION = "X-Resilient-Pinned"
"""The header naming the state of a tier's pinned manifests an index was read at."""
READ_BYTES = 4 << 20
"""A file is received in reads of at most this many bytes (a cancelled copy stops between two)."""
REPLICAS = "replicas"
COPY_SLOTS = mem.PINNED[:2]
"""The slots of a peer's copy: its newest pinned step, and the one before while the next is copied."""
AUTH = "X-Resilient-Auth"
SIGNATURE = "X-Resilient-Signature"
OWN = "own"
_STEM = re.compile(r"^(rank\d{5}|replicated)$")
_FILE = re.compile(r"^(rank\d{5}|replicated)\.(\d)\.shard$")
_NODE = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")

Version = tuple[int, int]
"""(step, generation): one saved state of one trajectory."""
Fill = Callable[[memoryview], None]
"""Writes a slot's bytes into a view of their size."""


class Cancelled(Exception):
    """A copy stopped because its agent is closing."""


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


def pinned_state(root: Path) -> str:
    """A name for the state of ``root``'s pinned manifests (which exist, and when each was written): it changes
    when a pinned step is published or dropped, not at every save of the turning slots."""
    h = hashlib.sha256()
    with contextlib.suppress(OSError):
        for entry in sorted(os.scandir(root), key=lambda e: e.name):
            part = entry.name.split(".")
            if len(part) == 3 and part[2] == "json" and part[1].isdigit() and int(part[1]) in mem.PINNED:
                with contextlib.suppress(OSError):
                    h.update(f"{entry.name}:{entry.stat(follow_symlinks=False).st_mtime_ns};".encode())
    return h.hexdigest()[:16]


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


def place(root: Path, limit: int, directory: Path, record: mem.SlotRecord, slot: int, fill: Fill) -> mem.SlotRecord:
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
            hasher = ChunkedHasher(record.chunk_bytes, hash_pool("read"), record.algorithm)
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
            timeout = TIMEOUT_S  # an idle or stalled connection does not hold a thread for good
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
        if request.path == "/index" or request.path.startswith("/index?"):
            query = urllib.parse.parse_qs(urllib.parse.urlsplit(request.path).query)
            since = query.get("since", [""])[0]
            try:
                until = time.monotonic() + min(WAIT_MAX_S, max(0.0, float(query.get("wait", ["0"])[0])))
            except ValueError:
                request.send_error(400, "wait must be a number of seconds")
                return
            state = pinned_state(self.root)
            while state == since and time.monotonic() < until:  # nothing pinned changed since the caller looked
                time.sleep(WATCH_S)
                state = pinned_state(self.root)
            body = json.dumps(index_of(self.root)).encode()
            request.send_response(200)
            request.send_header("Content-Type", "application/json")
            request.send_header("Content-Length", str(len(body)))
            request.send_header(VERSION, state)
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
        """``address``: ``host:port`` (``[v6]:port``) as the peer published it."""
        host, _, port = address.rpartition(":")
        self.address = address
        self._host, self._port = host.strip("[]"), int(port)
        self._token = token
        self._timeout = timeout_s
        self.pinned = ""
        """The state of the peer's pinned manifests its newest index was read at (pass it as ``since``)."""

    def _get(self, path: str) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        conn = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout)
        conn.request("GET", path, headers={AUTH: sign(self._token, path.encode())})
        response = conn.getresponse()
        if response.status != 200:
            conn.close()
            raise OSError(f"{self.address}{path}: HTTP {response.status} {response.reason}")
        return conn, response

    def index(self, since: str | None = None, wait_s: float = 0.0
              ) -> tuple[dict[str, list[mem.SlotRecord]], dict[str, dict[str, list[mem.SlotRecord]]]]:
        """The peer's own slots and its copies of others', from an index signed with the run token.  ``since``:
        the :attr:`pinned` state of an index read before; the peer answers when its pinned steps changed from it,
        or after ``wait_s``."""
        path = "/index" if since is None else f"/index?since={urllib.parse.quote(since)}&wait={wait_s:g}"
        conn, response = self._get(path)
        with contextlib.closing(conn):
            body = response.read()
        if not hmac.compare_digest(response.headers.get(SIGNATURE, ""), sign(self._token, body)):
            raise OSError(f"{self.address}: its index is not signed with the run's token")
        self.pinned = response.headers.get(VERSION, "")
        parsed = json.loads(body)
        return _decode(parsed[OWN]), {node: _decode(found) for node, found in parsed[REPLICAS].items()}

    def fill(self, where: str, record: mem.SlotRecord, cancelled: Callable[[], bool] = lambda: False) -> Fill:
        """Writes the peer's file of ``record`` into a view of its size (:class:`Cancelled` between two reads
        once ``cancelled()``)."""
        def into(view: memoryview) -> None:
            conn, response = self._get(f"/file/{where}/{record.stem}.{record.slot}.shard")
            with contextlib.closing(conn):
                if int(response.headers.get("Content-Length", -1)) != record.size:
                    raise ValueError(f"{record.stem} at step {record.step}: the peer's file is not "
                                     f"{record.size} bytes (overwritten since its index)")
                got = 0
                while got < record.size:
                    if cancelled():
                        raise Cancelled(f"copying {record.stem} from {self.address}")
                    n = response.readinto(view[got:got + READ_BYTES])
                    if not n:
                        raise OSError(f"{self.address}: the file ended after {got} of {record.size} bytes")
                    got += n
        return into


def local_fill(path: Path, record: mem.SlotRecord) -> Fill:
    def into(view: memoryview) -> None:
        with open(path, "rb") as f:
            if f.readinto(view) != record.size:
                raise ValueError(f"{path.name}: not {record.size} bytes")
    return into
