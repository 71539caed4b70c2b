"""The batch plan (pure): every position of a step exactly once, the reference's batches, and the declared rule."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from resilient.elastic.batch import BatchRule, feasible_world_sizes, plan_batch
from resilient.core.errors import ConfigError


def positions(plan, rank, k):
    offset, size = plan.slot(rank, k)
    return list(range(offset, offset + size))


@settings(max_examples=400, deadline=None)
@given(g=st.integers(1, 200), b=st.integers(1, 16), w=st.integers(1, 24), rule=st.sampled_from(list(BatchRule)))
def test_a_feasible_plan_takes_every_position_of_the_step_exactly_once(g, b, w, rule):
    plan = plan_batch(g, b, w, rule)
    fewest = -(-g // (w * b))  # the fewest micro-batches of at most b that hold a rank's share
    if rule is BatchRule.REFUSE:
        assert plan.feasible == (g % w == 0), "equal micro-batches exist exactly when the ranks divide the batch"
    else:
        assert plan.feasible == (g >= w * fewest), "every micro-batch holds a sample"
    if not plan.feasible:
        assert plan.accumulation == 0
        return
    taken = [p for r in range(w) for k in range(plan.accumulation) for p in positions(plan, r, k)]
    assert taken == list(range(g)), "ranks and micro-batches in order take the step's positions once, in order"
    sizes = [size for r in range(w) for _, size in plan.slots(r)]
    assert min(sizes) >= 1 and max(sizes) <= b, f"micro-batch sizes {sizes} outside 1..{b}"
    assert max(sizes) - min(sizes) <= 1
    assert plan.even == (len(set(sizes)) == 1)
    if rule is BatchRule.UNEVEN:
        assert plan.accumulation == fewest
    else:
        share = g // w
        assert plan.even and share % plan.accumulation == 0
        assert all(share % d for d in range(fewest, plan.accumulation)), "the fewest equal micro-batches"
    assert sum(plan.samples(r) for r in range(w)) == g
    # Every sample weighs 1/G in the step's gradient: weight x (1/n per sample of a mean loss) x (1/W from DDP).
    for r in range(w):
        for k, (_, n) in enumerate(plan.slots(r)):
            assert plan.weight(r, k) == (w * n) / g
            assert Fraction(w * n, g) / n / w == Fraction(1, g)
            if plan.even:
                assert plan.weight(r, k) == 1 / plan.accumulation, "when even, loss / run.accumulation is exact"


@settings(max_examples=200, deadline=None)
@given(b=st.integers(1, 8), w0=st.integers(1, 12), data=st.data())
def test_when_ranks_times_micro_batch_divide_the_global_batch_each_micro_batch_is_a_reference_batch(b, w0, data):
    g = w0 * b
    w = data.draw(st.sampled_from([d for d in range(1, w0 + 1) if w0 % d == 0]))
    plan = plan_batch(g, b, w)
    assert plan.feasible and plan.even and plan.accumulation == w0 // w
    reference = plan_batch(g, b, w0)
    assert reference.accumulation == 1 and "full size" in reference.reason
    for r in range(w):
        for k in range(plan.accumulation):
            j = r * plan.accumulation + k
            assert positions(plan, r, k) == positions(reference, j, 0), f"slot {j} is reference rank {j}'s batch"


def test_each_step_consumes_the_reference_steps_positions_at_any_world_size():
    g, b = 12, 3  # first started on 4 ranks
    reference = plan_batch(g, b, 4)
    cursor = 0
    for step, w in enumerate([4, 2, 1, 3, 4, 2]):  # shrink, shrink, grow, grow, shrink
        plan = plan_batch(g, b, w)
        taken = sorted(cursor + p for r in range(w) for k in range(plan.accumulation) for p in positions(plan, r, k))
        ref = sorted(cursor + p for r in range(4) for p in positions(reference, r, 0))
        assert taken == ref == list(range(step * g, (step + 1) * g))
        cursor += g


def test_the_plan_says_how_the_batch_is_split():
    assert plan_batch(8, 4, 2).reason == "global batch 8 = 2 ranks x 1 micro-batch x 4 samples: full size"
    one = plan_batch(8, 4, 1)
    assert (one.accumulation, one.even) == (2, True)
    assert one.reason == "global batch 8 = 1 rank x 2 micro-batches x 4 samples: accumulation 2 keeps the global batch"
    # 8 samples over 2 ranks with micro-batches of at most 3: 2 x 2 of 2, still even (smaller than B).
    small = plan_batch(8, 3, 2)
    assert (small.feasible, small.even, small.accumulation, small.slots(1)) == (True, True, 2, ((4, 2), (6, 2)))
    assert small.reason == ("global batch 8 = 2 ranks x 2 micro-batches x 2 samples: accumulation 2 keeps the global "
                            "batch (micro-batches of 2, below 3, so that all are equal)")
    assert small.to_event() == {"global_batch": 8, "micro_batch": 3, "world_size": 2, "accumulation": 2,
                                "rule": "refuse", "feasible": True, "even": True, "reason": small.reason}


def test_an_uneven_split_is_refused_by_default_and_kept_with_weights_under_the_uneven_rule():
    refused = plan_batch(10, 4, 3)
    assert not refused.feasible and refused.rule is BatchRule.REFUSE
    assert refused.reason == ("global batch 10 is not a multiple of 3 ranks, so its micro-batches cannot be equal "
                              "(they would be 3 ranks x 1 micro-batch of 3 or 4 samples (1 of 3 holding 4)); rule "
                              "'refuse' makes world size 3 infeasible")
    with pytest.raises(ConfigError, match=r"cannot hold at world size 3: .*Run on a world size that splits the "
                                          r"global batch \(1, 2, 5, 10\), or .* batch_rule='uneven'"):
        refused.require()
    kept = plan_batch(10, 4, 3, "uneven")
    assert kept.require() is kept and not kept.even and kept.accumulation == 1
    assert [kept.slot(r, 0) for r in range(3)] == [(0, 4), (4, 3), (7, 3)]
    assert [kept.weight(r, 0) for r in range(3)] == [1.2, 0.9, 0.9]
    assert "rule 'uneven' keeps it, each micro-batch's mean loss weighted by 3 x its samples / 10" in kept.reason


def test_equal_micro_batches_may_be_smaller_and_the_uneven_rule_prefers_the_fewest():
    # A share of 7 samples with micro-batches of at most 4: 7 of 1 sample are equal, 4 + 3 are fewer.
    exact = plan_batch(14, 4, 2)
    assert (exact.accumulation, exact.even, exact.slot(1, 0)) == (7, True, (7, 1))
    assert exact.reason.endswith("accumulation 7 keeps the global batch (micro-batches of 1, below 4, so that all "
                                 "are equal)")
    fewest = plan_batch(14, 4, 2, "uneven")
    assert (fewest.accumulation, fewest.even, fewest.slots(0), fewest.slots(1)) == \
        (2, False, ((0, 4), (4, 4)), ((8, 3), (11, 3)))
    assert [fewest.weight(1, k) for k in range(2)] == [6 / 14, 6 / 14]


def test_more_ranks_than_samples_is_infeasible_under_every_rule():
    for rule in BatchRule:
        plan = plan_batch(3, 4, 4, rule)
        assert not plan.feasible
        assert plan.reason == "global batch 3 cannot give each of 4 ranks a sample; world size 4 is infeasible under every rule"
    # Uneven needs a sample in each of the W * A micro-batches: 5 samples, micro-batches of 1, 2 ranks -> 3 each.
    assert not plan_batch(5, 1, 2, "uneven").feasible


def test_feasible_world_sizes_for_the_decision():
    assert feasible_world_sizes(12, 2, 1, 8) == frozenset({1, 2, 3, 4, 6})
    assert feasible_world_sizes(12, 2, 1, 8, BatchRule.UNEVEN) == frozenset(range(1, 9))
    assert feasible_world_sizes(12, 2, 4, 13, "uneven") == frozenset(range(4, 13))
    assert feasible_world_sizes(12, 2, 5, 5) == frozenset()


@pytest.mark.parametrize(("call", "message"), [
    (lambda: plan_batch(0, 4, 2), r"global_batch=0 must be an int >= 1"),
    (lambda: plan_batch(8, 4, True), r"world_size=True must be an int >= 1"),
    (lambda: plan_batch(8, 2.0, 2), r"micro_batch=2.0 must be an int >= 1"),
    (lambda: plan_batch(8, 4, 2, "drop"), r"batch rule 'drop' is not one of \['refuse', 'uneven'\]"),
    (lambda: feasible_world_sizes(8, 4, 3, 2), r"min_world 3 is above max_world 2"),
])
def test_bad_input_names_the_problem(call, message):
    with pytest.raises(ConfigError, match=message):
        call()
