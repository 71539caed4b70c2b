"""The exit-code contract between workers and the agent.

A worker that meets an error restarting cannot fix (bad configuration,
unrecoverable checkpoint state) exits with a code from
:data:`NO_RESTART_CODES`; the agent's restart policy stops the run instead of
burning its restart budget on it.  Every other non-zero exit or signal is a
failure worth a restart.  A preempted worker that committed its checkpoint
exits 0 like any finished worker: preemption needs no code of its own.
The agent's own exit status has codes of its own (75, 80, 81), outside the
workers' contract: a worker that exits with one of them is an ordinary failure.

:func:`describe_exit` turns a ``subprocess`` return code into words for
incidents and ``resilient status``.
"""

from __future__ import annotations

import signal
from enum import StrEnum

from .errors import (
    CheckpointMismatchError,
    ConfigError,
    NoValidCheckpointError,
    PersistentNonFiniteError,
    ResumeDivergedError,
)

EXIT_OK = 0
"""Finished (or preempted after committing a checkpoint)."""
EXIT_CONFIG = 78
"""Bad configuration (sysexits' EX_CONFIG): restarting cannot help."""
EXIT_UNRECOVERABLE = 79
"""Unrecoverable state (no valid checkpoint, checkpoint does not fit the job, a step that diverges on every try, a
resume that is not where the saving run was)."""

# The agent's own exit status (what ``resilient run`` returns to a scheduler).
EXIT_PREEMPTED_AGENT = 75
"""The agent was asked to stop (SIGTERM) and stopped its workers (sysexits' EX_TEMPFAIL: resubmit to resume)."""
EXIT_STOPPED = 80
"""The agent stopped the run with a verdict (restart budget exhausted, crash loop, rendezvous failed)."""
EXIT_UNHEALTHY = 81
"""This node failed its health check and stepped out: schedule the job elsewhere."""


class AgentVerdict(StrEnum):
    """How an agent ended, in one word: ``AgentResult.verdict``, the ``agent_finished`` event, the launch's
    published verdict.  Each goes with one of the agent's exit codes (``do_not_restart``: the worker's own)."""

    SUCCEEDED = "succeeded"
    PREEMPTED = "preempted"
    """Asked to stop (SIGTERM, ``resilient stop``, a quarantine's drain): the workers committed and exited."""
    INTERRUPTED = "interrupted"
    """SIGINT: stopped now, without a checkpoint (exit 130)."""
    STOPPED = "stopped"
    """Another node's verdict ended the run, without saying more."""
    UNHEALTHY = "unhealthy"
    BUDGET_EXHAUSTED = "budget_exhausted"
    CRASH_LOOP = "crash_loop"
    DO_NOT_RESTART = "do_not_restart"
    """A worker exited with a code of :data:`NO_RESTART_CODES`: the agent exits with that code."""
    TOKEN_MISMATCH = "token_mismatch"
    RENDEZVOUS_FAILED = "rendezvous_failed"
    AGENT_THREAD_FAILED = "agent_thread_failed"

    @classmethod
    def read(cls, text: str) -> AgentVerdict | None:
        """The verdict named ``text`` (as another node published it), or None for a word this version lacks."""
        try:
            return cls(text)
        except ValueError:
            return None


NO_RESTART_CODES: frozenset[int] = frozenset({EXIT_CONFIG, EXIT_UNRECOVERABLE})
"""Exit codes after which the agent stops the run rather than restarting it."""

_MEANING = {
    EXIT_OK: "success",
    EXIT_CONFIG: "configuration error: not restarted",
    EXIT_UNRECOVERABLE: "unrecoverable state: not restarted",
}
_AGENT_MEANING = {
    EXIT_OK: "success",
    EXIT_PREEMPTED_AGENT: "preempted: resubmit to resume",
    EXIT_STOPPED: "stopped with a verdict",
    EXIT_UNHEALTHY: "node unhealthy: stepped out",
}


def exit_code_for(exc: BaseException) -> int | None:
    """The contract's exit code for an uncaught ``exc``, or None for an ordinary (restartable) failure."""
    if isinstance(exc, ConfigError):
        return EXIT_CONFIG
    if isinstance(exc, (NoValidCheckpointError, CheckpointMismatchError, PersistentNonFiniteError, ResumeDivergedError)):
        return EXIT_UNRECOVERABLE
    return None


def signal_name(signum: int) -> str:
    """``SIGKILL`` for 9; ``signal 77`` for a number this platform does not name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_exit(code: int, *, agent: bool = False) -> str:
    """Words for a process's return code as ``subprocess`` reports it; ``agent`` reads the agent's own codes.

    Negative codes are deaths by signal (``-9`` -> ``killed by SIGKILL``).
    Codes 129..192 are also named as ``128+N``: that is how a shell (or a
    wrapper script) reports a child it saw die by signal N.
    """
    if code < 0:
        return f"killed by {signal_name(-code)}"
    meaning = (_AGENT_MEANING if agent else _MEANING).get(code)
    if meaning is not None:
        return f"exit {code} ({meaning})"
    if 128 < code <= 128 + 64:
        return f"exit {code} (128+{code - 128}: a shell's report of a child killed by {signal_name(code - 128)})"
    return f"exit {code}"
