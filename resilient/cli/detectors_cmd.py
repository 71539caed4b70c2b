"""``resilient detectors``: read or change the straggler and slowdown detectors of a running job.

    resilient detectors --run-dir runs/x                                 # every setting, per node
    resilient detectors --run-dir runs/x straggler.rule.decision=12 slowdown.enabled=false

A change needs the run's token (``<run_dir>/token``), is validated by each
agent (a bad key or value is refused, naming the settings or the rule it
breaks), applies from the next window of steps without a restart, and is a
``detectors_changed`` event.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..errors import ConfigError


def add_parser(commands: Any) -> None:
    p = commands.add_parser("detectors", help="read or change a running job's straggler and slowdown detectors")
    p.add_argument("--run-dir", type=Path, metavar="DIR", required=True, help="the run directory")
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
    from .stop_cmd import live_agents

    changes = parse_assignments(args.set)
    token, live = live_agents(args.run_dir)
    request: dict[str, Any] = {"op": "detectors"}
    if changes:
        request.update(token=token, set=changes)
    failed = 0
    for s in live:
        try:
            answer = call(Path(s["control_socket"]), request)
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
