"""Shared helpers: run the training worker in real processes and read its traces."""

from __future__ import annotations

import json
import re
import signal
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from .launch import Finished, run_ranks

WORKER = Path(__file__).with_name("worker_train.py")
REPO = WORKER.parent.parent


@dataclass
class Trace:
    starts: list[dict] = field(default_factory=list)
    steps: dict[int, dict] = field(default_factory=dict)
    """Last record of each step (a replayed step overwrites the first try)."""
    all_steps: list[dict] = field(default_factory=list)
    end: dict | None = None


def read_trace(prefix: Path, rank: int = 0) -> Trace:
    trace = Trace()
    for line in Path(f"{prefix}.rank{rank}").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("event") == "start":
            trace.starts.append(rec)
        elif rec.get("event") == "end":
            trace.end = rec
        else:
            trace.steps[rec["step"]] = rec
            trace.all_steps.append(rec)
    return trace


def run_worker(
    trace: Path, *args: str, nproc: int = 1, expect: str = "ok", timeout: float = 120, env: dict | None = None
) -> list[Finished]:
    """Run the worker, ``nproc`` ranks of it as torchrun would start them (forked from the tests' fork server,
    :mod:`tests.launch`); ``expect`` is "ok" or "killed"."""
    cmd = [sys.executable, str(WORKER), "--trace", str(trace), *args]
    ranks = run_ranks(cmd, nproc, env, timeout=timeout, world=nproc > 1)
    codes = [r.returncode for r in ranks]
    shown = "\n".join(f"--- rank {i} (exit {r.returncode}):\n{r.output[-3000:]}" for i, r in enumerate(ranks))
    if expect == "ok":
        assert codes == [0] * nproc, f"worker failed {codes}:\n{shown}"
    elif expect == "killed":
        assert -signal.SIGKILL in codes, f"a rank was expected to be SIGKILLed, exits {codes}:\n{shown}"
    return ranks


def assert_same_run(reference: Trace, resumed: Trace, from_step: int = 0) -> None:
    """Every step at or after ``from_step`` and the final state are bitwise equal."""
    assert reference.end is not None and resumed.end is not None
    assert sorted(resumed.steps) == sorted(reference.steps)
    for step in sorted(reference.steps):
        if step < from_step:
            continue
        ref, got = reference.steps[step], resumed.steps[step]
        assert got["indices"] == ref["indices"], f"step {step}: batches differ {got['indices']} != {ref['indices']}"
        assert got["lr"] == ref["lr"], f"step {step}: learning rate differs"
        assert got["loss"] == ref["loss"], f"step {step}: loss differs {got['loss']} != {ref['loss']}"
    for key in ("step", "params", "optimizer", "torch_rng", "python_rng", "numpy_rng"):
        assert resumed.end[key] == reference.end[key], f"final {key} differs"


def assert_same_tree(x: object, y: object, where: str = "state") -> None:
    """Bitwise equal trees (dicts, lists, tuples) of tensors and plain values; ``where`` names a difference."""
    import torch

    if isinstance(x, torch.Tensor):
        assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y), where
    elif isinstance(x, dict):
        assert isinstance(y, dict) and x.keys() == y.keys(), where
        for k in x:
            assert_same_tree(x[k], y[k], f"{where}.{k}")
    elif isinstance(x, (list, tuple)):
        assert isinstance(y, (list, tuple)) and len(x) == len(y), where
        for i, (u, v) in enumerate(zip(x, y)):
            assert_same_tree(u, v, f"{where}[{i}]")
    else:
        assert x == y, f"{where}: {x!r} != {y!r}"


def assert_diagram_is_the_code_s(section: str, phases: type[Enum], edges: Iterable[tuple[Enum, Enum]]) -> None:
    """The mermaid diagram under ``## <section>`` of docs/architecture.md draws exactly ``edges`` between the
    ``phases`` (named by their values), and no phase the code does not have."""
    doc = (Path(__file__).parents[1] / "docs" / "architecture.md").read_text()
    found = re.search(rf"## {re.escape(section)}\n.*?```mermaid\n(.*?)```", doc, re.DOTALL)
    assert found, f"docs/architecture.md has no section {section!r} with a mermaid diagram"
    names = {p.value: p for p in phases}
    drawn = set()
    for a, b in re.findall(r"^\s*(\S+)\s*-->\s*(\S+?)\s*(?::.*)?$", found.group(1), re.MULTILINE):
        if a == "[*]" or b == "[*]":
            continue
        assert a in names and b in names, f"the diagram names a phase the code does not have: {a} --> {b}"
        drawn.add((names[a], names[b]))
    expected = set(edges)
    assert drawn == expected, (sorted(expected - drawn, key=str), sorted(drawn - expected, key=str))
