"""Step time by section, measured in the training loop and sent to the agent once per window of steps.

Each step's wall time, from one step boundary to the next (so a checkpoint
stall at the boundary counts), is split into the sections of
:mod:`resilient.watchdog.timing`:

- the sections the Run is told about as they happen (``data`` by the
  loader, ``checkpoint``, the user's ``run.section(...)``), timed from
  entry to exit;
- ``optimizer``: ``optimizer.step()``, timed by the optimizer's step hooks;
- ``comm``: the gradient all-reduce's *exposed* wait.  A DDP communication
  hook notes when each bucket is handed over and when its all-reduce
  completes; what a backward waited is the last completion less the last
  hand-over (the rest ran while the backward was still computing).  Ranks
  waiting for a slow peer wait here, which is why it is never used to
  name a straggler;
- ``compute``: the rest of the step (forward, backward, the user's code).

Beside the sections, each window says how long the training thread was
runnable but waiting for a CPU, per step (``cpu``: the run-queue delay the
kernel keeps in ``/proc/thread-self/schedstat``; left out where there is no
such file).  A rank that is slower only because the host's scheduler kept it
waiting is told apart that way from one that is slower at its own work.

The hook all-reduces exactly as DDP's built-in path does (gradients scaled
by ``1 / world_size``, then summed), so results are bitwise the same with
and without it.  A user's own hook is kept: pass it as
``Run(ddp={"comm_hook": hook, "comm_state": state})`` and it is timed the
same way.  Cost: two clock reads per section change and per bucket, and a
report (with one read of the schedstat file) every :data:`WINDOW_STEPS` steps.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..watchdog.timing import CHECKPOINT, COMM, COMPUTE, DATA, OPTIMIZER

WINDOW_STEPS = 5
"""Steps per timing window (the detectors score one window at a time)."""
COMM_HOOK = "comm_hook"
COMM_STATE = "comm_state"
"""Keys of ``Run(ddp={...})`` that carry a user's communication hook and its state (not DDP arguments)."""
if TYPE_CHECKING:
    from ..worker.hooks import WorkerHooks

_BUCKETS = {"step": COMPUTE, "": COMPUTE, "data": DATA, "checkpoint": CHECKPOINT}
"""Run section -> timing section; any other name (a user's section) is its own."""
SCHEDSTAT = "/proc/thread-self/schedstat"


def run_queue_wait(path: str = SCHEDSTAT) -> float | None:
    """Seconds the calling thread has spent runnable but not running (its run-queue delay); None where unknown."""
    try:
        with open(path, "rb") as f:
            fields = f.read().split()
        return int(fields[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def step_timer(hooks: WorkerHooks | None, optimizer: Any, handles: list[Any]) -> StepTimer | None:
    """The Run's timer under an agent (None without one: nobody would read the reports), hooked to ``optimizer``
    (the hooks' handles appended to ``handles``)."""
    if hooks is None:
        return None
    timer = StepTimer(hooks.timing)
    if optimizer is not None:
        handles.append(optimizer.register_step_pre_hook(timer.optimizer_pre))
        handles.append(optimizer.register_step_post_hook(timer.optimizer_post))
    return timer


class StepTimer:
    """Splits each step's wall time into sections and hands a report to ``send`` at the end of every window."""

    def __init__(self, send: Callable[[dict[str, Any]], None], *, window: int = WINDOW_STEPS,
                 clock: Callable[[], float] = time.perf_counter,
                 cpu_wait: Callable[[], float | None] = run_queue_wait) -> None:
        self.window = window
        self._send = send
        self._clock = clock
        self._cpu_wait = cpu_wait
        self._wait_mark: float | None = None
        """The thread's run-queue delay when the window's first measured step began."""
        self._acc: dict[str, float] = {}
        self._bucket = COMPUTE
        self._mark: float | None = None
        """When the current section's time began to count; None outside a measured step."""
        self._started = 0.0
        self._steps: list[tuple[float, dict[str, float]]] = []
        self._index: int | None = None
        # What the communication hook saw of the backward in flight (written from gloo's threads as well).
        self._handed: float | None = None
        self._done: float | None = None
        self._comm_bucket = COMPUTE
        self._opt_started: float | None = None
        self.total: int | None = None
        """The steps the loop will run (``Run.steps(total)``): each window says how many are left."""
        self._left: int | None = None
        self.world: int | None = None
        """Ranks in the process group (set by the Run on every re-formation): each window says so."""

    # ---------------------------------------------------------------- the loop
    def begin(self) -> None:
        """Start measuring a step here (the first step, or the retry of a failed one: its time is dropped)."""
        now = self._clock()
        self._acc, self._mark, self._started = {}, now, now
        self._handed = self._done = None
        if not self._steps:
            self._wait_mark = self._cpu_wait()

    def switch(self, section: str) -> None:
        """The rank entered ``section`` (a Run section name): charge the time since the last change."""
        if self._mark is None:
            return
        now = self._clock()
        self._acc[self._bucket] = self._acc.get(self._bucket, 0.0) + (now - self._mark)
        self._bucket, self._mark = _BUCKETS.get(section, section), now

    def now(self) -> float:
        return self._clock()

    def nested(self, name: str, seconds: float) -> None:
        """``seconds`` of the current section were in fact ``name`` (measured by a hook inside it)."""
        if self._mark is None:
            return
        self._acc[name] = self._acc.get(name, 0.0) + seconds
        self._acc[self._bucket] = self._acc.get(self._bucket, 0.0) - seconds

    def end_step(self, step: int) -> None:
        """Step ``step`` (0-based index of the update) finished; report its window when that was the last step."""
        if self._mark is None:
            self.begin()
            return
        self._settle_comm()
        now = self._clock()
        self._acc[self._bucket] = self._acc.get(self._bucket, 0.0) + (now - self._mark)
        index = step // self.window
        if self._index is not None and index != self._index:
            self._report()  # a window left early (a resume mid-window): send what it has
        self._index = index
        self._steps.append((now - self._started, {k: max(0.0, v) for k, v in self._acc.items()}))
        self._left = None if self.total is None else max(0, self.total - (step + 1))
        self._acc, self._mark, self._started = {}, now, now
        if (step + 1) % self.window == 0:
            self._report()

    def _report(self) -> None:
        steps, index = self._steps, self._index
        self._steps, self._index = [], None
        if not steps or index is None:
            return
        names = {name for _, acc in steps for name in acc}
        sections = {}
        for name in sorted(names):
            values = [acc.get(name, 0.0) for _, acc in steps]
            median = statistics.median(values)
            sections[name] = round(median if median > 0 else sum(values) / len(values), 6)
        wall = sum(w for w, _ in steps) / len(steps)
        report: dict[str, Any] = {"w": index, "n": len(steps), "step": round(wall, 6), "s": sections}
        if self._left is not None:
            report["left"] = self._left
            report["total"] = self.total
        if self.world is not None:
            report["world"] = self.world
        waited, self._wait_mark = self._wait_mark, self._cpu_wait()
        if waited is not None and self._wait_mark is not None and self._wait_mark >= waited:
            report["cpu"] = round((self._wait_mark - waited) / len(steps), 6)
        self._send(report)

    # ---------------------------------------------------------------- hooks
    def optimizer_pre(self, *_: Any) -> None:
        self._opt_started = self._clock()

    def optimizer_post(self, *_: Any) -> None:
        started = self._opt_started
        if started is not None:
            self.nested(OPTIMIZER, self._clock() - started)
            self._opt_started = None

    def bucket_handed(self) -> None:
        self._handed = self._clock()
        self._comm_bucket = self._bucket

    def bucket_done(self) -> None:
        now = self._clock()
        if self._done is None or now > self._done:
            self._done = now

    def _settle_comm(self) -> None:
        """Charge the step's exposed communication wait: its last all-reduce's completion less its last hand-over.

        Every bucket handed over before the last one was reduced while the
        backward went on computing; only what followed the last hand-over
        held the backward up.  With several synchronised backwards in one
        step only the last one's wait is seen (DDP's ``no_sync`` micro-batches
        do not communicate, so gradient accumulation is measured in full).
        """
        handed, done = self._handed, self._done
        self._handed = self._done = None
        if handed is None or done is None or done <= handed:
            return
        self._acc[COMM] = self._acc.get(COMM, 0.0) + (done - handed)
        self._acc[self._comm_bucket] = self._acc.get(self._comm_bucket, 0.0) - (done - handed)

    def comm_hook(self, inner: Callable[..., Any] | None) -> Callable[[Any, Any], Any]:
        """A DDP communication hook that times ``inner`` (None: DDP's default all-reduce)."""
        return CommTiming(self, inner).hook()


_NO_STATE = object()


class CommTiming:
    """A DDP communication hook that tells a :class:`StepTimer` when each bucket is handed over and when its
    reduction completes, around the hook it runs (DDP's default all-reduce when none).

    The timer and the inner hook can be changed after registration (DDP takes one hook, once): a later Run
    over the same wrapper takes the timing over, and a hook the script registers afterwards runs inside.
    """

    def __init__(self, timer: StepTimer, inner: Callable[..., Any] | None = None) -> None:
        self.timer = timer
        self.inner = inner
        self.inner_state: Any = _NO_STATE
        """The state the inner hook was registered with, when it came after this hook (else the hook's own)."""

    def hook(self) -> Callable[[Any, Any], Any]:
        import torch
        import torch.distributed as dist

        timing = self

        def timed(state: Any, bucket: Any) -> Any:
            timer, inner = timing.timer, timing.inner
            timer.bucket_handed()
            if inner is not None:
                fut = inner(state if timing.inner_state is _NO_STATE else timing.inner_state, bucket)
            else:
                buffer = bucket.buffer()
                # Scale then sum, as DDP's built-in path does (a multiply by the reciprocal, not a divide:
                # the two differ in the last bit when the world size is not a power of two).
                buffer.mul_(1.0 / dist.get_world_size(state))
                fut = dist.all_reduce(buffer, group=state, async_op=True).get_future()

            def finished(f: Any) -> Any:
                timer.bucket_done()
                return f.value()[0] if inner is None else f.value()

            return fut.then(finished)

        # DDP checks a hook's annotations against the objects themselves; this module's are strings.
        timed.__annotations__ = {"state": object, "bucket": dist.GradBucket,
                                 "return": torch.futures.Future[torch.Tensor]}
        return timed


TIMING_ATTRIBUTE = "_resilient_comm_timing"
"""Where a script's DDP wrapper keeps the :class:`CommTiming` registered on it."""


def time_script_ddp(model: Any, timer: StepTimer | None) -> str | None:
    """Time the gradient all-reduce of a DDP wrapper the script made itself (``Run(model=DDP(...))``).

    The timer's hook is registered on it, and the wrapper's ``register_comm_hook`` now puts a hook the script
    registers later inside the timed one, with its own state: the script's code does not change, and its hook
    is timed too.  Without this a rank waiting for a slow peer waits inside the backward, which is counted as
    its compute: every rank looks as slow as the straggler.  Returns why it cannot (a hook registered before
    the Run: DDP takes one, once), or None.
    """
    from torch.nn.parallel import DistributedDataParallel

    if timer is None or not isinstance(model, DistributedDataParallel):
        return None
    timing = getattr(model, TIMING_ATTRIBUTE, None)
    if isinstance(timing, CommTiming):
        timing.timer = timer  # an earlier Run over this wrapper registered it: this one takes it over
        return None
    if model._comm_hooks:
        hook = getattr(model._comm_hooks[0][0], "__qualname__", "a hook")
        return (f"the DDP wrapper has a communication hook ({hook}) registered before resilient.Run(): DDP takes one "
                "hook, so the Run cannot time the gradient all-reduce, and a rank waiting for a slow peer looks as "
                "slow as it (straggler detection cannot tell them apart); register the hook after resilient.Run() "
                "and it runs inside the Run's, timed")
    timing = CommTiming(timer)
    try:
        model.register_comm_hook(model.process_group, timing.hook())
    except RuntimeError as e:  # a built-in hook (register_builtin_comm_hook) is not listed in _comm_hooks
        return f"the DDP wrapper's communication could not be timed: {e}"

    def register_comm_hook(state: object, hook: Callable[..., Any]) -> None:
        if timing.inner is not None:
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")
        model._check_comm_hook(hook)
        timing.inner, timing.inner_state = hook, state
        model._comm_hooks.append((hook, state))

    object.__setattr__(model, "register_comm_hook", register_comm_hook)
    object.__setattr__(model, TIMING_ATTRIBUTE, timing)
    return None


class _TimedCollective:
    """An FSDP2 all-gather or reduce-scatter (the one FSDP had) that tells the timer how long each blocking call
    took, waiting for every rank included, as communication.  An asynchronous call (CUDA's prefetching
    all-gather) returns its work untouched: its wait happens later, in FSDP's own code, and is not seen."""

    def __init__(self, timer: StepTimer, inner: Any) -> None:
        self.timer = timer
        self.inner = inner

    def allocate(self, size: Any, *, dtype: Any, device: Any) -> Any:
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("async_op"):
            return self.inner(*args, **kwargs)
        timer = self.timer
        started = timer.now()
        try:
            return self.inner(*args, **kwargs)
        finally:
            timer.nested(COMM, timer.now() - started)


def time_fsdp(model: Any, timer: StepTimer | None) -> str | None:
    """Time the all-gathers and reduce-scatters of every FSDP2 module in ``model`` as communication, so that the
    ranks waiting for a slow peer (inside those collectives) are told from it.  Returns why it cannot, or None.
    HSDP's all-reduce across replicas is not timed (FSDP issues it itself)."""
    from ..core import compat

    if timer is None:
        return None
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    except ImportError as e:
        return f"FSDP2's collectives cannot be timed under this torch: {e}"
    shards = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not shards:
        return None
    off = compat.missing("fsdp_comm_timing")
    if off is not None:
        return off
    timed_gather = type("TimedAllGather", (_TimedCollective, AllGather), {})
    timed_scatter = type("TimedReduceScatter", (_TimedCollective, ReduceScatter), {})
    for module in shards:
        groups = getattr(module._get_fsdp_state(), "_fsdp_param_groups", None)
        if groups is None:
            return "FSDP2's collectives cannot be timed: its state has no _fsdp_param_groups under this torch"
        if len(groups) != 1:
            continue  # no parameters of its own (a root over sharded children), or several meshes: left as it is
        gather, scatter = getattr(groups[0], "_all_gather_comm", None), getattr(groups[0], "_reduce_scatter_comm", None)
        if gather is None or scatter is None:
            return "FSDP2's collectives cannot be timed: its param group has no _all_gather_comm under this torch"
        for comm, setter, kind in ((gather, module.set_custom_all_gather, timed_gather),
                                   (scatter, module.set_custom_reduce_scatter, timed_scatter)):
            if isinstance(comm, _TimedCollective):
                comm.timer = timer  # an earlier Run over this model timed it: this one takes it over
            else:
                setter(kind(timer, comm))
    return None
