"""What the ladder weighs a restart at: this run's restarts as the node's ledger measured them, not a constant.

A restart now costs a fork and a restore (a fraction of a second on one
machine), or far more on a big GPU job; a fixed guess makes the ladder hold
for a warming spare when restarting at once would be sooner, or the other way
round.  The agent reads what its restarts cost from its goodput ledger
(detection to the run's next new step, re-done steps included), and before
any restart the first start's time (the agent's start to the first step).
"""

from __future__ import annotations

from pathlib import Path

from resilient.agent.accounting import NodeAccounting
from resilient.agent.config import AgentConfig
from resilient.agent.inproc import RESTART_COST_EVERY_S, InProcess
from resilient.elastic.costs import RecoveryCosts
from resilient.elastic.decide import Action, LadderConfig, decide_recovery
from resilient.elastic.observe import Fault, FaultKind, Membership, Observation
from resilient.metrics.ledger import LedgerConfig


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _steps(acc: NodeAccounting, clock: Clock, steps: range, step_s: float) -> None:
    for step in steps:
        acc.heartbeat(clock.t, "section", 0, "step", step, tokens=step, samples=step, committed_step=None, save=None)
        clock.t += step_s


def test_the_ledger_gives_each_restart_s_cost_from_detection_to_the_next_new_step(tmp_path: Path) -> None:
    clock = Clock()
    acc = NodeAccounting(tmp_path / "ledger.json", LedgerConfig(), wall=clock, monotonic=clock)
    acc.apply("agent_started")
    acc.generation_started(1, 1, 1, restart=False, lead_rank=0)
    clock.t += 4.0  # the first start: imports, the group, the restore
    assert acc.restart_costs({"i1"}) == ([], None), "nothing measured before the first step"
    _steps(acc, clock, range(11), 0.5)  # steps 0..9 done, step 10 under way when it fails
    assert acc.restart_costs({"i1"}) == ([], 4.0)
    detected = clock.t + 0.25
    acc.failure(detected, clock.t - 0.5, "i1", "crash")
    clock.t = detected + 0.1
    acc.apply("generation_ended", "failed")
    acc.generation_started(2, 1, 1, restart=True, lead_rank=0)
    clock.t += 0.3  # the restart: fork, group, restore from the commit at step 7
    assert acc.restart_costs({"i1"})[0] == [], "an incident still open (re-doing steps) is not yet a cost"
    _steps(acc, clock, range(8, 14), 0.5)  # 8 and 9 re-done; 10 (never completed before) is the next new step
    restarts, first = acc.restart_costs({"i1"})
    assert first == 4.0
    [cost] = restarts
    # From the detection to the next new step's start: 0.1 + 0.3 of restart, then 8 and 9 again (1.0 s).
    assert abs(cost - (0.4 + 1.0)) < 1e-6, cost
    assert acc.restart_costs({"other"})[0] == [], "an incident answered in process is not a restart"


def _inproc(tmp_path: Path, clock: Clock) -> InProcess:
    return InProcess(AgentConfig(entrypoint=("train.py",), run_id="r", node_id="n0", run_dir=tmp_path),
                     lambda kind, **fields: None, clock)


def test_the_ladder_weighs_a_restart_at_what_this_run_s_restarts_cost(tmp_path: Path) -> None:
    clock = Clock()
    inp = _inproc(tmp_path, clock)
    try:
        assert inp.costs().restart_s == RecoveryCosts().restart_s, "nothing measured: the default"
        measured: list[tuple[list[float], float | None]] = [([], None)]
        reads: list[float] = []

        def source() -> tuple[list[float], float | None]:
            reads.append(clock.t)
            return measured[-1]

        inp.restart_costs = source
        assert inp.costs().restart_s == RecoveryCosts().restart_s and inp.restart_s() is None
        clock.t += RESTART_COST_EVERY_S
        measured.append(([], 4.0))
        assert inp.restart_s() == (4.0, "the first start") and inp.costs().restart_s == 4.0
        measured.append(([0.6, 0.4, 9.0], 4.0))
        assert inp.costs().restart_s == 4.0, "read again before its interval"
        clock.t += RESTART_COST_EVERY_S
        assert inp.restart_s() == (0.6, "median of 3 restarts") and inp.costs().restart_s == 0.6
        assert len(reads) == 3, reads
    finally:
        inp.close()


def test_a_cheap_measured_restart_beats_holding_for_a_warming_spare() -> None:
    """The same crash with no shrink allowed and a spare 3 s from ready: held for at the default restart cost
    (7 s), restarted at once when this run's restarts were measured at half a second."""
    membership = Membership(rank_nodes=("a", "a", "b", "b"), min_size=4, max_size=4, full_size=4,
                            feasible_world_sizes=frozenset({4}))
    obs = Observation(fault=Fault(kind=FaultKind.CRASH, step=57, ranks=frozenset({3})), membership=membership,
                      survivor_steps={0: 56, 1: 56, 2: 56}, opted_in=True)
    held = decide_recovery(obs, RecoveryCosts(repair_s=3.0), LadderConfig(), 1000.0)
    assert held.action is Action.WAIT_FOR_REPAIR, held.reason
    assert held.reason.endswith("waiting R + d_spare = 3.0 + 1.0 = 4.0 s < restart 7.0 s")
    restarted = decide_recovery(obs, RecoveryCosts(repair_s=3.0, restart_s=0.5), LadderConfig(), 1000.0)
    assert restarted.action is Action.RESTART, restarted.reason
    assert "waiting (4.0 s) is no cheaper than a restart (0.5 s)" in restarted.reason
