"""The agent's side of straggler and slowdown detection: collect the ranks' windows, score them, report.

Workers send one ``timing`` heartbeat per window of steps
(:mod:`resilient.run.timing`).  :meth:`SlownessWatch.take` files them by
generation and window on the receiver's thread; the watch loop calls
:meth:`SlownessWatch.poll`, which scores every window all of this node's
ranks have reported, in order, with the pure detectors
(:mod:`resilient.watchdog.straggler`, :mod:`resilient.watchdog.slowdown`),
and reports what changed:

- a straggler flagged or cleared: a ``straggler_flagged`` /
  ``straggler_cleared`` event and, when flagged, an incident of kind
  ``straggler`` naming the rank, node, section and numbers;
- a slowdown that began: a ``slowdown_began`` event and an incident of
  kind ``slowdown`` with the attribution and the host's telemetry over the
  slowdown against the baseline; the ledger's measured ideal is held so the
  slow steps count as ``slowdown_excess``; when it ends, a
  ``slowdown_ended`` event, and the incident is rewritten with its cost
  (seconds above the baseline, and what the ledger counted meanwhile in each
  category, with the one the slowdown's time lands in: ``data_wait`` for the
  input pipeline, ``checkpoint_stall`` for storage, ``slowdown_excess``
  otherwise).

Across machines one agent scores stragglers: the *scorer*, whose node
holds rank 0.  Every agent passes its ranks' windows to it through the
store (:meth:`outbox`; the scorer's :meth:`take_peers`, on the peer watch's
thread); the straggler detector scores a window once every rank of the
world reported it, so one rank per node is scored against the others.  The
scorer publishes the standing flags of every node when they change
(:meth:`flags_out`); each agent takes its own ranks' flags from there
(:meth:`from_scorer`) and reports (events, incidents, eviction, quarantine)
only the ranks it runs.  A launch of N nodes thus costs etcd N window
records a second in and N out, not N² (every agent following every
other's).  The scorer shows every rank's scores in ``/metrics`` (labelled
with the rank's node).  A window some node completed while one of its own
spares warmed up is not scored for stragglers.  The slowdown detector
scores this node's ranks alone (the job's step time is the same on every
node), as soon as they have reported.

A window some rank never reports (it died, or the world re-formed) is
dropped once a later window is complete; a new generation starts both
detectors afresh (ranks renumbered, the step time may change).  The scores
are read by ``/metrics`` and ``status`` through :meth:`snapshot`.
"""

from __future__ import annotations

import statistics
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import asdict
from typing import Any

from ..core.errors import ConfigError
from ..core.events import Emit, EventKind
from ..watchdog.settings import Configs, flatten
from ..watchdog.settings import apply as apply_settings
from ..watchdog.slowdown import SlowdownChange, SlowdownConfig, SlowdownDetector
from ..watchdog.straggler import StragglerChange, StragglerConfig, StragglerDetector
from ..watchdog.timing import RankWindow, parse_window
from .heartbeat import Heartbeat
from .incidents import Incident
from .telemetry import HostSample, compare_samples, sample_host
from .windows import WindowTable

HOST_SAMPLES = 64
HOST_EVERY_S = 1.0
"""The host's counters are read at most this often (a window of fast steps takes a few tens of milliseconds)."""
"""Host samples kept, one per scored window (a slowdown compares those around it with the baseline's)."""



class SlownessWatch:
    """Collects timing windows from the heartbeat threads and scores them from the watch loop."""

    def __init__(self, node_id: str, emit: Emit, *, straggler: StragglerConfig | None = None,
                 slowdown: SlowdownConfig | None = None, record: Callable[[Incident], None] | None = None,
                 publish: Callable[[Incident], None] | None = None,
                 ledger_seconds: Callable[[], Mapping[str, float]] | None = None,
                 freeze_ideal: Callable[[bool], None] | None = None,
                 telemetry: Callable[[], HostSample] = sample_host,
                 persistent: Callable[[dict[str, Any]], object] | None = None, persist_windows: int = 0,
                 evict_windows: int = 0) -> None:
        self.node_id = node_id
        self._emit = emit
        self._record = record
        self._publish = publish
        self._ledger = ledger_seconds
        self._freeze = freeze_ideal
        self._telemetry = telemetry
        self._sampled: HostSample | None = None
        self._persistent = persistent
        self._persist_windows = persist_windows
        self._flagged_at: dict[tuple[int, str], tuple[int, dict[str, Any]]] = {}
        """Standing flags: the window each was raised at and its event's fields (cleared flags leave)."""
        self._acted: set[tuple[str, int, int, str, int]] = set()
        """(what, generation, rank, section) of flags already reported as persistent (what: evict, quarantine)."""
        self._evict_windows = evict_windows
        self._evictions: deque[dict[str, Any]] = deque()
        """Flags that stood ``evict_windows`` windows, for the watch loop to weigh (:meth:`take_eviction`)."""
        self._store_seq = 0
        """The newest sequence of store changes taken (:meth:`from_store`)."""
        self.evictions_done = 0
        """Stragglers this node's agent replaced or dropped (counted by the eviction)."""
        self.stragglers = StragglerDetector(straggler)
        self.slowdowns = SlowdownDetector(slowdown)
        self._lock = threading.Lock()
        self.windows = WindowTable(node_id)
        """Windows received and not yet scored (this node's ranks', and its peers' across machines)."""
        self.outbox, self.take_peers = self.windows.outbox, self.windows.take_peers
        self._generation: int | None = None
        self.disturbed_windows = 0
        """Windows left unscored for stragglers while a spare of this node warmed up."""
        self.failures = 0
        """Errors inside detection (each reported as a ``detector_failed`` event, the first three in full)."""
        self._audits: list[tuple[int, dict[str, Any]]] = []
        """Replica audit findings waiting for the watch loop: (generation, report)."""
        self._reasons: dict[tuple[int, str], str] = {}
        """Why each standing straggler flag was raised (for ``status``)."""
        self._host: deque[HostSample] = deque(maxlen=HOST_SAMPLES)
        """One host sample per scored window."""
        self._baseline_host: tuple[HostSample, HostSample] | None = None
        self._queued: tuple[Configs, dict[str, Any], str] | None = None
        """Settings accepted by :meth:`request`, applied at the next :meth:`poll` (with the changes and their source)."""
        self._open: tuple[Incident, dict[str, float]] | None = None
        """The slowdown incident in progress and the ledger's seconds by category when it began."""
        self.scorer = False
        """This node holds rank 0: it scores every rank (set by each :meth:`poll`)."""
        self._world_flags: dict[tuple[int, str], dict[str, Any]] = {}
        """As the scorer: every node's standing flags, as :class:`StragglerChange` fields."""
        self._world_cleared: dict[tuple[int, str], dict[str, Any]] = {}
        """As the scorer: the fields of each flag's latest clearing (its reason, for the node that held it)."""
        self._flags_seq = 0
        self._flags_dirty = False
        self._scorer_record: dict[str, Any] | None = None
        """The scorer's newest flags record, taken on the peer watch's thread, applied by the next poll."""
        self._scorer_seq: tuple[str, int] = ("", -1)

    # ------------------------------------------------------------ intake (receiver threads)
    def take(self, hb: Heartbeat) -> None:
        """File one ``timing`` or ``audit`` heartbeat of a current worker (the tracker checked its generation, pid)."""
        if hb.kind == "audit":
            with self._lock:
                self._audits.append((hb.generation or 0, dict(hb.audit or {})))
            return
        try:
            window = parse_window(hb.rank, self.node_id, hb.timing or {})
        except ValueError:
            self.windows.refused()
            return
        self.windows.file(hb.generation or 0, window)

    # ------------------------------------------------------------ scoring (the watch loop)
    def poll(self, generation: int, ranks: Collection[int], *, disturbed: bool = False) -> None:
        """Score the windows of ``generation`` every one of ``ranks`` has reported, oldest first.

        ``disturbed``: the agent itself loads this node now (a spare warming up: importing, building its
        model); the windows that complete meanwhile are not scored for stragglers (they would name whichever
        rank shares a core with the spare), only for the job's slowdown.

        Detection must never end a healthy generation: an error in it is a ``detector_failed`` event (the
        first few of them, with the traceback) and the watch loop goes on.
        """
        try:
            self._poll(generation, ranks, disturbed)
        except Exception as e:  # noqa: BLE001  reported, never fatal to training
            self.failures += 1
            if self.failures <= 3:
                self._emit(EventKind.DETECTOR_FAILED, error=f"{type(e).__name__}: {e}",
                           traceback=traceback.format_exc(), failures=self.failures)

    def _poll(self, generation: int, ranks: Collection[int], disturbed: bool) -> None:
        if generation != self._generation:
            self._new_generation(generation)
        self._apply_queued(generation)
        self._record_audits()
        scorer = 0 in ranks
        if scorer != self.scorer:
            self.scorer = scorer
            with self._lock:
                self._world_flags.clear()
                self._flags_dirty = scorer
        world_batches, local_batches = self.windows.ready(generation, ranks, disturbed)
        if not scorer:
            self._apply_scorer(generation)
            for windows in local_batches:
                self._check_persistent(generation, windows)
            world_batches = []
        for windows in world_batches:
            if disturbed or self.windows.disturbed(generation, min(w.window for w in windows.values())):
                self.disturbed_windows += 1
                continue
            changes = self.stragglers.observe(windows)
            self._note_world(changes)
            for change in self._own(changes):
                self._straggler(change, generation)
            self._check_persistent(generation, windows)
        for windows in local_batches:
            self._host.append(self._host_now())
            had_baseline = self.slowdowns.baseline_s is not None
            for slow in self.slowdowns.observe(windows):
                self._slowdown(slow, generation)
            if not had_baseline and self.slowdowns.baseline_s is not None:  # the host while the baseline was set
                first = max(0, len(self._host) - self.slowdowns.config.baseline_windows - 1)
                self._baseline_host = (self._host[first], self._host[-1])

    def _host_now(self) -> HostSample:
        """The host's counters, read at most once per :data:`HOST_EVERY_S`: a window of fast steps lasts a few tens
        of milliseconds, and reading them for each (psutil, the pressure files) took a percent of a core from
        the workers of a busy node."""
        sampled = self._sampled
        if sampled is None or time.monotonic() - sampled.t >= HOST_EVERY_S:
            sampled = self._sampled = self._telemetry()
        return sampled

    def _own(self, changes: Iterable[StragglerChange]) -> list[StragglerChange]:
        """The changes of this node's ranks (a peer's agent reports its own)."""
        return [c for c in changes if c.node == self.node_id]

    # ------------------------------------------------------------ one scorer for the launch
    def _note_world(self, changes: Iterable[StragglerChange]) -> None:
        """As the scorer: every node's standing flags, for :meth:`flags_out`."""
        with self._lock:
            for c in changes:
                key, fields = (c.rank, c.section), {k: v for k, v in asdict(c).items() if k != "kind"}
                if c.kind == "flagged":
                    self._world_flags[key] = fields
                else:
                    self._world_flags.pop(key, None)
                    self._world_cleared[key] = fields
                self._flags_dirty = True

    def flags_out(self) -> dict[str, Any] | None:
        """As the scorer, once after each change: the record of every node's standing flags (None: no change)."""
        with self._lock:
            if not self.scorer or not self._flags_dirty or self._generation is None:
                return None
            self._flags_dirty = False
            self._flags_seq += 1
            return {"by": self.node_id, "seq": self._flags_seq, "generation": self._generation,
                    "flags": list(self._world_flags.values()),
                    "cleared": [v for k, v in self._world_cleared.items() if k not in self._world_flags]}

    def from_scorer(self, record: Mapping[str, Any]) -> None:
        """The scorer's flags record as read from the store (the peer watch's thread); applied by the next poll."""
        mark = (str(record.get("by")), int(record.get("seq") or 0))
        if mark == self._scorer_seq:
            return
        self._scorer_seq = mark
        with self._lock:
            self._scorer_record = dict(record)

    def _apply_scorer(self, generation: int) -> None:
        """This node's ranks' flags as the scorer published them: each new flag raised, each gone one cleared."""
        with self._lock:
            record = self._scorer_record
            if record is None or record.get("generation") != generation:
                return  # another generation's (one ahead waits for this node to get there)
            self._scorer_record = None
        try:
            standing = {(int(f["rank"]), str(f["section"])): f for f in record.get("flags") or ()
                        if f.get("node") == self.node_id}
            cleared = {(int(f["rank"]), str(f["section"])): f for f in record.get("cleared") or ()
                       if f.get("node") == self.node_id}
            for key, fields in standing.items():
                if key not in self._flagged_at:
                    self._straggler(StragglerChange(kind="flagged", **fields), generation)
            for key in [k for k in self._flagged_at if k not in standing]:
                fields = cleared.get(key) or {**self._flagged_at[key][1], "node": self.node_id,
                                              "reason": f"rank {key[0]} is no longer flagged in {key[1]}"}
                self._straggler(StragglerChange(kind="cleared", **fields), generation)
        except (KeyError, TypeError, ValueError) as e:
            self._emit(EventKind.DETECTOR_FAILED, error=f"the scorer's straggler flags are malformed: {e}",
                       by=record.get("by"))

    def settings(self) -> dict[str, Any]:
        """Every detector setting by its dotted key (a change already accepted included)."""
        with self._lock:
            configs = self._queued[0] if self._queued else (self.stragglers.config, self.slowdowns.config)
        return flatten(configs)

    def request(self, changes: Mapping[str, Any], source: str) -> dict[str, Any]:
        """Accept ``changes`` (dotted key -> value) for the next window on; ConfigError and no change if invalid."""
        with self._lock:
            base = self._queued[0] if self._queued else (self.stragglers.config, self.slowdowns.config)
            configs = apply_settings(base, changes)
            merged = {**(self._queued[1] if self._queued else {}), **changes}
            self._queued = (configs, merged, source)
        return flatten(configs)

    def from_store(self, record: Mapping[str, Any]) -> None:
        """Changes requested through the store (``resilient detectors --store``): each sequence once, queued for
        the next window like a change through the control socket; one that does not validate is reported."""
        seq = record.get("seq")
        if not isinstance(seq, int) or seq <= self._store_seq:
            return
        self._store_seq = seq
        changes = record.get("changes")
        try:
            if not isinstance(changes, Mapping):
                raise ConfigError(f"the store's detector changes are {changes!r}, not KEY: VALUE pairs")
            self.request(changes, f"store (seq {seq}, by {record.get('by')})")
        except ConfigError as e:
            self._emit(EventKind.DETECTOR_FAILED, error=f"detector changes from the store refused: {e}", seq=seq)

    def _apply_queued(self, generation: int) -> None:
        with self._lock:
            queued, self._queued = self._queued, None
        if queued is None:
            return
        (straggler, slowdown), changes, source = queued
        self.reconfigure(straggler=straggler, slowdown=slowdown, generation=generation)
        self._emit(EventKind.DETECTORS_CHANGED, generation=generation, changes=dict(changes), source=source,
                   settings=flatten((straggler, slowdown)))

    def run_ended(self, generation: int) -> None:
        """The workers exited: a slowdown in progress ends (its incident gets its cost); flags stay for ``status``."""
        try:
            for slow in self.slowdowns.end():
                self._slowdown(slow, generation)
        except Exception as e:  # noqa: BLE001  reported, never fatal
            self._emit(EventKind.DETECTOR_FAILED, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())

    def reconfigure(self, *, straggler: StragglerConfig | None = None, slowdown: SlowdownConfig | None = None,
                    generation: int = 0) -> None:
        """Use new detector settings from the next window on (runtime control)."""
        if straggler is not None:
            for change in self._own(self.stragglers.reconfigure(straggler)):
                self._straggler(change, generation)
        if slowdown is not None:
            for slow in self.slowdowns.reconfigure(slowdown):
                self._slowdown(slow, generation)

    def snapshot(self) -> dict[str, Any]:
        """Scores and standing flags, for ``/metrics`` and ``status``."""
        slow = self.slowdowns.last if self.slowdowns.slow else None
        return {
            "scores": [asdict(s) for s in self.stragglers.scores()] if self.scorer else [],
            "stragglers": [{"rank": r, "section": s, "reason": reason} for (r, s), reason in self._reasons.items()],
            "slowdown": None if slow is None else {"reason": slow.reason, "ratio": round(slow.ratio, 4),
                                                   "since_window": slow.window},
            "baseline_s": self.slowdowns.baseline_s,
            "disturbed_windows": self.disturbed_windows,
        }

    def _record_audits(self) -> None:
        """Each replica audit finding: an event and an incident naming the ranks and tensors."""
        with self._lock:
            audits, self._audits = self._audits, []
        for generation, report in audits:
            self._emit(EventKind.REPLICA_MISMATCH, generation=generation, **report)
            if self._record is not None:
                ranks = report.get("ranks") or []
                self._record(Incident(
                    id=f"g{generation:04d}-{self.node_id}-replicas-s{report.get('step')}", node=self.node_id,
                    generation=generation, kind="replica_mismatch", rank=ranks[0] if len(ranks) == 1 else None,
                    pid=None, section=None, step=report.get("step"), summary=str(report.get("reason")),
                    performance=report))

    def _new_generation(self, generation: int) -> None:
        """A restart or re-formation ends what was being measured: flags clear, a slowdown ends, all warm up again."""
        previous = self._generation or 0
        for change in self._own(self.stragglers.clear()):
            self._straggler(change, previous)
        for rank, section in list(self._flagged_at):  # flags the scorer raised end with the generation too
            fields = {**self._flagged_at[(rank, section)][1], "node": self.node_id,
                      "reason": f"generation {previous} ended"}
            self._straggler(StragglerChange(kind="cleared", **fields), previous)
        with self._lock:
            self._world_flags.clear()
            self._world_cleared.clear()
            self._flags_dirty = self.scorer
        for slow in self.slowdowns.finish():
            self._slowdown(slow, previous)
        self._generation, self._baseline_host = generation, None
        self.windows.start(generation)
        self._host.clear()
        self._evictions.clear()  # flags of the old generation name ranks that may be someone else's now

    def _check_persistent(self, generation: int, windows: Mapping[int, RankWindow]) -> None:
        """A flag that has stood ``evict_windows`` windows is queued once for the watch loop to weigh replacing
        the rank (:meth:`take_eviction`); one that stood ``persist_windows`` is reported once (the agent
        quarantines its node)."""
        window = max(w.window for w in windows.values())
        left = [w.remaining for w in windows.values() if w.remaining is not None]
        for (rank, section), (since, fields) in list(self._flagged_at.items()):
            flag = {**fields, "rank": rank, "section": section, "generation": generation, "flagged_at_window": since,
                    "windows_flagged": window - since, "remaining_steps": min(left) if left else None,
                    "job_step_s": statistics.median(w.step_s for w in windows.values())}
            peers = [w.sections.get(section, 0.0) for r, w in windows.items() if r != rank]
            if rank in windows and peers:  # this window's numbers: the flag's are as old as the flag
                flag["rank_s"], flag["peers_s"] = windows[rank].sections.get(section, 0.0), statistics.median(peers)
            for what, after in (("evict", self._evict_windows), ("quarantine", self._persist_windows)):
                # A straggler kept is weighed again every ``after`` windows (a spare may be ready by then).
                key = (what, generation, rank, section, (window - since) // after if what == "evict" and after else 0)
                if after > 0 and window - since >= after and key not in self._acted:
                    self._acted.add(key)
                    if what == "evict":
                        self._evictions.append(flag)
                    elif self._persistent is not None:
                        self._persistent(flag)

    @property
    def evictions_waiting(self) -> int:
        """Persistent flags queued and not yet weighed."""
        return len(self._evictions)

    def take_eviction(self) -> dict[str, Any] | None:
        """The oldest persistent flag not yet weighed for replacement, or None."""
        return self._evictions.popleft() if self._evictions else None

    def _straggler(self, change: StragglerChange, generation: int) -> None:
        fields = {k: v for k, v in asdict(change).items() if k not in ("kind", "node")}  # the event has the node
        if change.kind == "cleared":
            self._flagged_at.pop((change.rank, change.section), None)
            self._reasons.pop((change.rank, change.section), None)
            self._emit(EventKind.STRAGGLER_CLEARED, generation=generation, **fields)
            return
        self._reasons[(change.rank, change.section)] = change.reason
        self._flagged_at[(change.rank, change.section)] = (change.window, fields)
        self._emit(EventKind.STRAGGLER_FLAGGED, generation=generation, **fields)
        if self._record is not None:
            self._record(Incident(
                id=f"g{generation:04d}-{self.node_id}-straggler-r{change.rank}-{change.section}-w{change.window}",
                node=self.node_id, generation=generation, kind="straggler", rank=change.rank, pid=None,
                section=change.section, step=None, summary=change.reason, performance={**fields, "node": change.node}))

    def _slowdown(self, change: SlowdownChange, generation: int) -> None:
        attribution = None if change.attribution is None else asdict(change.attribution)
        fields = {"window": change.window, "baseline_s": change.baseline_s, "step_s": change.step_s,
                  "ratio": round(change.ratio, 4), "attribution": attribution, "excess_s": round(change.excess_s, 3),
                  "reason": change.reason}
        ledger_now = dict(self._ledger()) if self._ledger is not None else {}
        if change.kind == "began":
            if self._freeze is not None:
                self._freeze(True)
            span = min(len(self._host), self.slowdowns.config.rule.consecutive + 1)
            fields["host"] = compare_samples(self._baseline_host, (self._host[-span], self._host[-1]))
            self._emit(EventKind.SLOWDOWN_BEGAN, generation=generation, **fields)
            incident = Incident(id=f"g{generation:04d}-{self.node_id}-slowdown-w{change.window}", node=self.node_id,
                                generation=generation, kind="slowdown", rank=None if attribution is None else
                                attribution["rank"], pid=None, section=None if attribution is None else
                                attribution["section"], step=None, summary=change.reason, performance=fields)
            self._open = (incident, ledger_now)
            if self._record is not None:
                self._record(incident)
            return
        if self._freeze is not None:
            self._freeze(False)
        opened, self._open = self._open, None
        if opened is not None and self._ledger is not None:
            # The cause is the one named when it began: at its end the recent windows are back to normal.
            fields.update(ledger_cost(opened[1], ledger_now, (opened[0].performance or {}).get("attribution")))
        self._emit(EventKind.SLOWDOWN_ENDED, generation=generation, **fields)
        if opened is not None and self._publish is not None:
            incident = opened[0]
            self._publish(incident.with_performance({**(incident.performance or {}), "ended": fields}))


LEDGER_CATEGORY = {"data": "data_wait", "checkpoint": "checkpoint_stall"}
"""Where the ledger counts a slowdown attributed to this section (anything else: ``slowdown_excess``)."""


def ledger_cost(before: Mapping[str, float], after: Mapping[str, float],
                attribution: Mapping[str, Any] | None) -> dict[str, Any]:
    """What the ledger counted between a slowdown's start and end: seconds by category, and the category its cost
    lands in with the seconds there (a slower input pipeline is data wait, not excess step time)."""
    during = {k: round(after.get(k, 0.0) - before.get(k, 0.0), 3) for k in after}
    category = LEDGER_CATEGORY.get((attribution or {}).get("section") or "", "slowdown_excess")
    return {"ledger_s": {k: v for k, v in during.items() if v > 0}, "ledger_category": category,
            "ledger_cost_s": during.get(category, 0.0)}
