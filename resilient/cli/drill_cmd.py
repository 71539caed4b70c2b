"""``resilient drill run FILE|DIR ...`` and ``resilient drill compare A.json B.json``: chaos drills, scored.

``run`` loads every drill first (a bad file fails before anything starts),
runs them one after another on this machine, prints a line of progress
every few seconds and each drill's verdicts, and writes per drill
``OUT/<name>/<name>.md`` and ``.json`` and for the suite ``OUT/drills.md``
and ``OUT/drills.json``.  Exit 0 when every expectation held (a drill this
machine cannot run is skipped and says why), 1 otherwise.
``compare`` prints what changed between two suites' records (or two
drills') and exits 1 on a regression.  The work is in :mod:`resilient.chaos`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any


def add_parser(commands: Any) -> None:
    group = commands.add_parser("drill", help="chaos drills: inject faults, score detection and recovery")
    kinds = group.add_subparsers(dest="drill", metavar="COMMAND", required=True)
    r = kinds.add_parser("run", help="run drill files (or every *.toml of a directory) and score them")
    r.add_argument("paths", nargs="+", type=Path, metavar="PATH", help="a drill file, or a directory of them")
    r.add_argument("--quick", action="store_true",
                   help="game days a third as long (duration and steps), for CI; every other drill as it is")
    r.add_argument("--out", type=Path, default=Path("drill-results"), metavar="DIR",
                   help="where the runs and reports go (default ./drill-results)")
    r.set_defaults(handler=cmd_run)
    c = kinds.add_parser("compare", help="what changed between two drill records (e.g. two releases)")
    c.add_argument("before", type=Path, metavar="BEFORE.json")
    c.add_argument("after", type=Path, metavar="AFTER.json")
    c.add_argument("--tolerance", type=float, default=0.10, metavar="R",
                   help="a measurement worse by more than this share is a regression (default 0.10)")
    c.set_defaults(handler=cmd_compare)


def drill_files(paths: list[Path]) -> list[Path]:
    from ..core.errors import ConfigError

    files: list[Path] = []
    for p in paths:
        if p.is_dir():
            found = sorted(p.glob("*.toml"))
            if not found:
                raise ConfigError(f"{p}: no drill files (*.toml) in this directory")
            files += found
        elif p.is_file():
            files.append(p)
        else:
            raise ConfigError(f"{p}: no such drill file or directory")
    return files


def cmd_run(args: argparse.Namespace) -> int:
    from ..chaos.drill import load_drill
    from ..chaos.report import render
    from ..chaos.runner import run_drill

    drills = [load_drill(f) for f in drill_files(args.paths)]
    if args.quick:
        drills = [d.quick() for d in drills]
    names = [d.name for d in drills]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        from ..core.errors import ConfigError

        raise ConfigError(f"two drills are named {dup!r}: each needs a name of its own (its results directory)")
    last = [0.0]

    def progress(line: str) -> None:
        now = time.monotonic()
        if now - last[0] >= 5 or not line.endswith(" s"):
            last[0] = now
            print(f"resilient: drill {line}", file=sys.stderr, flush=True)

    records = []
    references: dict = {}  # one uninterrupted run per workload and world, shared by the drills that have them
    for drill in drills:
        result = run_drill(drill, args.out, progress, references)
        records.append(result.record)
        skipped = result.record.get("skipped")
        verdict = f"SKIPPED ({skipped})" if skipped else ("PASS" if result.passed else "FAIL")
        print(f"{drill.name}: {verdict}")
        for v in result.verdicts:
            print(f"  {'ok ' if v.ok else 'FAIL'} {v.expectation}: wanted {v.wanted}, got {v.got}"
                  + (f" ({v.margin})" if v.margin else ""))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "drills.json").write_text(json.dumps(records, indent=1) + "\n")
    (args.out / "drills.md").write_text(render(records))
    print(f"wrote {args.out / 'drills.md'} and {args.out / 'drills.json'}")
    return 0 if all(r["passed"] or r.get("skipped") for r in records) else 1


def _records(path: Path) -> list[dict[str, Any]]:
    from ..core.errors import ConfigError

    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: not a drill record ({e}); give a drills.json or <name>.json") from None
    records = raw if isinstance(raw, list) else [raw]
    if not all(isinstance(r, dict) and "drill" in r and "measured" in r for r in records):
        raise ConfigError(f"{path}: not a drill record (no drill/measured fields); give a drills.json or <name>.json")
    return records


def cmd_compare(args: argparse.Namespace) -> int:
    from ..chaos.report import compare

    text, regressions = compare(_records(args.before), _records(args.after), args.tolerance)
    print(text, end="")
    print(f"{regressions} regression(s)")
    return 1 if regressions else 0
