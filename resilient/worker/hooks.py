"""The worker's side of the agent contract, as used by :class:`resilient.Run`.

:class:`WorkerHooks` holds everything a worker process does for its agent:

- heartbeats: ``hello`` once, a ``section`` message on every section entry,
  ``bye`` when no more will come (:mod:`resilient.worker.heartbeat`);
- stack dumps: faulthandler writes every thread's stack to the rank's stack
  file when the agent sends ``RESILIENT_STACK_SIGNAL`` (it runs in C, so it
  works while the main thread is stuck in a lock or a sleep);
- the error file: an uncaught exception is announced by a line starting
  with :data:`UNCAUGHT_PREFIX`, its traceback printed, and only then
  written as JSON for the agent's first-failure report, so an error file
  always has its traceback in the rank's log (the agent keeps
  the rest of that worker's output out of its console and shows the error
  under the incident, as the first failure or as one line of consequence);
  exceptions under the exit-code contract
  (:func:`resilient.core.exitcodes.exit_code_for`) end the process with their
  code so the agent does not restart a run that cannot succeed;
- graceful stop: ``RESILIENT_STOP_SIGNAL`` only sets a flag; the Run reads
  the control file at its next step boundary (:meth:`take_stop_request`);
- chaos: a fault plan (``RESILIENT_FAULT_PLAN``) is loaded lazily and its
  faults fire on section entry;
- in-process recovery: ``recovery`` reports (:meth:`recovery`), and
  :meth:`rejoin` after a re-formation.  A spare (``RESILIENT_ROLE=spare``)
  starts in *standby*: it sends only ``recovery`` reports until it is
  promoted, so the agent never counts it as a member of a generation it is
  not in; on promotion it says ``hello`` like any new member.

Only the main thread can install signal handlers; a Run created elsewhere
gets heartbeats and stack dumps but no graceful stop, and says so in
``notes``.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import IO, TYPE_CHECKING, Any

from ..core.events import EventKind
from ..core.fsutil import write_json_atomic
from .diagnose import DiagnoseSpec, InputDiagnosis
from .env import WorkerEnv
from .heartbeat import BatchingSender, HeartbeatSender

if TYPE_CHECKING:
    from collections.abc import Callable
    from contextlib import AbstractContextManager

    from ..core.events import EventLog
    from ..data.loader import ElasticLoader
    from ..faults.inject import FaultInjector

UNCAUGHT_PREFIX = "resilient: uncaught "
"""Starts the line the excepthook prints before the traceback once the error file is written: the agent
keeps what follows out of its console (the rank's log still has it) and reports it with the incident."""


@dataclass(frozen=True)
class StopRequest:
    """What the agent asked for in the control file."""

    stop_at_step: int
    """Commit and exit at the first step boundary where ``step >= stop_at_step``."""
    reason: str


def read_stop_request(path: str) -> StopRequest:
    """Parse the control file the agent wrote before signalling.

    A missing or invalid file still means "stop": the signal says the agent
    wants the worker gone, so it stops at its current boundary (step 0
    means "now") with a reason that says what was wrong with the file.
    """
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        return StopRequest(0, f"stop signal without a readable control file {path} ({e}); stopping now")
    step = raw.get("stop_at_step") if isinstance(raw, dict) else None
    if isinstance(step, bool) or not isinstance(step, int):
        return StopRequest(0, f"control file {path} has no integer stop_at_step ({raw!r}); stopping now")
    return StopRequest(step, str(raw.get("reason") or "stop requested by the agent"))


class WorkerHooks:
    """Heartbeats, stack dumps, error file, stop requests and faults for one worker process."""

    def __init__(self, env: WorkerEnv, *, events: EventLog | None = None) -> None:
        self.env = env
        self.events = events
        self.sender = BatchingSender(HeartbeatSender(env.agent_socket, rank=env.rank, local_rank=env.local_rank,
                                                     generation=env.generation))
        self.section = "init"
        self.step = 0
        self.committed_step: int | None = None
        self.stop_signalled = False
        """Set by the stop signal handler; cleared when the control file is read."""
        self.stop_request: StopRequest | None = None
        self.injector: FaultInjector | None = None
        self.notes: list[str] = []
        """What could not be installed, and why."""
        self.position: Callable[[], dict[str, Any] | None] | None = None
        """Where the Run is in its data (the step's stream positions and sample indices, the seed): set by the
        Run, written into the error file so that an incident names the samples and can be replayed."""
        self._raised_in: tuple[BaseException, str] | None = None
        self._stack_file: IO[str] | None = None
        self._prev_excepthook: Any = None
        self._prev_stop_handler: Any = None
        self._said_bye = False
        self.standby = env.role == "spare"
        self._fault_plan: Any = None
        """A spare not yet promoted: nothing but ``recovery`` reports goes out."""
        self.rank, self.generation = env.rank, env.generation
        self._checkpoint_location: str | None = None
        self.diagnosis: InputDiagnosis | None = None
        """A diagnosis job's input-path isolation (``resilient diagnose input``); None in a training job."""
        if env.diagnose is not None:
            self.diagnosis = InputDiagnosis(DiagnoseSpec.parse(env.diagnose), env.rank)

    # ------------------------------------------------------------ install
    def install(self) -> None:
        """Register the stack dump, excepthook and stop handler; load the fault plan if any."""
        env = self.env
        self._prev_excepthook = sys.excepthook
        sys.excepthook = self._excepthook  # first: a bad fault plan below is a ConfigError, exit 78
        if env.stack_file is not None:
            self._stack_file = open(env.stack_file, "a", encoding="utf-8")  # noqa: SIM115  kept open for the handler
            faulthandler.register(env.stack_signal, file=self._stack_file, all_threads=True, chain=False)
        if env.control_file is not None:
            if threading.current_thread() is threading.main_thread():
                self._prev_stop_handler = signal.signal(env.stop_signal, self._on_stop_signal)
            else:
                self.notes.append("Run created outside the main thread: no graceful stop on the stop signal")
        if env.fault_plan is not None:
            from ..faults.inject import FaultInjector  # only now: `import resilient` never loads the injector
            from ..faults.plan import FaultPlan

            plan = FaultPlan.load(env.fault_plan)
            self._fault_plan = plan
            if not self.standby:  # a spare has no rank to be struck as until it is promoted (rejoin)
                self.injector = FaultInjector(plan, env.node_id, env.rank, env.attempt, events=self.events,
                                              record=self._fault_record())
            if any(f.section == "commit" for f in plan.faults):
                from ..checkpoint.commit import set_fault_point

                set_fault_point(self._commit_point)  # a save's commit, once staged and before it is published

    def _commit_point(self, section: str, step: int) -> None:
        if self.injector is not None:
            self.injector.at(section, step)

    def agent_log(self) -> EventLog | None:
        """The agent's run-level event log, where a fault's ``fault_injected`` event and the Run's forwarded
        events also go (None without a run directory, or when the Run's own log is that file already)."""
        return self._fault_record()

    def _fault_record(self) -> EventLog | None:
        """The agent's event log, where a fault's ``fault_injected`` event also goes (None without an agent)."""
        from ..core.events import EventLog

        if self.env.run_dir is None:
            return None
        path = os.path.join(self.env.run_dir, "events.jsonl")
        if self.events is not None and self.events.path is not None and \
                os.path.abspath(self.events.path) == os.path.abspath(path):
            return None  # the Run's own log is that file already: the event is written once
        return EventLog(path)

    def uninstall(self) -> None:
        """Undo :meth:`install` (for tests and for processes that outlive their Run)."""
        if self._stack_file is not None:
            faulthandler.unregister(self.env.stack_signal)
            self._stack_file.close()
            self._stack_file = None
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._prev_excepthook
        if self._prev_stop_handler is not None:
            signal.signal(self.env.stop_signal, self._prev_stop_handler)
            self._prev_stop_handler = None
        self.sender.close()

    # ---------------------------------------------------------- heartbeats
    def hello(self, checkpoint: str | None) -> None:
        self._checkpoint_location = checkpoint
        if self.standby:  # a spare says hello when it is promoted (rejoin)
            return
        self.sender.send("hello", self.section, self.step, committed_step=self.committed_step, checkpoint=checkpoint)
        if self.injector is not None:  # hello went out at once: nothing queued to flush
            self.injector.at(self.section, self.step)

    def enter(self, section: str, step: int, committed_step: int | None, *, tokens: int = 0, samples: int = 0,
              save: dict[str, Any] | None = None) -> None:
        """Report entering ``section`` at ``step`` (with the rank's counters); fire a planned fault there, if any."""
        self.section = section
        self.step = step
        self.committed_step = committed_step
        if not (self._said_bye or self.standby):  # after bye (e.g. Run.close() after a graceful stop): silence
            self.sender.send("section", section, step, committed_step=committed_step, tokens=tokens, samples=samples,
                             save=save)
        if self.injector is not None:
            if self.injector.due(section, step):
                self.sender.flush()  # the agent must see where the fault struck before it strikes
            self.injector.at(section, step)

    def restored(self, checkpoint: str | None, step: int | None, seconds: float) -> None:
        """Tell the agent what this process restored (``checkpoint`` None: a fresh start) and how long it took."""
        if self.standby:
            return
        report = {"checkpoint": checkpoint, "step": step, "seconds": round(max(0.0, seconds), 6)}
        self.sender.send_single("restored", self.section, self.step, committed_step=self.committed_step,
                                restored=report)

    def attach_loader(self, loader: ElasticLoader, section: Callable[[str], AbstractContextManager[Any]]) -> None:
        """The Run's loader: its waits are reported as section "data"; a diagnosis job holds its batches."""
        loader.report_section = section
        if self.diagnosis is not None:
            self.diagnosis.bind(loader)

    def timing(self, report: dict[str, Any]) -> None:
        """Send one window of step time by section (:mod:`resilient.watchdog.timing`) in a datagram of its own."""
        if self._said_bye or self.standby:
            return
        if self.diagnosis is not None and self.diagnosis.window(report):
            self.stop_request = StopRequest(0, "the input-path diagnosis measured both phases")
        self.sender.send_single("timing", self.section, self.step, committed_step=self.committed_step, timing=report)

    def audit(self, report: dict[str, Any]) -> None:
        """Send the replica audit's finding (:mod:`resilient.run.audit`) in a datagram of its own."""
        if self._said_bye or self.standby:
            return
        self.sender.send_single("audit", self.section, self.step, committed_step=self.committed_step, audit=report)

    def notice(self, notice: dict[str, Any]) -> None:
        """Tell the agent something it says on its console and in ``resilient status`` (``{"kind": ...}``)."""
        if self._said_bye or self.standby:
            return
        self.sender.send_single("notice", self.section, self.step, committed_step=self.committed_step, notice=notice)

    def recovery(self, report: dict[str, Any]) -> None:
        """Send an in-process recovery report (``{"event": ...}``) in a datagram of its own, standby or not."""
        self.sender.send_single("recovery", self.section, self.step, committed_step=self.committed_step,
                                recovery=report)

    def rejoin(self, generation: int, rank: int, resume_step: int | None = None) -> None:
        """Report as ``rank`` of ``generation`` from now on; a promoted spare leaves standby and says hello.

        Planned faults follow the rank: this process is now struck by ``rank``'s faults, except those at
        or before ``resume_step`` (the step the re-formed group resumes at): the run has been there
        already, and a replacement must not repeat the fault that took the rank it replaces.
        """
        self.rank, self.generation = rank, generation
        self.sender.rejoin(generation, rank)
        if self._fault_plan is not None:
            from ..faults.inject import FaultInjector

            self.injector = FaultInjector(self._fault_plan, self.env.node_id, rank, self.env.attempt,
                                          events=self.events, after_step=resume_step, record=self._fault_record())
        if self.standby:
            self.standby = False
            self.hello(self._checkpoint_location)

    def bye(self, step: int, committed_step: int | None) -> None:
        """Tell the agent that no more heartbeats will come from this process."""
        if self._said_bye:
            return
        self._said_bye = True
        self.step, self.committed_step = step, committed_step
        if not self.standby:
            self.sender.send("bye", self.section, step, committed_step=committed_step)
        self.sender.close()  # nothing follows a bye: stop the sending thread and release the socket

    def raised_in(self, exc: BaseException, section: str) -> None:
        """Remember the innermost section an exception left, for the error file."""
        if self._raised_in is None or self._raised_in[0] is not exc:
            self._raised_in = (exc, section)

    # ---------------------------------------------------------------- stop
    def _on_stop_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stop_signalled = True  # only a flag: the Run acts at its next step boundary

    def take_stop_request(self) -> StopRequest | None:
        """The pending stop request, reading the control file if a stop signal came since the last read."""
        if self.stop_signalled:
            self.stop_signalled = False
            assert self.env.control_file is not None
            self.stop_request = read_stop_request(self.env.control_file)
            if self.events is not None:
                self.events.emit(EventKind.STOP_REQUESTED, step=self.step, stop_at_step=self.stop_request.stop_at_step,
                                 reason=self.stop_request.reason)
        return self.stop_request

    # -------------------------------------------------------------- errors
    def _excepthook(self, exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        # The traceback reaches the log before the error file exists: the agent may stop this process as soon as
        # it sees the file (or a peer's death), and an error file then always has its traceback in the log.
        raised_at = (time.time(), time.monotonic())
        code = None
        try:
            from ..core.exitcodes import exit_code_for

            code = exit_code_for(exc)
        except Exception as e:  # noqa: BLE001  the hook must still print the original error
            print(f"resilient: could not map the error to an exit code: {e}", file=sys.stderr)
        if self.env.error_file is not None:
            print(f"{UNCAUGHT_PREFIX}{exc_type.__qualname__} in rank {self.rank}; traceback follows, then it is "
                  f"written to {self.env.error_file}", file=sys.stderr, flush=True)
        (self._prev_excepthook or sys.__excepthook__)(exc_type, exc, tb)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):
                pass
        try:
            self.write_error(exc_type, exc, tb, code, raised_at)
        except Exception as e:  # noqa: BLE001  the traceback is printed already; say why the file is missing
            print(f"resilient: could not write the error file: {e}", file=sys.stderr, flush=True)
        if code is not None:
            os._exit(code)

    def write_error(self, exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None,
                    exit_code: int | None, raised_at: tuple[float, float] | None = None) -> None:
        """Write the error file atomically (nothing when the agent gave none).

        ``raised_at`` is (clock time, monotonic time) when the exception reached the hook; default now.
        """
        path = self.env.error_file
        if path is None:
            return
        wall, mono = raised_at if raised_at is not None else (time.time(), time.monotonic())
        section = self._raised_in[1] if self._raised_in and self._raised_in[0] is exc else self.section
        module = exc_type.__module__
        record = {
            "rank": self.rank,
            "pid": os.getpid(),
            "time": wall,
            # The host's CLOCK_MONOTONIC, which the agent's clock is: it tells an error raised after a peer's death
            # was seen (a consequence) from one that came first.
            "monotonic": mono,
            "exc_type": exc_type.__qualname__ if module == "builtins" else f"{module}.{exc_type.__qualname__}",
            "message": str(exc),
            "traceback": "".join(traceback.format_exception(exc_type, exc, tb)),
            "section": section,
            "step": self.step,
            "exit_code": exit_code,
            "position": self._position(),
        }
        own = getattr(exc, "own_nonfinite", None)
        if isinstance(own, bool):  # non-finite gradients: whether this rank's own backward made them
            record["own_nonfinite"] = own
        write_json_atomic(path, record)

    def _position(self) -> dict[str, Any] | None:
        if self.position is None:
            return None
        try:
            return self.position()
        except Exception as e:  # noqa: BLE001 - the error file is written whatever the position cannot say
            return {"error": f"{type(e).__qualname__}: {e}"}
