"""``resilient diagnose input``: pin a slowdown on the input path, or clear it, before anyone blames the hardware.

    resilient diagnose input --steps 50 --nproc-per-node 2 train.py --steps 1000

runs the script under ``resilient run`` in a diagnosis job of its own (a
run directory of its own, no checkpoint read or written): ``--steps`` steps
on the real input path, then as many on the same batches held in memory
(:mod:`resilient.worker.diagnose`), and prints the verdict of
:func:`resilient.watchdog.input_path.judge_input`.  The script must give
its data to ``Run(data=ElasticLoader(...))`` and run at least
``2 * --steps + 5`` steps.  Exit 0 with the verdict either way, 1 when the
job could not be measured.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..core.errors import ConfigError


def add_parser(commands: Any) -> None:
    p = commands.add_parser("diagnose", help="isolate a cause of slowness (input: the input pipeline)")
    what = p.add_subparsers(dest="what", metavar="WHAT", required=True)
    q = what.add_parser("input", help="the same steps on the real input path and on batches held in memory")
    q.add_argument("--steps", type=int, default=50, metavar="N", help="steps in each phase (default 50, at least 10)")
    q.add_argument("--nproc-per-node", default="1", metavar="N", help="ranks of the diagnosis job (default 1)")
    q.add_argument("--run-dir", type=Path, metavar="DIR", help="keep the job's run directory here (default: a temporary one)")
    q.add_argument("--min-share", type=float, default=0.05, metavar="R",
                   help="input-bound when the input path costs at least R of a step (default 0.05)")
    q.add_argument("--json", action="store_true", help="print the verdict as JSON")
    q.add_argument("-m", "--module", action="store_true", help="run SCRIPT as a module")
    q.add_argument("script", metavar="SCRIPT")
    q.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS")
    p.set_defaults(handler=cmd_diagnose)


def cmd_diagnose(args: argparse.Namespace) -> int:
    from ..watchdog.input_path import judge_input

    if args.steps < 10:
        raise ConfigError(f"--steps {args.steps}: each phase needs at least 10 steps (2 timing windows)")
    with tempfile.TemporaryDirectory(prefix="resilient-diagnose-") as scratch:
        root = args.run_dir if args.run_dir is not None else Path(scratch)
        results = root / "diagnosis"
        env = {**os.environ, "RESILIENT_DIAGNOSE": f"input:{args.steps}:{results}"}
        cmd = [sys.executable, "-m", "resilient", "run", "--run-dir", str(root / "run"), "--quiet",
               "--nproc-per-node", args.nproc_per_node, "--max-restarts", "0", "--run-id",
               f"diagnose-{uuid.uuid4().hex[:8]}", *(["-m"] if args.module else []), args.script, *args.script_args]
        print(f"resilient: diagnosing the input path of {args.script}: {args.steps} steps as it reads, then "
              f"{args.steps} on batches held in memory", file=sys.stderr, flush=True)
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        found = {int(p.stem[4:]): json.loads(p.read_text()) for p in sorted(results.glob("rank*.json"))}
        if done.returncode != 0 or not found:
            hint = "" if found else (f"; no rank finished both phases: the script must take its data from "
                                     f"Run(data=ElasticLoader(...)) and run at least {2 * args.steps + 5} steps")
            print(f"resilient: error: the diagnosis job exited {done.returncode}{hint}\n{done.stderr[-2000:]}",
                  file=sys.stderr)
            return 1
        verdict = judge_input(found, args.min_share)
    if args.json:
        print(json.dumps({**asdict(verdict), "ranks": sorted(found)}, indent=2))
    else:
        print(f"resilient: {verdict.reason}")
    return 0
