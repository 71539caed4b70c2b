"""``resilient status``: the first command on-call runs.

Shows the run's nodes, their ranks and the section each is in, the
generation and what its ranks restored, restarts used, the newest committed
checkpoint and its age, the verdict if the run stopped, and recent incidents
with their first failure.  A node whose agent runs on this host is read live
through its control socket (rank rows at most one 100 ms heartbeat batch
behind the workers), else from its ``status.json`` (up to a second older).
Without ``--run-dir`` it reads the only run directory under ``runs/``, and
lists them newest first when there are several.
From the store, restarts and the verdict are those of the current launch.
Reads a run directory (``--run-dir``) or the shared store (``--store URL
--run-id ID``); it never changes the run.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from ..core.errors import ConfigError
from .checkpoint_cmd import age, format_table
from .stop_cmd import run_owners


def add_parser(commands: Any) -> None:
    p = commands.add_parser("status", help="nodes, ranks, restarts, newest checkpoint and incidents of a run")
    p.add_argument("--run-dir", type=Path, metavar="DIR", help="the run directory (default: the only one in runs/)")
    p.add_argument("--store", metavar="URL", help="read from etcd://HOST:PORT instead of a run directory")
    p.add_argument("--run-id", metavar="ID", help="run id in the store (with --store)")
    p.add_argument("--incidents", type=int, default=5, metavar="N", help="recent incidents to show (default 5)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(handler=cmd_status)


def collect_from_run_dir(run_dir: Path) -> dict[str, Any]:
    from ..agent.incidents import load_incidents
    from ..core.fsutil import read_json

    if not run_dir.is_dir():
        raise ConfigError(f"no run directory at {run_dir}: pass the --run-dir that `resilient run` printed")
    owners = run_owners(run_dir)
    nodes = [live_status(s, owners=owners) for p in sorted((run_dir / "nodes").glob("*/status.json"))
             if (s := read_json(p)) is not None]
    events = read_events(run_dir / "events.jsonl")
    restarts = [e for e in events if e.get("kind") == "restart"]
    finished = [e for e in events if e.get("kind") == "agent_finished"]
    return {
        "source": str(run_dir), "nodes": nodes,
        "restarts_used": max([e.get("restarts_used") or 0 for e in restarts + finished + nodes] or [0]),
        "verdicts": [{k: e.get(k) for k in ("node", "verdict", "reason", "exit_code")} for e in finished],
        "incidents": load_incidents(run_dir / "incidents"),
    }


def live_status(saved: dict[str, Any], timeout_s: float = 2.0, *, owners: set[int] | None = None) -> dict[str, Any]:
    """The node's status from its running agent (``"read": "live"``), else ``saved``, its status.json (``"file"``).

    The agent answers with a snapshot taken as it answers, so its rank rows
    are as new as the newest heartbeat it received (at most one 100 ms batch
    behind the worker); the file is up to a second older.  The control socket
    is reachable only on the agent's host; elsewhere, or once the agent
    ended, the file is what there is.
    """
    from ..agent.control import ControlError, call

    sock = saved.get("control_socket")
    if not sock or str(saved.get("phase", "")).startswith("finished"):
        return {**saved, "read": "file"}
    try:
        answer = call(Path(sock), {"op": "status"}, timeout_s=timeout_s, owners=owners)
    except (ControlError, OSError) as e:
        return {**saved, "read": "file", "live_error": str(e)}
    if answer.get("ok") and isinstance(answer.get("status"), dict):
        return {**answer["status"], "read": "live"}
    return {**saved, "read": "file", "live_error": str(answer.get("error"))}


def collect_from_store(url: str, run_id: str) -> dict[str, Any]:
    from ..coord import keyspace
    from ..coord.etcd import EtcdClient, EtcdConfig, EtcdControlStore

    store = EtcdControlStore(EtcdClient(EtcdConfig.from_url(url, outage_tolerance_s=5.0)), keyspace.run_root(run_id))
    nodes = [json.loads(e.value) for e in sorted(store.get_prefix(keyspace.STATUS), key=lambda e: e.key)]
    incidents = [body for e in sorted(store.get_prefix(keyspace.INCIDENTS), key=lambda e: e.key)
                 if (body := _signed_body(e)) is not None]
    # Verdict and restarts belong to the current launch (incidents to the run).  Status needs no token, so
    # it shows signed entries without checking their proofs; the agents themselves ignore forged ones.
    launch = _signed_body(store.get(keyspace.LAUNCH))
    verdict = restarts = None
    if launch is not None:
        keys = keyspace.LaunchKeys(launch["id"])
        verdict = _signed_body(store.get(keys.verdict()))
        restarts = len(store.get_prefix(keys.restarts()))
    return {
        "source": f"{url} run {run_id}", "nodes": nodes, "restarts_used": restarts or 0, "launch": launch,
        "verdicts": [verdict] if verdict is not None else [], "incidents": incidents,
    }


def _signed_body(entry: Any) -> dict[str, Any] | None:
    if entry is None:
        return None
    try:
        body = json.loads(entry.value).get("body")
    except (ValueError, AttributeError):
        return None
    return body if isinstance(body, dict) else None


def read_events(path: Path) -> list[dict[str, Any]]:
    """Every event of an ``events.jsonl``, oldest first (none when it does not exist)."""
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    found = []
    for line in lines:
        try:
            found.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line being written right now
    return found


def newest_checkpoint(location: str | None) -> dict[str, Any] | None:
    """Name, step and creation time of the newest committed checkpoint at ``location``."""
    if not location:
        return None
    try:
        from ..checkpoint.inspect import list_checkpoints
        from ..checkpoint.locations import open_storage

        infos = [i for i in list_checkpoints(open_storage(location)) if i.manifest_ok]
    except Exception as e:  # status must still print the rest
        return {"location": location, "error": f"{type(e).__name__}: {e}"}
    if not infos:
        return {"location": location, "name": None}
    newest = max(infos, key=lambda i: i.step)
    return {"location": location, "name": newest.name, "step": newest.step, "created_unix": newest.created_unix}


def render(status: dict[str, Any], max_incidents: int) -> str:
    now = time.time()
    out = [f"run status from {status['source']}"]
    launch = status.get("launch")
    if launch:
        out.append(f"launch {launch.get('id')}: {launch.get('state')} ({launch.get('reason')})")
    nodes = status["nodes"]
    if not nodes:
        out.append("no node has published status yet")
    max_restarts = max([n.get("max_restarts", 0) for n in nodes] or [0])
    for n in nodes:
        read = "read live from its agent" if n.get("read") == "live" else f"updated {age(now, n.get('updated_at'))} ago"
        out.append(f"node {n['node']} (agent pid {n.get('agent_pid')}): {n.get('phase')}, generation "
                   f"{n.get('generation')}, node rank {n.get('node_rank')} of {n.get('num_nodes')}, {read}")
        rows = [[r, str(v["pid"]), v["section"], str(v["step"]), f"{v['in_section_s']:.1f}s",
                 "-" if v.get("last_heartbeat_age_s") is None else f"{v['last_heartbeat_age_s']:.1f}s",
                 "yes" if v.get("alive") else "no"] for r, v in sorted(n.get("ranks", {}).items(), key=lambda x: int(x[0]))]
        if rows:
            table = format_table(["RANK", "PID", "SECTION", "STEP", "IN SECTION", "LAST BEAT", "ALIVE"], rows)
            out.extend("  " + line for line in table.splitlines())
        restore = n.get("restore")
        if isinstance(restore, dict) and restore.get("summary"):
            out.append(f"  restore: {restore['summary']}")
        memory = n.get("memory")
        if isinstance(memory, dict):
            out.append(f"  memory tier: {memory_line(memory)}")
            replica = memory.get("replica")
            if isinstance(replica, dict):
                copy = (f"a copy of {replica['copy_of']}'s step {replica['copy_step']} ({replica['copy_bytes']} B)"
                        if replica.get("copy_of") else "no copy of a peer's yet")
                out.append(f"  memory replica: pins every {replica.get('pin_every')} steps; {copy}; "
                           f"serves on {replica.get('serving')}")
        recovery = n.get("recovery")
        if isinstance(recovery, dict):
            if recovery.get("declined"):
                out.append(f"  recovery: by restart only: {recovery['declined']}")
            if recovery.get("decision"):
                out.append(f"  recovery decision: {recovery['decision']}")
            if recovery.get("completed"):
                out.append(f"  recovered: {recovery['completed']}")
            if recovery.get("spares") is not None:
                out.append(f"  spares ready: {recovery['spares']}")
            cost = recovery.get("restart_cost")
            if isinstance(cost, dict):
                out.append(f"  a restart costs: {cost.get('seconds')} s ({cost.get('from')})")
        out.extend(notice_lines(n.get("notices")))
        out.extend(slowness_lines(n.get("slowness")))
        out.extend(quarantine_lines(n.get("quarantine")))
        timeouts = ", ".join(f"{t['section']} {t['timeout_s']:g}s ({t['source']})" for t in n.get("timeouts", [])
                             if t["source"] != "initial")
        if timeouts:
            out.append(f"  hang timeouts: {timeouts}")
    out.append(f"restarts used: {status['restarts_used']} of {max_restarts}")
    ckpt = status.get("checkpoint")
    if ckpt is None:
        out.append("newest committed checkpoint: unknown (no worker reported a checkpoint location)")
    elif ckpt.get("error"):
        out.append(f"newest committed checkpoint: cannot read {ckpt['location']}: {ckpt['error']}")
    elif ckpt.get("name") is None:
        out.append(f"newest committed checkpoint: none yet in {ckpt['location']}")
    else:
        out.append(f"newest committed checkpoint: {ckpt['name']} (step {ckpt['step']}), "
                   f"{age(now, ckpt['created_unix'])} old, in {ckpt['location']}")
    for v in status["verdicts"]:
        out.append(f"verdict from node {v.get('node')}: {v.get('verdict')}: {v.get('reason')} "
                   f"(exit {v.get('exit_code')})")
    incidents = status["incidents"][-max_incidents:]
    out.append(f"incidents: {len(status['incidents'])}" + (" (most recent last)" if incidents else ""))
    for inc in incidents:
        decision = inc.get("decision") or {}
        out.append(f"  {inc.get('id')}: {inc.get('summary')}")
        error = inc.get("error")
        if isinstance(error, dict):
            out.append(f"    error: {error.get('exc_type')}: {error.get('message')}")
        elif error:
            out.append(f"    error: {error}")
        if decision:
            out.append(f"    decision: {decision.get('action')}: {decision.get('reason')}")
    return "\n".join(out)


def cmd_status(args: argparse.Namespace) -> int:
    if args.store:
        if not args.run_id:
            raise ConfigError("--store needs --run-id")
        status = collect_from_store(args.store, args.run_id)
    else:
        run_dir = args.run_dir
        if run_dir is None:
            run_dir = only_run_dir(Path("runs"))
        status = collect_from_run_dir(run_dir)
    location = next((n.get("checkpoint") for n in status["nodes"] if n.get("checkpoint")), None)
    status["checkpoint"] = newest_checkpoint(location)
    if args.json:
        print(json.dumps(status, indent=1, default=str))
    else:
        print(render(status, args.incidents))
    return 0


def only_run_dir(runs: Path) -> Path:
    """The one run directory under ``runs``; with none or several, a ConfigError that lists them newest first."""
    found = [p for p in runs.glob("*") if (p / "events.jsonl").exists()]
    if len(found) == 1:
        return found[0]
    if not found:
        raise ConfigError(f"no run directory under {runs}/; pass --run-dir DIR (the one `resilient run` printed)")
    now = time.time()
    summaries = sorted((summarise_run_dir(p) for p in found), key=lambda r: r["updated_at"], reverse=True)
    rows = [[r["path"], r["run_id"] or "?", f"{age(now, r['updated_at'])} ago", r["state"]] for r in summaries]
    table = format_table(["RUN DIR", "RUN ID", "UPDATED", "STATE"], rows)
    raise ConfigError(f"{len(found)} run directories under {runs}/, newest first; pick one with --run-dir:\n{table}")


def summarise_run_dir(run_dir: Path) -> dict[str, Any]:
    """Path, run id, last update (wall clock) and state of a run directory, from its files only."""
    from ..core.fsutil import read_json

    nodes = [s for p in sorted(run_dir.glob("nodes/*/status.json")) if isinstance(s := read_json(p), dict)]
    events = run_dir / "events.jsonl"
    finished = [e for e in _tail_events(events) if e.get("kind") == "agent_finished"]
    updated = max([float(n.get("updated_at") or 0) for n in nodes] + [events.stat().st_mtime])
    run_id = next((n.get("run_id") for n in nodes if n.get("run_id")), None)
    phases = sorted({str(n.get("phase")) for n in nodes if n.get("phase")})
    if finished and all(p.startswith("finished") for p in phases):
        last = finished[-1]
        state = f"finished: {last.get('verdict')} (exit {last.get('exit_code')})"
    else:
        state = ", ".join(phases) or "no status yet"
    return {"path": str(run_dir), "run_id": run_id, "updated_at": updated, "state": state}


def _tail_events(path: Path, size: int = 65536) -> list[dict[str, Any]]:
    """The events in the last ``size`` bytes of ``path`` (the verdict is among the last lines)."""
    with open(path, "rb") as f:
        f.seek(max(0, f.seek(0, 2) - size))
        lines = f.read().decode(errors="replace").splitlines()
    found = []
    for line in lines:
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue  # the first line cut by the seek, or one being written
        if isinstance(event, dict):
            found.append(event)
    return found


def quarantine_lines(quarantine: Any) -> list[str]:
    """This node's quarantine record in force, and its newest burn-in."""
    if not isinstance(quarantine, dict):
        return []
    out = []
    standing = quarantine.get("standing")
    if isinstance(standing, dict):
        out.append(f"  quarantined: {standing.get('summary')}")
    burn_in = quarantine.get("burn_in")
    if isinstance(burn_in, dict):
        out.append(f"  burn-in: {burn_in.get('reason')}")
    return out


def notice_lines(notices: Any) -> list[str]:
    """What the workers told the agent: the integration's rungs, resumes under another config or not where the
    saving run was (the newest of each, one line each)."""
    from ..agent.notices import say

    if not isinstance(notices, dict):
        return []
    out = []
    for entry in (notices.get("integration") or [])[-1:]:
        out.append(f"  integration: {entry.get('line')}")
    for entry in (notices.get("config_changed") or [])[-1:]:
        out.append(f"  config: {say('config_changed', entry)}")
    for entry in (notices.get("resume_diverged") or [])[-1:]:
        what = say("resume_diverged", entry) or (f"rank {entry.get('rank')} resumed from {entry.get('checkpoint')} "
                                                  f"at step {entry.get('step')} elsewhere than the saving run was: "
                                                  f"{', '.join(entry.get('moved') or [])} moved; the run stopped")
        out.append(f"  resume: {what}")
    return out


def slowness_lines(slowness: Any) -> list[str]:
    """Standing straggler flags (with their numbers) and a slowdown in progress, for one node."""
    if not isinstance(slowness, dict):
        return []
    out = []
    scores = {(s["rank"], s["section"]): s for s in slowness.get("scores", [])}
    for flag in slowness.get("stragglers", []):
        s = scores.get((flag["rank"], flag["section"]), {})
        out.append(f"  straggler: rank {flag['rank']} in {flag['section']}: {flag.get('reason') or ''}".rstrip(": ")
                   + (f" (latest window {s['relative']:.2f}x its peers)" if s.get("relative") else ""))
    slow = slowness.get("slowdown")
    if isinstance(slow, dict):
        out.append(f"  slowdown: {slow.get('reason')}")
    elif slowness.get("baseline_s"):
        out.append(f"  step time: at its baseline ({slowness['baseline_s'] * 1e3:.1f} ms per step), no straggler"
                   if not slowness.get("stragglers") else
                   f"  step time baseline: {slowness['baseline_s'] * 1e3:.1f} ms per step")
    return out


def memory_line(memory: dict[str, Any]) -> str:
    """``12.0 MiB of 4.0 GiB in /dev/shm/...; interval auto; steps held: rank00000 40,39,38; ...``"""
    def size(n: object) -> str:
        value = float(n) if isinstance(n, (int, float)) else 0.0
        for unit in ("B", "KiB", "MiB", "GiB"):
            if value < 1024 or unit == "GiB":
                return f"{value:.1f} {unit}" if unit != "B" else f"{int(value)} B"
            value /= 1024
        return f"{value:.1f} TiB"

    holdings = memory.get("holdings") or {}
    held = "; ".join(f"{stem} {','.join(str(s) for s in steps)}" for stem, steps in sorted(holdings.items()))
    return (f"{size(memory.get('used_bytes'))} of {size(memory.get('limit_bytes'))} in {memory.get('directory')}; "
            f"interval {memory.get('every')}; steps held: {held or 'none yet'}")

