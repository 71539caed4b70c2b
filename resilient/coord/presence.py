"""Presence: each agent of a launch keeps a key alive on a lease, probes a few peers, and says which are lost.

An agent writes ``<launch>nodes/<node>`` = ``{"state": "running", "probe":
"host:port"}`` attached to an etcd lease of ``ttl_s`` seconds and renews
the lease every ``interval_s``; an agent that ends normally first rewrites
its key as ``{"state": "left"}`` without a lease, so leaving is never
mistaken for being lost.  The lease is the slow signal (a dead agent's
key lapses ``ttl_s`` later).  The fast one is the probes
(:mod:`resilient.coord.liveness`): the agent answers probes on its probe
address, pings the next few nodes of the ring, and writes an accusation
(``suspect/<node>/<me>``) for a peer that stops answering, or a vouch
(``vouch/<node>/<me>``) for one that answers while its key is gone.  Every
agent follows those keys through its etcd watch (no request while nothing
changes) and applies :func:`~resilient.coord.liveness.judge` to them: a
node that was alive and is judged lost is reported once.  Each of these
values is signed with the run token (:class:`~resilient.coord.proof.Seal`):
a forged presence key, accusation or vouch is reported and counts for
nothing, so no writer without the token can get a live node judged lost or
point the probes elsewhere.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from ..core.supervised import CrashCallback, FatalCallback, Supervised, quiet
from .etcd import EtcdClient
from .keyspace import LaunchKeys
from .liveness import INTERVAL_S, PROBERS, SILENCE_S, Evidence, Prober, ProbeServer, Verdict, judge, ring_after
from .proof import Seal
from .store import ControlStoreError
from .watch import PrefixWatch

TTL_S = 9
"""The presence lease's time to live, renewed every third of it (one request per agent every 3 s, its only
steady request): the slow signal, for a node nobody can probe; a node whose agent died is found by the probes."""
LEASE_GRACE_S = 2.0
"""A node whose key lapsed is taken for lost by the lease only this long after (its vouches may be on the way)."""


class Presence:
    """Keeps this node's presence key alive and its probes running, and reports peers judged lost."""

    def __init__(self, client: EtcdClient, keys: LaunchKeys, node: str, on_lost: Callable[[str, str], None],
                 on_error: Callable[[str], None], *, watch: PrefixWatch, ttl_s: int = TTL_S,
                 interval_s: float | None = None, probe_host: str | None = None, probe_interval_s: float = INTERVAL_S,
                 silence_s: float = SILENCE_S, on_probe: Callable[[str, bool, str], None] | None = None,
                 extra: Mapping[str, str] | None = None, seal: Seal, on_crash: CrashCallback = quiet,
                 on_fatal: FatalCallback = quiet) -> None:
        """``keys``: the launch's keys, under the run's root (the presence keys, accusations and vouches are
        among them).  ``watch``: a started watch of a prefix that holds ``keys.prefix`` (the agent's, shared with
        its other readers).
        ``probe_host``: the address this agent answers probes on (None: presence by lease alone).
        ``on_lost(node, why)``; ``on_probe(node, up, why)``: this agent's probes of a peer failed (it accuses
        it) or are answered again.  ``extra``: more addresses this agent serves, published in its key
        (:meth:`published` reads a peer's).  ``seal``: signs this agent's keys with the run token and checks
        its peers' (a presence key, accusation or vouch written without the token counts for nothing).
        ``on_crash``, ``on_fatal``: its threads' unexpected errors (:mod:`resilient.core.supervised`): a thread
        that raised starts again; one that keeps raising is not, and ``on_fatal`` says so."""
        interval_s = ttl_s / 3 if interval_s is None else interval_s
        if ttl_s < 2 or not 0 < interval_s < ttl_s:
            raise ValueError(f"presence needs ttl_s >= 2 and 0 < interval_s < ttl_s, got {ttl_s}, {interval_s}")
        self._client = client
        self._seal = seal
        self._launch = keys
        self._node = node
        self._on_lost = on_lost
        self._on_error = on_error
        self._on_probe = on_probe
        self._ttl = ttl_s
        self._interval = interval_s
        self._lease = 0
        self._judging = threading.Lock()
        self._serial = threading.Lock()
        self._verdict = Verdict(frozenset({node}), {}, frozenset({node}))
        self._alive_once: set[str] = set()
        self._gone_since: dict[str, float] = {}
        self._reported: set[str] = set()
        self._addresses: dict[str, str] = {}
        self._extra = dict(extra or {})
        self._published: dict[str, dict[str, str]] = {}
        self._parsed: dict[str, tuple[int, str, str | None, dict[str, str]]] = {}
        """Each presence key as last parsed: (revision, state, probe address); judged under ``_serial``."""
        self._keys = threading.Lock()
        self._renewing = threading.Lock()
        """Held while the lease is renewed or replaced (the presence thread, or :meth:`renew` for a caller)."""
        self._desired: dict[str, bytes] = {}
        self._written: dict[str, bytes] = {}
        self._watch = watch
        self._server = (ProbeServer(probe_host, node, on_crash=on_crash, on_fatal=on_fatal)
                        if probe_host is not None else None)
        self._prober = (Prober(node, self._probed, interval_s=probe_interval_s, silence_s=silence_s,
                               on_crash=on_crash, on_fatal=on_fatal) if probe_host is not None else None)
        self._poke = threading.Event()
        self._done = threading.Event()
        self._thread = Supervised("presence", self._loop, on_crash=on_crash, on_fatal=on_fatal, stop=self._done)

    def start(self) -> None:
        """Answer probes, write the presence key, start following the peers' keys and renewing this one."""
        if self._server is not None:
            self._server.start()
        self._announce()
        keys = self._launch
        self._watch.subscribe(self._judge, under=(keys.nodes(), keys.suspects(), keys.vouches()))
        if self._prober is not None:
            self._prober.start()
        self._judge()
        self._thread.start()

    def renew(self) -> int:
        """Renew this node's lease now, or take a new one and write the presence key again when it expired (a
        long outage or partition outlived it): the lease, alive.  For a caller whose write on the lease etcd
        refused as unknown, as well as for the presence thread."""
        with self._renewing:
            if self._client.lease_keepalive(self._lease) <= 0:
                self._announce()  # our own lease expired: we are back
            return self._lease

    @property
    def lease(self) -> int:
        """The lease this node's presence key lives on (a new one after an outage outlived it)."""
        return self._lease

    @property
    def probe_address(self) -> str | None:
        return self._server.address if self._server is not None else None

    def live(self) -> frozenset[str]:
        """The nodes judged alive now (this one included)."""
        with self._judging:
            return self._verdict.live

    def address_of(self, node: str) -> str | None:
        """The host a peer's agent answers probes on (its address on the network), if it published one."""
        with self._judging:
            found = self._addresses.get(node)
        return found.rpartition(":")[0] if found else None

    def published(self, node: str, name: str) -> str | None:
        """What a running peer published as ``name`` beside its probe address (its ``extra``), if anything."""
        with self._judging:
            return self._published.get(node, {}).get(name)

    def _announce(self) -> None:
        self._lease = self._client.lease_grant(self._ttl)
        value: dict[str, Any] = {"state": "running", **self._extra}
        if self._server is not None:
            value["probe"] = self._server.address
        key = self._launch.node(self._node)
        self._client.put(key, self._seal.seal(key, value), lease=self._lease)
        with self._keys:
            self._written.clear()  # the old lease took them with it

    def _evidence(self) -> tuple[Evidence, frozenset[str], dict[str, str], dict[str, dict[str, str]]]:
        running: set[str] = set()
        left: set[str] = set()
        addresses: dict[str, str] = {}
        suspects: dict[str, set[str]] = {}
        vouches: dict[str, set[str]] = {}
        published: dict[str, dict[str, str]] = {}
        parsed: dict[str, tuple[int, str, str | None, dict[str, str]]] = {}
        keys = self._launch
        for key, entry in self._watch.view().under(keys.prefix).items():
            name = keys.node_of(key)
            if name is not None:
                known = self._parsed.get(key)
                if known is None or known[0] != entry.mod_revision:
                    value = self._seal.open(entry)
                    if value is None:
                        continue  # forged (reported): nobody is present by it
                    known = (entry.mod_revision, str(value.get("state")),
                             str(value["probe"]) if value.get("probe") else None,
                             {str(k): str(v) for k, v in value.items() if k not in ("state", "probe")})
                parsed[key] = known
                _, state, probe, extra = known
                if state == "running":
                    running.add(name)
                    published[name] = extra
                    if probe:
                        addresses[name] = probe
                elif state == "left":
                    left.add(name)
            elif (said := keys.accusation_of(key)) is not None and self._seal.open(entry) is not None:
                kind, target, by = said
                if target and by:
                    (suspects if kind == "suspect" else vouches).setdefault(target, set()).add(by)
        self._parsed = parsed  # the next judgement parses only the keys that changed (a large launch has many)
        evidence = Evidence(frozenset(running), {n: frozenset(b) for n, b in suspects.items() if n not in left},
                            {n: frozenset(b) for n, b in vouches.items() if n not in left})
        return evidence, frozenset(left), addresses, published

    def _judge(self) -> None:
        """Weigh the keys as the watch holds them now: report newly lost nodes, choose whom to probe.

        Called by the watch's thread and the presence thread: one at a time, each reading the watch's newest view,
        so a verdict is never replaced by one from an older view."""
        with self._serial:
            newly = self._weigh()
        for node, why in newly:
            try:
                self._on_lost(node, why)
            except Exception as e:  # noqa: BLE001 - one report's failure must not keep the others or the thread
                self._on_error(f"reporting node {node} lost failed: {type(e).__name__}: {e}")

    def _weigh(self) -> list[tuple[str, str]]:
        """The verdict on the newest view; returns the nodes newly lost, with why."""
        evidence, left, addresses, published = self._evidence()
        verdict = judge(evidence, self._node)
        with self._judging:
            self._addresses.update(addresses)
            self._published.update(published)
            # A peer this agent reaches is alive to it while its key is gone (its vouch is on the way), and stays
            # in its ring: it is the one to vouch for it.
            reached = {n for n, up in (self._prober.state() if self._prober is not None else {}).items() if up}
            live = verdict.live | (reached - left - set(verdict.lost))
            self._verdict = Verdict(live, verdict.lost, verdict.known)
            self._alive_once |= live
            # Lost: as judged, or alive before and now neither alive nor gone on purpose for LEASE_GRACE_S (its key
            # lapsed and no live node vouched for it meanwhile; nobody accused it, e.g. nobody could probe it).
            lost = dict(verdict.lost)
            now = time.monotonic()
            gone = self._alive_once - live - left - {self._node} - set(lost)
            if gone - self._gone_since.keys():
                self._poke.set()  # the presence thread waits for its grace to end (it may sleep till a renewal)
            self._gone_since = {n: self._gone_since.get(n, now) for n in gone}
            for node in sorted(gone):
                if now - self._gone_since[node] >= LEASE_GRACE_S:
                    lost[node] = "its presence lease expired and no live node vouches for it"
            newly = [(n, lost[n]) for n in sorted(lost) if n in self._alive_once and n not in self._reported]
            # Reported once until it is alive again (its accusations go with its key, and the lease follows).
            self._reported = {n for n in self._reported | {n for n, _ in newly} if n not in live}
            ring = (verdict.known | reached) - left
            targets = {n: self._addresses[n] for n in ring_after(ring, self._node, PROBERS) if n in self._addresses}
        if self._prober is not None:
            self._prober.follow(targets)
            self._want_keys(evidence, targets)
        return newly

    def _probed(self, node: str, up: bool, why: str) -> None:
        """The prober's news (its thread): the keys are weighed again on the presence thread."""
        self._poke.set()
        if self._on_probe is not None:
            self._on_probe(node, up, why)

    def _want_keys(self, evidence: Evidence, targets: dict[str, str]) -> None:
        """The accusations and vouches this agent should have in the store now: an accusation of each peer it
        probes that does not answer, a vouch for each that answers while its presence key is gone."""
        assert self._prober is not None
        state, down = self._prober.state(), self._prober.down()
        desired: dict[str, bytes] = {}
        with self._keys:
            for node in targets:
                if node in down:
                    key = self._launch.suspect(node, self._node)
                    desired[key] = self._seal.seal(key, {"why": down[node], "at": time.time()})
            for node in targets:
                if state.get(node) is True and node not in evidence.running:
                    key = self._launch.vouch(node, self._node)
                    desired[key] = self._seal.seal(key, {"at": time.time()})
            # A key already written stays as written (its time is when it was first said).
            self._desired = {k: self._written.get(k, v) for k, v in desired.items()}
            changed = self._desired.keys() != self._written.keys()
        if changed:
            self._poke.set()

    def _write_keys(self) -> None:
        with self._keys:
            puts = {k: v for k, v in self._desired.items() if k not in self._written}
            deletes = [k for k in self._written if k not in self._desired]
        for key, value in puts.items():
            self._client.put(key, value, lease=self._lease)
            with self._keys:
                self._written[key] = value
        for key in deletes:
            self._client.delete(key)
            with self._keys:
                self._written.pop(key, None)

    def _loop(self) -> None:
        renew_at = time.monotonic() + self._interval
        while not self._done.is_set():
            now = time.monotonic()
            with self._judging:  # a lapsed key's grace that ends before the next renewal is judged as it ends
                graces = [end for since in self._gone_since.values() if (end := since + LEASE_GRACE_S) > now]
            self._poke.wait(max(0.0, min([renew_at, *graces]) - now))
            self._poke.clear()
            if self._done.is_set():
                break
            try:
                if time.monotonic() >= renew_at:
                    renew_at = time.monotonic() + self._interval
                    self.renew()
                self._judge()  # the prober's news, or a lapsed key's grace running out
                if self._prober is not None:
                    self._write_keys()
            except (ControlStoreError, OSError) as e:  # the store away: renewed and written on the next pass
                self._on_error(f"{type(e).__name__}: {e}")
                self._done.wait(self._interval)  # the keys are written again on the next pass, not in a spin

    def leave(self) -> None:
        """Stop renewing and probing, and mark this node as gone on purpose (once; again does nothing)."""
        if self._done.is_set():
            return
        self._done.set()
        self._poke.set()
        self._watch.unsubscribe(self._judge)
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        if self._prober is not None:
            self._prober.close()
        try:
            key = self._launch.node(self._node)
            self._client.put(key, self._seal.seal(key, {"state": "left"}))
            if self._lease:
                self._client.lease_revoke(self._lease)
        except ControlStoreError as e:
            self._on_error(f"{type(e).__name__}: {e}")
        if self._server is not None:
            self._server.close()
