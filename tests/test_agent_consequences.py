"""Consequences of a first failure, and what a generation restored: the pure parts, with made-up inputs."""

from __future__ import annotations

import signal

import pytest

from resilient.agent.consequences import describe_other, describe_others, short_error
from resilient.agent.incidents import Incident, format_incident
from resilient.agent.policy import Failure, first_failure
from resilient.agent.restores import summarise_restores
from resilient.core.collective import caused_by_peer, is_collective_error

GLOO_RESET = {
    "exc_type": "RuntimeError",
    "message": "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
               "[127.0.0.1]:20899. This is typically caused by a remote worker crashing. Check the logs of the "
               "remote worker before reporting an error. GLHF!",
}


def killed(rank: int, t: float, **kw) -> Failure:
    return Failure(kind="signal", rank=rank, node="n0", signal=int(signal.SIGKILL), time=t, **kw)


def exited(rank: int, t: float, code: int = 1, **kw) -> Failure:
    return Failure(kind="exit", rank=rank, node="n0", exit_code=code, time=t, **kw)


@pytest.mark.parametrize("error, expected", [
    (GLOO_RESET, True),
    ({"exc_type": "RuntimeError", "message": "[gloo] Read error [127.0.0.1]:30118: Connection reset by peer"}, True),
    ({"exc_type": "torch.distributed.DistBackendError", "message": "NCCL error in: ..."}, True),
    ({"exc_type": "RuntimeError", "message": "NCCL communicator was aborted on rank 0."}, True),
    ({"exc_type": "ValueError", "message": "loss is nan"}, False),
    ({"exc_type": "RuntimeError", "message": "CUDA out of memory"}, False),
    (None, False),
])
def test_collective_errors_are_told_from_a_rank_s_own(error, expected):
    assert is_collective_error(error) is expected


def test_non_finite_gradients_this_rank_did_not_make_are_caused_by_a_peer():
    nan = {"exc_type": "resilient.core.errors.PersistentNonFiniteError", "message": "step 3: ..."}
    assert caused_by_peer({**nan, "own_nonfinite": False})  # they came in the all-reduce
    assert not caused_by_peer({**nan, "own_nonfinite": True})  # its own samples made them
    assert not caused_by_peer(nan)  # not looked at (one rank, or the first try): its own
    assert caused_by_peer(GLOO_RESET) and not caused_by_peer(None)


def test_a_gloo_message_is_shortened_to_its_library_and_first_sentence():
    assert short_error(GLOO_RESET) == "RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:20899"
    assert short_error({"exc_type": "builtins.ValueError", "message": "bad\nsecond line"}) == "ValueError: bad"
    assert len(short_error({"exc_type": "E", "message": "x" * 500})) == len("E: ") + 160


def test_a_collective_error_is_never_the_first_failure_while_a_rank_died_of_its_own():
    survivor = exited(0, 10.0, consequence=True)  # reaped first, yet only the consequence of rank 1's death
    dead = killed(1, 10.01)
    assert first_failure([survivor, dead]) is dead
    # Nothing else failed (the peer died on another node): the collective error is what this node has.
    assert first_failure([survivor, killed(1, 10.5, caused_by_agent=True)]) is survivor


def test_a_survivor_that_raised_is_a_consequence_never_stopped_by_the_agent():
    first = killed(1, 10.0)
    # It raised gloo's error, then the agent's SIGTERM ended its exit: its own error is what it is named by.
    survivor = Failure(kind="signal", rank=0, node="n0", signal=int(signal.SIGTERM), time=10.2, section="step",
                       step=13, caused_by_agent=True, consequence=True)
    assert describe_other(survivor, GLOO_RESET, first) == (
        "rank 0 on n0 in section 'step' at step 13: consequence: RuntimeError: [gloo] Connection closed by peer "
        "[127.0.0.1]:20899 (after rank 1 was killed by SIGKILL)")
    silent = Failure(kind="signal", rank=2, node="n0", signal=int(signal.SIGTERM), time=10.2, caused_by_agent=True)
    assert describe_other(silent, None, first) == (
        "rank 2 on n0: killed by SIGTERM: stopped by the agent (after rank 1 was killed by SIGKILL)")
    own = exited(3, 10.1)
    assert describe_other(own, {"exc_type": "ValueError", "message": "loss is nan"}, first) == (
        "rank 3 on n0: also failed: ValueError: loss is nan (after rank 1 was killed by SIGKILL)")


def test_the_console_shows_the_first_failure_s_traceback_then_one_line_per_consequence(tmp_path):
    incident = Incident(id="g0001-n0", node="n0", generation=1, kind="exit", rank=1, pid=7, section="step", step=3,
                        summary="rank 1 on n0: exit 1 in section 'step' at step 3", exit_code=1,
                        error={"exc_type": "ValueError", "message": "boom",
                               "traceback": "Traceback (most recent call last):\n  File \"x.py\"\nValueError: boom\n"},
                        other_failures=("rank 0 on n0: consequence: RuntimeError: [gloo] reset (after rank 1 ...)",),
                        decision={"reason": "restart 1 of 3 now"})
    assert format_incident(incident, tmp_path / "g0001-n0.json").splitlines() == [
        "resilient: incident g0001-n0: rank 1 on n0: exit 1 in section 'step' at step 3",
        "resilient:   rank 1 raised:",
        "resilient:   | Traceback (most recent call last):",
        'resilient:   |   File "x.py"',
        "resilient:   | ValueError: boom",
        "resilient:   rank 0 on n0: consequence: RuntimeError: [gloo] reset (after rank 1 ...)",
        "resilient:   decision: restart 1 of 3 now",
        f"resilient:   details: {tmp_path / 'g0001-n0.json'}",
    ]


def report(name: str | None, step: int | None, seconds: float) -> dict:
    return {"checkpoint": name, "step": step, "seconds": seconds}


def test_every_rank_restored_the_same_checkpoint():
    s = summarise_restores(2, "n0", [0, 1], {0: report("step_10", 10, 0.31), 1: report("step_10", 10, 0.4249)})
    assert s.line == "generation 2: all 2 ranks restored step_10 (step 10) in 0.42 s (slowest rank 1)"
    assert (s.checkpoint, s.step, s.seconds, s.slowest_rank, s.complete) == ("step_10", 10, 0.425, 1, True)
    assert s.record()["ranks"]["1"] == report("step_10", 10, 0.4249)


def test_a_fresh_start_different_checkpoints_and_silent_ranks_are_named():
    fresh = summarise_restores(1, "n0", [0, 1], {0: report(None, None, 0.01), 1: report(None, None, 0.02)})
    assert fresh.line == "generation 1: all 2 ranks started fresh (no checkpoint to restore) in 0.02 s (slowest rank 1)"
    mixed = summarise_restores(3, "n1", [2, 3, 4], {2: report("step_20", 20, 0.5), 3: report(None, None, 0.1)},
                               multi_node=True)
    assert mixed.line == ("generation 3 on n1: rank 2 restored step_20 (step 20); rank 3 restored nothing (fresh "
                          "start); rank 4 did not report a restore; in 0.50 s (slowest rank 2)")
    assert (mixed.checkpoint, mixed.missing, mixed.complete) == (None, (4,), False)
    one = summarise_restores(4, "n0", [0], {0: report("step_5", 5, 0.2)})
    assert one.line == "generation 4: rank 0 restored step_5 (step 5) in 0.20 s (slowest rank 0)"
    with pytest.raises(ValueError, match="at least one"):
        summarise_restores(1, "n0", [0], {})


def test_a_first_failure_that_is_itself_a_collective_error_shows_in_one_line():
    incident = Incident(id="g0001-n1", node="n1", generation=1, kind="exit", rank=1, pid=7, section="step", step=20,
                        summary="rank 1 on n1: exit 1 in section 'step' at step 20: a collective error, ...",
                        exit_code=1, error={**GLOO_RESET, "traceback": "Traceback (most recent call last):\n..."})
    assert format_incident(incident).splitlines()[1:] == [
        ("resilient:   rank 1 raised RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:20899 (traceback in "
         "the incident file)")]


def test_an_error_raised_after_the_first_failure_was_seen_is_a_consequence_whatever_it_says():
    first = killed(1, 10.0)
    late = exited(0, 10.4)
    early = exited(2, 10.3)
    errors = {0: {"exc_type": "ValueError", "message": "bad batch", "monotonic": 10.2},
              2: {"exc_type": "ValueError", "message": "bad batch", "monotonic": 9.9}, 1: None}
    assert describe_others([first, late, early], errors, first) == (
        "rank 0 on n0: consequence: ValueError: bad batch (after rank 1 was killed by SIGKILL)",
        "rank 2 on n0: also failed: ValueError: bad batch (after rank 1 was killed by SIGKILL)",  # raised before it
    )
