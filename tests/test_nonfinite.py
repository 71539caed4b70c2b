"""Non-finite gradients: never applied, the step retried on the same batch, a persistent one named and final.

A real model and optimizer with ``Run`` and ``ElasticLoader`` in this process (no agent): a dataset whose one
sample is NaN on its first read (an intermittent fault) or on every read (bad data).  The retried run's final
parameters equal those of a run that never saw the fault, bit for bit.
"""

from __future__ import annotations

import pytest
import torch

import resilient
from resilient.core.errors import ConfigError, NonFiniteGradientsError, PersistentNonFiniteError
from resilient.core.exitcodes import EXIT_UNRECOVERABLE, exit_code_for
from resilient.run.attempt import poisoned


class Data:
    """16 samples; sample ``bad`` is NaN on its first ``times`` reads."""

    def __init__(self, bad: int | None = None, times: int = 0) -> None:
        g = torch.Generator().manual_seed(3)
        self.x, self.y = torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
        self.bad, self.times, self.reads = bad, times, 0

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int):
        x = self.x[i]
        if i == self.bad and self.reads < self.times:
            self.reads += 1
            x = torch.full_like(x, float("nan"))
        return x, self.y[i]


def train(data: Data, steps: int = 6, *, fused: bool = False, seen: list | None = None,
          **kw) -> tuple[list[torch.Tensor], resilient.Run]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.05, fused=fused)
    run = resilient.Run(model=model, optimizer=opt, data=resilient.ElasticLoader(data, batch_size=4, seed=1),
                        agent=None, **kw)
    for step in run.steps(steps):
        if seen is not None:
            seen.append(step)
        with run.attempt():
            for x, y in run.micro_batches():
                torch.nn.functional.mse_loss(run.model(x), y).backward()
            opt.step()
            opt.zero_grad()
            run.report()
    return [p.detach().clone() for p in model.parameters()], run


def test_an_intermittent_nan_is_never_applied_and_the_retried_step_equals_the_clean_run():
    clean, _ = train(Data())
    for bad in (0, 5, 11):  # whichever step reads the sample (the shuffle decides)
        got, run = train(Data(bad=bad, times=1))
        assert all(torch.equal(a, b) for a, b in zip(clean, got)), f"sample {bad}: not the clean run's parameters"
        [seen] = run.events.of_kind("nonfinite_gradients")
        assert seen.fields["retried"] is True and seen.fields["tries"] == 1
        assert seen.fields["params"] and "0.weight" in seen.fields["params"][0], seen.fields
        assert run.step == 6 and all(torch.isfinite(p).all() for p in run.model.parameters())


def test_a_nan_on_every_try_is_persistent_named_and_not_restarted():
    data = Data(bad=5, times=100)
    with pytest.raises(PersistentNonFiniteError) as err:
        train(data)
    text = str(err.value)
    assert "were not finite in 3 tries of the same batch" in text and "stream positions" in text, text
    assert "0.weight" in text and exit_code_for(err.value) == EXIT_UNRECOVERABLE
    assert data.reads == 3  # the first try and two retries, each reading the batch again


def _nan_step(nonfinite: str) -> tuple[torch.nn.Linear, torch.Tensor, torch.optim.Optimizer]:
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    resilient.Run(model=model, optimizer=opt, agent=None, nonfinite=nonfinite)
    model(torch.tensor([[float("nan"), 1.0]])).sum().backward()
    return model, model.weight.detach().clone(), opt


def test_outside_an_attempt_or_in_raise_mode_it_fails_before_the_update_and_off_applies_it():
    for mode in ("retry", "raise"):
        model, weight, opt = _nan_step(mode)
        with pytest.raises(NonFiniteGradientsError) as err:
            opt.step()
        assert torch.equal(model.weight, weight), mode  # not applied
        assert "not finite (NaN or Inf) on rank 0 before the optimizer's update (on this rank: weight" \
            in str(err.value)
        assert exit_code_for(err.value) is None  # a restart from the newest commit replays it cleanly
    model, _, opt = _nan_step("off")
    opt.step()
    assert not torch.isfinite(model.weight).all()  # off: the user asked for no check
    with pytest.raises(ConfigError, match="nonfinite='sometimes'"):
        resilient.Run(model=model, optimizer=opt, agent=None, nonfinite="sometimes")


def test_a_huge_finite_gradient_is_applied_not_taken_for_an_overflow():
    """Seen in a loader test whose model diverges: gradients of 1e20 and more, finite, whose 2-norm overflows."""
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    resilient.Run(model=model, optimizer=opt, agent=None)
    model(torch.tensor([[3e19, 3e19]])).sum().backward()
    assert torch.isinf(torch.linalg.vector_norm(model.weight.grad)) and torch.isfinite(model.weight.grad).all()
    opt.step()  # not refused
    assert torch.isfinite(model.weight).all() and model.weight.abs().max() > 1e19


def test_a_poisoned_batch_is_a_copy_with_one_nan():
    x, y = torch.ones(2, 3), torch.ones(2, 1)
    px, py = poisoned((x, y))
    assert torch.isnan(px).sum() == 1 and torch.isnan(px.view(-1)[0]) and torch.equal(py, y)
    assert torch.isfinite(x).all()  # the loader's tensor is untouched
    assert poisoned({"ids": torch.arange(3), "v": x})["v"].isnan().sum() == 1


def test_a_late_verdict_never_applies_a_nan_and_the_step_is_run_again_wherever_it_falls(tmp_path):
    """nonfinite_verdict="late": the check sets a flag on the device and the fused step skips the update by it;
    the flag is read a step later (or at a boundary that keeps the state).  A NaN in any step, the last one
    included, and with a checkpoint every step: the run equals the run that never saw it, bit for bit, and so
    does its newest commit."""
    clean, _ = train(Data(), fused=True, nonfinite_verdict="now")
    for bad in range(16):  # every sample: every step of the six, first and last included
        ckpt = resilient.CheckpointConfig(dir=tmp_path / f"c{bad}", every_steps=1) if bad % 4 == 0 else None
        seen: list[int] = []
        got, run = train(Data(bad=bad, times=1), fused=True, nonfinite_verdict="late", seen=seen, checkpoint=ckpt)
        assert all(torch.equal(a, b) for a, b in zip(clean, got)), f"sample {bad}: not the clean run's parameters"
        [event] = run.events.of_kind("nonfinite_gradients")
        assert event.fields["late"] is True and event.fields["retried"] is True and event.fields["tries"] == 1
        step = event.fields["step"]
        assert seen[:step + 1] == list(range(step + 1)) and seen.count(step) == 2, (bad, seen)
        assert run.step == 6 and run._state.nonfinite.pending is None
        if ckpt is not None:
            run.close()
            again, restored = train(Data(), steps=6, fused=True, nonfinite_verdict="late",
                                    checkpoint=resilient.CheckpointConfig(dir=tmp_path / f"c{bad}"))
            assert restored.restored_from is not None and all(torch.equal(a, b) for a, b in zip(clean, again))


def test_a_late_verdict_is_not_read_in_its_own_step():
    """What makes it cheap: the step's own update reads nothing of its flag (on CUDA, no wait for the device);
    the next step's update reads it from the host copy."""
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    run = resilient.Run(model=model, optimizer=opt, agent=None, nonfinite_verdict="late")
    for step in run.steps(2):
        with run.attempt():
            model(torch.ones(1, 2)).sum().backward()
            opt.step()
            opt.zero_grad()
            pending = run._state.nonfinite.pending
            assert pending is not None and pending.step == step and pending.bad is None, "read in its own step"
            assert not hasattr(opt, "found_inf"), "a later step without the check would inherit the flag"
    assert run._state.nonfinite.pending is None, "the last step's verdict is read at the end of the loop"


def test_a_late_verdict_names_a_persistent_nan_from_the_retry_checked_at_once():
    data = Data(bad=5, times=100)
    with pytest.raises(PersistentNonFiniteError) as err:
        train(data, fused=True, nonfinite_verdict="late")
    text = str(err.value)
    assert "were not finite in 3 tries of the same batch" in text and "0.weight" in text, text
    assert data.reads == 3


def test_a_late_verdict_needs_a_fused_optimizer_and_no_scaler():
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ConfigError, match="fused=True"):
        resilient.Run(model=model, optimizer=torch.optim.Adam(model.parameters()), agent=None,
                      nonfinite_verdict="late")
    fused = torch.optim.Adam(model.parameters(), fused=True)
    with pytest.raises(ConfigError, match="GradScaler"):
        resilient.Run(model=model, optimizer=fused, agent=None, scaler=torch.amp.GradScaler("cpu"),
                      nonfinite_verdict="late")
    with pytest.raises(ConfigError, match="nonfinite_verdict='soon'"):
        resilient.Run(model=model, optimizer=fused, agent=None, nonfinite_verdict="soon")
    run = resilient.Run(model=model, optimizer=fused, agent=None)
    assert run._state.nonfinite.verdict == "now", "auto: late only on CUDA, where the sync costs"


def test_a_run_on_the_cpu_never_pays_for_the_late_verdicts_probe(monkeypatch):
    """Its probe runs a fused optimizer step (about half a second in a fresh process): only a Run that would read
    its verdict late probes it, not every Run's start."""
    from resilient.core import compat

    monkeypatch.setattr(compat, "STATUS", {})
    model = torch.nn.Linear(2, 1)
    resilient.Run(model=model, optimizer=torch.optim.Adam(model.parameters(), fused=True), agent=None)
    assert "late_nonfinite" not in compat.STATUS and "fused_check" in compat.STATUS
    resilient.Run(model=model, optimizer=torch.optim.Adam(model.parameters(), fused=True), agent=None,
                  nonfinite_verdict="late")
    assert compat.STATUS["late_nonfinite"] is None



def test_a_rank_s_own_gradients_are_watched_before_they_are_averaged_only_on_a_retry_of_a_non_finite_step():
    """What tells the rank whose samples made a NaN from the ranks the all-reduce brought it to: hooks that see
    each gradient as its backward makes it, installed only while a step found non-finite is retried."""
    from resilient.run.nonfinite import watch_own
    from resilient.run.records import OwnGradients
    from resilient.run.state import RunState

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    watch = OwnGradients(model)
    model(torch.ones(2, 4)).sum().backward()
    assert watch.verdict() is False
    model(torch.tensor([[1.0, float("nan"), 0.0, 0.0]])).sum().backward()
    assert watch.verdict() is True  # the flags of one attempt's backward passes, micro-batches included
    watch.remove()
    assert watch.verdict() is None
    model(torch.tensor([[float("nan")] * 4])).sum().backward()
    assert watch.verdict() is None  # removed: the hooks see nothing more

    state = RunState(model=model, events=resilient.EventLog(None), world_size=2, step=5)
    assert watch_own(state) is None  # a healthy step is not watched
    state.nonfinite.tries = {5: 1}
    watching = watch_own(state)
    assert isinstance(watching, OwnGradients)
    watching.remove()
    state.world_size = 1
    assert watch_own(state) is None  # one rank: its gradients are its own anyway
