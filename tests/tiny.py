"""An in-process tiny training setup for fast checkpoint tests."""

from __future__ import annotations

import torch

import resilient


def tiny_run(url, endpoint=None, *, hidden: int = 16, events=None, every: int | None = 3, keep: int = 5,
             **config) -> resilient.Run:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    g = torch.Generator().manual_seed(3)
    data = resilient.ElasticLoader([torch.randn(4, generator=g) for _ in range(40)], batch_size=4, seed=2)
    # A save at every scheduled step whatever the load: the tests name the checkpoints they expect.
    config.setdefault("when_busy", "wait")
    ckpt = resilient.CheckpointConfig(dir=url, endpoint_url=endpoint, every_steps=every, keep=keep, **config)
    return resilient.Run(model=model, optimizer=optimizer, scheduler=scheduler, data=data, checkpoint=ckpt,
                         events=events or resilient.EventLog())


def train(run: resilient.Run, steps: int) -> None:
    model, opt = run.model, run.optimizer
    for _ in run.steps(steps):
        loss = model(next(run.data)).pow(2).mean()
        loss.backward()
        opt.step()
        run.scheduler.step()
        opt.zero_grad()
        run.report(loss=loss)


def params(run: resilient.Run) -> list[torch.Tensor]:
    return [p.detach().clone() for p in run.model.parameters()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
