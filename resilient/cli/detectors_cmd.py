"""``resilient detectors``: read or change the straggler and slowdown detectors of a running job.

    resilient detectors --run-dir runs/x                                 # every setting, per node
    resilient detectors --run-dir runs/x straggler.rule.decision=12 slowdown.enabled=false
    resilient detectors --store etcd://h:2379 --run-id x --token-file t straggler.enabled=false   # every machine

A change needs the run's token (``<run_dir>/token``), is validated by each
agent (a bad key or value is refused, naming the settings or the rule it
breaks), applies from the next window of steps without a restart, and is a
``detectors_changed`` event.  Through the store (many machines) it is also
validated here first, then written as a signed record under the run's
launch that every agent applies within a second; agents that join later
apply it too.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..core.errors import ConfigError


def add_parser(commands: Any) -> None:
    p = commands.add_parser("detectors", help="read or change a running job's straggler and slowdown detectors")
    p.add_argument("--run-dir", type=Path, metavar="DIR", help="the run directory (its control sockets and token)")
    p.add_argument("--store", metavar="URL", help="change every machine's agents through etcd://HOST:PORT instead")
    p.add_argument("--run-id", metavar="ID", help="run id in the store (with --store)")
    p.add_argument("--token-file", type=Path, metavar="FILE", help="the run token (with --store; default <run dir>/token)")
    p.add_argument("set", nargs="*", metavar="KEY=VALUE",
                   help="settings to change, e.g. straggler.rule.decision=12 or slowdown.enabled=false")
    p.set_defaults(handler=cmd_detectors)


def parse_assignments(items: list[str]) -> dict[str, Any]:
    """``["a.b=1", ...]`` as ``{"a.b": 1}`` (values parsed as bool, int, float)."""
    from ..watchdog.settings import parse_value

    changes = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{item!r} is not KEY=VALUE, e.g. straggler.rule.decision=12")
        changes[key.strip()] = parse_value(value)
    return changes


def cmd_detectors(args: argparse.Namespace) -> int:
    from ..agent.control import ControlError, call
    from .stop_cmd import live_agents, run_owners

    changes = parse_assignments(args.set)
    if args.store:
        return through_store(args, changes)
    if args.run_dir is None:
        raise ConfigError("give --run-dir DIR (the run's control sockets), or --store URL --run-id ID")
    token, live = live_agents(args.run_dir)
    request: dict[str, Any] = {"op": "detectors"}
    if changes:
        request.update(token=token, set=changes)
    owners = run_owners(args.run_dir)
    failed = 0
    for s in live:
        try:
            answer = call(Path(s["control_socket"]), request, owners=owners)
        except ControlError as e:
            print(f"node {s['node']}: {e}", file=sys.stderr)
            failed += 1
            continue
        if not answer.get("ok"):
            print(f"node {s['node']}: refused: {answer.get('error')}", file=sys.stderr)
            failed += 1
            continue
        settings = answer.get("detectors", {})
        print(f"node {s['node']}:" + (" changed, from the next window on" if changes else ""))
        for key, value in sorted(settings.items()):
            mark = "  *" if key in changes else "   "
            print(f"{mark} {key} = {json.dumps(value)}")
    return 1 if failed else 0


def through_store(args: argparse.Namespace, changes: dict[str, Any]) -> int:
    """Validate ``changes`` and merge them into the launch's signed ``detectors`` record (one more sequence)."""
    import getpass
    import socket

    from ..coord.keyspace import LaunchKeys
    from ..watchdog.settings import apply, flatten
    from ..watchdog.slowdown import SlowdownConfig
    from ..watchdog.straggler import StragglerConfig
    from .stop_cmd import signed_launch

    signed, launch = signed_launch(args, "change the detectors of")
    key = LaunchKeys(launch["id"]).detectors()
    while True:
        entry, current = signed.get_entry(key)
        merged = {**((current or {}).get("changes") or {}), **changes}
        apply((StragglerConfig(), SlowdownConfig()), merged)  # a bad key or value is refused here, not on every node
        if not changes:
            print(json.dumps({"run_id": args.run_id, "launch_id": launch["id"], "requested": current}))
            return 0
        record = {"seq": int((current or {}).get("seq", 0)) + 1, "changes": merged,
                  "by": f"{getpass.getuser()}@{socket.gethostname()}"}
        swapped, _ = signed.compare_and_swap(key, entry.mod_revision if entry is not None else 0, record)
        if swapped:
            break
    print(f"run {args.run_id} (launch {launch['id']}): every agent applies from its next window, seq "
          f"{record['seq']}:")
    settings = flatten(apply((StragglerConfig(), SlowdownConfig()), merged))
    for k in sorted(merged):
        print(f"  * {k} = {json.dumps(settings[k])}")
    return 0
