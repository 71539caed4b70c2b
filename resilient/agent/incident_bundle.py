"""``resilient incident bundle``: one incident, and what it takes to investigate it elsewhere, in one tarball.

A bundle holds the incident record; the run's events around it; every rank's
log (its tail), error file and stacks of the incident's generation; the
launch record (the agent's command line, settings and versions:
:mod:`.launch_record`); the training script with its SHA-256; where the run
was in its data at the failing step (from the worker's error file); and the
newest committed checkpoint at or before the failing step.  That checkpoint
is pinned in its location (retention keeps it, :mod:`resilient.checkpoint.retention`)
until ``resilient incident release``; it is copied into the bundle, verified
as it is read, when it is no larger than a limit (or ``--with-checkpoint``),
else referenced by location and name.

Never a secret: the run token file is not read into the bundle, and the
token's text, should a log have printed it, is replaced wherever it appears.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import tarfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..checkpoint.locations import open_storage
from ..checkpoint.manifest import parse_manifest, step_of
from ..core.errors import ConfigError
from ..core.fsutil import read_json
from ..core.redact import PASSWORD_ENV, scrub
from .incident_view import find, incidents_of
from .launch_record import read_launch_record, read_secrets

CHECKPOINT_LIMIT = 1 << 30
"""A checkpoint up to this size is copied into the bundle; a larger one is referenced (``--with-checkpoint``)."""
EVENTS_WINDOW_S = 600.0
"""Run events within this many seconds of the incident go in the bundle."""
LOG_TAIL = 4 << 20
"""Bytes of each rank's log kept (its end)."""
RANK_FILES = ("rank*.log", "rank*.error.json", "rank*.stacks.txt")


@dataclass(frozen=True)
class Bundle:
    path: Path
    bytes: int
    index: dict[str, Any]
    """``bundle.json``: what is in the bundle and where its checkpoint is."""


def _script(launch: Mapping[str, Any] | None) -> Path | None:
    """The training script the workers ran: the first ``.py`` of the worker command, from the agent's cwd."""
    if not launch:
        return None
    for arg in launch.get("entrypoint") or ():
        if str(arg).endswith(".py"):
            path = Path(arg) if Path(arg).is_absolute() else Path(launch.get("cwd") or ".") / arg
            return path if path.is_file() else None
    return None


def _checkpoint(location: str, step: int | None, holder: str, run_dir: Path, copy: bool | None,
                limit: int, members: dict[str, bytes], endpoint_url: str | None) -> dict[str, Any] | None:
    """Pin the newest commit at or before ``step`` and copy it (verified) when ``copy`` or small enough."""
    storage = open_storage(location, endpoint_url=endpoint_url)
    names = [n for n in storage.list_committed() if step is None or (step_of(n) or 0) <= step]
    if not names:
        return {"location": location, "name": None, "note": f"no committed checkpoint at or before step {step}: "
                "a replay starts from the script's initial state"}
    name = names[-1]
    raw = storage.read_manifest(name)
    manifest = parse_manifest(raw, name)
    storage.pin(name, holder, json.dumps({"incident": holder, "run_dir": str(run_dir), "time": time.time()}).encode())
    record = {"location": location, "name": name, "step": manifest.step, "bytes": manifest.total_bytes,
              "pinned_by": holder, "copied": False}
    if copy is False or (copy is None and manifest.total_bytes > limit):
        record["note"] = (f"{manifest.total_bytes} bytes, over the bundle's limit of {limit}: referenced, not copied "
                          "(kept by its pin until `resilient incident release`; --with-checkpoint copies it)")
        return record
    for relpath, data in copy_checkpoint(storage, name):
        members[f"checkpoint/{name}/{relpath}"] = data
    record["copied"] = True
    return record


def copy_checkpoint(storage: Any, name: str) -> list[tuple[str, bytes]]:
    """Checkpoint ``name``'s manifest and files, each verified as it is read: (path in the checkpoint, bytes)."""
    from ..checkpoint.verify import check_file

    raw = storage.read_manifest(name)
    manifest = parse_manifest(raw, name)
    found = [("manifest.json", raw)]
    for entry in manifest.files:
        checked = check_file(storage, manifest, entry)
        if not checked.check.ok:
            raise ConfigError(f"checkpoint {name} in {storage.url} is damaged ({entry.path}: {checked.check.problem})"
                              ": verify it with `resilient checkpoint verify`")
        found.append((entry.path, bytes(checked.buf)))
    return found


def make_bundle(run_dir: Path, wanted: str, out: Path | None = None, *, with_checkpoint: bool | None = None,
                limit: int = CHECKPOINT_LIMIT, endpoint_url: str | None = None) -> Bundle:
    """Bundle incident ``wanted`` (an id or a prefix only it has) of the run at ``run_dir``."""
    record = dict(find(incidents_of(run_dir), wanted, run_dir))
    ident, node, generation, step = record["id"], record["node"], record["generation"], record.get("step")
    members: dict[str, bytes] = {"incident.json": json.dumps(record, indent=1).encode()}
    wall = float(record.get("wall_time") or time.time())
    events = run_dir / "events.jsonl"
    if events.exists():
        near = [line for line in events.read_text(errors="replace").splitlines()
                if _near(line, wall)]
        members["events.jsonl"] = ("\n".join(near) + "\n").encode()
    for gdir in sorted((run_dir / "nodes").glob(f"*/g{generation}")):
        for pattern in RANK_FILES:
            for path in sorted(gdir.glob(pattern)):
                data = path.read_bytes()
                members[f"ranks/{gdir.parent.name}/{path.name}"] = data[-LOG_TAIL:] if path.suffix == ".log" else data
    launch = read_launch_record(run_dir, node)
    if launch is not None:
        members["launch.json"] = json.dumps(launch, indent=1).encode()
    script = _script(launch)
    script_record = None
    if script is not None:
        body = script.read_bytes()
        members[f"script/{script.name}"] = body
        script_record = {"path": str(script), "name": script.name, "sha256": hashlib.sha256(body).hexdigest()}
    position = (record.get("error") or {}).get("position")
    location = checkpoint_location(run_dir, node)
    checkpoint = _checkpoint(location, step, ident, run_dir, with_checkpoint, limit, members,
                             endpoint_url) if location else None
    index = {"incident": ident, "created": time.time(), "run_dir": str(run_dir.resolve()), "node": node,
             "generation": generation, "step": step, "summary": record.get("summary"), "position": position,
             "script": script_record, "launch": launch is not None, "checkpoint": checkpoint,
             "members": sorted(members)}
    members["bundle.json"] = json.dumps(index, indent=1).encode()
    _redact(members, run_dir, launch)
    path = out if out is not None else Path(f"incident-{ident}.tar.gz")
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with tarfile.open(partial, "w:gz") as tar:
        for name, data in sorted(members.items()):
            info = tarfile.TarInfo(f"incident-{ident}/{name}")
            info.size, info.mtime, info.mode = len(data), int(wall), 0o600
            tar.addfile(info, io.BytesIO(data))
    partial.replace(path)  # never a half-written bundle under the name
    return Bundle(path, path.stat().st_size, index)


def _near(line: str, wall: float) -> bool:
    try:
        event = json.loads(line)
    except json.JSONDecodeError:
        return False
    when = event.get("time") if isinstance(event, dict) else None
    return isinstance(when, (int, float)) and abs(when - wall) <= EVENTS_WINDOW_S


def _redact(members: dict[str, bytes], run_dir: Path, launch: Mapping[str, Any] | None) -> None:
    """Every secret the bundle could carry replaced wherever it appears (a log, an error or an event that printed
    it): the run token (from ``<run_dir>/token`` and from the token file the agent was given), the etcd password
    (when it is in this environment), and the values of the secret flags the agents and workers were started with
    (their ``secrets.json``).  The script is left as it is: it is code, and a replay checks its SHA-256."""
    tokens = []
    settings = (launch or {}).get("settings") or {}
    for path in (run_dir / "token", Path(str(settings.get("token_file") or run_dir / "token"))):
        with contextlib.suppress(OSError):
            tokens.append(path.read_text().strip())
    others = [v for v in (os.environ.get(PASSWORD_ENV),) if v]
    for node_dir in sorted((run_dir / "nodes").glob("*")):
        others += read_secrets(run_dir, node_dir.name)
    for name, data in members.items():
        if not name.startswith("script/"):
            members[name] = scrub(scrub(data, tokens, "<run token>"), others)


def checkpoint_location(run_dir: Path, node: str) -> str | None:
    """Where the run's workers said their checkpoints go (``nodes/<node>/status.json``); None: nowhere."""
    status = read_json(run_dir / "nodes" / node / "status.json")
    location = status.get("checkpoint") if isinstance(status, dict) else None
    return str(location) if location else None


def release(run_dir: Path, wanted: str, endpoint_url: str | None = None) -> dict[str, Any]:
    """Let go of incident ``wanted``'s pins in its run's checkpoint location; what was released."""
    record = find(incidents_of(run_dir), wanted, run_dir)
    location = checkpoint_location(run_dir, str(record["node"]))
    if not location:
        raise ConfigError(f"the run at {run_dir} names no checkpoint location (nodes/{record['node']}/status.json): "
                          "nothing was pinned")
    storage = open_storage(location, endpoint_url=endpoint_url)
    released = [name for name, holders in storage.list_pins().items() if record["id"] in holders
                and storage.unpin(name, str(record["id"]))]
    return {"incident": record["id"], "location": location, "released": released}
