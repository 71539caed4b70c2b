"""What this node's agent was started with: ``<run_dir>/nodes/<node>/launch.json``.

Written once at the agent's start, for whoever investigates an incident
later (``resilient incident bundle`` puts it in the bundle): the agent's
command line, its working directory, the worker command, the settings, and
the versions of Python, torch and resilient.  Never a secret: the run token
is not in it (only where its file is), an etcd password is dropped, of the
workers' extra environment only the names are kept, and the values of
secret flags in the command lines (:mod:`resilient.core.redact`: ``--api-token
X`` and the like) are replaced by ``<redacted>``.  Those values go to
``secrets.json`` beside it (mode 0600, like the run token) so that
``resilient incident bundle`` can scrub them from the logs it bundles.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import __version__
from ..core.fsutil import read_json, write_json_atomic
from ..core.redact import redact_argv, secret_name, secret_values

if TYPE_CHECKING:
    from .config import AgentConfig
    from .rundir import RunDir

LAUNCH_FILE = "launch.json"
SECRETS_FILE = "secrets.json"


def _public(value: Any) -> Any:
    """``value`` as JSON, every setting whose name says it is a secret left out."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): _public(v) for k, v in value.items() if not secret_name(str(k))}
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return redact_argv(value)  # a command line (the entrypoint, --restart-args, --burn-in-arg): flag values hidden
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_public(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def launch_record(config: AgentConfig) -> dict[str, Any]:
    """The record for ``config`` (no secret in it)."""
    settings = _public(config)
    settings["worker_env"] = sorted(config.worker_env)  # names only: their values may be secrets
    torch = sys.modules.get("torch")
    return {"time": time.time(), "argv": redact_argv(sys.argv), "cwd": os.getcwd(),
            "entrypoint": redact_argv(config.entrypoint),
            "settings": settings,
            "versions": {"resilient": __version__, "python": platform.python_version(),
                         "torch": getattr(torch, "__version__", None) or _torch_version(),
                         "platform": platform.platform()}}


def _torch_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")  # without importing it: the agent does not need torch
    except PackageNotFoundError:
        return None


def write_launch_record(run_dir: RunDir, config: AgentConfig) -> Path | None:
    """Write the record; a record for later never stops the run (what failed goes to stderr)."""
    path = run_dir.node_dir / LAUNCH_FILE
    try:
        hidden = secret_values(sys.argv) + secret_values(config.entrypoint)
        if hidden:
            _write_private(run_dir.node_dir / SECRETS_FILE, json.dumps(sorted(set(hidden))))
        write_json_atomic(path, launch_record(config), indent=1)
    except Exception as e:  # noqa: BLE001 - whatever failed, the run goes on without its launch record
        print(f"resilient: could not write {path}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return None
    return path


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(text)


def read_secrets(root: Path, node: str) -> list[str]:
    """The secret flag values this node's agent and workers were started with (to scrub them)."""
    found = read_json(root / "nodes" / node / SECRETS_FILE)
    return [str(v) for v in found] if isinstance(found, list) else []


def read_launch_record(root: Path, node: str) -> dict[str, Any] | None:
    found = read_json(root / "nodes" / node / LAUNCH_FILE)
    return found if isinstance(found, dict) else None
