"""What must hold in every run's event log, whatever the test: one decision per generation, each rank held by one
worker, each worker in one place.

Every test that runs agents leaves their shared event log (``events.jsonl`` in the run directory, all nodes
writing to it); the suite's autouse fixture (``conftest.py``) reads each one its test left and fails the test on a
violation, so a race that double-decides or places a spare twice fails whichever test it happens in.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any


def _load(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line torn by a SIGKILL mid-write
    return out


def recovery_violations(events: list[dict[str, Any]]) -> list[str]:
    """The violations in one run's event log (empty: none).

    * a generation formed in process was decided once: every node that applied it names the same previous
      generation, rung and deciding node, and applied it once;
    * in each generation, formed in process or by a restart's round, a rank is held by one worker (on one node)
      and a worker (a promoted spare among them) holds one rank;
    * a generation is formed either by a round or in process, never both.
    """
    problems: list[str] = []
    continued: dict[int, list[dict[str, Any]]] = defaultdict(list)
    started: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e.get("kind") == "generation_continued":
            continued[int(e["generation"])].append(e)
        elif e.get("kind") == "workers_started" and e.get("generation") is not None:
            started[int(e["generation"])].append(e)
    for g, applied in sorted(continued.items()):
        decisions = {(e.get("previous"), e.get("action"), e.get("decided_by")) for e in applied}
        if len(decisions) > 1:
            problems.append(f"generation {g} was formed by {len(decisions)} decisions: {sorted(map(str, decisions))}")
        nodes = [e.get("node") for e in applied]
        for node in sorted({n for n in nodes if nodes.count(n) > 1}, key=str):
            problems.append(f"node {node} applied generation {g} {nodes.count(node)} times")
        problems += _places(g, [(e.get("node"), r, w) for e in applied for r, w in (e.get("members") or {}).items()])
    for g, rounds in sorted(started.items()):
        if g in continued:
            problems.append(f"generation {g} was formed both by a round and in process")
        problems += _places(g, [(e.get("node"), r, f"{e.get('node')}:{pid}") for e in rounds
                                for r, pid in (e.get("pids") or {}).items()])
    return problems


def _places(generation: int, held: list[tuple[Any, str, str]]) -> list[str]:
    """(node, rank, worker) of one generation: each rank one worker, each worker one rank."""
    problems = []
    by_rank: dict[str, set[tuple[Any, str]]] = defaultdict(set)
    by_worker: dict[str, set[str]] = defaultdict(set)
    for node, rank, worker in held:
        by_rank[str(rank)].add((node, worker))
        by_worker[worker].add(str(rank))
    for rank, holders in sorted(by_rank.items()):
        if len(holders) > 1:
            problems.append(f"generation {generation}: rank {rank} held by {sorted(map(str, holders))}")
    for worker, ranks in sorted(by_worker.items()):
        if len(ranks) > 1:
            problems.append(f"generation {generation}: worker {worker} holds ranks {sorted(ranks)}")
    return problems


def check_event_logs(root: Path) -> list[str]:
    """Every violation in the event logs under ``root``, each prefixed with its log's path."""
    return [f"{path}: {problem}" for path in sorted(root.rglob("events.jsonl"))
            for problem in recovery_violations(_load(path))]
