"""What a Run saves beyond model and optimizer: scaler, user state, counters, config fingerprint."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import resilient
from resilient.run.records import StepPosition
from resilient.run.saving import payloads


class Ema:
    """A user object with its own state (an exponential moving average of the loss)."""

    def __init__(self) -> None:
        self.value, self.count = 0.0, 0

    def update(self, x: float) -> None:
        self.value = 0.9 * self.value + 0.1 * x
        self.count += 1

    def state_dict(self):
        return {"value": self.value, "count": self.count}

    def load_state_dict(self, state):
        self.value, self.count = state["value"], state["count"]


def make(tmp_path, config):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
    ema = Ema()
    events = resilient.EventLog(tmp_path / "events.jsonl")
    run = resilient.Run(model=model, optimizer=opt, scaler=scaler, state={"ema": ema}, config=config,
                        checkpoint=resilient.CheckpointConfig(dir=tmp_path / "c", every_steps=None), events=events)
    return run, model, opt, scaler, ema, events


def test_scaler_user_state_and_counters_survive_a_restart(tmp_path):
    run, model, opt, scaler, ema, _ = make(tmp_path, {"lr": 0.1})
    for _ in run.steps(5):
        loss = model(torch.ones(2, 3)).pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        ema.update(loss.item())
        run.report(loss=loss, tokens=6, samples=2)
    assert run.save().ok
    run2, model2, _, scaler2, ema2, events2 = make(tmp_path, {"lr": 0.1})
    assert run2.restored_from == "step_0000000005"
    assert (run2.step, run2.samples, run2.tokens) == (5, 10, 30)
    assert scaler2.get_scale() == scaler.get_scale() != 1024.0
    assert scaler2.state_dict() == scaler.state_dict()
    assert (ema2.value, ema2.count) == (ema.value, ema.count)
    assert torch.equal(model2.weight, model.weight)
    assert not events2.of_kind("config_changed")
    committed = run.checkpoints.last_committed
    assert committed.counters == {"samples": 10, "step": 5, "tokens": 30}
    assert (tmp_path / "events.jsonl").read_text().count("checkpoint_restored") == 1


def test_a_changed_config_is_flagged_on_resume(tmp_path):
    run, *_ = make(tmp_path, {"lr": 0.1})
    run.save()
    run2, *_, events = make(tmp_path, {"lr": 0.2})
    (changed,) = events.of_kind("config_changed")
    assert changed.fields["checkpoint"] == "step_0000000000"


def test_the_host_buffer_is_prepared_before_the_first_save(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    run = resilient.Run(model=model, optimizer=opt,
                        checkpoint=resilient.CheckpointConfig(dir=tmp_path / "c", every_steps=50))
    manager = run.checkpoints
    for step in run.steps(3):
        if step == 2:  # the boundary after the first update started the preparation
            with manager._writer.buffers[0].in_use:  # waits for it to finish
                prepared = manager._writer.buffers[0].capacity
        model(torch.ones(1, 64)).sum().backward()
        opt.step()
        opt.zero_grad()
    from resilient.checkpoint.snapshot import snapshot_bytes

    assert prepared >= snapshot_bytes(payloads(run._state)) > 3 * 64 * 64 * 4, "model + AdamW state not covered"
    result = run.close()
    assert result.ok and manager._writer.buffers[0].capacity == prepared, "the final save had to grow the buffer"


def test_a_run_made_again_over_the_same_optimizer_frees_the_first_one(tmp_path):
    """A second Run over the same optimizer (a script that makes its Run again) takes the optimizer's hooks over:
    the first Run's hooks are removed, so the optimizer no longer keeps it alive with its host buffer and
    checkpoint manager, and only the newest Run's checks follow the optimizer's steps."""
    run, model, opt, scaler, ema, _ = make(tmp_path, {"lr": 0.1})
    for _ in run.steps(2):
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
        opt.zero_grad()
    run.save()
    run.close()
    first, buffers = weakref.ref(run._state), weakref.ref(run.checkpoints._writer.buffers[0])
    del run
    gc.collect()
    assert first() is not None, "the state of a Run the script dropped still guards its optimizer"
    again = resilient.Run(model=model, optimizer=opt, scaler=scaler, state={"ema": ema}, config={"lr": 0.1},
                          checkpoint=resilient.CheckpointConfig(dir=tmp_path / "c", every_steps=None))
    assert again.restored_from is not None
    gc.collect()
    assert first() is None and buffers() is None, "the optimizer kept the first Run's state alive"
    model(torch.randn(4, 3)).sum().backward()
    opt.step()  # the dead Run's hooks are inert; the live one's see the step
    assert again._state.attempt.position is StepPosition.AFTER


def test_a_runs_attributes_read_its_state_and_cannot_be_assigned(tmp_path):
    """The script reads the Run; only the Run changes its state (a script that set ``run.step`` would desync the
    loop, the checkpoints and the agent's view of the step)."""
    run, model, opt, *_ = make(tmp_path, {"lr": 0.1})
    for _ in run.steps(1):
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
        opt.zero_grad()
    assert (run.step, run.model, run.optimizer) == (1, model, opt)
    assert run.step is run._state.step and run.user_state is run._state.user_state
    with pytest.raises(AttributeError, match="Run.step cannot be assigned"):
        run.step = 5
    assert run.step == 1 and "step" not in vars(run), "nothing shadows the state"
    run.close()
