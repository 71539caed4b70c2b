"""The script's side of recovery: ``Run(ddp=True)``, ``run.micro_batches()`` and ``with run.attempt():``.

A script opts into in-process recovery by letting the :class:`~resilient.run.Run`
own three things (DESIGN.md, "The script's side of recovery"):

- **the DDP wrapper** (``ddp=True``): the Run wraps the model itself once the
  process group exists, so it can wrap it again on a re-formed group
  (:func:`wrap_ddp`; ``Run._rebuild_ddp``);
- **the split of the step** (``run.micro_batches()``): this rank's
  micro-batches of the run's fixed global batch under the batch plan
  (:mod:`resilient.elastic.batch`), with DDP's gradient sync only on the last
  (:func:`micro_batches`);
- **the attempt** (``with run.attempt():`` around the step body): what a retry
  of the step needs is recorded at entry (:class:`AttemptStart`), a failure
  that a re-formed group can survive is told apart from the rest
  (:func:`is_recoverable`), and the step's cursor, counters, gradients and
  random streams are put back for the retry (:func:`rewind`).

**Random numbers.**  A replacement rank cannot have the dead rank's RNG
state, so under the new API the torch RNG (CPU, and CUDA through
``torch.manual_seed``) is a function of the step, not of history:
``attempt()`` seeds it at entry from ``(seed, step, rank)`` and
``micro_batches()`` seeds it before each micro-batch from ``(seed, step,
slot)``, the slot being the micro-batch's place in the step's global batch
(``rank * accumulation + k``; at full size ``slot == rank``, the same seed as
the attempt's).  An uninterrupted run, a retried attempt and a replacement
therefore draw the same numbers, and a run shrunk to fewer ranks draws, for
each micro-batch, what the full-size rank that held those samples drew.
Python's ``random`` and numpy's global generator are re-seeded the same way
at attempt entry only with ``Run(reseed=True)`` (it changes what a script
that draws from them sees); otherwise a retry on the same process puts them
back as they were at the attempt's start, a replacement continues from its
own, and the first recovery with a replacement says so once
(``unreproducible_random_streams``).  A resumed run is still the same run:
the seeds depend only on the step.

**Where a rank is in the update.**  ``attempt()`` also follows the
optimizer's update (:class:`StepPosition`, :func:`track_position`): a rank
that failed inside ``optimizer.step()`` or after it, with the rest of the
step unfinished, is dirty and never a source of state in a recovery
(:mod:`resilient.run_recovery`); the ``state=`` objects, scheduler, scaler
and optimizer hyperparameters are copied at entry and put back on a retry
(:func:`rewind`).
"""

from __future__ import annotations

import copy
import enum
import hashlib
import random
import sys
import weakref
from collections.abc import Generator, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.parallel import DistributedDataParallel

from . import compat
from .collective import is_collective_error  # torch-free: the agent classifies peer failures the same way
from .elastic.batch import BatchPlan
from .errors import ConfigError, NonFiniteGradientsError, PersistentNonFiniteError, ResilientError
from .events import EventKind
from .run_timing import COMM_HOOK, COMM_STATE
from .state import unwrap

if TYPE_CHECKING:
    from .run import Run
    from .run_timing import StepTimer


def step_seed(seed: int, step: int, slot: int) -> int:
    """The torch seed of ``slot`` (a rank at attempt entry, a micro-batch's slot) at ``step`` of a run seeded ``seed``."""
    digest = hashlib.blake2b(f"resilient/{seed}/{step}/{slot}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def ddp_options(ddp: bool | Mapping[str, Any], model: torch.nn.Module,
                timer: StepTimer | None = None) -> dict[str, Any] | None:
    """``Run(ddp=...)`` as the keyword arguments of ``DistributedDataParallel`` (None: the Run does not wrap).

    Two keys are not DDP's: ``comm_hook`` and ``comm_state``, a communication
    hook to register on every wrapper the Run builds.  With a ``timer`` the
    hook (DDP's default all-reduce when none is given) is wrapped so that the
    timer sees the communication wait (:mod:`resilient.run_timing`).
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

    from .worker.env import launched_distributed

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


def regroup(run: Run) -> None:
    """The Run's rank and world size from the default process group (if any), and the loader's binding."""
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    run.rank = dist.get_rank() if distributed else 0
    run.world_size = dist.get_world_size() if distributed else 1
    if run._timer is not None:  # its windows say among how many ranks they are scored
        run._timer.world = run.world_size
    if run.data is not None:
        run.data.bind(run.rank, run.world_size)


class StepPosition(enum.Enum):
    """Where a rank is inside the step's optimizer update (DESIGN.md, "A step is atomic to the outside")."""

    BEFORE = "before"
    """The update was not entered: the rank's state is the step's start, once the attempt is rewound (clean)."""
    INSIDE = "inside"
    """Inside ``optimizer.step()``: part of the update may be applied (an optimizer with a collective in its
    step applies one part, waits for its peers, applies the rest).  Dirty: never a source of state."""
    AFTER = "after"
    """The update was applied but the rest of the step body did not finish (the scheduler, the counters, the
    ``state=`` objects may lag it, and what the body would still have done is unknown).  Dirty too."""


def track_position(run: Run, optimizer: Any) -> list[Any]:
    """Follow ``optimizer``'s update in ``run._position`` (BEFORE at each attempt's entry); the hooks' handles.

    Registered after every other hook the Run installs (the non-finite check, the step timer), so a
    collective those run before the update leaves the rank BEFORE it: nothing of the update was applied.
    """
    if optimizer is None:
        return []

    def entered(*_: Any) -> None:
        run._position = StepPosition.INSIDE

    def finished(*_: Any) -> None:
        run._position = StepPosition.AFTER

    return [optimizer.register_step_pre_hook(entered), optimizer.register_step_post_hook(finished)]


_HOOKED: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()
"""The handles of the hooks that the newest Run over each optimizer put on it."""


def take_over(optimizer: Any) -> None:
    """Remove the hooks an earlier Run put on ``optimizer``: the optimizer's steps answer to the newest Run over
    it.  An earlier Run's checks, counters and events would otherwise follow steps no longer its, and the
    optimizer would keep it alive, with its host buffers, for as long as the optimizer lives."""
    if optimizer is None:
        return
    for handle in _HOOKED.pop(optimizer, []):
        handle.remove()


def hooked(optimizer: Any, handles: list[Any]) -> None:
    """Record the hooks a Run put on ``optimizer`` (for :func:`take_over`)."""
    if optimizer is not None:
        _HOOKED[optimizer] = [h for h in handles if h is not None]


def snapshot_state(name: str, obj: Any) -> Any:
    """A copy of ``obj.state_dict()`` that later changes to ``obj`` cannot reach; ConfigError naming ``name``
    when it cannot be copied (a ``state=`` object is put back from it when a step is retried)."""
    try:
        return copy.deepcopy(obj.state_dict())
    except Exception as e:  # noqa: BLE001 - anything deepcopy raises: a lock, a file handle, a generator
        raise ConfigError(
            f"{name}: its state_dict() cannot be copied ({type(e).__qualname__}: {e}); a retried step puts it "
            "back from a copy taken at the step's start, so return plain values and tensors from state_dict()"
        ) from None


@dataclass(frozen=True)
class AttemptStart:
    """What a retry of the step needs, recorded when ``run.attempt()`` is entered."""

    step: int
    consumed: int | None
    """The loader's cursor at the step's start (None: no loader)."""
    samples: int
    tokens: int
    python_rng: Any
    numpy_rng: Any
    """numpy's global generator state; None when numpy is not imported."""
    user: dict[str, Any]
    """A copy of each ``state=`` object's state at the step's start."""
    scheduler: Any
    scaler: Any
    hyper: list[dict[str, Any]]
    """The optimizer's hyperparameters (every param group's entries but its parameters): a scheduler or the
    script may set them inside the step."""
    retryable: bool = True
    """False: nothing can retry this attempt (no in-process recovery, ``nonfinite`` not "retry"), so the copies
    above were not taken."""


def begin(run: Run) -> AttemptStart:
    """Record the attempt's start, seed the torch RNG from ``(seed, step, rank)`` (and Python's and numpy's
    global generators too with ``Run(reseed=True)``)."""
    if run.reseed:
        reseed(run.seed, run.step, run.rank)
    numpy = sys.modules.get("numpy")
    optimizer = run.optimizer
    # Copies only where this attempt can be retried: in-process recovery, or a non-finite gradient's retry.
    retryable = run._recovery is not None or run._nonfinite == "retry"
    start = AttemptStart(
        step=run.step, consumed=run.data.consumed if run.data is not None else None, samples=run.samples,
        tokens=run.tokens, python_rng=random.getstate(),
        numpy_rng=numpy.random.get_state() if numpy is not None else None,
        user={name: snapshot_state(f"state[{name!r}]", obj) for name, obj in run.user_state.items()}
        if retryable else {},
        scheduler=snapshot_state("scheduler", run.scheduler) if retryable and run.scheduler is not None else None,
        scaler=snapshot_state("scaler", run.scaler) if retryable and run.scaler is not None else None,
        hyper=[{k: copy.copy(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        if retryable and optimizer is not None else [],
        retryable=retryable,
    )
    run._position = StepPosition.BEFORE
    torch.manual_seed(step_seed(run.seed, run.step, run.rank))
    return start


def reseed(seed: int, step: int, rank: int) -> None:
    """Python's ``random`` and numpy's global generator (if imported) seeded from ``(seed, step, rank)``."""
    value = step_seed(seed, step, rank) ^ 0x9E3779B97F4A7C15  # not torch's seed: both are Mersenne twisters
    random.seed(value)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(value % (1 << 32))


def rewind(run: Run, start: AttemptStart) -> None:
    """Put back what the failed attempt moved: cursor, counters, gradients, the ``state=`` objects, scheduler,
    scaler, the optimizer's hyperparameters and every RNG stream.  Parameters and optimizer state are the
    caller's: unchanged when the rank failed before the update (:class:`StepPosition`), else a peer's."""
    assert run.step == start.step, f"the step moved during the attempt: {start.step} -> {run.step}"
    assert start.retryable, "an attempt begun without its copies is being retried"
    run._close_micro_batches()
    run._micro_samples = None
    if run.data is not None and start.consumed is not None:
        run.data.rewind(start.consumed)
    run.samples, run.tokens = start.samples, start.tokens
    # A step body starts with no gradient (the previous step ended with zero_grad): drop the partial sums.
    for p in unwrap(run.model).parameters():
        p.grad = None
    for name, obj in run.user_state.items():
        obj.load_state_dict(copy.deepcopy(start.user[name]))  # a copy: the object may keep what it is given
    if run.scheduler is not None:
        run.scheduler.load_state_dict(copy.deepcopy(start.scheduler))
    if run.scaler is not None:
        run.scaler.load_state_dict(copy.deepcopy(start.scaler))
    if run.optimizer is not None:
        for group, hyper in zip(run.optimizer.param_groups, start.hyper, strict=True):
            group.update(copy.deepcopy(hyper))
    random.setstate(start.python_rng)
    numpy = sys.modules.get("numpy")
    if numpy is not None and start.numpy_rng is not None:
        numpy.random.set_state(start.numpy_rng)
    torch.manual_seed(step_seed(run.seed, run.step, run.rank))


def is_recoverable(exc: BaseException) -> bool:
    """Whether ``exc`` is a peer or collective failure that re-forming the group can survive.

    The same classification the agent uses for consequences
    (:func:`resilient.collective.is_collective_error`): gloo's
    "Connection closed/reset by peer", an aborted NCCL communicator, a
    ``DistBackendError`` and its kin, a collective timeout, anywhere in the
    exception's chain.  Interrupts, exits and resilient's own errors are not.
    """
    if not isinstance(exc, Exception) or isinstance(exc, ResilientError):
        return False
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and len(seen) < 16:
        seen.add(id(current))
        if is_collective_error({"exc_type": type(current).__qualname__, "message": str(current)}):
            return True
        current = current.__cause__ or current.__context__
    return False


def micro_batches(run: Run, weighted: bool) -> Generator[Any, None, None]:
    """This rank's micro-batches of the step: seeded per slot, DDP's sync only on the last one."""
    if run.data is None:
        raise ConfigError("Run.micro_batches() needs data=ElasticLoader(...) when the Run is created")
    plan = run.data.plan
    if plan != run._announced_plan:  # the first step, and the first after a change of world size
        run._announced_plan = plan
        run.events.emit(EventKind.BATCH_PLANNED, step=run.step, rank=run.rank, **plan.to_event())
    items = run.data.micro_batches(weighted=weighted)  # checks the plan and the weights before anything is read
    model = run.model
    ddp = model if isinstance(model, DistributedDataParallel) else None
    return _micro_batches(run, plan, items, ddp)


def _micro_batches(run: Run, plan: BatchPlan, items: Iterator[Any],
                   ddp: DistributedDataParallel | None) -> Generator[Any, None, None]:
    a = plan.accumulation
    samples = 0
    for k in range(a):
        torch.manual_seed(step_seed(run.seed, run.step, run.rank * a + k))  # before reading: augmentations draw too
        item = next(items)
        if k == 0 and run._hooks is not None and run._hooks.injector is not None and run._hooks.injector.take_poison():
            item = poisoned(item)  # a fault plan's "nan": one bad value in this rank's batch
        samples += plan.slot(run.rank, k)[1]
        run._micro_samples = samples  # what report() counts for this step
        if ddp is not None and k + 1 < a:
            with ddp.no_sync():  # gradients accumulate locally; the last micro-batch's backward all-reduces them
                yield item
        else:
            yield item


def poisoned(batch: Any) -> Any:
    """``batch`` with its first floating-point tensor copied and its first element set to NaN (the loader's own
    tensors, and so the retry's batch, stay clean)."""
    done = False

    def walk(obj: Any) -> Any:
        nonlocal done
        if done:
            return obj
        if isinstance(obj, torch.Tensor) and obj.is_floating_point() and obj.numel():
            done = True
            copy = obj.clone()
            copy.view(-1)[0] = float("nan")
            return copy
        if isinstance(obj, tuple):
            return type(obj)(*map(walk, obj)) if hasattr(obj, "_fields") else tuple(map(walk, obj))
        if isinstance(obj, list):
            return [walk(o) for o in obj]
        if isinstance(obj, Mapping):
            return {k: walk(v) for k, v in obj.items()}
        return obj

    return walk(batch)


class Attempt:
    """``with run.attempt():``: one try of the step body; a recoverable failure is retried when recovery is wired.

    Without in-process recovery (plain python, torchrun, an agent that
    offers none: ``Run._recovery`` is None) every error passes through
    unchanged and recovery is by restart.  With it, a failure that
    :func:`is_recoverable` accepts is handed to ``Run._recovery(exc)`` (the
    re-formation of the group, :mod:`resilient.run_recovery`), which rewinds
    the attempt itself before anything else and may move ``run.step`` (past
    an update the state's source had applied); when it returns True the
    error is swallowed and ``run.steps()`` yields ``run.step`` again.
    """

    __slots__ = ("_run",)

    def __init__(self, run: Run) -> None:
        self._run = run

    def __enter__(self) -> None:
        run = self._run
        if run._attempt_start is not None:
            raise ConfigError("run.attempt() is already active: attempts do not nest (one per step body)")
        entered = getattr(run._recovery, "attempt_entered", None)  # in-process recovery's bookkeeping, if wired
        if entered is not None:
            entered()
        run._attempt_start = begin(run)

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> bool:
        run = self._run
        try:
            run._close_micro_batches()  # leaves DDP's no_sync if the body failed between micro-batches
            if isinstance(exc, NonFiniteGradientsError) and not isinstance(exc, PersistentNonFiniteError):
                from .run_nonfinite import retry

                return retry(run, exc)  # the same step on the same batch; every rank saw the same verdict
            if exc is None or run._recovery is None or not run._attempt_failed(exc):
                return False
            if not run._recovery(exc):  # it raises instead when it tried and failed
                return False
            run._retry = True
            run.events.emit(EventKind.ATTEMPT_RETRIED, step=run.step, rank=run.rank, world_size=run.world_size,
                            error=f"{type(exc).__qualname__}: {exc}"[:500])
            return True
        finally:
            run._attempt_start = None
