"""Incidents as an on-call engineer reads them: one line each, or one whole (``resilient incident ls|show``).

Works on the records the agents wrote (``<run_dir>/incidents/<id>.json``,
:mod:`resilient.agent.incidents`), read-only, from any machine that sees
the run directory.  An incident is named by its id or by a prefix that
only it has.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..core.errors import ConfigError
from .incidents import load_incidents

SHOWN_INDICES = 32
"""Sample indices of the failing step a ``show`` prints (the record keeps them all)."""


def incidents_of(run_dir: Path) -> list[dict[str, Any]]:
    """Every incident of the run at ``run_dir``, oldest first; ConfigError when it is not a run directory."""
    if not (run_dir / "incidents").is_dir() and not (run_dir / "nodes").is_dir():
        raise ConfigError(f"{run_dir} is not a run directory (no incidents/ or nodes/ in it); give the --run-dir "
                          "of `resilient run`")
    return load_incidents(run_dir / "incidents")


def find(records: Sequence[Mapping[str, Any]], wanted: str, run_dir: Path) -> Mapping[str, Any]:
    """The incident whose id is ``wanted``, or the one id that starts with it; ConfigError naming the ids."""
    exact = [r for r in records if r.get("id") == wanted]
    found = exact or [r for r in records if str(r.get("id", "")).startswith(wanted)]
    if len(found) == 1:
        return found[0]
    ids = [str(r.get("id")) for r in records]
    if not found:
        known = ", ".join(ids[-10:]) if ids else "none"
        raise ConfigError(f"no incident {wanted!r} in {run_dir / 'incidents'} (its newest: {known}); list them with "
                          f"`resilient incident ls {run_dir}`")
    raise ConfigError(f"{wanted!r} names {len(found)} incidents ({', '.join(str(r.get('id')) for r in found)}); "
                      "give more of the id")


def first_failure(record: Mapping[str, Any]) -> str:
    """What failed first, in one line: the exception and its message, else the summary."""
    error = record.get("error") or {}
    if error.get("exc_type"):
        message = " ".join(str(error.get("message") or "").split())
        return f"{error['exc_type']}: {message}"
    return str(record.get("summary") or "")


def when(record: Mapping[str, Any]) -> str:
    wall = record.get("wall_time")
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(wall)) if isinstance(wall, (int, float)) else "-"


def lines(records: Sequence[Mapping[str, Any]], width: int | None = None) -> list[str]:
    """``resilient incident ls``: a header, then one line per incident, its id first (cut at ``width``)."""
    rows = [(str(r.get("id")), when(r), str(r.get("kind") or "-"),
             str(r.get("step")) if r.get("step") is not None else "-", first_failure(r)) for r in records]
    widths = [max([len(h), *(len(row[i]) for row in rows)]) for i, h in enumerate(("ID", "TIME", "KIND", "STEP"))]
    out = []
    for row in [("ID", "TIME", "KIND", "STEP", "FIRST FAILURE"), *rows]:
        text = "  ".join(cell.ljust(w) for cell, w in zip(row[:4], widths, strict=True)) + "  " + row[4]
        out.append(text if width is None or len(text) <= width else text[:width - 3] + "...")
    return out


def render(record: Mapping[str, Any]) -> str:
    """``resilient incident show``: everything the record holds, for a person."""
    out = [f"incident {record.get('id')}  ({record.get('kind')}, {when(record)})",
           f"  {record.get('summary')}",
           (f"  node {record.get('node')}, generation {record.get('generation')}, rank {record.get('rank')}, "
            f"section {record.get('section')!r}, step {record.get('step')}")]
    error = record.get("error") or {}
    if error:
        out += ["", f"first failure: {first_failure(record)}"]
        trace = str(error.get("traceback") or "").rstrip()
        if trace:
            out += ["", "traceback:", *("  " + line for line in trace.splitlines())]
        position = error.get("position") or {}
        if position.get("indices") is not None:
            mine = list(position.get("rank_indices") or [])
            shown = ", ".join(map(str, mine[:SHOWN_INDICES])) + (", ..." if len(mine) > SHOWN_INDICES else "")
            first, size = position.get("step_start", 0), position.get("global_batch", 0)
            out += ["", (f"data at step {position.get('step')}: stream positions {first} to {first + size - 1} "
                         f"(global batch {size}, seed {position.get('seed')}); rank {position.get('rank')} of "
                         f"{position.get('world_size')} read samples {shown}")]
    for title, key in (("other failures", "other_failures"), ("problems", "problems")):
        if record.get(key):
            out += ["", f"{title}:", *(f"  {line}" for line in record[key])]
    for rank, stack in sorted((record.get("stacks") or {}).items(), key=lambda kv: int(kv[0])):
        out += ["", f"stack of rank {rank} ({stack.get('state')}, {stack.get('method')}):",
                *("  " + line for line in str(stack.get("text") or stack.get("note") or "").rstrip().splitlines())]
    for title, key in (("hang", "hang"), ("performance", "performance"), ("recovery ladder", "ladder"),
                       ("decision", "decision"), ("restored", "restored"), ("recovered", "recovered")):
        if record.get(key):
            out += ["", f"{title}:", *("  " + line for line in json.dumps(record[key], indent=1,
                                                                           sort_keys=True).splitlines())]
    return "\n".join(out)
