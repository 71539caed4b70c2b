"""Scripts as users write them, each killed mid-run under ``resilient run``: the run ends bitwise equal to the run
that never stopped, or exits non-zero saying why; never exit 0 and different.  Each row of the integrations table
(``docs/integrations.md``, the README) is run here.

Two GPT scripts written the way people write them (``tests/nanogpt_like.py``: the popular single-file trainer's
shape, its next batch fetched inside the step from the global generator, its own DDP set-up and checkpoint;
``tests/gpt_env_rank.py``: the spare-capable integration that still reads ``RANK``/``WORLD_SIZE`` before
``Run()``).  A rank SIGKILLs itself at the top of an iteration in the launch's first process.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from .agent_helpers import events, explain, incidents, run_agent
from .helpers import REPO

NANO = REPO / "tests" / "nanogpt_like.py"
ENV_RANK = REPO / "tests" / "gpt_env_rank.py"
CRASH = 25


def nano(out: Path, integration: str, *extra: str) -> tuple[str, ...]:
    return (f"--resilient_integration={integration}", f"--out_dir={out}", f"--trace={out / 'trace.jsonl'}", *extra)


def trace(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "trace.jsonl").read_text().splitlines()]


def final(out: Path) -> dict[str, Any]:
    [record] = [r for r in trace(out) if "final" in r]
    return record


def iterations(out: Path, rank: int = 0) -> list[int]:
    """The iterations rank ``rank`` completed, in the order it completed them (a restart repeats some)."""
    return [r["iter"] for r in trace(out) if "iter" in r and r["rank"] == rank]


def launches(out: Path, crash: int) -> list[list[int]]:
    """Rank 0's iterations, cut where they go back (a restart).  The first run's are checked: from 0 up to the
    crash of rank 1 at the top of iteration ``crash``, the last one possibly missing (rank 1 dies as soon as it
    finished it, and the agent stops rank 0 at once, which may be before rank 0 wrote it down)."""
    done = iterations(out)
    cuts = [i for i in range(1, len(done)) if done[i] <= done[i - 1]]
    parts = [done[a:b] for a, b in zip([0, *cuts], [*cuts, len(done)], strict=True)]
    first = parts[0]
    assert first == list(range(len(first))) and len(first) in (crash - 1, crash), done
    return parts


@pytest.fixture(scope="module")
def nano_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The prefetching script through run.prefetch, never stopped (its five-line twin trains the same)."""
    out = tmp_path_factory.mktemp("nano-ref")
    proc = run_agent(out / "run", "--nproc-per-node", "2", script=NANO, script_args=nano(out, "prefetch"))
    assert proc.returncode == 0, explain(proc)
    assert iterations(out) == list(range(40))
    return final(out)


@pytest.fixture(scope="module")
def env_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("env-ref")
    proc = run_agent(out / "run", "--nproc-per-node", "2", script=ENV_RANK,
                     script_args=(f"--ckpt_dir={out / 'ckpt'}", f"--trace={out / 'trace.jsonl'}"))
    assert proc.returncode == 0, explain(proc)
    return final(out)


# ------------------------------------------------------------------ row 1: the script unmodified


def test_an_unmodified_script_restarts_from_its_top_and_its_incident_names_what_is_known(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = run_agent(tmp_path / "run", "--nproc-per-node", "2", script=NANO,
                     script_args=nano(out, "none", f"--crash_at={CRASH}", "--crash_rank=1"))
    assert proc.returncode == 0, explain(proc)
    assert launches(out, CRASH)[1:] == [list(range(40))], "a restart of an unmodified script begins at its top"
    [incident] = incidents(tmp_path / "run")
    assert incident["rank"] == 1 and incident["section"] is None and incident["step"] is None, incident
    assert "no step was reported (no resilient.Run yet)" in incident["summary"], incident["summary"]


def test_an_unmodified_script_resumes_from_its_own_checkpoint_with_restart_args(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = run_agent(tmp_path / "run", "--nproc-per-node", "2", "--restart-args=--init_from=resume", script=NANO,
                     script_args=nano(out, "none", f"--crash_at={CRASH}", "--crash_rank=1"))
    assert proc.returncode == 0, explain(proc)
    # Its ckpt.pt is written at every eval_interval (10) on rank 0: the restart resumes at 20.
    assert launches(out, CRASH)[1:] == [list(range(20, 40))]
    log = (tmp_path / "run" / "nodes").glob("*/g2/rank0.log")
    assert any("resuming from" in p.read_text() for p in log)


# ------------------------------------------------------------------ row 2: the five lines


def test_the_five_lines_with_a_batch_fetched_ahead_stop_with_the_reason_rather_than_train_another_run(
        tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = run_agent(tmp_path / "run", "--nproc-per-node", "2", script=NANO, console=True,
                     script_args=nano(out, "five", f"--crash_at={CRASH}", "--crash_rank=1"))
    assert proc.returncode == 79, explain(proc)
    assert ("recovery for this script: a restart from the memory tier or the newest commit, bitwise (the steps "
            "since that save are trained again); not in process: the script's steps are not under "
            "run.attempt()") in proc.stdout
    [diverged, *_] = events(tmp_path / "run", "resume_diverged")
    assert diverged["moved"] == ["torch"] and diverged["accepted"] is False
    last = incidents(tmp_path / "run")[-1]
    assert last["error"]["exc_type"].endswith("ResumeDivergedError"), last["error"]
    assert "a batch prefetched outside run.steps()" in last["error"]["message"]
    assert "final" not in json.dumps(trace(out)), "it stopped: no final model to mistake for the reference"


@pytest.mark.parametrize("flags", [(), ("--no-memory-tier",)], ids=["memory-tier", "durable-commit"])
def test_the_five_lines_with_run_prefetch_resume_bitwise_equal(tmp_path: Path, nano_reference: dict[str, Any],
                                                               flags: tuple[str, ...]) -> None:
    out = tmp_path / "out"
    crash = CRASH if not flags else CRASH + 2
    proc = run_agent(tmp_path / "run", "--nproc-per-node", "2", *flags, script=NANO,
                     script_args=nano(out, "prefetch", f"--crash_at={crash}", "--crash_rank=1"))
    assert proc.returncode == 0, explain(proc)
    [restored] = events(tmp_path / "run", "restored")[1:]
    assert restored["generation"] == 2
    assert not events(tmp_path / "run", "resume_diverged")
    assert final(out) == nano_reference
    assert launches(out, crash)[1:] == [list(range(restored["step"], 40))], restored


# ------------------------------------------------------------------ row 3: run.attempt()


def test_a_script_that_reads_its_rank_before_run_is_replaced_by_a_spare_with_the_right_rank(
        tmp_path: Path, env_reference: dict[str, Any]) -> None:
    out = tmp_path / "out"
    proc = run_agent(tmp_path / "run", "--nproc-per-node", "2", "--spares", "1", script=ENV_RANK, console=True,
                     script_args=(f"--ckpt_dir={out / 'ckpt'}", f"--trace={out / 'trace.jsonl'}",
                                  f"--crash_at={CRASH - 8}", "--crash_rank=1"))
    assert proc.returncode == 0, explain(proc)
    assert ("recovery for this script: in process first (a spare takes a lost rank's place, 1 kept; the survivors "
            "retry the step after a network error)") in proc.stdout
    run = tmp_path / "run"
    assert not events(run, "restart")
    [done] = events(run, "recovered_in_process")
    assert done["rung"] == "promote_spare" and done["resumed_after_step"] == CRASH - 8, done
    # The spare started the script with rank 1 of 2: it logged as rank 1 of a world of 2, never as rank 0 or alone.
    after = [r for r in trace(out) if "iter" in r and r["iter"] >= CRASH - 8]
    assert {(r["rank"], r["world_size"]) for r in after} == {(0, 2), (1, 2)}
    assert sum(1 for r in after if r["rank"] == 1) == 30 - (CRASH - 8), "each iteration once on rank 1"
    assert final(out) == env_reference


def test_a_script_that_reads_its_rank_before_run_restarts_bitwise_without_a_spare(
        tmp_path: Path, env_reference: dict[str, Any]) -> None:
    out = tmp_path / "out"
    proc = run_agent(tmp_path / "run", "--nproc-per-node", "2", script=ENV_RANK,
                     script_args=(f"--ckpt_dir={out / 'ckpt'}", f"--trace={out / 'trace.jsonl'}",
                                  f"--crash_at={CRASH - 8}", "--crash_rank=1"))
    assert proc.returncode == 0, explain(proc)
    assert len(events(tmp_path / "run", "restart")) == 1
    assert final(out) == env_reference


# ------------------------------------------------------------------ the tables these runs stand for


def table_rows(text: str, header: str) -> list[list[str]]:
    """The rows of the markdown table whose header row starts with ``header``, as lists of cells."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {header}"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def test_the_integration_tables_of_the_readme_and_the_docs_have_the_rows_run_here() -> None:
    """Each row says what the tests above run: an unmodified script restarts from its top (or its own checkpoint
    with --restart-args), the five lines restart from the memory tier or the commit, bitwise and checked, and
    run.attempt() recovers in process with a spare, a shrink or a retry."""
    readme = table_rows((REPO / "README.md").read_text(), "your script")
    docs = table_rows((REPO / "docs" / "integrations.md").read_text(), "integration")
    for rows, crash in ((readme, 1), (docs, 2)):
        assert len(rows) == 3, rows
        unmodified, five, attempt = (row[0] + " " + row[crash] for row in rows)
        assert "unmodified" in unmodified and "from its top" in unmodified and "--restart-args" in unmodified
        assert "run.steps" in five and "memory tier" in five and "newest commit" in five
        assert "run.attempt()" in attempt and "in process" in attempt
    assert "checked at the first step" in readme[1][1] and "bitwise" in docs[1][4]
    assert "spare" in readme[2][1] and "shrink" in readme[2][1] and "spare" in docs[2][3]
