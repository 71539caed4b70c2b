"""One small training script in two styles, for tests/test_run_attempt.py.

``--style classic``: the loop of today: the script wraps DDP itself and takes
``next(run.data)``; it seeds torch at each step the way ``run.attempt()``
does (``step_seed(seed, step, rank)``), so both styles draw the same numbers.

``--style attempt``: the script's side of in-process recovery:
``Run(ddp=True)``, ``with run.attempt():``, ``run.micro_batches()`` and
``loss / run.accumulation``.

The model has dropout and every sample draws a random augmentation, so the
random streams matter.  Each rank writes one JSON line per step (the
indices and the unscaled loss of each micro-batch, the accumulation) and a
last line with every parameter as hex floats.

``--die-rank R --die-step S`` SIGKILLs rank R before its backward at step S;
the survivors' ``Run._recovery`` records the failure and declines (there is
no re-formation here), so ``attempt()`` passes it through, and each survivor
writes an ``error`` line saying what it raised and how it was classified.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import signal
import sys

import torch
import torch.distributed as dist

import resilient
from resilient.run.attempt import is_recoverable, step_seed

SEED = 0


class Noisy(torch.utils.data.Dataset):
    def __init__(self, n: int = 40) -> None:
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(n, 8, generator=g)
        self.y = torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i] + 0.01 * torch.randn(8), self.y[i]


def train(run, args, trace, classic: bool, rank: int, optimizer, scheduler) -> None:
    for step in run.steps(args.steps):
        indices, losses = [], []
        if classic:
            torch.manual_seed(step_seed(SEED, step, rank))
            x, y = next(run.data)
            loss = torch.nn.functional.mse_loss(run.model(x), y)
            loss.backward()
            indices.append(run.data.last_indices)
            losses.append(loss.item().hex())
            optimizer.step(); scheduler.step(); optimizer.zero_grad()
            run.report(loss=loss)
            accumulation = 1
        else:
            with run.attempt():
                for x, y in run.micro_batches():
                    loss = torch.nn.functional.mse_loss(run.model(x), y)
                    if rank == args.die_rank and step == args.die_step:
                        os.kill(os.getpid(), signal.SIGKILL)  # the peers are in this step's all-reduce
                    (loss / run.accumulation).backward()
                    indices.append(run.data.last_indices)
                    losses.append(loss.item().hex())
                optimizer.step(); scheduler.step(); optimizer.zero_grad()
                run.report(loss=loss)
            accumulation = run.accumulation
        trace.write(json.dumps({"step": step, "indices": indices, "losses": losses, "accumulation": accumulation,
                                "consumed": run.data.consumed, "samples": run.samples}) + "\n")
        trace.flush()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--style", choices=["classic", "attempt"], required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--trace", required=True)
    p.add_argument("--dir", default=None, help="checkpoint location (elastic, saved at the end)")
    p.add_argument("--events", default=None)
    p.add_argument("--die-rank", type=int, default=None)
    p.add_argument("--die-step", type=int, default=None)
    args = p.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    rank = dist.get_rank() if world > 1 else 0
    torch.manual_seed(1234)
    model: torch.nn.Module = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
    inner = model
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + 0.1 * s))
    data = resilient.ElasticLoader(Noisy(), batch_size=4, seed=11)
    ckpt = None
    if args.dir:
        ckpt = resilient.CheckpointConfig(dir=args.dir, every_steps=None, async_save=False, elastic=True,
                                          when_busy="wait", timeout_s=60)
    events = resilient.EventLog(f"{args.events}.rank{rank}" if args.events else None)
    classic = args.style == "classic"
    if classic and world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    run = resilient.Run(model=model, optimizer=optimizer, scheduler=scheduler, data=data, checkpoint=ckpt,
                        events=events, ddp=not classic, seed=SEED)
    asked: list[BaseException] = []
    if args.die_rank is not None:
        run._state.recovery = lambda exc: asked.append(exc) and False  # what in-process recovery would be handed
    with open(f"{args.trace}.rank{rank}", "a") as trace:
        trace.write(json.dumps({"event": "start", "restored_from": run.restored_from, "step": run.step,
                                "world_size": run.world_size, "wrapped": type(run.model).__name__}) + "\n")
        failed = False
        try:
            train(run, args, trace, classic, rank, optimizer, scheduler)
        except Exception as exc:
            if args.die_rank is None:
                raise
            trace.write(json.dumps({"event": "error", "type": type(exc).__qualname__, "message": str(exc)[:300],
                                    "recoverable": is_recoverable(exc), "asked_recovery": len(asked),
                                    "step": run.step}) + "\n")
            failed = True
        if failed:
            # The exception's traceback holds train()'s frames, and with them the DDP wrapper, in reference
            # cycles (a frame holds the exception that holds its traceback) that only the cycle collector
            # frees: drop every reference and collect, so that the wrapper goes before the group.
            asked.clear()
            model = run = None  # the DDP wrapper before the group (see tests/worker_train.py)
            gc.collect()
            dist.destroy_process_group()
            return 0
        run.close()
        params = [v.hex() for t in inner.parameters() for v in t.detach().reshape(-1).tolist()]
        trace.write(json.dumps({"event": "end", "step": run.step, "params": params}) + "\n")
    if world > 1:
        model = run = None
        gc.collect()  # the DDP wrapper sits in reference cycles: collect it now, before the group goes
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
