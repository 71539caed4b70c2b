"""``resilient incident replay BUNDLE``: run an incident's failing step again, on one machine, from any directory.

The bundle (:mod:`.incident_bundle`) is unpacked into a work directory; its
checkpoint (the bundle's copy, or the pinned original copied here first, so
that the replay never writes where the run keeps its checkpoints) is what
the ranks restore; the bundled script runs with the run's arguments, as
``--ranks`` processes (the recorded world size by default) in a process
group on loopback, each told by ``RESILIENT_REPLAY`` to restore that
checkpoint, save nothing, and stop once the failing step is behind
(:mod:`resilient.run.replay`).  Then the ranks' outcomes are compared with
the incident: the same exception at the same step is a reproduction, and
the samples each read at that step are compared with the run's.

A replay runs code that came in a file: :func:`prepare` unpacks the bundle
and says what would run (the script's path and SHA-256, checked against
the bundle's record and against the run's own script where that is on this
host), and nothing runs until the caller says yes (``--yes``).  A script
name with a path in it is refused.  The ranks run in the replay's work
directory, with only the environment variables of :data:`KEPT_ENV` (no
credentials, no tokens, none of the run's settings).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..checkpoint.locations import open_storage
from ..core.errors import ConfigError
from ..core.redact import REDACTED
from .consequences import short_error
from .incident_bundle import copy_checkpoint

KEPT_ENV = ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR",
            "PYTHONPATH", "VIRTUAL_ENV", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS")
"""The only variables of the caller's environment a replayed script sees (besides those that set up its ranks)."""

GRACE_S = 20.0
"""How long the other ranks get to end once one has failed (they may wait in a collective for it)."""


@dataclass
class ReplayReport:
    reproduced: bool
    lines: list[str] = field(default_factory=list)
    results: list[dict[str, Any]] = field(default_factory=list)
    workdir: Path | None = None


def _unpack(bundle: Path, work: Path) -> Path:
    if not bundle.is_file():
        raise ConfigError(f"{bundle} is not a file: give the tarball `resilient incident bundle` wrote")
    try:
        with tarfile.open(bundle) as tar:
            tops = {m.name.split("/", 1)[0] for m in tar.getmembers()}
            if len(tops) != 1:
                raise ConfigError(f"{bundle} is not an incident bundle (it has {len(tops)} top-level entries)")
            tar.extractall(work, filter="data")
    except tarfile.TarError as e:
        raise ConfigError(f"{bundle} is not an incident bundle: {e}") from None
    root = work / tops.pop()
    if not (root / "bundle.json").is_file():
        raise ConfigError(f"{bundle} is not an incident bundle (no bundle.json in it)")
    return root


def _json(path: Path, what: str) -> dict[str, Any]:
    try:
        found = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"the bundle's {what} cannot be read ({path.name}: {e}); bundle the incident again") from None
    if not isinstance(found, dict):
        raise ConfigError(f"the bundle's {what} ({path.name}) is not a JSON object")
    return found


def _script(root: Path, index: Mapping[str, Any]) -> Path:
    """The bundled script: a bare file name under the bundle's ``script/``, whose SHA-256 is the bundle's record."""
    script = index.get("script") or {}
    if not script:
        raise ConfigError("the bundle holds no training script (the run's entrypoint was not a .py file); a replay "
                          "needs one")
    name = str(script.get("name", ""))
    if not name or name in (".", "..") or "/" in name or "\\" in name or os.path.isabs(name):
        raise ConfigError(f"the bundle names its script {name!r}, not a bare file name: `resilient incident bundle` "
                          "never writes that, so this bundle was made or changed by hand; refusing to run it")
    body = root / "script" / name
    if not body.is_file() or body.is_symlink():
        raise ConfigError(f"the bundle has no file script/{name} (or it is a link): bundle the incident again")
    if _sha256(body) != script.get("sha256"):
        raise ConfigError(f"script/{name} does not match the SHA-256 the bundle recorded for it: the bundle was "
                          "changed after it was written; refusing to run it")
    return body


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _command(body: Path, launch: Mapping[str, Any]) -> list[str]:
    """The worker command with the bundled script, under this Python."""
    entry = [str(a) for a in launch.get("entrypoint") or ()]
    at = next((i for i, a in enumerate(entry) if a.endswith(".py")), None)
    args = entry[at + 1:] if at is not None else []
    return [sys.executable, "-u", str(body), *args]


def _against_the_run(body: Path, recorded: Mapping[str, Any]) -> str:
    """How the bundled script compares with the run's own script, where that is on this host."""
    original = Path(str(recorded.get("path") or ""))
    if not recorded.get("path") or not original.is_file():
        return f"the run's script {original} is not on this host: nothing to compare it with"
    if _sha256(original) == _sha256(body):
        return f"the same as the run's script at {original}"
    return f"DIFFERENT from the run's script at {original} (changed since the run?)"


def _checkpoint(root: Path, work: Path, index: Mapping[str, Any], endpoint_url: str | None) -> tuple[Path, str]:
    """The directory the ranks restore from, and how it came to be."""
    record = index.get("checkpoint") or {}
    if record.get("copied"):
        return root / "checkpoint", f"{record['name']} (copied in the bundle)"
    target = work / "checkpoint"
    target.mkdir(parents=True, exist_ok=True)
    if not record.get("name"):
        return target, "no checkpoint (the run had committed none before the failing step): the script's start"
    storage = open_storage(str(record["location"]), endpoint_url=endpoint_url)
    for relpath, data in copy_checkpoint(storage, str(record["name"])):
        path = target / str(record["name"]) / relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return target, f"{record['name']} (copied from {record['location']}, where its pin keeps it)"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(cmd: Sequence[str], world: int, plan: Path, work: Path, timeout_s: float) -> list[int | None]:
    base = {k: v for k, v in os.environ.items() if k in KEPT_ENV}
    port = _free_port()
    procs = []
    for rank in range(world):
        env = {**base, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
               "RESILIENT_REPLAY": str(plan)}
        log = open(work / f"rank{rank}.log", "w")  # noqa: SIM115 - closed when the process has ended
        procs.append((subprocess.Popen(list(cmd), cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    deadline, failed_at = time.monotonic() + timeout_s, None
    try:
        while any(p.poll() is None for p, _ in procs):
            now = time.monotonic()
            if failed_at is None and any(p.returncode not in (None, 0) for p, _ in procs):
                failed_at = now
            if now > deadline or (failed_at is not None and now > failed_at + GRACE_S):
                break
            time.sleep(0.05)
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    return [p.returncode for p, _ in procs]


@dataclass
class Prepared:
    """A bundle unpacked for a replay, not run yet: what would run, and with what."""

    work: Path
    root: Path
    index: dict[str, Any]
    incident: dict[str, Any]
    position: dict[str, Any]
    world: int
    script: Path
    cmd: list[str]
    lines: list[str]
    """What would run, for the caller to read before saying yes."""


def prepare(bundle: Path, *, ranks: int | None = None, workdir: Path | None = None) -> Prepared:
    """Unpack ``bundle`` and check it; nothing runs (:func:`replay` runs it)."""
    work = workdir if workdir is not None else Path(tempfile.mkdtemp(prefix="resilient-replay-"))
    work.mkdir(parents=True, exist_ok=True)
    root = _unpack(bundle, work)
    index, incident = _json(root / "bundle.json", "index"), _json(root / "incident.json", "incident record")
    if not (root / "launch.json").is_file():
        raise ConfigError("the bundle has no launch record (the agent that ran it wrote none): the command to "
                          "replay is unknown")
    launch = _json(root / "launch.json", "launch record")
    step, error = incident.get("step"), incident.get("error") or {}
    if step is None:
        raise ConfigError(f"incident {incident.get('id')} names no step ({incident.get('kind')}): there is no step "
                          "to replay")
    position = index.get("position") or error.get("position") or {}
    world = ranks or int(position.get("world_size") or 1)
    body = _script(root, index)
    cmd = _command(body, launch)
    lines = [f"script: {body}", f"  sha256 {_sha256(body)} (as the bundle recorded it); "
             f"{_against_the_run(body, index['script'])}",
             f"command: {' '.join(cmd)}",
             f"runs as uid {os.geteuid()} on {world} rank(s), in {work}, with only {', '.join(KEPT_ENV)} of this "
             "environment"]
    if REDACTED in cmd:
        lines.append(f"note: the values of the run's secret flags are not in the bundle; the script gets {REDACTED} "
                     "for them, so a step that needs them does not replay as it ran")
    return Prepared(work, root, index, incident, dict(position), world, body, cmd, lines)


def replay(prepared: Prepared, *, timeout_s: float = 600.0, endpoint_url: str | None = None) -> ReplayReport:
    """Replay a prepared bundle's failing step; the report says whether the failure came back and what differed."""
    work, step = prepared.work, prepared.incident["step"]
    source, how = _checkpoint(prepared.root, work, prepared.index, endpoint_url)
    results = work / "results"
    results.mkdir(exist_ok=True)
    plan = work / "replay.json"
    plan.write_text(json.dumps({"checkpoint": str(source), "step": step, "results": str(results)}))
    codes = _run(prepared.cmd, prepared.world, plan, work, timeout_s)
    found = []
    for path in sorted(results.glob("rank*.json")):
        found.append(json.loads(path.read_text()))
    return _compare(prepared.incident, prepared.position, prepared.world, how, found, codes, work)


def _compare(incident: Mapping[str, Any], position: Mapping[str, Any], world: int, how: str,
             found: list[dict[str, Any]], codes: list[int | None], work: Path) -> ReplayReport:
    step, error = incident["step"], incident.get("error") or {}
    expected = error.get("exc_type")
    report = ReplayReport(False, results=found, workdir=work)
    lines = report.lines
    lines.append(f"replayed incident {incident.get('id')} on {world} rank(s) from {how}")
    recorded = int(position.get("world_size") or world)
    if world != recorded:
        lines.append(f"note: the run had {recorded} ranks; on {world} the loader splits the same global batch "
                     "differently, so a failure that depends on one rank's share, or on the reduction order, may "
                     "not come back")
    run_said = short_error(error) if expected else incident.get("summary")
    lines.append(f"the run: step {step}, rank {incident.get('rank')}: {run_said}")
    raised = [r for r in found if r.get("raised")]
    same = [r for r in raised if r["raised"]["exc_type"] == expected and r.get("step") == step]
    if same:
        report.reproduced = True
        r = next((r for r in same if r.get("rank") == incident.get("rank")), same[0])  # the incident's rank first
        full = work / "results" / f"rank{r['rank']}.json"
        lines.append(f"reproduced: rank {r['rank']} raised {short_error(r['raised'])} at step {r['step']} "
                     f"(in full: {full})")
    elif raised:
        r = raised[0]
        full = work / "results" / f"rank{r['rank']}.json"
        lines.append(f"not reproduced: rank {r['rank']} raised {short_error(r['raised'])} at step {r['step']} "
                     f"instead (in full: {full})")
    elif found and all(r.get("through") for r in found):
        lines.append(f"not reproduced: every rank ran through step {step} without it")
    else:
        logs = ", ".join(str(work / f"rank{i}.log") for i in range(len(codes)))
        lines.append(f"not reproduced: the ranks ended with exit codes {codes} and wrote no outcome (see {logs})")
    mine = next((r for r in found if r.get("rank") == position.get("rank")), found[0] if found else None)
    if mine is not None and position.get("rank_indices") is not None:
        got = (mine.get("position") or {}).get("rank_indices")
        verdict = "the same as the run's" if got == position["rank_indices"] else \
            f"the run's were {position['rank_indices']}" if mine.get("rank") == position.get("rank") else \
            f"the run's rank {position.get('rank')} read {position['rank_indices']}"
        lines.append(f"samples of step {step} on rank {mine.get('rank')}: {got} ({verdict})")
        if mine.get("loss") is not None:
            lines.append(f"loss before it: {mine['loss']}")
    lines.append("on CPU a replay computes what the run computed, bit for bit; on a GPU, kernels that are not "
                 "deterministic (atomics, some cuDNN and NCCL reductions) can differ in the last bits")
    return report
