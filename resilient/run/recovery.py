"""In-process recovery of a :class:`~resilient.run.Run` under the agent: the worker's side of rung 1.

Wired when the agent gives ``RESILIENT_RECOVERY_STORE`` (the Run state's
``recovery`` is then an :class:`InProcessRecovery`).  Two ways into a re-formed group:

- **a survivor**: a peer failure inside ``with state.attempt():`` reaches
  :meth:`InProcessRecovery.__call__` with the error alive.  It rewinds the
  attempt first (cursor, counters, gradients, ``state=`` objects, scheduler,
  RNG) and notes where it was in the optimizer's update
  (:class:`~resilient.run.records.StepPosition`), then releases every
  reference to the old groups (the DDP wrapper, the finished frames of the
  error's traceback, the checkpoint Coordinator's sub-groups once an
  in-flight save has its outcome) and destroys them at once: that is what
  makes every other survivor's collective fail promptly
  (:func:`resilient.elastic.reform.abandon`).  It waits for its
  assignment, forms the new group, agrees with the others on which rank's
  state wins (:func:`~resilient.elastic.state_sync.agree_step`: a clean
  rank, one that failed before its update; a rank that failed inside or
  after ``optimizer.step()`` holds an update its peers may not have and
  receives everything) and takes it; ``run.step`` becomes the number of
  updates that state has completed.  With no clean rank the sync fails on
  every rank and the run restarts from the newest commit (the agent sees
  the positions in the ``waiting`` reports and decides so itself first);
- **a spare** (``RESILIENT_ROLE=spare``): ``Run.__init__`` builds and
  restores as usual, then blocks in :meth:`InProcessRecovery.wait_as_spare`
  until an assignment makes it a member, joins the same way (without state
  of its own) and returns, so the script's ``for step in run.steps(n)``
  continues at the synced step.

Either way the state comes from the source rank (model, optimizer,
scheduler, scaler, and counters, the loader's cursor and the ``state=``
objects), the loader is bound to the new rank and world size (its global
batch kept: :mod:`resilient.elastic.batch`), DDP is rebuilt on the new
group, the heartbeats switch to the new generation and rank, and the agent
gets ``ready`` / ``rejoined`` / ``gave_up`` reports
(:mod:`resilient.worker.protocol`).

A sharded model (FSDP2, HSDP; ``layout`` from
:func:`resilient.elastic.mesh_rebind.survey`) is moved rather than rebuilt:
its FSDP step state is reset and its groups released before the
destruction, its meshes rebound first in the new group, and each rank takes
its shards from a replica that holds them
(:mod:`resilient.elastic.shard_sync`).  A sharded spare was promoted
already, in ``resilient.device_mesh()`` (:mod:`resilient.run.mesh`), before its
Run existed; :meth:`InProcessRecovery.wait_as_spare` then only takes the
state.  Any failure inside recovery sends
``gave_up`` and re-raises the original error (chained to the failure), so
the process exits non-zero and the agent falls back to a restart.
"""

from __future__ import annotations

import gc
import json
import sys
import time
import traceback
import weakref
from typing import TYPE_CHECKING, Any

from torch.distributed.constants import default_pg_timeout

from ..checkpoint.coordinator import Coordinator
from ..core.events import EventKind
from ..core.state import unwrap
from ..elastic import groups, mesh_rebind
from ..elastic.observe import ranks_text
from ..elastic.reform import (
    Assignment,
    AssignmentError,
    ReformError,
    abandon,
    abort_key,
    connect_store,
    grow_key,
    is_peer_failure,
    reach_store,
    reform,
    wait_for_assignment,
    wait_until_assigned,
)
from ..elastic.shard_sync import sync_sharded
from ..elastic.state_sync import StateSyncError, agree_step, sync_from
from . import nonfinite, resume
from .attempt import rewind_current
from .ddp import ddp_layout, regroup, wrap_ddp
from .integration import decline
from .records import StepPosition
from .sections import Section
from .state import InProcessStanding

if TYPE_CHECKING:
    from torch.distributed import Store

    from ..elastic.mesh_rebind import ShardLayout
    from ..worker.env import WorkerEnv
    from ..worker.hooks import WorkerHooks
    from .mesh import Joined
    from .state import RunState


MAX_REFORMATIONS = 3
"""Generations a survivor tries to join after one failure: each further one follows a failure during the
re-formation before it (a member, a spare or the deciding agent lost while the group formed)."""


class InProcessRecovery:
    """The Run's ``recovery`` under an agent that offers in-process recovery; True from a call: retry the step."""

    def __init__(self, state: RunState, env: WorkerEnv, hooks: WorkerHooks | None, *, layout: ShardLayout | None = None,
                 joined: Joined | None = None) -> None:
        assert env.recovery_store is not None and env.worker_id is not None
        self.state = state
        self.env = env
        self.hooks = hooks
        self.layout = layout
        """A sharded model's meshes and replica groups (None: unsharded state, DDP or one process)."""
        self._joined = joined
        """A spare's promotion that ``resilient.device_mesh()`` waited for before the Run existed."""
        self.worker_id: str = env.worker_id
        self.standing = state.inproc = InProcessStanding(env.worker_id, env.role, env.generation)
        """What the rest of the Run sees of it: the generation this worker is a member of, whether the run
        declined it (:func:`~resilient.run.integration.decline`)."""
        self.timeout_s = env.recovery_timeout_s
        self._store: Store | None = joined.store if joined is not None else None
        self._group_stores: dict[int, Store] = {}
        """A client of the store another machine's agent formed the newest group on (only across machines)."""
        self._ready_sent = False
        self._warned_streams = False
        self.collective_timeout = groups.collective_timeout() or default_pg_timeout
        """The script's collective timeout (a spare, with no group yet: torch's default), kept by re-formed groups."""
        self.user_groups: list[Any] = []
        """The process groups ``Run(groups=fn)`` made in the current generation."""
        self._received = False
        """This rank began taking its state from a peer in the generation it joins (its own is no longer whole)."""

    # ------------------------------------------------------------------ members
    def attempt_entered(self) -> None:
        """At each ``run.attempt()`` entry: the first one tells the agent this rank opted in, or why it cannot."""
        if self._ready_sent:
            return
        self._ready_sent = True
        foreign = groups.foreign_groups(self.owned_groups()) if self.standing.declined is None else []
        if foreign:
            decline(self.state, f"the script made process groups of its own ({'; '.join(foreign)}), which a "
                    "re-formed world cannot make again; create them in Run(groups=fn), which calls fn again after "
                    "every re-formation (state.groups holds what it returned)")
        if self.standing.declined is None:
            self._report(self._ready("worker"))

    def owned_groups(self) -> list[Any]:
        """The groups a re-formation makes again: the default group, the checkpoint coordinator's, the sharded
        model's mesh groups and those ``Run(groups=fn)`` made."""
        import torch.distributed as dist

        owned: list[Any] = [dist.group.WORLD]
        if self.state.checkpoints is not None:
            owned += self.state.checkpoints.coord.groups
        if self.layout is not None:
            root = self.layout.root
            owned += [root.get_group(d) for d in range(root.ndim)]
        return owned + self.user_groups

    def __call__(self, exc: BaseException) -> bool:
        """Survive ``exc`` (a peer failure inside the attempt) in a re-formed group; raise it if that fails."""
        failed_at = time.monotonic()
        state = self.state
        step, position = state.step, state.attempt.position
        if nonfinite.settle(state, wait=True) is not None:
            # The update before this step was skipped as non-finite (read late): this rank's state is not the
            # step's start, so it is never a source; it takes a peer's (with none, the newest commit).
            position = StepPosition.AFTER
            nonfinite.drop_pending(state)
        clean = position is StepPosition.BEFORE
        try:
            layout = ddp_layout(state.model)
            # Back to the step's start: cursor, counters, state= objects, scheduler, RNG.  A clean rank's
            # parameters and optimizer state are the step's start too; a dirty rank's are partly updated, and
            # the whole state will come from a clean peer (or, with none, from the newest commit).
            rewind_current(state)
            mine = self._extra(step, layout)
            # Before the release: the agent decides once every live member said this (or a short settle time
            # passed), so ranks lost together are decided together, and it decides while this rank releases.
            # ``failed_at`` (this host's monotonic clock, the agent's too) orders the ranks' errors: the first is
            # the cause, the others fail when it releases its connections.
            self._report({"event": "waiting", "worker": self.worker_id, "generation": self.standing.generation,
                          "step": step, "position": position.value, "failed_at": failed_at,
                          "error": f"{type(exc).__qualname__}: {exc}"[:500]})
            self._release(exc)
            abandon_s = time.monotonic() - failed_at
            store = self._connect()
            for attempt in range(MAX_REFORMATIONS):
                waited = time.monotonic()
                assignment = wait_for_assignment(store, self.worker_id, self.standing.generation, self.timeout_s)
                self._received = False
                try:
                    with Section(state, "restore"):  # the agent times the re-formation; a drill can strike in it
                        self._join(assignment, step, clean, mine, failed_at=failed_at, abandon_s=abandon_s,
                                   wait_s=time.monotonic() - waited)
                    return True
                except Exception as again:
                    if attempt + 1 == MAX_REFORMATIONS or not self._may_form_again(again):
                        raise
                    # The new generation failed before it formed or while it took its state (a second failure
                    # during the re-formation): leave it as a survivor of it and wait for the one after.
                    clean = clean and not self._received
                    failed_at = time.monotonic()
                    self.standing.generation = assignment.generation
                    self._report({"event": "waiting", "worker": self.worker_id, "generation": assignment.generation,
                                  "step": step, "position": position.value if clean else "receiving",
                                  "failed_at": failed_at, "error": f"{type(again).__qualname__}: {again}"[:500]})
                    self._release(again)  # its traceback holds the failed generation's groups: cleared first
                    abandon_s = time.monotonic() - failed_at
            raise AssertionError("unreachable: the last attempt's failure is raised")
        except Exception as err:  # whatever failed, the agent must hear of it and restart
            self._give_up(err)
            raise exc from err

    def _may_form_again(self, err: BaseException) -> bool:
        """Whether a failure while joining a generation is one its next generation can recover from: the
        generation was abandoned, a member never arrived, the store it formed on went away, or a peer failed
        while the state was taken.  Not a malformed assignment or inconsistent state; not a sharded model
        (its meshes were rebound: a restart is the way back)."""
        if self.layout is not None or isinstance(err, (AssignmentError, StateSyncError)):
            return False
        return isinstance(err, ReformError) or is_peer_failure(err)

    # ------------------------------------------------------------------- growing
    def may_grow(self) -> bool:
        """Whether this world is below its full size, so that a boundary may grow it (and send the state)."""
        data = self.state.data
        return self.standing.declined is None and data is not None and bool(data.global_batch) and \
            self.state.world_size * data.batch_size < data.global_batch

    def at_boundary(self) -> None:
        """Before each step: join the larger generation the agent scheduled at this boundary, if any.

        Only a world below its full size (the global batch's first world size) can grow, so only then is
        the agent's store asked (one small request per step).  Every member polls at every boundary and the
        agent schedules the boundary a few steps ahead of the furthest rank, so all of them leave together.
        """
        state = self.state
        if not self.may_grow():
            return
        store = self._connect()
        key = grow_key(self.standing.generation)
        if not store.check([key]):
            return
        plan = json.loads(store.get(key))
        if state.step < int(plan["at_step"]):
            return
        started = time.monotonic()
        try:
            with Section(state, "restore"):  # the agent books the re-formation as recovery, and times it
                mine = self._extra(state.step, ddp_layout(state.model))
                self._release(None)
                assignment = wait_for_assignment(store, self.worker_id, self.standing.generation, self.timeout_s)
                self._join(assignment, state.step, True, mine, failed_at=None, abandon_s=time.monotonic() - started,
                           wait_s=0.0)
        except Exception as err:
            self._give_up(err)
            raise

    def _release(self, exc: BaseException | None) -> None:
        """Drop every reference to the old groups, then destroy them (see ``abandon()``)."""
        state = self.state
        if self.layout is not None:  # FSDP's in-flight collectives and unsharded parameters, then its groups
            mesh_rebind.reset_iteration(self.layout)
            mesh_rebind.release(self.layout)
        wrapper = state.model
        state.model = unwrap(wrapper)  # DDP first: its reducer destroying the group can deadlock (see
        # docs/design/in-process-worker.md)
        held = weakref.ref(wrapper) if wrapper is not state.model else None
        del wrapper
        seen: set[int] = set()
        current = exc
        while current is not None and id(current) not in seen:  # the error's finished frames hold tensors, DDP
            seen.add(id(current))
            traceback.clear_frames(current.__traceback__)
            current = current.__cause__ or current.__context__
        if state.checkpoints is not None:
            state.checkpoints.wait()  # a save in flight fails on the broken group; the manager records it
            state.checkpoints.coord = Coordinator()  # its sub-groups go with the old group
        if state.make_groups is not None:  # the script's groups of this generation (Run(groups=fn)) go with it
            state.groups, self.user_groups = None, []
        if held is not None and held() is not None:
            # Something still holds the wrapper (a reference cycle): only a collection frees it, and with it the
            # group and its connections.  Not unconditional: a collection costs ~90 ms with torch loaded.
            gc.collect()
        abandon()

    # ------------------------------------------------------------------- spares
    def wait_as_spare(self) -> None:
        """Block until an assignment makes this spare a member; join it.  Raises when the agent's store is gone."""
        joined, self._joined = self._joined, None
        if joined is not None:  # promoted and in the group already: take the state
            try:
                self._join(joined.assignment, None, True, self._extra(None, None), failed_at=None, abandon_s=0.0,
                           wait_s=0.0, form_s=joined.form_s)
            except Exception as err:
                self._give_up(err)
                raise
            return
        if self.env.promoted is None:  # a spare promoted before its script started said ready then
            self._report(self._ready("spare"))
        try:
            store = self._connect()
            assignment = wait_until_assigned(store, self.worker_id, self.standing.generation, self.timeout_s)
            for attempt in range(MAX_REFORMATIONS):
                try:
                    self._join(assignment, None, True, self._extra(None, None), failed_at=None, abandon_s=0.0,
                               wait_s=0.0)
                    return
                except Exception as again:
                    if attempt + 1 == MAX_REFORMATIONS or not self._may_form_again(again):
                        raise
                    # Promoted, then the generation failed while it formed: a member of it without state, which
                    # waits for the next generation like its survivors (the agent need not replace it).
                    self.standing.generation = assignment.generation
                    self._report({"event": "waiting", "worker": self.worker_id, "generation": assignment.generation,
                                  "step": None, "position": "stateless", "stateless": True,
                                  "failed_at": time.monotonic(), "error": f"{type(again).__qualname__}: {again}"[:500]})
                    self._release(again)
                    assignment = wait_for_assignment(store, self.worker_id, self.standing.generation, self.timeout_s)
        except Exception as err:
            self._give_up(err)
            raise

    # ------------------------------------------------------------------- shared
    def _join(self, assignment: Assignment, completed: int | None, clean: bool, mine: dict[str, Any], *,
              failed_at: float | None, abandon_s: float, wait_s: float, form_s: float | None = None) -> None:
        """Form ``assignment``'s group (unless ``form_s`` says it was formed already), take the state of a
        clean rank that completed the most (``completed``: this rank's updates, None without state;
        ``clean``: False when it failed inside or after its update), rebuild DDP; report ``rejoined``."""
        state = self.state
        started = time.monotonic()
        ckpt, layout = state.checkpoints, self.layout
        if form_s is None:
            # A sharded model's mesh groups first: a spare creates them (resilient.device_mesh) before its Run.
            # Then the checkpoint coordinator's, then the script's own (Run(groups=fn)): the order of the start.
            makers: list[Any] = [lambda: mesh_rebind.rebind(layout)] if layout is not None else []
            if ckpt is not None:
                makers.append(lambda: Coordinator.from_environment(ckpt.config.timeout_s))
            if state.make_groups is not None:
                makers.append(self.make_user_groups)
            reformed = reform(assignment, timeout_s=self.timeout_s, store=self._group_store(assignment),
                              subgroups=makers, collective_timeout=self.collective_timeout,
                              aborted=lambda: self._connect().check([abort_key(assignment.generation)]))
            if ckpt is not None:
                ckpt.regroup(reformed.subgroups[1 if layout is not None else 0])
        else:  # a spare promoted in resilient.device_mesh(): its Run made the checkpoint sub-groups since
            started -= form_s
            if ckpt is not None:
                ckpt.regroup(ckpt.coord)
        self.standing.generation = assignment.generation
        formed = time.monotonic()
        agreement = agree_step(completed, clean, preferred_source=assignment.source_rank)
        module = unwrap(state.model)
        self._received = agreement.source_rank != assignment.rank
        if layout is not None:  # each shard from a replica that holds it, the rest from the source
            extra = sync_sharded(agreement, layout, module, state.optimizer, state.scheduler, state.scaler, mine)
        else:
            extra = sync_from(agreement.source_rank, module, state.optimizer, state.scheduler, state.scaler, mine)
        if extra["step"] != agreement.completed:
            raise StateSyncError(f"the source (rank {agreement.source_rank}) sent counters of step {extra['step']} "
                                 f"with the state of step {agreement.completed}")
        source = agreement.source_rank == assignment.rank
        state.step, state.samples, state.tokens = agreement.completed, int(extra["samples"]), int(extra["tokens"])
        if state.data is not None:
            state.data.load_state_dict(extra["data"])
        if not source:
            for name, obj in state.user_state.items():
                obj.load_state_dict(extra["user"][name])
        state.last_saved_step = state.step  # nothing to save at once: the state came from a peer, not a new update
        resume.replaced(state)  # nor a restore to check: a spare's warm-up restore was replaced by the peer's state
        if ckpt is not None and ckpt.cadence is not None and extra.get("checkpoint_every"):
            ckpt.cadence.every = int(extra["checkpoint_every"])  # a newcomer schedules its saves as its peers do
        regroup(state)  # rank, world size, and the loader's share of the kept global batch
        if state.ddp_options is not None:
            # The ranks hold the same state: DDP's own broadcast of it would only send the model again.  The
            # source's bucket layout keeps the retried step's sums in the uninterrupted run's order.
            state.model = wrap_ddp(module, {**state.ddp_options, "init_sync": False}, extra["ddp_layout"])
        synced = time.monotonic()
        self._warn_streams(assignment)
        if self.hooks is not None:
            self.hooks.rejoin(assignment.generation, state.rank, resume_step=state.step)
        seconds = {"abandon": abandon_s, "wait": wait_s, "form": formed - started, "sync": synced - formed,
                   "total": synced - (failed_at if failed_at is not None else started)}
        seconds = {k: round(v, 6) for k, v in seconds.items()}
        report = {"event": "rejoined", "worker": self.worker_id, "generation": assignment.generation,
                  "rank": state.rank, "world_size": state.world_size, "completed": agreement.completed,
                  "source": agreement.source_rank, "replacement": assignment.is_replacement,
                  "reason": agreement.reason, "seconds": seconds, "failed_at": failed_at}
        self._report(report)
        state.events.emit(EventKind.GROUP_REJOINED, worker=self.worker_id, generation=assignment.generation,
                        rank=state.rank, world_size=state.world_size, step=state.step, source=agreement.source_rank,
                        replacement=assignment.is_replacement, reason=agreement.reason, seconds=seconds)

    def make_user_groups(self) -> None:
        """Call ``Run(groups=fn)``'s ``fn`` in the current generation; ``run.groups`` is what it returned."""
        state = self.state
        assert state.make_groups is not None
        state.groups = None  # the old generation's groups go: a reference kept would keep their connections open
        self.user_groups = []
        state.groups, self.user_groups = groups.made_by(state.make_groups)

    def _warn_streams(self, assignment: Assignment) -> None:
        """Once, at the first recovery with a replacement: the global generators it cannot reproduce."""
        if self._warned_streams or not assignment.replacements or self.state.reseed:
            return
        self._warned_streams = True
        streams = ["random"] + (["numpy.random"] if "numpy" in sys.modules else [])
        self.state.events.emit(
            EventKind.UNREPRODUCIBLE_RANDOM_STREAMS, rank=self.state.rank, step=self.state.step, streams=streams,
            replacements=list(assignment.replacements),
            note=(f"{' and '.join(streams)} on {ranks_text(assignment.replacements, verb=False)} continue from the "
                  "replacement's own history, not the lost rank's (torch's generator is seeded per step under "
                  "run.attempt()); pass Run(reseed=True) to seed them per (seed, step, rank) too"))

    def _extra(self, step: int | None, layout: list[list[int]] | None) -> dict[str, Any]:
        """What travels with the state besides model and optimizer: counters, the loader's cursor, ``state=``,
        and the DDP bucket layout."""
        state = self.state
        ckpt = state.checkpoints
        return {"step": step if step is not None else state.step, "samples": state.samples, "tokens": state.tokens,
                "ddp_layout": layout, "checkpoint_every": ckpt.every if ckpt is not None else None,
                "data": state.data.state_dict() if state.data is not None else None,
                "user": {name: obj.state_dict() for name, obj in state.user_state.items()}}

    def _connect(self) -> Store:
        if self._store is None:
            assert self.env.recovery_store is not None
            host, port = self.env.recovery_store
            self._store = connect_store(host, port, self.timeout_s)
        return self._store

    def _group_store(self, assignment: Assignment) -> Store:
        """The store the new group forms on: this agent's, or (across machines) the deciding agent's."""
        if (assignment.store_host, assignment.store_port) == self.env.recovery_store:
            return self._connect()
        if self._group_stores.get(assignment.generation) is None:
            self._group_stores = {assignment.generation: reach_store(
                assignment.store_host, assignment.store_port, self.timeout_s, assignment.generation,
                lambda: self._connect().check([abort_key(assignment.generation)]))}
        return self._group_stores[assignment.generation]

    def _ready(self, role: str) -> dict[str, Any]:
        data = self.state.data
        report = {"event": "ready", "worker": self.worker_id, "role": role, "step": self.state.step,
                  "world_size": self.state.world_size, "global_batch": data.global_batch if data is not None else None,
                  "micro_batch": data.batch_size if data is not None else None,
                  "batch_rule": data.batch_rule if data is not None else None}
        if self.layout is not None:  # which ranks hold copies of which shards: the agent's ladder needs it
            report["replicas"] = [list(group) for group in self.layout.replicas]
        return report

    def _give_up(self, err: BaseException) -> None:
        error = f"{type(err).__qualname__}: {err}"[:1000]
        generation = self.standing.generation
        self._report({"event": "gave_up", "worker": self.worker_id, "generation": generation, "error": error})
        self.state.events.emit(EventKind.RECOVERY_GAVE_UP, worker=self.worker_id, generation=generation,
                               step=self.state.step, error=error)
        self.state.model = unwrap(self.state.model)
        if self.state.checkpoints is not None:
            self.state.checkpoints.coord = Coordinator()
        abandon()  # groups left alive at interpreter exit can abort the process instead of a clean exit code

    def _report(self, report: dict[str, Any]) -> None:
        if self.hooks is not None:
            self.hooks.recovery(report)
