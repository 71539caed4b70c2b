"""Rendezvous: which nodes form the next generation, and where its workers meet.

Two flavours:

* one machine, one agent (no external service): nothing to meet, so no
  protocol (:class:`OneNodeRendezvous`).  Each round is this node alone.
* etcd (many machines): :class:`EtcdRendezvous`, rounds formed by one
  transaction each (:mod:`resilient.coord.rounds`): no node hosts the
  state the others depend on, a restart does not wait for a node its peers
  judged lost, and a running round costs the store nothing.

Each launch of a run has its own rendezvous (see
:mod:`resilient.coord.launch`); the generation counter is the run's.  A
round's result names the generation it starts and a fresh
``MASTER_ADDR:MASTER_PORT`` on its first node for the workers, so workers
of a new generation never meet a store left over from the previous one (the
stale-address failure seen with a store shared across restarts).
"""

from __future__ import annotations

import random
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ..coord.etcd_transport import NOT_FOUND
from ..coord.keyspace import GENERATION, rendezvous_space, run_root
from ..coord.proof import Seal
from ..coord.rounds import (
    RendezvousClosedError,
    RendezvousTimeoutError,
    Round,
    RoundKeys,
    RoundStore,
    Waiting,
    ready_to_close,
)
from ..coord.store import ControlStore, ControlStoreError, Entry, StoreRequestError
from ..coord.watch import PrefixWatch, View
from ..core.errors import ConfigError

RECHECK_S = 10.0
"""A node waiting in a round asks who closes it again when the live nodes change, and else this often (a closer
that withdrew while its agent lives on, or whose join lapsed and was made again behind others'): one request per
waiting node per 10 s."""


@dataclass(frozen=True)
class Assignment:
    """This node's place in a completed rendezvous round."""

    node_rank: int
    num_nodes: int
    generation: int
    master_addr: str
    master_port: int
    members: tuple[str, ...] = ()
    """The round's nodes in node-rank order (empty on one machine)."""
    previous: tuple[str, ...] = ()
    """The round before's, as far as the store still holds it (empty when it does not): whose ranks were whose."""


@dataclass(frozen=True, kw_only=True)
class RendezvousTimeouts:
    """How long each phase of a rendezvous may take."""

    join_s: float = 600.0
    """Give up joining after this long (a node that never sees enough peers)."""
    last_call_s: float = 1.0
    """After the minimum number of nodes joined, wait this long for more before forming the round (not waited
    for when every live node of the previous round has joined)."""


class OneNodeRendezvous:
    """The rendezvous of a run on one machine under one agent: every round is this node alone, node rank 0 of 1,
    with the run's next generation number and a fresh port on ``local_addr`` for the workers' store."""

    def __init__(self, control: ControlStore, local_addr: str) -> None:
        self._control = control
        self._local_addr = local_addr
        self._closed = False

    def next(self) -> Assignment:
        """The next round, at once; raises :class:`RendezvousClosedError` once closed."""
        if self._closed:
            raise RendezvousClosedError("the rendezvous is closed")
        generation = self._control.add(GENERATION, 1)
        return Assignment(0, 1, generation, self._local_addr, free_port(self._local_addr))

    def num_nodes_waiting(self) -> int:
        return 0  # no other node can join a run on one machine

    def close(self) -> None:
        self._closed = True

    def is_closed(self) -> bool:
        return self._closed

    def leave(self) -> None:
        pass  # no peer waits for this node

    def shutdown(self) -> None:
        self._closed = True


class EtcdRendezvous:
    """This node's side of the launch's rounds in etcd (:mod:`resilient.coord.rounds` has the protocol).

    ``live()``: the nodes judged alive now (presence and probes); ``lease()``: this node's presence lease, which
    its joins live on.  :meth:`next` blocks until a round takes this node; the closer's watch of the joins and
    every joiner's watch of ``out/`` wake it, ``poll_s`` bounds a wait for a local judgement (a closer judged
    lost, a last call ending)."""

    def __init__(self, client: Any, space: str, counter_key: str, node: str, local_addr: str, *, min_nodes: int,
                 max_nodes: int, timeouts: RendezvousTimeouts, lease: Callable[[], int],
                 live: Callable[[], frozenset[str]], on_error: Callable[[str], None] = lambda _: None,
                 on_crash: Callable[[str, str], None] = lambda _error, _trace: None,
                 clock: Callable[[], float] = time.monotonic, poll_s: float = 0.1, recheck_s: float = RECHECK_S,
                 seal: Seal, floor: Callable[[], int] = lambda: 0,
                 renew_lease: Callable[[], int] | None = None) -> None:
        """``seal``: signs this node's values and checks the others' with the run token (a forged one counts for
        nothing); ``floor()``: the newest generation the launch's recovery keys name (see :class:`RoundStore`).
        ``renew_lease()``: renews ``lease()`` now (a new one if it expired), for a join etcd refused because the
        lease it named had expired before this node's presence noticed."""
        if not 1 <= min_nodes <= max_nodes:
            raise ConfigError(f"nodes {min_nodes}:{max_nodes} are invalid: need 1 <= min_nodes <= max_nodes")
        self._store = RoundStore(client, space, counter_key, seal, floor)
        self._client = client
        self._node = node
        self._addr = local_addr
        self._min, self._max = min_nodes, max_nodes
        self._timeouts = timeouts
        self._lease = lease
        self._renew_lease = renew_lease
        self._live = live
        self._on_error = on_error
        self._on_crash = on_crash
        self._clock = clock
        self._poll = poll_s
        self._recheck = recheck_s
        self._wake = threading.Condition()
        self._out: PrefixWatch | None = None
        self._round: Round | None = None
        """The last round that took this node."""
        self._joined: int | None = None
        """The round this node has joined and waits in."""
        self.formed: list[tuple[int, str]] = []
        """The rounds this node formed as their closer, with the reason (for its events and tests)."""

    # ------------------------------------------------------------ watches
    def _notify(self) -> None:
        with self._wake:
            self._wake.notify_all()

    def _watch_out(self) -> PrefixWatch:
        if self._out is None:
            self._out = PrefixWatch(self._client, self._store.keys.out, on_change=self._notify,
                                    on_error=self._on_error, on_crash=self._on_crash).start()
        return self._out

    def _sleep(self, seconds: float) -> None:
        with self._wake:
            self._wake.wait(seconds)

    def _result(self, view: View, n: int) -> Round | None:
        return self._store.round_of(view.entries.get(self._store.keys.result(n)))

    # ------------------------------------------------------------ the round
    def next(self) -> Assignment:
        """Join the next round and wait until one takes this node; raises :class:`RendezvousClosedError` or
        :class:`RendezvousTimeoutError` (the store's errors pass through)."""
        out = self._watch_out()
        deadline = self._clock() + self._timeouts.join_s
        while True:
            if self._store.closed(out.view().entries):
                raise RendezvousClosedError("the rendezvous is closed: the run is over")
            lease = self._lease()
            try:
                n = self._store.join(self._node, {"addr": self._addr, "port": free_port(self._addr)}, lease)
            except StoreRequestError as e:
                if e.code != NOT_FOUND or self._renew_lease is None or self._clock() >= deadline:
                    raise
                self._on_error(f"joining round: the lease {lease} had expired ({e}); renewing it")
                self._renew_lease()  # a partition or outage outlived it: a new one, the presence key written again
                continue
            self._joined = n
            formed = self._await(n, deadline, lease)
            self._joined = None
            if formed is None:
                continue  # this node's presence moved to a new lease (an outage outlived the old): its join lapsed
            if self._node in formed.members:
                self._round = formed
                before = self._result(out.view(), formed.number - 1) if formed.number > 0 else None
                return Assignment(formed.members.index(self._node), len(formed.members), formed.generation,
                                  formed.master_addr, formed.master_port, members=formed.members,
                                  previous=before.members if before is not None else ())
            # Round n formed without this node (it joined as the round formed, or the round was full): the next.

    def _await(self, n: int, deadline: float, lease: int) -> Round | None:
        out = self._watch_out()
        keys = self._store.keys
        joins_watch: PrefixWatch | None = None
        closer: str | None = None
        checked = -1e9
        judged: frozenset[str] | None = None
        min_since: float | None = None
        try:
            while True:
                view = out.view()
                formed = self._result(view, n)
                if formed is not None:
                    return formed
                if self._store.closed(view.entries):
                    raise RendezvousClosedError("the rendezvous is closed: the run is over")
                now = self._clock()
                if now >= deadline:
                    self._withdraw(n)
                    raise RendezvousTimeoutError(
                        f"no round of {self._min}..{self._max} nodes took {self._node} in "
                        f"{self._timeouts.join_s:g} s (--rdzv-join-timeout): are the other nodes' agents started "
                        "with the same run id and store?")
                if self._lease() != lease:
                    return None
                live = self._live()
                if closer is None or live != judged or now - checked >= self._recheck:
                    closer, checked, judged = self._store.closer(n, live), now, live
                if closer != self._node:
                    self._sleep(self._poll)
                    continue
                if joins_watch is None:
                    joins_watch = PrefixWatch(self._client, keys.joins(n), on_change=self._notify,
                                              on_error=self._on_error, on_crash=self._on_crash).start()
                entries = {k: e for k, e in joins_watch.view().entries.items() if self._store.value(e) is not None}
                self._announce(n, view, entries.keys())
                joins = {RoundKeys.node_of(k): e for k, e in entries.items() if RoundKeys.node_of(k) in live}
                min_since = (min_since if min_since is not None else now) if len(joins) >= self._min else None
                previous = self._result(view, n - 1)
                why = ready_to_close(
                    len(joins), min_nodes=self._min, max_nodes=self._max,
                    previous_joined=previous is not None and (set(previous.members) & live) <= joins.keys(),
                    min_for_s=None if min_since is None else now - min_since, last_call_s=self._timeouts.last_call_s)
                if why is not None:
                    formed_now = self._form(n, joins, previous)
                    if formed_now is not None:
                        self.formed.append((n, why))
                        self._store.tidy(n)
                        return formed_now
                self._sleep(self._poll)
        finally:
            if joins_watch is not None:
                joins_watch.close()

    def _form(self, n: int, joins: dict[str, Entry], previous: Round | None) -> Round | None:
        try:
            return self._store.form(n, joins, previous.members if previous is not None else (), self._max)
        except ControlStoreError as e:  # its answer lost: the next pass reads the result if it landed
            self._on_error(f"forming round {n}: {type(e).__name__}: {e}")
            return None

    def _announce(self, n: int, view: View, joins: Iterable[str]) -> None:
        """As round n's closer: say in ``out/waiting`` who waits in it (members of the round before, and nodes
        new to it), written again only when that changes."""
        previous = self._result(view, n - 1)
        before = set(previous.members) if previous is not None else set()
        names = {RoundKeys.node_of(k) for k in joins}
        waiting = Waiting(n, bool(names & before), bool(names - before))
        found = self._store.value(view.entries.get(self._store.keys.waiting))
        if found is None or Waiting.of(found) != waiting:
            self._store.announce_waiting(waiting)

    def _withdraw(self, n: int) -> None:
        try:
            self._store.withdraw(n, self._node)
        except ControlStoreError:
            pass  # it lapses with this node's lease

    def num_nodes_waiting(self) -> int:
        """Nodes waiting to join while this node's round runs: a reason to restart the group so that they can
        (0 when the round is already full: they wait for room, as torch's redundant nodes do)."""
        if self._out is None or self._round is None:
            return 0
        found = self._store.value(self._out.view().entries.get(self._store.keys.waiting))
        if found is None:
            return 0
        waiting = Waiting.of(found)
        mine = self._round
        if waiting.number <= mine.number:
            return 0
        if waiting.number > mine.number + 1 or waiting.members:
            return 1  # this node's round was left by a member, or others formed rounds since
        return 1 if waiting.new and len(mine.members) < self._max else 0

    def close(self) -> None:
        """Close the rendezvous for every node: the run is over."""
        self._store.close(f"closed by {self._node}")

    def is_closed(self) -> bool:
        return self._store.closed(self._watch_out().view().entries)

    def leave(self) -> None:
        """Step out without closing: withdraw from a round this node waits in; the others' next rounds form
        without it (they wait for it at most a last call while its presence says it is alive)."""
        if self._joined is not None:
            self._withdraw(self._joined)
        if self._out is not None:
            self._out.close()
            self._out = None

    def shutdown(self) -> None:
        """Close the rendezvous for every node and stop following it."""
        try:
            self.close()
        except ControlStoreError:
            pass  # best effort at exit
        self.leave()


MASTER_PORTS_FROM = 20000
"""The lowest port the agent offers its rank-0 worker (MASTER_PORT); the highest is below the kernel's ephemeral
range."""


def ephemeral_ports(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """The range the kernel hands out ports from, to a bind to port 0 and to every outgoing connection."""
    try:
        with open(path, encoding="ascii") as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(addr: str, *, tries: int = 64) -> int:
    """A port that is free on ``addr`` now, for the rank-0 worker to bind moments later (its TCPStore).

    Chosen at random below the kernel's ephemeral range: a port the kernel picked (a bind to port 0) comes from
    the range it also gives every outgoing connection, so any process's connection may take it in the seconds
    before the worker binds it (the worker then fails to listen, and the generation restarts for nothing).  Only
    another explicit bind can take a port below the range.  Falls back to the kernel's choice when none of
    ``tries`` candidates is free.
    """
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    low, _ = ephemeral_ports()
    pool = range(MASTER_PORTS_FROM, low)
    for port in random.sample(pool, min(tries, len(pool))):
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((addr, port))
            except OSError:
                continue
            return port
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])


def etcd_rendezvous(client: Any, run_id: str, launch_id: str, node: str, local_addr: str, *, min_nodes: int,
                    max_nodes: int, timeouts: RendezvousTimeouts, lease: Callable[[], int],
                    live: Callable[[], frozenset[str]], on_error: Callable[[str], None],
                    on_crash: Callable[[str, str], None], seal: Seal,
                    floor: Callable[[], int] = lambda: 0,
                    renew_lease: Callable[[], int] | None = None) -> EtcdRendezvous:
    """Many machines: launch ``launch_id``'s rounds in its rendezvous space, numbered by the run's counter."""
    return EtcdRendezvous(client, rendezvous_space(run_id, launch_id), run_root(run_id) + GENERATION, node,
                          local_addr, min_nodes=min_nodes, max_nodes=max_nodes, timeouts=timeouts, lease=lease,
                          live=live, on_error=on_error, on_crash=on_crash, seal=seal, floor=floor,
                          renew_lease=renew_lease)
