"""In-process recovery: the agent's side of the recovery ladder's cheapest rungs.

When a member of the running generation dies (or hangs, and the agent kills
it), the survivors of a script that opted in (``run.attempt()``) keep their
processes and wait on the agent's store for their next generation
(:mod:`resilient.elastic.reform`).  On one machine this module decides what
that generation is (:func:`resilient.elastic.decide.decide_recovery` over the
fault, the membership, the spare pool and the measured costs), publishes one
assignment per live worker, moves the processes in the
:class:`~resilient.agent.launcher.WorkerGroup`, starts a spare to refill the
pool and watches the members report ``rejoined``; across machines the
decision goes through the store (:mod:`resilient.agent.cluster_flow`) and
this module keeps this node's part.  It never stops the survivors itself:
when the ladder says restart (or stop), or a rung does not complete, the
generation ends as a failure and the supervisor's restart path takes over.

Worker messages arrive on the receivers' threads; the watch loop reads them
under :attr:`InProcess._lock`.
"""

from __future__ import annotations

import itertools
import json
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ..core.events import Emit, EventKind
from ..core.supervised import ThreadReports
from ..elastic.batch import feasible_world_sizes
from ..elastic.costs import RecoveryCosts
from ..elastic.decide import Action, LadderConfig, RecoveryDecision
from ..elastic.observe import Fault, FaultKind, Membership, Observation, Spare
from ..elastic.reform import Member, abort_key, plan_assignments, publish_assignments
from .cluster_watch import ClusterState, ClusterWatch
from .decision import LadderCase, Restarts, decide
from .inproc_state import Recovering, Reports, SpareState, clean_position
from .launcher import why_not_renice
from .policy import Failure

if TYPE_CHECKING:
    from ..elastic.reform import Assignment
    from ..worker.protocol import Heartbeat
    from .cluster import ClusterStore
    from .config import AgentConfig
    from .launcher import WorkerGroup

ACTING = (Action.RETRY_IN_PLACE, Action.PROMOTE_SPARE, Action.SHRINK)
"""The rungs this agent carries out in process; the others end the generation (restart or stop)."""
_DEFAULT_SPARE_WARM_S = 10.0
"""Expected seconds from a spare's start to its "ready" before one was measured (imports, model, restore)."""


FOLDED_PER_STEP = 2
"""Failures during the re-formation of one step folded into the next decision; past that, the step's re-formations
count as failing (``max_inproc_retries_per_step``), so a member that fails every re-formation ends in a restart."""


RESTART_COST_EVERY_S = 5.0
"""How often the measured cost of a restart is read again from the node's ledger (a decision reads it)."""


class InProcess:
    """This node's in-process recovery: the store workers re-form on, their reports, and the ladder."""

    def __init__(self, config: AgentConfig, emit: Emit, clock: Callable[[], float]) -> None:
        from torch.distributed import TCPStore

        self.config = config
        self._emit = emit
        self._clock = clock
        self.host = config.local_addr
        self._store = TCPStore(self.host, 0, is_master=True, wait_for_workers=False,
                               timeout=timedelta(seconds=config.recovery_timeout_s))
        self.port = int(self._store.port)
        self._lock = threading.Lock()
        self._reports = Reports()
        self._ids = itertools.count()
        self.spares: dict[str, SpareState] = {}
        self.recovering: Recovering | None = None
        self.changed: threading.Event | None = None
        """Set on every worker report: the watch loop acts on it at once instead of at its next tick."""
        self.ladder = LadderConfig(in_process=config.in_process, grow_settle_s=config.grow_settle_s,
                                   max_wait_s=min(300.0, config.recovery_timeout_s / 2))
        self._measured: dict[str, list[float]] = {"inproc_s": [], "spare_s": [], "shrink_s": [], "grow_s": [],
                                                  "warm_s": []}
        self.spare_failures = 0
        """Spares in a row that exited before they were ready (a script that cannot run as a spare)."""
        self._failed_at_step: Counter[int] = Counter()
        """In-process recoveries per fault step that failed (their deadline passed, or too many were folded)."""
        self._folded_at_step: Counter[int] = Counter()
        """Recoveries of a step abandoned because a member failed while they formed (folded into the next)."""
        self._rate_mark: tuple[int, float, int] | None = None
        """(generation, agent clock, furthest step) at the start of the step-rate measure."""
        self.last_decision: str | None = None
        """The ladder's newest reason, for ``resilient status``."""
        self.last_completed: str | None = None
        """How the newest in-process recovery completed, in one line, for ``resilient status``."""
        self.cluster: ClusterState | None = None
        """Across machines: the launch's recovery keys in the store (:mod:`resilient.agent.cluster_flow`)."""
        self.restart_costs: Callable[[], tuple[list[float], float | None]] | None = None
        """This run's restarts' measured costs here (set by the agent: ``NodeAccounting.restart_costs``)."""
        self._restart_cost: tuple[float, tuple[float, str] | None] | None = None
        self.declined: str | None = None
        """Why a worker said this run recovers by restart only (its first ``declined`` report): no spare is kept."""
        self.spare_nice = config.spare_nice
        """The niceness spares start with: ``--spare-nice``, or 0 where a promoted one could not be set back."""
        if self.spare_nice:
            why = why_not_renice()
            if why is not None:
                self.spare_nice = 0
                emit(EventKind.SPARE_PRIORITY, nice=0, wanted=config.spare_nice,
                     problem=f"{why}: spares start at the workers' priority")

    # ----------------------------------------------------------- workers
    def new_worker_id(self, role: str) -> str:
        """``w<n>`` / ``s<n>``; across machines prefixed with the node, so that ids are unique in the launch."""
        node = f"{self.config.node_id}." if self.config.multi_node else ""
        return f"{node}{'s' if role == 'spare' else 'w'}{next(self._ids)}"

    def worker_env(self, worker_id: str, role: str) -> dict[str, str]:
        """The variables that offer in-process recovery to one worker (see resilient/worker/env.py)."""
        c = self.config
        resizable = c.shrinkable or c.min_nodes < c.max_nodes
        return {"RESILIENT_RECOVERY_STORE": f"{self.host}:{self.port}", "RESILIENT_WORKER_ID": worker_id,
                "RESILIENT_ROLE": role, "RESILIENT_RECOVERY_TIMEOUT": f"{c.recovery_timeout_s:g}",
                "RESILIENT_RESIZABLE": "1" if resizable else "0"}

    def spare_started(self, worker_id: str, pid: int, generation: int) -> None:
        with self._lock:
            spare = self.spares[worker_id] = SpareState(worker_id, self._clock())
            if worker_id in self._reports.ready:  # a forked spare can say ready before its start is recorded
                spare.ready_at = self._reports.ready[worker_id][0]
        self._emit(EventKind.SPARE_STARTED, worker=worker_id, pid=pid, generation=generation, nice=self.spare_nice)

    def spare_gone(self, worker_id: str, returncode: int) -> None:
        """A spare exited before it was promoted: out of the pool (the caller starts another)."""
        with self._lock:
            spare = self.spares.pop(worker_id, None)
            self._reports.ready.pop(worker_id, None)
            if spare is not None and spare.ready_at is None:
                self.spare_failures += 1
        self._emit(EventKind.SPARE_LOST, worker=worker_id, returncode=returncode)

    def on_message(self, hb: Heartbeat, received_at: float) -> None:
        """A worker's ``recovery`` message (receiver thread)."""
        report = dict(hb.recovery or {})
        event, worker = report.get("event"), str(report.get("worker") or "")
        with self._lock:
            if event == "ready":
                self._reports.ready[worker] = (received_at, report)
                spare = self.spares.get(worker)
                if spare is not None and spare.ready_at is None:
                    spare.ready_at = received_at
                    self.spare_failures = 0
                    self._measured["warm_s"].append(received_at - spare.started_at)
            elif event == "waiting":
                self._reports.waiting[(int(report.get("generation") or 0), worker)] = (received_at, report)
            elif event == "rejoined":
                self._reports.rejoined[(int(report.get("generation") or 0), worker)] = (received_at, report)
            first_decline = event == "declined" and self.declined is None
            if first_decline:
                self.declined = str(report.get("reason") or "a worker declined in-process recovery")
        if first_decline:  # the spares are stopped; the console says why in the run's integration line (notices)
            self._emit(EventKind.IN_PROCESS_DECLINED, worker=worker, reason=self.declined)
        if self.changed is not None:
            self.changed.set()
        if event == "ready" and report.get("role") == "spare":
            self._emit(EventKind.SPARE_READY, worker=worker, step=report.get("step"))
        elif event == "gave_up":
            self._emit(EventKind.RECOVERY_ABANDONED, worker=worker, generation=report.get("generation"),
                       error=report.get("error"))

    def waiting_reports(self, generation: int, worker_ids: Sequence[str]) -> list[dict[str, Any]] | None:
        """The ``waiting`` reports of these members for ``generation``, earliest first, when every one of them
        sent one (the earliest names the first error; the others are usually its consequences)."""
        with self._lock:
            found = [self._reports.waiting.get((generation, w)) for w in worker_ids]
        if any(r is None for r in found):
            return None

        def when(pair: tuple[float, dict[str, Any]]) -> float:
            at = pair[1].get("failed_at")  # when the worker caught its error (one host: the agent's clock)
            return float(at) if isinstance(at, (int, float)) else pair[0]

        return [report for _, report in sorted((r for r in found if r is not None), key=when)]

    def waiting(self, generation: int, worker_ids: Sequence[str]) -> bool:
        """Every one of these members said it left generation ``generation``'s group and waits for the next."""
        return self.waiting_reports(generation, worker_ids) is not None

    def waiting_now(self, generation: int, worker_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        """The ``waiting`` reports for ``generation`` that these members sent so far."""
        with self._lock:
            return {w: self._reports.waiting[(generation, w)][1] for w in worker_ids
                    if (generation, w) in self._reports.waiting}

    def ready_spares_wall(self, spare_ids: Sequence[str]) -> dict[str, float]:
        """Wall-clock time each of these spares became ready (for the pool, read on other machines)."""
        now, wall = self._clock(), time.time()
        with self._lock:
            return {i: wall - (now - s.ready_at) for i, s in self.spares.items()
                    if i in spare_ids and s.ready_at is not None and i in self._reports.ready}

    def batch_plan(self) -> dict[str, Any] | None:
        """The global batch, micro-batch and rule the workers reported (None before any did)."""
        with self._lock:
            found = next((r for _, r in self._reports.ready.values() if r.get("global_batch") and r.get("micro_batch")),
                         None)
        return None if found is None else {k: found.get(k) for k in ("global_batch", "micro_batch", "batch_rule")}

    def replicas(self) -> list[list[int]] | None:
        """A sharded run's replica groups as its workers reported them (None: unsharded, or none reported)."""
        with self._lock:
            return next((r["replicas"] for _, r in self._reports.ready.values() if r.get("replicas") is not None),
                        None)

    def ready_spares(self) -> int:
        """Spares that reported ready and were not promoted: the spares gauge."""
        with self._lock:
            return sum(1 for i, s in self.spares.items() if s.ready_at is not None and i in self._reports.ready)

    def warming_spares(self) -> int:
        """Spares started and not yet ready (importing, building the model): they compete with the ranks here."""
        with self._lock:
            return sum(1 for s in self.spares.values() if s.ready_at is None)

    def spare_view(self, group: WorkerGroup) -> tuple[list[Spare], frozenset[int]]:
        """The group's spares as the ladder sees them, and the world sizes the members' batch plan allows."""
        with self._lock:
            ready = dict(self._reports.ready)
            spares = [Spare(id=i, node=self.config.node_id, warm=s.ready_at is not None and i in ready,
                            ready_since=s.ready_at) for i, s in self.spares.items() if i in group.spares]
        return spares, self._feasible(ready)

    def dirty_ranks(self, generation: int, members: Mapping[int, str]) -> frozenset[int]:
        """The members (rank -> worker id) whose ``waiting`` report for ``generation`` says they failed inside
        or after the optimizer's update: their state is partial, never a source."""
        with self._lock:
            found = {r: self._reports.waiting.get((generation, w)) for r, w in members.items()}
        return frozenset(r for r, entry in found.items() if entry is not None and not clean_position(entry[1]))

    def stateless_ranks(self, generation: int, members: Mapping[int, str]) -> frozenset[int]:
        """The members (rank -> worker id) whose ``waiting`` report for ``generation`` says they hold no state: a
        promoted spare whose first generation failed while it formed."""
        with self._lock:
            found = {r: self._reports.waiting.get((generation, w)) for r, w in members.items()}
        return frozenset(r for r, entry in found.items() if entry is not None and entry[1].get("stateless"))

    def opted_in(self, worker_ids: Sequence[str]) -> bool:
        """Every one of these members said ``ready``: as a worker (its script runs its steps under
        ``run.attempt()``), or, for a promoted spare that has not trained yet, as a spare of the same script; at
        least one of them as a worker."""
        with self._lock:
            roles = [self._reports.ready[w][1].get("role") if w in self._reports.ready else None for w in worker_ids]
        return all(role in ("worker", "promoted") for role in roles) and "worker" in roles

    # ------------------------------------------------------------ decide
    def restart_s(self, *, fresh: bool = False) -> tuple[float, str] | None:
        """A restart's cost for the ladder, measured (seconds, how), or None before anything was: the median of
        this run's restarts here (detection to the next new step, the re-done steps included); before any, the
        first start's (the agent's start to the first step: a restart starts the workers again, re-done steps
        not counted).  Read from :attr:`restart_costs` at most every :data:`RESTART_COST_EVERY_S` (``fresh``:
        now)."""
        if self.restart_costs is None:
            return None
        now = self._clock()
        if fresh or self._restart_cost is None or now - self._restart_cost[0] >= RESTART_COST_EVERY_S:
            restarts, first = self.restart_costs()
            found = ((statistics.median(restarts), f"median of {len(restarts)} restarts") if restarts
                     else (first, "the first start") if first else None)
            self._restart_cost = (now, found)
        return self._restart_cost[1]

    def costs(self) -> RecoveryCosts:
        """The ladder's costs: measured medians where this agent has timed a rung, defaults otherwise."""
        restart = self.restart_s()
        with self._lock:
            measured = {k: statistics.median(v) for k, v in self._measured.items() if v and k != "warm_s"}
            if restart is not None:
                measured["restart_s"] = restart[0]
            warming = [s for s in self.spares.values() if s.ready_at is None]
            warm = statistics.median(self._measured["warm_s"]) if self._measured["warm_s"] else _DEFAULT_SPARE_WARM_S
        repair = None
        if warming:  # the soonest a warming spare is expected ready: the "repair" a hold would wait for
            now = self._clock()
            repair = max(0.0, min(s.started_at + warm - now for s in warming))
        return RecoveryCosts(**measured, repair_s=repair)

    def decide(self, group: WorkerGroup, lost: Mapping[int, str], kind: FaultKind, step: int,
               exit_codes: Sequence[int], failure: Failure, restarts: Restarts, survivor_steps: Mapping[int, int],
               waiting_since: float | None = None, *, dirty: frozenset[int] = frozenset()) -> RecoveryDecision:
        """The one decision (:func:`~resilient.agent.decision.decide`) on losing ``lost`` (old rank -> worker
        id) of the current members, the ladder on offer; ``dirty``: survivors whose state is partial
        (:func:`dirty_ranks`)."""
        decision = self.preview(group, lost, kind, step, exit_codes, failure, restarts, survivor_steps,
                                waiting_since, dirty=dirty)
        if waiting_since is None or decision.action is not Action.WAIT_FOR_REPAIR:
            # A hold is decided again on every tick: its event and status line once, then only what ends it.
            self.note_decision(f"{decision.action.value}: {decision.reason}", decision.to_event())
        return decision

    def preview(self, group: WorkerGroup, lost: Mapping[int, str], kind: FaultKind, step: int,
                exit_codes: Sequence[int], failure: Failure, restarts: Restarts, survivor_steps: Mapping[int, int],
                waiting_since: float | None = None, *,
                dirty: frozenset[int] = frozenset()) -> RecoveryDecision:
        """What the one decision would be on losing ``lost`` now, reported nowhere (:meth:`decide` reports it)."""
        c = self.config
        old_world = len(group.workers)
        survivors = [r for r in group.workers if r not in lost]
        spares, feasible = self.spare_view(group)
        failures = self.failed_recoveries(step)
        obs = Observation(
            fault=Fault(kind=kind, step=step, ranks=frozenset(lost), exit_codes=frozenset(exit_codes),
                        detail=failure.describe()),
            membership=Membership(rank_nodes=(c.node_id,) * old_world, min_size=min(c.min_ranks, old_world),
                                  max_size=c.nproc_per_node, full_size=c.nproc_per_node,
                                  feasible_world_sizes=feasible),
            spares=spares,
            survivor_steps={r: survivor_steps[r] for r in survivors if r in survivor_steps},
            dirty=dirty & set(survivors),
            opted_in=self.opted_in([group.workers[r].worker_id for r in survivors]) and self.config.in_process,
            declined=self.declined,
            inproc_failures=failures, waiting_since=waiting_since, replicas=self.replicas(),
        )
        return self.decide_cluster(failure, restarts, obs)

    def decide_cluster(self, failure: Failure, restarts: Restarts, obs: Observation) -> RecoveryDecision:
        """The one decision over ``obs`` (across machines: the whole launch's membership), with this agent's
        measured costs; reported nowhere (:meth:`report_cluster` reports the answer acted on)."""
        return decide(failure, restarts, self._clock(), ladder=LadderCase(obs, self.costs(), self.ladder))

    def report_cluster(self, decision: RecoveryDecision, obs: Observation) -> None:
        """Report the ladder's answer over ``obs`` across machines: a hold once, when it starts (``obs`` has no
        ``waiting_since``), then only what ends it."""
        if obs.waiting_since is None or decision.action is not Action.WAIT_FOR_REPAIR:
            self.note_decision(f"{decision.action.value}: {decision.reason}", decision.to_event())

    def note_decision(self, line: str, event: dict[str, Any]) -> None:
        self.last_decision = line
        self._emit(EventKind.RECOVERY_DECIDED, **event)

    def _feasible(self, ready: Mapping[str, tuple[float, dict[str, Any]]]) -> frozenset[int]:
        """World sizes (up to this node's MAX) at which the workers' batch plan keeps the global batch."""
        c = self.config
        batch = next((r for _, r in ready.values() if r.get("global_batch") and r.get("micro_batch")), None)
        if batch is None:
            return frozenset({c.nproc_per_node})  # no loader to re-plan: only a replacement keeps the step
        return feasible_world_sizes(int(batch["global_batch"]), int(batch["micro_batch"]), 1, c.nproc_per_node,
                                    batch.get("batch_rule") or "refuse")

    # ------------------------------------------------------------- carry
    def carry_out(self, group: WorkerGroup, decision: RecoveryDecision, lost: Mapping[int, str], generation: int,
                  detected_at: float, incident_id: str) -> dict[int, int]:
        """Publish ``generation`` as ``decision`` says and move the processes; return rank -> pid."""
        old_world = len(group.workers)
        rank_map = decision.rank_map(old_world)
        promoted = {p.rank: p.spare for p in decision.promotions}
        members = []
        for old, new in sorted(rank_map.items(), key=lambda kv: kv[1]):
            if old in lost:
                members.append(Member(worker_id=promoted[old], new_rank=new, old_rank=None))
            else:
                members.append(Member(worker_id=group.workers[old].worker_id, new_rank=new, old_rank=old))
        source = min(m.new_rank for m in members if m.old_rank is not None)
        standby = [i for i in group.spares if i not in promoted.values()]
        publish_assignments(self._store, plan_assignments(generation, members, source, self.host, self.port,
                                                          standby))
        for rank in lost:
            group.retire(rank)
        for rank, spare in promoted.items():
            self.promote(group, spare, rank)
        group.renumber(rank_map)
        self.start_recovery(Recovering(
            generation=generation, rung=decision.action.value, world_size=decision.world_size,
            promotions=tuple((p.rank, p.spare) for p in decision.promotions), dropped=tuple(decision.dropped_ranks),
            members={m.worker_id: m.new_rank for m in members}, detected_at=detected_at,
            deadline=self._clock() + 2 * self.config.recovery_timeout_s + 10, incident_id=incident_id,
            step=decision.step))
        return {r: w.pid for r, w in group.workers.items()}

    def step_rate(self, now: float, furthest: int, generation: int) -> float | None:
        """Steps per second of this generation's furthest rank, from the agent's own ticks; None until 0.3 s."""
        mark = self._rate_mark
        if mark is None or mark[0] != generation or furthest < mark[2]:
            self._rate_mark = (generation, now, furthest)
            return None
        _, since, first = mark
        if now - since < 0.3:
            return None
        return (furthest - first) / (now - since)

    def promote(self, group: WorkerGroup, spare: str, rank: int) -> None:
        """Spare ``spare`` becomes the member of ``rank``, out of the pool (its next ``ready`` is a member's)."""
        problem = group.promote(spare, rank).reprioritise(0)
        if problem is not None:
            self._emit(EventKind.SPARE_PRIORITY, worker=spare, rank=rank, problem=problem)
        with self._lock:
            self.spares.pop(spare, None)
            found = self._reports.ready.get(spare)
            if found is not None:  # a member now; its next ``ready`` (at its first attempt) says ``worker``
                self._reports.ready[spare] = (found[0], {**found[1], "role": "promoted"})

    def start_recovery(self, recovering: Recovering) -> None:
        """``recovering`` is under way: the watch loop follows its members until they rejoin (or it fails)."""
        with self._lock:
            self.recovering = recovering

    def under_way(self, **fields: Any) -> None:
        """A recovery decided elsewhere (across machines) that this node's members now carry out."""
        self.start_recovery(Recovering(deadline=self._clock() + 2 * self.config.recovery_timeout_s + 10, **fields))

    def publish(self, assignments: Sequence[Assignment]) -> None:
        """Put these workers' assignments on this agent's store, where they wait for them."""
        publish_assignments(self._store, assignments)

    def signal_grow(self, key: str, generation: int, at_step: int) -> None:
        """Ask this agent's members to join ``generation`` at the boundary before ``at_step`` (after its
        assignments were published)."""
        self._store.set(key, json.dumps({"generation": generation, "at_step": at_step}))

    def progress(self) -> tuple[Recovering, dict[str, dict[str, Any]]] | None:
        """The recovery under way and the members that rejoined it so far (None when none is under way)."""
        with self._lock:
            r = self.recovering
            if r is None:
                return None
            done = {w: rep for (g, w), (_, rep) in self._reports.rejoined.items() if g == r.generation}
            return r, done

    def rejoined(self, generation: int) -> dict[str, dict[str, Any]]:
        """The members that sent ``rejoined`` for ``generation`` so far."""
        with self._lock:
            return {w: rep for (g, w), (_, rep) in self._reports.rejoined.items() if g == generation}

    def completed(self, at: float, reports: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
        """Close the recovery under way (every member rejoined); its record for the event and the incident."""
        with self._lock:
            r = self.recovering
            assert r is not None
            self.recovering = None
            took = max(0.0, at - r.detected_at)
            self._measured[{"retry_in_place": "inproc_s", "promote_spare": "spare_s", "shrink": "shrink_s",
                            "grow": "grow_s"}[r.rung]].append(took)
        return r.record(took, reports)

    def abandon_recovery(self, *, another_failure: bool = False) -> Recovering | None:
        """The recovery under way will not complete: forget it, and tell its members still forming the new group
        to leave it and wait for the next generation.  ``another_failure``: a member was lost while it formed (a
        second fault, which the next decision folds in); otherwise the recovery itself failed (its deadline
        passed), which counts against ``max_inproc_retries_per_step``."""
        with self._lock:
            r, self.recovering = self.recovering, None
            if r is not None and another_failure:
                self._folded_at_step[r.step] += 1
            if r is not None and (not another_failure or self._folded_at_step[r.step] > FOLDED_PER_STEP):
                self._failed_at_step[r.step] += 1  # a step whose re-formations keep failing is not folded forever
        if r is not None:
            self.abort(r.generation)
        return r

    def forget_grow(self, generation: int) -> None:
        """The grow to ``generation`` will not take place (the run ended before its boundary): no recovery is
        under way any more, and none failed; its members still forming the group are told to leave it."""
        with self._lock:
            if self.recovering is not None and self.recovering.generation == generation:
                self.recovering = None
        self.abort(generation)

    def failed_recoveries(self, step: int) -> int:
        """In-process recoveries of ``step`` that failed so far (what ``max_inproc_retries_per_step`` bounds)."""
        with self._lock:
            return self._failed_at_step[step]

    def abort(self, generation: int) -> None:
        """Generation ``generation`` failed before it formed: its members still forming it leave and wait (the
        ones that formed it fail in their next collective anyway).  Returns once the store holds the key: a
        TCPStore ``set`` is not answered, so the key is read back on the same connection, which the server serves in
        order."""
        key = abort_key(generation)
        self._store.set(key, "1")
        self._store.get(key)

    def group_stopped(self) -> None:
        """The generation's processes are gone (the group stopped): no spare, no recovery under way."""
        with self._lock:
            self.spares.clear()
            self._reports = Reports()
            self.recovering = None
            self.spare_failures = 0

    def view(self) -> dict[str, Any]:
        """What ``resilient status`` shows of in-process recovery."""
        restart = self.restart_s(fresh=True)
        return {"decision": self.last_decision, "completed": self.last_completed, "spares": self.ready_spares(),
                "declined": self.declined,
                "restart_cost": {"seconds": round(restart[0], 3), "from": restart[1]} if restart is not None else None}

    # ----------------------------------------------------------- across machines
    def follow_launch(self, store: ClusterStore, threads: ThreadReports) -> None:
        """Follow the joined launch's recovery keys in the store (again after another launch was joined): a
        change wakes the watch loop (:attr:`changed`)."""
        if self.cluster is not None and self.cluster.store.keys == store.keys:
            return
        self.leave_launch()
        state = self.cluster = ClusterState(store=store)

        def wake() -> None:
            if self.changed is not None:
                self.changed.set()

        def unreachable(error: str) -> None:
            self._emit(EventKind.STORE_UNREACHABLE, error=error)

        state.watch = ClusterWatch(store, lambda: state.following, wake, unreachable, threads=threads)

    def leave_launch(self) -> None:
        """Stop following the launch's recovery keys (at the agent's end)."""
        state, self.cluster = self.cluster, None
        if state is not None:
            state.close()

    def close(self) -> None:
        self._store = None  # type: ignore[assignment]  # the server thread ends with the object
