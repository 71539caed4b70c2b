"""The shipped drill suite, run and kept with its provenance: detection, resumption and work lost per fault.

Runs ``resilient drill run chaos/ --out DIR`` (``--quick`` by default: the
game day a third as long) and writes ``benchmarks/results/drill_suite.json``
and ``.md``: the commit, the command, the machine's load before and after,
and per drill its verdict, detection and resumption seconds, re-done steps,
rung, equality and goodput, as the suite's records say.  The peer of each
measurement is the drill's own expectation (the margin is in the table).

    python benchmarks/drill_suite.py                 # ~20 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _provenance import commit, load_now, uncommitted_code_changes

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results"


def _num(value: Any, fmt: str = "{:.2f}") -> str:
    return "-" if value is None else fmt.format(value)


def render(record: dict[str, Any]) -> str:
    lines = ["# The drill suite", "",
             (f"commit `{record['commit']}`{' (uncommitted changes)' if record['uncommitted'] else ''}; "
              f"`{record['command']}`; {record['seconds']:.0f} s; load before {record['load_before']['loadavg']}, "
              f"after {record['load_after']['loadavg']}; exit {record['exit_code']}"), "",
             "| drill | verdict | detected (s) | by | resumed (s) | re-done steps | rung | equal | goodput |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in record["drills"]:
        m = r["measured"]
        verdict = "SKIP" if r["skipped"] else ("PASS" if r["passed"] else "FAIL")
        equal = {True: "bitwise", False: "differs", None: "-"}[m["equal"]]
        lines.append(f"| {r['drill']} | {verdict} | {_num(m['detect_s'])} | {m['detected_by'] or '-'} | "
                     f"{_num(m['resume_s'])} | {m['redone_steps']} | {m['rung'] or '-'} | {equal} | "
                     f"{_num(m['goodput'], '{:.3f}')} |")
    failed = [f"{r['drill']}: {v['expectation']} wanted {v['wanted']}, got {v['got']}"
              for r in record["drills"] for v in r["verdicts"] if not v["ok"]]
    if failed:
        lines += ["", "Failed expectations:", "", *(f"- {f}" for f in failed)]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--full", action="store_true", help="the game day at its full length (no --quick)")
    p.add_argument("--out-dir", type=Path, default=OUT)
    args = p.parse_args()
    before, started = load_now(), time.monotonic()
    with tempfile.TemporaryDirectory(prefix="drill-suite-") as tmp:
        cmd = [sys.executable, "-m", "resilient", "drill", "run", str(ROOT / "chaos"), "--out", tmp,
               *([] if args.full else ["--quick"])]
        done = subprocess.run(cmd, cwd=ROOT, check=False)
        records = json.loads((Path(tmp) / "drills.json").read_text())
    record = {"commit": commit(), "uncommitted": uncommitted_code_changes(), "load_before": before,
              "load_after": load_now(), "seconds": time.monotonic() - started, "exit_code": done.returncode,
              "command": "python " + " ".join(["benchmarks/drill_suite.py", *sys.argv[1:]]), "drills": records}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "drill_suite.json").write_text(json.dumps(record, indent=1) + "\n")
    (args.out_dir / "drill_suite.md").write_text(render(record))
    print(render(record))
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
