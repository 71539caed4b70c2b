"""A deployment topology: one TOML file that every target renders with the same meaning.

The file says what runs (a script and its arguments), on how many nodes with
how many processes each, how many spare nodes stand by, where the nodes
meet (etcd endpoints, or an etcd the target runs itself), where checkpoints
go, and how metrics are scraped::

    [run]
    id = "llm-7b"                  # shared by every node; names the run directory
    script = "train.py"            # run by every agent (relative to workdir)
    args = ["--config", "c.yaml"]
    workdir = "/work"              # where the script and runs/ are, on every host
    image = "resilient-agent:0.1"  # the agent image (k8s, compose)

    [nodes]
    count = 4                      # or "2:4": train on as few as 2 after losing some
    nproc_per_node = 8
    spares = 1                     # spare nodes: agents with --role spare
    max_restarts = 3

    [store]
    etcd = ["10.0.0.5:2379"]       # or leave out: the target runs etcd (3 members on k8s)

    [checkpoint]
    dir = "s3://bucket/llm-7b"
    endpoint_url = "http://minio:9000"

    [metrics]
    port = 9400                    # every agent's /metrics, on addr (default 0.0.0.0)

Pure: :func:`load_topology` reads and checks a file (a :class:`TopologyError`
naming the table, the key and the fix); :mod:`resilient.deploy.render`
writes the targets' files from a :class:`Topology`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from ..core.errors import ConfigError

NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?$")
"""What a run id must look like: it names Kubernetes objects, Slurm jobs and systemd units (DNS-1123, short)."""
ENDPOINT = re.compile(r"^[A-Za-z0-9.-]+:[0-9]{1,5}$")


class TopologyError(ConfigError):
    """A topology file is invalid: the message names the file, the key and the fix."""


@dataclass(frozen=True, kw_only=True)
class Topology:
    """One deployment, as every target reads it."""

    run_id: str
    script: str
    args: tuple[str, ...] = ()
    module: bool = False
    """``script`` names a module (``python -m``)."""
    workdir: str = "/work"
    image: str = "resilient-agent:latest"
    python: str = "python3"
    """The interpreter on the hosts (Slurm, systemd), where ``resilient`` is installed."""
    min_nodes: int = 1
    nodes: int = 1
    nproc_per_node: int = 1
    spare_nodes: int = 0
    max_restarts: int = 3
    etcd: tuple[str, ...] = ()
    """HOST:PORT of each etcd member; empty: the target runs etcd (k8s: 3 members, compose: 1), or, on one
    node without spares, the agent's embedded store."""
    checkpoint_dir: str = ""
    """Where the script's checkpoints go (the script's own arguments say so; a local directory is the agents'
    --health-path); empty: not given."""
    checkpoint_endpoint: str = ""
    metrics_port: int = 9400
    """Every agent's /metrics port (0: a free one, for Slurm and systemd; Kubernetes and compose scrape a fixed
    one)."""
    metrics_addr: str = "0.0.0.0"
    """The address the agents serve /metrics on (every interface, for a Prometheus on another host)."""
    extra_agent_args: tuple[str, ...] = ()
    """More ``resilient run`` options, the same on every node (e.g. ``--section-timeout step=600``)."""
    slurm: Mapping[str, str] = field(default_factory=dict)
    """#SBATCH options by name (partition, account, time, ...)."""
    namespace: str = "default"
    """Kubernetes namespace."""

    @property
    def node_range(self) -> str:
        """``--nnodes`` as the agent takes it."""
        return str(self.nodes) if self.min_nodes == self.nodes else f"{self.min_nodes}:{self.nodes}"

    @property
    def total_nodes(self) -> int:
        return self.nodes + self.spare_nodes

    @property
    def embedded(self) -> bool:
        """One node, no spares and no etcd given: the agent's own store, nothing to deploy beside it."""
        return not self.etcd and self.total_nodes == 1


_TABLES = {
    "run": {"id", "script", "args", "module", "workdir", "image", "python", "agent_args"},
    "nodes": {"count", "nproc_per_node", "spares", "max_restarts"},
    "store": {"etcd"},
    "checkpoint": {"dir", "endpoint_url"},
    "metrics": {"port", "addr"},
    "slurm": None,  # any #SBATCH option
    "k8s": {"namespace"},
}


def load_topology(path: str | Path) -> Topology:
    """Read and check a topology file; :class:`TopologyError` names the problem and the fix."""
    p = Path(path)
    try:
        raw = tomllib.loads(p.read_text())
    except OSError as e:
        raise TopologyError(f"{p}: cannot read the topology file ({e.strerror})") from e
    except tomllib.TOMLDecodeError as e:
        raise TopologyError(f"{p}: is not valid TOML ({e})") from e
    try:
        return parse_topology(raw)
    except TopologyError as e:
        raise TopologyError(f"{p}: {e}") from None


def parse_topology(raw: Mapping[str, Any]) -> Topology:
    for name in raw:
        if name not in _TABLES:
            raise TopologyError(f"[{name}]: unknown table; a topology has {', '.join(f'[{t}]' for t in _TABLES)}")
    tables = {name: _table(raw, name) for name in _TABLES}
    for name, known in _TABLES.items():
        unknown = sorted(set(tables[name]) - known) if known is not None else []
        if unknown:
            raise TopologyError(f"[{name}] {unknown[0]}: unknown key; [{name}] has {', '.join(sorted(known or ()))}")
    run, nodes, store = tables["run"], tables["nodes"], tables["store"]
    for key in ("id", "script"):
        if key not in run:
            raise TopologyError(f"[run] {key}: missing; a topology needs [run] id and script")
    run_id = _str("run", "id", run["id"])
    if not NAME.match(run_id):
        raise TopologyError(f"[run] id = {run_id!r}: use 1 to 40 lower-case letters, digits and '-', starting and "
                            "ending with a letter or digit (it names Kubernetes objects and systemd units)")
    min_nodes, count = _count(nodes.get("count", 1))
    etcd = tuple(_str("store", "etcd", e) for e in _list("store", "etcd", store.get("etcd", [])))
    for e in etcd:
        if not ENDPOINT.match(e):
            raise TopologyError(f"[store] etcd: {e!r} is not HOST:PORT (e.g. \"10.0.0.5:2379\")")
    slurm = {}
    for key, value in tables["slurm"].items():
        if not re.match(r"^[a-z][a-z-]*$", key):
            raise TopologyError(f"[slurm] {key}: not an sbatch option name (e.g. partition, account, time)")
        if not isinstance(value, (str, int)) or isinstance(value, bool) or "\n" in str(value):
            raise TopologyError(f"[slurm] {key} = {value!r}: give the option's value as a string or a number")
        if key in ("nodes", "ntasks-per-node", "requeue", "job-name", "output", "signal"):
            raise TopologyError(f"[slurm] {key}: set by the rendered script from the topology; leave it out")
        slurm[key] = str(value)
    namespace = _str("k8s", "namespace", tables["k8s"].get("namespace", "default"))
    if not NAME.match(namespace):
        raise TopologyError(f"[k8s] namespace = {namespace!r}: not a Kubernetes namespace name")
    port = _int("metrics", "port", tables["metrics"].get("port", 9400), minimum=0)
    if port > 65535:
        raise TopologyError(f"[metrics] port = {port}: a port is at most 65535")
    return Topology(
        run_id=run_id,
        script=_str("run", "script", run["script"]),
        args=tuple(_str("run", "args", a) for a in _list("run", "args", run.get("args", []))),
        module=_bool("run", "module", run.get("module", False)),
        workdir=_str("run", "workdir", run.get("workdir", "/work")),
        image=_str("run", "image", run.get("image", "resilient-agent:latest")),
        python=_str("run", "python", run.get("python", "python3")),
        extra_agent_args=tuple(_str("run", "agent_args", a) for a in _list("run", "agent_args",
                                                                              run.get("agent_args", []))),
        min_nodes=min_nodes,
        nodes=count,
        nproc_per_node=_int("nodes", "nproc_per_node", nodes.get("nproc_per_node", 1), minimum=1),
        spare_nodes=_int("nodes", "spares", nodes.get("spares", 0), minimum=0),
        max_restarts=_int("nodes", "max_restarts", nodes.get("max_restarts", 3), minimum=0),
        etcd=etcd,
        checkpoint_dir=_opt("checkpoint", "dir", tables["checkpoint"]),
        checkpoint_endpoint=_opt("checkpoint", "endpoint_url", tables["checkpoint"]),
        metrics_port=port,
        metrics_addr=_str("metrics", "addr", tables["metrics"].get("addr", "0.0.0.0")),
        slurm=slurm,
        namespace=namespace,
    )


def _table(raw: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = raw.get(name, {})
    if not isinstance(value, Mapping):
        raise TopologyError(f"{name}: must be a table [{name}]")
    return value


def _str(table: str, key: str, value: Any) -> str:
    if not isinstance(value, str) or not value or "\n" in value or "\x00" in value:
        raise TopologyError(f"[{table}] {key} = {value!r}: must be a non-empty string on one line")
    return value


def _opt(table: str, key: str, values: Mapping[str, Any]) -> str:
    return _str(table, key, values[key]) if key in values else ""


def _list(table: str, key: str, value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise TopologyError(f"[{table}] {key} = {value!r}: must be a list")
    return value


def _bool(table: str, key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TopologyError(f"[{table}] {key} = {value!r}: must be true or false")
    return value


def _int(table: str, key: str, value: Any, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TopologyError(f"[{table}] {key} = {value!r}: must be an integer >= {minimum}")
    return value


def _count(value: Any) -> tuple[int, int]:
    """``count = 4`` or ``count = "2:4"`` (MIN:MAX) -> (min, max)."""
    if isinstance(value, str) and re.match(r"^[0-9]+:[0-9]+$", value):
        low, high = (int(x) for x in value.split(":"))
        if not 1 <= low <= high:
            raise TopologyError(f"[nodes] count = {value!r}: MIN:MAX needs 1 <= MIN <= MAX")
        return low, high
    n = _int("nodes", "count", value, minimum=1) if not isinstance(value, str) else None
    if n is None:
        raise TopologyError(f"[nodes] count = {value!r}: give a number of nodes, or \"MIN:MAX\"")
    return n, n
