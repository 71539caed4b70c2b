"""What this node's agent was started with: ``<run_dir>/nodes/<node>/launch.json``.

Written once at the agent's start, for whoever investigates an incident
later (``resilient incident bundle`` puts it in the bundle): the agent's
command line, its working directory, the worker command, the settings, and
the versions of Python, torch and resilient.  Never a secret: the run token
is not in it (only where its file is), an etcd password is dropped, and of
the workers' extra environment only the names are kept.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import __version__
from ..core.fsutil import read_json, write_json_atomic

if TYPE_CHECKING:
    from .config import AgentConfig
    from .rundir import RunDir

LAUNCH_FILE = "launch.json"
SECRET_WORDS = ("password", "secret", "token", "credential", "key")
"""A setting whose name has one of these is left out (its file's path, ``token_file``, is kept)."""


def _public(value: Any) -> Any:
    """``value`` as JSON, every setting whose name says it is a secret left out."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): _public(v) for k, v in value.items()
                if not any(word in str(k).lower() for word in SECRET_WORDS) or str(k).endswith("_file")}
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
    return {"time": time.time(), "argv": list(sys.argv), "cwd": os.getcwd(), "entrypoint": list(config.entrypoint),
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
        write_json_atomic(path, launch_record(config), indent=1)
    except Exception as e:  # noqa: BLE001 - whatever failed, the run goes on without its launch record
        print(f"resilient: could not write {path}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return None
    return path


def read_launch_record(root: Path, node: str) -> dict[str, Any] | None:
    found = read_json(root / "nodes" / node / LAUNCH_FILE)
    return found if isinstance(found, dict) else None
