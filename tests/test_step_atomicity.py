"""A step is applied on every rank or on none: a fault at any point of a step ends in the uninterrupted run's
state, or a clear stop, never in exit 0 with another model (DESIGN.md, "A step is atomic to the outside").

Real agents and gloo workers (``tests/elastic_worker.py``) with an optimizer that has a collective inside its
``step()`` (``--optimizer split``: half the parameters updated, a statistic all-reduced, the other half
updated, as LAMB, Shampoo or ZeRO do), a ``state=`` object updated inside the attempt (``--ema``) and a
collective after the update (``--tail-collective``).  Each run is compared bitwise with an uninterrupted run of
the same script: parameters, optimizer state, scheduler, counters, the ``state=`` object, every step's samples
and losses.  The positions a fault can strike, and what each must lead to:

- inside ``optimizer.step()``: every survivor holds part of an update (dirty), so no one is a source of
  state; the ladder restarts from the newest commit and says why, even with a spare ready;
- after ``optimizer.step()``, the step unfinished: the survivors' update is applied but their scheduler and
  counters lag it; dirty too, a restart;
- in the backward (before the update): the survivors are clean; the spare takes the rank in process, and the
  ``state=`` object, counted once already in the failed attempt, is put back and sent to the spare;
- a network error after the ``state=`` object counted a loss: retried in place, counted once.

The decisions themselves, over every combination of positions, lost ranks and spares, are property-tested in
``tests/test_step_positions.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .agent_helpers import events, explain, incidents
from .test_agent_inproc import DIE_STEP, assert_bitwise_equal, elastic_run, trace

SCRIPT = ("--optimizer", "split", "--ema", "--tail-collective")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out, proc = elastic_run(tmp_path_factory.mktemp("atomic"), "ref", "--nproc-per-node", "2", extra=SCRIPT)
    assert proc.returncode == 0, explain(proc)
    return out


def assert_same_run(out: Path, reference: Path, *, restarted: bool = False) -> None:
    """Bitwise the reference; ``restarted``: steps after the newest commit were done again, and each step's
    last completion on each rank is compared."""
    if restarted:
        got, want = ({(line["step"], line["rank"]): (line["indices"], line["losses"]) for line in trace(path)}
                     for path in (out, reference))
        assert got == want, "a step's samples or losses differ from the uninterrupted run's"
        final, ref = json.loads((out / "final.json").read_text()), json.loads((reference / "final.json").read_text())
        assert (final["params"], final["optimizer"]) == (ref["params"], ref["optimizer"])
        assert (final["scheduler"], final["lr"], final["samples"]) == (ref["scheduler"], ref["lr"], ref["samples"])
    else:
        assert_bitwise_equal(out, reference)
    final, ref = json.loads((out / "final.json").read_text()), json.loads((reference / "final.json").read_text())
    assert final["average"] == ref["average"], "the state= object differs from the uninterrupted run's"


@pytest.mark.parametrize("how", ["in-step", "after-step"])
def test_a_rank_killed_inside_or_after_the_update_is_a_restart_even_with_a_spare_ready(
        tmp_path: Path, reference: Path, how: str) -> None:
    out, proc = elastic_run(tmp_path, how, "--nproc-per-node", "2", "--spares", "1", die=("w1", how),
                            extra=(*SCRIPT, "--spares-ready", "1"))
    assert proc.returncode == 0, explain(proc)
    run = out / "run"
    [decided] = events(run, "recovery_decided")
    assert decided["action"] == "restart", decided
    where = "inside or after optimizer.step()"
    assert f"rank 0 is dirty (they failed {where} of step {DIE_STEP}" in decided["reason"], decided["reason"]
    assert "no clean survivor holds the state" in decided["reason"]
    assert len(events(run, "restart")) == 1
    assert not events(run, "recovered_in_process")
    [incident] = incidents(run)
    assert "dirty" in incident["ladder"]["reason"], incident["ladder"]
    assert_same_run(out, reference, restarted=True)


def test_a_rank_killed_before_the_update_is_replaced_in_process_and_the_state_object_counts_once(
        tmp_path: Path, reference: Path) -> None:
    out, proc = elastic_run(tmp_path, "kill", "--nproc-per-node", "2", "--spares", "1", die=("w1", "kill"),
                            extra=(*SCRIPT, "--spares-ready", "1"))
    assert proc.returncode == 0, explain(proc)
    run = out / "run"
    assert not events(run, "restart"), "recovered by a restart, not in process"
    [done] = events(run, "recovered_in_process")
    assert done["rung"] == "promote_spare" and done["resumed_after_step"] == DIE_STEP, done
    assert {line["worker"] for line in trace(out) if line["step"] > DIE_STEP and line["rank"] == 1} == {"s2"}
    assert_same_run(out, reference)
    # The script does not pass Run(reseed=True): both members say once which generators the spare cannot draw.
    warned = events(run, "unreproducible_random_streams")
    assert sorted(e["rank"] for e in warned) == [0, 1], warned
    assert all(e["streams"][0] == "random" and "Run(reseed=True)" in e["note"] for e in warned), warned


def test_a_network_error_after_the_state_object_counted_a_loss_is_retried_and_counted_once(
        tmp_path: Path, reference: Path) -> None:
    out, proc = elastic_run(tmp_path, "late", "--nproc-per-node", "2", "--spares", "1", die=("w1", "raise-late"),
                            extra=SCRIPT)
    assert proc.returncode == 0, explain(proc)
    run = out / "run"
    assert not events(run, "restart")
    [done] = events(run, "recovered_in_process")
    assert done["rung"] == "retry_in_place", done
    assert_same_run(out, reference)
