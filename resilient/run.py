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
(:mod:`resilient.run_attempt`, :mod:`resilient.run_recovery`).
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable, Generator, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Self

import torch

from . import __version__, compat
from . import run_attempt as _attempt
from . import run_audit as _audit
from . import run_nonfinite as _nonfinite
from .checkpoint import sharded
from .checkpoint.config import CheckpointConfig
from .checkpoint.manager import CheckpointManager, SaveResult
from .checkpoint.restore import Restored
from .data.loader import ElasticLoader
from .elastic import groups as _groups
from .elastic.batch import BatchPlan
from .errors import ConfigError
from .events import EventKind, EventLog, ForwardingLog
from .mesh import take_joined, worker_hooks
from .run_memory import open_memory
from .run_payloads import (
    apply_restored,
    capture_payloads,
    check_sharding,
    digest_config,
    new_save_report,
    open_checkpoints,
    shard_layout,
    stop_at_boundary,
)
from .run_recovery import InProcessRecovery
from .run_sections import AFTER_STEPS, BETWEEN, Section
from .run_timing import step_timer, time_fsdp, time_script_ddp
from .state import Stateful, check_stateful, model_fingerprint
from .worker.env import WorkerEnv
from .worker.heartbeat import HeartbeatCounts

if TYPE_CHECKING:
    from .worker.hooks import WorkerHooks

_FROM_ENVIRONMENT: Any = object()


class Run:
    """One rank's view of a resumable training run.

    ``step`` is the number of completed optimizer updates; inside the loop
    body it is the index of the update being computed.
    """

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
        reseed: bool = False,
        groups: Callable[[], Any] | None = None,
    ) -> None:
        """``agent``: the agent contract; read from the environment unless given (None: no agent).

        ``ddp``: wrap ``model`` in ``DistributedDataParallel`` here (True, or a
        dict of its keyword arguments) once a process group exists, so that the
        wrapper can be rebuilt on a re-formed group; ``run.model`` is then the
        wrapped module.  ``seed``: the run's seed for the random streams of
        :meth:`attempt` and :meth:`micro_batches` (:mod:`resilient.run_attempt`).  ``audit_every``: compare
        replicated parameters across ranks every this many steps, 0 never (:mod:`resilient.run_audit`).
        ``nonfinite``: a gradient with NaN or Inf is never applied; "retry" (the default) retries the step on
        the same batch inside :meth:`attempt`, "raise" only raises, "off" does not check
        (:mod:`resilient.run_nonfinite`).  ``reseed``: also seed Python's ``random`` and numpy's global
        generator from ``(seed, step, rank)`` at each attempt's entry, so a replacement rank draws what the rank
        it replaces would have (otherwise they continue from the process's own history).  ``groups``: a
        function that makes the script's own process groups (``dist.new_group`` calls) and returns them; the Run
        calls it once its own groups exist and again after every in-process re-formation, and ``run.groups``
        holds what it returned (use it each time: the groups of an earlier generation are destroyed).  A
        script that makes groups elsewhere recovers by restart only.
        """
        self.events = events if events is not None else EventLog()
        self._section = "init"
        self._reported_save: SaveResult | None = None
        env = WorkerEnv.from_environ(os.environ) if agent is _FROM_ENVIRONMENT else agent
        spare = env is not None and env.role == "spare"
        joined = take_joined() if spare else None  # a sharded spare promoted in resilient.device_mesh()
        self._hooks: WorkerHooks | None = worker_hooks(env, self.events, joined)  # first: errors below get a file
        if self._hooks is not None and (agent_log := self._hooks.agent_log()) is not None:
            node = env.node_id if env is not None else None
            self.events = ForwardingLog(self.events, agent_log, lambda: {"rank": self._hooks.rank if self._hooks
                                                                         else None, "node": node, "source": "worker"})
        if self._hooks is not None:
            self._hooks.hello(os.fspath(checkpoint.dir) if checkpoint is not None else None)
            for note in self._hooks.notes:
                self.events.emit(EventKind.AGENT_HOOK_MISSING, note=note)
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(f"Run(model=...) needs a torch.nn.Module, got {type(model).__qualname__}")
        off = compat.off(sharded=sharded.is_sharded(model))  # those this run can use
        if off:  # fail closed: each feature that needs a missing private API is off, and this says which
            self.events.emit(EventKind.TORCH_FEATURES_OFF, torch=torch.__version__, features=off)
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
        for name, obj in (("scheduler", scheduler), ("scaler", scaler)):
            if obj is not None:
                check_stateful(name, obj)
                _attempt.snapshot_state(f"Run({name}=...)", obj)
        self._sharded = check_sharding(model, ddp, spare=spare and joined is None)
        """FSDP2/DTensor parameters: saved as chunks per rank, resharded on restore."""
        layout = shard_layout(self, model, optimizer, env, spare=spare)
        _attempt.take_over(optimizer)  # an earlier Run over this optimizer lets go of it
        optimizer_hooks: list[Any] = []
        self._timer = step_timer(self._hooks, optimizer, optimizer_hooks)
        """Step time by section, sent to the agent every few steps for its straggler and slowdown detectors."""
        self._ddp = _attempt.ddp_options(ddp, model, self._timer)
        untimed = time_script_ddp(model, self._timer) if self._ddp is None else None
        untimed = untimed or (time_fsdp(model, self._timer) if self._sharded else None)
        if untimed is not None:
            self.events.emit(EventKind.COMM_NOT_TIMED, reason=untimed)
        _attempt.init_default_group(self._ddp is not None)  # torchrun or the agent, and the script made no group
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ConfigError(f"Run(seed={seed!r}) must be an int")
        self.seed = seed
        if not isinstance(reseed, bool):
            raise ConfigError(f"Run(reseed={reseed!r}) must be True or False")
        self.reseed = reseed
        self._audit_every = _audit.checked_every(audit_every)
        self.model = model
        """The model to call: the DDP wrapper with ``ddp=True`` under a process group, else the module given."""
        self.optimizer = optimizer
        self._nonfinite = _nonfinite.checked_mode(nonfinite)
        self._nonfinite_tries: dict[int, int] = {}
        self._nonfinite_hook = _nonfinite.install(self, optimizer, self._nonfinite)
        self._position = _attempt.StepPosition.BEFORE
        """Where this rank is in the current step's optimizer update (set by hooks; BEFORE at attempt entry)."""
        optimizer_hooks += [self._nonfinite_hook, *_attempt.track_position(self, optimizer)]  # the latter last
        _attempt.hooked(optimizer, optimizer_hooks)
        self.scheduler = scheduler
        self.scaler = scaler
        self.data = data
        self.user_state = dict(state or {})
        self.config = dict(config) if config is not None else None
        self.step = 0
        self.samples = 0
        """Samples this rank trained on (reported through :meth:`report`)."""
        self.tokens = 0
        """Tokens this rank trained on (reported through :meth:`report`)."""
        self.last_loss: float | None = None
        self.restored_from: str | None = None
        self._last_saved_step: int | None = None
        self._prepared = False
        self._step_started: float | None = None
        self.last_step_s: float | None = None
        self._attempt_start: _attempt.AttemptStart | None = None
        self._recovery: Callable[[BaseException], bool] | None = None
        """In-process recovery (re-form the group, sync state) for a failed attempt; True: retry the step."""
        # A sharded model whose layout cannot be moved to a new group recovers by restart only.
        self._inproc = InProcessRecovery(self, env, self._hooks, layout=layout, joined=joined) \
            if env and env.recovery_store and (layout is not None or not self._sharded) else None
        """The agent's in-process recovery: the survivor's side (``_recovery``), the spare's, growing back."""
        if self._inproc is not None:
            self._recovery = self._inproc
        if groups is not None and not callable(groups):
            raise ConfigError(f"Run(groups={groups!r}) must be a function that makes the script's process groups")
        self._make_groups = groups
        self.groups: Any = None
        """What ``Run(groups=fn)``'s ``fn`` returned in the current generation (None before it ran)."""
        self._retry = False
        self._micro: Generator[Any, None, None] | None = None
        self._micro_samples: int | None = None
        self._announced_plan: BatchPlan | None = None
        """The batch plan last announced in a ``batch_planned`` event."""
        self.rank, self.world_size = 0, 1
        _attempt.regroup(self)  # rank and world size of the process group (if any), the loader's share of it
        if self._inproc is not None and (restart_only := _groups.restart_only(model)) is not None:
            self._inproc.decline(restart_only)  # said at the start, so the agent starts no spare for nothing
        if data is not None and self._hooks is not None:
            self._hooks.attach_loader(data, self.section)
        self._fingerprint = {
            "model": model_fingerprint(model),
            "config": digest_config(self.config),
            "code": {"resilient": __version__, "torch": torch.__version__},
        }
        self.checkpoints: CheckpointManager | None = None
        restore_started, diagnosing = time.perf_counter(), env is not None and env.diagnose is not None
        self._memory = open_memory(self, env) if checkpoint is not None and not diagnosing else None
        """The node's memory tier (:mod:`resilient.run_memory`): restored from first, saved at boundaries."""
        if checkpoint is not None and not diagnosing:  # a diagnosis job measures: it keeps nothing
            with self.section("restore"):
                # A spare already in the group takes its state from the members, not from a checkpoint.
                self.checkpoints = open_checkpoints(self, checkpoint, env, spare=spare, restore=joined is None)
        if self._hooks is not None:  # the agent reports which checkpoint every rank restored (None: fresh start)
            self._hooks.restored(self.restored_from, self.step if self.restored_from else None,
                                 time.perf_counter() - restore_started)
        if self._make_groups is not None and not (spare and joined is None):  # a spare makes them once promoted
            if self._inproc is not None:
                self._inproc.make_user_groups()
            else:
                self.groups = self._make_groups()
        if spare and self._inproc is not None and self._inproc.declined is not None:
            # This run recovers by restart only: a spare would hold its memory (a GPU's) for nothing.
            raise SystemExit(0)
        if spare and self._inproc is not None:  # blocks until promoted, then a member with its state
            self._inproc.wait_as_spare()
        elif self._ddp is not None:  # after the restore: DDP's first broadcast then carries the restored state
            self.model = _attempt.wrap_ddp(self.model, self._ddp)
        self.events.emit(EventKind.RUN_STARTED, rank=self.rank, world_size=self.world_size, step=self.step,
                         restored_from=self.restored_from)

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
        hooks, timer = self._hooks, self._timer
        if timer is not None:
            timer.total = total
            timer.begin()
        while self.step < total:
            if hooks is not None and (hooks.stop_signalled or hooks.stop_request is not None):
                stop_at_boundary(self, hooks)
            if self._inproc is not None:
                self._inproc.at_boundary()  # a shrunk world grows back here when the agent says so
            if _audit.due(self, self._audit_every):
                self._audit_boundary()
            self._maybe_checkpoint()
            if self._memory is not None:
                self._memory.at_boundary()
            self._step_started = time.perf_counter()
            if hooks is not None:
                self._enter("step")
            yield self.step
            if self._retry:  # the attempt failed and was recovered in-process: the same step again
                self._retry = False
                if timer is not None:
                    timer.begin()  # the failed attempt and the recovery are not the step's time
                continue
            self.last_step_s = time.perf_counter() - self._step_started
            if timer is not None:
                timer.end_step(self.step)
            self.step += 1
            # Between updates: no section.  A checkpoint taken at this boundary must not re-enter "step" on
            # its way out, or the agent would see the next step start before it does.
            self._section = BETWEEN
        ckpt = self.checkpoints
        if ckpt is not None and ckpt.config.save_on_finish and self._last_saved_step != self.step:
            self._save(wait=False)
        if hooks is not None:
            self._enter(AFTER_STEPS)

    def report(self, *, loss: Any = None, tokens: int = 0, samples: int | None = None) -> None:
        """Count this rank's progress for the current update."""
        if loss is not None:
            self.last_loss = float(loss.detach().item() if isinstance(loss, torch.Tensor) else loss)
        if samples is None:
            samples = self._micro_samples if self._micro_samples is not None else \
                self.data.batch_size if self.data is not None else 0
            self._micro_samples = None
        self.samples += int(samples)
        self.tokens += int(tokens)

    def attempt(self) -> _attempt.Attempt:
        """``with run.attempt():`` around the step body: a peer failure inside is survived and the step retried.

        Only where in-process recovery is available; under plain python or
        torchrun every error passes through (recovery is by restart).  Entry
        seeds the torch RNG from ``(seed, step, rank)`` and records the cursor,
        so a retry reads the same batches and draws the same numbers.  Keep
        the whole step body inside: code after the block runs once per attempt.
        """
        return _attempt.Attempt(self)

    def micro_batches(self, *, weighted: bool = False) -> Generator[Any, None, None]:
        """This rank's share of the step's global batch: :attr:`accumulation` micro-batches, at any world size.

        The global batch is the loader's ``batch_size`` times the world size at
        the run's first start; with DDP only the last micro-batch's backward
        all-reduces (``no_sync()`` on the others).  Divide each micro-batch's
        mean loss by :attr:`accumulation`; where the plan is uneven (the
        loader's ``batch_rule="uneven"``) iterate ``weighted=True`` pairs
        ``(batch, weight)`` and multiply by ``weight`` instead.
        """
        self._micro = _attempt.micro_batches(self, weighted)
        return self._micro

    @property
    def accumulation(self) -> int:
        """Micro-batches this rank runs per step under :meth:`micro_batches` (1 at the run's first world size)."""
        return self.data.plan.require().accumulation if self.data is not None else 1

    def save(self) -> SaveResult:
        """Commit a checkpoint of the state after ``step`` updates; return once committed.

        Call it at the top of an iteration (before any work of that step) or
        outside the loop.
        """
        if self.checkpoints is None:
            raise ConfigError("Run.save() needs checkpoint=CheckpointConfig(...) when the Run is created")
        with self.section("checkpoint"):
            self.checkpoints.wait()
            results = self.checkpoints.results
            if results and results[-1].step == self.step and results[-1].ok:
                return results[-1]  # this state is already committed
            result = self._save(wait=True)
        assert result is not None
        return result

    def close(self) -> SaveResult | None:
        """Wait for the in-flight checkpoint (if any) to commit, stop the loader's workers; return the save's outcome."""
        result = None
        if self.checkpoints is not None:
            with self.section("checkpoint"):
                result = self.checkpoints.wait()
        if self._memory is not None:
            self._memory.close()
        if self.data is not None:
            self.data.close()  # stop its worker processes now, not whenever the loader is collected
        if self._ddp is not None:  # the wrapper Run made must not outlive the group (docs/architecture.md)
            self.model = _attempt.unwrap(self.model)
            gc.collect()  # it sits in reference cycles: freed now, not while Python exits (an abort there)
        self.events.emit(EventKind.RUN_CLOSED, step=self.step)
        if self._hooks is not None:
            self._hooks.bye(self.step, self._committed_step())
        return result

    @property
    def heartbeats(self) -> HeartbeatCounts | None:
        """Heartbeats sent to the agent and dropped on the way (full queue, no agent); None without an agent."""
        if self._hooks is None:
            return None
        return HeartbeatCounts(sent=self._hooks.sender.sent, dropped=self._hooks.sender.dropped)

    def section(self, name: str) -> Section:
        """Context manager marking a part of the loop, e.g. ``with run.section("eval"): ...``.

        Under the agent, entering it sends a heartbeat naming ``name`` (a hang there is attributed to it and
        timed with its timeout); leaving it re-enters the enclosing section.
        """
        return Section(self, name)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------- in-process recovery (internal)
    def _attempt_failed(self, exc: BaseException) -> bool:
        """Whether ``exc`` (raised inside :meth:`attempt`) is a peer failure the group can be re-formed after."""
        return _attempt.is_recoverable(exc)

    def _rewind_attempt(self) -> None:
        """Back to the current attempt's start: cursor, counters, gradients (none) and RNG, for a retry."""
        if self._attempt_start is None:
            raise ConfigError("Run._rewind_attempt() outside run.attempt(): there is no attempt to rewind")
        _attempt.rewind(self, self._attempt_start)

    def _rebuild_ddp(self) -> None:
        """Follow a re-formed default process group: rank, world size, the loader's share, the DDP wrapper.

        Call it once every member's state is the same (DDP's construction
        broadcasts rank 0's parameters and buffers).
        """
        _attempt.regroup(self)
        if self._ddp is not None:
            self.model = _attempt.wrap_ddp(self.model, self._ddp)

    def _close_micro_batches(self) -> None:
        micro, self._micro = self._micro, None
        if micro is not None:
            micro.close()  # a generator left inside DDP's no_sync() leaves it

    # -------------------------------------------------------------- helpers
    def _audit_boundary(self) -> None:
        """The replica audit at this boundary.  A peer lost during its collective, with in-process recovery on, is
        left to this step's attempt: its first collective meets the same broken group and the attempt recovers it
        (this rank is clean, no update begun).  Anything else propagates."""
        try:
            _audit.audit(self, self.step)
        except Exception as exc:
            if self._inproc is None or not _attempt.is_recoverable(exc):
                raise
            self.events.emit(EventKind.REPLICA_AUDIT_INTERRUPTED, step=self.step, error=str(exc)[:500])

    def _enter(self, section: str) -> None:
        self._section = section
        if self._timer is not None:
            self._timer.switch(section)
        if self._hooks is not None:
            self._hooks.enter(section, self.step, self._committed_step(), tokens=self.tokens, samples=self.samples,
                              save=self._new_save_report())

    def _new_save_report(self) -> dict[str, Any] | None:
        """The newest finished save, once: what the agent exports as checkpoint duration and bytes."""
        report, self._reported_save = new_save_report(self.checkpoints, self._reported_save)
        return report

    def _committed_step(self) -> int | None:
        manifest = self.checkpoints.last_committed if self.checkpoints is not None else None
        return manifest.step if manifest is not None else None

    def _maybe_checkpoint(self) -> None:
        ckpt = self.checkpoints
        if ckpt is None or self.step == 0:
            return
        if not self._prepared:
            # After the first update the optimizer state exists, so the size is known.
            self._prepared = True
            ckpt.prepare(self._payloads())
        ckpt.step_done(self.last_step_s)
        every = ckpt.every  # computed from the save's cost and the failure rate where one is given
        due = every is not None and self.step % every == 0 and self._last_saved_step != self.step
        if due or ckpt.pending is not None:  # paced by config.when_busy: see resilient/checkpoint/pacing.py
            with self.section("checkpoint"):
                decision = ckpt.save_due(self.step, due=due, payloads=self._payloads, fingerprint=self._fingerprint,
                                         counters={"samples": self.samples, "tokens": self.tokens})
            if decision is not None and decision.action != "defer":
                self._last_saved_step = self.step

    def _save(self, *, wait: bool) -> SaveResult | None:
        assert self.checkpoints is not None
        self._last_saved_step = self.step
        with self.section("checkpoint"):
            return self.checkpoints.save(
                self.step,
                self._payloads(),
                counters={"samples": self.samples, "tokens": self.tokens},
                fingerprint=self._fingerprint,
                wait=wait,
            )

    def _payloads(self) -> dict[str, Any]:
        return capture_payloads(self)

    def _apply(self, restored: Restored) -> None:
        apply_restored(self, restored)
        self._last_saved_step = self.step
