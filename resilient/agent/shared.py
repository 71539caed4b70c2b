"""The facts every node of a launch must agree on, read and written through the control store.

Each key here changes the run, so each carries a token proof
(:class:`~resilient.coord.proof.SignedStore`) and lives under the launch
(``launch/<id>/``, see :mod:`resilient.coord.launch`):

* ``verdict``: why the launch stopped, published once by the node that decided;
* ``stop``: the step at which every worker commits and exits (graceful stop);
* ``stop_request``: ``resilient stop --store`` asking the agents for a graceful stop;
* ``restarts/<generation>``: one record per failed generation, whichever node
  writes it first, so the restart budget is global;
* ``detectors``: detector settings changed on the running job through the
  store (``resilient detectors --store``): every change so far, merged, with
  a sequence number; each agent applies a sequence it has not applied yet;

* ``stragglers``: the standing straggler flags of every node, written by
  the launch's scorer (the agent whose node holds rank 0) when they change;
* ``scorer``: which node scores, and where its timing link listens
  (:mod:`resilient.agent.timing_link`), written when a node becomes the
  scorer: the others send it their windows directly;

and, outside the launch's prefix, ``timing/<launch>/<node>``: the newest
timing windows of a node's ranks, written only when they cannot go to the
scorer's timing link (no scorer announced yet, a record too large for a
datagram).  Only the scorer follows them (a watch of its own, opened while it
scores).

Across machines the facts polled by the watch loop (verdict, stop, stop
request, detector changes, whether the launch ended, the restarts used for
status) are read from the agent's watch of the run's launches
(:class:`~resilient.coord.watch.PrefixWatch`), which costs the store
nothing while nothing changes; while that watch is not following (not
started, or an outage broke it) they are read from the store.  What a
decision needs (the restart history) is always read from the store.

With ``budget_scope="run"`` the restart records of earlier launches count
too; the crash-loop count is always this launch's (a resubmission is a new
attempt at the cause, and a crash loop is about the current one).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, Literal

from ..coord import keyspace
from ..coord.keyspace import LaunchKeys
from ..coord.launch import current_launch, end_launch, record_of
from ..coord.proof import SignedStore
from ..coord.watch import PrefixWatch
from .policy import FailureMark, History

BudgetScope = Literal["launch", "run"]


class SharedFacts:
    """One launch's shared facts, as this node reads and writes them."""

    def __init__(self, signed: SignedStore, launch_id: str, node_id: str, budget_scope: BudgetScope = "launch",
                 watch: PrefixWatch | None = None, root: str = "",
                 timing_watch: Callable[[], PrefixWatch] | None = None) -> None:
        """``watch``: a watch of every launch of the run and the run's launch record (the launch record's key as
        a prefix, under ``root``, the control store's prefix); ``timing_watch``: opens a started watch of the
        launches' timing windows (for the scorer, when it first reads them)."""
        self.signed = signed
        self.launch_id = launch_id
        self.keys = LaunchKeys(launch_id)
        self._node = node_id
        self._scope = budget_scope
        self._watch = watch
        self._root = root
        self._open_timing = timing_watch
        self._timing_watch: PrefixWatch | None = None

    def _watched(self, key: str) -> tuple[bool, dict[str, Any] | None]:
        """``(True, verified value or None)`` from the watch while it follows the store; ``(False, None)`` when
        the store must be read instead."""
        if self._watch is None or not self._watch.fresh:
            return False, None
        entry = self._watch.view().entries.get(self._root + key)
        if entry is None:
            return True, None
        return True, self.signed.verified([replace(entry, key=key)]).get(key)

    def _verified_in(self, watch: PrefixWatch, keep: Callable[[str], bool]) -> dict[str, dict[str, Any]]:
        """Verified values of the keys (as in the control store) of ``watch``'s copy that ``keep`` accepts."""
        cut = len(self._root)
        return self.signed.verified(replace(e, key=k[cut:]) for k, e in watch.view().entries.items()
                                    if keep(k[cut:]))

    def _get(self, key: str) -> dict[str, Any] | None:
        watched, value = self._watched(key)
        return value if watched else self.signed.get(key)

    def verdict(self, *, read: bool = False) -> dict[str, Any] | None:
        """The launch's verdict (verified), or ``None``; ``read``: from the store, not the watch's copy."""
        key = self.keys.verdict()
        return self.signed.get(key) if read else self._get(key)

    def publish_verdict(self, verdict: str, reason: str, exit_code: int) -> None:
        """Publish a stop verdict (a peer's earlier one stays) and mark the launch ended."""
        record = {"verdict": verdict, "reason": reason, "exit_code": exit_code, "node": self._node}
        self.signed.put_if_absent(self.keys.verdict(), record)
        self.end(f"verdict {verdict}")

    def stop(self) -> dict[str, Any] | None:
        """The agreed graceful stop ``{stop_at_step, reason, node}``, or ``None``."""
        return self._get(self.keys.stop())

    def propose_stop(self, stop_at_step: int, reason: str) -> int:
        """Propose a stop step; returns the agreed one (a peer's earlier proposal wins)."""
        record = {"stop_at_step": stop_at_step, "reason": reason, "node": self._node}
        _, agreed = self.signed.put_if_absent(self.keys.stop(), record)
        return int(agreed["stop_at_step"])

    def stop_request(self) -> dict[str, Any] | None:
        """A request from ``resilient stop --store`` (verified), or ``None``."""
        return self._get(self.keys.stop_request())

    def detectors(self) -> dict[str, Any] | None:
        """Detector changes requested through the store ``{seq, changes, by}`` (verified), or ``None``."""
        return self._get(self.keys.detectors())

    def publish_timing(self, record: dict[str, Any]) -> None:
        """This node's newest timing windows (:meth:`~resilient.agent.slowness.SlownessWatch.outbox`)."""
        self.signed.put(self.keys.timing(self._node), record)

    def timing(self) -> list[dict[str, Any]]:
        """Every node's newest timing windows (verified), this node's included: the scorer's read, from a watch
        opened at the first call (:meth:`stop_timing` closes it)."""
        under = self.keys.timings()
        if self._timing_watch is None and self._open_timing is not None:
            self._timing_watch = self._open_timing()
        if self._timing_watch is None or not self._timing_watch.fresh:
            return list(self.signed.get_prefix(under).values())
        return list(self._verified_in(self._timing_watch, lambda key: key.startswith(under)).values())

    def stop_timing(self) -> None:
        """This agent no longer scores: stop following the windows."""
        watch, self._timing_watch = self._timing_watch, None
        if watch is not None:
            watch.close()

    def scorer(self) -> dict[str, Any] | None:
        """The node that scores stragglers now and its timing link ``{node, address, generation}``, or ``None``."""
        return self._get(self.keys.scorer())

    def announce_scorer(self, address: str, generation: int) -> None:
        """This node scores stragglers from ``generation`` on; its timing link listens at ``address``."""
        self.signed.put(self.keys.scorer(), {"node": self._node, "address": address, "generation": generation})

    def publish_stragglers(self, record: dict[str, Any]) -> None:
        """The scorer's standing flags of every node (:meth:`~resilient.agent.slowness.SlownessWatch.flags_out`)."""
        self.signed.put(self.keys.stragglers(), record)

    def stragglers(self) -> dict[str, Any] | None:
        """The scorer's newest flags record (verified), or ``None``."""
        return self._get(self.keys.stragglers())

    def ended(self, *, read: bool = False) -> bool:
        """This launch is over: marked ended, or another launch of the run replaced it.  ``read``: from the
        store, not the watch's copy (which a node cut off the network for a while may hold stale, its watch
        not yet caught up, when a fresh read already found the launch's rendezvous closed)."""
        watched, value = (False, None) if read else self._watched(keyspace.LAUNCH)
        record = record_of(value) if watched else current_launch(self.signed)
        return record is None or record.id != self.launch_id or record.state == "ended"

    def end(self, reason: str) -> None:
        """Mark the launch ended, so that the next submission of the run id starts a new one."""
        end_launch(self.signed, self.launch_id, reason)

    # -- the restart budget ---------------------------------------------------
    def _records(self, scope: BudgetScope) -> list[dict[str, Any]]:
        if scope == "launch":
            return list(self.signed.get_prefix(self.keys.restarts()).values())
        return list(self.signed.get_prefix(keyspace.LAUNCHES, only=keyspace.is_restart).values())

    def restarts_used(self) -> int:
        """Restarts counted against the budget (this launch's, or the run's with ``budget_scope="run"``), for
        status: from the watch when it follows the store (a record written a moment ago may not be in yet)."""
        if self._watch is None or not self._watch.fresh:
            return len(self._records(self._scope))
        under = self.keys.restarts()
        counted = (lambda key: key.startswith(under)) if self._scope == "launch" else keyspace.is_restart
        return len(self._verified_in(self._watch, counted))

    def history(self, committed_step: int | None, exclude_generation: int | None = None) -> History:
        """The global restart history: every node reads the same records.

        The record of ``exclude_generation`` (a peer may already have counted
        the failure being decided) is left out, so every node decides alike.
        """
        def keep(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
            return [r for r in records if r.get("generation") != exclude_generation]

        used = keep(self._records(self._scope))
        here = used if self._scope == "launch" else keep(self._records("launch"))
        since = sorted((r for r in here if r.get("committed_step") == committed_step),
                       key=lambda r: r.get("generation") or 0)
        return History(restarts_used=len(used), restarts_since_progress=len(since),
                       newest_committed_step=committed_step,
                       marks=tuple(FailureMark.from_record(r.get("failure")) for r in since))

    def restarted(self, generation: int) -> dict[str, Any] | None:
        """The restart record of ``generation``, once a node counted one (its nodes meet again in a rendezvous)."""
        return self._get(self.keys.restart(generation))

    def take_place(self, generation: int, slot: int) -> bool:
        """Claim place ``slot`` of the nodes lost before the restart after ``generation`` for this node (a spare
        node taking it in the restart's rendezvous): True for the one node that holds it."""
        _, holder = self.signed.put_if_absent(self.keys.place(generation, slot), {"node": self._node})
        return holder.get("node") == self._node

    def count_restart(self, generation: int, reason: str, committed_step: int | None,
                      failure: FailureMark | None = None) -> None:
        """Record one restart for ``generation`` after ``failure``, once for all nodes (the first writer wins)."""
        record = {"generation": generation, "node": self._node, "reason": reason, "committed_step": committed_step,
                  "launch": self.launch_id, "failure": None if failure is None else failure.to_record()}
        self.signed.put_if_absent(self.keys.restart(generation), record)
