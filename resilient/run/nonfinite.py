"""Non-finite gradients: caught before the optimizer applies them, the step retried on the same batch.

One NaN or Inf in a gradient (a bad value in a batch, an overflow, a
flipped bit) poisons every parameter the optimizer touches with it, and
every checkpoint after that.  ``Run(nonfinite="retry")`` (the default)
registers a step pre-hook on the optimizer that checks the gradients it is
about to apply: one fused kernel over them, GradScaler's check of NaN and
Inf with a scale of one (the values stay as they are), and one host sync; a
few tens of microseconds for a small model on the CPU, where a norm per
tensor, or a fused 2-norm, cost several times that.  With a data-parallel model every rank holds the same all-reduced
gradient, so every rank sees the same verdict without a collective; with
sharded parameters (DTensor) each rank checks its own shards and the
verdict is all-reduced (MAX) so that no rank steps while another does not.

A non-finite gradient raises :class:`~resilient.core.errors.NonFiniteGradientsError`
from ``optimizer.step()``: the update is not applied.  Inside
``with run.attempt():`` the step is rewound (cursor, counters, gradients,
random streams: :func:`resilient.run.attempt.rewind`) and retried on the
same batch, up to :data:`RETRIES` times; an intermittent fault is gone on the
retry and the run goes on as if it never happened.  When every try of the
step is non-finite the batch or the model is the cause, not chance:
:class:`~resilient.core.errors.PersistentNonFiniteError` names the step, the
samples' stream positions and the parameters, and the worker exits with
the unrecoverable code (the agent does not restart a replay of the same).
Outside an attempt the error propagates: the worker fails before the
poisoned update is applied and the agent restarts it from its newest
commit.  Each detection is a ``nonfinite_gradients`` event, also in the
agent's run-level log.

``nonfinite="raise"`` checks without retrying; ``"off"`` registers nothing.

**The verdict without a host sync** (``nonfinite_verdict``).  Reading the
check's result on the host waits for the device to finish the step's
backward: on a GPU, a stall every step.  With ``"late"`` (``"auto"`` picks
it on CUDA) the check never reads it there.  One fused kernel
(``torch._amp_foreach_non_finite_check_and_unscale_``, the one AMP's scaler
uses) sets a flag on the device, and the optimizer's fused step skips the
whole update on the device when the flag is set (the ``found_inf`` protocol
of the fused Adam, AdamW and SGD): a non-finite update is still never
applied.  The flag is copied to the host asynchronously and read when the
device is long past it: at the next step's update, or at the boundary
before anything that keeps or sends the state (a checkpoint, the memory
tier, the replica audit, a stop, a re-formation, the end of the loop).  A
step found non-finite then is retried as in ``"now"``: the Run goes back to
that step's start (cursor, counters, scheduler, ``state=`` objects, random
streams; parameters and optimizer state never moved) and runs it again on
the same batch, checked at once this time, so that a persistent fault is
named with its parameters.  It needs a fused optimizer
(``fused=True``) and no ``GradScaler`` (which sets ``found_inf`` itself).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..core import compat
from ..core.errors import ConfigError, NonFiniteGradientsError, PersistentNonFiniteError
from ..core.events import EventKind
from ..core.state import unwrap
from .records import AttemptStart, OwnGradients, PendingVerdict

if TYPE_CHECKING:
    from .state import RunState

MODES = ("retry", "raise", "off")
VERDICTS = ("auto", "now", "late")
"""When the check's result is read: "now" in the update it guards; "late" a step later, with no host sync
(the update skipped on the device meanwhile); "auto" late on CUDA where the optimizer allows it."""
RETRIES = 2
"""Retries of a step whose gradients were not finite, on the same batch, before it is called persistent."""
NAMED = 3
"""Parameters named in the error (the first few whose gradient is not finite)."""


def checked_mode(mode: Any) -> str:
    if mode not in MODES:
        raise ConfigError(f"Run(nonfinite={mode!r}): use one of {', '.join(map(repr, MODES))}")
    return str(mode)


def checked_verdict(verdict: Any, mode: str, optimizer: torch.optim.Optimizer | None, scaler: Any) -> str:
    """``Run(nonfinite_verdict=...)`` resolved to "now" or "late"; ConfigError for "late" where it cannot be."""
    if verdict not in VERDICTS:
        raise ConfigError(f"Run(nonfinite_verdict={verdict!r}): use one of {', '.join(map(repr, VERDICTS))}")
    if mode == "off" or optimizer is None or verdict == "now":
        return "now"
    if verdict == "auto":  # late only on CUDA, where a host read waits for the device (and only then probed)
        on_cuda = any(p.device.type == "cuda" for g in optimizer.param_groups for p in g["params"])
        return "late" if on_cuda and _late_unavailable(optimizer, scaler) is None else "now"
    why = _late_unavailable(optimizer, scaler)
    if why is not None:
        raise ConfigError(f"Run(nonfinite_verdict='late'): {why}")
    return "late"


def configure(state: RunState, mode: Any, verdict: Any) -> None:
    """``Run(nonfinite=..., nonfinite_verdict=...)`` checked (ConfigError) and kept: how the state's optimizer is
    checked."""
    check = state.nonfinite
    check.mode = checked_mode(mode)
    check.verdict = checked_verdict(verdict, check.mode, state.optimizer, state.scaler)


def _late_unavailable(optimizer: torch.optim.Optimizer, scaler: Any) -> str | None:
    """Why the verdict cannot be read late for this optimizer (None: it can)."""
    if scaler is not None:
        return ("a GradScaler skips non-finite steps itself, through the optimizer's found_inf; leave "
                "nonfinite_verdict at 'auto' or 'now'")
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return (f"{type(optimizer).__name__} cannot skip an update on the device; create it with fused=True "
                "(Adam, AdamW and SGD have a fused step), or pass nonfinite_verdict='now'")
    devices = {p.device for g in optimizer.param_groups for p in g["params"]}
    if len(devices) > 1:
        return f"the optimizer's parameters are on {len(devices)} devices; the late check needs them on one"
    return compat.missing("late_nonfinite")


def install(state: RunState, optimizer: torch.optim.Optimizer | None, mode: str) -> list[Any]:
    """Register the check on ``optimizer`` (nothing when there is nothing to check); returns the hooks' handles."""
    if optimizer is None or mode == "off":
        return []
    if state.nonfinite.verdict == "now":
        return [optimizer.register_step_pre_hook(lambda opt, args, kwargs: check(state, opt))]
    return [optimizer.register_step_pre_hook(lambda opt, args, kwargs: check_late(state, opt)),
            optimizer.register_step_post_hook(lambda opt, args, kwargs: _stepped(opt))]


class LateNonFiniteError(NonFiniteGradientsError):
    """An earlier step's gradients were not finite, found when its verdict was read; its update was skipped."""


def check_late(state: RunState, optimizer: torch.optim.Optimizer) -> None:
    """The step's check, set on the device: the fused step skips the update when it finds NaN or Inf.

    First reads the previous step's verdict (its kernels ran while this step computed) and raises
    :class:`LateNonFiniteError` for it when it was not finite: this step's update is not applied either.
    """
    bad = settle(state, wait=True)
    if bad is not None:
        raise late_error(state, bad, "at the next step's update")
    if state.nonfinite.recheck_step == state.step:  # retried after a late verdict: checked now, its parameters named
        check(state, optimizer)
        return
    grads, sharded = _grads(optimizer)
    if not grads and not sharded:
        return
    device = grads[0].device if grads else next(p.device for g in optimizer.param_groups for p in g["params"])
    found = torch.zeros((), dtype=torch.float32, device=device)
    if grads:  # one fused kernel: found becomes 1 where any element is NaN or Inf (multiplied by 1: unchanged)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, torch.ones((), device=device))
    if sharded and torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(found, op=torch.distributed.ReduceOp.MAX)  # enqueued: no host sync
    optimizer.found_inf = found  # type: ignore[attr-defined]  # the fused step skips its update when set
    optimizer.grad_scale = None  # type: ignore[attr-defined]
    if device.type == "cuda":
        host = torch.empty((), dtype=torch.float32, pin_memory=True)
        host.copy_(found, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
    else:
        host, ready = found, None
    state.nonfinite.pending = PendingVerdict(state.step, host, ready, state.attempt.start)


def _stepped(optimizer: torch.optim.Optimizer) -> None:
    for name in ("found_inf", "grad_scale"):  # a later step without the check must not inherit them
        if hasattr(optimizer, name):
            delattr(optimizer, name)


def settle(state: RunState, *, wait: bool) -> PendingVerdict | None:
    """Read the pending verdict where it is ready (or ``wait`` for it); the pending step when it was not finite.

    A finite verdict is dropped; a non-finite one stays pending until the Run goes back to its step.
    """
    pending = state.nonfinite.pending
    if pending is None:
        return None
    if pending.bad is None:
        if pending.ready is not None and not pending.ready.query():
            if not wait:
                return None
            pending.ready.synchronize()
        pending.bad = bool(pending.host.item())  # a host tensor: no device sync
    if not pending.bad:
        state.nonfinite.pending = None
        return None
    return pending


def recheck(state: RunState, pending: PendingVerdict) -> None:
    """The Run went back to ``pending``'s step (its verdict was not finite): no longer pending, and that step's
    update is checked at once when it is run again."""
    state.nonfinite.recheck_step, state.nonfinite.pending = pending.step, None


def drop_pending(state: RunState) -> None:
    """Forget the pending verdict: the rank's state is to be replaced (by a peer's), not gone back over."""
    state.nonfinite.pending = None


def late_error(state: RunState, pending: PendingVerdict, when: str) -> LateNonFiniteError:
    return LateNonFiniteError(
        f"step {pending.step}: a gradient was not finite (NaN or Inf) on rank {state.rank}; the update was skipped "
        f"on the device and the verdict read {when} (nonfinite_verdict='late': the parameters are named when the "
        "step is checked again)", step=pending.step, rank=state.rank)


def _local(grad: torch.Tensor) -> tuple[torch.Tensor, bool]:
    to_local = getattr(grad, "to_local", None)
    return (to_local(), True) if callable(to_local) else (grad, False)


@dataclass
class _Plain:
    """An optimizer whose parameters are all plain tensors on one device, of one dtype: what the check of its
    gradients needs, found once (the check runs at every step, where a loop over the groups, a type test per
    gradient and two allocations cost more than the check's kernel for a small model)."""

    groups: int
    """The id of the ``param_groups`` list the parameters were read from."""
    params: list[torch.Tensor]
    flag: torch.Tensor
    one: torch.Tensor


_PLAIN: weakref.WeakKeyDictionary[Any, _Plain] = weakref.WeakKeyDictionary()


def _plain(optimizer: torch.optim.Optimizer) -> _Plain | None:
    """``optimizer``'s :class:`_Plain`, when its parameters are plain tensors of one device and dtype."""
    groups = optimizer.param_groups
    known = _PLAIN.get(optimizer)
    if known is not None and known.groups == id(groups) and sum(len(g["params"]) for g in groups) == len(known.params):
        return known
    params = [p for g in groups for p in g["params"]]
    if not params or compat.missing("fused_check") or any(_local(p)[1] for p in params) or \
            len({(p.device, p.dtype) for p in params}) != 1:
        return None
    device = params[0].device
    found = _PLAIN[optimizer] = _Plain(id(groups), params, torch.zeros((), dtype=torch.float32, device=device),
                                       torch.ones((), dtype=torch.float32, device=device))
    return found


def _grads(optimizer: torch.optim.Optimizer) -> tuple[list[torch.Tensor], bool]:
    """The gradients ``optimizer`` is about to apply (this rank's local parts), and whether any is sharded."""
    grads, sharded = [], False
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                local, is_dtensor = _local(p.grad.detach())
                sharded |= is_dtensor
                if local.numel():
                    grads.append(local)
    return grads, sharded


def _any_nonfinite(grads: list[torch.Tensor]) -> bool:
    """Whether any element of ``grads`` is NaN or Inf: one fused kernel per device and dtype (the check GradScaler
    makes, by a scale of one: the values stay as they are), one host sync; a pass per tensor without it."""
    if compat.missing("fused_check"):
        return not all(bool(g.isfinite().all()) for g in grads)
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault((g.device, g.dtype), []).append(g)
    found = []
    for (device, _), tensors in groups.items():
        flag = torch.zeros((), dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, flag, torch.ones((), device=device))
        found.append(flag if device.type == "cpu" else flag.cpu())
    return bool(found[0].item() if len(found) == 1 else torch.stack(found).sum().item())


def check(state: RunState, optimizer: torch.optim.Optimizer) -> None:
    """Raise :class:`NonFiniteGradientsError` when a gradient ``optimizer`` is about to apply is not finite."""
    plain = _plain(optimizer)
    if plain is not None:  # the usual case, at every step: one kernel over the gradients, one host sync
        grads = [p.grad for p in plain.params if p.grad is not None]
        if not grads:
            return
        plain.flag.zero_()
        torch._amp_foreach_non_finite_check_and_unscale_(grads, plain.flag, plain.one)
        if not plain.flag.item():
            return
    _check_all(state, optimizer)


def _check_all(state: RunState, optimizer: torch.optim.Optimizer) -> None:
    """:func:`check` of any optimizer's gradients (sharded, on several devices or dtypes), naming the bad ones."""
    grads, sharded = _grads(optimizer)
    if not grads and not sharded:
        return
    if grads:
        bad = torch.tensor(_any_nonfinite(grads))
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
    own = state.nonfinite.own.verdict() if state.nonfinite.own is not None else None
    whose = "" if own is None else \
        (". This rank's own backward made them not finite, before the ranks' gradients were averaged: look at "
         "this rank's samples first") if own else \
        (". This rank's own gradients were finite before the ranks' gradients were averaged: another rank's "
         "samples made them")
    raise NonFiniteGradientsError(
        f"step {state.step}: a gradient is not finite (NaN or Inf) on rank {state.rank} before the optimizer's update"
        f"{where}; the update was not applied{whose}", step=state.step, rank=state.rank, params=names,
        own_nonfinite=own)


def watch_own(state: RunState) -> OwnGradients | None:
    """At an attempt's entry: watch this rank's own gradients when the attempt retries a step found non-finite
    and the ranks average their gradients (so that the error can say whose samples made them)."""
    if state.world_size <= 1 or not state.nonfinite.tries.get(state.step) or state.model is None:
        return None
    return OwnGradients(state.model)


def watch(state: RunState) -> None:
    """At an attempt's entry: watch this rank's own gradients where :func:`watch_own` says so."""
    state.nonfinite.own = watch_own(state)


def unwatch(state: RunState) -> None:
    """At an attempt's exit: stop watching this rank's own gradients."""
    own, state.nonfinite.own = state.nonfinite.own, None
    if own is not None:
        own.remove()


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


def retry(state: RunState, exc: NonFiniteGradientsError, *, since: AttemptStart | None = None) -> bool:
    """Whether to retry ``exc.step`` on the same batch (the caller goes back to its start), or raise the persistent
    error once every try was non-finite.  ``since``: that step's start, where it is not the current attempt's
    (a late verdict)."""
    step = exc.step
    check = state.nonfinite
    tries = check.tries.get(step, 0) + 1
    check.tries = {step: tries}  # only the current step's count is kept
    start = since if since is not None else state.attempt.start
    first = start.consumed if start is not None else None
    end = state.data.consumed if state.data is not None else None
    if since is not None and state.attempt.start is not None:
        end = state.attempt.start.consumed  # read in the next step's update: the late step's batch ends there
    retried = check.mode == "retry" and tries <= RETRIES
    state.events.emit(EventKind.NONFINITE_GRADIENTS, step=step, rank=state.rank, params=list(exc.params),
                      tries=tries, retried=retried, late=isinstance(exc, LateNonFiniteError), error=str(exc)[:500])
    if check.mode != "retry":
        return False
    if not retried:
        span = "" if first is None or end is None else \
            f" (the step's global batch: stream positions {first} to {end - 1})"
        raise PersistentNonFiniteError(
            f"step {step}: the gradients were not finite in {tries} tries of the same batch{span}: the data or "
            "the model diverges, not an intermittent fault, and a restart would replay the same. Look at those "
            f"samples and at the learning rate and loss scaling; {exc}", step=step, rank=state.rank,
            params=exc.params, own_nonfinite=exc.own_nonfinite) from exc
    return True
