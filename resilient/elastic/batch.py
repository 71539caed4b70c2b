"""The batch contract under elasticity: which samples each rank's micro-batches take, at any world size.

Pure (no torch, no I/O): the loader uses it to serve micro-batches, and the
recovery decision uses :func:`feasible_world_sizes` to know where a shrink
or a grow keeps the batch.

**The global batch.**  A run's global batch ``G`` (samples per optimizer
step) is fixed at its first start: the loader's per-rank ``batch_size`` ``B``
times the world size then.  At any world size ``W`` a step consumes exactly
the ``G`` stream positions ``[c, c + G)``, ``c`` being the loader's cursor
at the step's start: the same set as the run that never changed size.

**The layout.**  Every rank runs the same number ``A`` of micro-batches of
at most ``B`` samples.  The step's ``G`` positions are cut, in stream order,
into ``W * A`` *slots* whose sizes differ by at most one (``q, rem =
divmod(G, W * A)``: the first ``rem`` slots hold ``q + 1``); slot ``j``
starts at offset ``j * q + min(j, rem)``.  Rank ``r``'s micro-batch ``k`` is
slot ``j = r * A + k``, so a rank's share is contiguous and every position
of the step is in exactly one slot.  At the first world size ``A = 1`` and
slot ``r`` is the batch ``next(loader)`` gives rank ``r``; whenever ``W * B``
divides ``G`` every slot holds ``B`` samples and slot ``j`` is exactly the
first world size's rank-``j`` batch (only the order of the gradient
reduction differs).

**Even and uneven splits.**  When ``W`` divides ``G``, ``A`` is the fewest
micro-batches (at least ``ceil(G / (W * B))``) that divide a rank's share
``G / W`` equally (micro-batches smaller than ``B`` if need be, one sample
each at worst: the reason says so).  Then the script's ``loss /
run.accumulation`` (a mean loss per micro-batch) gives the reference's
gradient: DDP averages over ``W`` ranks, so each sample weighs ``1 / (W * A
* (G / (W * A))) = 1 / G``, as in the reference.  Otherwise the plan follows
a declared :class:`BatchRule`:

- ``refuse`` (the default): the world size is infeasible; the recovery
  decision does not shrink or grow there, and a restore there is an error.
- ``uneven``: keep the global batch in the fewest micro-batches,
  ``ceil(G / (W * B))``, of two sizes; micro-batch ``(r, k)`` of ``n``
  samples carries the weight ``W * n / G`` and the script multiplies its mean
  loss by it (``run.micro_batches(weighted=True)``), so each sample still
  weighs ``1 / G``.  This rule also prefers the fewest micro-batches to equal
  ones (a share of 7 with ``B = 4``: 4 and 3, not 7 of 1).  Layers that see
  the whole micro-batch (batch norm) see batches of another size than the
  reference's.

A world size whose micro-batches could not all hold a sample (``G < W *
ceil(G / (W * B))``, e.g. more ranks than samples) is infeasible under every
rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from ..core.errors import ConfigError

_LISTED = 4096
"""An infeasible plan's error lists the feasible world sizes up to this many ranks."""


class BatchRule(str, Enum):
    """What a plan does when the global batch does not split into equal micro-batches."""

    REFUSE = "refuse"  # the world size is infeasible: shrink and grow skip it, a restore there is an error
    UNEVEN = "uneven"  # micro-batches differ by one sample; the loss is weighted by each one's sample count

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, kw_only=True)
class BatchPlan:
    """How one step's global batch is split at one world size (see the module docstring)."""

    global_batch: int
    """G: samples per optimizer step, fixed at the run's first start."""
    micro_batch: int
    """B: the most samples one micro-batch may hold (the loader's per-rank batch_size)."""
    world_size: int
    """W: ranks that share the step."""
    rule: BatchRule
    """The rule for a split into micro-batches of unequal size."""
    accumulation: int
    """A: micro-batches per rank per step (every rank runs the same number); 0 when infeasible."""
    feasible: bool
    """Whether this world size can run the step under the rule."""
    even: bool
    """Whether every micro-batch has the same size (then ``loss / accumulation`` is exact)."""
    reason: str
    """One line saying how the batch is split, or why it cannot be."""

    def slot(self, rank: int, k: int) -> tuple[int, int]:
        """``(offset, size)`` of rank ``rank``'s micro-batch ``k``: positions ``c + offset .. c + offset + size - 1``."""
        self._check(rank, k)
        q, rem = divmod(self.global_batch, self.world_size * self.accumulation)
        j = rank * self.accumulation + k
        return j * q + min(j, rem), q + (1 if j < rem else 0)

    def slots(self, rank: int) -> tuple[tuple[int, int], ...]:
        """``(offset, size)`` of each of ``rank``'s micro-batches, in order."""
        return tuple(self.slot(rank, k) for k in range(self.accumulation))

    def samples(self, rank: int) -> int:
        """Samples ``rank`` trains on in one step."""
        return sum(size for _, size in self.slots(rank))

    def weight(self, rank: int, k: int) -> float:
        """Multiply micro-batch ``k``'s mean loss by this: ``W * n / G`` (``1 / A`` when even)."""
        _, size = self.slot(rank, k)
        return self.world_size * size / self.global_batch

    def require(self) -> BatchPlan:
        """This plan, or a ConfigError saying why the world size cannot keep the global batch and what to do."""
        if not self.feasible:
            sizes = sorted(feasible_world_sizes(self.global_batch, self.micro_batch, 1,
                                                min(self.global_batch, _LISTED), self.rule))
            shown = ", ".join(map(str, sizes[:16])) + (", ..." if len(sizes) > 16 else "")
            raise ConfigError(
                f"the batch contract cannot hold at world size {self.world_size}: {self.reason}. Run on a world size "
                f"that splits the global batch ({shown}), or create the ElasticLoader with batch_rule='uneven' and "
                "weight each micro-batch's loss (run.micro_batches(weighted=True))"
            )
        return self

    def to_event(self) -> dict[str, Any]:
        """The plan as an event's fields."""
        return {"global_batch": self.global_batch, "micro_batch": self.micro_batch, "world_size": self.world_size,
                "accumulation": self.accumulation, "rule": self.rule.value, "feasible": self.feasible,
                "even": self.even, "reason": self.reason}

    def _check(self, rank: int, k: int) -> None:
        assert self.feasible, f"no slots in an infeasible plan: {self.reason}"
        assert 0 <= rank < self.world_size and 0 <= k < self.accumulation, (rank, k, self)


def plan_batch(global_batch: int, micro_batch: int, world_size: int,
               rule: BatchRule | str = BatchRule.REFUSE) -> BatchPlan:
    """Split a step's ``global_batch`` samples over ``world_size`` ranks in micro-batches of at most ``micro_batch``."""
    _positive("global_batch", global_batch)
    _positive("micro_batch", micro_batch)
    _positive("world_size", world_size)
    rule = as_rule(rule)
    g, b, w = global_batch, micro_batch, world_size
    ranks = "rank" if w == 1 else "ranks"
    fewest = -(-g // (w * b))  # the fewest micro-batches of at most b that hold a rank's share

    def plan(a: int, even: bool, reason: str) -> BatchPlan:
        return BatchPlan(global_batch=g, micro_batch=b, world_size=w, rule=rule, accumulation=a, feasible=a > 0,
                         even=even, reason=reason)

    if g < w * fewest:
        what = f"each of {w} {ranks}" if fewest == 1 else f"{w} {ranks} x {fewest} micro-batches"
        return plan(0, False, f"global batch {g} cannot give {what} a sample; world size {w} is infeasible "
                              "under every rule")
    share, extra = divmod(g, w)
    # Equal micro-batches need w to divide g; then the fewest that divide the share (1 sample each at worst).
    a = next((d for d in range(fewest, share + 1) if share % d == 0), 0) if extra == 0 else 0
    if a and (a == fewest or rule is BatchRule.REFUSE):
        q = share // a
        micro = "micro-batch" if a == 1 else "micro-batches"
        how = "full size" if a == 1 and q == b else f"accumulation {a} keeps the global batch"
        if q < b and a > 1:
            how += f" (micro-batches of {q}, below {b}, so that all are equal)"
        return plan(a, True, f"global batch {g} = {w} {ranks} x {a} {micro} x {q} samples: {how}")
    q, rem = divmod(g, w * fewest)
    micro = "micro-batch" if fewest == 1 else "micro-batches"
    split = f"{w} {ranks} x {fewest} {micro} of {q} or {q + 1} samples ({rem} of {w * fewest} holding {q + 1})"
    if rule is BatchRule.UNEVEN:
        return plan(fewest, False, f"global batch {g} = {split}: rule 'uneven' keeps it, each micro-batch's mean "
                                   f"loss weighted by {w} x its samples / {g}")
    return plan(0, False, f"global batch {g} is not a multiple of {w} {ranks}, so its micro-batches cannot be equal "
                          f"(they would be {split}); rule 'refuse' makes world size {w} infeasible")


def feasible_world_sizes(global_batch: int, micro_batch: int, min_world: int, max_world: int,
                         rule: BatchRule | str = BatchRule.REFUSE) -> frozenset[int]:
    """The world sizes in ``[min_world, max_world]`` where a step keeps ``global_batch`` under ``rule``."""
    _positive("min_world", min_world)
    _positive("max_world", max_world)
    if min_world > max_world:
        raise ConfigError(f"feasible_world_sizes: min_world {min_world} is above max_world {max_world}")
    return frozenset(w for w in range(min_world, max_world + 1)
                     if plan_batch(global_batch, micro_batch, w, rule).feasible)


def as_rule(rule: BatchRule | str) -> BatchRule:
    """``rule`` as a :class:`BatchRule`; a ConfigError naming the choices for anything else."""
    try:
        return BatchRule(rule)
    except ValueError:
        raise ConfigError(f"batch rule {rule!r} is not one of {[r.value for r in BatchRule]}") from None


def _positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} must be an int >= 1")
