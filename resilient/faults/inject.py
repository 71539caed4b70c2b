"""Carry out a fault plan inside a worker process.

:class:`FaultInjector` keeps the faults of a plan that can strike this
process (its node, rank and restart attempt), indexed by (section, step),
so the check at every section entry is one dict lookup.  Each fault fires
at most once per process, and is recorded (an event, and a line on stderr
that lands in the rank's log) before it fires: a SIGKILLed process cannot
say afterwards what happened to it.

The functions that hang are named for what they do (``_hang``,
``_deadlock``, ``_deadlock_partner``) so that a stack dump of the victim
reads as an explanation.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TextIO

from ..core.events import EventKind
from .plan import Fault, FaultPlan

if TYPE_CHECKING:
    from ..core.events import EventLog


class InjectedFault(RuntimeError):
    """Raised by a ``raise`` fault: an ordinary, restartable crash."""


class FaultInjector:
    """The faults of ``plan`` that can strike worker ``rank`` on ``node`` in restart ``attempt``."""

    def __init__(
        self,
        plan: FaultPlan,
        node: str | None,
        rank: int,
        attempt: int,
        *,
        events: EventLog | None = None,
        log: TextIO | None = None,
        after_step: int | None = None,
        record: EventLog | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """``after_step``: only faults at later steps (a rank taken over in a re-formed group); ``record``: a
        second log the ``fault_injected`` event also goes to (the agent's ``events.jsonl``, where a drill
        reads when the fault struck); ``sleep``: how ``slow`` and ``hang`` faults wait (tests record it)."""
        self.plan = plan
        self._sleep = sleep
        self.node = node
        self.rank = rank
        self.attempt = attempt
        self.events = events
        self._record = record
        self._log = log
        self.fired: list[Fault] = []
        """Faults fired so far in this process (the ones that returned: hangs with a duration)."""
        self._index: dict[tuple[str, int], list[Fault]] = {}
        self._slow: dict[str, tuple[float, int | None]] = {}
        """``slow`` faults in force: section -> (seconds per step, first step no longer slowed or None)."""
        self._poison = False
        """A ``nan`` fault fired and the Run has not yet poisoned a batch with it."""
        self._slowed: dict[str, int] = {}
        """The last step each slowed section was slowed at (once per step, however often it is re-entered)."""
        for fault in plan.for_worker(node, rank, attempt):
            if after_step is None or fault.step > after_step:
                self._index.setdefault((fault.section, fault.step), []).append(fault)

    def take_poison(self) -> bool:
        """Whether a ``nan`` fault waits for the next micro-batch (it is then consumed)."""
        poison, self._poison = self._poison, False
        return poison

    @property
    def armed(self) -> bool:
        """Whether any fault can still strike this process."""
        return bool(self._index) or bool(self._slow)

    def due(self, section: str, step: int) -> bool:
        """Whether entering ``section`` at ``step`` fires a fault (so the caller can flush what it owes first)."""
        return bool(self._index) and (section, step) in self._index

    def at(self, section: str, step: int) -> None:
        """Called on entering ``section`` at ``step``: fire the first matching fault, if any."""
        if self._slow:
            slow = self._slow.get(section)
            if slow is not None and self._slowed.get(section) != step:
                if slow[1] is None or step < slow[1]:
                    self._slowed[section] = step
                    self._sleep(slow[0])
                else:
                    del self._slow[section]
        if not self._index:
            return
        faults = self._index.get((section, step))
        if not faults:
            return
        fault = faults.pop(0)  # at most once per process, even when the section is entered again
        if not faults:
            del self._index[(section, step)]
        self.fire(fault, step)

    def fire(self, fault: Fault, step: int) -> None:
        """Record ``fault``, then carry it out."""
        message = f"resilient: injecting fault into rank {self.rank} (pid {os.getpid()}): {fault.describe()}"
        for events in (self.events, self._record):
            if events is not None:
                events.emit(EventKind.FAULT_INJECTED, fault=fault.to_dict(), step=step, rank=self.rank,
                            node=self.node, attempt=self.attempt, seed=self.plan.seed, pid=os.getpid(),
                            message=message)
        log = self._log if self._log is not None else sys.stderr
        try:
            log.write(message + "\n")
            log.flush()
        except (OSError, ValueError):
            pass  # a closed stderr must not stop the fault
        self.fired.append(fault)
        if fault.kind == "kill":
            _flush_stdio()
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.kind == "exit":
            _flush_stdio()
            os._exit(fault.code)
        elif fault.kind == "raise":
            raise InjectedFault(message)
        elif fault.kind == "hang":
            _hang(fault.duration_s, self._sleep)
        elif fault.kind == "deadlock":
            _deadlock()
        elif fault.kind == "slow":
            assert fault.duration_s is not None  # Fault requires it
            self._slow[fault.section] = (fault.duration_s, None if fault.steps is None else step + fault.steps)
            self._slowed[fault.section] = step
            self._sleep(fault.duration_s)
        elif fault.kind == "nan":
            self._poison = True  # the Run's next micro-batch gets one NaN (resilient.run.attempt.poisoned)
        elif fault.kind == "sigstop":
            _flush_stdio()
            os.kill(os.getpid(), signal.SIGSTOP)
        else:  # pragma: no cover - Fault validates its kind
            raise AssertionError(fault.kind)


def _flush_stdio() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass


def _hang(duration_s: float | None, sleep: Callable[[float], None]) -> None:
    """Sleep for ``duration_s`` (None: forever); signal handlers still run meanwhile."""
    if duration_s is not None:
        sleep(duration_s)
        return
    while True:
        sleep(3600)


def _deadlock() -> None:
    """Take lock A, let a partner take lock B, then each waits for the other's lock: forever."""
    lock_a, lock_b = threading.Lock(), threading.Lock()
    partner_holds_b = threading.Event()
    main_holds_a = threading.Event()

    def _deadlock_partner() -> None:
        with lock_b:
            partner_holds_b.set()
            main_holds_a.wait()
            with lock_a:  # never acquired
                pass

    with lock_a:
        threading.Thread(target=_deadlock_partner, name="resilient-chaos-deadlock", daemon=True).start()
        main_holds_a.set()
        partner_holds_b.wait()
        with lock_b:  # never acquired
            pass
