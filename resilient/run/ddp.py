"""The DDP wrapper a Run owns (``Run(ddp=True)``): made on the current group, made again on a re-formed one.

The Run wraps the model itself once the process group exists, so that it
can wrap it again after an in-process re-formation (:func:`wrap_ddp`,
:func:`rebuild`), carrying the bucket layout over so that a retried step
sums its gradients in the order the uninterrupted run did.  It also creates
the default group from torch's variables when the script made none
(:func:`init_default_group`), and follows the group's rank and world size
(:func:`regroup`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.parallel import DistributedDataParallel

from ..core import compat
from ..core.errors import ConfigError
from ..core.state import unwrap
from .timing import COMM_HOOK, COMM_STATE

if TYPE_CHECKING:
    from .state import RunState
    from .timing import StepTimer


def ddp_options(ddp: bool | Mapping[str, Any], model: torch.nn.Module,
                timer: StepTimer | None = None) -> dict[str, Any] | None:
    """``Run(ddp=...)`` as the keyword arguments of ``DistributedDataParallel`` (None: the Run does not wrap).

    Two keys are not DDP's: ``comm_hook`` and ``comm_state``, a communication
    hook to register on every wrapper the Run builds.  With a ``timer`` the
    hook (DDP's default all-reduce when none is given) is wrapped so that the
    timer sees the communication wait (:mod:`resilient.run.timing`).
    """
    if ddp is False:
        return None
    if ddp is not True and not (isinstance(ddp, Mapping) and all(isinstance(key, str) for key in ddp)):
        raise ConfigError(f"Run(ddp={ddp!r}): pass True, False, or a dict of DistributedDataParallel keyword arguments")
    # The Run wraps: a model wrapped already could not be rebuilt on a new group.
    if isinstance(model, DistributedDataParallel):
        raise ConfigError(
            "Run(ddp=True) wraps the model in DistributedDataParallel itself (so that it can rebuild the wrapper "
            "on a re-formed process group), but this model is wrapped already: pass the plain module "
            "(model.module), or leave ddp=False to keep your own wrapper"
        )
    options = {} if ddp is True else dict(ddp)
    hook = options.get(COMM_HOOK)
    if hook is not None and not callable(hook):
        raise ConfigError(f"Run(ddp={{'comm_hook': {hook!r}}}): a communication hook is a callable (state, bucket) "
                          "-> Future, as DistributedDataParallel.register_comm_hook takes")
    if timer is not None:
        options[COMM_HOOK] = timer.comm_hook(hook)
    return options


def init_default_group(wanted: bool) -> None:
    """Create the default process group from torch's variables when ``wanted`` and none exists yet.

    ``Run(ddp=True)`` does this so that a script needs no
    ``init_process_group`` call under ``torchrun`` or the agent (``env://``:
    ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``); gloo on a
    machine without CUDA, torch's default pair (gloo for CPU tensors, NCCL
    for CUDA ones) otherwise.  A script that creates the group itself keeps it.
    """
    import torch.distributed as dist

    from ..worker.env import launched_distributed

    if not wanted or not dist.is_available() or dist.is_initialized() or not launched_distributed():
        return
    dist.init_process_group("gloo" if not torch.cuda.is_available() else None, init_method="env://")


def wrap_ddp(model: torch.nn.Module, options: Mapping[str, Any],
             layout: list[list[int]] | None = None) -> torch.nn.Module:
    """``model`` (unwrapped first) in a new DDP wrapper on the current default group; the plain module without one.

    ``layout`` (:func:`ddp_layout` of the wrapper this one replaces, the
    same on every rank): start with that bucket layout instead of DDP's
    first-iteration one.  DDP rebuilds its buckets once, after its first
    iteration, in the order gradients became ready, and gloo's ring sums
    each chunk starting at a different rank, so with more than two ranks a
    fresh wrapper would sum the retried step in another order than the run
    that never failed (last-bit differences).  Carried over, the retried
    step sums exactly as the uninterrupted run did.
    """
    import torch.distributed as dist

    module = unwrap(model)
    if not (dist.is_available() and dist.is_initialized()):
        return module
    options = dict(options)
    hook, state = options.pop(COMM_HOOK, None), options.pop(COMM_STATE, None)
    if layout is None or compat.missing("ddp_bucket_layout"):  # without the private API: DDP's own layout
        return _with_hook(DistributedDataParallel(module, **options), hook, state)
    compute = dist._compute_bucket_assignment_by_size  # what DDP's constructor asks for its first layout

    def carried(tensors: list[torch.Tensor], bucket_size_limits: list[int], *rest: Any,
                **more: Any) -> tuple[list[list[int]], list[int]]:
        if sorted(i for bucket in layout for i in bucket) != list(range(len(tensors))):
            return compute(tensors, bucket_size_limits, *rest, **more)  # not this model's layout: DDP's own
        return list(reversed(layout)), [max(bucket_size_limits)] * len(layout)  # DDP reverses what it is given

    dist._compute_bucket_assignment_by_size = carried
    try:
        wrapped = DistributedDataParallel(module, **options)
    finally:
        dist._compute_bucket_assignment_by_size = compute
    return _with_hook(wrapped, hook, state)


def _with_hook(wrapped: DistributedDataParallel, hook: Any, state: Any) -> DistributedDataParallel:
    """``wrapped`` with the communication hook of ``Run(ddp=...)`` registered, if any."""
    if hook is not None:
        wrapped.register_comm_hook(state, hook)
    return wrapped


def ddp_layout(model: torch.nn.Module) -> list[list[int]] | None:
    """A DDP wrapper's current gradient buckets as indices of its parameters, in order; None for a plain module."""
    if not isinstance(model, DistributedDataParallel) or compat.missing("ddp_bucket_layout"):
        return None
    params, _ = model._build_params_for_reducer()
    index = {id(p): i for i, p in enumerate(params)}
    return [[index[id(p)] for p in bucket.parameters()] for bucket in model.reducer._get_zeros_like_grad_buckets()]


def regroup(state: RunState) -> None:
    """The rank and world size from the default process group (if any), and the loader's binding."""
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    state.rank = dist.get_rank() if distributed else 0
    state.world_size = dist.get_world_size() if distributed else 1
    if state.timer is not None:  # its windows say among how many ranks they are scored
        state.timer.world = state.world_size
    if state.data is not None:
        state.data.bind(state.rank, state.world_size)


def rebuild(state: RunState) -> None:
    """Follow a re-formed default process group: rank, world size, the loader's share, the DDP wrapper.

    Call it once every member's state is the same (DDP's construction
    broadcasts rank 0's parameters and buffers).
    """
    regroup(state)
    if state.ddp_options is not None:
        state.model = wrap_ddp(state.model, state.ddp_options)
