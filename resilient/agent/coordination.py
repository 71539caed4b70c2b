"""This node's side of the run's control store: the store, the launch it joined, and the launch's rendezvous.

The agent's loop asks; this module talks to the store.  It builds the
control store (``MemoryControlStore`` inside the agent on one machine, etcd
under ``/resilient/<run_id>/`` on many), checks this agent's token against
the run's, agrees on the launch (:mod:`resilient.coord.launch`), keeps this
node's presence key alive, builds the launch's rendezvous, and reads and
writes the launch's shared facts (:class:`~resilient.agent.shared.SharedFacts`:
the restart records, the verdict).  Every write that changes the run goes
through the token's proof (:mod:`resilient.coord.proof`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..coord import keyspace
from ..coord.keyspace import LaunchKeys, run_root
from ..coord.launch import begin_launch
from ..coord.proof import Seal, SignedStore
from ..coord.store import ControlStoreError
from ..core.events import Emit, EventKind
from ..core.supervised import ThreadReports
from .config import AgentConfig
from .policy import FailureMark, History
from .rendezvous import EtcdRendezvous, OneNodeRendezvous, etcd_rendezvous
from .rundir import RunDir
from .shared import SharedFacts
from .timing_link import PUBLISHED_AS as TIMING_AS
from .timing_link import TimingLink

if TYPE_CHECKING:
    from .quarantine_gate import QuarantineGate

FORGED_EVENTS = 20
"""``forged_key`` events an agent gives in a minute at most; the ones past it are counted in the next."""
_OUTAGE_KINDS = {"start": EventKind.STORE_OUTAGE_START, "end": EventKind.STORE_OUTAGE_END}
"""The etcd client's ``on_outage(event, detail)`` events, as event kinds."""


class Coordination:
    """The control store as this node's agent uses it: launch, presence, rendezvous, restart budget, verdict."""

    def __init__(self, config: AgentConfig, run_dir: RunDir, token: str, *, emit: Emit,
                 on_node_lost: Callable[[str, str], None],
                 on_thread_failed: Callable[[str, str], None] = lambda _name, _error: None) -> None:
        """``on_thread_failed(name, error)``: one of the agent's supervised threads kept raising (after its
        ``agent_thread_failed`` event): the agent stops."""
        self._config = config
        self._on_thread_failed = on_thread_failed
        self.threads = ThreadReports(self._thread_crashed, self._thread_failed)
        """Where the agent's supervised threads report (:mod:`resilient.core.supervised`)."""
        self._run_dir = run_dir
        self._emit = emit
        self._on_node_lost = on_node_lost
        self.control = self._control_store()
        self._forged_lock = threading.Lock()
        self._forged_since, self._forged_said, self._forged_unsaid = -float("inf"), 0, 0
        self.signed = SignedStore(self.control, token, on_rejected=self._on_rejected_write)
        self.seal = Seal(token, run_root(config.run_id), on_rejected=self._on_rejected_write)
        """Signs and checks the values under the run's etcd keys that are written outside :attr:`signed` (the
        rendezvous rounds, the presence keys)."""
        self._token = token
        self.shared: SharedFacts | None = None
        """This launch's shared facts; set once the agent has joined a launch."""
        self.rendezvous: EtcdRendezvous | OneNodeRendezvous | None = None
        self._presence: Any = None
        self.launch_watch: Any = None
        """Across machines: the agent's watch of the run's launches (:class:`~resilient.coord.watch.PrefixWatch`)."""
        self.timing_watch: Any = None
        """Across machines, while this agent scores stragglers: its watch of the nodes' timing windows (those that
        could not come by :attr:`timing_link`)."""
        self.timing_link: TimingLink | None = None
        """Across machines: where this agent sends its timing windows from and, as the scorer, receives every node's
        (:mod:`resilient.agent.timing_link`); its address is published in the presence key."""
        self._launch_retried = False
        self.presence_extra: dict[str, str] = {}
        """More addresses this agent serves, published in its presence key (its memory tier's, for one)."""
        if config.multi_node:
            self.timing_link = TimingLink(config.local_addr, token, self._on_rejected_write, self.threads)
            self.presence_extra[TIMING_AS] = self.timing_link.address
        self.restarts_used_cached = 0
        """The restart count last read from the store (for readers that must not do I/O)."""

    def _control_store(self) -> Any:
        if self._config.store_url is None:
            from ..coord.store import MemoryControlStore

            return MemoryControlStore()
        from ..coord.etcd import EtcdClient, EtcdConfig, EtcdControlStore

        etcd = EtcdConfig.from_url(self._config.store_url, **self._config.etcd_options)  # type: ignore[arg-type]
        self._etcd_config = etcd

        def on_outage(event: str, detail: str) -> None:
            self._emit(_OUTAGE_KINDS[event], detail=detail)

        client = EtcdClient(etcd, on_outage=on_outage)
        self._etcd_client = client
        return EtcdControlStore(client, run_root(self._config.run_id))

    def _on_rejected_write(self, key: str, problem: str) -> None:
        """A forged or altered entry was ignored: a ``forged_key`` event, at most :data:`FORGED_EVENTS` a minute
        (a writer flooding etcd with forgeries must not flood the event log too); the next event after a full
        minute says how many were ignored without one."""
        now = time.monotonic()
        with self._forged_lock:
            if now - self._forged_since >= 60.0:
                self._forged_since, self._forged_said = now, 0
            if self._forged_said >= FORGED_EVENTS:
                self._forged_unsaid += 1
                return
            self._forged_said += 1
            unsaid, self._forged_unsaid = self._forged_unsaid, 0
        self._emit(EventKind.FORGED_KEY, key=key, problem=problem, unsaid=unsaid,
                   hint="only holders of the run token may change the run; this entry is ignored. Something with "
                        "write access to etcd wrote it: lock etcd down (authentication, TLS, a network policy)")

    def next_generation(self) -> int:
        """Move the run's generation counter on by one and return it (a generation formed in process on this
        node, no round): signed in etcd, as the rounds and decisions write it; a forged counter counts from the
        launch's current generation."""
        if self._config.store_url is None:
            return int(self.control.add(keyspace.GENERATION, 1))
        while True:
            entry, value = self.signed.get_entry(keyspace.GENERATION)
            base = int(value["generation"]) if value is not None else (0 if entry is None else self._current())
            revision = entry.mod_revision if entry is not None else 0
            done, _ = self.signed.compare_and_swap(keyspace.GENERATION, revision, {"generation": base + 1})
            if done:
                return base + 1

    def _current(self) -> int:
        """The launch's current generation as its signed recovery key says (0: none yet)."""
        if self.shared is None:
            return 0
        found = self.signed.get(self.shared.keys.current())
        return int(found["generation"]) if found is not None else 0

    def _probed(self, node: str, up: bool, why: str) -> None:
        if up:
            self._emit(EventKind.PEER_ANSWERS_AGAIN, peer=node)
        else:
            self._emit(EventKind.PEER_UNANSWERED, peer=node, why=why)

    def _store_unreachable(self, error: str) -> None:
        self._emit(EventKind.STORE_UNREACHABLE, error=error)

    def _thread_crashed(self, name: str, error: str, trace: str) -> None:
        self._emit(EventKind.THREAD_RESTARTED, thread=name, error=error, traceback=trace[-4000:],
                   hint="the thread started again; a bug in the agent: report it with this trace")

    def _thread_failed(self, name: str, error: str) -> None:
        self._emit(EventKind.AGENT_THREAD_FAILED, thread=name, error=error,
                   hint="the agent stops the run gracefully (a checkpoint first): resubmit it, and report the "
                        "thread_restarted events' traces")
        self._on_thread_failed(name, error)

    def _watch_crashed(self, error: str, trace: str) -> None:
        self._emit(EventKind.WATCH_RESTARTED, error=error, traceback=trace[-4000:],
                   hint="the watch read its keys again and follows on; a bug in the agent: report it with this trace")

    # ------------------------------------------------------------ the launch
    def join_launch(self) -> str | None:
        """Check the token against the run's and agree on the launch; returns a problem, or None."""
        c = self._config
        problem = self.signed.check_fingerprint()
        if problem is not None:
            token_file = c.token_file or self._run_dir.token_file
            return (f"{problem}: {token_file} does not match the token the run's first agent published. Copy "
                    "<run_dir>/token from that node to every node (or pass --token-file FILE with it); if no "
                    f"agent of run {c.run_id} holds that token any more, delete key "
                    f"{run_root(c.run_id)}{keyspace.TOKEN_FINGERPRINT}")
        decision = begin_launch(self.signed, c.launch_id)
        root = run_root(c.run_id)
        if c.store_url is not None and self.launch_watch is None:
            from ..coord.watch import PrefixWatch

            # Every launch of the run and the run's launch record, followed for the agent's life: the shared
            # facts, the presence of the nodes and the recovery keys are read from it, not polled.
            self.launch_watch = PrefixWatch(self._etcd_client, root + keyspace.LAUNCH, on_error=self._store_unreachable,
                                            on_crash=self._watch_crashed)
            self.launch_watch.start()
        self.shared = SharedFacts(self.signed, decision.launch_id, c.node_id, c.restart.budget_scope,
                                  watch=self.launch_watch, root=root,
                                  timing_watch=self._open_timing_watch if c.store_url is not None else None)
        self._emit(EventKind.LAUNCH_JOINED, launch_id=decision.launch_id, action=decision.action,
                   reason=decision.reason)
        if c.store_url is not None:
            from ..coord.presence import Presence

            assert self.launch_watch is not None
            self._presence = Presence(self._etcd_client, LaunchKeys(decision.launch_id, root), c.node_id,
                                      self._on_node_lost, self._store_unreachable, watch=self.launch_watch,
                                      probe_host=c.local_addr, on_probe=self._probed, extra=self.presence_extra,
                                      silence_s=c.node_silence_s, seal=self.seal,
                                      on_crash=self.threads.crashed, on_fatal=self.threads.failed)
            self._presence.start()
        return None

    def _open_timing_watch(self) -> Any:
        """The nodes' timing windows, for this agent while it scores them: they change every second on every
        node, so they have a watch of their own, kept out of the launch's (which every reader of the launch's
        facts would otherwise be woken by), and only the scorer opens it."""
        from ..coord.watch import PrefixWatch

        self.timing_watch = PrefixWatch(self._etcd_client, run_root(self._config.run_id) + keyspace.TIMING,
                                        on_error=self._store_unreachable, on_crash=self._watch_crashed).start()
        return self.timing_watch

    def make_rendezvous(self) -> EtcdRendezvous | OneNodeRendezvous:
        """Build the rendezvous of the joined launch (this node alone on one machine)."""
        c = self._config
        if c.store_url is None:
            self.rendezvous = OneNodeRendezvous(self.control, c.local_addr)
        else:
            assert self.shared is not None and self._presence is not None, "join a launch before its rendezvous"
            presence = self._presence
            self.rendezvous = etcd_rendezvous(self._etcd_client, c.run_id, self.shared.launch_id, c.node_id,
                                              c.local_addr, min_nodes=c.min_nodes, max_nodes=c.max_nodes,
                                              timeouts=c.rendezvous, lease=lambda: presence.lease,
                                              live=presence.live, on_error=self._store_unreachable,
                                              on_crash=self._watch_crashed, seal=self.seal, floor=self._current,
                                              renew_lease=presence.renew)
        return self.rendezvous

    def leave_rendezvous(self) -> None:
        """Step out of the launch's rendezvous without closing it (this node is kept out for a while): the
        others form their next rounds without this node, and a fresh rendezvous is ready for the round it joins
        when it comes back."""
        if self.rendezvous is not None:
            self.rendezvous.leave()
        self.make_rendezvous()

    def published(self, node: str, name: str) -> str | None:
        """What a running peer's agent published as ``name`` in its presence key (see :attr:`presence_extra`)."""
        return self._presence.published(node, name) if self._presence is not None else None

    def live(self) -> frozenset[str]:
        """The nodes judged alive now; this one alone without a store across machines."""
        return self._presence.live() if self._presence is not None else frozenset({self._config.node_id})

    def peer_host(self, node: str) -> str | None:
        """The address a peer's agent published (where its workers' connections go), if it published one."""
        return self._presence.address_of(node) if self._presence is not None else None

    def cluster_store(self) -> Any:
        """The joined launch's recovery keys (:class:`~resilient.agent.cluster.ClusterStore`), across machines."""
        from .cluster import ClusterStore

        assert self.shared is not None and self._config.store_url is not None
        presence = self._presence
        return ClusterStore(self.signed, self._etcd_client, run_root(self._config.run_id), self.shared.keys,
                            self._config.node_id, self._token,
                            lease=(lambda: presence.lease) if presence is not None else None,
                            live=presence.live if presence is not None else None, watch=self.launch_watch)

    def quarantine_gate(self, scratch: Path, set_phase: Callable[[str], None]) -> QuarantineGate | None:
        """Across machines, this node's side of the fleet's quarantine; None on one machine (no other node could
        stand in for this one, so keeping it out would stop the run)."""
        c = self._config
        if c.store_url is None:
            return None
        from ..coord.quarantine import FleetQuarantine
        from .quarantine_gate import QuarantineGate

        return QuarantineGate(FleetQuarantine(self._etcd_client, c.quarantine), c.node_id, scratch, c.local_addr,
                              self._emit, set_phase=set_phase, burn_in_argv=c.burn_in_argv)

    def stale_launch(self, generation: int) -> bool:
        """The joined launch's rendezvous was closed before this agent ran anything in it: the launch is over.

        A submission that ended without marking its launch (SIGINT, a node that stepped out) leaves a
        closed rendezvous behind; the next submission then ends that launch and starts a new one, once.
        Returns whether a new launch (and its rendezvous) is ready to try.
        """
        if generation != 0 or self._launch_retried or self._config.launch_id is not None or self.shared is None:
            return False
        self._launch_retried = True
        self.shared.end("its rendezvous was closed")
        self.shared.stop_timing()
        if self.rendezvous is not None:
            self.rendezvous.shutdown()
        if self._presence is not None:
            self._presence.leave()
        if self.join_launch() is not None:
            return False
        self.make_rendezvous()
        return True

    def end_launch(self, why: str) -> None:
        """The run as a whole ended (every node ends alike): the next submission starts a new launch."""
        if self.shared is None:
            return
        try:
            self.shared.end(why)
        except ControlStoreError as e:
            self._emit(EventKind.STORE_UNREACHABLE, error=f"{type(e).__name__}: {e}")

    def close(self, *, leave_run_open: bool = False) -> None:
        """Leave the rendezvous and mark this node as left (not lost).  ``leave_run_open``: the run goes on
        without this node, so its rendezvous is left open for the others (a shutdown closes it for all)."""
        if self.rendezvous is not None:
            if leave_run_open:
                self.rendezvous.leave()
            else:
                self.rendezvous.shutdown()
        if self._presence is not None:
            self._presence.leave()
        if self.shared is not None:
            self.shared.stop_timing()
        if self.launch_watch is not None:
            self.launch_watch.close()
        if self.timing_link is not None:
            self.timing_link.close()

    # ------------------------------------------------------------ shared facts
    def restarts_used(self) -> int:
        """Restarts counted against the budget, read from the store (and cached)."""
        if self.shared is not None:
            self.restarts_used_cached = self.shared.restarts_used()
        return self.restarts_used_cached

    def history(self, committed_step: int | None, exclude_generation: int | None = None) -> History:
        assert self.shared is not None
        return self.shared.history(committed_step, exclude_generation)

    def count_restart(self, generation: int, reason: str, committed_step: int | None,
                      failure: FailureMark | None = None) -> None:
        assert self.shared is not None
        self.shared.count_restart(generation, reason, committed_step, failure)

    def publish_verdict(self, verdict: str, reason: str, exit_code: int) -> None:
        """Tell every node the launch stops, and close the rendezvous so that none waits in it."""
        assert self.shared is not None
        self.shared.publish_verdict(verdict, reason, exit_code)
        if self.rendezvous is not None:
            try:
                self.rendezvous.close()
            except Exception as e:  # the verdict key still tells the other nodes
                self._emit(EventKind.RENDEZVOUS_CLOSE_FAILED, error=f"{type(e).__name__}: {e}")

    def run_over(self) -> tuple[int, str, str] | None:
        """How a node held out of the run ends when it need not wait any longer (exit code, verdict, reason): the
        launch's verdict, or success when the launch ended without it."""
        if self.shared is None:
            return None
        # Read, not the watch's copies: a node that was cut off may hold them stale while a fresh read already
        # found the rendezvous closed.
        verdict = self.shared.verdict(read=True)
        if verdict is not None:
            return verdict["exit_code"], verdict["verdict"], verdict["reason"]
        if self.shared.ended(read=True):
            return 0, "succeeded", "the run ended while this node was held out"
        return None

    def verdict(self) -> dict[str, Any] | None:
        """The launch's verdict, if a node published one."""
        return self.shared.verdict() if self.shared is not None else None
