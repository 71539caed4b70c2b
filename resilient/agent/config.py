"""The agent's configuration: one validated dataclass built by the CLI or by code."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..coord.launch import check_launch_id
from ..coord.liveness import MIN_SILENCE_S, SILENCE_S
from ..coord.quarantine import QuarantineConfig
from ..core.errors import ConfigError
from ..elastic.evict import EvictConfig
from ..watchdog.sections import SectionTimeouts
from ..watchdog.slowdown import SlowdownConfig
from ..watchdog.straggler import StragglerConfig
from .health import HealthConfig
from .policy import RestartConfig
from .rendezvous import RendezvousTimeouts

_NODE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    """Everything one node agent needs to supervise its workers."""

    entrypoint: tuple[str, ...]
    """The worker command line, e.g. (sys.executable, "-u", "train.py", "--steps", "300")."""
    restart_args: tuple[str, ...] = ()
    """Arguments added after the entrypoint's whenever the workers resume (``--restart-args``): every start but
    the run's very first, so that a script that resumes from its own checkpoint (``--resume``) does so."""
    run_id: str
    """Name shared by every node of the run."""
    node_id: str
    """This node's unique name within the run."""
    run_dir: Path
    """Where events, logs, incidents and status go."""
    launch_id: str | None = None
    """This submission's launch id; None agrees on one through the store (see resilient.coord.launch)."""
    token_file: Path | None = None
    """The run token to use instead of <run_dir>/token (every node of a run needs the same token)."""
    nproc_per_node: int = 1
    """Worker processes on this node (with ``--nproc-per-node MIN:MAX``, the MAX it starts with)."""
    min_nproc_per_node: int | None = None
    """Fewest ranks this node may continue with after losing some (MIN of ``--nproc-per-node MIN:MAX``);
    None: ``nproc_per_node`` (no shrink on this node)."""
    spares: int = 0
    """Extra worker processes kept warm on this node to take a failed rank's place (``--spares``)."""
    spare_nice: int = 10
    """Niceness a spare starts with, so that its start-up never takes CPU from the workers (``--spare-nice``);
    set back to the members' at promotion.  Only where the agent may lower it again (CAP_SYS_NICE)."""
    role: str = "worker"
    """``worker``: a node of the run; ``spare``: a node of the launch's spare pool (``--role spare``), whose
    warm processes wait to take a lost node's ranks or to grow a shrunk world, across machines."""
    in_process: bool = True
    """Offer in-process recovery to scripts that opt in (``run.attempt()``); False: restarts only."""
    grow_settle_s: float = 5.0
    """A shrunk world grows back onto a spare once it has been ready this long (``--grow-settle``)."""
    recovery_timeout_s: float = 60.0
    """How long a survivor waits for its new generation and the new group takes to form before the agent
    falls back to a restart."""
    min_nodes: int = 1
    """Fewest nodes the run continues with."""
    max_nodes: int = 1
    """Most nodes admitted to a generation."""
    store_url: str | None = None
    """etcd://host:port[,host:port] for many machines; None for the embedded one-machine store."""
    etcd_options: Mapping[str, object] = field(default_factory=dict)
    """Extra EtcdConfig fields (username, password, ca_file, cert_file, key_file, outage_tolerance_s)."""
    local_addr: str = "127.0.0.1"
    """Address other nodes reach this one at (the workers' MASTER_ADDR when this node has rank 0)."""
    restart: RestartConfig = field(default_factory=RestartConfig)
    """Restart budget, backoff and crash-loop breaker."""
    sections: SectionTimeouts = field(default_factory=SectionTimeouts)
    """Hang timeouts per section."""
    straggler: StragglerConfig = field(default_factory=StragglerConfig)
    """How ranks slower than their peers are detected (changeable on a running job)."""
    slowdown: SlowdownConfig = field(default_factory=SlowdownConfig)
    """How the job slowing down against its own baseline is detected (changeable on a running job)."""
    health: HealthConfig = field(default_factory=HealthConfig)
    """Thresholds below which the node steps out."""
    evict: EvictConfig = field(default_factory=EvictConfig)
    """When a persistent straggler on this node is replaced by a spare or dropped (by cost)."""
    quarantine: QuarantineConfig = field(default_factory=QuarantineConfig)
    """Across machines: the fleet whose quarantine records keep this node out, and its burn-in."""
    burn_in_argv: tuple[str, ...] = ()
    """Extra arguments for the burn-in process (``python -m resilient.watchdog.burnin``), e.g. smaller sizes."""
    health_paths: tuple[str, ...] = ()
    """Directories whose free space is checked (e.g. where checkpoints go)."""
    health_interval_s: float = 10.0
    """Seconds between health checks while running."""
    rendezvous: RendezvousTimeouts = field(default_factory=RendezvousTimeouts)
    """Join, last-call and keep-alive timing."""
    monitor_interval_s: float = 0.1
    """Seconds between checks of the workers."""
    stop_grace_s: float = 5.0
    """After a failure, seconds between SIGTERM and SIGKILL for the remaining workers."""
    preempt_grace_s: float = 60.0
    """On SIGTERM, seconds the workers get to commit a checkpoint and exit."""
    node_silence_s: float = SILENCE_S
    """Across machines: a node whose agent answers no probe for this long is accused by its probers (a quorum of
    accusations makes it lost); a node whose agent died is judged at once, from its refused port."""
    signalled_together_s: float = 1.0
    """Seconds a worker's death by SIGTERM waits for this agent's own SIGTERM (a scheduler ending the whole job:
    a stop, not a failure) before it counts as a failure."""
    preempt_margin_steps: int = 2
    """Steps ahead of the furthest rank at which a graceful stop is scheduled."""
    fault_plan: Path | None = None
    """A chaos plan handed to the workers (tests and drills)."""
    echo_output: bool = True
    """Copy worker output to this process's stdout with a rank prefix."""
    worker_env: Mapping[str, str] = field(default_factory=dict)
    """Base environment of the workers (the CLI passes its own)."""
    fork_server: bool = True
    """Fork workers from a process that has imported torch (:mod:`resilient.agent.forking`); False: start each
    one as a new interpreter."""
    preload: tuple[str, ...] = ()
    """Modules the fork server imports before its first fork, besides torch and resilient."""
    memory_tier: bool = True
    """Keep each rank's state at step boundaries in shared memory this agent owns (:mod:`.memory_tier`), so a
    restarted worker resumes from its newest step instead of the durable commit; False: durable tier only."""
    memory_root: Path = Path("/dev/shm")
    """The shared-memory filesystem the memory tier lives in (``--memory-root``)."""
    memory_limit: int | None = None
    """Bytes the node's memory tier may hold, all ranks together (``--memory-limit``); None: half of
    ``memory_root``'s filesystem."""
    memory_every: int | None = None
    """Steps between memory saves (``--memory-every``); None: chosen from the measured cost of a save."""
    memory_replicas: int = 0
    """Copies of this node's memory tier kept on peer nodes (``--memory-replicas``, 0 or 1): with 1, a node lost
    with its agent is restored from memory on its replacement (:mod:`.memory_replica`)."""
    memory_pin_every: int = 10
    """With a replica: the steps (multiples of it) every rank pins for the copy (``--memory-pin-every``)."""
    mtbf_s: float | None = None
    """The run's mean time between failures (``--mtbf SECONDS``): the workers' Runs compute their durable save
    interval from it (Young/Daly), ``every_steps`` the longest."""
    mtbf_from_history: bool = False
    """``--mtbf auto``: estimate the MTBF from the run's incident history before each generation."""
    metrics_port: int | None = None
    """Serve Prometheus /metrics on this port (0: a free one); None: no metrics server."""
    metrics_addr: str = "127.0.0.1"
    """Address of the metrics server (loopback unless asked otherwise)."""
    stall_alert_after_s: float = 600.0
    """Exported alerting threshold: seconds without a new step before the run counts as stalled."""
    goodput_objective: float = 0.9
    """Exported alerting threshold: the goodput ratio the run should keep."""
    ideal_step_s: float | None = None
    """Ideal step time for the ledger; None measures it (mean of steps <= median + 3 MAD)."""
    flops_per_step: float | None = None
    """Model FLOPs of one optimizer step of the whole job, for MFU."""
    peak_flops_per_device: float | None = None
    """Peak FLOP/s of one device (rank); None looks it up by GPU name, and on CPU means no MFU."""

    def __post_init__(self) -> None:
        if not self.entrypoint:
            raise ConfigError("AgentConfig.entrypoint is empty: give the training script to run")
        if not _NODE_ID.match(self.node_id):
            raise ConfigError(f"node id {self.node_id!r} must be 1-63 letters, digits, '.', '_' or '-'")
        if not _NODE_ID.match(self.run_id):
            raise ConfigError(f"run id {self.run_id!r} must be 1-63 letters, digits, '.', '_' or '-'")
        if self.launch_id is not None:
            check_launch_id(self.launch_id)
        if self.token_file is not None and not self.token_file.is_file():
            raise ConfigError(f"token file {self.token_file} does not exist: copy <run_dir>/token from the node "
                              "that started the run")
        if self.nproc_per_node < 1:
            raise ConfigError(f"--nproc-per-node must be >= 1, got {self.nproc_per_node}")
        if self.min_nproc_per_node is not None and not 1 <= self.min_nproc_per_node <= self.nproc_per_node:
            raise ConfigError(f"--nproc-per-node {self.min_nproc_per_node}:{self.nproc_per_node} needs "
                              "1 <= MIN <= MAX")
        if self.spares < 0:
            raise ConfigError(f"--spares must be >= 0, got {self.spares}")
        if not 0 <= self.spare_nice <= 19:
            raise ConfigError(f"--spare-nice must be 0 (as the workers) to 19 (lowest priority), got {self.spare_nice}")
        if self.role not in ("worker", "spare"):
            raise ConfigError(f"--role {self.role!r} is not a role: use worker (the default) or spare")
        if self.role == "spare" and self.store_url is None:
            raise ConfigError("--role spare joins the spare pool of a run on many machines: pass --store "
                              "etcd://HOST:PORT (on one machine, use --spares N instead)")
        if self.shrinkable and self.max_nodes > 1:
            raise ConfigError("--nproc-per-node MIN:MAX shrinks a run on one machine; on many machines give the "
                              "bounds in nodes: --nnodes MIN:MAX")
        if (self.spares or self.shrinkable or self.role == "spare") and not self.in_process:
            raise ConfigError("--spares, --role spare and --nproc-per-node MIN:MAX act through in-process recovery; "
                              "drop --no-in-process, or drop them")
        if self.grow_settle_s < 0:
            raise ConfigError(f"--grow-settle must be >= 0 seconds, got {self.grow_settle_s}")
        if self.recovery_timeout_s <= 0:
            raise ConfigError(f"--recovery-timeout must be > 0, got {self.recovery_timeout_s}")
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise ConfigError(f"--nnodes {self.min_nodes}:{self.max_nodes} needs 1 <= MIN <= MAX")
        if self.max_nodes > 1 and self.store_url is None:
            raise ConfigError("--nnodes above 1 needs a shared store: pass --store etcd://HOST:PORT")
        for name in ("health_interval_s", "monitor_interval_s", "stop_grace_s", "preempt_grace_s",
                     "signalled_together_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"AgentConfig.{name} must be > 0, got {getattr(self, name)}")
        if not self.node_silence_s >= MIN_SILENCE_S:
            raise ConfigError(f"--node-silence-timeout must be at least {MIN_SILENCE_S:g} s (several probe intervals: "
                              f"shorter, a scheduling hiccup of a peer's agent judges its node lost), got "
                              f"{self.node_silence_s:g}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"--metrics-port {self.metrics_port} is not a port; use 0 for a free one")
        if not 0 < self.goodput_objective <= 1:
            raise ConfigError(f"--goodput-objective {self.goodput_objective} must be in (0, 1]")
        for name in ("stall_alert_after_s", "ideal_step_s", "flops_per_step", "peak_flops_per_device"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"AgentConfig.{name} must be > 0, got {value}")
        if self.memory_limit is not None and self.memory_limit < 1:
            raise ConfigError(f"--memory-limit must be a size above 0 (e.g. 8G), got {self.memory_limit}")
        if self.memory_every is not None and self.memory_every < 1:
            raise ConfigError(f"--memory-every must be >= 1 steps or auto, got {self.memory_every}")
        if self.memory_replicas not in (0, 1):
            raise ConfigError(f"--memory-replicas must be 0 or 1 (a copy on the next node), got {self.memory_replicas}")
        if self.memory_replicas and not (self.memory_tier and self.store_url is not None):
            raise ConfigError("--memory-replicas 1 copies the memory tier to a peer node: it needs the memory tier (drop "
                              "--no-memory-tier) and a run across machines (--store etcd://HOST:PORT)")
        if self.memory_pin_every < 1:
            raise ConfigError(f"--memory-pin-every must be >= 1 steps, got {self.memory_pin_every}")
        if self.mtbf_s is not None and not self.mtbf_s > 0:
            raise ConfigError(f"--mtbf {self.mtbf_s!r} must be a number of seconds > 0, or auto")
        if self.mtbf_s is not None and self.mtbf_from_history:
            raise ConfigError("--mtbf is either a number of seconds or auto, not both")
        if self.preempt_margin_steps < 1:
            raise ConfigError("AgentConfig.preempt_margin_steps must be >= 1")

    @property
    def min_ranks(self) -> int:
        """Fewest ranks this node continues with."""
        return self.min_nproc_per_node if self.min_nproc_per_node is not None else self.nproc_per_node

    @property
    def shrinkable(self) -> bool:
        """``--nproc-per-node MIN:MAX`` with MIN < MAX: this node may continue on fewer ranks."""
        return self.min_ranks < self.nproc_per_node

    @property
    def multi_node(self) -> bool:
        """The run may span machines (``--nnodes`` above 1, or a spare node): recovery goes through the store."""
        return self.max_nodes > 1 or self.role == "spare"

    @property
    def offers_in_process(self) -> bool:
        """In-process recovery is offered to the workers.  On one machine: there is a spare or room to shrink
        (without either the ladder could only restart, so the workers are not asked to wait for a new
        generation and exit as they always have).  On many: always, since a spare node may join the pool at
        any time; a script that did not opt in (``run.attempt()``) still restarts as before."""
        if not self.in_process:
            return False
        return self.multi_node or self.spares > 0 or self.shrinkable
