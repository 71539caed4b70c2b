"""What this script's integration lets each rung of recovery do, told to the agent once, at the first step's end.

The rungs a run can take depend on how the script uses the Run (``docs/integrations.md``): restoring a
checkpoint needs ``checkpoint=``, the memory tier needs an agent that keeps one, and in-process recovery
(a spare in a lost rank's place, a retry in place, a shrink) needs the step body under ``run.attempt()``
with the groups the Run can form again.  Only after its first step does a Run know all of it (whether the
step ran in an attempt), so it sends these facts in a ``notice`` then; the agent, which knows what it
offers (``--spares``, ``MIN:MAX``), says in one line which rung this run can use and why not the others
(:mod:`resilient.agent.integration`).  A script that never entered an attempt declines in-process recovery
here, so that the agent stops the spares it would keep for nothing.  Whatever else rules in-process recovery
out (a model whose groups cannot be made again, the script's own process groups, a batch fetched ahead inside
an attempt) declines it the same way, through :func:`decline`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..core.events import EventKind

if TYPE_CHECKING:
    from .state import RunState

NO_ATTEMPT = "the script's steps are not under run.attempt()"


def facts(state: RunState, *, memory: bool) -> dict[str, Any]:
    """The script's side of the rungs, as the agent's :func:`~resilient.agent.integration.describe` reads it
    (``memory``: the node's memory tier keeps this rank's state)."""
    inproc, hooks = state.inproc, state.hooks
    offered = hooks is not None and hooks.env.recovery_store is not None
    return {
        "kind": "integration",
        "checkpoint": state.checkpoints is not None,
        "memory": memory,
        "attempt": state.attempt.ever_entered,
        "offered": offered,
        "declined": inproc.declined if inproc is not None else None,
        "prefetch": state.resume.fetched is not None,
        "ddp": state.ddp_options is not None,
    }


def after_first_step(state: RunState, *, memory: bool) -> None:
    """At the end of this process's first completed step: decline in-process recovery when the step was not in
    an attempt, then tell the agent the facts (once)."""
    state.integration_told = True
    if state.inproc is not None and not state.attempt.ever_entered:
        decline(state, NO_ATTEMPT)
    if state.hooks is not None:
        state.hooks.notice(facts(state, memory=memory))


def decline(state: RunState, reason: str) -> None:
    """Recover this run by restart only, and say why: to the agent (which says it on its console and in
    ``resilient status``, and starts no spare for it) and in this rank's events.  Once; nothing without
    in-process recovery."""
    inproc = state.inproc
    if inproc is None or inproc.declined is not None:
        return
    inproc.declined = reason
    state.recovery = None  # a failure inside run.attempt() now propagates: the agent restarts the group
    if state.hooks is not None:
        state.hooks.recovery({"event": "declined", "worker": inproc.worker_id, "role": inproc.role, "reason": reason})
    state.events.emit(EventKind.IN_PROCESS_DECLINED, rank=state.rank, worker=inproc.worker_id, reason=reason)
