"""This node's side of the fleet's quarantine (:mod:`resilient.coord.quarantine`), across machines.

- :meth:`QuarantineGate.hold`, before every rendezvous round: while a
  record for this node stands the agent stays out of the rendezvous (the
  run goes on without it, on fewer nodes or with a spare); once it lapses
  or is released the node burns in (:mod:`resilient.watchdog.burnin`, in a
  process of its own: the agent never imports torch) and joins only if it
  passes against the fleet's numbers.  A failed burn-in is a new offence,
  with twice the expiry.  A node that has seen a record of its own always
  burns in before it joins again; ``burn_in_at_start`` makes it burn in
  before its first round too.  The hold ends early when the agent is asked
  to stop or the run ends without this node.
- :meth:`QuarantineGate.check`, once a second from the peer watch while a
  generation runs: a record written meanwhile (by an operator, a persistent
  straggler flag, a failed health check) ends this node's generation.
- :meth:`QuarantineGate.add` writes a record for this node;
  :meth:`persistent_straggler` does so on a thread of its own (the watch
  loop never waits on the network), and only where the run can go on
  without this node.

:meth:`view` is what ``status`` and ``/metrics`` show; it does no I/O.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..coord.quarantine import FleetQuarantine, Standing
from ..coord.store import ControlStoreError
from ..coord.watch import PrefixWatch
from ..core.events import Emit, EventKind
from ..core.exitcodes import EXIT_PREEMPTED_AGENT
from ..watchdog.burnin import BurnInVerdict, judge

Ending = tuple[int, str, str]
"""How an agent ends: exit code, verdict, reason."""

BURN_IN_TIMEOUT_S = 300.0
"""A burn-in that has not finished by then failed (a node that slow is not coming back)."""
RETRY_S = 10.0
"""After a burn-in that failed or could not be judged, the wait before the next try."""


class QuarantineGate:
    """Keeps this node out of rendezvous while quarantined, and burns it in before it rejoins."""

    def __init__(self, fleet: FleetQuarantine, node_id: str, scratch: Path, addr: str, emit: Emit, *,
                 set_phase: Callable[[str], None], poll_s: float = 1.0, retry_s: float = RETRY_S,
                 burn_in_argv: tuple[str, ...] = ()) -> None:
        self.fleet = fleet
        self.node_id = node_id
        self.scratch = scratch
        self.addr = addr
        self._emit = emit
        self._set_phase = set_phase
        self._poll_s = poll_s
        self._retry_s = retry_s
        self._burn_in_argv = burn_in_argv
        """Extra arguments for the burn-in process (smaller sizes in tests)."""
        self.standing: Standing | None = None
        """The record in force as last read (None: free, or not read yet)."""
        self.offences = 0
        self.burn_in: dict[str, Any] | None = None
        """The newest burn-in of this node: its numbers, the verdict and the reason."""
        self._must_burn_in = False
        """Set whenever a record of this node is seen: it burns in before it joins again, however the record ended."""
        self._held: set[int] = set()
        self._watch: PrefixWatch | None = None
        """This node's record key, followed from the first :meth:`check` on (no request while it stands still)."""
        self._seen: int | None = None
        """The record key's revision when the offences were last read (they move only with a new record)."""

    # ------------------------------------------------------------ reads
    def _watched(self) -> PrefixWatch | None:
        if self._watch is None:
            record, _ = self.fleet.keys_of(self.node_id)  # as a prefix it may hold other nodes' too: filtered
            self._watch = PrefixWatch(self.fleet.client, record, on_error=lambda _: None).start()
        return self._watch if self._watch.fresh else None

    def check(self) -> Standing | None:
        """This node's record as the watch of its keys holds it (read when the watch is not following etcd); an
        outage keeps the last answer (an outage never ends a generation)."""
        try:
            watch = self._watched()
            if watch is None:
                standing, self.offences = self.fleet.standing_and_offences(self.node_id)
                self._seen = None
            else:
                entries = watch.view().entries
                found = entries.get(self.fleet.keys_of(self.node_id)[0])
                standing = self.fleet.standing_in(self.node_id, entries)
                revision = found.mod_revision if found is not None else 0
                if revision != self._seen:
                    self.offences, self._seen = self.fleet.offences(self.node_id), revision
        except ControlStoreError as e:
            self._emit(EventKind.STORE_UNREACHABLE, error=f"{type(e).__name__}: {e}")
            return self.standing
        self.standing = standing
        if standing is not None:
            self._must_burn_in = True
        return standing

    def close(self) -> None:
        """Stop following this node's record."""
        if self._watch is not None:
            self._watch.close()

    def view(self) -> dict[str, Any]:
        """What status and ``/metrics`` show: the standing record, the offences, the newest burn-in."""
        s = self.standing
        return {"fleet": self.fleet.config.fleet, "offences": self.offences, "burn_in": self.burn_in,
                "standing": None if s is None else {**asdict(s.record), "remaining_s": s.remaining_s,
                                                    "summary": s.describe()}}

    # ------------------------------------------------------------ writes
    def add(self, *, reason: str, source: str, evidence: dict[str, Any] | None = None) -> bool:
        """Quarantine this node (one record however many causes see it); whether a new record was written."""
        try:
            created, record = self.fleet.add(self.node_id, reason=reason, source=source, by=self.node_id,
                                             evidence=evidence)
        except ControlStoreError as e:
            self._emit(EventKind.STORE_UNREACHABLE, error=f"{type(e).__name__}: {e}")
            return False
        if created:
            self._emit(EventKind.NODE_QUARANTINED, quarantined_node=self.node_id, source=source, reason=reason,
                       offence=record.offence, expiry_s=record.expiry_s, expiry_reason=record.expiry_reason,
                       evidence=record.evidence)
            print(f"resilient: node {self.node_id} quarantined ({source}, offence {record.offence}, "
                  f"{record.expiry_s:.0f} s): {reason}", file=sys.stderr, flush=True)
        self.check()
        return created

    def persistent_straggler(self, flag: dict[str, Any], *, can_leave: bool) -> None:
        """A straggler flag on this node persisted: quarantine the node, on a thread of its own, if the run can go
        on without it; otherwise say why it stays."""
        reason = f"a persistent straggler: {flag['reason']} (flagged for {flag['windows_flagged']} windows)"
        if not can_leave:
            self._emit(EventKind.QUARANTINE_SKIPPED, reason=reason, evidence=flag,
                       why="the run cannot go on without this node (it has its fewest nodes, --nnodes MIN)")
            return
        threading.Thread(target=self.add, kwargs={"reason": reason, "source": "straggler", "evidence": flag},
                         name="quarantine-add", daemon=True).start()

    # ------------------------------------------------------------ the gate
    def hold(self, stopping: Callable[[], bool], ended: Callable[[], Ending | None], *,
             burn_in_at_start: bool) -> Ending | None:
        """Before a rendezvous round: stay out while a record stands, then burn in.  Returns how the agent ends
        instead of joining (exit code, verdict, reason: asked to stop, or the run is over as ``ended()`` says),
        or None to join."""
        if burn_in_at_start and self.burn_in is None:
            self._must_burn_in = True
        standing = self.check()
        while True:
            wait = self._poll_s
            if standing is not None:
                if standing.record.offence not in self._held:
                    self._held.add(standing.record.offence)
                    self._emit(EventKind.QUARANTINE_HELD, reason=standing.record.reason,
                               offence=standing.record.offence, remaining_s=standing.remaining_s,
                               summary=standing.describe())
                    print(f"resilient: {standing.describe()}; staying out of the rendezvous", file=sys.stderr,
                          flush=True)
                self._set_phase(f"quarantined: {standing.remaining_s} s left ({standing.record.reason})")
            elif not self._must_burn_in:
                return None
            elif not stopping():
                self._set_phase("burning in")
                verdict, result = self.run_burn_in()
                if verdict is not None and verdict.passed:
                    self._must_burn_in = False
                    return None
                if verdict is not None:
                    self.add(reason=verdict.reason, source="burn_in", evidence=result)
                wait = self._retry_s  # failed, or the fleet's numbers could not be read: not at once again
            if stopping():
                return EXIT_PREEMPTED_AGENT, "preempted", "stopped while held out of the run"
            try:
                over = ended()
            except ControlStoreError as e:
                self._emit(EventKind.STORE_UNREACHABLE, error=f"{type(e).__name__}: {e}")
                over = None
            if over is not None:
                return over
            time.sleep(wait)
            standing = self.check()

    def run_burn_in(self) -> tuple[BurnInVerdict | None, dict[str, Any]]:
        """Measure this node in a process of its own, judge it against the fleet, publish and report it.  The
        verdict is None when the fleet's numbers could not be read (an outage is not the node's fault)."""
        try:
            fleet = self.fleet.burn_ins()
        except ControlStoreError as e:
            self._emit(EventKind.STORE_UNREACHABLE, error=f"{type(e).__name__}: {e}")
            return None, {}
        result, problem = self._measure()
        if problem is not None:
            verdict = BurnInVerdict(False, f"burn-in failed: {problem}", ())
            result = {"error": problem}
        else:
            verdict = judge(result, fleet, self.node_id, self.fleet.config.burn_in_min_ratio)
        record = {**result, "passed": verdict.passed, "reason": verdict.reason,
                  "checks": [asdict(c) for c in verdict.checks]}
        self.burn_in = record
        try:
            self.fleet.publish_burn_in(self.node_id, record)
        except ControlStoreError as e:
            self._emit(EventKind.STORE_UNREACHABLE, error=f"{type(e).__name__}: {e}")
        kind = EventKind.BURN_IN_PASSED if verdict.passed else EventKind.BURN_IN_FAILED
        self._emit(kind, reason=verdict.reason, result=record)
        print(f"resilient: node {self.node_id}: {verdict.reason}", file=sys.stderr, flush=True)
        return verdict, result

    def _measure(self) -> tuple[dict[str, Any], str | None]:
        """The burn-in process's numbers, or what went wrong."""
        argv = [sys.executable, "-m", "resilient.watchdog.burnin", "--scratch", str(self.scratch),
                "--addr", self.addr, *self._burn_in_argv]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=BURN_IN_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            return {}, f"the burn-in did not finish within {BURN_IN_TIMEOUT_S:.0f} s"
        except OSError as e:
            return {}, f"the burn-in process could not start ({e})"
        lines = done.stdout.strip().splitlines()
        if done.returncode != 0 or not lines:
            return {}, f"the burn-in process exited {done.returncode}: {done.stderr.strip()[-400:]}"
        try:
            result = json.loads(lines[-1])
        except ValueError as e:
            return {}, f"the burn-in printed no result ({e})"
        if not isinstance(result, dict):
            return {}, f"the burn-in printed {lines[-1][:80]!r}, not its numbers"
        return result, None
