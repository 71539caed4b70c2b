"""``resilient stop``: ask every agent of a run to checkpoint and stop, as SIGTERM would.

It reads the run's token from ``<run_dir>/token`` (so only a user who can
read that file can stop the run) and sends a stop request to each node's
control socket; the workers commit a checkpoint at a step boundary ahead of
every rank and exit, and each agent ends with the verdict "preempted".

With ``--store URL --run-id ID`` (from any machine, no run directory
needed) it writes a signed ``stop_request`` under the run's current launch;
the agents see it within a second and stop the same way.  The proof needs
the run token: ``--token-file`` (or ``--run-dir`` for ``<run_dir>/token``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from ..core.errors import ConfigError


def add_parser(commands: Any) -> None:
    p = commands.add_parser("stop", help="checkpoint and stop a running run (needs the run's token)")
    p.add_argument("--run-dir", type=Path, metavar="DIR", help="the run directory (its token and control sockets)")
    p.add_argument("--store", metavar="URL", help="stop through etcd://HOST:PORT instead of the control sockets")
    p.add_argument("--run-id", metavar="ID", help="run id in the store (with --store)")
    p.add_argument("--token-file", type=Path, metavar="FILE",
                   help="the run token (with --store; default <run dir>/token)")
    p.add_argument("--reason", default="resilient stop", help="recorded in the events (default: 'resilient stop')")
    p.set_defaults(handler=cmd_stop)


def cmd_stop(args: argparse.Namespace) -> int:
    if args.store:
        return stop_through_store(args)
    if args.run_dir is None:
        raise ConfigError("give --run-dir DIR (the run's control sockets), or --store URL --run-id ID")
    from ..agent.control import ControlError, call

    token, live = live_agents(args.run_dir)
    owners = run_owners(args.run_dir)
    failed = 0
    for s in live:
        try:
            answer = call(Path(s["control_socket"]), {"op": "stop", "token": token, "reason": args.reason},
                          owners=owners)
        except ControlError as e:
            print(f"node {s['node']}: {e}", file=sys.stderr)
            failed += 1
            continue
        print(f"node {s['node']}: {json.dumps(answer)}")
        failed += 0 if answer.get("ok") else 1
    return 1 if failed else 0


def run_owners(run_dir: Path) -> set[int]:
    """Who may serve the run's control sockets: this user, and the user whose run it is (the token file's owner:
    root may stop another user's run, nobody else can read its token)."""
    owners = {os.geteuid()}
    with contextlib.suppress(OSError):
        owners.add((run_dir / "token").stat().st_uid)
    return owners


def live_agents(run_dir: Path) -> tuple[str, list[dict[str, Any]]]:
    """The run's token and the status of every agent of ``run_dir`` still running (ConfigError if none)."""
    from ..agent.rundir import read_token
    from ..core.fsutil import read_json

    token_file = run_dir / "token"
    if not token_file.exists():
        raise ConfigError(f"no run token at {token_file}: is {run_dir} the run directory of `resilient run`?")
    statuses = [s for p in sorted((run_dir / "nodes").glob("*/status.json")) if (s := read_json(p))]
    live = [s for s in statuses if s.get("control_socket") and not str(s.get("phase", "")).startswith("finished")]
    if not live:
        raise ConfigError(f"no running agent found under {run_dir}/nodes")
    return read_token(token_file), live


def signed_launch(args: argparse.Namespace, what: str) -> tuple[Any, dict[str, Any]]:
    """The run's store signed with its token (``--token-file``, or ``<--run-dir>/token``) and its current launch
    record, for ``--store URL --run-id ID``; ConfigError naming what is missing or wrong."""
    from ..agent.rundir import read_token
    from ..coord.etcd import EtcdClient, EtcdConfig, EtcdControlStore
    from ..coord.keyspace import LAUNCH
    from ..coord.proof import SignedStore

    if not args.run_id:
        raise ConfigError(f"--store needs --run-id: the run to {what}")
    token_file = args.token_file or (args.run_dir / "token" if args.run_dir else None)
    if token_file is None or not token_file.exists():
        raise ConfigError(f"the request must be signed with the run token: pass --token-file FILE (a copy of "
                          f"<run_dir>/token){'' if token_file is None else f'; {token_file} does not exist'}")
    store = EtcdControlStore.for_run(EtcdClient(EtcdConfig.from_url(args.store, outage_tolerance_s=10.0)), args.run_id)
    signed = SignedStore(store, read_token(token_file))
    problem = signed.check_fingerprint(publish=False)
    if problem is not None:
        raise ConfigError(f"cannot {what} run {args.run_id} with {token_file}: {problem}; use its agents' token file")
    launch = signed.get(LAUNCH)
    if launch is None:
        raise ConfigError(f"run {args.run_id} has no launch in {args.store}: is the run id right?")
    return signed, launch


def stop_through_store(args: argparse.Namespace) -> int:
    """Write a signed stop request under the run's current launch."""
    import socket

    from ..coord.keyspace import LaunchKeys

    signed, launch = signed_launch(args, "stop")
    if launch.get("state") == "ended":
        print(f"run {args.run_id}: launch {launch['id']} already ended ({launch.get('reason')}); nothing to stop")
        return 0
    request = {"reason": args.reason, "by": socket.gethostname()}
    created, current = signed.put_if_absent(LaunchKeys(launch["id"]).stop_request(), request)
    print(json.dumps({"run_id": args.run_id, "launch_id": launch["id"], "requested": created, "request": current}))
    return 0
