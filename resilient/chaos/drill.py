"""Drill files: a workload, a topology, a fault schedule and what must hold, as TOML (schema: ``chaos/README.md``).

A drill is data, read and checked here before anything starts, so a typo is
a :class:`DrillError` naming the file, the table, the key and the fix, not
a half-run drill::

    [drill]
    name = "kill-a-rank"
    seed = 7

    [workload]                     # the bundled reference workload unless script is given
    steps = 120
    checkpoint_every = 10

    [topology]
    nproc_per_node = 2
    spares = 1

    [[faults]]                     # or [random]: count, kinds, first_step (drawn from the seed)
    kind = "kill"
    rank = 1
    step = 40

    [expect]
    detected_within_s = 5
    resumed_within_s = 30
    max_redone_steps = 0
    rung = "promote_spare"
    equal = "bitwise"
    min_goodput = 0.5

Pure: :func:`load_drill` reads one file and :meth:`Drill.plan` gives the
fault plan; the same file and seed always give the same schedule.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import tomllib

from ..core.errors import ConfigError
from ..faults.plan import FAULT_KINDS, Fault, FaultPlan, FaultPlanError, parse_faults
from .gameday import GameDay
from .host_faults import NETWORK_FAULTS, STORAGE_FAULTS, HostFault, HostFaultError, parse_host_faults

RUNGS = ("retry_in_place", "promote_spare", "shrink", "restart")
"""What an expectation's ``rung`` may name: the recovery ladder's rungs, cheapest first."""
EQUALITY = ("bitwise", "none")
STORAGE = ("local", "s3")
NETWORKS = ("loopback", "netns")
REFERENCE_WORKLOAD = "reference"
"""``workload.script`` for the bundled workload (:mod:`resilient.chaos.workload`)."""


class DrillError(ConfigError):
    """A drill file is invalid: the message names the file, the key and the fix."""


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What trains during the drill."""

    script: str = REFERENCE_WORKLOAD
    """A training script (relative to the drill file), or "reference" for the bundled workload."""
    args: tuple[str, ...] = ()
    """Arguments for a script of the user's (the bundled workload takes the fields below)."""
    steps: int = 120
    checkpoint_every: int = 10
    step_sleep_s: float = 0.0
    """Extra seconds per step of the bundled workload (a slower step gives detectors room to see)."""
    own_group: bool = False
    """The bundled workload makes a process group of its own, as many scripts do: in-process recovery is
    declined, so every failure restarts (from the newest checkpoint, a spare node taking a lost node's place)."""


@dataclass(frozen=True, kw_only=True)
class Topology:
    """What the runner brings up on this machine."""

    nodes: int = 1
    """Nodes of the world: one agent each (``--node-id n0``, ``n1``, ...); more than one meet through an etcd
    the runner starts on loopback."""
    nproc_per_node: int = 2
    spare_nodes: int = 0
    """Agents started as ``--role spare`` (``spare0``, ...): hot-standby nodes in the launch's pool."""
    min_nodes: int | None = None
    """Fewest nodes the run may shrink to (``--nnodes MIN:MAX``); None: the world keeps every node."""
    spares: int = 0
    """Warm spare processes on the node (in-process promotion)."""
    min_ranks: int | None = None
    """Smallest world the run may shrink to (``--nproc-per-node MIN:MAX``); None: no shrinking."""
    section_timeouts: tuple[tuple[str, float], ...] = ()
    """Per-section hang timeouts (``--section-timeout NAME=S``), e.g. (("step", 3.0),)."""
    agent_args: tuple[str, ...] = ()
    """Further ``resilient run`` flags, as given."""
    network: str = "loopback"
    """How the nodes reach each other: "loopback", or "netns" (a network namespace per node on a bridge of their
    own, :mod:`resilient.chaos.netns`: the network faults need it)."""
    storage: str = "local"
    """Where the faulted run checkpoints: "local" (a directory), or "s3" (a bucket on moto's S3 server on loopback,
    through the fault proxy of :mod:`resilient.chaos.s3proxy`)."""
    monitoring: bool = False
    """Prometheus (scraping the agent) and Alertmanager (the shipped rules and routes) for the faulted run."""
    alert_for_s: float = 1.0
    """Every alert rule's ``for:`` is cut to this for the drill (the production values outlast a drill)."""


@dataclass(frozen=True, kw_only=True)
class Expect:
    """What must hold after the drill; every field left out is not checked."""

    detected_within_s: float | None = None
    """From the fault's injection to the agent's detection (a failed or hung worker, a straggler flag)."""
    resumed_within_s: float | None = None
    """From the detection to training going on (recovered in process, or the restarted workers' restore)."""
    max_redone_steps: int | None = None
    """Steps computed again after the recovery (0 for an in-process rung, up to a checkpoint interval after a
    restart)."""
    rung: str | None = None
    """The recovery rung that must have answered the first fault."""
    equal: str = "none"
    """``bitwise``: the final parameters and optimizer state equal those of an uninterrupted reference run."""
    min_goodput: float | None = None
    """Goodput (productive share of the wall time, from the ledger) at least this."""
    exit_code: int = 0
    """The agent's exit status."""
    events: tuple[str, ...] = ()
    """Event kinds that must occur (e.g. "straggler_flagged")."""
    no_events: tuple[str, ...] = ()
    """Event kinds that must not occur."""
    alerts: tuple[str, ...] = ()
    """Alerts that must reach a receiver firing (needs ``[topology] monitoring = true``)."""
    no_alerts: tuple[str, ...] = ()
    """Alerts that must not."""
    alerted_within_s: float | None = None
    """From the first fault to each expected alert's first firing notification."""


@dataclass(frozen=True, kw_only=True)
class RandomFaults:
    """A seeded random schedule: ``count`` faults of ``kinds`` on random ranks and steps."""

    count: int = 1
    kinds: tuple[str, ...] = ("kill",)
    first_step: int = 10
    hang_s: float | None = None


@dataclass(frozen=True, kw_only=True)
class Drill:
    """One drill file, checked."""

    name: str
    path: Path
    description: str = ""
    seed: int = 0
    workload: Workload = field(default_factory=Workload)
    topology: Topology = field(default_factory=Topology)
    faults: tuple[Fault, ...] = ()
    host_faults: tuple[HostFault, ...] = ()
    """Faults the runner injects from outside the workers (cgroups, the checkpoint store), as listed."""
    gameday: GameDay | None = None
    """A seeded random schedule of rank kills at an MTBF, scored against the Young/Daly prediction."""
    random: RandomFaults | None = None
    expect: Expect = field(default_factory=Expect)
    timeout_s: float = 300.0
    """The most the faulted run may take before the drill fails (and everything is torn down)."""

    @property
    def world(self) -> int:
        return self.topology.nodes * self.topology.nproc_per_node

    def plan(self) -> FaultPlan:
        """The fault schedule: the listed faults, or the seeded random ones (same seed, same schedule)."""
        if self.random is None:
            return FaultPlan(faults=self.faults, seed=self.seed)
        r = self.random
        return FaultPlan.random(self.seed, world_size=self.world, steps=self.workload.steps, count=r.count,
                                kinds=r.kinds, first_step=r.first_step, hang_s=r.hang_s)

    def quick(self, factor: int = 3) -> Drill:
        """This drill for CI: a game day ``factor`` times shorter (its duration and its workload's steps);
        any other drill unchanged."""
        if self.gameday is None:
            return self
        day = replace(self.gameday, duration_s=self.gameday.duration_s / factor)
        if day.start_after_s >= day.duration_s:
            raise DrillError(f"drill {self.path}: --quick leaves [gameday] no time after start_after_s = "
                             f"{day.start_after_s:g}; lower it, or run without --quick")
        return replace(self, gameday=day, workload=replace(self.workload, steps=-(-self.workload.steps // factor)))

    @property
    def all_host_faults(self) -> tuple[HostFault, ...]:
        """The listed host faults, then the game day's kills (drawn from the seed)."""
        drawn = () if self.gameday is None else self.gameday.schedule(self.seed, self.world)
        return (*self.host_faults, *drawn)

    @property
    def clustered(self) -> bool:
        """Whether the runner brings up several agents meeting through etcd (more nodes, or spare nodes)."""
        return self.topology.nodes > 1 or self.topology.spare_nodes > 0

    @property
    def needs_reference(self) -> bool:
        """Whether the uninterrupted reference runs first (equality, or the game day's baseline)."""
        return self.expect.equal == "bitwise" or self.gameday is not None

    def script_path(self) -> Path | None:
        """The user's script (None: the bundled workload)."""
        if self.workload.script == REFERENCE_WORKLOAD:
            return None
        return (self.path.parent / self.workload.script).resolve()


TABLES = ("drill", "workload", "topology", "faults", "host_faults", "random", "gameday", "expect")


def load_drill(path: str | os.PathLike[str]) -> Drill:
    """Read and check a drill file; :class:`DrillError` names the file, the key and the fix."""
    p = Path(path)
    try:
        raw = tomllib.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise DrillError(f"cannot read drill {p}: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise DrillError(f"drill {p} is not valid TOML ({e}); fix the syntax") from None
    try:
        return _drill(raw, p)
    except DrillError as e:
        raise DrillError(f"drill {p}: {e}") from None


def _drill(raw: Mapping[str, Any], path: Path) -> Drill:
    unknown = sorted(set(raw) - set(TABLES))
    if unknown:
        raise DrillError(f"[{unknown[0]}]: unknown table; a drill has {', '.join(TABLES)}")
    head = _table(raw, "drill")
    if "name" not in head:
        raise DrillError("[drill] name: missing; give the drill a name, e.g. name = \"kill-a-rank\"")
    known = {"name", "description", "seed", "timeout_s"}
    _known("drill", head, known)
    name = _str("drill", "name", head["name"])
    seed = _int("drill", "seed", head.get("seed", 0), minimum=None)
    timeout = _num("drill", "timeout_s", head.get("timeout_s", 300.0), positive=True)
    workload = _build(Workload, "workload", _table(raw, "workload"))
    topology = _build(Topology, "topology", _table(raw, "topology"))
    expect = _build(Expect, "expect", _table(raw, "expect"))
    if "faults" in raw and "random" in raw:
        raise DrillError("[[faults]] and [random]: give one schedule, not both")
    faults_raw = raw.get("faults", [])
    if not isinstance(faults_raw, list):
        raise DrillError("faults: write each fault as a [[faults]] table")
    try:
        faults = parse_faults(faults_raw, lambda i: f"[[faults]] #{i + 1}: ")
    except FaultPlanError as e:
        raise DrillError(str(e)) from None
    try:
        host = parse_host_faults(raw.get("host_faults", []))
    except HostFaultError as e:
        raise DrillError(str(e)) from None
    rnd = _build(RandomFaults, "random", _table(raw, "random")) if "random" in raw else None
    if "gameday" in raw and "random" in raw:
        raise DrillError("[gameday] and [random]: give one random schedule, not both")
    day = _gameday(_table(raw, "gameday")) if "gameday" in raw else None
    drill = Drill(name=name, path=path, description=str(head.get("description", "")), seed=seed, workload=workload,
                  topology=topology, faults=faults, host_faults=host, gameday=day, random=rnd, expect=expect,
                  timeout_s=timeout)
    _check(drill)
    return drill


def _check(d: Drill) -> None:
    w, t, e = d.workload, d.topology, d.expect
    if w.steps < 1 or w.checkpoint_every < 1:
        raise DrillError("[workload] steps and checkpoint_every must be >= 1")
    if w.step_sleep_s < 0:
        raise DrillError(f"[workload] step_sleep_s = {w.step_sleep_s}: must be seconds >= 0")
    if w.args and w.script == REFERENCE_WORKLOAD:
        raise DrillError("[workload] args: the bundled workload takes steps, checkpoint_every, step_sleep_s and "
                         "own_group; "
                         "args are for a script of yours (script = \"train.py\")")
    if t.nodes < 1 or t.spare_nodes < 0:
        raise DrillError(f"[topology] nodes = {t.nodes}, spare_nodes = {t.spare_nodes}: nodes must be >= 1 and "
                         "spare_nodes >= 0")
    if t.min_nodes is not None and not 1 <= t.min_nodes <= t.nodes:
        raise DrillError(f"[topology] min_nodes = {t.min_nodes}: must be between 1 and nodes ({t.nodes})")
    if t.network not in NETWORKS:
        raise DrillError(f"[topology] network = {t.network!r}: use one of {', '.join(NETWORKS)}")
    if t.network == "netns" and not d.clustered:
        raise DrillError("[topology] network = \"netns\" puts each node in a namespace of its own: give nodes = 2 "
                         "or more")
    if t.network == "netns" and t.monitoring:
        raise DrillError("[topology] network = \"netns\" and monitoring = true: Prometheus cannot reach agents in "
                         "namespaces yet; run monitoring drills on loopback")
    if t.storage not in STORAGE:
        raise DrillError(f"[topology] storage = {t.storage!r}: use one of {', '.join(STORAGE)}")
    if t.storage == "s3" and w.script != REFERENCE_WORKLOAD:
        raise DrillError("[topology] storage = \"s3\" points the bundled workload's checkpoints at the drill's S3 "
                         "server; a script of yours keeps its checkpoints where it does: leave storage out")
    if t.nodes > 1 and t.min_ranks is not None:
        raise DrillError("[topology] min_ranks shrinks the ranks of one node; across nodes give min_nodes")
    if t.nproc_per_node < 1 or t.spares < 0:
        raise DrillError("[topology] nproc_per_node must be >= 1 and spares >= 0")
    if t.min_ranks is not None and not 1 <= t.min_ranks <= t.nproc_per_node:
        raise DrillError(f"[topology] min_ranks = {t.min_ranks}: must be between 1 and nproc_per_node "
                         f"({t.nproc_per_node})")
    if (e.alerts or e.no_alerts or e.alerted_within_s is not None) and not t.monitoring:
        raise DrillError("[expect] alerts, no_alerts and alerted_within_s need Prometheus and Alertmanager: set "
                         "[topology] monitoring = true")
    if e.alerted_within_s is not None and not e.alerts:
        raise DrillError("[expect] alerted_within_s: name the alerts it applies to, e.g. alerts = [\"HangDetected\"]")
    if t.alert_for_s <= 0:
        raise DrillError(f"[topology] alert_for_s = {t.alert_for_s}: must be seconds > 0")
    if e.rung is not None and e.rung not in RUNGS:
        raise DrillError(f"[expect] rung = {e.rung!r}: use one of {', '.join(RUNGS)}")
    if e.equal not in EQUALITY:
        raise DrillError(f"[expect] equal = {e.equal!r}: use one of {', '.join(EQUALITY)}")
    if e.min_goodput is not None and not 0 <= e.min_goodput <= 1:
        raise DrillError(f"[expect] min_goodput = {e.min_goodput}: a share between 0 and 1")
    for i, fault in enumerate(d.faults):
        if fault.rank is not None and fault.rank >= d.world:
            raise DrillError(f"[[faults]] #{i + 1}: rank {fault.rank} is outside the world of {d.world} ranks")
        if fault.step >= w.steps:
            raise DrillError(f"[[faults]] #{i + 1}: step {fault.step} is past the workload's {w.steps} steps")
    if d.random is not None:
        bad = [k for k in d.random.kinds if k not in FAULT_KINDS]
        if bad:
            raise DrillError(f"[random] kinds: {bad[0]!r} is not a fault kind; use {', '.join(FAULT_KINDS)}")
    for i, hf in enumerate(d.host_faults):
        where = f"[[host_faults]] #{i + 1} ({hf.kind}): "
        if hf.rank >= d.world:
            raise DrillError(f"{where}rank {hf.rank} is outside the world of {d.world} ranks")
        if hf.step is not None and hf.step >= w.steps:
            raise DrillError(f"{where}step {hf.step} is past the workload's {w.steps} steps")
        if hf.step is not None and w.script != REFERENCE_WORKLOAD:
            raise DrillError(f"{where}step = {hf.step} reads the bundled workload's trace (and its checkpoint "
                             "directory); with a script of yours, trigger by time: at_s = SECONDS")
        if hf.kind in STORAGE_FAULTS and t.storage != "s3":
            raise DrillError(f"{where}acts on the drill's S3 endpoint: give [topology] storage = \"s3\"")
        if hf.kind in ("fill_disk", "corrupt_checkpoint", "truncate_checkpoint") and t.storage != "local":
            raise DrillError(f"{where}acts on a local checkpoint directory: leave [topology] storage out")
        if hf.kind in NETWORK_FAULTS and t.network != "netns":
            raise DrillError(f"{where}acts on the network between nodes: give [topology] network = \"netns\"")
        if hf.kind == "resubmit" and (d.clustered or w.script != REFERENCE_WORKLOAD):
            raise DrillError(f"{where}resubmits the bundled workload on one node: leave out nodes, spare_nodes and "
                             "script")
        if hf.kind in ("kill_node", "store_outage") and not d.clustered:
            raise DrillError(f"{where}needs agents meeting through etcd: give [topology] nodes = 2 or more")
    if d.gameday is not None and (t.spares or t.min_ranks is not None or t.spare_nodes or t.min_nodes is not None):
        raise DrillError("[gameday] measures restarts against Young/Daly: leave out [topology] spares, spare_nodes, "
                         "min_ranks and min_nodes")
    if not d.faults and not d.host_faults and d.random is None and d.gameday is None:
        raise DrillError("no faults: add a [[faults]] table (kind, step, rank, ...), a [[host_faults]] table or a "
                         "[random] schedule")


def _gameday(values: Mapping[str, Any]) -> GameDay:
    _known("gameday", values, {"duration_s", "mtbf_s", "start_after_s", "max_error"})
    for key in ("duration_s", "mtbf_s"):
        if key not in values:
            raise DrillError(f"[gameday] {key}: missing; a game day needs duration_s and mtbf_s (seconds)")
    nums = {k: _num("gameday", k, v, positive=k in ("duration_s", "mtbf_s")) for k, v in values.items()}
    day = GameDay(**nums)
    if day.start_after_s >= day.duration_s:
        raise DrillError(f"[gameday] start_after_s = {day.start_after_s:g} leaves no time before duration_s = "
                         f"{day.duration_s:g}")
    return day


def _table(raw: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = raw.get(name, {})
    if not isinstance(value, Mapping):
        raise DrillError(f"{name}: must be a table [{name}]")
    return value


def _known(table: str, values: Mapping[str, Any], known: set[str]) -> None:
    unknown = sorted(set(values) - known)
    if unknown:
        raise DrillError(f"[{table}] {unknown[0]}: unknown key; [{table}] has {', '.join(sorted(known))}")


def _build(cls: Any, table: str, values: Mapping[str, Any]) -> Any:
    """``cls`` from a table: every key known, each value of its field's type (lists become tuples)."""
    specs = {f.name: f for f in fields(cls)}
    _known(table, values, set(specs))
    out: dict[str, Any] = {}
    for key, value in values.items():
        default = getattr(cls(), key)
        if isinstance(default, tuple):
            if not isinstance(value, list):
                raise DrillError(f"[{table}] {key} = {value!r}: must be a list")
            if key == "section_timeouts":
                value = tuple(_timeout(table, v) for v in value)
            else:
                value = tuple(_str(table, key, v) for v in value)
        elif isinstance(default, bool):
            if not isinstance(value, bool):
                raise DrillError(f"[{table}] {key} = {value!r}: must be true or false")
        elif isinstance(default, int) or (default is None and key in _INTS):
            value = _int(table, key, value, minimum=0)
        elif isinstance(default, float) or (default is None and key in _FLOATS):
            value = _num(table, key, value, positive=False)
        elif isinstance(default, str) or (default is None and key in _STRS):
            value = _str(table, key, value)
        out[key] = value
    return cls(**out)


_INTS = {"max_redone_steps", "min_ranks", "min_nodes"}
_FLOATS = {"detected_within_s", "resumed_within_s", "min_goodput", "hang_s", "alerted_within_s"}
_STRS = {"rung"}


def _timeout(table: str, value: Any) -> tuple[str, float]:
    if not isinstance(value, str) or "=" not in value:
        raise DrillError(f"[{table}] section_timeouts: {value!r} must be \"SECTION=SECONDS\", e.g. \"step=3\"")
    name, seconds = value.split("=", 1)
    try:
        return name, float(seconds)
    except ValueError:
        raise DrillError(f"[{table}] section_timeouts: {value!r}: {seconds!r} is not a number of seconds") from None


def _str(table: str, key: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise DrillError(f"[{table}] {key} = {value!r}: must be a non-empty string")
    return value


def _int(table: str, key: str, value: Any, *, minimum: int | None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
        raise DrillError(f"[{table}] {key} = {value!r}: must be an integer" + (f" >= {minimum}" if minimum is not None
                                                                              else ""))
    return value


def _num(table: str, key: str, value: Any, *, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0 \
            or (positive and value == 0):
        raise DrillError(f"[{table}] {key} = {value!r}: must be a number {'> 0' if positive else '>= 0'}")
    return float(value)
