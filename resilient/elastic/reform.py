"""In-process re-formation of the process group: the worker's side of recovery rung 1.

When a peer dies, survivors keep their processes and their memory.  What
they must replace is the process group, whose connections include the dead
peer.  The agent decides who is in the next generation and publishes one
:class:`Assignment` per worker on a TCPStore that no worker hosts (rank 0
may be the one that died), under ``assign/<generation>/<worker id>``.  A
worker:

1. leaves the failed collective (gloo raises when a peer's connection
   closes) and calls :func:`abandon` at once: destroying its groups closes
   its own connections, which is what makes every *other* survivor's
   collective fail promptly too (see ``docs/design/in-process-worker.md``,
   "What gloo does when a peer dies", for what gloo does on this machine);
2. waits for its assignment (:func:`wait_for_assignment`);
3. forms the new group (:func:`reform`) under a key prefix of its own
   generation, so no key of an earlier round is ever read, and re-creates
   the sub-groups its caller registered;
4. takes the training state from the source rank
   (:mod:`resilient.elastic.state_sync`) and retries the failed step.

This module imports torch only inside its functions, so the agent can build
and publish assignments without importing torch.

Its keys (:func:`assignment_key`, :func:`abort_key`, :func:`grow_key`,
:func:`group_prefix`) are those of an agent's own TCPStore, not etcd's: they
are named here, beside their protocol, and not in
:mod:`resilient.coord.keyspace`, which names every etcd key.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ..core.errors import ResilientError

if TYPE_CHECKING:
    from torch.distributed import Store

_FORMAT = "resilient.assignment/1"

PEER_FAILURE_TEXT = (
    "connection closed by peer", "connection reset by peer", "broken pipe", "connection refused",
    "timed out", "nccl communicator was aborted", "remote process exited",
)
"""Phrases (lowercased) of the errors a survivor's collective raises when a peer died or its group was closed."""


class ReformError(ResilientError):
    """Re-forming the process group failed; the message says at which stage and what to do."""


class AssignmentError(ReformError, ValueError):
    """An assignment is malformed or inconsistent (a bug in whoever published it)."""


class AssignmentTimeoutError(ReformError):
    """No assignment arrived for this worker within the timeout."""


class ReformAborted(ReformError):
    """The generation being formed was abandoned (a member failed while it formed): wait for the next one."""


def assignment_key(generation: int, worker_id: str) -> str:
    """The store key under which the agent publishes ``worker_id``'s assignment for ``generation``."""
    return f"assign/{generation}/{worker_id}"


def abort_key(generation: int) -> str:
    """The store key by which the agent tells its workers that ``generation`` failed before it formed (a member
    died while the group was forming or taking its state): they leave it and wait for the next generation."""
    return f"abort/{generation}"


def grow_key(generation: int) -> str:
    """The store key under which the agent asks generation ``generation``'s members to grow at a step boundary.

    Its value is JSON ``{"generation": next, "at_step": S}``: every member leaves the group at the boundary
    before step ``S`` (having completed ``S`` updates) and joins generation ``next``, whose assignments the
    agent published first.
    """
    return f"grow/{generation}"


def group_prefix(generation: int) -> str:
    """The key prefix of the process group of ``generation``: fresh per generation, so no stale key is read."""
    return f"reform/g{generation}/"


@dataclass(frozen=True, kw_only=True)
class Member:
    """One worker of a generation."""

    worker_id: str
    """The worker's identity across generations (the agent's name for the process)."""
    new_rank: int
    """Its rank in the new generation."""
    old_rank: int | None = None
    """Its rank in the previous generation; None for a replacement (a promoted spare) that holds no state yet."""


@dataclass(frozen=True, kw_only=True)
class Assignment:
    """What one worker is to do in a generation; the same membership is sent to every worker.

    A worker whose ``worker_id`` is not among ``members`` is on standby in
    this generation (``rank`` is None) and waits for the next one.
    """

    generation: int
    """The generation this assignment forms; generations only move forward."""
    worker_id: str
    """The worker this assignment is addressed to."""
    members: tuple[Member, ...]
    """Every member of the new group, one per new rank."""
    source_rank: int
    """The rank (new numbering) whose state is authoritative unless a rank is found further ahead."""
    store_host: str
    """Host of the agent's TCPStore that the new group rendezvouses on."""
    store_port: int
    """Port of that store."""
    prefix: str
    """Key prefix of this generation's process group on the store."""

    def __post_init__(self) -> None:
        if not isinstance(self.generation, int) or isinstance(self.generation, bool) or self.generation < 1:
            raise AssignmentError(f"assignment generation must be an integer >= 1, not {self.generation!r}")
        if not self.members:
            raise AssignmentError(f"generation {self.generation}: an assignment needs at least one member")
        ranks = sorted(m.new_rank for m in self.members)
        if ranks != list(range(len(self.members))):
            raise AssignmentError(
                f"generation {self.generation}: new ranks must be 0..{len(self.members) - 1} once each, got {ranks}"
            )
        ids = [m.worker_id for m in self.members]
        if len(set(ids)) != len(ids):
            raise AssignmentError(f"generation {self.generation}: a worker appears twice among members {ids}")
        olds = [m.old_rank for m in self.members if m.old_rank is not None]
        if len(set(olds)) != len(olds):
            raise AssignmentError(f"generation {self.generation}: an old rank is given to two members {olds}")
        if not 0 <= self.source_rank < len(self.members):
            raise AssignmentError(
                f"generation {self.generation}: source rank {self.source_rank} is not a rank of the "
                f"{len(self.members)} members"
            )
        if self.by_rank(self.source_rank).old_rank is None:
            raise AssignmentError(
                f"generation {self.generation}: source rank {self.source_rank} is a replacement without state; "
                "name a survivor as the source"
            )
        if not self.store_host or not 0 < self.store_port < 65536:
            raise AssignmentError(f"generation {self.generation}: bad store address {self.store_host}:{self.store_port}")
        if not self.prefix:
            raise AssignmentError(f"generation {self.generation}: the process group needs a non-empty key prefix")

    def by_rank(self, rank: int) -> Member:
        return next(m for m in self.members if m.new_rank == rank)

    @property
    def me(self) -> Member | None:
        """This worker's membership; None when it is on standby in this generation."""
        return next((m for m in self.members if m.worker_id == self.worker_id), None)

    @property
    def rank(self) -> int | None:
        me = self.me
        return None if me is None else me.new_rank

    @property
    def world_size(self) -> int:
        return len(self.members)

    @property
    def replacements(self) -> tuple[int, ...]:
        """New ranks that join without state (promoted spares)."""
        return tuple(sorted(m.new_rank for m in self.members if m.old_rank is None))

    @property
    def is_replacement(self) -> bool:
        me = self.me
        return me is not None and me.old_rank is None

    def to_json(self) -> str:
        body = asdict(self)
        body["format"] = _FORMAT
        return json.dumps(body, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> Assignment:
        """Parse and validate; raises :class:`AssignmentError` naming what is wrong."""
        try:
            body = json.loads(text)
        except ValueError as e:
            raise AssignmentError(f"an assignment is not JSON ({e}): {str(text)[:120]!r}") from None
        if not isinstance(body, dict) or body.get("format") != _FORMAT:
            got = body.get("format") if isinstance(body, dict) else type(body).__name__
            raise AssignmentError(f"an assignment must be a {_FORMAT} object, got {got!r}")
        try:
            members = tuple(Member(**_fields(m, ("worker_id", "new_rank", "old_rank"))) for m in body["members"])
            fields = _fields(body, ("generation", "worker_id", "source_rank", "store_host", "store_port", "prefix"))
            return cls(members=members, **fields)
        except (KeyError, TypeError) as e:
            raise AssignmentError(f"an assignment lacks or mistypes a field ({e}): {str(text)[:200]!r}") from None


def _fields(body: Any, names: Sequence[str]) -> dict[str, Any]:
    if not isinstance(body, Mapping):
        raise TypeError(f"expected an object, got {type(body).__name__}")
    missing = [n for n in names if n not in body]
    if missing:
        raise KeyError(", ".join(missing))
    return {n: body[n] for n in names}


def plan_assignments(
    generation: int, members: Sequence[Member], source_rank: int, store_host: str, store_port: int,
    standby: Sequence[str] = (),
) -> list[Assignment]:
    """One assignment per member and per standby worker (pure: the agent publishes them)."""
    both = sorted({m.worker_id for m in members} & set(standby))
    if both:
        raise AssignmentError(f"generation {generation}: workers {both} cannot be both members and on standby")
    return [
        Assignment(generation=generation, worker_id=w, members=tuple(members), source_rank=source_rank,
                   store_host=store_host, store_port=store_port, prefix=group_prefix(generation))
        for w in [m.worker_id for m in members] + list(standby)
    ]


def publish_assignments(store: Store, assignments: Sequence[Assignment]) -> None:
    """Write each assignment under its worker's key (what the agent does to start a generation)."""
    for a in assignments:
        store.set(assignment_key(a.generation, a.worker_id), a.to_json())


def connect_store(host: str, port: int, timeout_s: float) -> Store:
    """A client of the agent's TCPStore (never the master: no worker hosts the store)."""
    import torch.distributed as dist

    try:
        return dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, dist.DistError) as e:
        raise ReformError(
            f"cannot reach the agent's store at {host}:{port} within {timeout_s:g} s ({e}); "
            "in-process recovery needs the agent alive, so the run falls back to a restart"
        ) from None


def reach_store(host: str, port: int, timeout_s: float, generation: int, aborted: Callable[[], bool],
                clock: Callable[[], float] = time.monotonic) -> Store:
    """:func:`connect_store` to the store generation ``generation`` forms on, a second at a time, leaving when
    ``aborted()`` says the generation was abandoned: the agent hosting that store may be gone, and a connection
    to a dead port is otherwise retried until ``timeout_s``."""
    deadline = clock() + timeout_s
    while True:
        try:
            store = connect_store(host, port, max(0.1, min(1.0, deadline - clock())))
            store.set_timeout(timedelta(seconds=timeout_s))  # its later waits keep the whole bound
            return store
        except ReformError:
            if aborted():
                raise ReformAborted(f"the store generation {generation} forms on ({host}:{port}) is unreachable and "
                                    "the generation was abandoned; waiting for the next one") from None
            if clock() >= deadline:
                raise


def wait_for_assignment(
    store: Store, worker_id: str, after_generation: int, timeout_s: float,
    clock: Callable[[], float] = time.monotonic,
) -> Assignment:
    """Block until this worker is a member of a generation after ``after_generation``; return that assignment.

    Standby assignments (generations this worker is not part of) are
    skipped.  Raises :class:`AssignmentTimeoutError` when none arrives in
    ``timeout_s`` seconds, :class:`ReformError` when the store cannot be
    reached, :class:`AssignmentError` on a malformed assignment.
    """
    import torch.distributed as dist

    deadline = clock() + timeout_s
    generation = after_generation + 1
    while True:
        key = assignment_key(generation, worker_id)
        remaining = deadline - clock()
        try:
            if remaining <= 0:
                raise _timed_out(worker_id, generation, key, timeout_s, "deadline passed")
            store.wait([key], timedelta(seconds=remaining))
            raw = store.get(key)
        except dist.DistStoreError as e:
            raise _timed_out(worker_id, generation, key, timeout_s, str(e)) from None
        except (RuntimeError, dist.DistError) as e:
            raise ReformError(f"worker {worker_id}: the agent's store failed while waiting for {key!r}: {e}") from None
        assignment = Assignment.from_json(raw)
        if assignment.worker_id != worker_id or assignment.generation != generation:
            raise AssignmentError(
                f"key {key!r} holds the assignment of worker {assignment.worker_id!r} for generation "
                f"{assignment.generation}, not of worker {worker_id!r} for generation {generation}"
            )
        if assignment.rank is not None:
            return assignment
        generation += 1



def wait_until_assigned(store: Store, worker: str, generation: int, timeout_s: float) -> Assignment:
    """A spare's wait for its assignment: no bound of its own (the agent ends a spare it no longer needs)."""
    while True:
        try:
            return wait_for_assignment(store, worker, generation, timeout_s)
        except AssignmentTimeoutError:
            continue

def _timed_out(worker_id: str, generation: int, key: str, timeout_s: float, detail: str) -> AssignmentTimeoutError:
    return AssignmentTimeoutError(
        f"worker {worker_id}: no assignment for generation {generation} within {timeout_s:g} s "
        f"(store key {key!r}: {detail}); the agent announced no new generation for it, so this worker cannot "
        "recover in process and should exit for a restart"
    )


def is_peer_failure(error: BaseException) -> bool:
    """Whether ``error`` is what a collective raises when a peer died or left: retry in a new generation.

    torch raises ``DistBackendError``/``DistNetworkError`` for gloo's lost
    connections, and a plain ``RuntimeError`` from some paths (e.g. DDP's
    reducer), so the message is read as well.
    """
    import torch.distributed as dist

    if isinstance(error, (dist.DistBackendError, dist.DistNetworkError)):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(p in text for p in PEER_FAILURE_TEXT)


def abandon() -> float:
    """Destroy the default process group and every sub-group now; return the seconds it took.

    Closing this rank's connections is what makes its peers' pending
    collectives fail at once instead of at their timeout, so a survivor
    calls this as soon as it caught the error.  gloo closes them only when
    the group object itself is destroyed (its ``shutdown()`` and ``abort()``
    leave them open), so drop every other reference first: the DDP wrapper,
    and the exception's traceback (call this after leaving the ``except``
    block).  A reference kept elsewhere leaves peers waiting until their
    collective timeout, and a group destroyed later by DDP's reducer can
    deadlock in torch 2.13 (see ``docs/design/in-process-worker.md``).  Idempotent.
    """
    import torch.distributed as dist

    started = time.monotonic()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    return time.monotonic() - started


@dataclass(frozen=True)
class Reformed:
    """The outcome of :func:`reform`: the new group's shape, the re-created sub-groups and where the time went."""

    assignment: Assignment
    subgroups: tuple[Any, ...]
    """What each sub-group callback returned, in order."""
    abandon_s: float
    form_s: float
    """Connecting to the store and forming the default group (waits for every member)."""
    subgroups_s: float


ARRIVAL_POLL_S = (0.005, 0.1)
"""How often a member waiting for the others to arrive looks again (first, and at most: the interval grows by half
each time, so a quick formation is seen at once and a slow one costs the stores little)."""


def _arrive(store: Store, assignment: Assignment, timeout_s: float, aborted: Callable[[], bool],
            clock: Callable[[], float]) -> None:
    """Count this member in and wait until every member arrived, leaving as soon as ``aborted()`` says the
    generation was abandoned: a member that died before it arrived would otherwise hold the others in
    ``init_process_group`` until its timeout (it cannot be interrupted)."""
    import torch.distributed as dist

    count, everyone = f"{assignment.prefix}arrived", f"{assignment.prefix}all-arrived"
    deadline = clock() + timeout_s
    pause, longest = ARRIVAL_POLL_S
    try:
        if store.add(count, 1) >= assignment.world_size:
            store.set(everyone, "1")  # the last to arrive says so: the others look for one key, not the count
            return
        while not store.check([everyone]):
            if aborted():
                raise ReformAborted(
                    f"worker {assignment.worker_id}: generation {assignment.generation} was abandoned while it formed "
                    f"({store.add(count, 0)} of {assignment.world_size} members had arrived): a member failed; "
                    "waiting for the next generation")
            if clock() > deadline:
                raise ReformError(
                    f"worker {assignment.worker_id}: generation {assignment.generation}: {store.add(count, 0)} of "
                    f"{assignment.world_size} members arrived within {timeout_s:g} s; the agent should announce "
                    "another generation or restart the group")
            time.sleep(pause)
            pause = min(longest, pause * 1.5)
    except (RuntimeError, dist.DistError) as e:
        raise ReformError(f"worker {assignment.worker_id}: the store generation {assignment.generation} forms on "
                          f"failed ({e}): its agent may be gone; waiting for the next generation") from None


def reform(
    assignment: Assignment, *, timeout_s: float, store: Store | None = None,
    subgroups: Sequence[Callable[[], Any]] = (), clock: Callable[[], float] = time.monotonic,
    collective_timeout: timedelta | None = None, aborted: Callable[[], bool] | None = None,
) -> Reformed:
    """Abandon the current groups and form the one ``assignment`` describes (gloo).

    The members first count in on the store and wait for each other there (every member of a generation joins
    through here, so each counts), interruptibly: ``aborted`` says whether the agent abandoned the generation
    meanwhile (:class:`ReformAborted`; None: never).
    ``timeout_s`` bounds forming the group (every member must arrive);
    ``collective_timeout`` is the new group's collective timeout once formed
    (the script's, :func:`resilient.elastic.groups.collective_timeout`;
    None: ``timeout_s`` stays).  ``store``: an existing client of
    the agent's store (one is connected otherwise).  ``subgroups``: callbacks
    that re-create the caller's sub-groups (``dist.new_group``), run in the
    same order on every rank once the default group exists.  Raises
    :class:`ReformError` when the group cannot be formed.
    """
    import torch.distributed as dist

    rank = assignment.rank
    if rank is None:
        raise AssignmentError(
            f"worker {assignment.worker_id} is on standby in generation {assignment.generation}; "
            "wait for an assignment that makes it a member"
        )
    started = clock()
    abandon()
    abandoned = clock()
    base = store if store is not None else connect_store(assignment.store_host, assignment.store_port, timeout_s)
    _arrive(base, assignment, timeout_s, aborted or (lambda: False), clock)
    try:
        dist.init_process_group(
            "gloo", store=dist.PrefixStore(assignment.prefix, base), rank=rank,
            world_size=assignment.world_size, timeout=timedelta(seconds=timeout_s),
        )
    except (RuntimeError, dist.DistError) as e:
        abandon()
        raise ReformError(
            f"worker {assignment.worker_id}: generation {assignment.generation} (rank {rank} of "
            f"{assignment.world_size}) could not form its group within {timeout_s:g} s: {e}. A member did not "
            "arrive; the agent should announce another generation or restart the group"
        ) from None
    if collective_timeout is not None:
        from .groups import set_collective_timeout

        set_collective_timeout(collective_timeout)
    formed = clock()
    made = tuple(make() for make in subgroups)
    return Reformed(assignment, made, abandoned - started, formed - abandoned, clock() - formed)
