"""The launch's rendezvous across machines: rounds of nodes, each formed by one etcd transaction.

Keys, under the launch's rendezvous space (``/resilient/<run>/rdzv/<launch>/``):

* ``round``: the number of the round open for joining (absent: 0).  Only
  the transaction that forms a round moves it.
* ``j/<n>/<node>``: the node joined round n.  It lives on the node's
  presence lease, so a node that dies leaves its round with it.  A join
  compares ``round``, so a join never lands in a round that has formed.
* ``out/r/<n>``: round n's result: its members in node-rank order, the
  generation it starts and where that generation's workers meet.
* ``out/waiting``: a round has joiners while an earlier one runs (written
  by that round's closer): members of the running round restart to let
  them in, as they would for torch's waiting nodes.
* ``out/closed``: the run is over; nobody waits in its rendezvous.

**Who forms a round.** Its earliest live joiner (by the join's create
revision), the *closer*, follows the round's joins with a watch.  The
other joiners follow ``out/`` only, so a round of N nodes costs O(N) watch
events, not N².  When the closer dies (its peers judge it lost, or its
join lapses with its lease) the next earliest live joiner takes over.  Any
number of agents may try to form a round at once: the transaction lets one
result exist per round.

**When.** :func:`ready_to_close`: the joiners number ``max_nodes``; or at
least ``min_nodes`` and every live member of the previous round has joined
(a restart does not wait for a node its peers judged lost, nor for a last
call); or at least ``min_nodes`` for ``last_call_s``.

**How.** One transaction (:meth:`RoundStore.form`) compares ``round``, the
result's absence, the run's generation counter and, in a round of at most
:data:`COMPARED_JOINS` nodes, each member's join (still there, on the lease
it was written with), then writes the result,
moves ``round`` to n+1 and the counter to the round's generation.  A
commit whose answer was lost is settled by reading the result: a retry
finds it written.

In steady training the rendezvous costs the store nothing: no keep-alive
(a member's liveness is its presence key and its peers' probes, see
:mod:`.presence`), and one open watch stream per agent.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .store import ControlStoreError, Entry
from .txn import Compare, Put, Txn, TxnResult

COMPARED_JOINS = 100
"""A round of at most this many nodes compares each member's join in its transaction; etcd refuses a
transaction of more than 128 comparisons (``--max-txn-ops``), so a larger round compares none: a member whose
join lapsed between the closer's look and the commit is then named, fails the group's formation, and the next
round forms without it (as a node that dies just after a round formed)."""
JOIN_ATTEMPTS = 1000
"""Joins retried this many times while rounds keep forming under them (each retry means a round formed)."""


class RendezvousError(Exception):
    """The rendezvous failed (a subclass says how)."""


class RendezvousClosedError(RendezvousError):
    """The rendezvous is closed: the run is over, no round will form."""


class RendezvousTimeoutError(RendezvousError):
    """No round took this node within the join timeout."""


class RoundClient(Protocol):
    """The store calls the rounds make (:class:`~resilient.coord.etcd.EtcdClient`, or the tests' model)."""

    def txn(self, txn: Txn) -> TxnResult: ...
    def get(self, key: str) -> Entry | None: ...
    def get_prefix(self, prefix: str) -> list[Entry]: ...
    def first_created(self, prefix: str) -> tuple[Entry | None, int]: ...
    def put(self, key: str, value: bytes, *, lease: int = 0) -> int: ...
    def delete(self, key: str) -> bool: ...
    def delete_prefix(self, prefix: str) -> int: ...


@dataclass(frozen=True)
class Round:
    """A formed round: who is in it, in node-rank order, and what it starts."""

    number: int
    generation: int
    members: tuple[str, ...]
    master_addr: str
    master_port: int

    def encode(self) -> bytes:
        return json.dumps({"round": self.number, "generation": self.generation, "members": list(self.members),
                           "master_addr": self.master_addr, "master_port": self.master_port}).encode()

    @staticmethod
    def decode(value: bytes) -> Round:
        d = json.loads(value)
        return Round(int(d["round"]), int(d["generation"]), tuple(str(m) for m in d["members"]),
                     str(d["master_addr"]), int(d["master_port"]))


@dataclass(frozen=True)
class Waiting:
    """``out/waiting``: round ``number`` has joiners while an earlier round runs."""

    number: int
    members: bool
    """A member of the round before it joined (that round is broken: its members restart anyway)."""
    new: bool
    """A node that was not in the round before it joined (it waits to be let in)."""

    def encode(self) -> bytes:
        return json.dumps({"round": self.number, "members": self.members, "new": self.new}).encode()

    @staticmethod
    def decode(value: bytes) -> Waiting:
        d = json.loads(value)
        return Waiting(int(d["round"]), bool(d["members"]), bool(d["new"]))


def ready_to_close(joined: int, *, min_nodes: int, max_nodes: int, previous_joined: bool,
                   min_for_s: float | None, last_call_s: float) -> str | None:
    """Why the round may form now (None: not yet).  ``joined``: live joiners; ``previous_joined``: a previous
    round exists and every live member of it joined; ``min_for_s``: how long ``min_nodes`` or more have been
    joined (None: fewer)."""
    if joined >= max_nodes:
        return f"{joined} nodes joined, the most the run takes"
    if joined < min_nodes:
        return None
    if previous_joined:
        return "every live node of the previous round joined"
    if min_for_s is not None and min_for_s >= last_call_s:
        return f"{joined} nodes joined and no more came in the last call ({last_call_s:g} s)"
    return None


def node_order(node: str) -> tuple[Any, ...]:
    """Node ids in natural order: ``node-2`` before ``node-10``."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", node) if part)


def order_members(joins: Mapping[str, Entry], previous: Sequence[str], max_nodes: int) -> tuple[str, ...]:
    """Node-rank order: the previous round's members keep theirs, relative to each other; newcomers follow in
    their ids' natural order (the first round: ``node-0``, ``node-1``, ... ``node-10``, as a user names them);
    at most ``max_nodes``, the earliest joiners first among newcomers left over (the others wait for room)."""
    returning = [n for n in previous if n in joins]
    seen = set(returning)
    room = max(0, max_nodes - len(returning))
    first_come = sorted((n for n in joins if n not in seen), key=lambda n: (joins[n].create_revision, n))[:room]
    return tuple(returning + sorted(first_come, key=node_order))


class RoundKeys:
    def __init__(self, space: str) -> None:
        self.space = space
        self.round = space + "round"
        self.out = space + "out/"
        self.waiting = self.out + "waiting"
        self.closed = self.out + "closed"

    def joins(self, n: int) -> str:
        return f"{self.space}j/{n:08d}/"

    def join(self, n: int, node: str) -> str:
        return self.joins(n) + node

    def result(self, n: int) -> str:
        return f"{self.out}r/{n:08d}"

    @staticmethod
    def node_of(key: str) -> str:
        return key.rsplit("/", 1)[1]


class RoundStore:
    """The rounds' store operations, each a bounded number of requests (the waiting is the caller's)."""

    def __init__(self, client: RoundClient, space: str, counter_key: str) -> None:
        """``space``: the launch's rendezvous keys; ``counter_key``: the run's generation counter (a decimal,
        moved by in-process decisions too)."""
        self.client = client
        self.keys = RoundKeys(space)
        self.counter_key = counter_key

    def open_round(self) -> tuple[int, int]:
        """The round open for joining and the revision ``round`` was written at (0, 0 before the first)."""
        entry = self.client.txn(Txn((), (), read=(self.keys.round,))).entries[self.keys.round]
        return (int(entry.value), entry.mod_revision) if entry is not None else (0, 0)

    def join(self, node: str, value: Mapping[str, Any], lease: int) -> int:
        """Join the open round (on ``lease``); returns its number."""
        body = json.dumps({**value, "node": node}).encode()
        for _ in range(JOIN_ATTEMPTS):
            n, revision = self.open_round()
            done = self.client.txn(Txn((Compare.unchanged(self.keys.round, revision),),
                                       (Put(self.keys.join(n, node), body, lease),)))
            if done.succeeded:
                return n
        raise RendezvousError(f"{JOIN_ATTEMPTS} rounds formed while {node} tried to join one: "
                              "the launch's rendezvous keys are being rewritten; check what else writes under "
                              f"{self.keys.space}")

    def withdraw(self, n: int, node: str) -> None:
        self.client.delete(self.keys.join(n, node))

    def closer(self, n: int, live: Collection[str]) -> str | None:
        """Round n's earliest live joiner (None: nobody live joined)."""
        first, _count = self.client.first_created(self.keys.joins(n))
        if first is None:
            return None
        node = RoundKeys.node_of(first.key)
        if node in live:
            return node
        # The first joiner is dead but its join has not lapsed yet: look at them all (rare: once per such death).
        alive = [e for e in self.client.get_prefix(self.keys.joins(n)) if RoundKeys.node_of(e.key) in live]
        return RoundKeys.node_of(min(alive, key=lambda e: e.create_revision).key) if alive else None

    def result(self, n: int) -> Round | None:
        entry = self.client.get(self.keys.result(n))
        return Round.decode(entry.value) if entry is not None else None

    def form(self, n: int, joins: Mapping[str, Entry], previous: Sequence[str], max_nodes: int) -> Round | None:
        """Form round n of ``joins`` (node -> its join entry, live joiners only), in one transaction.

        Returns the round's result: this call's, or one already written
        (another closer's, or this closer's own commit whose answer was lost).
        None when nothing was written because a compared key moved (a member's
        join lapsed, the counter moved): look again and retry.
        """
        keys = self.keys
        read = self.client.txn(Txn((), (), read=(keys.round, self.counter_key, keys.result(n))))
        written = read.entries[keys.result(n)]
        if written is not None:
            return Round.decode(written.value)
        round_entry, counter = read.entries[keys.round], read.entries[self.counter_key]
        if (int(round_entry.value) if round_entry is not None else 0) != n:
            return self.result(n)  # formed since (its result is written in the same transaction)
        members = order_members(joins, previous, max_nodes)
        if not members:
            return None
        generation = (int(counter.value) if counter is not None else 0) + 1
        first = json.loads(joins[members[0]].value)
        formed = Round(n, generation, members, str(first["addr"]), int(first["port"]))
        compare = [Compare.unchanged(keys.round, round_entry.mod_revision if round_entry is not None else 0),
                   Compare.absent(keys.result(n)),
                   Compare.unchanged(self.counter_key, counter.mod_revision if counter is not None else 0),
                   *(Compare.unchanged(joins[m].key, joins[m].mod_revision)
                     for m in (members if len(members) <= COMPARED_JOINS else ()))]
        writes = (Put(keys.result(n), formed.encode()), Put(keys.round, str(n + 1).encode()),
                  Put(self.counter_key, str(generation).encode()))
        done = self.client.txn(Txn(tuple(compare), writes, read=(keys.result(n),)))
        if done.succeeded:
            return formed
        other = done.entries[keys.result(n)]
        return Round.decode(other.value) if other is not None else None

    def tidy(self, n: int) -> None:
        """After round n formed: drop the joins of round n-1 and results before n-1 (best effort; a reader of
        an older result that is gone re-joins)."""
        try:
            if n >= 1:
                self.client.delete_prefix(self.keys.joins(n - 1))
            if n >= 2:
                self.client.delete(self.keys.result(n - 2))
        except ControlStoreError:
            pass  # left for the next round's closer: keys under the launch go when the launch does

    def announce_waiting(self, waiting: Waiting) -> None:
        self.client.put(self.keys.waiting, waiting.encode())

    def close(self, why: str) -> None:
        self.client.put(self.keys.closed, why.encode())
