"""``resilient stop``: ask every agent of a run to checkpoint and stop, as SIGTERM would.

It reads the run's token from ``<run_dir>/token`` (so only a user who can
read that file can stop the run) and sends a stop request to each node's
control socket; the workers commit a checkpoint at a step boundary ahead of
every rank and exit, and each agent ends with the verdict "preempted".
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..errors import ConfigError


def add_parser(commands: Any) -> None:
    p = commands.add_parser("stop", help="checkpoint and stop a running run (needs the run's token)")
    p.add_argument("--run-dir", type=Path, required=True, metavar="DIR", help="the run directory")
    p.add_argument("--reason", default="resilient stop", help="recorded in the events (default: 'resilient stop')")
    p.set_defaults(handler=cmd_stop)


def cmd_stop(args: argparse.Namespace) -> int:
    from ..agent.control import ControlError, call
    from ..agent.rundir import read_token
    from ..fsutil import read_json

    token_file = args.run_dir / "token"
    if not token_file.exists():
        raise ConfigError(f"no run token at {token_file}: is {args.run_dir} the run directory of `resilient run`?")
    token = read_token(token_file)
    statuses = [s for p in sorted((args.run_dir / "nodes").glob("*/status.json")) if (s := read_json(p))]
    live = [s for s in statuses if s.get("control_socket") and not str(s.get("phase", "")).startswith("finished")]
    if not live:
        raise ConfigError(f"no running agent found under {args.run_dir}/nodes")
    failed = 0
    for s in live:
        try:
            answer = call(Path(s["control_socket"]), {"op": "stop", "token": token, "reason": args.reason})
        except ControlError as e:
            print(f"node {s['node']}: {e}", file=sys.stderr)
            failed += 1
            continue
        print(f"node {s['node']}: {json.dumps(answer)}")
        failed += 0 if answer.get("ok") else 1
    return 1 if failed else 0
