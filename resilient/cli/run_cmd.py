"""``resilient run``: supervise a training script, as torchrun does, with hang detection.

Flags that torchrun has keep its names and meaning (``--nnodes``,
``--nproc-per-node``, ``--max-restarts``, ``--rdzv-id``, ``--local-addr``,
``--monitor-interval``, ``--standalone``, ``--rdzv-backend etcd`` with
``--rdzv-endpoint``); torchrun's c10d and static rendezvous across machines
are refused with the fix (the nodes meet through etcd).  The rest are ours;
``--config FILE.toml`` gives any of them from a file
(:mod:`resilient.cli.run_config`).  Environment variables read
here: ``RESILIENT_ETCD_PASSWORD`` (so a password need not be on the
command line), and under Slurm ``SLURM_JOB_ID`` and ``SLURM_RESTART_COUNT``,
which name the launch (``slurm-<job>-<restart count>``) unless
``--launch-id`` does: every node of a job gets the same id and a requeue a
new one, even when the previous submission was killed without ending its
launch.  Without ``--run-id`` and ``--node-id`` a Slurm job's run is
``slurm-<job>`` and a node is ``SLURMD_NODENAME``.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import shlex
import socket
import sys
import time
from pathlib import Path
from typing import Any

from ..coord.liveness import SILENCE_S
from ..core.errors import ConfigError
from ..core.redact import PASSWORD_ENV



def launch_id_from(explicit: str | None, environ: dict[str, str]) -> str | None:
    """The launch id: ``--launch-id``, else one derived from Slurm's job id and requeue count, else None."""
    if explicit:
        return explicit
    job = environ.get("SLURM_JOB_ID")
    if job:
        return f"slurm-{job}-{environ.get('SLURM_RESTART_COUNT') or 0}"
    return None


def slurm_ids(run_id: str | None, node_id: str | None, environ: dict[str, str]) -> tuple[str | None, str | None]:
    """``--run-id`` and ``--node-id``, else under Slurm ``slurm-<job id>`` (the same on every node of the job and
    across its requeues) and ``SLURMD_NODENAME``; else None (the caller's defaults)."""
    job = environ.get("SLURM_JOB_ID")
    return (run_id or (f"slurm-{job}" if job else None),
            node_id or environ.get("SLURMD_NODENAME") or None)


def add_parser(commands: Any) -> None:
    p = commands.add_parser(
        "run", help="run a training script under the node agent (a drop-in for torchrun)",
        description="Start NPROC workers of SCRIPT on this node, restart them from the newest committed "
        "checkpoint when one fails or hangs, and stop with a verdict when restarting cannot help.",
    )
    g = p.add_argument_group("launch", "what runs, where, and under which names")
    g.add_argument("--nnodes", default="1", metavar="N|MIN:MAX", help="nodes in the run (default 1)")
    g.add_argument("--nproc-per-node", "--nproc_per_node", default="1", metavar="N|MIN:MAX",
                   help="worker processes on this node (default 1); MIN:MAX starts MAX and may continue on as "
                   "few as MIN after losing some, keeping the global batch (scripts that use run.attempt())")
    g.add_argument("--role", choices=("worker", "spare"), default="worker",
                   help="spare: join the run's spare pool (needs --store) with --nproc-per-node spare processes "
                   "that take a lost node's ranks, or grow a run shrunk below MAX of --nnodes, in process")
    g.add_argument("--run-id", "--rdzv-id", "--rdzv_id", dest="run_id", metavar="ID",
                   help="name shared by every node (default: run-<date>-<time> on one node; required with --store)")
    g.add_argument("--node-id", metavar="ID", help="this node's unique name (default: the host name)")
    g.add_argument("--launch-id", metavar="ID",
                   help="this submission's launch id, the same on every node (default: under Slurm "
                   "slurm-<job>-<restart count>, else agreed through the store: a resubmission after the run "
                   "was preempted, succeeded or got a verdict starts a new launch, other agents join it)")
    g.add_argument("--run-dir", type=Path, metavar="DIR", help="events, logs and incidents (default: runs/<run id>)")
    g.add_argument("--config", metavar="FILE.toml",
                   help="flags from a TOML file, a key per flag (nproc-per-node = 2, quiet = true, section-timeout "
                        "= {step = 30}); flags on the command line override it")
    g.add_argument("-m", "--module", action="store_true", help="run SCRIPT as a module (python -m SCRIPT)")
    g.add_argument("--no-python", "--no_python", action="store_true", help="SCRIPT is an executable, not Python")
    g.add_argument("--quiet", action="store_true", help="do not copy worker output to this terminal")
    g.add_argument("--no-fork-server", dest="fork_server", action="store_false",
                   help="start each worker as a new interpreter instead of forking it from a process that has "
                        "imported torch")
    g.add_argument("--preload", default="", metavar="MOD,...",
                   help="modules the fork server imports before forking the workers, besides torch")
    g.add_argument("--local-addr", "--local_addr", metavar="ADDR",
                   help="address peers reach this node at (default 127.0.0.1 alone, else the host name; a loopback "
                        "address is refused while the store is on another machine)")
    g = p.add_argument_group("recovery", "what answers a failure: spares, in-process recovery, shrinking, restarts")
    g.add_argument("--spares", type=int, default=0, metavar="N",
                   help="extra processes kept ready (torch imported; the script starts once one is promoted, with "
                        "the rank it takes) to take a failed rank's place in process (default 0)")
    g.add_argument("--spare-nice", type=int, default=10, metavar="N",
                   help="niceness of a spare until it is promoted (default 10; 0: as the workers). Spares start "
                   "once the workers have restored, at this lower priority; needs CAP_SYS_NICE to undo, without "
                   "it spares start at 0")
    g.add_argument("--no-in-process", dest="in_process", action="store_false",
                   help="recover by restarting the group only, even for scripts that use run.attempt()")
    g.add_argument("--grow-settle", type=float, default=5.0, metavar="S",
                   help="a run shrunk below MAX of --nproc-per-node grows back onto a spare (or a replacement the "
                   "agent starts) once it has been ready S seconds (default 5)")
    g.add_argument("--recovery-timeout", type=float, default=60.0, metavar="S",
                   help="seconds an in-process recovery may take before the agent restarts the group (default 60)")
    g.add_argument("--max-restarts", "--max_restarts", type=int, default=3, metavar="N",
                   help="restarts allowed per launch (see --restart-budget-scope), all nodes together (default 3)")
    g.add_argument("--restart-budget-scope", choices=["launch", "run"], default="launch",
                   help="--max-restarts counts per launch (default) or for the run across resubmissions")
    g.add_argument("--crash-loop-restarts", type=int, default=3, metavar="K",
                   help="stop after K restarts without a newly committed checkpoint that each failed the same way "
                   "(same step, or same exception in the same section; default 3)")
    g.add_argument("--restart-backoff", type=float, default=0.0, metavar="S",
                   help="first restart delay, doubled per restart without progress (default 0)")
    g.add_argument("--stop-grace", type=float, default=5.0, metavar="S",
                   help="after a failure, SIGTERM-to-SIGKILL grace for the other workers (default 5)")
    g.add_argument("--preempt-grace", type=float, default=60.0, metavar="S",
                   help="on SIGTERM, seconds the workers get to checkpoint and exit (default 60)")
    # Seconds a worker killed by SIGTERM waits for this agent's own SIGTERM (a scheduler ending the job: a stop,
    # not a failure) before it counts as a failure (default 1).  For tests: not in --help.
    g.add_argument("--signalled-together", type=float, default=1.0, metavar="S", help=argparse.SUPPRESS)
    g.add_argument("--restart-args", default="", metavar="'ARGS'",
                   help="arguments added after SCRIPT's own whenever the workers resume (a restart, a resubmission), "
                        "e.g. --restart-args='--init_from=resume' for a script that resumes from its own "
                        "checkpoint; the script also finds RESILIENT_RESUMING=1 then")
    g.add_argument("--resume-check", choices=("stop", "accept"), default=None,
                   help="when a restarted worker's first step is not where the run that saved was (random numbers "
                        "drawn or data read between its restore and that step): stop with a verdict (default), or "
                        "accept it and go on, recorded in the ledger; Run(resume_check=...) in the script wins")
    g = p.add_argument_group("checkpoints in memory",
                             "the node's memory tier, which a restart restores from before the durable commits")
    g.add_argument("--no-memory-tier", dest="memory_tier", action="store_false",
                   help="keep no state in shared memory: a restarted worker resumes from the newest durable commit")
    g.add_argument("--memory-root", type=Path, default=Path("/dev/shm"), metavar="DIR",
                   help="the shared-memory filesystem the memory tier lives in (default /dev/shm)")
    g.add_argument("--memory-limit", default=None, metavar="SIZE",
                   help="bytes the node's memory tier may hold, all ranks together, e.g. 8G (default: half of "
                        "--memory-root); a rank without room keeps to the durable tier and says so")
    g.add_argument("--memory-every", default="auto", metavar="N|auto",
                   help="steps between memory saves (default auto: chosen so that saves cost at most 1%% of the "
                        "step time, from what saves cost)")
    g.add_argument("--memory-replicas", type=int, default=0, choices=(0, 1), metavar="0|1",
                   help="1: keep a copy of each node's memory tier on the next node, so that a node lost with its "
                        "agent is restored from memory on its replacement, not from the durable tier (default 0)")
    g.add_argument("--memory-pin-every", type=int, default=10, metavar="N",
                   help="with --memory-replicas 1: every rank keeps the multiples of N steps in memory for the "
                        "copy (default 10)")
    g.add_argument("--mtbf", default=None, metavar="SECONDS|auto",
                   help="the run's mean time between failures: the workers then save durable checkpoints at the "
                        "Young/Daly interval for the measured save cost (every_steps the longest); auto: "
                        "estimated from the run's incident history before each generation (default: every_steps)")
    g = p.add_argument_group("coordination", "across machines: the store, its credentials, the rendezvous")
    g.add_argument("--store", metavar="URL", help="etcd://HOST:PORT[,HOST:PORT] or etcds:// (TLS); omit on one machine")
    g.add_argument("--rdzv-backend", "--rdzv_backend", choices=["etcd", "etcd-v3", "c10d", "static"],
                   help="as torchrun's: etcd (with --rdzv-endpoint) is --store etcd://HOST:PORT; c10d and static "
                   "only on one machine (the nodes of a run meet through etcd)")
    g.add_argument("--rdzv-endpoint", "--rdzv_endpoint", metavar="HOST:PORT",
                   help="with --rdzv-backend etcd: the etcd endpoint")
    g.add_argument("--standalone", action="store_true",
                   help="as torchrun's: one machine, nothing to meet through (the default without --store)")
    g.add_argument("--token-file", type=Path, metavar="FILE",
                   help="the run token (default <run dir>/token); every node of a run needs the same token")
    g.add_argument("--etcd-user", metavar="USER", help=f"etcd user (password from ${PASSWORD_ENV})")
    g.add_argument("--etcd-ca", metavar="FILE", help="CA bundle for etcds://")
    g.add_argument("--etcd-cert", metavar="FILE", help="client certificate for etcds://")
    g.add_argument("--etcd-key", metavar="FILE", help="client key for etcds://")
    g.add_argument("--store-outage-tolerance", type=float, default=60.0, metavar="S",
                   help="seconds an unreachable store is retried before giving up (default 60)")
    g.add_argument("--node-silence-timeout", type=float, default=SILENCE_S, metavar="S",
                   help=f"a node whose agent answers no probe for this long is judged lost (default {SILENCE_S:g}: "
                        "an agent stalled 2 s is not; a node whose agent died is judged at once)")
    g.add_argument("--rdzv-last-call", type=float, default=1.0, metavar="S",
                   help="wait this long for more nodes once the minimum joined (default 1)")
    g.add_argument("--rdzv-join-timeout", type=float, default=600.0, metavar="S",
                   help="give up if the minimum of nodes has not joined by then (default 600)")
    g = p.add_argument_group("watchdogs", "hangs, the node's health, burn-in, drills")
    g.add_argument("--monitor-interval", "--monitor_interval", type=float, default=0.1, metavar="S",
                   help="seconds between checks of the workers (default 0.1)")
    g.add_argument("--section-timeout", action="append", default=[], metavar="SECTION=S",
                   help="fixed hang timeout for a section (init, restore, data, step, checkpoint); repeatable")
    g.add_argument("--timeout-factor", type=float, metavar="X", help="calibrated timeout = max seen x X (default 3)")
    g.add_argument("--timeout-warmup", type=int, metavar="N", help="observations before calibrating (default 5)")
    g.add_argument("--timeout-floor", type=float, metavar="S", help="lowest calibrated timeout (default 5)")
    g.add_argument("--health-path", action="append", default=[], metavar="DIR",
                   help="directory whose free space is checked (e.g. the checkpoint dir); repeatable")
    g.add_argument("--min-free-disk-gb", type=float, metavar="GB", help="step out below this free disk (default 1)")
    g.add_argument("--min-free-memory-gb", type=float, metavar="GB",
                   help="step out below this available memory (default 0.5)")
    g.add_argument("--burn-in", action="store_true",
                   help="burn in before the first rendezvous too (a returning node always burns in)")
    g.add_argument("--burn-in-min-ratio", type=float, default=0.7, metavar="R",
                   help="a burn-in passes at R of the fleet's median for every measure (default 0.7)")
    # An argument for the burn-in process, e.g. --burn-in-arg=--disk-mib=8; repeatable.  For tests (a smaller
    # burn-in): not in --help.
    g.add_argument("--burn-in-arg", action="append", default=[], metavar="ARG", help=argparse.SUPPRESS)
    g.add_argument("--fault-plan", type=Path, metavar="FILE", help="chaos plan for the workers (drills and tests)")
    g = p.add_argument_group("stragglers", "slow ranks: detection, replacement, the fleet's quarantine")
    g.add_argument("--detector", action="append", default=[], metavar="KEY=VALUE",
                   help="a straggler/slowdown detector setting, e.g. straggler.rule.decision=12 or "
                        "slowdown.enabled=false; repeatable (`resilient detectors` changes them while running)")
    g.add_argument("--no-evict", dest="evict", action="store_false",
                   help="never replace or drop a persistent straggler (it is still reported)")
    g.add_argument("--evict-after-windows", type=int, default=6, metavar="N",
                   help="weigh replacing a straggler once its flag stood N windows of 5 steps (default 6)")
    g.add_argument("--evict-margin", type=float, default=2.0, metavar="X",
                   help="replace or drop a straggler only when the time saved is X times the cost (default 2)")
    g.add_argument("--fleet", default="default", metavar="NAME",
                   help="across machines: the fleet whose node quarantine this node obeys (default 'default')")
    g.add_argument("--quarantine-expiry", type=float, default=600.0, metavar="S",
                   help="how long a node's first quarantine lasts; each later offence doubles it (default 600)")
    g.add_argument("--quarantine-after-windows", type=int, default=60, metavar="N",
                   help="quarantine this node when a straggler flag on it stands N windows of 5 steps (0: never; "
                        "default 60)")
    g = p.add_argument_group("metrics", "/metrics, goodput and MFU")
    g.add_argument("--metrics-port", type=int, metavar="PORT",
                   help="serve Prometheus /metrics on PORT (0: a free one, printed and logged); default: off")
    g.add_argument("--metrics-addr", default="127.0.0.1", metavar="ADDR",
                   help="address of the metrics server (default 127.0.0.1; 0.0.0.0 for a remote Prometheus)")
    g.add_argument("--stall-alert-after", type=float, default=600.0, metavar="S",
                   help="exported alert threshold: seconds without a new step = stalled (default 600)")
    g.add_argument("--goodput-objective", type=float, default=0.9, metavar="R",
                   help="exported alert threshold: goodput ratio the run should keep (default 0.9)")
    g.add_argument("--ideal-step-time", type=float, metavar="S",
                   help="ideal step time for goodput (default: measured, mean of steps <= median + 3 MAD)")
    g.add_argument("--flops-per-step", type=float, metavar="F", help="model FLOPs of one step of the whole job (MFU)")
    g.add_argument("--peak-tflops", type=float, metavar="T",
                   help="peak TFLOP/s of one device (default: looked up by GPU name; needed on CPU for MFU)")
    p.add_argument("script", metavar="SCRIPT", help="training script (or module with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="arguments for SCRIPT")
    p.set_defaults(handler=cmd_run)


def _addresses(host: str) -> set[str]:
    """What ``host`` (a name or an address) resolves to here; empty when it does not resolve."""
    try:
        return {str(info[4][0]).split("%", 1)[0] for info in socket.getaddrinfo(host.strip("[]"), None)}
    except (OSError, UnicodeError):
        return set()


def loopback(host: str) -> bool:
    """Whether ``host`` resolves, and only to loopback addresses."""
    found = _addresses(host)
    return bool(found) and all(ipaddress.ip_address(a).is_loopback for a in found)


def remote(host: str) -> bool:
    """Whether ``host`` resolves, and to no loopback address (a name that does not resolve here is neither)."""
    found = _addresses(host)
    return bool(found) and not any(ipaddress.ip_address(a).is_loopback for a in found)


def check_reachable(local_addr: str, store: str, *, given: bool) -> None:
    """Refuse an address peers cannot reach: a loopback one while the store is on another machine (the nodes are
    then on other machines too, and each would probe its own loopback for this node)."""
    from ..coord.etcd import EtcdConfig

    hosts = [e.split("://", 1)[1].rsplit(":", 1)[0] for e in EtcdConfig.from_url(store).endpoints]
    if not loopback(local_addr) or not any(remote(h) for h in hosts):
        return
    source = "--local-addr" if given else f"this host's name ({socket.getfqdn()}, the default address)"
    raise ConfigError(
        f"{source} is {local_addr}, on loopback, but the store {store} is on another machine: its other nodes "
        "could not reach this node there. Pass --local-addr with an address they reach (this host's address on "
        "the cluster network; in Kubernetes the pod IP)")


def rendezvous_store(args: argparse.Namespace, max_nodes: int) -> str | None:
    """The control store URL from ``--store`` and torchrun's rendezvous flags, each meaning what it means under
    torchrun or refused with the fix: the nodes of a run meet through etcd, never a TCPStore."""
    store, backend, endpoint = args.store, args.rdzv_backend, args.rdzv_endpoint
    across = "across machines run etcd and give --store etcd://HOST:PORT (or --rdzv-backend etcd --rdzv-endpoint " \
             "HOST:PORT); on one machine leave the rendezvous flags out"
    if backend in ("etcd", "etcd-v3"):
        if endpoint is None and store is None:
            raise ConfigError(f"--rdzv-backend {backend} needs --rdzv-endpoint HOST:PORT (or --store etcd://...)")
        if endpoint is not None and store is not None and store != f"etcd://{endpoint}":
            raise ConfigError(f"--rdzv-endpoint {endpoint} and --store {store} name two stores: give one")
        store = store or f"etcd://{endpoint}"
    elif endpoint is not None:
        kind = backend or "static (torchrun's default)"
        raise ConfigError(f"--rdzv-endpoint {endpoint} with --rdzv-backend {kind}: torchrun's {backend or 'static'} "
                          f"rendezvous meets at a TCPStore on that host, which resilient run does not use; {across}")
    elif backend is not None and (store is not None or max_nodes > 1):
        raise ConfigError(f"--rdzv-backend {backend} across machines: resilient run's nodes meet through etcd, not "
                          f"torchrun's {backend} rendezvous; {across}")
    if args.standalone and (store is not None or max_nodes > 1):
        raise ConfigError("--standalone is one machine: drop it, or drop --store and --nnodes above 1")
    return store


def restart_arguments(text: str) -> list[str]:
    """``--restart-args``, split as a shell would."""
    try:
        return shlex.split(text)
    except ValueError as e:
        raise ConfigError(f"--restart-args {text!r}: {e}; quote it as a shell would, e.g. "
                          "--restart-args='--init_from=resume'") from None


def parse_nnodes(text: str, flag: str = "--nnodes") -> tuple[int, int]:
    """``N`` or ``MIN:MAX`` as (min, max)."""
    try:
        if ":" in text:
            lo, hi = text.split(":", 1)
            return int(lo), int(hi)
        return int(text), int(text)
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: give N or MIN:MAX, e.g. {flag} 2:3") from None


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str | None, flag: str) -> int | None:
    """``8G``, ``512M``, ``1073741824`` as bytes; None stays None."""
    if text is None:
        return None
    number, unit = text.strip().rstrip("iBb"), ""
    if number and number[-1].upper() in _UNITS:
        number, unit = number[:-1], number[-1].upper()
    try:
        value = float(number) * _UNITS[unit]
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: give a size in bytes, or with K, M, G or T, e.g. {flag} 8G") from None
    return int(value)


def parse_count(text: str, flag: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: give a number of steps, or auto") from None


def parse_seconds(text: str, flag: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: give a number of seconds, or auto") from None


def parse_sections(items: list[str]) -> dict[str, float]:
    found = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            if not sep or not name:
                raise ValueError
            found[name] = float(value)
        except ValueError:
            raise ConfigError(f"--section-timeout {item!r}: write SECTION=SECONDS, e.g. step=30") from None
    return found


def build_config(args: argparse.Namespace, environ: dict[str, str]) -> Any:
    from ..agent.config import AgentConfig
    from ..agent.health import HealthConfig
    from ..agent.policy import RestartConfig
    from ..agent.rendezvous import RendezvousTimeouts
    from ..coord.quarantine import QuarantineConfig
    from ..elastic.evict import EvictConfig
    from ..watchdog.sections import SectionTimeouts
    from ..watchdog.settings import apply as apply_settings
    from ..watchdog.slowdown import SlowdownConfig
    from ..watchdog.straggler import StragglerConfig
    from .detectors_cmd import parse_assignments

    min_nodes, max_nodes = parse_nnodes(args.nnodes)
    min_nproc, nproc = parse_nnodes(args.nproc_per_node, "--nproc-per-node")
    store = rendezvous_store(args, max_nodes)
    run_id, node_id = slurm_ids(args.run_id, args.node_id, environ)
    if store is not None and not run_id:
        raise ConfigError("--store needs --run-id: every node of the run must give the same one")
    run_id = run_id or time.strftime("run-%Y%m%d-%H%M%S")
    node_id = node_id or socket.gethostname().split(".")[0]
    local_addr = args.local_addr or ("127.0.0.1" if store is None else socket.getfqdn())
    if store is not None:
        check_reachable(local_addr, store, given=args.local_addr is not None)
    if args.no_python:
        entry = (args.script, *args.script_args)
    elif args.module:
        entry = (sys.executable, "-u", "-m", args.script, *args.script_args)
    else:
        if not Path(args.script).exists():
            raise ConfigError(f"training script {args.script} does not exist (use -m for a module)")
        entry = (sys.executable, "-u", args.script, *args.script_args)
    etcd: dict[str, Any] = {"outage_tolerance_s": args.store_outage_tolerance}
    if args.etcd_user:
        etcd["username"] = args.etcd_user
        etcd["password"] = environ.get(PASSWORD_ENV)
        if not etcd["password"]:
            raise ConfigError(f"--etcd-user needs the password in ${PASSWORD_ENV}")
    for key, value in (("ca_file", args.etcd_ca), ("cert_file", args.etcd_cert), ("key_file", args.etcd_key)):
        if value:
            etcd[key] = value
    sections: dict[str, Any] = {"explicit": parse_sections(args.section_timeout)}
    for key, value in (("factor", args.timeout_factor), ("warmup", args.timeout_warmup),
                       ("floor_s", args.timeout_floor)):
        if value is not None:
            sections[key] = value
    straggler, slowdown = apply_settings((StragglerConfig(), SlowdownConfig()), parse_assignments(args.detector))
    quarantine = QuarantineConfig(fleet=args.fleet, expiry_s=args.quarantine_expiry,
                                  straggler_windows=args.quarantine_after_windows,
                                  burn_in_min_ratio=args.burn_in_min_ratio, burn_in_at_start=args.burn_in,
                                  max_expiry_s=max(QuarantineConfig().max_expiry_s, args.quarantine_expiry))
    health: dict[str, Any] = {}
    if args.min_free_disk_gb is not None:
        health["min_free_disk_bytes"] = int(args.min_free_disk_gb * 2**30)
    if args.min_free_memory_gb is not None:
        health["min_free_memory_bytes"] = int(args.min_free_memory_gb * 2**30)
    return AgentConfig(
        entrypoint=entry, restart_args=tuple(restart_arguments(args.restart_args)), run_id=run_id, node_id=node_id, launch_id=launch_id_from(args.launch_id, environ),
        token_file=args.token_file.absolute() if args.token_file else None,
        run_dir=(args.run_dir or Path("runs") / run_id).absolute(),
        nproc_per_node=nproc, min_nproc_per_node=min_nproc if min_nproc != nproc else None, spares=args.spares,
        spare_nice=args.spare_nice,
        role=args.role, in_process=args.in_process, recovery_timeout_s=args.recovery_timeout, grow_settle_s=args.grow_settle, min_nodes=min_nodes, max_nodes=max_nodes, store_url=store,
        etcd_options=etcd if store else {}, local_addr=local_addr,
        restart=RestartConfig(max_restarts=args.max_restarts, crash_loop_restarts=args.crash_loop_restarts,
                              backoff_initial_s=args.restart_backoff, budget_scope=args.restart_budget_scope),
        sections=SectionTimeouts(**sections), health=HealthConfig(**health), health_paths=tuple(args.health_path),
        straggler=straggler, slowdown=slowdown, quarantine=quarantine,
        evict=EvictConfig(enabled=args.evict, after_windows=args.evict_after_windows, margin=args.evict_margin), burn_in_argv=tuple(args.burn_in_arg),
        rendezvous=RendezvousTimeouts(join_s=args.rdzv_join_timeout, last_call_s=args.rdzv_last_call),
        monitor_interval_s=args.monitor_interval, stop_grace_s=args.stop_grace, preempt_grace_s=args.preempt_grace,
        signalled_together_s=args.signalled_together, node_silence_s=args.node_silence_timeout,
        fault_plan=args.fault_plan.absolute() if args.fault_plan else None, echo_output=not args.quiet,
        worker_env={**{k: v for k, v in environ.items() if k != PASSWORD_ENV},  # the workers never need it
                    **({"RESILIENT_RESUME_CHECK": args.resume_check} if args.resume_check else {})},
        fork_server=args.fork_server, memory_tier=args.memory_tier,
        memory_root=args.memory_root.absolute(), memory_limit=parse_size(args.memory_limit, "--memory-limit"),
        memory_every=None if args.memory_every == "auto" else parse_count(args.memory_every, "--memory-every"),
        memory_replicas=args.memory_replicas, memory_pin_every=args.memory_pin_every,
        mtbf_s=None if args.mtbf in (None, "auto") else parse_seconds(args.mtbf, "--mtbf"),
        mtbf_from_history=args.mtbf == "auto",
        preload=tuple(m.strip() for m in args.preload.split(",") if m.strip()), metrics_port=args.metrics_port, metrics_addr=args.metrics_addr,
        stall_alert_after_s=args.stall_alert_after, goodput_objective=args.goodput_objective,
        ideal_step_s=args.ideal_step_time, flops_per_step=args.flops_per_step,
        peak_flops_per_device=args.peak_tflops * 1e12 if args.peak_tflops else None,
    )


def cmd_run(args: argparse.Namespace) -> int:
    from ..agent.supervisor import run_agent

    if args.config is not None:  # resilient's main() reads the file before parsing; a caller that did not, is wrong
        raise ConfigError("--config FILE is expanded before the command line is parsed: call resilient.cli.main.main()")
    config = build_config(args, dict(os.environ))
    print(f"resilient: run {config.run_id} node {config.node_id}: {config.nproc_per_node} worker(s); "
          f"run dir {config.run_dir}", file=sys.stderr, flush=True)
    result = run_agent(config)
    print(f"resilient: {result.verdict}: {result.reason} (generation {result.generation}, "
          f"restarts used {result.restarts_used}/{config.restart.max_restarts}); exit {result.exit_code}",
          file=sys.stderr, flush=True)
    return result.exit_code
