"""Several nodes on this machine for a drill: an etcd on loopback and one agent command per node.

A drill with ``[topology] nodes > 1`` (or spare nodes) runs one ``resilient
run`` agent per node, ``n0`` ... ``n<N-1>``, and one per spare node
(``spare0`` ..., ``--role spare``), each in a process group of its own,
meeting through an etcd the runner starts on free loopback ports (Debian's
``etcd-server``: on ``PATH``, else unpacked in the checkout's
``.servers/usr/bin``).  Its data lives in ``/dev/shm`` where there is one
(etcd syncs every write) and is removed on close.  :meth:`Etcd.stop` and
:meth:`Etcd.start` keep the ports and the data, so a ``store_outage`` is a
real server going away and coming back.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from .monitor import UNPACKED, ServerProcess, free_port

PACKAGE = "etcd-server"


def etcd_binary() -> str | None:
    return shutil.which("etcd") or (str(UNPACKED / "etcd") if (UNPACKED / "etcd").is_file() else None)


def unavailable() -> str | None:
    """Why a drill of several nodes cannot run here (None: it can)."""
    if etcd_binary() is None:
        return f"a drill of several nodes needs etcd (Debian: apt-get install {PACKAGE})"
    return None


class Etcd:
    """One etcd member on loopback for a drill; ``url`` is what the agents' ``--store`` takes."""

    def __init__(self, root: Path, host: str = "127.0.0.1") -> None:
        exe = etcd_binary()
        if exe is None:
            raise RuntimeError(unavailable())
        root.mkdir(parents=True, exist_ok=True)
        self.log = root / "etcd.log"
        shm = Path("/dev/shm")
        self.data = Path(tempfile.mkdtemp(prefix="resilient-drill-etcd-", dir=shm if shm.is_dir() else None))
        client, peer = free_port(), free_port()
        self.url = f"etcd://{host}:{client}"
        self._health = f"http://{host}:{client}/health"
        self._cmd = [exe, "--name=drill", f"--data-dir={self.data}",
                     f"--listen-client-urls=http://{host}:{client}",
                     f"--advertise-client-urls=http://{host}:{client}",
                     f"--listen-peer-urls=http://127.0.0.1:{peer}",
                     f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                     f"--initial-cluster=drill=http://127.0.0.1:{peer}", "--log-level=warn"]
        self._server: ServerProcess | None = None
        try:
            self.start()
        except BaseException:
            self.close()
            raise

    def start(self) -> None:
        """Start the server (again: the same ports and data) and wait until it answers its health check."""
        if self._server is None or self._server.proc.poll() is not None:
            self._server = ServerProcess(self._cmd, self.log, self._health)

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.data, ignore_errors=True)

    def pids(self) -> list[int]:
        """The server's pid while it is alive (a teardown that leaves it is reported)."""
        return [] if self._server is None or self._server.proc.poll() is not None else [self._server.proc.pid]


def node_names(nodes: int, spare_nodes: int) -> list[tuple[str, bool]]:
    """(node id, is a spare) for every agent of the drill, the world's nodes first."""
    return [(f"n{i}", False) for i in range(nodes)] + [(f"spare{i}", True) for i in range(spare_nodes)]
