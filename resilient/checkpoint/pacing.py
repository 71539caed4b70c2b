"""Save pacing: what a due save does while the previous one is still being written (pure).

A scheduled save falls due at a step boundary; the writer (a background
thread per save) may still be writing or committing an earlier one.  What
the loop then does is ``CheckpointConfig.when_busy``:

- ``"defer"`` (default): take no snapshot now; the save stays *pending* and
  is taken at the first step boundary at which the writer is free, with
  that later step.  A pending save satisfies its due slot and every slot
  that falls due while it is pending (one pending save, never a queue); the
  schedule itself does not move: the next due step is still the next
  multiple of ``every_steps``.
- ``"second_buffer"``: snapshot into a second host buffer and queue the save
  behind the one being written (at most one queued).  Without memory for
  that buffer, or with a save already queued, it defers as above.
- ``"wait"``: wait for the writer, then snapshot (the loop stalls for the
  rest of the previous write: the behaviour before pacing existed).

Every rank must take the same decision, or rank 0 would commit a step its
peers never snapshotted.  Busy-ness is rank-local (each rank's writer ends
at its own time), so each rank states its :class:`Busy` level and the ranks
take the maximum (``Coordinator.agree_max``) before :func:`decide_save`;
with the same inputs every rank decides the same.

Explicit saves (``Run.save()``, a graceful stop, the final save) do not come
here: they always wait for the writer, because saving is their point; they
also take any pending save.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Literal

WhenBusy = Literal["defer", "second_buffer", "wait"]
"""The values of ``CheckpointConfig.when_busy``."""
WHEN_BUSY: tuple[WhenBusy, ...] = ("defer", "second_buffer", "wait")

MEMORY_HEADROOM_FRACTION = 0.25
MEMORY_HEADROOM_MIN = 256 << 20
"""A second buffer must leave this much memory free (a quarter of its size, at least 256 MiB): a copy
that pushes the host into swap or the OOM killer costs far more than a deferred save."""


class Busy(IntEnum):
    """One rank's writer state at a due (or pending) step; ranks agree on the maximum."""

    FREE = 0
    """Every earlier save of this rank has its outcome: a snapshot can start now."""
    CAN_QUEUE = 1
    """One save in flight and a free second buffer that fits in memory ("second_buffer" only)."""
    NO_MEMORY = 2
    """One save in flight, but a second buffer does not fit in available memory."""
    BUSY = 3
    """A save in flight and no way to take another without waiting (or two in flight)."""


@dataclass(frozen=True)
class Pending:
    """A scheduled save that was not taken at its step and waits for the writer."""

    due_step: int
    """The first due step it stands in for."""
    slots: int
    """Due steps it stands in for (the first and every one that fell due while it was pending)."""
    reason: str
    """Why it was first deferred."""


Action = Literal["snapshot", "queue", "defer"]


@dataclass(frozen=True)
class SaveDecision:
    """What to do at this step boundary, and why."""

    action: Action
    """"snapshot": take it now; "queue": take it now into the second buffer, written after the one in
    flight; "defer": take nothing now."""
    reason: str
    pending: Pending | None
    """The pending save after this decision (None once a snapshot is taken)."""
    landed: Pending | None = None
    """The pending save this snapshot takes, if it stands in for deferred due steps."""


def local_busy(*, in_flight: int, policy: WhenBusy, second_buffer_fits: bool) -> Busy:
    """This rank's :class:`Busy` level: ``in_flight`` saves without an outcome yet."""
    if in_flight == 0:
        return Busy.FREE
    if policy != "second_buffer" or in_flight > 1:
        return Busy.BUSY
    return Busy.CAN_QUEUE if second_buffer_fits else Busy.NO_MEMORY


def second_buffer_fits(need_bytes: int, available_bytes: int) -> tuple[bool, str]:
    """Whether allocating ``need_bytes`` more host memory leaves the headroom free; and why."""
    if need_bytes <= 0:
        return True, "the second buffer is already large enough"
    headroom = max(MEMORY_HEADROOM_MIN, int(need_bytes * MEMORY_HEADROOM_FRACTION))
    if available_bytes >= need_bytes + headroom:
        return True, f"{_mib(need_bytes)} for a second buffer fits in {_mib(available_bytes)} available"
    return False, (f"a second buffer needs {_mib(need_bytes)} plus {_mib(headroom)} headroom, only "
                   f"{_mib(available_bytes)} available")


def decide_save(
    *, step: int, due: bool, pending: Pending | None, busy: Busy, busy_step: int | None, policy: WhenBusy
) -> SaveDecision:
    """The agreed decision at a boundary where a save is ``due`` or ``pending``.

    ``busy`` and ``busy_step`` (the newest step whose save is still in
    flight on some rank) are the maximum over all ranks.  ``policy`` "wait"
    is decided by the caller (it needs no agreement: every rank waits).
    """
    assert due or pending is not None, "nothing to decide: no save due or pending"
    assert policy != "wait", "the wait policy needs no decision"
    if busy is Busy.FREE or (busy is Busy.CAN_QUEUE and policy == "second_buffer"):
        if busy is Busy.FREE:
            reason = "writer free"
            action: Action = "snapshot"
        else:
            reason = f"writer busy with the save of step {busy_step}: snapshot into the second buffer, queued"
            action = "queue"
        if pending is not None:
            reason += f"; takes the save due at step {pending.due_step}, {step - pending.due_step} steps late"
        return SaveDecision(action, reason, None, landed=pending)
    why = f"writer busy with the save of step {busy_step}"
    if policy == "second_buffer":
        why += (" and a second save queued" if busy is Busy.BUSY
                else "; no memory for a second host buffer (on at least one rank)")
    if pending is None:
        return SaveDecision("defer", f"{why}: deferred to the first step with a free writer",
                            Pending(due_step=step, slots=1, reason=why))
    if due:
        merged = Pending(due_step=pending.due_step, slots=pending.slots + 1, reason=pending.reason)
        return SaveDecision("defer", f"{why}: still pending since step {pending.due_step}; this due step joins it",
                            merged)
    return SaveDecision("defer", f"{why}: still pending since step {pending.due_step}", pending)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB"
