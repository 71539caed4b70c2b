"""The agent's side of the goodput ledger: feed it, persist it, expose it.

The ledger (:mod:`resilient.metrics.ledger`) is pure; this class gives it
the node's wall clock, serialises access from the heartbeat threads, the
supervisor and the metrics server, persists its state to
``<run_dir>/nodes/<node>/ledger.json`` (every second and at exit) and
reloads it when an agent restarts on the same run directory, so that a run
restarted many times still has one continuous account.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from ..core.events import OutcomeKind
from ..core.fsutil import read_json, write_json_atomic
from ..metrics.ledger import Ledger, LedgerConfig


class NodeAccounting:
    """One node's ledger plus the agent's own counters, safe to use from any thread."""

    def __init__(self, path: Path, config: LedgerConfig, *, wall: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self._wall = wall
        # Heartbeats are stamped with the monotonic clock; the ledger keeps this host's wall time.
        self._offset = wall() - monotonic()
        self._lock = threading.Lock()
        saved = read_json(path)
        self.ledger = Ledger.from_dict(saved["ledger"]) if saved else Ledger(config)
        extra = (saved or {}).get("agent", {})
        self.restarts_by_reason: Counter[str] = Counter(extra.get("restarts_by_reason", {}))
        self.recoveries_by_rung: Counter[str] = Counter(extra.get("recoveries_by_rung", {}))
        self.incidents_by_kind: Counter[str] = Counter(extra.get("incidents_by_kind", {}))
        self.hangs = int(extra.get("hangs", 0))
        self.checkpoint_failures = int(extra.get("checkpoint_failures", 0))
        self.checkpoint_duration_s: float | None = extra.get("checkpoint_duration_s")
        self.checkpoint_bytes: int | None = extra.get("checkpoint_bytes")
        self.resumed = saved is not None
        self._committed: int | None = None
        self._lead_rank: int | None = None

    def wall_of(self, monotonic_t: float) -> float:
        return monotonic_t + self._offset

    def now(self) -> float:
        return self._wall()

    # ------------------------------------------------------------ feeding
    def apply(self, method: str, *args: Any, **kwargs: Any) -> None:
        """Call ``ledger.<method>(now, *args)`` under the lock."""
        with self._lock:
            getattr(self.ledger, method)(self._wall(), *args, **kwargs)

    def generation_started(self, generation: int, world_size: int, full_world_size: int, restart: bool,
                           lead_rank: int) -> None:
        with self._lock:
            self._lead_rank = lead_rank
            self.ledger.generation_started(self._wall(), generation, world_size, full_world_size, restart)

    def heartbeat(self, received_at: float, kind: str, rank: int, section: str, step: int, tokens: int, samples: int,
                  committed_step: int | None, save: dict[str, Any] | None) -> None:
        t = self.wall_of(received_at)
        with self._lock:
            if kind != "bye":
                self.ledger.section(t, rank, section, step, tokens, samples)
            if committed_step is not None and (self._committed is None or committed_step > self._committed):
                self._committed = committed_step
                self.ledger.commit(t, committed_step)
            if save is not None and rank == self._lead_rank:  # one report per save and node
                self.checkpoint_duration_s = float(save.get("duration_s") or 0.0)
                self.checkpoint_bytes = int(save.get("bytes") or 0)
                if not save.get("ok", True):
                    self.checkpoint_failures += 1
                if save.get("deferred_from") is not None:  # taken late: the writer was busy when it fell due
                    self.ledger.save_deferred(t, int(save["deferred_from"]), int(save["step"]),
                                              int(save.get("deferred_slots") or 1))
            if kind == "bye" and rank == self._lead_rank:
                # The lead rank closed its Run: its last step is done, and what follows (interpreter and
                # process-group teardown) is not training time.
                self.ledger.generation_ended(t, OutcomeKind.SUCCEEDED)

    def incident_recorded(self, kind: str) -> None:
        """Count an incident of ``kind`` (every incident the agent records, whatever its cause)."""
        with self._lock:
            self.incidents_by_kind[kind] += 1

    def failure(self, detected_at: float, last_progress_at: float, incident_id: str, kind: str) -> None:
        """Record a failure that costs the run time; both times on the monotonic clock."""
        with self._lock:
            if kind == "hang":
                self.hangs += 1
            self.ledger.failure(self.wall_of(detected_at), min(self.wall_of(last_progress_at),
                                                              self.wall_of(detected_at)), incident_id, kind)

    def restarted(self, reason: str) -> None:
        with self._lock:
            self.restarts_by_reason[reason] += 1

    def recovered_in_process(self, rung: str) -> None:
        """A failure answered without a restart, by ``rung`` (``promote_spare``, ``shrink``)."""
        with self._lock:
            self.recoveries_by_rung[rung] += 1

    # ------------------------------------------------------------ reading
    def account(self) -> Any:
        with self._lock:
            return self.ledger.account(self._wall())

    def restart_costs(self, incident_ids: Collection[str]) -> tuple[list[float], float | None]:
        """What a restart costs this run, measured: the seconds each of ``incident_ids`` (failures answered by a
        restart) took from its detection to the run's next new step, restart and re-done steps together, for those
        that are over; and the seconds from the agent's start to the first step (None before it)."""
        account = self.account()
        done = [i.recovery_s + i.replay_s for i in account.incidents if i.id in incident_ids and not i.open]
        first = account.seconds.get("init", 0.0) if account.attempted_steps else None
        return done, first

    def save(self) -> None:
        with self._lock:
            state = {
                "ledger": self.ledger.to_dict(),
                "agent": {
                    "restarts_by_reason": dict(self.restarts_by_reason),
                    "recoveries_by_rung": dict(self.recoveries_by_rung),
                    "incidents_by_kind": dict(self.incidents_by_kind), "hangs": self.hangs,
                    "checkpoint_failures": self.checkpoint_failures,
                    "checkpoint_duration_s": self.checkpoint_duration_s, "checkpoint_bytes": self.checkpoint_bytes,
                },
            }
        write_json_atomic(self.path, state)


def device_peak_flops(configured: float | None) -> float | None:
    """Peak FLOP/s of one of this node's devices: configured, else from the table by GPU name (None on CPU)."""
    from ..metrics.mfu import device_name, resolve_peak

    peak = resolve_peak(device_name(0) if configured is None else None,
                        peak_tflops=configured / 1e12 if configured is not None else None)
    return peak.flops


def job_mfu(account: Any, flops_per_step: float | None, device_peak: float | None) -> dict[str, float | None]:
    """MFU of the job by scope ("run", "window"); see :func:`resilient.metrics.mfu.account_mfu`."""
    from ..metrics.mfu import account_mfu

    return account_mfu(account, flops_per_step, device_peak)
