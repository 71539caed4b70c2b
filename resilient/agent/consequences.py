"""Which failures of a generation followed from its first one, and one line each for on-call.

When one rank dies, its peers in a collective fail too: gloo raises
"Connection closed by peer", NCCL aborts the communicator, and the agent's
own stop ends whoever was left.  Those are consequences, not causes.  Pure
functions here decide it from what the agent already has, the exits it
stamped and each rank's error file (written by the ``sys.excepthook`` its
``Run`` installs):

* :func:`~resilient.core.collective.caused_by_peer`: the error is of the kind a lost peer causes
  (a connection reset or closed by the peer, an aborted communicator, a
  collective that timed out), or non-finite gradients the rank's own
  backward did not make (another rank's samples made them, and the
  all-reduce brought them), so :func:`~resilient.agent.policy.first_failure`
  never names it while another failure is at hand;
* :func:`describe_others`: every failure but the first, a consequence when
  its error is a collective one or was raised after the first failure was
  seen (the error file's ``monotonic`` time: the host's clock, the agent's);
* :func:`describe_other`: a failure that is not the first, in one line:
  ``rank 0 on n0: consequence: RuntimeError: [gloo] Connection closed by
  peer [127.0.0.1]:20899 (after rank 1 was killed by SIGKILL)``; a rank the
  agent stopped without it raising anything is "stopped by the agent";
  one that raised an error of its own is never called that.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from ..core.exitcodes import describe_exit
from .policy import Failure

_SOURCE = re.compile(r"^\[([^\]\s]*/)?([^\]\s/]*)\.(cc|cpp|h|hpp):\d+\]\s*")


def short_error(error: Mapping[str, Any]) -> str:
    """``RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:20899`` from an error file's record.

    The first line of the message, its first sentence, with the C++ source
    location torch prepends replaced by the library's name; at most 160
    characters.  The full message and traceback stay in the error file and
    the incident.
    """
    kind = str(error.get("exc_type") or "error").rsplit(".", 1)[-1]
    lines = str(error.get("message") or "").strip().splitlines()
    text = lines[0] if lines else ""
    found = _SOURCE.match(text)
    if found:
        path = (found.group(1) or "").lower()
        lib = next((name for name in ("gloo", "nccl", "c10d") if name in path), None)
        text = (f"[{lib}] " if lib else "") + text[found.end():]
    sentence = re.match(r"(.+?\.)\s+[A-Z]", text)
    if sentence:
        text = sentence.group(1).rstrip(".")
    if len(text) > 160:
        text = text[:157] + "..."
    return f"{kind}: {text}" if text else kind


def cause(first: Failure) -> str:
    """The first failure in a few words: ``rank 1 was killed by SIGKILL``."""
    who = f"rank {first.rank}" if first.rank is not None else f"node {first.node}"
    if first.kind == "signal" and first.signal:
        return f"{who} was {describe_exit(-first.signal)}"
    if first.kind == "exit" and first.exit_code:
        return f"{who} failed with {describe_exit(first.exit_code)}"
    return f"{who} {'hung' if first.kind == 'hang' else 'failed'}"


def describe_other(f: Failure, error: Mapping[str, Any] | None, first: Failure) -> str:
    """One line for a failure ``f`` that is not ``first``; ``error`` is its error file's record (None: none)."""
    who = f"rank {f.rank} on {f.node}" if f.rank is not None else f"node {f.node}"
    where = (f" in section '{f.section}'" if f.section else "") + (f" at step {f.step}" if f.step is not None else "")
    after = f"(after {cause(first)})"
    if error:
        label = "consequence" if f.consequence else "also failed"
        return f"{who}{where}: {label}: {short_error(error)} {after}"
    code = f.exit_code if f.exit_code is not None else -(f.signal or 0)
    if f.caused_by_agent:
        return f"{who}{where}: {describe_exit(code)}: stopped by the agent {after}"
    return f"{who}{where}: also failed: {describe_exit(code)} {after}"


def raised_after(error: Mapping[str, Any] | None, t: float) -> bool:
    """Whether ``error`` (an error file's record) was raised at or after ``t`` on this host's monotonic clock."""
    raised = error.get("monotonic") if error else None
    return isinstance(raised, int | float) and not isinstance(raised, bool) and raised >= t


def raised_before(error: Mapping[str, Any] | None, t: float) -> bool:
    """Whether ``error`` (an error file's record) was raised before ``t`` on this host's monotonic clock."""
    raised = error.get("monotonic") if error else None
    return isinstance(raised, int | float) and not isinstance(raised, bool) and raised < t


def describe_others(failures: Sequence[Failure], errors: Mapping[int, Mapping[str, Any] | None],
                    first: Failure) -> tuple[str, ...]:
    """One line for each failure but ``first`` (``errors``: rank -> error file record or None)."""
    lines = []
    for f in failures:
        if f is first:
            continue
        error = errors.get(f.rank) if f.rank is not None else None
        if not f.consequence and raised_after(error, first.time):  # it raised once the first failure was seen
            f = replace(f, consequence=True)
        lines.append(describe_other(f, error, first))
    return tuple(lines)
