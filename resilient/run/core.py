"""``resilient.Run``: the object a training script creates.

It restores the newest committed checkpoint on creation, drives the step
loop (``for step in run.steps(n)``), takes checkpoints at completed-update
boundaries on the configured cadence, and counts progress.  A script changes
in about five lines; see the README.

Under the node agent (``resilient run``) a Run also reports the section it
is in with each heartbeat (:meth:`Run.section`), dumps its stacks on request,
writes an error file on an uncaught exception, injects planned faults, and
stops gracefully when asked (:mod:`resilient.worker.hooks`); without an
agent none of this is installed.  A script opts into in-process recovery
with ``ddp=True``, ``run.micro_batches()`` and ``with run.attempt():``
(:mod:`.attempt`, :mod:`.recovery`).
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable, Generator, Iterator, Mapping
from typing import Any, Generic, Self, TypeVar, overload

import torch

from ..checkpoint import sharded
from ..checkpoint.config import CheckpointConfig
from ..checkpoint.manager import CheckpointManager, SaveResult
from ..core import compat
from ..core.errors import ConfigError
from ..core.events import EventKind, EventLog, ForwardingLog
from ..core.state import Stateful, check_stateful, model_fingerprint, unwrap
from ..core.version import VERSION
from ..data.loader import ElasticLoader
from ..elastic import groups as _groups
from ..worker.env import WorkerEnv, replay_plan
from ..worker.heartbeat import HeartbeatCounts
from . import attempt as _attempt
from . import audit as _audit
from . import ddp as _ddp
from . import integration as _integration
from . import nonfinite as _nonfinite
from . import replay as _replay
from . import resume as _resume
from . import saving
from .memory import RunMemory, open_memory
from .mesh import take_joined, worker_hooks
from .payloads import check_sharding, config_values, digest_config, open_checkpoints, shard_layout
from .recovery import InProcessRecovery
from .sections import AFTER_STEPS, Section, between_updates, enter
from .state import RunState
from .streams import check_generators
from .timing import step_timer, time_fsdp, time_script_ddp

_FROM_ENVIRONMENT: Any = object()
T = TypeVar("T")


class _Read(Generic[T]):
    """A Run attribute that reads the Run's state; assigning it is an error (the Run owns its state)."""

    def __init__(self, doc: str) -> None:
        self.__doc__ = doc
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type) -> _Read[T]: ...
    @overload
    def __get__(self, obj: object, owner: type) -> T: ...
    def __get__(self, obj: object, owner: type) -> Any:
        return self if obj is None else getattr(obj._state, self.name)  # type: ignore[attr-defined]

    def __set__(self, obj: object, value: object) -> None:
        raise AttributeError(f"Run.{self.name} cannot be assigned: the Run owns its state (it changes it as the "
                             "loop runs, restores and recovers); create the Run with what it should hold")


class Run:
    """One rank's view of a resumable training run.

    ``step`` is the number of completed optimizer updates; inside the loop
    body it is the index of the update being computed.  The Run's state is
    one :class:`~resilient.run.state.RunState`; its attributes read it and
    none can be assigned.  The Run also holds the parts that act on the
    state at its boundaries: the node's memory tier (:mod:`.memory`),
    in-process recovery (:mod:`.recovery`) and a replay (:mod:`.replay`).
    """

    events: _Read[EventLog] = _Read("The run's event log (under an agent, also forwarded to the agent's).")
    model: _Read[torch.nn.Module] = _Read(
        "The model to call: the DDP wrapper with ``ddp=True`` under a process group, else the module given.")
    optimizer: _Read[Any] = _Read("The optimizer given, or None.")
    scheduler: _Read[Any] = _Read("The learning-rate scheduler given, or None.")
    scaler: _Read[Any] = _Read("The gradient scaler given, or None.")
    data: _Read[ElasticLoader | None] = _Read("The loader given, or None.")
    user_state: _Read[dict[str, Any]] = _Read("The ``state=`` objects, by name.")
    config: _Read[dict[str, Any] | None] = _Read("The config given (its digest is in every manifest), or None.")
    seed: _Read[int] = _Read("The run's seed for the random streams of attempts and micro-batches.")
    reseed: _Read[bool] = _Read("Whether Python's and numpy's global generators are seeded per step too.")
    step: _Read[int] = _Read("Completed optimizer updates; inside the loop body, the update being computed.")
    samples: _Read[int] = _Read("Samples this rank trained on (reported through :meth:`report`).")
    tokens: _Read[int] = _Read("Tokens this rank trained on (reported through :meth:`report`).")
    last_loss: _Read[float | None] = _Read("The loss last reported, or None.")
    last_step_s: _Read[float | None] = _Read("Seconds the last completed update took, or None.")
    rank: _Read[int] = _Read("This rank in the current process group (0 without one).")
    world_size: _Read[int] = _Read("Ranks in the current process group (1 without one).")
    restored_from: _Read[str | None] = _Read("The checkpoint restored at creation or since, or None.")
    groups: _Read[Any] = _Read("What ``Run(groups=fn)``'s ``fn`` returned in the current generation (None before).")
    checkpoints: _Read[CheckpointManager | None] = _Read("The checkpoint manager, with ``checkpoint=``; else None.")

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        scaler: Any = None,
        data: ElasticLoader | None = None,
        checkpoint: CheckpointConfig | None = None,
        state: Mapping[str, Stateful] | None = None,
        config: Mapping[str, Any] | None = None,
        events: EventLog | None = None,
        agent: WorkerEnv | None = _FROM_ENVIRONMENT,
        ddp: bool | Mapping[str, Any] = False,
        seed: int = 0,
        audit_every: int = 100,
        nonfinite: str = "retry",
        nonfinite_verdict: str = "auto",
        reseed: bool = False,
        groups: Callable[[], Any] | None = None,
        generators: Mapping[str, Any] | None = None,
        resume_check: str | None = None,
    ) -> None:
        """``agent``: the agent contract; read from the environment unless given (None: no agent).

        ``ddp``: wrap ``model`` in ``DistributedDataParallel`` here (True, or a
        dict of its keyword arguments) once a process group exists, so that the
        wrapper can be rebuilt on a re-formed group; ``run.model`` is then the
        wrapped module.  ``seed``: the run's seed for the random streams of
        :meth:`attempt` and :meth:`micro_batches` (:mod:`.attempt`).  ``audit_every``: compare
        replicated parameters across ranks every this many steps, 0 never (:mod:`.audit`).
        ``nonfinite``: a gradient with NaN or Inf is never applied; "retry" (the default) retries the step on
        the same batch inside :meth:`attempt`, "raise" only raises, "off" does not check
        (:mod:`.nonfinite`).  ``nonfinite_verdict``: "late" reads the check's result a step later, with no host
        sync (the update skipped on the device meanwhile; needs a fused optimizer), "now" in the update it
        guards, "auto" (the default) late on CUDA where the optimizer allows it.  ``reseed``: also seed Python's ``random`` and numpy's global
        generator from ``(seed, step, rank)`` at each attempt's entry, so a replacement rank draws what the rank
        it replaces would have (otherwise they continue from the process's own history).  ``groups``: a
        function that makes the script's own process groups (``dist.new_group`` calls) and returns them; the Run
        calls it once its own groups exist and again after every in-process re-formation, and ``run.groups``
        holds what it returned (use it each time: the groups of an earlier generation are destroyed).  A
        script that makes groups elsewhere recovers by restart only.  ``generators``: the script's own random
        generators by name (``torch.Generator``, ``random.Random``, numpy's), saved and restored per rank like the
        global ones, put back when a step is retried, and checked at the first step after a restore.
        ``resume_check``: what happens when that first step is not where the run that saved was (:mod:`.resume`):
        "stop" (the default: exit 79 with what moved and why) or "accept" (go on, recorded); unset: the agent's
        ``--resume-check``, else "stop".
        """
        env = WorkerEnv.from_environ(os.environ) if agent is _FROM_ENVIRONMENT else agent
        replaying = replay_plan(os.environ) if agent is _FROM_ENVIRONMENT else None  # resilient incident replay
        if replaying is not None:
            checkpoint = _replay.checkpoint_config(replaying, checkpoint)
        spare = env is not None and env.role == "spare"
        joined = take_joined() if spare else None  # a sharded spare promoted in resilient.device_mesh()
        st = self._state = RunState(model=model, events=events if events is not None else EventLog())
        self._inproc: InProcessRecovery | None = None
        """In-process recovery, under an agent that offers it (its standing is ``state.inproc``)."""
        self._memory: RunMemory | None = None
        """The node's memory tier: restored from first, saved at boundaries."""
        self._replay: _replay.Replay | None = None
        """``resilient incident replay``: ends the loop once the failing step is behind, writes what happened."""
        st.hooks = hooks = worker_hooks(env, st.events, joined)  # first: errors below get a file
        if hooks is not None and (agent_log := hooks.agent_log()) is not None:
            node = env.node_id if env is not None else None
            st.events = ForwardingLog(st.events, agent_log,
                                      lambda: {"rank": hooks.rank, "node": node, "source": "worker"})
        if hooks is not None:
            hooks.position = lambda: _attempt.data_position(st)  # in the error file: the failing step's samples
            hooks.hello(os.fspath(checkpoint.dir) if checkpoint is not None else None)
            for note in hooks.notes:
                st.events.emit(EventKind.AGENT_HOOK_MISSING, note=note)
        _check_components(model, optimizer, scheduler, scaler, state)
        off = compat.off(sharded=sharded.is_sharded(model))  # those this run can use
        if off:  # fail closed: each feature that needs a missing private API is off, and this says which
            st.events.emit(EventKind.TORCH_FEATURES_OFF, torch=torch.__version__, features=off)
        st.optimizer, st.scheduler, st.scaler, st.data = optimizer, scheduler, scaler, data
        st.user_state = dict(state or {})
        st.config = dict(config) if config is not None else None
        st.sharded = check_sharding(model, ddp, spare=spare and joined is None)
        layout = shard_layout(st, env, spare=spare)
        _attempt.take_over(optimizer)  # an earlier Run over this optimizer lets go of it
        optimizer_hooks: list[Any] = []
        st.timer = step_timer(hooks, optimizer, optimizer_hooks)
        st.ddp_options = _ddp.ddp_options(ddp, model, st.timer)
        untimed = time_script_ddp(model, st.timer) if st.ddp_options is None else None
        untimed = untimed or (time_fsdp(model, st.timer) if st.sharded else None)
        if untimed is not None:
            st.events.emit(EventKind.COMM_NOT_TIMED, reason=untimed)
        # torchrun or the agent, and the script made no group; a spare's group is the one it was promoted into
        _ddp.init_default_group(st.ddp_options is not None and not spare)
        st.seed, st.reseed = _checked_seed(seed, reseed)
        st.generators = check_generators(generators)
        _resume.configure(st, resume_check if resume_check is not None else
                          env.resume_check if env is not None and env.resume_check else "stop")
        st.audit_every = _audit.checked_every(audit_every)
        _nonfinite.configure(st, nonfinite, nonfinite_verdict)
        optimizer_hooks += [*_nonfinite.install(st, optimizer, st.nonfinite.mode),
                            *_attempt.track_position(st, optimizer)]  # the latter last
        _attempt.hooked(optimizer, optimizer_hooks)
        # A sharded model whose layout cannot be moved to a new group recovers by restart only.
        if env and env.recovery_store and (layout is not None or not st.sharded):
            st.recovery = self._inproc = InProcessRecovery(st, env, hooks, layout=layout, joined=joined)
        if groups is not None and not callable(groups):
            raise ConfigError(f"Run(groups={groups!r}) must be a function that makes the script's process groups")
        st.make_groups = groups
        _ddp.regroup(st)  # rank and world size of the process group (if any), the loader's share of it
        self._replay = _replay.Replay(replaying, st) if replaying is not None else None
        if st.inproc is not None and (restart_only := _groups.restart_only(model)) is not None:
            _integration.decline(st, restart_only)  # said at the start, so the agent starts no spare for nothing
        if data is not None and hooks is not None:
            hooks.attach_loader(data, self.section)
        st.fingerprint = {
            "model": model_fingerprint(model),
            "config": digest_config(st.config),
            "config_values": config_values(st.config),  # a resume under another config names what changed
            "code": {"resilient": VERSION, "torch": torch.__version__},
        }
        self._open_checkpoints(checkpoint, env, spare=spare, joined=joined)
        if st.make_groups is not None and not (spare and joined is None):  # a spare makes them once promoted
            if self._inproc is not None:
                self._inproc.make_user_groups()
            else:
                st.groups = st.make_groups()
        if spare and st.inproc is not None and st.inproc.declined is not None:
            # This run recovers by restart only: a spare would hold its memory (a GPU's) for nothing.
            raise SystemExit(0)
        if spare and self._inproc is not None:  # blocks until promoted, then a member with its state
            self._inproc.wait_as_spare()
        elif st.ddp_options is not None:  # after the restore: DDP's first broadcast then carries the restored state
            st.model = _ddp.wrap_ddp(st.model, st.ddp_options)
        st.events.emit(EventKind.RUN_STARTED, rank=st.rank, world_size=st.world_size, step=st.step,
                       restored_from=st.restored_from)

    def _open_checkpoints(self, checkpoint: CheckpointConfig | None, env: WorkerEnv | None, *, spare: bool,
                          joined: object) -> None:
        """The memory tier and the checkpoint manager, and the newest state of either restored (a diagnosis job
        measures: it keeps nothing)."""
        st = self._state
        restore_started, diagnosing = time.perf_counter(), env is not None and env.diagnose is not None
        memory = self._memory = open_memory(st, env) if checkpoint is not None and not diagnosing else None
        if checkpoint is not None and not diagnosing:
            with Section(st, "restore"):
                # A promoted spare takes its state from the members, not from a checkpoint.
                promoted = joined is not None or (env is not None and env.promoted is not None)
                st.checkpoints = open_checkpoints(st, checkpoint, env, spare=spare, restore=not promoted,
                                                  from_memory=memory.restore if memory is not None else None)
        if st.hooks is not None:  # the agent reports which checkpoint every rank restored (None: fresh start)
            st.hooks.restored(st.restored_from, st.step if st.restored_from else None,
                              time.perf_counter() - restore_started)

    # ------------------------------------------------------------- the loop
    def steps(self, total: int) -> Iterator[int]:
        """Yield the index of each update still to do, up to ``total`` updates.

        Resuming the generator marks the previous update complete; at each
        boundary a due checkpoint is snapshotted before the next update.

        Under the agent, a graceful stop request ends the loop at a
        boundary by committing a checkpoint and raising ``SystemExit(0)``
        from here; let it propagate (``except Exception`` does not catch it)
        so the process exits 0, running ``finally`` blocks and ``with``
        exits on the way.
        """
        if total < 0:
            raise ConfigError(f"Run.steps({total}): the number of steps must be >= 0")
        st = self._state
        hooks, timer = st.hooks, st.timer
        if timer is not None:
            timer.total = total
            timer.begin()
        while True:
            yield from self._steps(total)
            # The last update's verdict (nonfinite_verdict="late") before the save on finish and whatever the
            # script does after the loop: a step found non-finite now is run again.
            if st.nonfinite.pending is None or not _attempt.late_verdict_at_boundary(st, needed=True):
                break
        saving.at_finish(st)
        if hooks is not None:
            enter(st, AFTER_STEPS)

    def _steps(self, total: int) -> Iterator[int]:
        st = self._state
        hooks, timer = st.hooks, st.timer
        while st.step < total:
            if st.resume.expected is not None:  # the first boundary after a restore: where the saving run was?
                _resume.verify(st)
            st.step_cursor = st.data.consumed if st.data is not None else None  # the step's first sample
            if self._replay is not None and self._replay.at_boundary():
                return  # a replay: the failing step is behind
            saving.measure(st)
            if st.nonfinite.pending is not None and _attempt.late_verdict_at_boundary(st, needed=self._keeps_state()):
                if timer is not None:
                    timer.begin()
                continue  # the step before was not finite (read late): back to it, on the same batch
            if hooks is not None and (hooks.stop_signalled or hooks.stop_request is not None):
                saving.stop_at_boundary(st, hooks)
            if self._inproc is not None:
                self._inproc.at_boundary()  # a shrunk world grows back here when the agent says so
            if _audit.due(st):
                _audit.at_boundary(st)
            saving.at_boundary(st)
            if self._memory is not None:
                self._memory.at_boundary()
            st.step_started = time.perf_counter()
            if hooks is not None:
                enter(st, "step")
            st.in_body = True
            yield st.step
            st.in_body = False
            if _attempt.take_retry(st):  # the attempt failed and was recovered in-process: the same step again
                if timer is not None:
                    timer.begin()  # the failed attempt and the recovery are not the step's time
                continue
            st.last_step_s = time.perf_counter() - st.step_started
            if timer is not None:
                timer.end_step(st.step)
            st.step += 1
            if not st.integration_told:
                _integration.after_first_step(st, memory=self._memory is not None and self._memory.tier.off is None)
            between_updates(st)

    def _keeps_state(self) -> bool:
        """Whether this boundary keeps or sends the state (a save, the memory tier, the audit, a stop, a growth): a
        late non-finite verdict is read here even if the device is not done with it."""
        st, inproc, memory = self._state, self._inproc, self._memory
        hooks = st.hooks
        return (hooks is not None and (hooks.stop_signalled or hooks.stop_request is not None)) \
            or (inproc is not None and inproc.may_grow()) or _audit.due(st) or saving.due(st) \
            or (memory is not None and memory.due(st.step))

    def report(self, *, loss: Any = None, tokens: int = 0, samples: int | None = None) -> None:
        """Count this rank's progress for the current update."""
        st = self._state
        if loss is not None:
            st.last_loss = float(loss.detach().item() if isinstance(loss, torch.Tensor) else loss)
        if samples is None:
            counted = _attempt.take_micro_samples(st)
            samples = counted if counted is not None else st.data.batch_size if st.data is not None else 0
        st.samples += int(samples)
        st.tokens += int(tokens)

    def prefetch(self, fetch: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """Fetch a batch ahead of the step that uses it: ``X, Y = run.prefetch(get_batch, "train")``.

        Returns ``fetch(*args, **kwargs)``.  A script that fetches the next
        step's batch inside the current one (to overlap it with the backward
        pass) draws random numbers, or reads the loader, for a step that no
        checkpoint holds yet.  Through this call the Run notes the streams
        before and after the fetch, and a checkpoint taken before that batch
        is used gives the *before* back: the resumed script's fetch before its
        loop then draws the same batch, and the run continues as if it had not
        stopped.  Fetch through it both before the loop and in the step.  A
        step that fetched ahead inside ``run.attempt()`` cannot be retried in
        place (the batch is the script's own), so such a run recovers by
        restart, and says so (:mod:`.resume`).
        """
        return _resume.prefetch(self._state, fetch, args, kwargs)

    def attempt(self) -> _attempt.Attempt:
        """``with run.attempt():`` around the step body: a peer failure inside is survived and the step retried.

        Only where in-process recovery is available; under plain python or
        torchrun every error passes through (recovery is by restart).  Entry
        seeds the torch RNG from ``(seed, step, rank)`` and records the cursor,
        so a retry reads the same batches and draws the same numbers.  Keep
        the whole step body inside: code after the block runs once per attempt.
        """
        return _attempt.Attempt(self._state)

    def micro_batches(self, *, weighted: bool = False) -> Generator[Any, None, None]:
        """This rank's share of the step's global batch: :attr:`accumulation` micro-batches, at any world size.

        The global batch is the loader's ``batch_size`` times the world size at
        the run's first start; with DDP only the last micro-batch's backward
        all-reduces (``no_sync()`` on the others).  Divide each micro-batch's
        mean loss by :attr:`accumulation`; where the plan is uneven (the
        loader's ``batch_rule="uneven"``) iterate ``weighted=True`` pairs
        ``(batch, weight)`` and multiply by ``weight`` instead.
        """
        return _attempt.micro_batches(self._state, weighted)

    @property
    def accumulation(self) -> int:
        """Micro-batches this rank runs per step under :meth:`micro_batches` (1 at the run's first world size)."""
        data = self._state.data
        return data.plan.require().accumulation if data is not None else 1

    def save(self) -> SaveResult:
        """Commit a checkpoint of the state after ``step`` updates; return once committed.

        Call it at the top of an iteration (before any work of that step) or
        outside the loop.
        """
        return saving.commit(self._state)

    def close(self) -> SaveResult | None:
        """Wait for the in-flight checkpoint (if any) to commit, stop the loader's workers; return the save's outcome."""
        st = self._state
        result = None
        if st.checkpoints is not None:
            with Section(st, "checkpoint"):
                result = st.checkpoints.wait()
        if self._memory is not None:
            self._memory.close()
        if st.data is not None:
            st.data.close()  # stop its worker processes now, not whenever the loader is collected
        if st.ddp_options is not None:  # its wrapper must not outlive the group (docs/design/in-process-worker.md)
            st.model = unwrap(st.model)
            if st.hooks is not None:
                # A collection holds the GIL throughout (seconds on a CPU-starved rank): the heartbeats queued
                # since the last datagram go first, or the agent keeps timing the section this rank has left.
                st.hooks.sender.flush()
            gc.collect()  # it sits in reference cycles: freed now, not while Python exits (an abort there)
        st.events.emit(EventKind.RUN_CLOSED, step=st.step)
        if st.hooks is not None:
            st.hooks.bye(st.step, st.committed_step())
        return result

    @property
    def heartbeats(self) -> HeartbeatCounts | None:
        """Heartbeats sent to the agent and dropped on the way (full queue, no agent); None without an agent."""
        hooks = self._state.hooks
        if hooks is None:
            return None
        return HeartbeatCounts(sent=hooks.sender.sent, dropped=hooks.sender.dropped)

    def section(self, name: str) -> Section:
        """Context manager marking a part of the loop, e.g. ``with run.section("eval"): ...``.

        Under the agent, entering it sends a heartbeat naming ``name`` (a hang there is attributed to it and
        timed with its timeout); leaving it re-enters the enclosing section.
        """
        return Section(self._state, name)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_components(model: object, optimizer: object, scheduler: object, scaler: object,
                      state: Mapping[str, Stateful] | None) -> None:
    """Refuse what a Run cannot checkpoint or retry, naming the fix."""
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"Run(model=...) needs a torch.nn.Module, got {type(model).__qualname__}")
    if type(optimizer).__name__ == "ZeroRedundancyOptimizer":  # torch.distributed.optim's, by name: no import
        raise ConfigError(
            "Run(optimizer=ZeroRedundancyOptimizer(...)) is not supported: its state is sharded over the ranks "
            "and its state_dict() needs a collective consolidation that the checkpoint and in-process recovery "
            "do not make. Use the plain optimizer under DDP, or shard the model and its optimizer state with "
            "FSDP2 (fully_shard), which the Run checkpoints and recovers"
        )
    for name, obj in (state or {}).items():
        check_stateful(name, obj)
        _attempt.snapshot_state(f"Run(state={{{name!r}: ...}})", obj)  # a retry puts it back from a copy
    for label, component in (("scheduler", scheduler), ("scaler", scaler)):
        if component is not None:
            check_stateful(label, component)
            _attempt.snapshot_state(f"Run({label}=...)", component)


def _checked_seed(seed: object, reseed: object) -> tuple[int, bool]:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"Run(seed={seed!r}) must be an int")
    if not isinstance(reseed, bool):
        raise ConfigError(f"Run(reseed={reseed!r}) must be True or False")
    return seed, reseed
