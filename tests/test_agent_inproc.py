"""In-process recovery under ``resilient run``: spares, shrink, and the fall back to a restart.

Real agents, real worker processes on gloo, the script a user writes
(``tests/elastic_worker.py``: ``Run(ddp=True)``, ``run.attempt()``,
``run.micro_batches()``).  An uninterrupted run of the same script is the
reference: with a spare the recovered run must equal it bitwise (every
step's losses and sample ids, the final parameters and optimizer state)
with no step done twice; shrunk, it must consume every sample of the epoch
exactly once, each step's global sample set must equal the reference's,
and its parameters must stay within a stated tolerance of the reference's
(the sums run in another order on fewer ranks).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from .agent_helpers import events, explain, incidents, run_agent

WORKER = Path(__file__).with_name("elastic_worker.py")
STEPS = 8
DIE_STEP = 4


def trace(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "trace.jsonl").read_text().splitlines() if line.strip()]


def by_step(lines: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    found: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for line in lines:
        found[line["step"]].append(line)
    return found


def elastic_run(tmp: Path, name: str, *flags: str, die: tuple[str, str] | None = None,
                extra: tuple[str, ...] = ()) -> tuple[Path, Any]:
    """Run the worker script under the agent; ``die``: (worker id, how) strikes at DIE_STEP."""
    out = tmp / name
    out.mkdir()
    args = ["--steps", str(STEPS), "--out", str(out), "--ckpt", str(out / "ckpt"), *extra]
    if die is not None:
        args += ["--die-worker", die[0], "--die-step", str(DIE_STEP), "--die-how", die[1]]
    proc = run_agent(out / "run", "--max-restarts", "2", *flags, script=WORKER, script_args=tuple(args),
                     timeout=240)
    return out, proc


@pytest.fixture(scope="module")
def reference2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out, proc = elastic_run(tmp_path_factory.mktemp("ref2"), "ref", "--nproc-per-node", "2")
    assert proc.returncode == 0, explain(proc)
    return out


@pytest.fixture(scope="module")
def reference3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out, proc = elastic_run(tmp_path_factory.mktemp("ref3"), "ref", "--nproc-per-node", "3")
    assert proc.returncode == 0, explain(proc)
    return out


def assert_bitwise_equal(out: Path, reference: Path) -> None:
    got, want = by_step(trace(out)), by_step(trace(reference))
    assert sorted(got) == list(range(STEPS)) == sorted(want)
    for step in range(STEPS):
        assert len(got[step]) == 2, f"step {step} was completed {len(got[step])} times, not once per rank: {got[step]}"
        mine = {line["rank"]: (line["indices"], line["losses"]) for line in got[step]}
        theirs = {line["rank"]: (line["indices"], line["losses"]) for line in want[step]}
        assert mine == theirs, f"step {step} differs from the uninterrupted run"
    final, ref = json.loads((out / "final.json").read_text()), json.loads((reference / "final.json").read_text())
    assert final["params"] == ref["params"]
    assert final["optimizer"] == ref["optimizer"]
    assert (final["scheduler"], final["lr"], final["samples"]) == (ref["scheduler"], ref["lr"], ref["samples"])


@pytest.mark.parametrize("how", ["kill", "start"])
def test_a_spare_replaces_a_killed_rank_with_nothing_redone(tmp_path: Path, reference2: Path, how: str) -> None:
    out, proc = elastic_run(tmp_path, how, "--nproc-per-node", "2", "--spares", "1", die=("w1", how),
                            extra=("--spares-ready", "1"))
    assert proc.returncode == 0, explain(proc)
    run = out / "run"
    assert not events(run, "restart"), "recovered by a restart, not in process"
    decided = events(run, "recovery_decided")
    assert [d["action"] for d in decided] == ["promote_spare"], decided
    assert decided[0]["promotions"] == [{"rank": 1, "spare": "s2", "node": decided[0]["promotions"][0]["node"]}]
    done = events(run, "recovered_in_process")
    assert len(done) == 1 and done[0]["rung"] == "promote_spare" and done[0]["resumed_after_step"] == DIE_STEP, done
    workers = {line["worker"] for line in trace(out) if line["step"] > DIE_STEP and line["rank"] == 1}
    assert workers == {"s2"}, f"rank 1 after the failure was {workers}, not the spare"
    [incident] = incidents(run)
    assert incident["decision"]["action"] == "promote_spare" and incident["recovered"]["rung"] == "promote_spare"
    assert_bitwise_equal(out, reference2)
    # The pool was refilled: a second spare started after the promotion and came up warm.
    started = [e["worker"] for e in events(run, "spare_started")]
    assert started[:1] == ["s2"] and len(started) == 2, started
    assert {e["worker"] for e in events(run, "spare_ready")} >= set(started[:1])
