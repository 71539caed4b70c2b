"""The script's side of recovery: ``Run(ddp=True)``, ``run.micro_batches()`` and ``with run.attempt():``.

A script opts into in-process recovery by letting the :class:`~resilient.run.Run`
own three things (DESIGN.md, "The script's side of recovery"):

- **the DDP wrapper** (``ddp=True``): the Run wraps the model itself once the
  process group exists, so it can wrap it again on a re-formed group
  (:mod:`.ddp`);
- **the split of the step** (``run.micro_batches()``): this rank's
  micro-batches of the run's fixed global batch under the batch plan
  (:mod:`resilient.elastic.batch`), with DDP's gradient sync only on the last
  (:func:`micro_batches`);
- **the attempt** (``with run.attempt():`` around the step body): what a retry
  of the step needs is recorded at entry (:class:`~.records.AttemptStart`), a failure
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
optimizer's update (:class:`~.records.StepPosition`, :func:`track_position`): a rank
that failed inside ``optimizer.step()`` or after it, with the rest of the
step unfinished, is dirty and never a source of state in a recovery
(:mod:`.recovery`); the ``state=`` objects, scheduler, scaler
and optimizer hyperparameters are copied at entry and put back on a retry
(:func:`rewind`).
"""

from __future__ import annotations

import copy
import hashlib
import random
import sys
import weakref
from collections.abc import Generator, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.parallel import DistributedDataParallel

from ..core.collective import is_collective_error  # torch-free: the agent classifies peer failures the same way
from ..core.errors import ConfigError, NonFiniteGradientsError, PersistentNonFiniteError, ResilientError
from ..core.events import EventKind
from ..core.state import seed_torch, unwrap
from . import nonfinite
from .records import AttemptStart, PendingVerdict, StepPosition
from .streams import generator_states, set_generator_states

if TYPE_CHECKING:
    from ..elastic.batch import BatchPlan
    from .state import RunState


def step_seed(seed: int, step: int, slot: int) -> int:
    """The torch seed of ``slot`` (a rank at attempt entry, a micro-batch's slot) at ``step`` of a run seeded ``seed``."""
    digest = hashlib.blake2b(f"resilient/{seed}/{step}/{slot}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def track_position(state: RunState, optimizer: Any) -> list[Any]:
    """Follow ``optimizer``'s update in ``state.attempt.position`` (BEFORE at each attempt's entry); the hooks'
    handles.

    Registered after every other hook the Run installs (the non-finite check, the step timer), so a
    collective those run before the update leaves the rank BEFORE it: nothing of the update was applied.
    """
    if optimizer is None:
        return []

    def entered(*_: Any) -> None:
        state.attempt.position = StepPosition.INSIDE

    def finished(*_: Any) -> None:
        state.attempt.position = StepPosition.AFTER

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


_IMMUTABLE = (float, int, bool, str, type(None), tuple)
"""Hyperparameter values kept as they are in an attempt's copy (a tensor learning rate, a list, is copied)."""


def begin(state: RunState) -> AttemptStart:
    """Record the attempt's start, seed the torch RNG from ``(seed, step, rank)`` (and Python's and numpy's
    global generators too with ``Run(reseed=True)``)."""
    if state.reseed:
        reseed(state.seed, state.step, state.rank)
    numpy = sys.modules.get("numpy")
    optimizer = state.optimizer
    # Copies only where this attempt can be retried: in-process recovery, or a non-finite gradient's retry.
    retryable = state.recovery is not None or state.nonfinite.mode == "retry"
    start = AttemptStart(
        step=state.step, consumed=state.data.consumed if state.data is not None else None, samples=state.samples,
        tokens=state.tokens, python_rng=random.getstate(),
        numpy_rng=numpy.random.get_state() if numpy is not None else None,
        user={name: snapshot_state(f"state[{name!r}]", obj) for name, obj in state.user_state.items()}
        if retryable else {},
        scheduler=snapshot_state("scheduler", state.scheduler) if retryable and state.scheduler is not None else None,
        scaler=snapshot_state("scaler", state.scaler) if retryable and state.scaler is not None else None,
        hyper=[{k: v if type(v) in _IMMUTABLE else copy.copy(v) for k, v in g.items() if k != "params"}
               for g in optimizer.param_groups] if retryable and optimizer is not None else [],
        generators=generator_states(state.generators) if retryable and state.generators else {},
        fetched=state.resume.fetched, retryable=retryable,
    )
    state.attempt.position = StepPosition.BEFORE
    seed_torch(step_seed(state.seed, state.step, state.rank))
    return start


def reseed(seed: int, step: int, rank: int) -> None:
    """Python's ``random`` and numpy's global generator (if imported) seeded from ``(seed, step, rank)``."""
    value = step_seed(seed, step, rank) ^ 0x9E3779B97F4A7C15  # not torch's seed: both are Mersenne twisters
    random.seed(value)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(value % (1 << 32))


def rewind(state: RunState, start: AttemptStart) -> None:
    """Put back what the failed attempt moved: cursor, counters, gradients, the ``state=`` objects, scheduler,
    scaler, the optimizer's hyperparameters and every RNG stream.  Parameters and optimizer state are the
    caller's: unchanged when the rank failed before the update (:class:`~.records.StepPosition`), else a peer's."""
    assert state.step == start.step, f"the step moved during the attempt: {start.step} -> {state.step}"
    assert start.retryable, "an attempt begun without its copies is being retried"
    close_micro_batches(state)
    state.attempt.micro_samples = None
    if state.data is not None and start.consumed is not None:
        state.data.rewind(start.consumed)
    state.samples, state.tokens = start.samples, start.tokens
    # A step body starts with no gradient (the previous step ended with zero_grad): drop the partial sums.
    for p in unwrap(state.model).parameters():
        p.grad = None
    for name, obj in state.user_state.items():
        obj.load_state_dict(copy.deepcopy(start.user[name]))  # a copy: the object may keep what it is given
    if state.scheduler is not None:
        state.scheduler.load_state_dict(copy.deepcopy(start.scheduler))
    if state.scaler is not None:
        state.scaler.load_state_dict(copy.deepcopy(start.scaler))
    if state.optimizer is not None:
        for group, hyper in zip(state.optimizer.param_groups, start.hyper, strict=True):
            group.update(copy.deepcopy(hyper))
    if start.generators:
        set_generator_states(state.generators, start.generators, "the attempt's start")
    random.setstate(start.python_rng)
    numpy = sys.modules.get("numpy")
    if numpy is not None and start.numpy_rng is not None:
        numpy.random.set_state(start.numpy_rng)
    seed_torch(step_seed(state.seed, state.step, state.rank))


def rewind_current(state: RunState) -> None:
    """Back to the current attempt's start (:func:`rewind`) for a retry; ConfigError outside an attempt."""
    if state.attempt.start is None:
        raise ConfigError("there is no attempt to rewind: a step is retried only inside run.attempt()")
    rewind(state, state.attempt.start)


def late_verdict_at_boundary(state: RunState, *, needed: bool) -> bool:
    """At a step boundary, the previous step's verdict where it is ready, or ``needed`` (something at this
    boundary keeps or sends the state).  True: that step was not finite and the Run went back to it (the loop
    runs it again); raises when it cannot be retried."""
    bad = nonfinite.settle(state, wait=needed)
    if bad is None:
        return False
    error = nonfinite.late_error(state, bad, "at the next step boundary")
    if bad.start is None or not nonfinite.retry(state, error, since=bad.start):
        raise error
    go_back(state, bad)
    return True


def go_back(state: RunState, pending: PendingVerdict) -> None:
    """Back to the start of ``pending``'s step (its update was skipped: parameters and optimizer state are that
    step's start already), to be retried and checked at once."""
    assert pending.start is not None
    close_micro_batches(state)
    state.step = pending.step
    rewind(state, pending.start)
    nonfinite.recheck(state, pending)


def is_recoverable(exc: BaseException) -> bool:
    """Whether ``exc`` is a peer or collective failure that re-forming the group can survive.

    The same classification the agent uses for consequences
    (:func:`resilient.core.collective.is_collective_error`): gloo's
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


def micro_batches(state: RunState, weighted: bool) -> Generator[Any, None, None]:
    """This rank's micro-batches of the step: seeded per slot, DDP's sync only on the last one."""
    if state.data is None:
        raise ConfigError("Run.micro_batches() needs data=ElasticLoader(...) when the Run is created")
    plan = state.data.plan
    if plan != state.attempt.announced_plan:  # the first step, and the first after a change of world size
        state.attempt.announced_plan = plan
        state.events.emit(EventKind.BATCH_PLANNED, step=state.step, rank=state.rank, **plan.to_event())
    items = state.data.micro_batches(weighted=weighted)  # checks the plan and the weights before anything is read
    model = state.model
    ddp = model if isinstance(model, DistributedDataParallel) else None
    micro = state.attempt.micro = _micro_batches(state, plan, items, ddp)
    return micro


def close_micro_batches(state: RunState) -> None:
    """Close the step's micro-batch generator, if open: one left inside DDP's ``no_sync()`` leaves it."""
    micro, state.attempt.micro = state.attempt.micro, None
    if micro is not None:
        micro.close()


def take_micro_samples(state: RunState) -> int | None:
    """The samples of the step's micro-batches read so far, once (``report()`` counts them when not told)."""
    samples, state.attempt.micro_samples = state.attempt.micro_samples, None
    return samples


def take_retry(state: RunState) -> bool:
    """Whether the step's attempt failed and was recovered (``steps()`` yields the step again), once."""
    retry, state.attempt.retry = state.attempt.retry, False
    return retry


def _micro_batches(state: RunState, plan: BatchPlan, items: Iterator[Any],
                   ddp: DistributedDataParallel | None) -> Generator[Any, None, None]:
    a = plan.accumulation
    samples = 0
    for k in range(a):
        seed_torch(step_seed(state.seed, state.step, state.rank * a + k))  # before reading: augmentations draw
        item = next(items)
        injector = state.hooks.injector if state.hooks is not None else None
        if k == 0 and injector is not None and injector.take_poison():
            item = poisoned(item)  # a fault plan's "nan": one bad value in this rank's batch
        samples += plan.slot(state.rank, k)[1]
        state.attempt.micro_samples = samples  # what report() counts for this step
        if ddp is not None and k + 1 < a:
            with ddp.no_sync():  # gradients accumulate locally; the last micro-batch's backward all-reduces them
                yield item
        else:
            yield item


MAX_INDICES = 4096
"""Sample indices a position names at most (a larger step's are cut, and say so)."""


def data_position(state: RunState) -> dict[str, Any]:
    """Where the run is in its data at this step: the step's first stream position, the global batch's dataset
    indices and this rank's share of them, the seed, the world.  Written into a worker's error file, so that an
    incident names the samples of the failing step, and a replay can check it feeds the same."""
    found: dict[str, Any] = {"step": state.step, "rank": state.rank, "world_size": state.world_size,
                             "seed": state.seed, "last_loss": state.last_loss}
    data = state.data
    if data is None:
        return found
    start = state.attempt.start.consumed if state.attempt.start is not None else state.step_cursor
    if start is None:
        start = data.consumed
    if state.attempt.announced_plan is not None:  # run.micro_batches(): this rank's slots of the global batch
        batch, slots = data.global_batch, state.attempt.announced_plan.slots(state.rank)
    else:  # next(loader): each rank its batch_size in rank order
        batch, slots = data.global_batch_size, ((state.rank * data.batch_size, data.batch_size),)
    mine = [offset for off, size in slots for offset in range(off, off + size)]
    indices = data.indices_at(start, min(batch, MAX_INDICES))
    found.update({"step_start": start, "global_batch": batch, "indices": indices, "cut": batch > MAX_INDICES,
                  "rank_indices": [indices[o] for o in mine if o < len(indices)]})
    return found


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
    offers none: ``state.recovery`` is None) every error passes through
    unchanged and recovery is by restart.  With it, a failure that
    :func:`is_recoverable` accepts is handed to ``state.recovery(exc)`` (the
    re-formation of the group, :mod:`.recovery`), which rewinds the attempt
    itself before anything else and may move ``state.step`` (past an update
    the state's source had applied); when it returns True the error is
    swallowed and ``run.steps()`` yields ``state.step`` again.  Non-finite
    gradients are retried on the same batch where :mod:`.nonfinite` says so.
    """

    __slots__ = ("_state",)

    def __init__(self, state: RunState) -> None:
        self._state = state

    def __enter__(self) -> None:
        state = self._state
        if state.attempt.start is not None:
            raise ConfigError("run.attempt() is already active: attempts do not nest (one per step body)")
        entered = getattr(state.recovery, "attempt_entered", None)  # in-process recovery's bookkeeping, if wired
        if entered is not None:
            entered()
        state.attempt.start = begin(state)
        state.attempt.ever_entered = True
        nonfinite.watch(state)

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> bool:
        state = self._state
        try:
            close_micro_batches(state)  # leaves DDP's no_sync if the body failed between micro-batches
            if isinstance(exc, nonfinite.LateNonFiniteError) and state.nonfinite.pending is not None:
                # An earlier step's verdict, read in this one's update: back to that step, on its batch.
                pending = state.nonfinite.pending
                if pending.start is None or not nonfinite.retry(state, exc, since=pending.start):
                    return False
                go_back(state, pending)
                state.attempt.retry = True
                return True
            if isinstance(exc, NonFiniteGradientsError) and not isinstance(exc, PersistentNonFiniteError):
                start = state.attempt.start
                if start is not None and state.resume.fetched is not start.fetched:
                    raise NonFiniteGradientsError(
                        f"{exc}; this step fetched its next batch ahead (run.prefetch) inside run.attempt(), so it "
                        "is not retried in place (its batch is gone): a restart gives the prefetched batch back",
                        step=exc.step, rank=exc.rank, params=exc.params, own_nonfinite=exc.own_nonfinite) from exc
                if not nonfinite.retry(state, exc):  # raises once the same batch failed every try
                    return False
                rewind_current(state)  # the same step on the same batch; every rank saw the same verdict
                state.attempt.retry = True
                return True
            if exc is None or state.recovery is None or not is_recoverable(exc):
                return False
            if not state.recovery(exc):  # it raises instead when it tried and failed
                return False
            state.attempt.retry = True
            state.events.emit(EventKind.ATTEMPT_RETRIED, step=state.step, rank=state.rank,
                              world_size=state.world_size, error=f"{type(exc).__qualname__}: {exc}"[:500])
            return True
        finally:
            state.attempt.start = None
            nonfinite.unwatch(state)
