"""What every deploy target shares: the agents' command line, their environment, the store URL, YAML output,
the shipped alert rules, and the exit codes that end a run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..core.errors import ConfigError
from ..core.exitcodes import EXIT_CONFIG, EXIT_STOPPED, EXIT_UNRECOVERABLE
from .topology import Topology

NO_RESTART = (EXIT_STOPPED, EXIT_CONFIG, EXIT_UNRECOVERABLE)
ETCD_IMAGE = "gcr.io/etcd-development/etcd:v3.5.17"


def agent_args(t: Topology, *, node_id: str, store: str | None, spare: bool = False,
               local_addr: str | None = None, run_dir: str | None = None, burn_in: bool = False) -> list[str]:
    """``resilient run`` options and the script, for one agent (the words after ``resilient``)."""
    args = ["run", "--run-id", t.run_id, "--node-id", node_id, "--nnodes", t.node_range,
            "--nproc-per-node", str(t.nproc_per_node), "--max-restarts", str(t.max_restarts),
            "--metrics-port", str(t.metrics_port), "--metrics-addr", t.metrics_addr]
    if store:
        args += ["--store", store]
    if spare:
        args += ["--role", "spare"]
    if local_addr:
        args += ["--local-addr", local_addr]
    if run_dir:
        args += ["--run-dir", run_dir]
    if t.checkpoint_dir and "://" not in t.checkpoint_dir:
        args += ["--health-path", t.checkpoint_dir]
    if burn_in:
        args += ["--burn-in"]
    args += list(t.extra_agent_args)
    args += (["-m"] if t.module else []) + [t.script, *t.args]
    return args



def store_url(endpoints: list[str]) -> str:
    return "etcd://" + ",".join(endpoints)


def environment(t: Topology) -> dict[str, str]:
    env = {"PYTHONUNBUFFERED": "1"}
    if t.checkpoint_endpoint:
        env["RESILIENT_S3_ENDPOINT_URL"] = t.checkpoint_endpoint
        env["AWS_ENDPOINT_URL_S3"] = t.checkpoint_endpoint
    return env


def to_yaml(docs: list[dict[str, Any]], header: str) -> str:
    try:
        import yaml
    except ImportError as e:
        raise ConfigError("rendering YAML needs PyYAML: pip install 'resilient-train[deploy]'") from e

    class Plain(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:  # every value written out: a hand-editable file
            return True

    body = "---\n".join(yaml.dump(d, Dumper=Plain, sort_keys=False, default_flow_style=False, width=110)
                         for d in docs)
    return f"# {header}\n{body}"


def alert_groups(assets: Path) -> list[dict[str, Any]]:
    import yaml

    path = assets / "prometheus" / "alerts.yml"
    try:
        return list(yaml.safe_load(path.read_text())["groups"])
    except (OSError, KeyError, TypeError) as e:
        raise ConfigError(f"cannot read the shipped alert rules at {path} ({e}); reinstall resilient-train") from e


def fixed_port(t: Topology, target: str) -> None:
    if t.metrics_port == 0:
        raise ConfigError(f"--target {target} scrapes every agent on a fixed port: give [metrics] port (e.g. 9400)")
