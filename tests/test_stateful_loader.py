"""The README's route for a loader of one's own: torchdata's StatefulDataLoader kept through ``Run(state=...)``.

A restart on the same number of ranks resumes the exact batch sequence the
loader would have produced, and the run ends bitwise equal to one that never
stopped, as the README promises (in-process runs, real checkpoints on disk).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

import resilient

STEPS, STOP_AT = 7, 4


def _parts(workers: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, StatefulDataLoader]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    samples = [torch.arange(3.0) + i for i in range(23)]  # 23: an epoch ends inside a batch
    loader = StatefulDataLoader(samples, batch_size=4, shuffle=True, num_workers=workers,
                                multiprocessing_context="fork" if workers else None)
    return model, optimizer, loader


def _train(ckpt: Path, workers: int, steps: int, fork: bool = True) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Train up to ``steps`` (resuming from ``ckpt`` if it holds a commit); the batches seen and final params.
    ``fork``: the iterator is made inside ``torch.random.fork_rng()``, as the README says."""
    model, optimizer, loader = _parts(workers)
    run = resilient.Run(model=model, optimizer=optimizer, state={"loader": loader},
                        checkpoint=resilient.CheckpointConfig(dir=ckpt, every_steps=None))
    if fork:
        with torch.random.fork_rng():  # iter() draws seeds from torch's generator, which the Run restored
            batches = iter(loader)  # after the Run: StatefulDataLoader applies the restored state at iter()
    else:
        batches = iter(loader)
    seen = []
    for _ in run.steps(steps):
        try:
            batch = next(batches)
        except StopIteration:  # a new epoch
            batches = iter(loader)
            batch = next(batches)
        seen.append(batch.clone())
        model(torch.nn.functional.dropout(batch, 0.3)).pow(2).mean().backward()  # a draw every step
        optimizer.step()
        optimizer.zero_grad()
    run.save()
    run.close()
    return seen, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stateful_dataloader_in_state_resumes_the_exact_batch_sequence(tmp_path: Path, workers: int) -> None:
    reference, final = _train(tmp_path / "reference", workers, STEPS)
    first, _ = _train(tmp_path / "resumed", workers, STOP_AT)
    rest, resumed_final = _train(tmp_path / "resumed", workers, STEPS)
    assert len(first) == STOP_AT and len(rest) == STEPS - STOP_AT
    for step, (got, want) in enumerate(zip(first + rest, reference, strict=True)):
        assert torch.equal(got, want), f"step {step}: the resumed run read another batch"
    assert all(torch.equal(a, b) for a, b in zip(resumed_final, final, strict=True))


def test_an_iterator_made_outside_fork_rng_stops_the_resumed_run_naming_torchs_generator(tmp_path: Path) -> None:
    """The natural way without fork_rng: iter() moves the restored stream, and the run says so, not ends other."""
    _train(tmp_path, 0, STOP_AT, fork=False)
    with pytest.raises(resilient.ResumeDivergedError, match="torch's generator moved") as caught:
        _train(tmp_path, 0, STEPS, fork=False)
    assert "fork_rng" in str(caught.value) and caught.value.moved == ("torch",)
