"""Node quarantine: a fleet's record of the nodes kept out of every run, with a memory of past offences.

A node that straggles persistently, fails a health check or is put there by
an operator gets a record under ``/resilient-fleet/<fleet>/quarantine/<node>``
in etcd: the reason, the evidence, who put it there, its offence number and
its expiry.  The record lives on an etcd lease of ``expiry_s`` seconds, so it
lapses on etcd's clock alone (no wall clocks are compared across hosts);
``release`` revokes the lease at once.  The count of offences lives beside it
without a lease (``offences/<node>``) and outlives every record and every
run, so a node quarantined again gets twice the expiry it got last time
(:func:`decide_expiry`): a flapping node stays out longer each time.
Burn-in results (``burn_in/<node>``, :mod:`resilient.watchdog.burnin`) are
kept here too: they are the fleet's numbers a returning node is judged by.

The fleet is not a run: its keys are outside every ``/resilient/<run_id>/``
and are not signed with a run token; who may write them is etcd's access
control (a role with write access to ``/resilient-fleet/``).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from ..core.errors import ConfigError
from .keyspace import FleetKeys, check_name
from .txn import Txn

if TYPE_CHECKING:
    from collections.abc import Mapping

    from .etcd import EtcdClient
    from .store import Entry

@dataclass(frozen=True, kw_only=True)
class QuarantineConfig:
    """When a node is quarantined, for how long, and what its burn-in must show to come back."""

    fleet: str = "default"
    """The fleet whose records this node obeys and writes (nodes that share hardware share a fleet)."""
    expiry_s: float = 600.0
    """How long a first offence keeps a node out; each later offence doubles it."""
    max_expiry_s: float = 7 * 86400.0
    """The longest any offence keeps a node out."""
    straggler_windows: int = 60
    """A straggler flag on this node standing this many windows (5 steps each) quarantines the node; 0: never."""
    burn_in_min_ratio: float = 0.7
    """A burn-in passes when every measure is at least this share of the fleet's median for it."""
    burn_in_at_start: bool = False
    """Run a burn-in before the first rendezvous too (a new node proves itself, and the fleet gets numbers)."""

    def __post_init__(self) -> None:
        check_name("fleet name", self.fleet)
        for name in ("expiry_s", "max_expiry_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 1):
                raise ConfigError(f"QuarantineConfig.{name}={value!r} must be at least 1 second")
        if self.max_expiry_s < self.expiry_s:
            raise ConfigError(f"QuarantineConfig.max_expiry_s={self.max_expiry_s} is below expiry_s={self.expiry_s}")
        if isinstance(self.straggler_windows, bool) or not isinstance(self.straggler_windows, int) \
                or self.straggler_windows < 0:
            raise ConfigError(f"QuarantineConfig.straggler_windows={self.straggler_windows!r} must be an int >= 0 "
                              "(0: a straggler never quarantines its node)")
        if not 0 < self.burn_in_min_ratio <= 1:
            raise ConfigError(f"QuarantineConfig.burn_in_min_ratio={self.burn_in_min_ratio!r} must be in (0, 1]: "
                              "the share of the fleet's median a returning node must reach")


def decide_expiry(offences_before: int, config: QuarantineConfig) -> tuple[float, str]:
    """How long this offence keeps the node out, and why: ``expiry_s`` doubled once per earlier offence."""
    expiry = min(config.expiry_s * 2.0 ** min(max(0, offences_before), 60), config.max_expiry_s)
    if offences_before <= 0:
        return expiry, f"first offence: kept out for {expiry:.0f} s"
    capped = " (the longest allowed)" if expiry >= config.max_expiry_s else ""
    return expiry, (f"offence {offences_before + 1}: kept out for {expiry:.0f} s{capped}, doubled once for each of "
                    f"{offences_before} earlier offence(s)")


@dataclass(frozen=True)
class QuarantineRecord:
    """Why a node is kept out, on what evidence, and for how long."""

    node: str
    reason: str
    source: str
    """What put it there: ``straggler``, ``health``, ``burn_in`` or ``operator``."""
    offence: int
    """1 for the node's first offence in this fleet, 2 for its second, ..."""
    expiry_s: float
    expiry_reason: str
    by: str
    """The node or user that wrote it."""
    evidence: dict[str, Any] = field(default_factory=dict)

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def decode(cls, node: str, raw: bytes) -> QuarantineRecord:
        try:
            d = json.loads(raw)
            return cls(node=node, reason=str(d["reason"]), source=str(d["source"]), offence=int(d["offence"]),
                       expiry_s=float(d["expiry_s"]), expiry_reason=str(d.get("expiry_reason", "")),
                       by=str(d.get("by", "")), evidence=dict(d.get("evidence") or {}))
        except (ValueError, KeyError, TypeError) as e:
            # A record nobody can read still keeps the node out: an operator releases it.
            return cls(node=node, reason=f"unreadable quarantine record ({type(e).__name__}: {e})", source="unknown",
                       offence=0, expiry_s=0.0, expiry_reason="", by="")


@dataclass(frozen=True)
class Standing:
    """A quarantine record in force, with the seconds its lease has left (etcd's clock)."""

    record: QuarantineRecord
    remaining_s: int

    def describe(self) -> str:
        r = self.record
        return (f"node {r.node} is quarantined ({r.source}, offence {r.offence}, {self.remaining_s} s left of "
                f"{r.expiry_s:.0f} s): {r.reason}")


def _count(entry: Entry | None) -> int:
    try:
        return int(json.loads(entry.value)["offences"]) if entry is not None else 0
    except (ValueError, KeyError, TypeError):
        return 0


class FleetQuarantine:
    """The fleet's quarantine records in etcd: add, read, list, release, and the offences and burn-in results."""

    def __init__(self, client: EtcdClient, config: QuarantineConfig | None = None) -> None:
        self.client = client
        self.config = config or QuarantineConfig()
        self.keys = FleetKeys(self.config.fleet)

    def get(self, node: str) -> Standing | None:
        """The node's record in force, or None (never quarantined, lapsed or released)."""
        return self._standing(node, self.client.get(self.keys.quarantine(node)))

    def list(self) -> list[Standing]:
        """Every record in force in the fleet, by node."""
        found = (self._standing(FleetKeys.node_of(e.key), e) for e in self.client.get_prefix(self.keys.quarantined()))
        return [s for s in found if s is not None]

    def _standing(self, node: str, entry: Entry | None) -> Standing | None:
        """The record in ``entry`` if its lease has not run out (etcd deletes the key a moment after)."""
        if entry is None:
            return None
        remaining = self.client.lease_ttl(entry.lease) if entry.lease else 0
        if entry.lease and remaining < 0:
            return None
        return Standing(QuarantineRecord.decode(node, entry.value), max(0, remaining))

    def keys_of(self, node: str) -> tuple[str, str]:
        """The node's quarantine record and offence count keys (what a watch of the node follows)."""
        return self.keys.quarantine(node), self.keys.offences_of(node)

    def standing_in(self, node: str, entries: Mapping[str, Entry]) -> Standing | None:
        """:meth:`get` from a watch's copy of the record's key (no request unless a record stands: its lease's
        time left is read)."""
        return self._standing(node, entries.get(self.keys_of(node)[0]))

    def standing_and_offences(self, node: str) -> tuple[Standing | None, int]:
        """:meth:`get` and :meth:`offences` together, in one request (a read-only transaction, one revision)."""
        keys = self.keys_of(node)
        found = self.client.txn(Txn((), (), read=keys)).entries
        return self._standing(node, found[keys[0]]), _count(found[keys[1]])

    def offences(self, node: str) -> int:
        """How many times the node was quarantined in this fleet (kept across runs and releases)."""
        return _count(self.client.get(self.keys.offences_of(node)))

    def all_offences(self) -> dict[str, int]:
        """Every node with an offence on record in this fleet, with its count."""
        return {FleetKeys.node_of(e.key): _count(e) for e in self.client.get_prefix(self.keys.offences())}

    def add(self, node: str, *, reason: str, source: str, by: str,
            evidence: dict[str, Any] | None = None) -> tuple[bool, QuarantineRecord]:
        """Quarantine ``node`` unless a record already stands: ``(True, new record)`` or ``(False, the standing
        one)``.  One offence however many sources see it at once: the record is created only if absent."""
        standing = self.get(node)
        if standing is not None:
            return False, standing.record
        before = self.offences(node)
        expiry, why = decide_expiry(before, self.config)
        record = QuarantineRecord(node=node, reason=reason, source=source, offence=before + 1, expiry_s=expiry,
                                  expiry_reason=why, by=by, evidence=dict(evidence or {}))
        lease = self.client.lease_grant(math.ceil(expiry))
        key = self.keys.quarantine(node)
        for _ in range(3):
            created, entry = self.client.put_if_absent(key, record.encode(), lease=lease)
            if created or not entry.lease or self.client.lease_ttl(entry.lease) >= 0:
                break
            # A lapsed record etcd has not deleted yet (it revokes expired leases a moment later): replace it,
            # or, if etcd deleted it meanwhile, create it again.
            created, current = self.client.compare_and_swap(key, entry.mod_revision, record.encode(), lease=lease)
            if created or current is not None:
                entry = current if current is not None else entry
                break
        if not created:
            self.client.lease_revoke(lease)
            return False, QuarantineRecord.decode(node, entry.value)
        self._count_offence(node, record)
        return True, record

    def _count_offence(self, node: str, record: QuarantineRecord) -> None:
        key = self.keys.offences_of(node)
        current = self.client.get(key)
        while True:
            value = json.dumps({"offences": _count(current) + 1, "last": asdict(record)}).encode()
            ok, current = self.client.compare_and_swap(key, 0 if current is None else current.mod_revision, value)
            if ok:
                return

    def release(self, node: str, *, forget: bool = False) -> bool:
        """End the node's record now (it still burns in before it rejoins); ``forget``: its offences too.
        Returns whether a record stood."""
        entry = self.client.get(self.keys.quarantine(node))
        if forget:
            self.client.delete(self.keys.offences_of(node))
        if entry is None:
            return False
        if entry.lease:
            self.client.lease_revoke(entry.lease)
        self.client.delete(self.keys.quarantine(node))
        return True

    def publish_burn_in(self, node: str, result: dict[str, Any]) -> None:
        """Record the node's latest burn-in (the fleet's numbers the next returning node is judged by)."""
        self.client.put(self.keys.burn_in(node), json.dumps(result, sort_keys=True).encode())

    def burn_ins(self) -> dict[str, dict[str, Any]]:
        """Every node's latest burn-in result, by node."""
        out = {}
        for entry in self.client.get_prefix(self.keys.burn_ins()):
            try:
                out[FleetKeys.node_of(entry.key)] = dict(json.loads(entry.value))
            except (ValueError, TypeError):
                continue
        return out
