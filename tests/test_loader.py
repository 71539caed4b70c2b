"""ElasticLoader: deterministic, exactly-once per epoch, resumable on any world size."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from resilient import CheckpointMismatchError, ConfigError, ElasticLoader
from resilient.elastic.batch import feasible_world_sizes


def loaders(n, batch, world, seed=5):
    data = list(range(n))
    return [ElasticLoader(data, batch_size=batch, seed=seed, rank=r, world_size=world) for r in range(world)]


def take(ls, steps):
    """Run ``steps`` lockstep steps on every rank; return the indices consumed, in stream order."""
    out = []
    for _ in range(steps):
        for loader in ls:
            batch = next(loader)
            assert batch.tolist() == loader.last_indices
            out += loader.last_indices
    return out


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 50), batch=st.integers(1, 7), world=st.integers(1, 4), epochs=st.integers(1, 3))
def test_every_sample_of_every_epoch_is_consumed_exactly_once(n, batch, world, epochs):
    ls = loaders(n, batch, world)
    steps = -(-epochs * n // (batch * world))
    stream = take(ls, steps)
    for e in range(epochs):
        assert sorted(stream[e * n : (e + 1) * n]) == list(range(n)), f"epoch {e} is not a permutation"


@settings(max_examples=60, deadline=None)
@given(n=st.integers(5, 40), batch=st.integers(1, 5), w1=st.integers(1, 4), w2=st.integers(1, 4),
       steps1=st.integers(0, 10), steps2=st.integers(1, 10))
def test_a_cursor_saved_on_one_world_size_continues_the_same_stream_on_another(n, batch, w1, w2, steps1, steps2):
    first = loaders(n, batch, w1)
    head = take(first, steps1)
    state = first[0].state_dict()
    assert all(loader.state_dict() == state for loader in first)
    second = loaders(n, batch, w2)
    for loader in second:
        loader.load_state_dict(state)
    tail = take(second, steps2)
    reference = loaders(n, 1, 1)
    assert head + tail == take(reference, len(head) + len(tail)), "samples skipped or repeated across the resize"


def test_epochs_are_shuffled_differently_and_reproducibly():
    a = take(loaders(20, 5, 1), 8)
    b = take(loaders(20, 5, 1), 8)
    assert a == b and a[:20] != a[20:40] and Counter(a[:20]) == Counter(a[20:40])


def test_collates_like_default_collate_and_measures_data_time():
    ticks = iter(range(100))
    data = [{"x": torch.full((3,), float(i)), "y": i} for i in range(10)]
    loader = ElasticLoader(data, batch_size=4, seed=0, shuffle=False, clock=lambda: float(next(ticks)))
    batch = next(loader)
    assert batch["x"].shape == (4, 3) and batch["y"].tolist() == [0, 1, 2, 3]
    assert loader.data_wait_s == 1.0


def test_a_changed_dataset_refuses_to_resume():
    state = loaders(10, 2, 1)[0].state_dict()
    with pytest.raises(CheckpointMismatchError, match="dataset_len 10 -> 11"):
        loaders(11, 2, 1)[0].load_state_dict(state)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"batch_size": 0}, "batch_size"),
    ({"rank": 3, "world_size": 2}, "rank 3"),
    ({"num_workers": -1}, r"num_workers=-1 must be an int >= 0"),
    ({"prefetch_factor": 2}, r"prefetch_factor=2 needs worker processes: set num_workers > 0"),
    ({"num_workers": 2, "prefetch_factor": 0}, r"prefetch_factor=0 must be an int >= 1"),
    ({"persistent_workers": True}, r"persistent_workers=True needs num_workers > 0"),
    ({"num_workers": 1, "timeout": -1}, r"timeout=-1 must be a number of seconds >= 0"),
    ({"timeout": 5}, r"timeout=5 applies to worker processes"),
    ({"multiprocessing_context": "fork"}, r"multiprocessing_context='fork' needs worker processes"),
    ({"num_workers": 1, "multiprocessing_context": "threads"}, r"'threads' is not a start method here; use one of"),
    ({"num_workers": 1, "worker_init_fn": 3}, r"worker_init_fn must be a callable"),
])
def test_bad_arguments(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ElasticLoader(list(range(4)), **{"batch_size": 2, **kwargs})


# ------------------------------------------------------------------ micro-batches under the batch plan
def micro_step(ls):
    """One step of ``micro_batches()`` on every rank: each micro-batch's indices, in rank order."""
    out = []
    for loader in ls:
        for batch in loader.micro_batches():
            assert batch.tolist() == loader.last_indices
            out.append(list(loader.last_indices))
    return out


@settings(max_examples=60, deadline=None)
@given(n=st.integers(5, 40), batch=st.integers(1, 5), w0=st.integers(1, 6), steps0=st.integers(0, 5),
       steps=st.integers(1, 6), data=st.data())
def test_micro_batches_give_each_step_the_reference_steps_samples_at_any_feasible_world_size(n, batch, w0, steps0,
                                                                                          steps, data):
    g = batch * w0
    w = data.draw(st.sampled_from(sorted(feasible_world_sizes(g, batch, 1, 8))))
    reference = loaders(n, batch, w0)
    ref_steps = [take(reference, 1) for _ in range(steps0 + steps)]
    first = loaders(n, batch, w0)
    take(first, steps0)
    second = loaders(n, batch, w)
    for loader in second:
        loader.load_state_dict(first[0].state_dict())  # a restore at another world size keeps the global batch
        assert loader.global_batch == g and loader.global_batch_size == batch * w
    for step in range(steps0, steps0 + steps):
        got = micro_step(second)
        assert [i for mb in got for i in mb] == ref_steps[step], f"step {step}: not the reference's samples in order"
        assert len(got) == w * second[0].plan.accumulation
        assert {loader.consumed for loader in second} == {(step + 1) * g}


def test_the_first_bind_fixes_the_global_batch_and_the_checkpoint_carries_it():
    loader = ElasticLoader(list(range(30)), batch_size=3, seed=1, rank=1, world_size=4)
    loader.bind(0, 2)  # shrunk: the step still takes 12 samples, in 2 micro-batches of 3 per rank
    assert (loader.global_batch, loader.global_batch_size, loader.plan.accumulation) == (12, 6, 2)
    state = loader.state_dict()
    assert state["global_batch"] == 12
    old = {k: v for k, v in state.items() if k != "global_batch"}  # a checkpoint from before the global batch
    fresh = ElasticLoader(list(range(30)), batch_size=3, seed=1, rank=0, world_size=1)
    fresh.load_state_dict(old)
    assert fresh.global_batch == 3 * 2, "without it: the batch of the ranks that wrote the checkpoint"


def test_a_step_left_before_its_last_micro_batch_does_not_move_the_cursor_and_rewind_reads_it_again():
    loader = ElasticLoader(list(range(30)), batch_size=4, seed=2, rank=0, world_size=1)
    loader.load_state_dict({**loader.state_dict(), "global_batch": 12})
    step = loader.micro_batches()
    first_two = [next(step).tolist(), next(step).tolist()]
    assert loader.consumed == 0
    whole = [b.tolist() for b in loader.micro_batches()]
    assert whole[:2] == first_two and loader.consumed == 12
    loader.rewind(0)
    assert [b.tolist() for b in loader.micro_batches()] == whole
    mixed = loader.micro_batches()
    next(mixed)
    next(loader)  # the classic way in the middle of a step
    with pytest.raises(ConfigError, match="the cursor moved from 12 to 16 while the micro-batches"):
        next(mixed)
    with pytest.raises(ConfigError, match=r"rewind\(-1\): the cursor is an int >= 0"):
        loader.rewind(-1)


def test_an_uneven_split_is_refused_by_default_and_weighted_under_the_uneven_rule():
    def at_three_ranks(rule):
        ls = [ElasticLoader(list(range(30)), batch_size=4, seed=3, rank=r, world_size=3, batch_rule=rule)
              for r in range(3)]
        for loader in ls:
            loader.load_state_dict({**loader.state_dict(), "global_batch": 10})
        return ls

    with pytest.raises(ConfigError, match=r"cannot hold at world size 3: global batch 10 is not a multiple of 3 ranks"):
        at_three_ranks("refuse")[0].micro_batches()
    ls = at_three_ranks("uneven")
    with pytest.raises(ConfigError, match=r"need their losses weighted: iterate micro_batches\(weighted=True\)"):
        ls[0].micro_batches()
    got = [(batch.tolist(), weight) for loader in ls for batch, weight in loader.micro_batches(weighted=True)]
    assert [len(b) for b, _ in got] == [4, 3, 3] and [w for _, w in got] == [1.2, 0.9, 0.9]
    assert [i for b, _ in got for i in b] == ls[0].indices_at(0, 10)
    with pytest.raises(ConfigError, match=r"batch rule 'odd' is not one of"):
        ElasticLoader(list(range(4)), batch_size=2, batch_rule="odd")
