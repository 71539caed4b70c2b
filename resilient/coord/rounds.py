"""The launch's rendezvous across machines: rounds of nodes, each formed by one etcd transaction.

Keys, under the launch's rendezvous space (``/resilient/<run>/rdzv/<launch>/``,
named by :class:`~resilient.coord.keyspace.RoundKeys`):

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

**Proofs.** Every value here is signed with the run token and bound to its
key (:class:`~resilient.coord.proof.Seal`): a join, a result, ``waiting``,
``closed``, ``round`` and the counter written without the token are ignored
and reported (the agent's ``forged_key`` event).  A forged join is no
joiner, a forged result directs no worker, a forged ``closed`` ends
nothing; a forged ``round`` or counter is read as what the launch's signed
results say (the round after the newest result; the newest generation known)
and written over by the next round that forms.

In steady training the rendezvous costs the store nothing: no keep-alive
(a member's liveness is its presence key and its peers' probes, see
:mod:`.presence`), and one open watch stream per agent.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .keyspace import RoundKeys
from .proof import Seal
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

    def body(self) -> dict[str, Any]:
        return {"round": self.number, "generation": self.generation, "members": list(self.members),
                "master_addr": self.master_addr, "master_port": self.master_port}

    @staticmethod
    def of(d: Mapping[str, Any]) -> Round:
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

    def body(self) -> dict[str, Any]:
        return {"round": self.number, "members": self.members, "new": self.new}

    @staticmethod
    def of(d: Mapping[str, Any]) -> Waiting:
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


class RoundStore:
    """The rounds' store operations, each a bounded number of requests (the waiting is the caller's)."""

    def __init__(self, client: RoundClient, space: str, counter_key: str, seal: Seal,
                 floor: Callable[[], int] = lambda: 0) -> None:
        """``space``: the launch's rendezvous keys; ``counter_key``: the run's generation counter (moved by
        in-process decisions too); ``seal``: signs and checks every value with the run token.  ``floor()``: the
        newest generation the launch's other signed keys name (read only when the counter is forged)."""
        self.client = client
        self.keys = RoundKeys(space)
        self.counter_key = counter_key
        self.seal = seal
        self._floor = floor

    def value(self, entry: Entry | None) -> dict[str, Any] | None:
        """``entry``'s value if it is there and its proof holds (a forged one is reported)."""
        return self.seal.open(entry) if entry is not None else None

    def round_of(self, entry: Entry | None) -> Round | None:
        found = self.value(entry)
        return Round.of(found) if found is not None else None

    def _newest_result(self) -> Round | None:
        results = [self.round_of(e) for e in self.client.get_prefix(self.keys.results)]
        return max((r for r in results if r is not None), key=lambda r: r.number, default=None)

    def _open_number(self, entry: Entry | None) -> int:
        if entry is None:
            return 0
        found = self.value(entry)
        if found is not None:
            return int(found["round"])
        newest = self._newest_result()  # forged: the round after the newest signed result is the open one
        return newest.number + 1 if newest is not None else 0

    def counter_of(self, entry: Entry | None) -> int:
        """The generation a counter entry says: its signed value, or (forged) the newest the launch knows."""
        if entry is None:
            return 0
        found = self.value(entry)
        if found is not None:
            return int(found["generation"])
        newest = self._newest_result()
        return max(self._floor(), newest.generation if newest is not None else 0)

    def open_round(self) -> tuple[int, int]:
        """The round open for joining and the revision ``round`` was written at (0, 0 before the first)."""
        entry = self.client.txn(Txn((), (), read=(self.keys.round,))).entries[self.keys.round]
        return (self._open_number(entry), entry.mod_revision) if entry is not None else (0, 0)

    def join(self, node: str, value: Mapping[str, Any], lease: int) -> int:
        """Join the open round (on ``lease``); returns its number."""
        for _ in range(JOIN_ATTEMPTS):
            n, revision = self.open_round()
            key = self.keys.join(n, node)
            done = self.client.txn(Txn((Compare.unchanged(self.keys.round, revision),),
                                       (Put(key, self.seal.seal(key, {**value, "node": node}), lease),)))
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
        if node in live and self.value(first) is not None:
            return node
        # The first joiner is dead but its join has not lapsed yet, or its join is forged: look at them all (rare).
        alive = [e for e in self.client.get_prefix(self.keys.joins(n))
                 if RoundKeys.node_of(e.key) in live and self.value(e) is not None]
        return RoundKeys.node_of(min(alive, key=lambda e: e.create_revision).key) if alive else None

    def result(self, n: int) -> Round | None:
        return self.round_of(self.client.get(self.keys.result(n)))

    def form(self, n: int, joins: Mapping[str, Entry], previous: Sequence[str], max_nodes: int) -> Round | None:
        """Form round n of ``joins`` (node -> its join entry, live joiners only), in one transaction.

        Returns the round's result: this call's, or one already written
        (another closer's, or this closer's own commit whose answer was lost).
        None when nothing was written because a compared key moved (a member's
        join lapsed, the counter moved): look again and retry.  Joins whose
        proof fails are left out; a forged result is written over.
        """
        keys = self.keys
        read = self.client.txn(Txn((), (), read=(keys.round, self.counter_key, keys.result(n))))
        written = read.entries[keys.result(n)]
        if written is not None and (found := self.round_of(written)) is not None:
            return found
        round_entry, counter = read.entries[keys.round], read.entries[self.counter_key]
        if self._open_number(round_entry) != n:
            return self.result(n)  # formed since (its result is written in the same transaction)
        signed = {m: e for m, e in joins.items() if self.value(e) is not None}
        members = order_members(signed, previous, max_nodes)
        if not members:
            return None
        generation = self.counter_of(counter) + 1
        first = self.value(signed[members[0]])
        assert first is not None
        formed = Round(n, generation, members, str(first["addr"]), int(first["port"]))
        compare = [Compare.unchanged(keys.round, round_entry.mod_revision if round_entry is not None else 0),
                   Compare.unchanged(keys.result(n), written.mod_revision if written is not None else 0),
                   Compare.unchanged(self.counter_key, counter.mod_revision if counter is not None else 0),
                   *(Compare.unchanged(signed[m].key, signed[m].mod_revision)
                     for m in (members if len(members) <= COMPARED_JOINS else ()))]
        seal = self.seal.seal
        writes = (Put(keys.result(n), seal(keys.result(n), formed.body())),
                  Put(keys.round, seal(keys.round, {"round": n + 1})),
                  Put(self.counter_key, seal(self.counter_key, {"generation": generation})))
        done = self.client.txn(Txn(tuple(compare), writes, read=(keys.result(n),)))
        if done.succeeded:
            return formed
        return self.round_of(done.entries[keys.result(n)])

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
        self.client.put(self.keys.waiting, self.seal.seal(self.keys.waiting, waiting.body()))

    def close(self, why: str) -> None:
        self.client.put(self.keys.closed, self.seal.seal(self.keys.closed, {"why": why}))

    def closed(self, entries: Mapping[str, Entry]) -> bool:
        """Whether the watched ``out/`` entries hold a signed ``closed``."""
        return self.value(entries.get(self.keys.closed)) is not None
