"""Which nodes of a launch are alive, from evidence: the agents probe each other over TCP.

A presence lease alone (:mod:`resilient.coord.presence`) is slow and
blind in both directions: a dead node counts as alive until its lease
lapses (seconds), and a live node cut off from etcd counts as dead once
it lapses, although its ranks still train.  So every agent also listens
on a probe port and keeps a connection to a few peers (the next
:data:`PROBERS` nodes in a ring of the launch's nodes), pinging each every
:data:`INTERVAL_S` seconds:

* a peer whose connection ends and whose port then refuses a new one (its
  agent died: the kernel answers for it at once), or that answers nothing
  for the silence (:data:`SILENCE_S` by default; powered off, or its traffic dropped), is
  **accused**: the prober writes ``suspect/<node>/<prober>`` on its own
  lease, and deletes it when the peer answers again;
* a peer that answers while its presence key is gone (its agent is cut off
  from etcd, not from its peers) is **vouched for**: ``vouch/<node>/<prober>``.

:func:`judge` is the pure rule every agent applies to those keys as its
watch holds them: a node is lost when enough of its live probers accuse it
(:data:`QUORUM`, or all of them when it has fewer), or when its presence
key is gone and no live node vouches for it.  A node that only one prober
cannot reach (a link cut between two nodes) is not lost.  Nothing is
written while every probe is answered: the probes cost the store nothing.

:class:`ProbeServer` answers probes; :class:`Prober` sends them.
"""

from __future__ import annotations

import errno
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from ..core.supervised import CrashCallback, FatalCallback, Supervised, quiet

INTERVAL_S = 0.15
"""Seconds between two pings of one peer."""

SILENCE_S = 2.5
"""A peer that answers nothing (a ping, or a connection being made) for this long is accused (the default of
``resilient run --node-silence-timeout``): an agent stalled for 2 s (a long garbage collection, a loaded machine
scheduling it late, a swap storm) answers before it, and a node cut off the network is judged lost within 3 s
(the silence, a ping interval and the accusations' round trip through etcd).  A node whose agent died is judged
at once, from its refused port, whatever this is."""

MIN_SILENCE_S = 0.5
"""The shortest silence a run may set: a few ping intervals, or every scheduling hiccup is an accusation."""

PROBERS = 3
"""How many peers each agent probes: each node is probed by as many (fewer in a smaller launch)."""

QUORUM = 2
"""Accusations that make a node lost (all of its live probers' when it has fewer)."""

MAX_CONNECTIONS = 64
"""Probe connections a server keeps at once (each node is probed by :data:`PROBERS` peers)."""

IDLE_S = 5.0
"""A probe connection that sent nothing for this long is dropped by the server (its prober pings far more often:
it is gone without a word)."""

_PING = b"."
_BYE = b"!"
"""Sent by a server that closes on purpose (its agent leaves the launch): its probers stop, accusing nobody."""


def ring_after(nodes: Iterable[str], node: str, k: int) -> list[str]:
    """The ``k`` nodes after ``node`` in the sorted ring of ``nodes`` (``node`` itself excluded)."""
    ring = sorted(set(nodes) | {node})
    at = ring.index(node)
    others = ring[at + 1:] + ring[:at]
    return others[:k]


def probers_of(nodes: Iterable[str], node: str, k: int = PROBERS) -> list[str]:
    """The nodes that probe ``node`` in the ring of ``nodes``: the ``k`` before it."""
    nodes = set(nodes)
    return list(reversed(ring_after(nodes, node, len(nodes))))[:k]


@dataclass(frozen=True)
class Evidence:
    """The keys :func:`judge` weighs, as one revision of the store holds them."""

    running: frozenset[str]
    """Nodes whose presence key says running (on a live lease)."""
    suspects: Mapping[str, frozenset[str]] = field(default_factory=dict)
    """node -> the nodes accusing it."""
    vouches: Mapping[str, frozenset[str]] = field(default_factory=dict)
    """node -> the nodes vouching for it."""


@dataclass(frozen=True)
class Verdict:
    live: frozenset[str]
    lost: Mapping[str, str]
    """node -> why it is taken for lost."""
    known: frozenset[str]
    """The ring the probers are chosen from: nodes running, or vouched for by a running node."""


def judge(evidence: Evidence, me: str, k: int = PROBERS, quorum: int = QUORUM) -> Verdict:
    """Which nodes are alive and which are lost (never ``me``), from presence, accusations and vouches."""
    running = evidence.running
    vouched = {n for n, by in evidence.vouches.items() if by & running}
    known = running | vouched | {me}
    lost: dict[str, str] = {}
    # Only an accused node can be lost here (a node whose key is gone and that nobody accuses is simply not
    # known): while every probe is answered nothing is weighed, so judging each change of a large launch is cheap.
    for node in sorted(n for n, by in evidence.suspects.items() if by & running):
        if node == me:
            continue
        live_probers = [p for p in probers_of(known, node, k) if p in running]
        accusers = sorted(evidence.suspects.get(node, frozenset()) & running)
        needed = min(quorum, len(live_probers))
        if needed and len(accusers) >= needed:
            lost[node] = f"its agent does not answer probes from {', '.join(accusers)}"
        elif node not in known:
            lost[node] = "its presence lease expired and no live node can reach its agent"
    return Verdict(frozenset(known - set(lost)), lost, frozenset(known))


# --------------------------------------------------------------------- the wire


class ProbeServer:
    """Answers probes on ``host``: a new connection gets this node's name, each ping an answer."""

    def __init__(self, host: str, node: str, *, on_crash: CrashCallback = quiet,
                 on_fatal: FatalCallback = quiet) -> None:
        """``on_crash``, ``on_fatal``: the serving thread's unexpected errors (:mod:`resilient.core.supervised`)."""
        self._node = node
        self._listener = socket.create_server((host, 0))
        self._listener.setblocking(False)
        bound = self._listener.getsockname()
        # The address as bound (an IP, not a name): probers connect without a name lookup on their thread.
        self.address = f"[{bound[0]}]:{bound[1]}" if ":" in bound[0] else f"{bound[0]}:{bound[1]}"
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._conns: dict[socket.socket, float] = {}
        """Each connection and when it last sent anything (monotonic)."""
        self._wake_r, self._wake_w = os.pipe()
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._done = False
        self._thread = Supervised("probe-server", self._serve, on_crash=on_crash, on_fatal=on_fatal)

    def start(self) -> None:
        self._thread.start()

    def _serve(self) -> None:
        while not self._done:
            for key, _ in self._selector.select(timeout=IDLE_S / 4):
                target = key.fileobj
                if target is self._listener:
                    self._accept()
                elif target == self._wake_r:
                    continue
                else:
                    assert isinstance(target, socket.socket)
                    self._answer(target)
            idle = time.monotonic() - IDLE_S
            for conn in [c for c, heard in self._conns.items() if heard < idle]:
                self._drop(conn)  # its prober is gone without a word (powered off, cut off): not a slot kept
        for conn in list(self._conns):
            try:
                conn.send(_BYE)
            except OSError:
                pass
            self._drop(conn)
        self._selector.close()
        self._listener.close()
        os.close(self._wake_r)

    def _accept(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except OSError:
            return
        if len(self._conns) >= MAX_CONNECTIONS:  # make room: the connection heard from least recently goes
            self._drop(min(self._conns, key=lambda c: self._conns[c]))
        conn.setblocking(False)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            conn.send(self._node.encode() + b"\n")
        except OSError:
            conn.close()
            return
        self._conns[conn] = time.monotonic()
        self._selector.register(conn, selectors.EVENT_READ)

    def _answer(self, conn: socket.socket) -> None:
        try:
            data = conn.recv(256)
            if data:
                self._conns[conn] = time.monotonic()
                conn.send(_PING * len(data))
                return
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            pass
        self._drop(conn)

    def _drop(self, conn: socket.socket) -> None:
        self._conns.pop(conn, None)
        try:
            self._selector.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()

    def close(self) -> None:
        """Stop answering, saying goodbye on every connection (a peer that leaves is not lost)."""
        if self._done:
            return
        self._done = True
        if self._thread.is_alive():
            os.write(self._wake_w, b"x")
            self._thread.join(timeout=5)
        else:  # never started: nothing of it runs to close what it holds
            self._selector.close()
            self._listener.close()
            os.close(self._wake_r)
        os.close(self._wake_w)


@dataclass
class _Peer:
    node: str
    address: str
    sock: socket.socket | None = None
    connected: bool = False
    greeted: bool = False
    heard: float = 0.0
    """Monotonic time of the last answer (or of the first connection attempt, before any)."""
    answered: float = 0.0
    """Monotonic time of the last answer only (0: none yet): what a silence is counted from."""
    up: bool | None = None
    why: str = ""
    """Why it is down (when ``up`` is False)."""
    failures: int = 0
    retry_at: float = 0.0
    pending: bytes = b""
    departed: bool = False
    """It said goodbye: not probed again until it is followed at another address."""


class Prober:
    """Pings a few peers on one thread and reports when each goes down or comes back.

    ``on_change(node, up, reason)`` is called from the prober's thread on every change of a peer's state (never
    for the first ``up``, only for a peer that was down)."""

    def __init__(self, me: str, on_change: Callable[[str, bool, str], None], *, interval_s: float = INTERVAL_S,
                 silence_s: float = SILENCE_S, clock: Callable[[], float] = time.monotonic,
                 on_crash: CrashCallback = quiet, on_fatal: FatalCallback = quiet) -> None:
        """``on_crash``, ``on_fatal``: the probing thread's unexpected errors (:mod:`resilient.core.supervised`);
        a socket's error is a peer's state, not one of them."""
        if not 0 < interval_s < silence_s:
            raise ValueError(f"probes need 0 < interval_s < silence_s, got {interval_s}, {silence_s}")
        self._me = me
        self._on_change = on_change
        self._interval = interval_s
        self._silence = silence_s
        self._clock = clock
        self._lock = threading.Lock()
        self._wanted: dict[str, str] = {}
        self._peers: dict[str, _Peer] = {}
        self._selector = selectors.DefaultSelector()
        self._done = threading.Event()
        self.error: str | None = None
        """The last error the prober's thread survived (None: none)."""
        self._thread = Supervised("prober", self._loop, on_crash=on_crash, on_fatal=on_fatal, stop=self._done)

    def start(self) -> None:
        self._thread.start()

    def follow(self, targets: Mapping[str, str]) -> None:
        """Probe exactly ``targets`` (node -> ``host:port``) from now on."""
        with self._lock:
            self._wanted = dict(targets)

    def state(self) -> dict[str, bool | None]:
        """node -> up (True), down (False) or not known (None), for the peers probed now; nothing known once the
        prober stopped."""
        if not self._thread.is_alive():
            return {}
        with self._lock:
            return {n: p.up for n, p in self._peers.items()}

    def down(self) -> dict[str, str]:
        """node -> why, for the peers probed now that do not answer."""
        if not self._thread.is_alive():
            return {}
        with self._lock:
            return {n: p.why for n, p in self._peers.items() if p.up is False}

    def _loop(self) -> None:
        next_ping = self._clock()
        while not self._done.is_set():
            try:
                next_ping = self._round(next_ping)
            except OSError as e:  # the probes outlive any one peer's surprise (anything else: a bug, reported)
                self.error = f"{type(e).__name__}: {e}"
                self._done.wait(self._interval)
        for peer in list(self._peers.values()):
            self._close(peer)
        self._selector.close()

    def _round(self, next_ping: float) -> float:
        """Connect where due, read what arrived, ping when due, accuse the silent; returns the next ping time."""
        self._sync_targets()
        now = self._clock()
        for peer in list(self._peers.values()):
            if peer.sock is None and not peer.departed and now >= peer.retry_at:
                self._connect(peer, now)
        timeout = max(0.0, min(next_ping - now, self._interval))
        for key, events in self._selector.select(timeout=timeout):
            peer = key.data
            if events & selectors.EVENT_WRITE and not peer.connected:
                self._connected(peer)
            if events & selectors.EVENT_READ and peer.sock is not None:
                self._read(peer)
        now = self._clock()
        if now >= next_ping:
            next_ping = now + self._interval
            for peer in list(self._peers.values()):
                if peer.sock is not None and peer.greeted:
                    try:
                        peer.sock.send(_PING)
                    except (BlockingIOError, InterruptedError):
                        pass
                    except OSError as e:
                        self._failed(peer, f"the connection failed: {os.strerror(e.errno or errno.EIO)}")
        for peer in list(self._peers.values()):
            if peer.sock is not None and now - peer.heard >= self._silence:
                self._failed(peer, f"no answer for {self._silence:g} s", hard=False)
        return next_ping

    def _sync_targets(self) -> None:
        with self._lock:
            wanted = dict(self._wanted)
            for node in [n for n in self._peers if n not in wanted]:
                self._close(self._peers.pop(node))
            for node, peer in self._peers.items():
                if peer.address != wanted[node]:  # its agent started again elsewhere: the same peer, its state kept
                    self._close(peer)
                    peer.address, peer.failures, peer.retry_at, peer.departed = wanted[node], 0, 0.0, False
            for node, address in wanted.items():
                if node not in self._peers and node != self._me:
                    self._peers[node] = _Peer(node, address)

    def _connect(self, peer: _Peer, now: float) -> None:
        host, _, port = peer.address.rpartition(":")
        host = host.strip("[]")
        try:
            target = (host, int(port))
            sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        except (OSError, ValueError) as e:
            self._failed(peer, f"cannot probe {peer.address}: {e}")
            return
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer.heard = now  # a connection being made is silent for at most SILENCE_S too
        peer.sock, peer.connected, peer.greeted, peer.pending = sock, False, False, b""
        try:
            code = sock.connect_ex(target)
        except OSError as e:  # an address this host cannot reach at all
            code = e.errno or errno.EHOSTUNREACH
        if code not in (0, errno.EINPROGRESS):
            self._failed(peer, f"connecting failed: {os.strerror(code)}")
            return
        self._selector.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE, peer)

    def _connected(self, peer: _Peer) -> None:
        assert peer.sock is not None
        code = peer.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if code:
            self._failed(peer, f"connecting failed: {os.strerror(code)}")
            return
        peer.connected = True
        self._selector.modify(peer.sock, selectors.EVENT_READ, peer)

    def _read(self, peer: _Peer) -> None:
        assert peer.sock is not None
        try:
            data = peer.sock.recv(256)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._failed(peer, f"the connection failed: {os.strerror(e.errno or errno.EIO)}")
            return
        if not data:
            self._failed(peer, "its agent closed the connection")
            return
        if peer.greeted and _BYE in data:  # it leaves on purpose: no accusation, no new connection to its port,
            self._close(peer)              # and no vouching for it (it is neither up nor down now)
            with self._lock:
                peer.departed, peer.failures, peer.up = True, 0, None
            return
        if not peer.greeted:
            peer.pending += data
            if b"\n" not in peer.pending:
                return
            name, _, rest = peer.pending.partition(b"\n")
            if name.decode(errors="replace") != peer.node:
                self._failed(peer, f"{peer.address} answered as {name.decode(errors='replace')!r}")
                return
            peer.greeted, peer.pending = True, b""
            del rest
        peer.heard = peer.answered = self._clock()
        peer.failures = 0
        self._set(peer, True, "it answers again")

    def _failed(self, peer: _Peer, reason: str, *, hard: bool = True) -> None:
        """A connection ended, was refused, or went silent.  A peer that was up gets one immediate new
        connection first (a restarted peer, a connection reset on the way); a second failure in a row, or
        silence, marks it down."""
        self._close(peer)
        peer.failures += 1
        now = self._clock()
        if hard and peer.up is not False and peer.failures < 2:
            peer.retry_at = now
            return
        peer.retry_at = now + self._interval
        self._set(peer, False, reason)

    def _set(self, peer: _Peer, up: bool, reason: str) -> None:
        with self._lock:
            before, peer.up = peer.up, up
            if not up and before is not False:
                peer.why = reason
        if before is not up and (not up or before is False):
            self._on_change(peer.node, up, reason)

    def _close(self, peer: _Peer) -> None:
        if peer.sock is not None:
            try:
                self._selector.unregister(peer.sock)
            except (KeyError, ValueError):
                pass
            peer.sock.close()
        peer.sock, peer.connected, peer.greeted = None, False, False

    def close(self) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        elif not self._thread.started:
            self._selector.close()
