"""The restart policy: after a failure, restart the group (and when) or stop the run, and why.

Pure functions of (failure, history, config, now): the restart rungs of the
agent's one decision per failure (:func:`resilient.agent.decision.decide`),
which checks the exit-code contract before them, and the in-process ladder
too when it is on offer.  The inputs come from the store (the restart count
lives there, so the budget is global, not per agent, and covers one launch
or, if asked, the whole run).  Checks, in order:

1. crash-loop breaker: ``crash_loop_restarts`` restarts in a row without a
   newly committed checkpoint, each attempt failing *the same way* as this
   one (:func:`same_way`: at the same step, or with the same error in the
   same place), means a restart cannot get past it; named before the budget
   because it says more.  Independent faults (other ranks, signals, steps)
   are left to the budget: each restart may still get further;
2. global budget: ``max_restarts`` restarts used;
3. otherwise restart after an exponential backoff in the restarts since the
   last progress (a run that keeps committing is never slowed down).

:func:`first_failure` picks the failure an incident is about when several
ranks fail together.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

from ..core.errors import ConfigError
from ..core.events import FAILURE_KINDS, FailureKind
from ..core.exitcodes import describe_exit, signal_name

Verdict = Literal["budget_exhausted", "crash_loop"]


@dataclass(frozen=True, kw_only=True)
class RestartConfig:
    """How many times, and how fast, a failed group is restarted."""

    max_restarts: int = 3
    """Restarts allowed, all nodes together (counted in the store); 0 never restarts."""
    budget_scope: Literal["launch", "run"] = "launch"
    """What ``max_restarts`` covers: each launch (a resubmission starts afresh) or the run across launches."""
    backoff_initial_s: float = 0.0
    """Delay before the first restart after progress; 0 restarts immediately."""
    backoff_factor: float = 2.0
    """Each restart without progress multiplies the delay by this."""
    backoff_max_s: float = 30.0
    """The delay never exceeds this."""
    crash_loop_restarts: int = 3
    """Stop after this many restarts in a row without a newly committed checkpoint, each failing the same way."""

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ConfigError(f"RestartConfig.max_restarts={self.max_restarts} must be >= 0 (0 never restarts)")
        if not (self.backoff_initial_s >= 0 and math.isfinite(self.backoff_initial_s)):
            raise ConfigError(f"RestartConfig.backoff_initial_s={self.backoff_initial_s} must be >= 0 seconds")
        if not (self.backoff_factor >= 1 and math.isfinite(self.backoff_factor)):
            raise ConfigError(f"RestartConfig.backoff_factor={self.backoff_factor} must be >= 1")
        if not (self.backoff_max_s >= self.backoff_initial_s and math.isfinite(self.backoff_max_s)):
            raise ConfigError(
                f"RestartConfig.backoff_max_s={self.backoff_max_s} must be finite and >= "
                f"backoff_initial_s={self.backoff_initial_s}"
            )
        if self.budget_scope not in ("launch", "run"):
            raise ConfigError(f"RestartConfig.budget_scope={self.budget_scope!r} must be 'launch' or 'run'")
        if self.crash_loop_restarts < 1:
            raise ConfigError(f"RestartConfig.crash_loop_restarts={self.crash_loop_restarts} must be >= 1")


@dataclass(frozen=True, kw_only=True)
class Failure:
    """One thing that went wrong with a rank or a node, as the agent saw it."""

    kind: FailureKind
    time: float
    """Agent clock when it was seen: the exit was reaped, the hang detected, the node declared lost."""
    rank: int | None = None
    node: str | None = None
    exit_code: int | None = None
    """For ``exit``: the non-zero exit status."""
    signal: int | None = None
    """For ``signal``: the signal number that killed the process."""
    section: str | None = None
    """Section the rank was in (from its last heartbeat)."""
    step: int | None = None
    caused_by_agent: bool = False
    """The agent itself killed this process while stopping the group: a casualty, never the cause."""
    consequence: bool = False
    """The rank raised the error a lost peer causes (a collective's connection reset, an aborted
    communicator): the cause only when nothing else failed."""
    detail: str | None = None
    """Evidence in one line: ``exc_type: message`` from the error file, a hang's reason, a health problem."""

    def __post_init__(self) -> None:
        if self.kind == "exit" and not self.exit_code:
            raise ValueError(f"a Failure of kind 'exit' needs a non-zero exit_code, got {self.exit_code}")
        if self.kind == "signal" and not (self.signal and self.signal > 0):
            raise ValueError(f"a Failure of kind 'signal' needs a signal number > 0, got {self.signal}")

    def describe(self) -> str:
        """One line for an on-call engineer, e.g. ``rank 1 on node n1 was killed by SIGKILL in 'step' at step 57``."""
        who = f"rank {self.rank}" if self.rank is not None else "a rank"
        if self.node is not None:
            who = f"node {self.node}" if self.rank is None else f"{who} on node {self.node}"
        if self.kind == "exit":
            assert self.exit_code is not None
            what = f"failed with {describe_exit(self.exit_code)}"
        elif self.kind == "signal":
            assert self.signal is not None
            what = f"was killed by {signal_name(self.signal)}"
        elif self.kind == "hang":
            what = "hung"
        elif self.kind == "node_lost":
            what = "was lost"
        elif self.kind == "collective":
            what = "had a collective fail with every rank alive"
        elif self.kind == "straggler":
            what = "was ended by the agent as a persistent straggler"
        else:
            what = "became unhealthy"
        text = f"{who} {what}"
        if self.section is not None:
            text += f" in section {self.section!r}"
        if self.step is not None:
            text += f" at step {self.step}"
        if self.caused_by_agent:
            text += " (stopped by the agent)"
        if self.detail:
            text += f": {self.detail}"
        return text


@dataclass(frozen=True, kw_only=True)
class FailureMark:
    """How a failure happened, without when: what a restart's failure is compared on (kept in its record)."""

    kind: FailureKind
    rank: int | None = None
    exit_code: int | None = None
    signal: int | None = None
    section: str | None = None
    step: int | None = None
    error: str | None = None
    """The exception's type, from the failure's ``exc_type: message`` evidence (None for a signal or a hang)."""

    @classmethod
    def of(cls, failure: Failure) -> FailureMark:
        error = None
        if failure.kind == "exit" and failure.detail and ":" in failure.detail:
            head = failure.detail.split(":", 1)[0].strip()
            error = head if head.replace(".", "").replace("_", "").isalnum() else None
        return cls(kind=failure.kind, rank=failure.rank, exit_code=failure.exit_code, signal=failure.signal,
                   section=failure.section, step=failure.step, error=error)

    def to_record(self) -> dict[str, object]:
        return {k: v for k, v in vars(self).items() if v is not None}

    @classmethod
    def from_record(cls, record: object) -> FailureMark | None:
        """The mark a restart record holds, or None (a record from before marks were kept, or damaged)."""
        if not isinstance(record, dict) or record.get("kind") not in FAILURE_KINDS:
            return None
        ints = {k: record.get(k) for k in ("rank", "exit_code", "signal", "step")}
        texts = {k: record.get(k) for k in ("section", "error")}
        if not all(v is None or (isinstance(v, int) and not isinstance(v, bool)) for v in ints.values()) or \
                not all(v is None or isinstance(v, str) for v in texts.values()):
            return None
        kind: FailureKind = record["kind"]
        return cls(kind=kind, rank=ints["rank"], exit_code=ints["exit_code"], signal=ints["signal"],
                   step=ints["step"], section=texts["section"], error=texts["error"])


def same_way(a: FailureMark, b: FailureMark) -> str | None:
    """How ``a`` and ``b`` are the same failure, in words, or None when they are independent.

    The same step (whatever killed it: a rank that runs out of memory at step 37 dies at 37 on every attempt); or
    the same error in the same section; or, without an error to compare and before any step, the same rank ending
    the same way in the same section.  A signal or a hang on another rank, with another signal, or at another step
    (the restart got elsewhere) is another fault."""
    if a.step is not None and a.step == b.step:
        return f"at step {a.step}"
    where = "" if a.section is None else f" in section {a.section!r}"
    if a.error is not None:
        if (a.error, a.section) == (b.error, b.section):
            return f"with {a.error}{where}"
        return None
    before_steps = a.step is None and b.step is None
    if b.error is None and before_steps and \
            (a.kind, a.rank, a.exit_code, a.signal, a.section) == (b.kind, b.rank, b.exit_code, b.signal, b.section):
        how = (f"exit {a.exit_code}" if a.kind == "exit" else signal_name(a.signal) if a.kind == "signal" and a.signal
               else a.kind)
        return f"rank {a.rank} by {how}{where}" if a.rank is not None else f"by {how}{where}"
    return None


@dataclass(frozen=True, kw_only=True)
class History:
    """What the policy needs to know about earlier restarts of this run."""

    restarts_used: int = 0
    """Restarts so far within the budget's scope (from the store: global, not per agent)."""
    restarts_since_progress: int = 0
    """Restarts since the newest committed checkpoint last advanced."""
    newest_committed_step: int | None = None
    """Step of the newest committed checkpoint; None if nothing was committed yet."""
    marks: tuple[FailureMark | None, ...] = ()
    """How the failures of the restarts since progress happened, oldest first (None: not known); fewer than
    ``restarts_since_progress`` when some are not known."""

    def with_commit(self, committed_step: int | None) -> History:
        """This history after seeing ``committed_step`` committed; a newer step resets the crash-loop count."""
        if committed_step is None or (
            self.newest_committed_step is not None and committed_step <= self.newest_committed_step
        ):
            return self
        return replace(self, newest_committed_step=committed_step, restarts_since_progress=0, marks=())

    def after_restart(self, committed_step: int | None = None, failure: FailureMark | None = None) -> History:
        """This history after one more restart (after ``failure``), resuming from ``committed_step``."""
        seen = self.with_commit(committed_step)
        return replace(
            seen, restarts_used=seen.restarts_used + 1, restarts_since_progress=seen.restarts_since_progress + 1,
            marks=(*seen.marks, failure),
        )

    def last_marks(self, n: int) -> tuple[FailureMark | None, ...]:
        """The marks of the last ``n`` restarts since progress, None where one is not known."""
        known = self.marks[-n:] if n else ()
        return (None,) * (min(n, self.restarts_since_progress) - len(known)) + known


class Action(enum.Enum):
    """What the supervisor does next."""

    RESTART = "restart"
    STOP = "stop"


@dataclass(frozen=True, kw_only=True)
class RestartDecision:
    """A restart (after ``delay_s``, not before ``not_before``) or a stop with a verdict."""

    action: Action
    delay_s: float
    not_before: float
    """``now + delay_s`` on the caller's clock."""
    reason: str
    verdict: Verdict | None
    """Why the run stops; None for a restart."""


def backoff_s(history: History, cfg: RestartConfig) -> float:
    """Delay before the next restart: ``initial * factor ** restarts_since_progress``, at most ``backoff_max_s``."""
    if cfg.backoff_initial_s == 0:
        return 0.0
    exponent = history.restarts_since_progress
    # Compare exponents, not powers: factor ** exponent can overflow a float.
    if cfg.backoff_factor > 1 and exponent * math.log(cfg.backoff_factor) >= math.log(
        cfg.backoff_max_s / cfg.backoff_initial_s
    ):
        return cfg.backoff_max_s
    return min(cfg.backoff_max_s, cfg.backoff_initial_s * cfg.backoff_factor**exponent)


def _resume_point(history: History) -> str:
    if history.newest_committed_step is None:
        return "no checkpoint committed yet"
    return f"newest committed checkpoint: step {history.newest_committed_step}"


def decide_restart(failure: Failure, history: History, cfg: RestartConfig, now: float) -> RestartDecision:
    """Restart or stop after ``failure``; call with ``history`` already updated by :meth:`History.with_commit`.
    The exit-code contract is not checked here: :func:`resilient.agent.decision.decide` checks it first."""
    what = failure.describe()

    def stop(verdict: Verdict, reason: str) -> RestartDecision:
        return RestartDecision(action=Action.STOP, delay_s=0.0, not_before=now, reason=reason, verdict=verdict)

    independent = ""
    if history.restarts_since_progress >= cfg.crash_loop_restarts:
        mark = FailureMark.of(failure)
        earlier = history.last_marks(cfg.crash_loop_restarts)
        ways = [None if m is None else same_way(m, mark) for m in earlier]
        if all(m is None or w is not None for m, w in zip(earlier, ways)):
            if history.newest_committed_step is None:
                stuck = "every attempt failed before the first checkpoint was committed"
            else:
                stuck = f"every attempt failed before committing past step {history.newest_committed_step}"
            known = [w for w in ways if w is not None]
            again = "" if not known else f", each failing the same way ({known[-1]})"
            return stop(
                "crash_loop",
                f"crash loop: {history.restarts_since_progress} restarts in a row without a newly committed "
                f"checkpoint (crash_loop_restarts={cfg.crash_loop_restarts}){again}; {stuck}. Last failure: {what}",
            )
        independent = (f"; not a crash loop: {history.restarts_since_progress} restarts without a new commit, "
                       "but not the same failure again (other ranks, signals or steps), so the budget decides")
    if history.restarts_used >= cfg.max_restarts:
        return stop(
            "budget_exhausted",
            f"restart budget exhausted: {history.restarts_used} of max_restarts={cfg.max_restarts} used by the "
            f"whole {cfg.budget_scope}. Last failure: {what}. Raise --max-restarts or fix the cause; "
            f"{_resume_point(history)}{independent}",
        )
    delay = backoff_s(history, cfg)
    when = "now" if delay == 0 else f"in {delay:.1f} s"
    if history.newest_committed_step is None:
        start = "no commit reported yet (the workers restore the newest that verifies, if any)"
    else:
        start = (f"newest commit reported: step {history.newest_committed_step} "
                 "(the workers restore the newest that verifies)")
    return RestartDecision(
        action=Action.RESTART,
        delay_s=delay,
        not_before=now + delay,
        reason=f"restart {history.restarts_used + 1} of {cfg.max_restarts} {when} after: {what}; {start}{independent}",
        verdict=None,
    )


_KIND_ORDER: dict[FailureKind, int] = {"exit": 0, "signal": 1, "hang": 2, "unhealthy": 3, "node_lost": 4}


def first_failure(failures: Sequence[Failure]) -> Failure:
    """The failure an incident is about: the earliest one the agent did not cause itself.

    Casualties of the agent's own stop (``caused_by_agent``) are chosen only
    when nothing else failed, and collective errors a lost peer causes
    (``consequence``) only when nothing but casualties failed: a survivor's
    "connection reset by peer" is what a peer's death (on this node or
    another) made it raise, whenever its exit was reaped.  A hang's time
    is its detection.  Ties go to a process's own death (exit, then signal)
    before a hang or a node event, then to the lowest rank.
    """
    if not failures:
        raise ValueError("first_failure needs at least one failure")
    genuine = ([f for f in failures if not (f.caused_by_agent or f.consequence)]
               or [f for f in failures if not f.caused_by_agent] or list(failures))
    return min(
        genuine,
        key=lambda f: (f.time, _KIND_ORDER[f.kind], f.rank if f.rank is not None else math.inf),
    )
