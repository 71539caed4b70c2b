"""The node's memory tier as its agent owns it: the directory, its limit, its cleanup, what it holds.

The workers write and read the tier (:mod:`resilient.checkpoint.memory`);
the agent decides where it lives and how much it may hold, tells every
worker (``RESILIENT_MEMORY_DIR``, ``RESILIENT_MEMORY_LIMIT``,
``RESILIENT_MEMORY_EVERY``), shows it in ``resilient status`` and on
``/metrics``, and removes it when the run ends on this node.  The directory
is named after the run, the node and the run directory, so an agent that
starts again on the same run directory (after it was killed) finds what its
predecessor's workers saved, while another run's or another test's never
collides with it.  A tier whose run directory no longer exists can never be
restored from: an agent sweeps such leftovers of dead agents at start.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..checkpoint import memory as mem
from ..core.errors import ConfigError
from ..core.events import Emit, EventKind
from ..core.supervised import ThreadReports
from .memory_replica import MemoryReplication
from .rundir import check_private_dir

PREFIX = "resilient-memory-"
OWNER = "owner.json"
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def default_limit(root: Path) -> int:
    """Half of the shared-memory filesystem ``root`` is on (a quarter of the RAM with Linux's default /dev/shm)."""
    st = os.statvfs(root)
    return st.f_blocks * st.f_frsize // 2


def directory_for(root: Path, run_id: str, node_id: str, run_dir: Path) -> Path:
    tag = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:10]
    return root / f"{PREFIX}{_UNSAFE.sub('_', run_id)[:40]}-{_UNSAFE.sub('_', node_id)[:40]}-{tag}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class NodeMemory:
    """This node's memory tier, from the agent's side."""

    def __init__(self, root: Path, *, run_id: str, node_id: str, run_dir: Path, limit: int | None,
                 every: int | None, emit: Emit, pin_every: int | None = None) -> None:
        """``pin_every``: the ranks pin every so many steps for a copy on a peer node (``--memory-replicas``)."""
        if not root.is_dir():
            raise ConfigError(f"--memory-root {root} is not a directory: give a tmpfs such as /dev/shm, or turn the "
                              "memory tier off with --no-memory-tier")
        self.root = root
        self.path = directory_for(root, run_id, node_id, run_dir)
        self.limit = limit if limit is not None else default_limit(root)
        self.every = every
        self.pin_every = pin_every
        self.replication: MemoryReplication | None = None
        """The copy of this tier on a peer node and of the predecessor's here (``--memory-replicas 1``)."""
        self._node = node_id
        self._emit = emit
        self._run_dir = run_dir.resolve()
        self._sweep()
        found = self.path.is_dir()
        self.path.mkdir(mode=0o700, exist_ok=True)
        # Its name is known in advance (a later agent of the run finds it): whoever made it must be this user.
        check_private_dir(self.path, "memory tier directory",
                          "remove it (the run's in-memory copies are not in a directory someone else owns), or give "
                          "--memory-root a directory only you can write")
        (self.path / OWNER).write_text(json.dumps({"run_dir": str(self._run_dir), "run_id": run_id, "node": node_id,
                                                   "agent_pid": os.getpid(), "since": time.time()}))
        if found:  # an earlier agent of this run on this node was killed: its workers' state is still here
            emit(EventKind.MEMORY_TIER_FOUND, directory=str(self.path), bytes=mem.usage(self.path),
                 holdings=self.holdings())

    def env(self) -> dict[str, str]:
        """What every worker is told."""
        pinned = {mem.PIN_EVERY_ENV: str(self.pin_every)} if self.pin_every else {}
        return {mem.DIR_ENV: str(self.path), mem.LIMIT_ENV: str(self.limit),
                mem.EVERY_ENV: str(self.every) if self.every is not None else "auto", **pinned}

    def replicate(self, *, host: str, token: str, nproc: int, address_of: Callable[[str], str | None],
                  live: Callable[[], frozenset[str]], threads: ThreadReports | None = None) -> MemoryReplication:
        """Serve this tier to the peers and keep a copy of the predecessor's (started by the caller)."""
        self.replication = MemoryReplication(self.path, self.limit, node=self._node, host=host, token=token,
                                             nproc=nproc, emit=self._emit, address_of=address_of, live=live,
                                             threads=threads)
        return self.replication

    def holdings(self) -> dict[str, list[int]]:
        """Published steps by file (``rank00000``, ``replicated``), newest first."""
        out: dict[str, list[int]] = {}
        with contextlib.suppress(OSError):
            for stem in sorted({p.name.split(".")[0] for p in self.path.glob("*.json") if p.name != OWNER}):
                steps = [r.step for r in mem.read_records(self.path, stem)]
                if steps:
                    out[stem] = steps
        return out

    def view(self) -> dict[str, Any]:
        """``resilient status``'s ``memory`` entry."""
        view = {"directory": str(self.path), "limit_bytes": self.limit, "used_bytes": mem.usage(self.path),
                "every": self.every if self.every is not None else "auto", "holdings": self.holdings()}
        if self.replication is not None:
            view["replica"] = {"pin_every": self.pin_every, **self.replication.view()}
        return view

    def used_bytes(self) -> int:
        return mem.usage(self.path)

    def release(self, why: str) -> None:
        """The run ended on this node: nothing will restore from the tier again (nor copy into it)."""
        if self.replication is not None:
            self.replication.close()
        used = mem.usage(self.path)
        # Renamed first: a copy from a peer still finishing (its agent stops it) cannot re-create a folder here.
        gone = self.path.with_name(f"{self.path.name}.released-{os.getpid()}")
        try:
            os.rename(self.path, gone)
        except OSError:
            gone = self.path
        shutil.rmtree(gone, ignore_errors=True)
        self._emit(EventKind.MEMORY_TIER_RELEASED, directory=str(self.path), bytes=used, reason=why)

    def _sweep(self) -> None:
        """Remove tiers of dead agents whose run directory is gone (no agent can ever restore from them)."""
        removed = []
        with contextlib.suppress(OSError):
            for candidate in self.root.glob(PREFIX + "*"):
                if candidate == self.path:
                    continue
                try:
                    owner = json.loads((candidate / OWNER).read_text())
                    run_dir, pid = Path(owner["run_dir"]), int(owner["agent_pid"])
                except (OSError, ValueError, KeyError, TypeError):
                    continue  # not ours to judge
                if run_dir.exists() or _pid_alive(pid):
                    continue
                used = mem.usage(candidate)
                shutil.rmtree(candidate, ignore_errors=True)
                removed.append({"directory": str(candidate), "bytes": used, "run_dir": str(run_dir)})
        if removed:
            self._emit(EventKind.MEMORY_TIER_SWEPT, removed=removed)
