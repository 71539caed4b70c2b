"""The restart policy and first-failure attribution, with made-up failures and times; the global budget with
two real agents on a real etcd."""

from __future__ import annotations

import json
import signal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from resilient.agent.decision import Restarts, decide
from resilient.agent.policy import (
    Action,
    Failure,
    FailureMark,
    History,
    RestartConfig,
    backoff_s,
    decide_restart,
    first_failure,
    same_way,
)
from resilient.coord.etcd import EtcdClient, EtcdConfig, EtcdControlStore
from resilient.core.errors import CheckpointMismatchError, ConfigError, NoValidCheckpointError, StorageError
from resilient.core.exitcodes import (
    EXIT_CONFIG,
    EXIT_PREEMPTED_AGENT,
    EXIT_STOPPED,
    EXIT_UNHEALTHY,
    EXIT_UNRECOVERABLE,
    NO_RESTART_CODES,
    describe_exit,
    exit_code_for,
)
from resilient.elastic.decide import Action as DecisionAction

from .agent_helpers import events, start_agent

CRASH = Failure(kind="exit", time=10.0, rank=1, node="n1", exit_code=1, section="step", step=47)


def test_exit_code_contract() -> None:
    assert exit_code_for(ConfigError("bad")) == EXIT_CONFIG
    assert exit_code_for(NoValidCheckpointError("x")) == EXIT_UNRECOVERABLE
    assert exit_code_for(CheckpointMismatchError("x")) == EXIT_UNRECOVERABLE
    assert exit_code_for(StorageError("disk")) is None
    assert exit_code_for(RuntimeError("boom")) is None


@pytest.mark.parametrize(
    ("code", "words"),
    [
        (0, "exit 0 (success)"),
        (1, "exit 1"),
        (78, "exit 78 (configuration error: not restarted)"),
        (79, "exit 79 (unrecoverable state: not restarted)"),
        (-9, "killed by SIGKILL"),
        (-15, "killed by SIGTERM"),
        (137, "exit 137 (128+9: a shell's report of a child killed by SIGKILL)"),
        (-200, "killed by signal 200"),
    ],
)
def test_describe_exit(code: int, words: str) -> None:
    assert describe_exit(code) == words


def test_agent_exit_codes_are_described_only_as_the_agents() -> None:
    assert describe_exit(EXIT_STOPPED, agent=True) == "exit 80 (stopped with a verdict)"
    assert describe_exit(EXIT_UNHEALTHY, agent=True) == "exit 81 (node unhealthy: stepped out)"
    assert describe_exit(EXIT_PREEMPTED_AGENT, agent=True) == "exit 75 (preempted: resubmit to resume)"
    assert describe_exit(EXIT_STOPPED) == "exit 80"  # a worker exiting 80 is an ordinary failure
    assert not {EXIT_STOPPED, EXIT_UNHEALTHY, EXIT_PREEMPTED_AGENT} & NO_RESTART_CODES


def test_restart_immediately_by_default() -> None:
    d = decide_restart(CRASH, History(newest_committed_step=40), RestartConfig(), now=100.0)
    assert (d.action, d.delay_s, d.not_before, d.verdict) == (Action.RESTART, 0.0, 100.0, None)
    assert d.reason == (
        "restart 1 of 3 now after: rank 1 on node n1 failed with exit 1 in section 'step' at step 47; "
        "newest commit reported: step 40 (the workers restore the newest that verifies)"
    )


def test_backoff_grows_without_progress_and_is_capped() -> None:
    cfg = RestartConfig(
        backoff_initial_s=1.0, backoff_factor=2.0, backoff_max_s=5.0, max_restarts=100, crash_loop_restarts=100
    )
    delays = [backoff_s(History(restarts_since_progress=k), cfg) for k in range(6)]
    assert delays == [1.0, 2.0, 4.0, 5.0, 5.0, 5.0]
    assert backoff_s(History(restarts_since_progress=10_000), cfg) == 5.0  # no float overflow
    d = decide_restart(CRASH, History(restarts_used=2, restarts_since_progress=2), cfg, now=50.0)
    assert (d.action, d.delay_s, d.not_before) == (Action.RESTART, 4.0, 54.0)
    assert d.reason.startswith("restart 3 of 100 in 4.0 s after: rank 1")
    assert d.reason.endswith("no commit reported yet (the workers restore the newest that verifies, if any)")


def test_do_not_restart_exit_codes_stop_even_with_budget_left() -> None:
    """The exit-code contract is the one decision's first check, before the restart policy's rungs."""
    bad_config = Failure(kind="exit", time=1.0, rank=0, exit_code=78, section="init", step=0)
    d = decide(bad_config, Restarts(History(), RestartConfig()), now=1.0, world_size=2)
    assert (d.action, d.verdict, d.exit_code, d.world_size) == (DecisionAction.STOP, "do_not_restart", 78, 2)
    assert d.reason.startswith(
        "stop: rank 0 failed with exit 78 (configuration error: not restarted) in section 'init' at step 0; exit 78 "
        "says by the exit-code contract that no recovery can help"
    )
    # Another failed rank's code counts as well: the failure an incident is about may be a peer's plain crash.
    d = decide(CRASH, Restarts(History(), RestartConfig()), now=1.0, exit_codes=(1, 79))
    assert (d.action, d.verdict, d.exit_code) == (DecisionAction.STOP, "do_not_restart", 79)
    # Checked there only: the policy's own rungs know nothing of the contract.
    assert decide_restart(bad_config, History(), RestartConfig(), now=1.0).action is Action.RESTART


def test_the_decision_without_the_ladder_is_the_policys() -> None:
    """No in-process recovery on offer: the decision is the restart policy's, its reason and delay unchanged."""
    history, cfg = History(restarts_used=1, restarts_since_progress=1), RestartConfig(backoff_initial_s=2.0)
    policy = decide_restart(CRASH, history, cfg, now=5.0)
    d = decide(CRASH, Restarts(history, cfg), now=5.0)
    assert (d.action, d.reason, d.delay_s, d.not_before, d.verdict) == \
        (DecisionAction.RESTART, policy.reason, 4.0, 9.0, None)
    spent = decide(CRASH, Restarts(History(restarts_used=3), RestartConfig(max_restarts=3)), now=5.0)
    assert (spent.action, spent.verdict) == (DecisionAction.STOP, "budget_exhausted")
    assert spent.reason.startswith("restart budget exhausted: 3 of max_restarts=3 used")


def test_budget_is_global_across_two_agents_on_a_real_etcd(tmp_path, etcd_server, etcd_run_id) -> None:
    """Both nodes fail in every generation: each generation costs one restart, and both stop alike."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"version": 1, "seed": 0, "faults": [
        {"kind": "exit", "rank": None, "step": 2, "attempt": None, "section": "step", "exit_code": 3}]}))
    run_dir = tmp_path / "run"
    agents = {node: start_agent(
        run_dir, "--nnodes", "2", "--nproc-per-node", "1", "--store", etcd_server.url, "--run-id", etcd_run_id,
        "--node-id", node, "--local-addr", "127.0.0.1", "--rdzv-last-call", "1", "--stop-grace", "3",
        "--max-restarts", "2", "--crash-loop-restarts", "10", "--fault-plan", str(plan),
        script_args=("--steps", "20", "--trace", str(tmp_path / "trace")), log=tmp_path / f"{node}.log")
        for node in ("n0", "n1")}
    try:
        codes = {node: agent.wait(timeout=300) for node, agent in agents.items()}
    finally:
        for agent in agents.values():
            agent.kill()
    logs = {node: (tmp_path / f"{node}.log").read_text()[-2000:] for node in agents}
    assert codes == {"n0": EXIT_STOPPED, "n1": EXIT_STOPPED}, (codes, logs)
    finished = {e["node"]: e for e in events(run_dir, "agent_finished")}
    assert {n: e["verdict"] for n, e in finished.items()} == {"n0": "budget_exhausted", "n1": "budget_exhausted"}
    assert {e["restarts_used"] for e in finished.values()} == {2}
    assert all("2 of max_restarts=2 used by the whole launch" in e["reason"] for e in finished.values())
    # Two failed generations were restarted, each counted once though both nodes failed in it.
    store = EtcdControlStore.for_run(EtcdClient(EtcdConfig.from_url(etcd_server.url)), etcd_run_id)
    [launch] = {e["launch_id"] for e in events(run_dir, "launch_joined")}
    records = store.get_prefix(f"launch/{launch}/restarts/")
    assert len(records) == 2, [r.key for r in records]
    failed = {e["generation"] for e in events(run_dir, "worker_failed")}
    assert {json.loads(r.value)["body"]["generation"] for r in records} == set(sorted(failed)[:2])
    # Each record keeps how its failure happened: the crash-loop breaker compares the next one with it.
    assert [(json.loads(r.value)["body"]["failure"]["step"], json.loads(r.value)["body"]["failure"]["exit_code"])
            for r in records] == [(2, 3), (2, 3)]
    assert len(failed) == 3 and {e["node"] for e in events(run_dir, "worker_failed")} == {"n0", "n1"}


def test_the_policy_names_the_budget_scope() -> None:
    history = History(restarts_used=3, restarts_since_progress=0, newest_committed_step=120)
    d = decide_restart(CRASH, history, RestartConfig(max_restarts=3, budget_scope="run"), now=1.0)
    assert (d.action, d.verdict) == (Action.STOP, "budget_exhausted")
    assert "3 of max_restarts=3 used by the whole run" in d.reason
    assert "newest committed checkpoint: step 120" in d.reason
    zero = decide_restart(CRASH, History(), RestartConfig(max_restarts=0), now=1.0)
    assert zero.verdict == "budget_exhausted" and "used by the whole launch" in zero.reason


def test_crash_loop_before_first_commit_stops_with_verdict() -> None:
    """A script that dies before committing anything: K restarts, then a verdict, not forever."""
    cfg = RestartConfig(max_restarts=10, crash_loop_restarts=3)
    history = History()
    actions = []
    for attempt in range(10):
        failure = Failure(kind="exit", time=float(attempt), rank=0, exit_code=1, section="init", step=0)
        d = decide_restart(failure, history.with_commit(None), cfg, now=float(attempt))
        actions.append(d.action)
        if d.action is Action.STOP:
            break
        history = history.after_restart(None, FailureMark.of(failure))
    assert actions == [Action.RESTART] * 3 + [Action.STOP]
    assert d.verdict == "crash_loop"
    assert d.reason == (
        "crash loop: 3 restarts in a row without a newly committed checkpoint (crash_loop_restarts=3), each "
        "failing the same way (at step 0); every attempt failed before the first checkpoint was committed. "
        "Last failure: rank 0 failed with exit 1 in section 'init' at step 0"
    )


def _fault(rank: int, sig: int, step: int | None, section: str | None = "restore") -> Failure:
    return Failure(kind="signal", time=1.0, rank=rank, signal=sig, section=section, step=step)


def test_independent_faults_are_not_a_crash_loop_and_the_budget_decides() -> None:
    """Faults from outside (a soak's random signals to random ranks while they start) are not the same failure
    again: each restart is allowed while the budget lasts, and the reason says why no loop was called."""
    cfg = RestartConfig(max_restarts=5, crash_loop_restarts=2)
    faults = [_fault(1, signal.SIGKILL, None), _fault(0, signal.SIGSEGV, None), _fault(1, signal.SIGTERM, None),
              _fault(0, signal.SIGKILL, 3, "step"), _fault(1, signal.SIGKILL, None)]
    history = History()
    decisions = []
    for failure in faults:
        decisions.append(decide_restart(failure, history, cfg, now=1.0))
        history = history.after_restart(None, FailureMark.of(failure))
    assert [d.action for d in decisions] == [Action.RESTART] * 5
    assert "not a crash loop: 2 restarts without a new commit, but not the same failure again" in decisions[2].reason
    last = decide_restart(_fault(0, signal.SIGTERM, None), history, cfg, now=1.0)
    assert last.verdict == "budget_exhausted" and "not a crash loop: 5 restarts" in last.reason


@pytest.mark.parametrize(("earlier", "again", "how"), [
    (_fault(1, signal.SIGKILL, 12, "step"), _fault(0, signal.SIGSEGV, 12, "step"), "at step 12"),
    (Failure(kind="exit", time=1.0, rank=2, exit_code=1, section="step", step=3, detail="ValueError: bad shape"),
     Failure(kind="exit", time=2.0, rank=0, exit_code=1, section="step", step=9, detail="ValueError: bad shape 2"),
     "with ValueError in section 'step'"),
    (_fault(1, signal.SIGSEGV, None, "restore"), _fault(1, signal.SIGSEGV, None, "restore"),
     "rank 1 by SIGSEGV in section 'restore'"),
    (Failure(kind="exit", time=1.0, rank=0, exit_code=3), Failure(kind="exit", time=2.0, rank=0, exit_code=3),
     "rank 0 by exit 3"),
])
def test_the_same_failure_again_is_a_crash_loop_and_the_verdict_says_how(earlier, again, how) -> None:
    history = History().after_restart(None, FailureMark.of(earlier))
    d = decide_restart(again, history, RestartConfig(max_restarts=10, crash_loop_restarts=1), now=1.0)
    assert d.verdict == "crash_loop" and f"each failing the same way ({how})" in d.reason, d.reason


@pytest.mark.parametrize(("a", "b"), [
    (_fault(1, signal.SIGKILL, None), _fault(0, signal.SIGKILL, None)),  # another rank
    (_fault(1, signal.SIGKILL, None), _fault(1, signal.SIGTERM, None)),  # another signal
    (_fault(1, signal.SIGKILL, 4, "step"), _fault(1, signal.SIGKILL, 5, "step")),  # another step
    (Failure(kind="exit", time=1.0, rank=0, exit_code=1, section="step", detail="ValueError: x"),
     Failure(kind="exit", time=1.0, rank=0, exit_code=1, section="step", detail="KeyError: x")),  # another error
])
def test_another_rank_signal_step_or_error_is_an_independent_fault(a, b) -> None:
    assert same_way(FailureMark.of(a), FailureMark.of(b)) is None
    history = History().after_restart(None, FailureMark.of(a))
    assert decide_restart(b, history, RestartConfig(max_restarts=10, crash_loop_restarts=1), now=1.0).action \
        is Action.RESTART


MARKS = st.builds(FailureMark, kind=st.sampled_from(["exit", "signal", "hang"]), rank=st.integers(0, 3) | st.none(),
                  exit_code=st.sampled_from([1, 3]) | st.none(), signal=st.sampled_from([9, 11, 15]) | st.none(),
                  section=st.sampled_from(["step", "restore"]) | st.none(), step=st.integers(0, 5) | st.none(),
                  error=st.sampled_from(["ValueError", "RuntimeError"]) | st.none())


@given(MARKS, st.lists(MARKS | st.none(), max_size=4), st.integers(1, 3))
def test_a_crash_loop_is_called_exactly_when_every_known_earlier_failure_is_the_same_again(mark, marks, k) -> None:
    """Against the definition: K restarts since progress, each earlier one unknown or the same way as this one;
    and a mark survives its record."""
    assert all(m is None or FailureMark.from_record(m.to_record()) == m for m in marks)
    history = History()
    for m in marks:
        history = history.after_restart(None, m)
    failure = Failure(kind="exit", time=1.0, rank=mark.rank, exit_code=1, step=mark.step, section=mark.section,
                      detail=None if mark.error is None else f"{mark.error}: boom")
    this = FailureMark.of(failure)
    d = decide_restart(failure, history, RestartConfig(max_restarts=100, crash_loop_restarts=k), now=1.0)
    last = marks[-k:]
    looping = len(marks) >= k and all(m is None or same_way(m, this) is not None for m in last)
    assert (d.verdict == "crash_loop") == looping, (d.reason, marks, this)


def test_a_restart_record_that_is_damaged_or_older_than_marks_is_not_known() -> None:
    assert FailureMark.from_record(None) is None
    assert FailureMark.from_record({"kind": "meteor"}) is None
    assert FailureMark.from_record({"kind": "exit", "step": "12"}) is None
    assert FailureMark.from_record({"kind": "exit", "step": 12}) == FailureMark(kind="exit", step=12)
    # Unknown marks count as the same (as before marks were kept): three unknown restarts are a loop.
    assert decide_restart(CRASH, History(restarts_since_progress=3), RestartConfig(max_restarts=10), now=0.0) \
        .verdict == "crash_loop"


def test_crash_loop_names_the_step_it_is_stuck_at() -> None:
    history = History(restarts_used=4, restarts_since_progress=3, newest_committed_step=40)
    d = decide_restart(CRASH, history, RestartConfig(max_restarts=10), now=0.0)
    assert d.verdict == "crash_loop"
    assert "every attempt failed before committing past step 40" in d.reason
    assert "at step 47" in d.reason


def test_crash_loop_wins_over_budget_when_both_apply() -> None:
    history = History(restarts_used=3, restarts_since_progress=3)
    assert decide_restart(CRASH, history, RestartConfig(max_restarts=3), now=0.0).verdict == "crash_loop"


def test_progress_resets_crash_loop_and_backoff() -> None:
    h = History().after_restart(None).after_restart(None)
    assert (h.restarts_used, h.restarts_since_progress, h.newest_committed_step) == (2, 2, None)
    h = h.with_commit(10)
    assert (h.restarts_used, h.restarts_since_progress, h.newest_committed_step) == (2, 0, 10)
    assert h.with_commit(10) is h and h.with_commit(5) is h and h.with_commit(None) is h
    h = h.after_restart(20)
    assert (h.restarts_used, h.restarts_since_progress, h.newest_committed_step) == (3, 1, 20)
    h = h.after_restart(20)
    assert (h.restarts_used, h.restarts_since_progress) == (4, 2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_restarts": -1}, "max_restarts=-1"),
        ({"backoff_initial_s": -1.0}, "backoff_initial_s=-1.0"),
        ({"backoff_factor": 0.5}, "backoff_factor=0.5"),
        ({"backoff_initial_s": 10.0, "backoff_max_s": 5.0}, "backoff_max_s=5.0 must be finite and >= "),
        ({"crash_loop_restarts": 0}, "crash_loop_restarts=0"),
        ({"budget_scope": "job"}, "budget_scope=.job. must be .launch. or .run."),
    ],
)
def test_invalid_restart_config(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RestartConfig(**kwargs)  # type: ignore[arg-type]


def test_failure_invariants_and_descriptions() -> None:
    with pytest.raises(ValueError):
        Failure(kind="exit", time=0.0, rank=0, exit_code=0)
    with pytest.raises(ValueError):
        Failure(kind="signal", time=0.0, rank=0)
    killed = Failure(kind="signal", time=0.0, rank=2, signal=signal.SIGKILL, section="checkpoint", step=30)
    assert killed.describe() == "rank 2 was killed by SIGKILL in section 'checkpoint' at step 30"
    hang = Failure(kind="hang", time=0.0, rank=1, section="step", step=57, detail="rank 1 has been in ...")
    assert hang.describe() == "rank 1 hung in section 'step' at step 57: rank 1 has been in ..."
    assert Failure(kind="node_lost", time=0.0, node="n2").describe() == "node n2 was lost"
    assert Failure(kind="unhealthy", time=0.0, node="n2").describe() == "node n2 became unhealthy"


def test_first_failure_ignores_the_agents_own_casualties() -> None:
    real = Failure(kind="exit", time=5.0, rank=1, exit_code=3)
    casualties = [
        Failure(kind="signal", time=4.0, rank=0, signal=signal.SIGTERM, caused_by_agent=True),
        Failure(kind="signal", time=4.5, rank=2, signal=signal.SIGKILL, caused_by_agent=True),
    ]
    assert first_failure([*casualties, real]) is real
    # Nothing else failed: the earliest casualty is all there is to report.
    assert first_failure(casualties) is casualties[0]


def test_first_failure_is_the_earliest_and_ties_prefer_a_real_death() -> None:
    hang = Failure(kind="hang", time=12.0, rank=0, section="step")
    crash = Failure(kind="exit", time=12.0, rank=3, exit_code=1)
    later = Failure(kind="signal", time=12.5, rank=1, signal=signal.SIGSEGV)
    assert first_failure([later, hang, crash]) is crash
    a = Failure(kind="exit", time=1.0, rank=2, exit_code=1)
    b = Failure(kind="exit", time=1.0, rank=1, exit_code=1)
    assert first_failure([a, b]) is b
    with pytest.raises(ValueError):
        first_failure([])
