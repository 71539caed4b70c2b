"""A :class:`~resilient.run.Run`'s side of its node's memory tier (:mod:`resilient.checkpoint.memory`).

Under an agent that gives a memory tier (``RESILIENT_MEMORY_DIR``) and with a
durable checkpoint configured, every rank copies what a durable save holds
into the tier at step boundaries: its own state, and on the node's local
rank 0 the replicated state.  A restarted worker restores from the tier
when every rank holds a step at least as new as the newest durable commit
(:func:`restore`).  The interval is the user's (``--memory-every N``) or
chosen from the measured cost (:func:`decide_interval`): every step
while the first saves are measured, then agreed by all ranks (the largest
proposal) at fixed steps, an event each time it changes.  Sharded state
(FSDP2/DTensor) is kept as each rank's local tensors with their layout and
put back as they were at the same world size and mesh; at another, the
durable tier reshards it.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..checkpoint import memory as mem
from ..checkpoint.manifest import Manifest, checkpoint_name
from ..checkpoint.restore import Restored, agree
from ..core.events import EventKind
from ..core.state import unwrap
from .attempt import is_recoverable
from .payloads import capture_payloads, sharded_targets
from .saving import settled
from .sections import Section

if TYPE_CHECKING:
    from ..checkpoint.coordinator import Coordinator
    from ..worker.env import WorkerEnv
    from .state import RunState


DECIDE_FIRST, DECIDE_EVERY = 4, 50
"""Steps at which the ranks agree on the interval: the first boundary after step DECIDE_FIRST's save, then every
DECIDE_EVERY steps."""
BUDGET = 0.01
"""The share of a step's time the memory tier may cost when its interval is chosen: a restart then re-does a
few more steps (at 1%, a save that costs half a step is taken every 50 steps), which the run pays once per
failure, while the budget is paid at every step."""
@dataclass(frozen=True)
class Cadence:
    """The memory tier's interval and why."""

    every: int
    reason: str
    cost_s: float
    step_s: float | None


def decide_interval(costs: list[mem.SaveCost], step_s: float | None, *, on_cpu: bool, budget: float = BUDGET,
                    bound: int | None = None) -> Cadence:
    """Steps between memory saves so that the tier costs at most ``budget`` of the step time.

    A save costs its loop stall, plus its hashing when the job trains on the
    CPU (the hash threads then take cores from the step; beside a GPU they
    use cores the step leaves idle).  The median of the newest saves is
    taken.  ``bound`` (the user's) is the longest interval allowed.
    """
    if not costs or step_s is None or step_s <= 0:
        return Cadence(1, "nothing measured yet: every step", 0.0, step_s)
    per_save = sorted(c.stall_s + (c.hash_s if on_cpu else 0.0) for c in costs)[len(costs) // 2]
    every = max(1, math.ceil(per_save / (budget * step_s)))
    reason = (f"a save costs {per_save * 1e3:.1f} ms and a step takes {step_s * 1e3:.1f} ms: every {every} "
              f"step(s) keeps the tier within {budget:.0%} of the step time")
    if bound is not None and every > bound:
        every, reason = bound, reason + f", capped at the bound of {bound}"
    return Cadence(every, reason, per_save, step_s)


class RunMemory:
    """The memory tier of one rank of a Run."""

    def __init__(self, state: RunState, env: WorkerEnv) -> None:
        assert env.memory_dir is not None
        self.state = state
        self.env = env
        # The node's replicated copy is kept by its local rank 0 alone.  A promoted spare never keeps it: its
        # LOCAL_RANK is the spare's own, and the rank it replaces may be another, so it could write the slot
        # beside the real local rank 0 (a lost local rank 0 then leaves the node's copy incomplete, and a
        # restart restores from the durable tier).
        self.keeps_replicated = env.local_rank == 0 and env.role != "spare"
        self.tier = mem.MemoryTier(env.memory_dir, limit=env.memory_limit,
                                   local_rank=env.local_rank if self.keeps_replicated else max(1, env.local_rank),
                                   events=state.events, generation=env.generation)
        self.fixed = env.memory_every or None
        self.every = self.fixed or 1
        self.fingerprint = hashlib.sha256(json.dumps(state.fingerprint, sort_keys=True, default=str)
                                          .encode()).hexdigest()
        self._rank: int | None = None
        self._saved: int | None = None
        self._step_times: list[float] = []

    # ------------------------------------------------------------ restore
    def restore(self, coord: Coordinator, durable: Manifest | None) -> Restored | None:
        """Every rank's state from the tier when it holds a step at least as new as ``durable``; collective."""
        got = mem.restore_memory(self.tier, coord, self.state.events, fingerprint=self.fingerprint,
                                 not_before=durable.step if durable is not None else None, agree=agree,
                                 prepare=self._put_back if self.state.sharded else None)
        if got is None:
            return None
        manifest = Manifest(name=f"memory:{checkpoint_name(got.step)}", step=got.step, world_size=coord.world_size,
                            files=(), parent=durable.name if durable is not None else None,
                            created_unix=time.time(), chunk_bytes=self.tier.chunk_bytes,
                            fingerprint=self.state.fingerprint, counters=got.counters)
        return Restored(manifest, got.replicated, got.rank_state, sharded=got.prepared, ranks_read=(coord.rank,))

    def _put_back(self, replicated: Any, rank_state: Any) -> dict[str, Any]:
        """A sharded rank's kept local tensors as DTensors of the live model's layout (ValueError: another)."""
        from ..checkpoint import sharded

        return sharded.put_back_local(sharded_targets(self.state), rank_state.get(sharded.SHARDS),
                                      rank_state.get(sharded.LAYOUT))

    # ------------------------------------------------------------ saving
    def due(self, step: int) -> bool:
        """Whether the boundary before ``step`` may save (or choose the interval, which may make it save)."""
        if step == 0 or self.tier.off is not None or step == self._saved:
            return False
        pin = self.env.memory_pin_every
        return step % self.every == 0 or bool(pin and step % pin == 0) or \
            (self.fixed is None and (step == DECIDE_FIRST or step % DECIDE_EVERY == 0))

    def at_boundary(self) -> None:
        """At a step boundary: choose the interval where due, and save when the step falls on it."""
        state = self.state
        step = state.step
        if step == 0:
            return
        if state.last_step_s is not None:
            self._step_times = [*self._step_times[-15:], state.last_step_s]
        if self.fixed is None and (step == DECIDE_FIRST or step % DECIDE_EVERY == 0):
            self._decide(step)  # collective: a rank whose tier went off still takes part, or its peers wait
        if self.tier.off is not None:
            return
        pinned = self.env.memory_pin_every and step % self.env.memory_pin_every == 0  # the agent copies it to a peer
        if (step % self.every and not pinned) or step == self._saved:  # the same boundary again: an in-process retry
            return
        settled(state, "before a memory-tier save")
        self._saved = step
        if self._rank is not None and self._rank != state.rank:  # an in-process regroup renumbered this rank
            self.tier.forget(self._rank)
        self._rank = state.rank
        if state.inproc is not None:
            self.tier.generation = state.inproc.generation
        with Section(state, "checkpoint"):
            self.tier.save(step, capture_payloads(state, replicated=self.keeps_replicated, local_shards=True),
                           rank=state.rank, world_size=state.world_size, fingerprint=self.fingerprint,
                           counters={"step": step, "samples": state.samples, "tokens": state.tokens}, pin=bool(pinned))

    def _decide(self, step: int) -> None:
        state = self.state
        # The saves whose hashing is done (the newest one's may still run: the loop does not wait for it here;
        # the median of the others decides).
        costs = [c for c in self.tier.costs if c.hash_s > 0] or self.tier.costs
        times = sorted(self._step_times)
        step_s = times[len(times) // 2] if times else None
        on_cpu = all(p.device.type == "cpu" for p in unwrap(state.model).parameters())
        cadence = decide_interval(costs, step_s, on_cpu=on_cpu)
        proposed = cadence.every
        if state.checkpoints is not None:
            try:
                proposed = state.checkpoints.coord.agree_max((cadence.every,))[0]
            except Exception as exc:
                if state.inproc is None or not is_recoverable(exc):
                    raise
                return  # a peer was lost: the step's attempt recovers the group; the interval stays
        if proposed != self.every:
            state.events.emit(EventKind.MEMORY_CADENCE, step=step, every=proposed, previous=self.every,
                            proposed_here=cadence.every, reason=cadence.reason, cost_s=round(cadence.cost_s, 6),
                            step_s=round(step_s, 6) if step_s is not None else None, budget=BUDGET)
            self.every = proposed

    def close(self) -> None:
        self.tier.close()


def open_memory(state: RunState, env: WorkerEnv | None) -> RunMemory | None:
    """The Run's memory tier, or None without an agent's tier."""
    if env is None or env.memory_dir is None:
        return None
    return RunMemory(state, env)

