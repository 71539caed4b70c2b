"""What this script's integration lets each rung of recovery do, told to the agent once, at the first step's end.

The rungs a run can take depend on how the script uses the Run (``docs/integrations.md``): restoring a
checkpoint needs ``checkpoint=``, the memory tier needs an agent that keeps one, and in-process recovery
(a spare in a lost rank's place, a retry in place, a shrink) needs the step body under ``run.attempt()``
with the groups the Run can form again.  Only after its first step does a Run know all of it (whether the
step ran in an attempt), so it sends these facts in a ``notice`` then; the agent, which knows what it
offers (``--spares``, ``MIN:MAX``), says in one line which rung this run can use and why not the others
(:mod:`resilient.agent.integration`).  A script that never entered an attempt declines in-process recovery
here, so that the agent stops the spares it would keep for nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .state import RunState

NO_ATTEMPT = "the script's steps are not under run.attempt()"


def facts(state: RunState) -> dict[str, Any]:
    """The script's side of the rungs, as the agent's :func:`~resilient.agent.integration.describe` reads it."""
    inproc, hooks = state.inproc, state.hooks
    offered = hooks is not None and hooks.env.recovery_store is not None
    return {
        "kind": "integration",
        "checkpoint": state.checkpoints is not None,
        "memory": state.memory is not None and state.memory.tier.off is None,
        "attempt": state.attempted,
        "offered": offered,
        "declined": inproc.declined if inproc is not None else None,
        "prefetch": state.fetched is not None,
        "ddp": state.ddp_options is not None,
    }


def after_first_step(state: RunState) -> None:
    """At the end of this process's first completed step: decline in-process recovery when the step was not in
    an attempt, then tell the agent the facts (once)."""
    state.integration_told = True
    if state.inproc is not None and not state.attempted:
        state.inproc.decline(NO_ATTEMPT)
    if state.hooks is not None:
        state.hooks.notice(facts(state))
