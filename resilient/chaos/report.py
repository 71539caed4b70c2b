"""Drill reports: a Markdown table per drill (and a suite), and the comparison of two releases' records.  Pure.

A record is what :func:`resilient.chaos.score.to_json` wrote (``<name>.json``);
a suite's file (``drills.json``) holds a list of them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def _s(value: Any, unit: str = " s") -> str:
    return "-" if value is None else f"{value:.2f}{unit}"


def summary_row(record: Mapping[str, Any]) -> str:
    m = record["measured"]
    kinds = ", ".join(sorted({f["kind"] for f in record["faults"]})) or "-"
    equal = {None: "-", True: "bitwise", False: "differs"}[m["equal"]]
    goodput = "-" if m["goodput"] is None else f"{m['goodput']:.1%}"
    verdict = "skipped: " + record["skipped"] if record.get("skipped") else ("PASS" if record["passed"] else "**FAIL**")
    return (f"| {record['drill']} | {kinds} | {_s(m['detect_s'])} | {_s(m['resume_s'])} | {m['redone_steps']} | "
            f"{m['rung'] or '-'} | {equal} | {goodput} | {verdict} |")


def render(records: Sequence[Mapping[str, Any]]) -> str:
    """The suite's table, then each drill's expectations with what was measured and the margin."""
    lines = ["# Drills", "",
             "| drill | fault | detect | resume | re-done steps | rung | equality | goodput | verdict |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [summary_row(r) for r in records]
    for r in records:
        lines += ["", f"## {r['drill']} (`{r['file']}`, seed {r['seed']})", ""]
        if r.get("skipped"):
            lines.append(f"Skipped: {r['skipped']}")
            continue
        if r.get("timeline"):
            lines += [f"Timeline: `{r['timeline']}`", ""]
        lines += ["Faults: " + "; ".join(
            f"{f['kind']}: {f['description']}" if f.get("source") == "host" else
            f"{f['kind']} rank {f.get('rank', '*')} at step {f['step']} ({f.get('section', 'step')})"
            for f in r["faults"]), "",
            "| expectation | wanted | got | verdict | margin |", "|---|---|---|---|---|"]
        for v in r["verdicts"]:
            lines.append(f"| {v['expectation']} | {v['wanted']} | {v['got']} | "
                         f"{'PASS' if v['ok'] else '**FAIL**'} | {v['margin']} |")
        if r.get("gameday"):
            lines += ["", *gameday_lines(r["gameday"])]
    return "\n".join(lines) + "\n"


def gameday_lines(g: Mapping[str, Any]) -> list[str]:
    """A game day's Young/Daly comparison as a table."""
    def v(key: str, unit: str = "") -> str:
        return "-" if g.get(key) is None else f"{g[key]:g}{unit}"
    return ["Young/Daly:", "", "| quantity | value | from |", "|---|---|---|",
            f"| faults that struck | {v('faults')} | the host faults' log |",
            f"| checkpoint cost C | {v('checkpoint_cost_s', ' s')} | the reference's checkpoint stall per commit |",
            f"| checkpoint interval tau | {v('interval_s', ' s')} | checkpoint_every x the reference's ideal step |",
            f"| restart cost R | {v('restart_cost_s', ' s')} | detection + recovery per incident (ledger) |",
            (f"| work lost per failure | {v('replay_s', ' s')} measured, {v('model_replay_s', ' s')} modelled "
             "(tau/2) | the ledger's replay |"),
            (f"| goodput | {v('measured_goodput')} measured, {v('predicted_goodput')} predicted "
             f"({'-' if g.get('relative_error') is None else format(g['relative_error'], '+.1%')}) | "
             f"reference {v('reference_goodput')} |"),
            (f"| Young's interval for MTBF {v('mtbf_s', ' s')} | {v('young_interval_s', ' s')} "
             f"({v('young_interval_steps')} steps) | sqrt(2 C M) |")]


def _fmt(key: str, value: float, unit: str) -> str:
    if key == "goodput":
        return f"{value:.1%}"
    return f"{value:g}{unit}" if isinstance(value, int) else f"{value:.2f}{unit}"


COMPARED = (("detect_s", "detect", " s"), ("resume_s", "resume", " s"), ("redone_steps", "re-done steps", ""),
            ("goodput", "goodput", ""))
"""Measurements compared between two records: lower is better, except goodput."""


def compare(before: Sequence[Mapping[str, Any]], after: Sequence[Mapping[str, Any]],
            tolerance: float = 0.10) -> tuple[str, int]:
    """Drill by drill, what changed from ``before`` to ``after``; (the Markdown, how many regressions).

    A regression: a drill that passed and fails now, or a measurement more than ``tolerance`` (10%) worse
    (detect and resume also by more than 0.5 s, so run-to-run jitter of a fast recovery is not one)."""
    old = {r["drill"]: r for r in before}
    lines = ["| drill | measurement | before | after | change |", "|---|---|---|---|---|"]
    regressions = 0
    for r in after:
        name = r["drill"]
        prev = old.get(name)
        if r.get("skipped"):
            lines.append(f"| {name} | - | {'-' if prev is None else ('PASS' if prev['passed'] else 'FAIL')} | "
                         f"skipped | not run here: {r['skipped']} |")
            continue
        if prev is None:
            lines.append(f"| {name} | - | - | {'PASS' if r['passed'] else 'FAIL'} | new drill |")
            continue
        if prev["passed"] and not r["passed"]:
            regressions += 1
            failed = ", ".join(v["expectation"] for v in r["verdicts"] if not v["ok"])
            lines.append(f"| {name} | verdict | PASS | FAIL | **regression** ({failed}) |")
        for key, label, unit in COMPARED:
            a, b = prev["measured"].get(key), r["measured"].get(key)
            if a is None or b is None:
                continue
            worse = (b < a * (1 - tolerance)) if key == "goodput" else \
                (b > a * (1 + tolerance) and (key == "redone_steps" or b - a > 0.5))
            regressions += worse
            lines.append(f"| {name} | {label} | {_fmt(key, a, unit)} | {_fmt(key, b, unit)} | "
                         f"{'**regression**' if worse else 'ok'} |")
    for name in sorted(set(old) - {r["drill"] for r in after}):
        lines.append(f"| {name} | - | {'PASS' if old[name]['passed'] else 'FAIL'} | - | not run |")
    return "\n".join(lines) + "\n", regressions
