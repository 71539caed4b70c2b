"""The first step after a restore checks that the run stands where the run that saved it stood.

In one process: a Run trains and saves, a new Run over new objects restores (as a restarted worker would), and
what the script does between the restore and its first step decides the outcome: nothing moved (the resumed run
equals the uninterrupted one bitwise), or a ``resume_diverged`` event and ``ResumeDivergedError`` naming what
moved.  A script that fetches its next batch inside the step resumes equal through ``run.prefetch``.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

import resilient
from resilient.core.errors import ResumeDivergedError
from resilient.core.events import EventKind, EventLog
from resilient.core.exitcodes import EXIT_UNRECOVERABLE, exit_code_for

DATA = torch.arange(4000, dtype=torch.float32).remainder(97).div(97)


def get_batch(size: int = 4) -> torch.Tensor:
    """A batch drawn from the global torch generator, as the popular GPT scripts draw theirs."""
    ix = torch.randint(len(DATA) - 8, (size,))
    return torch.stack([DATA[i : i + 8] for i in ix])


def make_run(ckpt: Path, **kwargs) -> tuple[resilient.Run, torch.nn.Module, torch.optim.Optimizer, EventLog]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    events = EventLog()
    run = resilient.Run(model=model, optimizer=optimizer, events=events, agent=None,
                        checkpoint=resilient.CheckpointConfig(dir=str(ckpt), every_steps=5, save_on_finish=False,
                                                              when_busy="wait"),  # saved at 5 and 10, none deferred
                        **kwargs)
    return run, model, optimizer, events


def train(run: resilient.Run, model, optimizer, steps: int, *, fetch, batches: list[torch.Tensor],
          before_loop=lambda: None) -> None:
    """The prefetching loop: the next batch is fetched after the forward pass, ahead of its step."""
    x = fetch()
    before_loop()
    for _ in run.steps(steps):
        batches.append(x)
        loss = model(x).pow(2).mean()
        x = fetch()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    run.close()


def params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def uninterrupted(tmp_path: Path, steps: int, *, prefetch: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    run, model, optimizer, _ = make_run(tmp_path / "reference")
    fetch = (lambda: run.prefetch(get_batch)) if prefetch else get_batch
    batches: list[torch.Tensor] = []
    train(run, model, optimizer, steps, fetch=fetch, batches=batches)
    return params(model), batches


def test_prefetching_through_run_prefetch_resumes_bitwise_equal(tmp_path):
    reference, reference_batches = uninterrupted(tmp_path, 17, prefetch=True)
    ckpt = tmp_path / "ckpt"
    run, model, optimizer, _ = make_run(ckpt)
    batches: list[torch.Tensor] = []
    train(run, model, optimizer, 12, fetch=lambda: run.prefetch(get_batch), batches=batches)  # saved at 5 and 10
    run, model, optimizer, events = make_run(ckpt)
    assert run.restored_from == "step_0000000010"
    batches = batches[:10]
    train(run, model, optimizer, 17, fetch=lambda: run.prefetch(get_batch), batches=batches)
    assert not events.of_kind(EventKind.RESUME_DIVERGED)
    assert all(torch.equal(a, b) for a, b in zip(batches, reference_batches, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(params(model), reference, strict=True))


def test_a_plain_prefetch_is_caught_at_the_first_step_naming_torch_and_the_cause(tmp_path):
    ckpt = tmp_path / "ckpt"
    run, model, optimizer, _ = make_run(ckpt)
    train(run, model, optimizer, 12, fetch=get_batch, batches=[])
    run, model, optimizer, events = make_run(ckpt)
    with pytest.raises(ResumeDivergedError) as caught:
        train(run, model, optimizer, 17, fetch=get_batch, batches=[])
    assert caught.value.moved == ("torch",) and caught.value.step == 10
    assert "prefetched outside run.steps()" in str(caught.value) and "run.prefetch" in str(caught.value)
    assert exit_code_for(caught.value) == EXIT_UNRECOVERABLE  # the agent does not restart into the same divergence
    (event,) = events.of_kind(EventKind.RESUME_DIVERGED)
    assert event.fields["moved"] == ["torch"] and event.fields["accepted"] is False
    assert event.fields["checkpoint"] == "step_0000000010"


def test_nothing_drawn_between_restore_and_first_step_passes_and_equals_the_uninterrupted_run(tmp_path):
    def fetch_in_step(run, model, optimizer, steps):
        for _ in run.steps(steps):
            model(get_batch()).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        run.close()

    run, reference, optimizer, _ = make_run(tmp_path / "reference")
    fetch_in_step(run, reference, optimizer, 17)
    run, model, optimizer, _ = make_run(tmp_path / "ckpt")
    fetch_in_step(run, model, optimizer, 12)
    run, model, optimizer, events = make_run(tmp_path / "ckpt")
    fetch_in_step(run, model, optimizer, 17)
    assert run.restored_from == "step_0000000010"
    assert not events.of_kind(EventKind.RESUME_DIVERGED)
    assert all(torch.equal(a, b) for a, b in zip(params(model), params(reference), strict=True))


@pytest.mark.parametrize(("draw", "moved"), [
    (lambda run: random.random(), ["python"]),
    (lambda run: torch.randn(1), ["torch"]),
    (lambda run: next(run.data), ["data"]),
    (lambda run: run.prefetch(next, run.data), ["data"]),
    (lambda run: torch.manual_seed(1), ["torch"]),
], ids=["python-random", "torch", "loader", "loader-prefetch-on-a-fresh-save", "seed-set-again"])
def test_each_stream_and_the_data_position_is_named(tmp_path, draw, moved):
    def loader_run() -> tuple[resilient.Run, torch.nn.Module, torch.optim.Optimizer, EventLog]:
        data = resilient.ElasticLoader([torch.full((8,), float(i)) for i in range(64)], batch_size=4, seed=3)
        return make_run(tmp_path / "ckpt", data=data)

    run, model, optimizer, _ = loader_run()
    for _ in run.steps(10):
        model(next(run.data)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    run.close()
    run, model, optimizer, _ = loader_run()
    draw(run)
    with pytest.raises(ResumeDivergedError) as caught:
        for _ in run.steps(12):
            pass
    assert list(caught.value.moved) == moved
    if moved == ["data"]:
        assert "the loader was read between the restore and the first step" in str(caught.value)


def test_accepting_a_divergence_goes_on_and_records_it(tmp_path):
    ckpt = tmp_path / "ckpt"
    run, model, optimizer, _ = make_run(ckpt)
    train(run, model, optimizer, 12, fetch=get_batch, batches=[])
    run, model, optimizer, events = make_run(ckpt, resume_check="accept")
    train(run, model, optimizer, 17, fetch=get_batch, batches=[])
    assert run.step == 17
    (event,) = events.of_kind(EventKind.RESUME_DIVERGED)
    assert event.fields["accepted"] is True and event.fields["moved"] == ["torch"]


def test_a_prefetched_batch_not_fetched_again_is_caught(tmp_path):
    ckpt = tmp_path / "ckpt"
    run, model, optimizer, _ = make_run(ckpt)
    train(run, model, optimizer, 12, fetch=lambda: run.prefetch(get_batch), batches=[])
    run, model, optimizer, _ = make_run(ckpt)
    with pytest.raises(ResumeDivergedError) as caught:
        for _ in run.steps(17):  # the loop without the fetch before it
            model(run.prefetch(get_batch)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    assert "did not fetch it again before its first step" in str(caught.value)


def test_a_prefetch_fetched_again_with_other_arguments_is_caught(tmp_path):
    ckpt = tmp_path / "ckpt"
    run, model, optimizer, _ = make_run(ckpt)
    train(run, model, optimizer, 12, fetch=lambda: run.prefetch(get_batch), batches=[])
    run, model, optimizer, _ = make_run(ckpt)
    with pytest.raises(ResumeDivergedError) as caught:
        train(run, model, optimizer, 17, fetch=lambda: run.prefetch(get_batch, 6), batches=[])  # 6 draws, not 4
    assert caught.value.moved == ("torch",)
    assert "drew other numbers" in str(caught.value)


def test_generators_given_to_the_run_are_saved_restored_and_checked(tmp_path):
    def gen_run() -> tuple[resilient.Run, torch.Generator, random.Random]:
        g, r = torch.Generator().manual_seed(5), random.Random(9)
        run = make_run(tmp_path / "ckpt", generators={"noise": g, "mixer": r})[0]
        return run, g, r

    run, g, r = gen_run()
    for step in run.steps(12):  # saved at the boundaries of steps 5 and 10
        if step == 10:
            expected = (torch.rand(3, generator=g.clone_state()), r.getstate())
        torch.rand(3, generator=g)
        r.random()
    run.close()
    run, g, r = gen_run()
    assert torch.equal(torch.rand(3, generator=g.clone_state()), expected[0]) and r.getstate() == expected[1]
    r.random()  # drawn between the restore and the first step
    with pytest.raises(ResumeDivergedError) as caught:
        for _ in run.steps(12):
            pass
    assert caught.value.moved == ("generator mixer",)


def test_refuses_what_it_cannot_save_as_a_generator(tmp_path):
    with pytest.raises(resilient.ConfigError, match="give a torch.Generator"):
        make_run(tmp_path / "ckpt", generators={"bad": object()})
    with pytest.raises(resilient.ConfigError, match="resume_check"):
        make_run(tmp_path / "ckpt", resume_check="warn")
