"""One decision per failure: the exit-code contract, the in-process ladder, the restart policy, in that order.

:func:`decide` is the only place that answers "what now?" once workers failed.  It is pure: everything it
looks at comes in its arguments, read by the executors beforehand.

1. The exit-code contract, checked here and nowhere else: a rank that exited with a code of
   :data:`~resilient.core.exitcodes.NO_RESTART_CODES` (78: configuration, 79: unrecoverable state) said no
   recovery can help: STOP with ``do_not_restart``, and its agent exits with that code.
2. When in-process recovery is on offer (a :class:`LadderCase`): the ladder
   (:func:`~resilient.elastic.decide.decide_recovery`).  A rung that acts (retry in place, promote a spare,
   shrink) or holds (wait for repair) is the decision.
3. Otherwise, or when the ladder says only a restart can answer: the restart policy
   (:func:`~resilient.agent.policy.decide_restart`: the crash-loop breaker, the run's budget, the backoff)
   turns it into RESTART after its delay, or STOP with the policy's verdict.

The decision carries its reason (the ladder's, then the policy's) and is carried out by one of three executors:
in process on one machine (:func:`resilient.agent.continuation.continue_locally`), in process across machines
(:mod:`resilient.agent.cluster_decide`, committed through the store), or as a restart of the generation by the
lifecycle (:mod:`resilient.agent.lifecycle`), which asks :func:`decide` itself, without a ladder, only when the
generation ended with no decision taken on its failure (in-process recovery not on offer).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from ..core.exitcodes import NO_RESTART_CODES
from ..elastic.costs import RecoveryCosts
from ..elastic.decide import Action, LadderConfig, RecoveryDecision, decide_recovery
from ..elastic.observe import Observation
from .policy import Action as RestartAction
from .policy import Failure, History, RestartConfig, decide_restart

__all__ = ["LadderCase", "Restarts", "decide"]


@dataclass(frozen=True)
class Restarts:
    """What the restart policy decides from: the run's restart history (read from the store) and its bounds."""

    history: History
    config: RestartConfig


@dataclass(frozen=True)
class LadderCase:
    """In-process recovery on offer: what the ladder looks at, its measured costs and its bounds."""

    observation: Observation
    costs: RecoveryCosts
    config: LadderConfig


def contract_codes(failure: Failure, exit_codes: Collection[int] = ()) -> list[int]:
    """The exit codes of the failed ranks that say, by the contract, no recovery can help (sorted)."""
    codes = set(exit_codes)
    if failure.kind == "exit" and failure.exit_code:
        codes.add(failure.exit_code)
    return sorted(codes & NO_RESTART_CODES)


def decide(failure: Failure, restarts: Restarts, now: float, *, ladder: LadderCase | None = None,
           exit_codes: Collection[int] = (), world_size: int = 0) -> RecoveryDecision:
    """The one decision on ``failure`` (see the module doc).

    ``exit_codes``: every failed rank's non-zero exit status (the ladder's fault adds its own);
    ``world_size``: the failed generation's, for a decision taken without the ladder (0 when not known).
    """
    step = failure.step or 0
    world = world_size
    if ladder is not None:
        fault = ladder.observation.fault
        step, world = fault.step, ladder.observation.membership.world_size
        exit_codes = {*exit_codes, *fault.exit_codes}
    contract = contract_codes(failure, exit_codes)
    if contract:
        what = ladder.observation.describe_fault() if ladder is not None else failure.describe()
        codes = ", ".join(map(str, contract))
        return RecoveryDecision(
            action=Action.STOP, verdict="do_not_restart", exit_code=contract[0], step=step, world_size=world,
            not_before=now,
            reason=(f"stop: {what}; exit {codes} says by the exit-code contract that no recovery can help "
                    "(78: configuration, 79: unrecoverable state). Fix the cause (the rank's error file has the "
                    "traceback) and start the run again"),
        )
    why, numbers = "", {}
    if ladder is not None:
        rung = decide_recovery(ladder.observation, ladder.costs, ladder.config, now)
        if rung.action is not Action.RESTART:
            return rung
        why, numbers = rung.reason, dict(rung.numbers)
    policy = decide_restart(failure, restarts.history, restarts.config, now)
    if policy.action is RestartAction.STOP:
        return RecoveryDecision(
            action=Action.STOP, verdict=policy.verdict, step=step, world_size=world, not_before=now, numbers=numbers,
            reason=f"stop: {why}; and {policy.reason}" if why else policy.reason,
        )
    return RecoveryDecision(
        action=Action.RESTART, step=step, world_size=world, not_before=policy.not_before,
        numbers={**numbers, "delay_s": policy.delay_s},
        reason=f"{why}; {policy.reason}" if why else policy.reason,
    )
