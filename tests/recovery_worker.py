"""A training script written the recovery way, run by tests/test_run_recovery.py under a test that plays the agent.

It never calls ``init_process_group``: ``Run(ddp=True)`` creates the group
from torch's variables (a member) or waits for an assignment (a spare,
``RESILIENT_ROLE=spare``).  The step body is ``with run.attempt():`` over
``run.micro_batches()``; the model has dropout and every sample draws a
random augmentation (``--quiet`` turns both off, for a comparison across
world sizes), with AdamW and a scheduler.

Each step appends one JSON line to ``<trace>.<name>`` from inside the
attempt, after the update (so a failed attempt writes nothing): the step,
rank, world size, accumulation, every micro-batch's dataset indices and
unscaled loss (hex floats), the cursor and the counters.  At the end it
writes ``<trace>.<name>.final.pt`` (model, optimizer and scheduler state).

``--kill-step S --kill-where backward`` SIGKILLs this process inside step
S's backward (a gradient hook, before DDP's all-reduce of that bucket);
``--kill-where between`` at the top of step S, before its attempt.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import sys
import time

import torch

import resilient

SEED = 0


class Noisy(torch.utils.data.Dataset):
    def __init__(self, n: int, noise: float) -> None:
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(n, 8, generator=g)
        self.y = torch.randn(n, 1, generator=g)
        self.noise = noise

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        # The augmentation draws from torch's RNG (none when there is no noise: nothing random then).
        return (self.x[i] + self.noise * torch.randn(8) if self.noise else self.x[i]), self.y[i]


def _die(*_: object) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--trace", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--samples", type=int, default=40)
    p.add_argument("--dir", default=None, help="checkpoint location (saved every --every steps and at the end)")
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--quiet", action="store_true", help="no dropout, no augmentation")
    p.add_argument("--kill-step", type=int, default=None)
    p.add_argument("--kill-where", choices=["backward", "between"], default="backward")
    args = p.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(1234)
    dropout = 0.0 if args.quiet else 0.2
    inner = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Dropout(dropout),
                                torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(inner.parameters(), lr=0.05, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + 0.1 * s))
    data = resilient.ElasticLoader(Noisy(args.samples, 0.0 if args.quiet else 0.01), batch_size=4, seed=11)
    ckpt = None
    if args.dir:
        ckpt = resilient.CheckpointConfig(dir=args.dir, every_steps=args.every, async_save=False, elastic=True,
                                          when_busy="wait", timeout_s=60)
    run = resilient.Run(model=inner, optimizer=optimizer, scheduler=scheduler, data=data, checkpoint=ckpt,
                        ddp=True, seed=SEED)
    with open(f"{args.trace}.{args.name}", "a") as trace:
        trace.write(json.dumps({"event": "start", "step": run.step, "rank": run.rank, "world": run.world_size,
                                "wrapped": type(run.model).__name__, "t": time.monotonic()}) + "\n")
        trace.flush()
        for step in run.steps(args.steps):
            if step == args.kill_step and args.kill_where == "between":
                _die()
            with run.attempt():
                indices, losses = [], []
                for x, y in run.micro_batches():
                    loss = torch.nn.functional.mse_loss(run.model(x), y)
                    if step == args.kill_step and args.kill_where == "backward":
                        inner[0].weight.register_hook(_die)  # the peers are in (or entering) this step's all-reduce
                    (loss / run.accumulation).backward()
                    indices.append(run.data.last_indices)
                    losses.append(loss.item().hex())
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                run.report(loss=loss)
                trace.write(json.dumps({"step": step, "rank": run.rank, "world": run.world_size,
                                        "accumulation": run.accumulation, "indices": indices, "losses": losses,
                                        "consumed": run.data.consumed, "samples": run.samples,
                                        "t": time.monotonic()}) + "\n")
                trace.flush()
        run.close()
        trace.write(json.dumps({"event": "end", "step": run.step, "rank": run.rank, "world": run.world_size}) + "\n")
    torch.save({"model": inner.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict()}, f"{args.trace}.{args.name}.final.pt")
    # Every reference to the groups first (the DDP wrapper, the checkpoint coordinator's sub-groups), then the
    # groups (docs/design/in-process-worker.md, "What gloo does when a peer dies": a group destroyed by DDP's
    # reducer, or alive at interpreter exit, can hang or abort the process).
    del run
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
