"""Across machines, the nodes' timing windows go straight to the launch's scorer, not through etcd.

Every node's ranks report timing windows; one agent, the scorer (its node
holds rank 0), scores them all for stragglers
(:mod:`resilient.agent.slowness`).  Written to etcd, each node's newest
windows cost a request a second per node: most of a launch's steady load on
its store.  Instead each agent keeps a :class:`TimingLink`, a UDP socket on
its own address published in its presence key, and sends its newest windows
to the scorer's link as one datagram each time they change; the scorer
announces its link's address once, in the launch's ``scorer`` key.  A
datagram is the same signed record etcd would hold (``timing/<launch>/<node>``
with the run token's proof bound to that key), so a forged or altered one is
dropped and reported as ``forged_key``; a replayed one repeats windows the
scorer has already filed, which it ignores.

A record too large for one datagram, a scorer that has not announced itself,
or a send that fails goes to etcd as before, where the scorer reads it too:
the direct path is an economy, never the only way.
"""

from __future__ import annotations

import json
import socket
import threading
from typing import Any

from ..coord.keyspace import LaunchKeys
from ..coord.proof import RejectCallback, sign, verify
from ..core.supervised import Supervised, ThreadReports

MAX_RECORD = 60_000
"""Bytes of a signed record sent as one datagram; a larger one goes to etcd (an IPv4 UDP payload is at most
65,507 bytes)."""
PUBLISHED_AS = "timing"
"""The name of the link's address in the agent's presence key."""


def timing_key(launch_id: str, node: str) -> str:
    """The key a node's timing record is signed under (and stored under, in etcd)."""
    return LaunchKeys(launch_id).timing(node)


class TimingLink:
    """This agent's UDP socket for timing windows: it sends its own to the scorer and, as the scorer, keeps each
    node's newest verified record of the current launch."""

    def __init__(self, host: str, token: str, on_rejected: RejectCallback, threads: ThreadReports | None = None) -> None:
        """``on_rejected(key, problem)``: a datagram whose proof is wrong (the agent's ``forged_key`` event)."""
        self._token = token
        self._on_rejected = on_rejected
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_DGRAM)
        self._sock.bind((host, 0))
        bound = self._sock.getsockname()
        self.address = f"[{bound[0]}]:{bound[1]}" if family == socket.AF_INET6 else f"{bound[0]}:{bound[1]}"
        self._lock = threading.Lock()
        self._launch: str | None = None
        self._records: dict[str, dict[str, Any]] = {}
        self._forged: set[str] = set()
        self.received = 0
        self.dropped = 0
        self._done = threading.Event()
        self._thread: Supervised = (threads or ThreadReports()).run("timing-link", self._serve, stop=self._done)

    # ------------------------------------------------------------ the scorer's side
    def follow(self, launch_id: str) -> None:
        """Keep records of ``launch_id`` only (a node joined another launch: the older records are dropped)."""
        with self._lock:
            if launch_id != self._launch:
                self._launch, self._records = launch_id, {}

    def records(self) -> list[dict[str, Any]]:
        """Each node's newest record received (verified, of the followed launch)."""
        with self._lock:
            return list(self._records.values())

    def _serve(self) -> None:
        while not self._done.is_set():
            try:
                data = self._sock.recv(65_536)
            except OSError:
                if self._done.is_set():
                    return
                raise
            if data:
                self._take(data)

    def _take(self, data: bytes) -> None:
        try:
            body = json.loads(data).get("body")
            node, launch = str(body["node"]), str(body["launch"])
        except (ValueError, TypeError, AttributeError, KeyError, RecursionError):
            self.dropped += 1
            return
        key = timing_key(launch, node)
        checked = verify(self._token, key, data)
        if checked.value is None:
            self.dropped += 1
            if key not in self._forged:  # said once per key: a flood of forgeries is not a flood of events
                self._forged.add(key)
                self._on_rejected(key, f"{checked.problem} (a timing datagram)")
            return
        with self._lock:
            if launch != self._launch:
                return
            self.received += 1
            self._records[node] = checked.value

    # ------------------------------------------------------------ every node's side
    def send(self, address: str, launch_id: str, record: dict[str, Any]) -> bool:
        """Send this node's ``record`` to the scorer's link at ``address`` (``host:port``); False when it could not
        go as one datagram (too large, an address that does not parse, the network refused it)."""
        node = record.get("node")
        if not isinstance(node, str):
            return False
        body = {**record, "launch": launch_id}
        data = sign(self._token, timing_key(launch_id, node), body)
        if len(data) > MAX_RECORD:
            return False
        host, _, port = address.rpartition(":")
        try:
            self._sock.sendto(data, (host.strip("[]"), int(port)))
        except (OSError, ValueError):
            return False
        return True

    def close(self) -> None:
        self._done.set()
        try:  # wake the receiving thread
            self._sock.sendto(b"", self._sock.getsockname()[:2])
        except OSError:
            pass
        self._thread.join(timeout=5)
        self._sock.close()


