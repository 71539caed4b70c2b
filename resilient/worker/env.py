"""The environment contract from the agent to its workers, read in one place.

The agent starts each worker with torch's usual variables (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ...) plus ``RESILIENT_*`` ones naming its
heartbeat socket and the per-rank files it reads (stack dumps, error file,
stop control file).  :meth:`WorkerEnv.from_environ` is the only place
outside :mod:`resilient.cli` that reads environment variables, and it reads
only these.  It returns None when ``RESILIENT_AGENT_SOCKET`` is unset: the
worker is not under an agent and :class:`resilient.Run` behaves as it
would without one.

In-process recovery adds ``RESILIENT_RECOVERY_STORE`` (the agent's
TCPStore that re-formed groups rendezvous on; unset: no in-process
recovery), ``RESILIENT_WORKER_ID``, ``RESILIENT_ROLE`` (``worker`` or
``spare``) and ``RESILIENT_RECOVERY_TIMEOUT``.  A spare gets no ``RANK``,
``WORLD_SIZE`` or ``MASTER_*`` while it waits (:mod:`resilient.worker.standby`, before its script starts);
promoted, its script starts with the ``RANK`` and ``WORLD_SIZE`` of its assignment and ``RESILIENT_PROMOTED``.
:func:`launched_distributed` tells whether torch's own variables ask for a
process group (plain ``torchrun`` sets them without any agent).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from ..core.errors import ConfigError

_UNCATCHABLE = (signal.SIGKILL, signal.SIGSTOP)
ROLES = ("worker", "spare")
"""``RESILIENT_ROLE``: a member of the current generation, or a pre-warmed spare waiting to be promoted."""
DEFAULT_RECOVERY_TIMEOUT_S = 60.0


@dataclass(frozen=True, kw_only=True)
class WorkerEnv:
    """What the agent told this worker (each field names its variable)."""

    agent_socket: str
    """RESILIENT_AGENT_SOCKET: the agent's unix datagram socket for heartbeats."""
    rank: int = 0
    """RANK: global rank."""
    world_size: int = 1
    """WORLD_SIZE: number of ranks."""
    local_rank: int = 0
    """LOCAL_RANK: rank on this node."""
    local_world_size: int = 1
    """LOCAL_WORLD_SIZE: ranks on this node."""
    group_rank: int = 0
    """GROUP_RANK: this node's index among the nodes."""
    group_world_size: int = 1
    """GROUP_WORLD_SIZE: number of nodes."""
    master_addr: str | None = None
    """MASTER_ADDR: address of the process-group store."""
    master_port: int | None = None
    """MASTER_PORT: port of the process-group store."""
    run_id: str | None = None
    """RESILIENT_RUN_ID (else TORCHELASTIC_RUN_ID): the run's name."""
    run_dir: str | None = None
    """RESILIENT_RUN_DIR: the run directory."""
    node_id: str | None = None
    """RESILIENT_NODE_ID: this node's name in the run."""
    generation: int = 0
    """RESILIENT_GENERATION: membership generation this worker belongs to (only moves forward within a run)."""
    launch_id: str | None = None
    """RESILIENT_LAUNCH_ID: this launch of the run (a resubmission of the same run id gets a new one)."""
    attempt: int = 0
    """RESILIENT_ATTEMPT (= TORCHELASTIC_RESTART_COUNT): restarts so far."""
    stack_file: str | None = None
    """RESILIENT_STACK_FILE: faulthandler appends all-thread stacks here; None: no dumps."""
    stack_signal: int = int(signal.SIGUSR2)
    """RESILIENT_STACK_SIGNAL: signal that asks for a stack dump."""
    error_file: str | None = None
    """RESILIENT_ERROR_FILE: JSON written on an uncaught exception; None: not written."""
    control_file: str | None = None
    """RESILIENT_CONTROL_FILE: JSON stop request {"stop_at_step": S, "reason": ...}; None: no graceful stop."""
    stop_signal: int = int(signal.SIGUSR1)
    """RESILIENT_STOP_SIGNAL: signal sent after the control file was written."""
    fault_plan: str | None = None
    """RESILIENT_FAULT_PLAN: a chaos plan (JSON) to inject faults from; None: no faults."""
    recovery_store: tuple[str, int] | None = None
    """RESILIENT_RECOVERY_STORE=host:port: the agent's TCPStore for in-process recovery; None: restart only."""
    worker_id: str | None = None
    """RESILIENT_WORKER_ID: this process's identity across generations (its assignments' key)."""
    role: str = "worker"
    """RESILIENT_ROLE: ``worker`` (a member) or ``spare`` (waits for an assignment before training)."""
    promoted: int | None = None
    """RESILIENT_PROMOTED: the generation a spare was promoted into before its script started (None: not yet, or
    not a spare); its Run joins that generation and takes the survivors' state, restoring no checkpoint."""
    recovery_timeout_s: float = DEFAULT_RECOVERY_TIMEOUT_S
    """RESILIENT_RECOVERY_TIMEOUT: seconds a survivor waits for its assignment, and for the new group, before giving up."""
    resizable: int = 0
    """RESILIENT_RESIZABLE=1: the agent may change the world size in process (a shrink, a grow): checkpoints then
    restore at any world size.  0: the world keeps its size (a spare only takes a lost rank's place)."""
    diagnose: str | None = None
    """RESILIENT_DIAGNOSE=input:STEPS:DIR: a diagnosis job of ``resilient diagnose input``
    (:mod:`resilient.worker.diagnose`): no checkpoint is read or written."""

    memory_dir: str | None = None
    """RESILIENT_MEMORY_DIR: this node's memory tier (:mod:`resilient.checkpoint.memory`); None: no memory tier."""
    memory_limit: int = 0
    """RESILIENT_MEMORY_LIMIT: bytes the node's memory tier may hold, all its ranks together."""
    memory_every: int = 0
    """RESILIENT_MEMORY_EVERY: steps between memory saves; 0 (``auto``): chosen from the measured cost."""
    memory_pin_every: int = 0
    """RESILIENT_MEMORY_PIN_EVERY: the steps (multiples of it) every rank saves in the memory tier, whatever its
    interval, for its agent to pin and copy to a peer node (``--memory-replicas``); 0: none."""

    mtbf_s: float | None = None
    """RESILIENT_MTBF: the run's mean time between failures in seconds, from which the Run computes its durable
    save interval (``resilient run --mtbf``); 0: computed from the run's history, which has no failure yet; None
    (unset): every ``CheckpointConfig.every_steps`` steps."""
    mtbf_source: str | None = None
    """RESILIENT_MTBF_SOURCE: where the agent took ``mtbf_s`` from, for the interval's reason."""
    resume_check: str | None = None
    """RESILIENT_RESUME_CHECK: ``stop`` or ``accept``, what a resume that is not where the saving run was does
    (``resilient run --resume-check``; ``Run(resume_check=...)`` wins); None: the Run's default."""

    def __post_init__(self) -> None:
        if not self.agent_socket:
            raise ConfigError("RESILIENT_AGENT_SOCKET is empty: set it to the agent's socket path, or unset it")
        for outer, inner, n, i in (
            ("WORLD_SIZE", "RANK", self.world_size, self.rank),
            ("LOCAL_WORLD_SIZE", "LOCAL_RANK", self.local_world_size, self.local_rank),
            ("GROUP_WORLD_SIZE", "GROUP_RANK", self.group_world_size, self.group_rank),
        ):
            if n < 1 or not 0 <= i < n:
                raise ConfigError(f"{inner}={i} is not within {outer}={n}: the agent must give 0 <= {inner} < {outer}")
        for var, value in (("RESILIENT_GENERATION", self.generation), ("RESILIENT_ATTEMPT", self.attempt)):
            if value < 0:
                raise ConfigError(f"{var}={value} must be >= 0")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ConfigError(f"MASTER_PORT={self.master_port} is not a TCP port (1..65535)")
        for var, signum in (("RESILIENT_STACK_SIGNAL", self.stack_signal), ("RESILIENT_STOP_SIGNAL", self.stop_signal)):
            try:
                sig = signal.Signals(signum)
            except ValueError:
                raise ConfigError(f"{var}={signum} is not a signal number on this platform") from None
            if sig in _UNCATCHABLE:
                raise ConfigError(f"{var}={signum} ({sig.name}) cannot be caught; use e.g. SIGUSR1 (10) or SIGUSR2 (12)")
        if self.role not in ROLES:
            raise ConfigError(f"RESILIENT_ROLE={self.role!r} is not a role: use one of {', '.join(ROLES)}")
        if not self.recovery_timeout_s > 0:  # also refuses NaN
            raise ConfigError(f"RESILIENT_RECOVERY_TIMEOUT={self.recovery_timeout_s!r} must be a number of seconds > 0")
        if self.recovery_store is not None:
            host, port = self.recovery_store
            if not host or not 0 < port < 65536:
                raise ConfigError(f"RESILIENT_RECOVERY_STORE={host}:{port} is not host:port with a port in 1..65535")
            if not self.worker_id:
                raise ConfigError("RESILIENT_RECOVERY_STORE is set but RESILIENT_WORKER_ID is not: the agent names "
                                  "each worker (e.g. w0, s0) so that it can address its assignments")
        if self.promoted is not None and self.role != "spare":
            raise ConfigError("RESILIENT_PROMOTED is set but RESILIENT_ROLE is not spare: only a spare is promoted")
        if self.role == "spare" and self.recovery_store is None:
            raise ConfigError("RESILIENT_ROLE=spare needs RESILIENT_RECOVERY_STORE: a spare waits there for the "
                              "assignment that promotes it")
        if self.memory_dir is not None and self.memory_limit <= 0:
            raise ConfigError(f"RESILIENT_MEMORY_LIMIT={self.memory_limit} must be a number of bytes > 0 when "
                              "RESILIENT_MEMORY_DIR is set")
        if self.memory_pin_every < 0:
            raise ConfigError(f"RESILIENT_MEMORY_PIN_EVERY={self.memory_pin_every} must be a number of steps >= 0")
        if self.memory_every < 0:
            raise ConfigError(f"RESILIENT_MEMORY_EVERY={self.memory_every} must be a number of steps >= 1, or auto")
        if self.mtbf_s is not None and not self.mtbf_s >= 0:  # also refuses NaN
            raise ConfigError(f"RESILIENT_MTBF={self.mtbf_s!r} must be a number of seconds >= 0 (0: none known yet)")
        if self.resume_check not in (None, "stop", "accept"):
            raise ConfigError(f"RESILIENT_RESUME_CHECK={self.resume_check!r} must be stop or accept")
        if self.stack_signal == self.stop_signal:
            raise ConfigError(
                f"RESILIENT_STACK_SIGNAL and RESILIENT_STOP_SIGNAL are both {self.stop_signal}; they must differ"
            )

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> WorkerEnv | None:
        """Read the agent's variables; None when not under an agent (RESILIENT_AGENT_SOCKET unset).

        Raises :class:`ConfigError` naming the variable when one is invalid.
        """
        socket_path = environ.get("RESILIENT_AGENT_SOCKET")
        if socket_path is None:
            return None
        attempt = _int(environ, "RESILIENT_ATTEMPT")
        restarts = _int(environ, "TORCHELASTIC_RESTART_COUNT")
        if attempt is not None and restarts is not None and attempt != restarts:
            raise ConfigError(
                f"RESILIENT_ATTEMPT={attempt} but TORCHELASTIC_RESTART_COUNT={restarts}; the agent sets both "
                "to the number of restarts so far"
            )
        values: dict[str, Any] = {
            "agent_socket": socket_path,
            "rank": _int(environ, "RANK"),
            "world_size": _int(environ, "WORLD_SIZE"),
            "local_rank": _int(environ, "LOCAL_RANK"),
            "local_world_size": _int(environ, "LOCAL_WORLD_SIZE"),
            "group_rank": _int(environ, "GROUP_RANK"),
            "group_world_size": _int(environ, "GROUP_WORLD_SIZE"),
            "master_addr": _str(environ, "MASTER_ADDR"),
            "master_port": _int(environ, "MASTER_PORT"),
            "run_id": _str(environ, "RESILIENT_RUN_ID") or _str(environ, "TORCHELASTIC_RUN_ID"),
            "run_dir": _str(environ, "RESILIENT_RUN_DIR"),
            "node_id": _str(environ, "RESILIENT_NODE_ID"),
            "generation": _int(environ, "RESILIENT_GENERATION"),
            "launch_id": _str(environ, "RESILIENT_LAUNCH_ID"),
            "attempt": attempt if attempt is not None else restarts,
            "stack_file": _str(environ, "RESILIENT_STACK_FILE"),
            "stack_signal": _int(environ, "RESILIENT_STACK_SIGNAL"),
            "error_file": _str(environ, "RESILIENT_ERROR_FILE"),
            "control_file": _str(environ, "RESILIENT_CONTROL_FILE"),
            "stop_signal": _int(environ, "RESILIENT_STOP_SIGNAL"),
            "fault_plan": _str(environ, "RESILIENT_FAULT_PLAN"),
            "recovery_store": _address(environ, "RESILIENT_RECOVERY_STORE"),
            "worker_id": _str(environ, "RESILIENT_WORKER_ID"),
            "role": _str(environ, "RESILIENT_ROLE"),
            "promoted": _int(environ, "RESILIENT_PROMOTED"),
            "recovery_timeout_s": _float(environ, "RESILIENT_RECOVERY_TIMEOUT"),
            "resizable": _int(environ, "RESILIENT_RESIZABLE"),
            "diagnose": _str(environ, "RESILIENT_DIAGNOSE"),
            "memory_dir": _str(environ, "RESILIENT_MEMORY_DIR"),
            "memory_limit": _int(environ, "RESILIENT_MEMORY_LIMIT"),
            "memory_every": 0 if _str(environ, "RESILIENT_MEMORY_EVERY") == "auto" else _int(environ,
                                                                                            "RESILIENT_MEMORY_EVERY"),
            "memory_pin_every": _int(environ, "RESILIENT_MEMORY_PIN_EVERY"),
            "mtbf_s": _float(environ, "RESILIENT_MTBF"),
            "mtbf_source": _str(environ, "RESILIENT_MTBF_SOURCE"),
            "resume_check": _str(environ, "RESILIENT_RESUME_CHECK"),
        }
        return cls(**{k: v for k, v in values.items() if v is not None})

    def to_environ(self) -> dict[str, str]:
        """The variables that :meth:`from_environ` reads back into this WorkerEnv (for launchers and tests)."""
        out: dict[str, str] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "recovery_store" and value is not None:
                out[_VARS[f.name]] = f"{value[0]}:{value[1]}"
            elif value is not None:
                out[_VARS[f.name]] = str(value)
        if self.run_id is not None:
            out["TORCHELASTIC_RUN_ID"] = self.run_id
        out["TORCHELASTIC_RESTART_COUNT"] = str(self.attempt)
        return out


_VARS = {
    "agent_socket": "RESILIENT_AGENT_SOCKET", "rank": "RANK", "world_size": "WORLD_SIZE",
    "local_rank": "LOCAL_RANK", "local_world_size": "LOCAL_WORLD_SIZE", "group_rank": "GROUP_RANK",
    "group_world_size": "GROUP_WORLD_SIZE", "master_addr": "MASTER_ADDR", "master_port": "MASTER_PORT",
    "run_id": "RESILIENT_RUN_ID", "run_dir": "RESILIENT_RUN_DIR", "node_id": "RESILIENT_NODE_ID",
    "generation": "RESILIENT_GENERATION", "launch_id": "RESILIENT_LAUNCH_ID", "attempt": "RESILIENT_ATTEMPT", "stack_file": "RESILIENT_STACK_FILE",
    "stack_signal": "RESILIENT_STACK_SIGNAL", "error_file": "RESILIENT_ERROR_FILE",
    "control_file": "RESILIENT_CONTROL_FILE", "stop_signal": "RESILIENT_STOP_SIGNAL",
    "fault_plan": "RESILIENT_FAULT_PLAN", "recovery_store": "RESILIENT_RECOVERY_STORE",
    "worker_id": "RESILIENT_WORKER_ID", "role": "RESILIENT_ROLE", "promoted": "RESILIENT_PROMOTED", "recovery_timeout_s": "RESILIENT_RECOVERY_TIMEOUT",
    "resizable": "RESILIENT_RESIZABLE", "diagnose": "RESILIENT_DIAGNOSE", "memory_dir": "RESILIENT_MEMORY_DIR",
    "memory_limit": "RESILIENT_MEMORY_LIMIT", "memory_every": "RESILIENT_MEMORY_EVERY",
    "memory_pin_every": "RESILIENT_MEMORY_PIN_EVERY", "mtbf_s": "RESILIENT_MTBF",
    "mtbf_source": "RESILIENT_MTBF_SOURCE", "resume_check": "RESILIENT_RESUME_CHECK",
}


def launched_distributed(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether torch's launcher variables ask for a process group (``WORLD_SIZE`` > 1), agent or not."""
    world = _int(environ, "WORLD_SIZE")
    return world is not None and world > 1


def _str(environ: Mapping[str, str], var: str) -> str | None:
    value = environ.get(var)
    return value if value else None  # set but empty means unset, as in a shell's VAR= prefix


def _int(environ: Mapping[str, str], var: str) -> int | None:
    value = _str(environ, var)
    if value is None:
        return None
    try:
        return int(value.strip())
    except ValueError:
        raise ConfigError(f"{var}={value!r} is not an integer") from None


def _float(environ: Mapping[str, str], var: str) -> float | None:
    value = _str(environ, var)
    if value is None:
        return None
    try:
        return float(value.strip())
    except ValueError:
        raise ConfigError(f"{var}={value!r} is not a number of seconds") from None


def _address(environ: Mapping[str, str], var: str) -> tuple[str, int] | None:
    value = _str(environ, var)
    if value is None:
        return None
    host, sep, port = value.strip().rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host  # [::1]:29500
    try:
        number = int(port)
    except ValueError:
        number = -1
    if not sep or not host or not 0 < number < 65536:
        raise ConfigError(f"{var}={value!r} is not host:port (e.g. 127.0.0.1:29400): the agent's recovery store")
    return host, number


@dataclass(frozen=True)
class ReplayPlan:
    """What ``resilient incident replay`` asks of each rank (``RESILIENT_REPLAY``, a JSON file)."""

    checkpoint: str
    """The directory to restore from: the replay's own copy of the bundled checkpoint (an empty one when the
    run had none before the failing step)."""
    step: int
    """The failing step: the loop ends once it is behind."""
    results: str
    """The directory each rank writes ``rank<R>.json`` into."""


def replay_plan(environ: Mapping[str, str] = os.environ) -> ReplayPlan | None:
    """The replay this process is part of, or None (a run, not a replay)."""
    path = _str(environ, "RESILIENT_REPLAY")
    if path is None:
        return None
    import json
    from pathlib import Path

    try:
        body = json.loads(Path(path).read_text(encoding="utf-8"))
        return ReplayPlan(checkpoint=str(body["checkpoint"]), step=int(body["step"]), results=str(body["results"]))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"RESILIENT_REPLAY={path}: not a replay plan ({e}); it is written by "
                          "`resilient incident replay`") from None

