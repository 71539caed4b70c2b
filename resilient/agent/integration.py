"""Which rungs of recovery a run can take, and why not the others, in one line (pure).

The facts come from the script's Run at its first step (:mod:`resilient.run.integration`): a checkpoint
configured, the memory tier on, the step under ``run.attempt()``, in-process recovery offered by this agent
and whether the Run declined it (and why).  :class:`Offers` is what this agent was asked for.  The table the
line is drawn from is ``docs/integrations.md`` ("What each integration gets").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class Offers:
    """What this agent offers a run, from its flags."""

    spares: int = 0
    """``--spares``."""
    shrinkable: bool = False
    """``--nproc-per-node MIN:MAX`` or ``--nnodes MIN:MAX``."""
    in_process: bool = True
    """False with ``--no-in-process``."""
    restart_args: bool = False
    """``--restart-args`` given."""


NO_RUN = ("a restart runs the script again from its top{resume}: it creates no resilient.Run, so nothing is restored "
          "for it")


def describe(facts: Mapping[str, Any] | None, offers: Offers) -> str:
    """One line: the rungs this run can use, fastest first, and why not the faster ones."""
    if facts is None:
        resume = " with --restart-args (its own resume)" if offers.restart_args else ""
        return f"recovery for this script: {NO_RUN.format(resume=resume)}"
    if facts.get("checkpoint"):
        tiers = "the memory tier or the newest commit" if facts.get("memory") else "the newest commit"
        restart = f"a restart from {tiers}, bitwise (the steps since that save are trained again)"
    else:
        restart = "a restart from the first step (the Run has no checkpoint= to restore)"
    rungs = _in_process(facts, offers)
    if isinstance(rungs, list):
        return f"recovery for this script: in process first ({'; '.join(rungs)}), else {restart}"
    stopped = f"; the {offers.spares} spare(s) kept for it are stopped" if offers.spares and rungs else ""
    return f"recovery for this script: {restart}; not in process: {rungs}{stopped}"


def _in_process(facts: Mapping[str, Any], offers: Offers) -> list[str] | str:
    """The in-process rungs this run can take, or why it can take none."""
    declined = facts.get("declined")
    if not facts.get("attempt"):
        return "the script's steps are not under run.attempt()"
    if declined:
        return str(declined)
    if not offers.in_process:
        return "--no-in-process"
    if not facts.get("offered"):
        return "not asked for (give --spares N, or --nproc-per-node MIN:MAX: the script is ready for it)"
    rungs = []
    if offers.spares:
        rungs.append(f"a spare takes a lost rank's place, {offers.spares} kept")
    rungs.append("the survivors retry the step after a network error")
    if offers.shrinkable:
        rungs.append("shrink keeping the global batch, grow back later")
    return rungs
