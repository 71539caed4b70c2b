"""Fault plans: which fault strikes where, as data.

A plan is a JSON file that a worker (or, later, an agent or a drill runner)
reads; the same plan drives unit tests, integration tests and drills::

    {"version": 1, "seed": 7, "faults": [
        {"kind": "exit", "rank": 1, "node": null, "step": 12, "attempt": 0, "section": "step", "exit_code": 3},
        {"kind": "hang", "rank": 0, "step": 30, "attempt": 1, "section": "data", "duration_s": 20.0}
    ]}

A fault fires when a worker enters ``section`` at ``step`` on ``node`` as
``rank`` in restart ``attempt``; ``null`` (for rank, node and attempt)
matches any.  ``step`` is the Run's step when the section is entered: the
update about to be computed for ``step`` and ``data``, the completed
updates for ``checkpoint``, ``restore`` and ``init``.  Section ``commit`` is
a point, not a section the agent sees: rank 0's save of that step, with
every rank's files staged and the manifest built, just before it is
published (:func:`resilient.checkpoint.commit.set_fault_point`).  Kinds:

- ``kill``: SIGKILL itself;  ``sigstop``: SIGSTOP itself (hangs until SIGCONT);
- ``exit``: ``os._exit(exit_code)`` (default 1) after flushing output;
- ``raise``: an uncaught ``RuntimeError`` naming the fault;
- ``hang``: sleep ``duration_s`` seconds (default: forever) inside the section;
- ``deadlock``: two threads each wait for the other's lock (forever);
- ``slow``: from ``step`` on, sleep ``duration_s`` seconds once per step,
  when the section is first entered in that step, for ``steps`` steps
  (default: the rest of the run): a straggler (section ``step``) or a slow
  input path (section ``data``);
- ``nan``: the rank's next micro-batch (``run.micro_batches()``) carries one
  NaN in its first floating-point tensor (a copy: the loader's data stays
  clean), so its loss and, once all-reduced, every rank's gradients are not
  finite (:mod:`resilient.run.nonfinite` catches them before the update).

:meth:`FaultPlan.random` makes a plan from a seed, so a drill can ask for
"three random crashes" and get the same three every time.
"""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from ..core.errors import ConfigError
from ..core.fsutil import write_text_atomic

PLAN_VERSION = 1
FAULT_KINDS = ("kill", "exit", "raise", "hang", "deadlock", "sigstop", "slow", "nan")
DEFAULT_EXIT_CODE = 1


class FaultPlanError(ConfigError):
    """A fault plan is invalid; the message names the field and the fix."""


@dataclass(frozen=True, kw_only=True)
class Fault:
    """One fault and where it strikes."""

    kind: str
    """One of FAULT_KINDS."""
    step: int
    """Run step at which the section is entered."""
    section: str = "step"
    """Section whose entry triggers it: init, restore, data, step, checkpoint or a user section."""
    rank: int | None = None
    """Global rank; None: every rank."""
    node: str | None = None
    """Node id (RESILIENT_NODE_ID); None: every node."""
    attempt: int | None = 0
    """Restart attempt (0: the first run); None: every attempt."""
    exit_code: int | None = None
    """Exit status (``exit`` only; default 1)."""
    duration_s: float | None = None
    """How long to hang (``hang``; None: forever), or the delay per step (``slow``, required)."""
    steps: int | None = None
    """How many steps a ``slow`` fault lasts; None: the rest of the run."""

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise FaultPlanError(f"kind: {self.kind!r} is not a fault kind; use one of {', '.join(FAULT_KINDS)}")
        _check_int("step", self.step, minimum=0)
        if not isinstance(self.section, str) or not self.section:
            raise FaultPlanError(f"section: {self.section!r} must be a section name such as 'step' or 'data'")
        if self.rank is not None:
            _check_int("rank", self.rank, minimum=0, what="a rank >= 0, or null for every rank")
        if self.node is not None and (not isinstance(self.node, str) or not self.node):
            raise FaultPlanError(f"node: {self.node!r} must be a node id string, or null for every node")
        if self.attempt is not None:
            _check_int("attempt", self.attempt, minimum=0, what="a restart count >= 0, or null for every attempt")
        if self.exit_code is not None:
            if self.kind != "exit":
                raise FaultPlanError(f"exit_code: only an 'exit' fault has one, this one is {self.kind!r}; remove it")
            _check_int("exit_code", self.exit_code, minimum=0, what="an exit status 0..255")
            if self.exit_code > 255:
                raise FaultPlanError(f"exit_code: {self.exit_code} is not an exit status; use 0..255")
        if self.kind == "slow" and self.duration_s is None:
            raise FaultPlanError("duration_s: a 'slow' fault needs the seconds to add per section entry, e.g. 0.005")
        if self.steps is not None:
            if self.kind != "slow":
                raise FaultPlanError(f"steps: only a 'slow' fault has one, this one is {self.kind!r}; remove it")
            _check_int("steps", self.steps, minimum=1, what="a number of steps >= 1, or null for the rest of the run")
        if self.duration_s is not None:
            if self.kind not in ("hang", "slow"):
                raise FaultPlanError(f"duration_s: only 'hang' and 'slow' faults have one, this one is {self.kind!r}; "
                                     "remove it")
            if (isinstance(self.duration_s, bool) or not isinstance(self.duration_s, (int, float))
                    or not math.isfinite(self.duration_s) or self.duration_s < 0):
                raise FaultPlanError(
                    f"duration_s: {self.duration_s!r} must be seconds >= 0, or null (omit it) to hang forever"
                )

    @property
    def code(self) -> int:
        """The exit status an ``exit`` fault uses."""
        return DEFAULT_EXIT_CODE if self.exit_code is None else self.exit_code

    def matches(self, node: str | None, rank: int, step: int, attempt: int, section: str) -> bool:
        """Whether this fault strikes a worker entering ``section`` at ``step``."""
        return (
            self.step == step
            and self.section == section
            and (self.rank is None or self.rank == rank)
            and (self.attempt is None or self.attempt == attempt)
            and (self.node is None or self.node == node)
        )

    def describe(self) -> str:
        where = (f"rank {'*' if self.rank is None else self.rank} on node {self.node or '*'}, "
                 f"attempt {'*' if self.attempt is None else self.attempt}")
        extra = {"exit": f" with code {self.code}",
                 "hang": f" for {'ever' if self.duration_s is None else f'{self.duration_s} s'}",
                 "slow": f" by {self.duration_s} s per step for "
                         f"{'the rest of the run' if self.steps is None else f'{self.steps} steps'}",
                 "nan": " (one NaN in the rank's next batch)"}.get(self.kind, "")
        return f"{self.kind}{extra} entering section {self.section!r} at step {self.step} ({where})"

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        for optional in ("exit_code", "duration_s", "steps"):
            if out[optional] is None:
                del out[optional]
        return out

    @classmethod
    def from_dict(cls, raw: Any) -> Fault:
        if not isinstance(raw, Mapping):
            raise FaultPlanError(f"must be an object like {{\"kind\": \"kill\", \"step\": 5}}, got {raw!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise FaultPlanError(f"{unknown[0]}: unknown field; a fault has {', '.join(sorted(known))}")
        for required in ("kind", "step"):
            if required not in raw:
                raise FaultPlanError(f"{required}: missing; every fault needs kind and step")
        return cls(**raw)


@dataclass(frozen=True, kw_only=True)
class FaultPlan:
    """An ordered set of faults, and the seed it was made from (if any)."""

    faults: tuple[Fault, ...] = ()
    """The faults; several may match one section entry (the first one wins)."""
    seed: int | None = None
    """Seed the plan was generated from; recorded for reproducibility."""
    version: int = PLAN_VERSION
    """Format version."""

    def __post_init__(self) -> None:
        if self.version != PLAN_VERSION:
            raise FaultPlanError(f"version: {self.version!r} is not supported; this resilient reads version "
                                 f"{PLAN_VERSION}")
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=None, what="an integer, or null")
        if not isinstance(self.faults, tuple) or not all(isinstance(f, Fault) for f in self.faults):
            raise FaultPlanError("faults: must be a tuple of Fault")

    def matching(self, node: str | None, rank: int, step: int, attempt: int, section: str) -> tuple[Fault, ...]:
        """The faults that strike a worker entering ``section`` at ``step``."""
        return tuple(f for f in self.faults if f.matches(node, rank, step, attempt, section))

    def for_worker(self, node: str | None, rank: int, attempt: int) -> tuple[Fault, ...]:
        """The faults that can strike this worker process at some step and section."""
        return tuple(
            f for f in self.faults
            if (f.rank is None or f.rank == rank) and (f.attempt is None or f.attempt == attempt)
            and (f.node is None or f.node == node)
        )

    # ----------------------------------------------------------- format
    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "seed": self.seed, "faults": [f.to_dict() for f in self.faults]}

    @classmethod
    def from_dict(cls, raw: Any) -> FaultPlan:
        if not isinstance(raw, Mapping):
            raise FaultPlanError(f"a fault plan is a JSON object {{\"version\": 1, \"faults\": [...]}}, got {raw!r}")
        unknown = sorted(set(raw) - {"version", "seed", "faults"})
        if unknown:
            raise FaultPlanError(f"{unknown[0]}: unknown field; a plan has version, seed and faults")
        if "version" not in raw:
            raise FaultPlanError(f"version: missing; add \"version\": {PLAN_VERSION}")
        faults_raw = raw.get("faults", [])
        if not isinstance(faults_raw, list):
            raise FaultPlanError(f"faults: must be a list of fault objects, got {type(faults_raw).__name__}")
        faults = parse_faults(faults_raw, lambda i: f"faults[{i}].")
        return cls(faults=faults, seed=raw.get("seed"), version=raw["version"])

    def dumps(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def loads(cls, text: str, source: str = "fault plan") -> FaultPlan:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise FaultPlanError(f"{source} is not valid JSON ({e}); fix the syntax") from None
        try:
            return cls.from_dict(raw)
        except FaultPlanError as e:
            raise FaultPlanError(f"{source}: {e}") from None

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> FaultPlan:
        """Read a plan file; :class:`FaultPlanError` names the file, the field and the fix."""
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise FaultPlanError(f"cannot read fault plan {os.fspath(path)}: {e}") from None
        return cls.loads(text, source=f"fault plan {os.fspath(path)}")

    def dump(self, path: str | os.PathLike[str]) -> None:
        """Write the plan atomically (readers never see half a file)."""
        write_text_atomic(path, self.dumps() + "\n")

    # ------------------------------------------------------- generation
    @classmethod
    def random(
        cls,
        seed: int,
        *,
        world_size: int,
        steps: int,
        count: int = 1,
        kinds: Sequence[str] = ("kill",),
        sections: Sequence[str] = ("step",),
        nodes: Sequence[str | None] = (None,),
        first_step: int = 1,
        exit_code: int = DEFAULT_EXIT_CODE,
        hang_s: float | None = None,
    ) -> FaultPlan:
        """``count`` faults drawn from ``seed``: the same arguments always give the same plan.

        Fault ``i`` strikes restart attempt ``i`` (so a run meets them one
        after another, one per restart) on a random rank, node, section and
        step in ``[first_step, steps)``, with a kind drawn from ``kinds``.
        """
        if world_size < 1:
            raise FaultPlanError(f"world_size: {world_size} must be >= 1")
        if not 0 <= first_step < steps:
            raise FaultPlanError(f"steps: need 0 <= first_step ({first_step}) < steps ({steps})")
        if count < 0:
            raise FaultPlanError(f"count: {count} must be >= 0")
        for name, options in (("kinds", kinds), ("sections", sections), ("nodes", nodes)):
            if not options:
                raise FaultPlanError(f"{name}: give at least one")
        rng = random.Random(seed)
        faults = []
        for i in range(count):
            kind = rng.choice(list(kinds))
            faults.append(Fault(
                kind=kind,
                rank=rng.randrange(world_size),
                node=rng.choice(list(nodes)),
                step=rng.randrange(first_step, steps),
                section=rng.choice(list(sections)),
                attempt=i,
                exit_code=exit_code if kind == "exit" else None,
                duration_s=hang_s if kind == "hang" else None,
            ))
        return cls(faults=tuple(faults), seed=seed)


def parse_faults(items: Sequence[Any], where: Callable[[int], str]) -> tuple[Fault, ...]:
    """Faults from their objects; an error names the fault by ``where(index)`` (how its file calls it)."""
    faults = []
    for i, item in enumerate(items):
        try:
            faults.append(Fault.from_dict(item))
        except (FaultPlanError, TypeError) as e:
            raise FaultPlanError(f"{where(i)}{e}") from None
    return tuple(faults)


def _check_int(name: str, value: Any, *, minimum: int | None, what: str | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
        want = what or (f"an integer >= {minimum}" if minimum is not None else "an integer")
        raise FaultPlanError(f"{name}: {value!r} must be {want}")
