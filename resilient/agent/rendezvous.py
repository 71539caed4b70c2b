"""Rendezvous: which nodes form the next generation, and where its workers meet.

Two flavours:

* one machine, one agent (no external service): nothing to meet, so no
  protocol (:class:`OneNodeRendezvous`).  Each round is this node alone.
  torch's handler would cost a restart up to 0.3 s here: it delays its
  first re-join by a random amount to spread nodes that do not exist;
* etcd (many machines): torch elastic's ``DynamicRendezvousHandler`` over
  our etcd v3 ``RendezvousBackend`` and store, so that no node hosts the
  state the others depend on.

Each launch of a run has its own rendezvous (see
:mod:`resilient.coord.launch`); the generation counter is the run's.  After
each round the node with rank 0 takes the next generation number from the
control store and publishes it, with a fresh ``MASTER_ADDR:MASTER_PORT``
for the workers, in the round's own key space.  Workers of a new generation
therefore never meet keys or a store left over from the previous one (the
stale-address failure seen with a store shared across restarts).

torch is imported inside functions: importing this module stays cheap.
"""

from __future__ import annotations

import gc
import os
import socket
from dataclasses import dataclass
from typing import Any

from ..coord.store import ControlStore

_GENERATION_KEY = "resilient/generation"


@dataclass(frozen=True)
class Assignment:
    """This node's place in a completed rendezvous round."""

    node_rank: int
    num_nodes: int
    generation: int
    master_addr: str
    master_port: int


@dataclass(frozen=True, kw_only=True)
class RendezvousTimeouts:
    """How long each phase of a rendezvous may take."""

    join_s: float = 600.0
    """Give up joining after this long (a node that never sees enough peers)."""
    last_call_s: float = 1.0
    """After the minimum number of nodes joined, wait this long for more before closing the round."""
    close_s: float = 30.0
    keep_alive_s: float = 2.0
    """Interval of the rendezvous keep-alive each node writes (a read and a compare-and-set in the store: the
    largest share of an agent's steady load on it; a node's liveness while it trains is judged by its peers'
    probes, not by this)."""
    keep_alive_attempts: int = 3
    """Missed keep-alives after which a node is considered dead."""


class OneNodeRendezvous:
    """The rendezvous of a run on one machine under one agent: every round is this node alone, node rank 0 of 1,
    with the run's next generation number and a fresh port on ``local_addr`` for the workers' store."""

    def __init__(self, control: ControlStore, local_addr: str) -> None:
        self._control = control
        self._local_addr = local_addr
        self._closed = False

    def next(self) -> Assignment:
        """The next round, at once; raises torch's ``RendezvousClosedError`` once closed (as the handler would)."""
        if self._closed:
            from torch.distributed.elastic.rendezvous.api import RendezvousClosedError

            raise RendezvousClosedError("the rendezvous is closed")
        generation = self._control.add("generation", 1)
        return Assignment(0, 1, generation, self._local_addr, free_port(self._local_addr))

    def num_nodes_waiting(self) -> int:
        return 0  # no other node can join a run on one machine

    def close(self) -> None:
        self._closed = True

    def is_closed(self) -> bool:
        return self._closed

    def stop_keep_alive(self) -> None:
        pass  # no keep-alive: no peer watches this node

    def shutdown(self) -> None:
        self._closed = True


class Rendezvous:
    """Thin wrapper over a torch rendezvous handler that adds generations and worker addresses."""

    def __init__(self, handler: Any, control: ControlStore, local_addr: str, hosted_store: Any = None) -> None:
        self._handler = handler
        self._control = control
        self._local_addr = local_addr
        self._hosted_store = hosted_store  # kept alive: the embedded TCPStore server lives in this object

    def next(self) -> Assignment:
        """Join the next round (blocks until it completes); raises torch's RendezvousError subclasses."""
        info = self._handler.next_rendezvous()
        store, node_rank, num_nodes = info.store, info.rank, info.world_size
        if node_rank == 0:
            generation = self._control.add("generation", 1)
            store.set(_GENERATION_KEY, str(generation))
            store.set("resilient/master_addr", self._local_addr)
            store.set("resilient/master_port", str(free_port(self._local_addr)))
        generation = int(store.get(_GENERATION_KEY).decode())
        addr = store.get("resilient/master_addr").decode()
        port = int(store.get("resilient/master_port").decode())
        return Assignment(node_rank, num_nodes, generation, addr, port)

    def num_nodes_waiting(self) -> int:
        """Nodes waiting to join: a reason to restart the group so that they can."""
        return int(self._handler.num_nodes_waiting())

    def close(self) -> None:
        """Mark the rendezvous closed: other nodes stop instead of waiting for a new round."""
        self._handler.set_closed()

    def is_closed(self) -> bool:
        return bool(self._handler.is_closed())

    def stop_keep_alive(self) -> None:
        """Stop this handler's keep-alive without closing the rendezvous: the other nodes see this node gone once
        its keep-alive times out (``keep_alive_s * keep_alive_attempts``) and form their next round without it.
        torch's handler has no public call for this; its ``shutdown`` would close the rendezvous for every node."""
        stop = getattr(self._handler, "_stop_heartbeats", None)
        if callable(stop):
            stop()
        else:  # its keep-alive timer holds the handler weakly: without the handler it sends nothing
            self._handler = None
            gc.collect()

    def shutdown(self) -> None:
        try:
            self._handler.shutdown()
        except Exception:  # best effort at exit; the store may already be gone
            pass


def free_port(addr: str) -> int:
    """A port that is free on ``addr`` now (the rank-0 worker binds it moments later)."""
    with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])


def _no_shared_worker_store() -> None:
    # torch otherwise keeps one TCPStore for all rounds and hands it to the
    # workers; we give each generation a fresh address instead (see above).
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"


def etcd_rendezvous(etcd: Any, run_id: str, control: ControlStore, min_nodes: int, max_nodes: int,
                    timeouts: RendezvousTimeouts, local_addr: str, launch_id: str) -> Rendezvous:
    """Many machines: torch's dynamic rendezvous over our etcd v3 backend, in launch ``launch_id``'s key space."""
    from ..coord.rendezvous import create_etcd_rendezvous_handler

    _no_shared_worker_store()
    handler = create_etcd_rendezvous_handler(
        etcd, run_id, min_nodes=min_nodes, max_nodes=max_nodes, local_addr=local_addr,
        join_timeout_s=timeouts.join_s, last_call_s=timeouts.last_call_s, close_s=timeouts.close_s,
        keep_alive_interval_s=timeouts.keep_alive_s, keep_alive_max_attempt=timeouts.keep_alive_attempts,
        launch_id=launch_id,
    )
    return Rendezvous(handler, control, local_addr)
