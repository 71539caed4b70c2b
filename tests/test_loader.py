"""ElasticLoader: deterministic, exactly-once per epoch, resumable on any world size."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from resilient import CheckpointMismatchError, ConfigError, ElasticLoader


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
