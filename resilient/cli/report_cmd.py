"""``resilient report goodput RUN_DIR``: the run's goodput account for people.

Prints the table, writes ``goodput.json`` and ``goodput.png`` (into the run
directory, or ``--out``).  The work is in :mod:`resilient.metrics.report`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_parser(commands: Any) -> None:
    group = commands.add_parser("report", help="reports on a run")
    kinds = group.add_subparsers(dest="report", metavar="REPORT", required=True)
    p = kinds.add_parser("goodput", help="where the run's time went: goodput, badput by category, incident costs",
                         description="Print the goodput account of a run, and write goodput.json and goodput.png.")
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the --run-dir of `resilient run`")
    p.add_argument("--out", type=Path, metavar="DIR", help="where goodput.json and goodput.png go (default RUN_DIR)")
    p.add_argument("--no-png", action="store_true", help="skip the picture (no matplotlib needed)")
    p.set_defaults(handler=cmd_goodput)


def cmd_goodput(args: argparse.Namespace) -> int:
    from ..agent.incidents import load_incidents
    from ..checkpoint.cadence import priced_alternatives
    from ..core.events import EventKind
    from ..metrics.report import write_report
    from .status_cmd import read_events

    incidents = load_incidents(args.run_dir / "incidents")
    cadence = [e for e in read_events(args.run_dir / "events.jsonl") if e.get("kind") == EventKind.CHECKPOINT_CADENCE]
    newest = cadence[-1] if cadence else None
    text, json_path, png_path = write_report(args.run_dir, incidents, args.out, png=not args.no_png,
                                             cadence=newest, priced=priced_alternatives(newest))
    print(text)
    print(f"wrote {json_path}" + (f" and {png_path}" if png_path else ""))
    return 0
