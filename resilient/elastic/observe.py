"""What the recovery decision observes: the fault, the membership, the spare pool, the survivors' state.

These frozen dataclasses are the contract between the node agent (which
gathers them from its workers and the store) and the pure ladder in
:mod:`resilient.elastic.decide`.  They check their own consistency on
construction and say what is wrong, so a mistake in the gathering fails
where it is made, not as an odd decision later.  The restart policy is not
in them: the agent's one decision (:mod:`resilient.agent.decision`) asks it
after the ladder.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType


class FaultKind(enum.Enum):
    """What went wrong, as far as the ladder cares."""

    CRASH = "crash"
    """A rank's process exited non-zero or died by a signal."""
    HANG = "hang"
    """A rank overran its section timeout; the agent kills it, so it is lost like a crash."""
    NODE_LOST = "node_lost"
    """A node (its agent and every rank on it) is gone."""
    COLLECTIVE_ERROR = "collective_error"
    """A collective failed on ranks that are all still alive (a transient network error)."""
    UNHEALTHY = "unhealthy"
    """A node failed its health check: its ranks may be alive, but they must move off it."""
    STRAGGLER = "straggler"
    """A rank persistently slower than its peers, ended by the agent because replacing or dropping it costs less
    than keeping it (:mod:`resilient.elastic.evict`); lost like a crash."""


def ranks_text(ranks: Iterable[int], *, verb: bool = True) -> str:
    """``rank 1 is`` / ``ranks 1, 3 are`` (``verb=False``: ``rank 1`` / ``ranks 1, 3``)."""
    listed = sorted(ranks)
    words = f"rank{'s' if len(listed) != 1 else ''} {', '.join(map(str, listed))}"
    if not verb:
        return words
    return f"{words} {'are' if len(listed) != 1 else 'is'}"


@dataclass(frozen=True, kw_only=True)
class Fault:
    """One failure of the group, as the agent classified it (several ranks of one event together)."""

    kind: FaultKind
    step: int
    """The step whose attempt failed; survivors that completed the step before it hold ``step - 1``."""
    ranks: frozenset[int] = frozenset()
    """Ranks whose process died or hung (CRASH, HANG; any kind may name ranks already gone)."""
    nodes: frozenset[str] = frozenset()
    """NODE_LOST: the nodes gone, with all their ranks; UNHEALTHY: the nodes that failed their check."""
    exit_codes: frozenset[int] = frozenset()
    """Non-zero exit codes of the failed ranks; 78 or 79 (the exit-code contract) stop the run."""
    detail: str = ""
    """The failure in words for the reason (e.g. the agent's ``Failure.describe()``); derived when empty."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", frozenset(self.ranks))
        object.__setattr__(self, "nodes", frozenset(self.nodes))
        object.__setattr__(self, "exit_codes", frozenset(self.exit_codes))
        if self.kind in (FaultKind.CRASH, FaultKind.HANG, FaultKind.STRAGGLER) and not self.ranks:
            raise ValueError(f"a {self.kind.value} Fault needs the ranks that failed (ranks=...), got none")
        if self.kind in (FaultKind.NODE_LOST, FaultKind.UNHEALTHY) and not self.nodes:
            raise ValueError(f"a {self.kind.value} Fault needs the nodes concerned (nodes=...), got none")
        if self.kind is FaultKind.COLLECTIVE_ERROR and (self.ranks or self.nodes):
            raise ValueError(
                "a collective_error Fault means every rank is alive; a lost rank or node is a crash, hang or "
                f"node_lost Fault (got ranks={sorted(self.ranks)}, nodes={sorted(self.nodes)})"
            )
        if 0 in self.exit_codes:
            raise ValueError("Fault.exit_codes holds the non-zero exit codes of failed ranks; 0 is a success")
        if self.step < 0:
            raise ValueError(f"Fault.step={self.step} must be >= 0")

    def describe(self) -> str:
        """The failure in one line: ``detail`` when given, else built from the kind, ranks and nodes."""
        if self.detail:
            return self.detail
        nodes = ", ".join(sorted(self.nodes))
        what = {
            FaultKind.CRASH: f"{ranks_text(self.ranks, verb=False)} failed",
            FaultKind.HANG: f"{ranks_text(self.ranks, verb=False)} hung",
            FaultKind.STRAGGLER: f"{ranks_text(self.ranks, verb=False)} was evicted as a straggler",
            FaultKind.NODE_LOST: f"node {nodes} was lost",
            FaultKind.COLLECTIVE_ERROR: "a collective failed",
            FaultKind.UNHEALTHY: f"node {nodes} is unhealthy",
        }[self.kind]
        return f"{what} at step {self.step}"


@dataclass(frozen=True, kw_only=True)
class Spare:
    """One worker of the spare pool: started, waiting in ``resilient.Run()`` to take a rank."""

    id: str
    node: str
    healthy: bool = True
    """Its node passes the health check."""
    warm: bool = True
    """Imports done, model built, newest committed checkpoint read into memory: it can take a rank now."""
    ready_since: float | None = None
    """Agent clock when it became warm; None when unknown (chosen last, never settled enough to grow onto)."""
    claimed: bool = False
    """Already taken by an earlier promotion (the store's compare-and-set holds it): never assign it again."""

    @property
    def usable(self) -> bool:
        """Healthy, warm and unclaimed."""
        return self.healthy and self.warm and not self.claimed


def pick_spares(spares: Iterable[Spare], count: int, *, avoid_nodes: frozenset[str]) -> list[Spare]:
    """Up to ``count`` distinct usable spares not on ``avoid_nodes``, longest ready first, then by id."""
    chosen: dict[str, Spare] = {}
    for spare in sorted(spares, key=lambda s: (s.ready_since is None, s.ready_since or 0.0, s.id)):
        if len(chosen) == count:
            break
        if spare.usable and spare.node not in avoid_nodes and spare.id not in chosen:
            chosen[spare.id] = spare
    return list(chosen.values())


@dataclass(frozen=True, kw_only=True)
class Membership:
    """The current world and the bounds it may move within."""

    rank_nodes: tuple[str, ...]
    """Node of each rank of the current world, indexed by rank; its length is the world size."""
    min_size: int
    """Fewest ranks the run may continue on (``--nproc-per-node MIN:MAX`` or ``--nnodes MIN:MAX``, in ranks)."""
    max_size: int
    """Most ranks the run may use."""
    full_size: int
    """World size the run was sized for (its global batch was fixed at this size)."""
    feasible_world_sizes: frozenset[int]
    """World sizes at which the batch plan keeps the global batch; a shrink or grow lands only on these."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "rank_nodes", tuple(self.rank_nodes))
        object.__setattr__(self, "feasible_world_sizes", frozenset(self.feasible_world_sizes))
        if not 1 <= self.min_size <= self.full_size <= self.max_size:
            raise ValueError(
                f"Membership needs 1 <= min_size <= full_size <= max_size, got {self.min_size}, {self.full_size}, "
                f"{self.max_size}"
            )
        if not self.min_size <= self.world_size <= self.max_size:
            raise ValueError(
                f"Membership has {self.world_size} ranks (len(rank_nodes)) outside min_size..max_size = "
                f"{self.min_size}..{self.max_size}"
            )
        bad = sorted(n for n in self.feasible_world_sizes if n < 1)
        if bad:
            raise ValueError(f"Membership.feasible_world_sizes holds sizes below 1: {bad}")

    @property
    def world_size(self) -> int:
        """Ranks in the current world."""
        return len(self.rank_nodes)


@dataclass(frozen=True, kw_only=True)
class Observation:
    """Everything the recovery decision looks at for one fault."""

    fault: Fault
    membership: Membership
    spares: Sequence[Spare] = ()
    survivor_steps: Mapping[int, int] = field(default_factory=dict)
    """Last completed step each surviving rank reported; in-process recovery needs them all equal."""
    diverged: frozenset[int] = frozenset()
    """Ranks that reported their in-memory state diverged from their peers'."""
    dirty: frozenset[int] = frozenset()
    """Survivors that failed inside the optimizer's update (or after it, their step unfinished): their state is
    partial, so they are never a source of state; they take it from a clean rank."""
    opted_in: bool = False
    """Every worker runs ``Run(ddp=True)`` with its step under ``run.attempt()``; else restart-based only."""
    declined: str | None = None
    """Why the workers said this run recovers by restart only (CUDA state, a group of the script's own), if so."""
    inproc_failures: int = 0
    """In-process recoveries of this same step (``fault.step``) that already failed."""
    waiting_since: float | None = None
    """Caller's clock when the ladder began holding for a repair of this fault; None if it has not."""
    replicas: Sequence[Sequence[int]] | None = None
    """Sharded state (FSDP2, HSDP): the ranks holding identical shards, one tuple per shard (one rank each
    without a replica, as in pure FSDP).  None: every rank holds the whole state (DDP)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "spares", tuple(self.spares))
        if self.replicas is not None:
            object.__setattr__(self, "replicas", tuple(tuple(int(r) for r in g) for g in self.replicas))
        object.__setattr__(self, "survivor_steps", MappingProxyType(dict(self.survivor_steps)))
        object.__setattr__(self, "diverged", frozenset(self.diverged))
        object.__setattr__(self, "dirty", frozenset(self.dirty))
        world = self.membership.world_size
        outside = sorted(r for r in self.fault.ranks if not 0 <= r < world)
        if outside:
            raise ValueError(f"Fault names {ranks_text(outside, verb=False)}, outside the world of {world} ranks")
        unknown = sorted(self.fault.nodes - set(self.membership.rank_nodes))
        if unknown:
            raise ValueError(f"Fault names node(s) {', '.join(unknown)} that hold no rank of the current world")
        strangers = sorted(r for r in (*self.survivor_steps, *self.diverged, *self.dirty) if not 0 <= r < world)
        if strangers:
            raise ValueError(
                f"survivor_steps, diverged or dirty name {ranks_text(set(strangers), verb=False)}, outside the world of "
                f"{world} ranks"
            )
        lost = set(self.lost_ranks)
        reporting_lost = sorted(lost & set(self.survivor_steps))
        if reporting_lost:
            raise ValueError(f"survivor_steps has {ranks_text(reporting_lost, verb=False)}, which the fault lost")
        ids = [s.id for s in self.spares]
        twice = sorted({i for i in ids if ids.count(i) > 1})
        if twice:
            raise ValueError(f"the spare pool lists spare id(s) {', '.join(twice)} more than once")
        if self.inproc_failures < 0:
            raise ValueError(f"Observation.inproc_failures={self.inproc_failures} must be >= 0")

    @property
    def lost_ranks(self) -> tuple[int, ...]:
        """Ranks whose process is gone: the fault's ranks, and every rank of a lost node."""
        lost = set(self.fault.ranks)
        if self.fault.kind is FaultKind.NODE_LOST:
            lost |= {r for r, node in enumerate(self.membership.rank_nodes) if node in self.fault.nodes}
        return tuple(sorted(lost))

    @property
    def survivors(self) -> tuple[int, ...]:
        """Ranks still alive with their in-memory state."""
        lost = set(self.lost_ranks)
        return tuple(r for r in range(self.membership.world_size) if r not in lost)

    def unreplicated(self) -> tuple[int, ...]:
        """Lost ranks whose shard no survivor holds (sharded state only; empty for DDP)."""
        if self.replicas is None:
            return ()
        alive = set(self.survivors)
        return tuple(r for r in self.lost_ranks
                     if not any(r in group and alive & set(group) for group in self.replicas))

    def without_clean_copy(self) -> tuple[int, ...]:
        """Ranks (lost, or dirty survivors) whose state no clean survivor holds a copy of: every survivor for
        replicated state (DDP) when none is clean; for sharded state, those whose replica group has no clean
        survivor.  Empty when in-process recovery has a clean source for everyone."""
        clean = set(self.survivors) - self.dirty
        needy = sorted(set(self.lost_ranks) | (self.dirty & set(self.survivors)))
        if self.replicas is None:
            return () if clean or not self.dirty else tuple(needy)
        return tuple(r for r in needy if not any(r in group and clean & set(group) for group in self.replicas))

    @property
    def bad_nodes(self) -> frozenset[str]:
        """Nodes no spare may be taken from: lost or unhealthy ones."""
        return self.fault.nodes

    def describe_fault(self) -> str:
        """The fault in one line, with the ranks a lost node took when the agent's words do not say."""
        text = self.fault.describe()
        if self.fault.kind is FaultKind.NODE_LOST and not self.fault.detail:
            text += f" ({ranks_text(self.lost_ranks, verb=False)})"
        return text
