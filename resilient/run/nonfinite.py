"""Non-finite gradients: caught before the optimizer applies them, the step retried on the same batch.

One NaN or Inf in a gradient (a bad value in a batch, an overflow, a
flipped bit) poisons every parameter the optimizer touches with it, and
every checkpoint after that.  ``Run(nonfinite="retry")`` (the default)
registers a step pre-hook on the optimizer that checks the gradients it is
about to apply: one fused 2-norm over them (``torch._foreach_norm``), which
is finite when every element is; only when it is not are the elements
looked at, since huge finite gradients overflow the squares (the max-norm
is exact but several times slower on CPU).  With a data-parallel model every rank holds the same all-reduced
gradient, so every rank sees the same verdict without a collective; with
sharded parameters (DTensor) each rank checks its own shards and the
verdict is all-reduced (MAX) so that no rank steps while another does not.

A non-finite gradient raises :class:`~resilient.errors.NonFiniteGradientsError`
from ``optimizer.step()``: the update is not applied.  Inside
``with run.attempt():`` the step is rewound (cursor, counters, gradients,
random streams: :func:`resilient.run.attempt.rewind`) and retried on the
same batch, up to :data:`RETRIES` times; an intermittent fault is gone on the
retry and the run goes on as if it never happened.  When every try of the
step is non-finite the batch or the model is the cause, not chance:
:class:`~resilient.errors.PersistentNonFiniteError` names the step, the
samples' stream positions and the parameters, and the worker exits with
the unrecoverable code (the agent does not restart a replay of the same).
Outside an attempt the error propagates: the worker fails before the
poisoned update is applied and the agent restarts it from its newest
commit.  Each detection is a ``nonfinite_gradients`` event, also in the
agent's run-level log.

``nonfinite="raise"`` checks without retrying; ``"off"`` registers nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .. import compat
from ..errors import ConfigError, NonFiniteGradientsError, PersistentNonFiniteError
from ..events import EventKind
from ..state import unwrap

if TYPE_CHECKING:
    from .state import RunState

MODES = ("retry", "raise", "off")
RETRIES = 2
"""Retries of a step whose gradients were not finite, on the same batch, before it is called persistent."""
NAMED = 3
"""Parameters named in the error (the first few whose gradient is not finite)."""


def checked_mode(mode: Any) -> str:
    if mode not in MODES:
        raise ConfigError(f"Run(nonfinite={mode!r}): use one of {', '.join(map(repr, MODES))}")
    return str(mode)


def install(state: RunState, optimizer: torch.optim.Optimizer | None, mode: str) -> Any:
    """Register the check on ``optimizer`` (None when there is nothing to check); returns the hook's handle."""
    if optimizer is None or mode == "off":
        return None
    return optimizer.register_step_pre_hook(lambda opt, args, kwargs: check(state, opt))


def _local(grad: torch.Tensor) -> tuple[torch.Tensor, bool]:
    to_local = getattr(grad, "to_local", None)
    return (to_local(), True) if callable(to_local) else (grad, False)


def check(state: RunState, optimizer: torch.optim.Optimizer) -> None:
    """Raise :class:`NonFiniteGradientsError` when a gradient ``optimizer`` is about to apply is not finite."""
    grads, sharded = [], False
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                local, is_dtensor = _local(p.grad.detach())
                sharded |= is_dtensor
                if local.numel():
                    grads.append(local)
    if not grads and not sharded:
        return
    if grads:
        # One fused pass: finite exactly when no element is NaN or Inf ...
        norms = torch._foreach_norm(grads) if not compat.missing("fused_norm") else \
            [torch.linalg.vector_norm(g) for g in grads]
        bad = torch.logical_not(torch.stack([n.float() for n in norms]).isfinite().all())
        if bool(bad.item()):  # ... or when huge finite values overflowed the squares: look at the elements
            bad = torch.tensor(not all(bool(g.isfinite().all()) for g in grads))
    else:
        bad = torch.zeros((), dtype=torch.bool)
    if sharded and torch.distributed.is_available() and torch.distributed.is_initialized():
        flag = bad.to(torch.int32).reshape(1)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        bad = flag[0].bool()
    if not bool(bad.item()):
        return
    names = _bad_params(state, optimizer)
    where = f" (on this rank: {', '.join(names)})" if names else " (on another rank's shards)"
    raise NonFiniteGradientsError(
        f"step {state.step}: a gradient is not finite (NaN or Inf) on rank {state.rank} before the optimizer's update"
        f"{where}; the update was not applied", step=state.step, rank=state.rank, params=names)


def _bad_params(state: RunState, optimizer: torch.optim.Optimizer) -> tuple[str, ...]:
    names = {id(p): n for n, p in unwrap(state.model).named_parameters()}
    found: list[str] = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                local, _ = _local(p.grad.detach())
                if local.numel() and not bool(local.isfinite().all()):
                    found.append(names.get(id(p), f"parameter {len(found)}"))
                    if len(found) == NAMED:
                        return tuple(found)
    return tuple(found)


def retry(state: RunState, exc: NonFiniteGradientsError) -> bool:
    """From ``run.attempt()``'s exit: whether to retry the step on the same batch (the attempt rewinds it), or
    raise the persistent error once every try was non-finite."""
    tries = state.nonfinite_tries.get(state.step, 0) + 1
    state.nonfinite_tries = {state.step: tries}  # only the current step's count is kept
    start = state.attempt_start
    positions = None if start is None or start.consumed is None else (start.consumed, state.data.consumed
                                                                      if state.data is not None else None)
    retried = state.nonfinite_mode == "retry" and tries <= RETRIES
    state.events.emit(EventKind.NONFINITE_GRADIENTS, step=state.step, rank=state.rank, params=list(exc.params),
                    tries=tries, retried=retried, error=str(exc)[:500])
    if state.nonfinite_mode != "retry":
        return False
    if not retried:
        span = "" if positions is None or positions[1] is None else \
            f" (this rank's samples at stream positions {positions[0]} to {positions[1] - 1})"
        raise PersistentNonFiniteError(
            f"step {state.step}: the gradients were not finite in {tries} tries of the same batch{span}: the data or "
            "the model diverges, not an intermittent fault, and a restart would replay the same. Look at those "
            f"samples and at the learning rate and loss scaling; {exc}", step=state.step, rank=state.rank,
            params=exc.params) from exc
    return True
