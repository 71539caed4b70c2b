"""One decider per generation: a claim on the decider's lease, and a decision committed in one transaction.

The protocol the agents of a launch follow to decide what comes after a
generation (:mod:`resilient.agent.cluster` names the keys):

1. **Claim.** An agent creates the generation's claim key if it is absent,
   on its own lease.  Exactly one agent holds it; if that agent dies, its
   lease expires and the claim goes with it, so another agent claims and
   decides.  A claim is identified by the revision it was written at.
2. **Commit.** The decision is one transaction.  It compares: the claim is
   still at the holder's revision (it neither expired nor was taken over),
   no decision exists yet (a forged one, whose signature fails, is written
   over by comparing its revision), the run's generation counter and every spare
   the decision promotes are as the decider read them.  It then writes
   everything together: the decision, the launch's current generation, the
   counter, and each promoted spare's pool entry marked as taken.  Two
   decisions for one generation, or one spare promoted by two decisions,
   cannot both commit.
3. **Release** deletes the claim only if it is still the holder's: a
   decider whose lease expired never removes its successor's claim.
4. **In doubt** (the store failed to answer a commit), the holder withdraws
   its claim by the same compare-and-delete.  Once the claim's revision is
   gone a commit still in flight can never apply, since it compares that
   revision; the transaction's read then says whether the commit had landed
   first.  A transport that retried a commit which had already applied
   finds the decision there with its own nonce and counts it as its own.

Values are opaque here: the caller signs them, and ``nonce_of`` reads the
nonce back from a stored value only when its signature holds (a forged
claim or decision is never taken for one's own).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from .store import ControlStoreError, Entry
from .txn import Compare, Delete, Put, Txn, TxnResult

FORGED_TRIES = 8
"""A commit that finds a forged decision in its key writes over it (comparing its revision): this many tries while
forged values keep coming, then it gives up as if its claim were lost (the claim's holder tries again later)."""
NonceOf = Callable[[Entry], "str | None"]
"""The nonce a stored value carries, or None when it is not a validly signed value."""


class Transactional(Protocol):
    def txn(self, txn: Txn) -> TxnResult: ...


@dataclass(frozen=True)
class Claim:
    key: str
    nonce: str
    revision: int
    """The claim key's revision while this holder has it."""


class Outcome(Enum):
    COMMITTED = "committed"
    DECIDED = "decided"
    """Another holder's decision is there: follow it."""
    CLAIM_LOST = "claim_lost"
    """The claim expired or another agent holds it now: nothing of this commit applied."""
    COUNTER_MOVED = "counter_moved"
    """The run's generation counter moved (a restart began): nothing applied."""
    SPARES_MOVED = "spares_moved"
    """A spare the decision promotes was taken or left the pool: nothing applied; read the pool again."""
    WITHDRAWN = "withdrawn"
    """The commit was in doubt; the claim was withdrawn, so it never applies."""


@dataclass(frozen=True)
class Decision:
    key: str
    value: bytes
    nonce: str
    writes: tuple[Put, ...] = ()
    """Made with the decision: the current generation, the counter, the promoted spares' entries."""
    counter: Compare | None = None
    spares: tuple[Compare, ...] = ()


def claim(client: Transactional, key: str, value: bytes, nonce: str, lease: int, nonce_of: NonceOf) -> Claim | None:
    """Take ``key`` on ``lease`` if no valid claim holds it: the claim, or None when another agent's does.

    A value without a valid signature does not hold the key: it is replaced
    (by compare-and-set on its revision), so a forged claim cannot block the
    launch.
    """
    compare = Compare.absent(key)
    for _ in range(8):
        result = client.txn(Txn((compare,), (Put(key, value, lease),), read=(key,)))
        entry = result.entries.get(key)
        if entry is None:
            compare = Compare.absent(key)  # the forged value compared against was deleted meanwhile: create
            continue
        found = nonce_of(entry)
        if found == nonce:
            return Claim(key, nonce, entry.mod_revision)  # ours, also when a retried create had already landed
        if found is not None:
            return None
        compare = Compare.unchanged(key, entry.mod_revision)
    return None


def release(client: Transactional, held: Claim) -> bool:
    """Delete the claim if it is still ``held``'s; False when it expired or another agent holds it now."""
    return client.txn(Txn((Compare.unchanged(held.key, held.revision),), (Delete(held.key),))).succeeded


def commit(client: Transactional, held: Claim, decision: Decision, nonce_of: NonceOf) -> Outcome:
    """Commit ``decision`` under ``held`` in one transaction (see the module doc).

    Raises :class:`ControlStoreError` only when the store answered neither
    the commit nor its withdrawal: the claim then stays on the holder's
    lease, and the decision key says, once the store answers, whether the
    commit applied.
    """
    guards = (*((decision.counter,) if decision.counter is not None else ()), *decision.spares)
    reads = (held.key, decision.key, *(g.key for g in guards))
    there = Compare.absent(decision.key)
    for _ in range(FORGED_TRIES):
        compares = (Compare.unchanged(held.key, held.revision), there, *guards)
        try:
            result = client.txn(Txn(compares, (Put(decision.key, decision.value), *decision.writes), read=reads))
        except ControlStoreError:
            return withdraw(client, held, decision, nonce_of)
        if result.succeeded:
            return Outcome.COMMITTED
        found = result.entries.get(decision.key)
        if found is None or nonce_of(found) is not None or there.holds(found):
            return why_not(result.entries, held, decision, nonce_of)  # (a forged decision counts as none there)
        there = Compare.unchanged(decision.key, found.mod_revision)  # forged: written over, never followed
    return Outcome.CLAIM_LOST


def withdraw(client: Transactional, held: Claim, decision: Decision, nonce_of: NonceOf) -> Outcome:
    """End a commit in doubt: delete the claim unless the decision is there, and say which happened."""
    there = Compare.absent(decision.key)
    for _ in range(FORGED_TRIES):
        result = client.txn(Txn((Compare.unchanged(held.key, held.revision), there),
                                (Delete(held.key),), read=(held.key, decision.key)))
        if result.succeeded:
            return Outcome.WITHDRAWN
        found = result.entries.get(decision.key)
        if found is None or nonce_of(found) is not None:
            break
        there = Compare.unchanged(decision.key, found.mod_revision)  # a forged decision is no decision
    return why_not(result.entries, held, decision, nonce_of)


def why_not(entries: dict[str, Entry | None], held: Claim, decision: Decision, nonce_of: NonceOf) -> Outcome:
    """Why a commit's comparisons failed, from what its transaction read (one revision)."""
    found = entries.get(decision.key)
    nonce = nonce_of(found) if found is not None else None
    if nonce is not None:  # a forged decision (no valid signature) counts as none
        return Outcome.COMMITTED if nonce == decision.nonce else Outcome.DECIDED
    current = entries.get(held.key)
    if current is None or current.mod_revision != held.revision:
        return Outcome.CLAIM_LOST
    if decision.counter is not None and not decision.counter.holds(entries.get(decision.counter.key)):
        return Outcome.COUNTER_MOVED
    return Outcome.SPARES_MOVED
