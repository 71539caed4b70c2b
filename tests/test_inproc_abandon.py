"""A recovery abandoned while its generation formed (``InProcess.abandon_recovery``), against a real TCPStore.

The members still forming the abandoned generation are told through the
agent's store (``abort/<generation>``); a second failure during a
re-formation is folded into the next decision a bounded number of times per
step, after which the step's in-process recoveries count as failing, so a
member that fails every re-formation ends in a restart instead of a loop.
"""

from __future__ import annotations

import time
from pathlib import Path

from resilient.agent.config import AgentConfig
from resilient.agent.inproc import FOLDED_PER_STEP, InProcess
from resilient.elastic.reform import abort_key, connect_store


def _recovering(inp: InProcess, generation: int, step: int) -> None:
    inp.under_way(generation=generation, rung="promote_spare", world_size=2, promotions=((1, "s2"),), dropped=(),
                  members={"w0": 0, "s2": 1}, detected_at=time.monotonic(), incident_id=None, step=step)


def test_an_abandoned_generation_is_aborted_and_folded_failures_are_bounded_per_step(tmp_path: Path) -> None:
    events: list[tuple[object, dict]] = []
    inp = InProcess(AgentConfig(entrypoint=("train.py",), run_id="r", node_id="n0", run_dir=tmp_path),
                    lambda kind, **fields: events.append((kind, fields)), time.monotonic)
    try:
        client = connect_store(inp.host, inp.port, 10)
        generation = 2
        for folded in range(1, FOLDED_PER_STEP + 2):
            _recovering(inp, generation, step=7)
            assert not client.check([abort_key(generation)])
            assert inp.abandon_recovery(another_failure=True) is not None
            assert client.check([abort_key(generation)]), "the members still forming it were not told"
            assert inp.recovering is None
            # Folded failures do not count against the step until they pass the bound.
            assert inp.failed_recoveries(7) == (0 if folded <= FOLDED_PER_STEP else 1), folded
            generation += 1
        _recovering(inp, generation, step=8)
        inp.abandon_recovery()  # the recovery itself failed (its deadline passed): it counts at once
        assert inp.failed_recoveries(8) == 1 and inp.failed_recoveries(7) == 1
        assert inp.abandon_recovery() is None  # nothing under way: nothing to abandon, nothing counted
        assert inp.failed_recoveries(8) == 1
    finally:
        inp.close()


def test_failures_folded_across_machines_are_counted_from_the_decisions_whoever_took_them() -> None:
    """Across machines successive decisions of one step may be taken by different agents, each of which counts
    only what it followed: the failures folded at a step are read from the launch's decisions instead (every
    in-process decision at the step after the first answered a failure during the one before; a grow answers
    none, and other steps do not count)."""
    from resilient.agent.cluster import folded_at_step

    def decided(action: str, step: int) -> dict[str, object]:
        return {"action": action, "step": step, "generation": 9}

    assert folded_at_step([], 7) == 0
    assert folded_at_step([decided("promote_spare", 7)], 7) == 0
    assert folded_at_step([decided("promote_spare", 7), decided("shrink", 7), decided("grow", 7),
                           decided("promote_spare", 8), decided("restart", 7)], 7) == 1
    assert folded_at_step([decided("retry_in_place", 7)] * (FOLDED_PER_STEP + 2), 7) == FOLDED_PER_STEP + 1


def test_a_spare_that_says_ready_before_its_start_is_recorded_counts_as_ready(tmp_path: Path) -> None:
    """A spare forked from the fork server can report ready within a millisecond, before the agent's launcher
    thread records its start: the report must not be lost (the spare would count as warming for good, and the
    ladder restart instead of promoting it)."""
    from resilient.worker.protocol import Heartbeat

    inp = InProcess(AgentConfig(entrypoint=("train.py",), run_id="r", node_id="n0", run_dir=tmp_path),
                    lambda kind, **fields: None, time.monotonic)
    try:
        ready = Heartbeat(rank=-1, local_rank=0, pid=4242, section="init", step=0, seq=1, kind="recovery",
                          recovery={"event": "ready", "worker": "s2", "role": "spare", "step": 0})
        inp.on_message(ready, time.monotonic())
        assert inp.ready_spares() == 0  # not started yet, as far as the agent knows
        inp.spare_started("s2", 4242, generation=1)
        assert inp.ready_spares() == 1 and inp.warming_spares() == 0
        inp.spare_started("s3", 4243, generation=1)  # the usual order: started, then ready
        assert inp.warming_spares() == 1
    finally:
        inp.close()
