"""The bundled reference workload of the drills: a small, deterministic DDP training run, as a user writes one.

``python -m resilient.chaos.workload --steps N --out DIR --ckpt DIR`` under
``resilient run``: a two-layer MLP with dropout on a seeded synthetic
regression set, AdamW and a learning-rate schedule, data from
``ElasticLoader``, every step under ``run.attempt()`` (so the in-process
rungs can recover it), a checkpoint every ``--every`` steps.  With
``--own-group`` it also makes a process group of its own after ``Run()``
and uses it in every step (an all-reduce of a zero: the state is not
touched), as scripts with their own groups do: in-process recovery is then
declined and every failure restarts the ranks from the newest checkpoint.

Each rank appends one line per completed step to ``DIR/trace.jsonl`` (the
step, the rank, its worker id, the world size, the clock time: a step done
twice is a step re-done), and rank 0 writes ``DIR/final.json`` at the end: the SHA-256 of
every parameter's and optimizer state tensor's bytes, the step and the
samples seen.  Two runs are bitwise equal when their digests are.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from ..core.tensors import tensor_bytes


class Synthetic:
    """``n`` samples of ``y = w . x + noise`` from a fixed seed; item ``i`` is the same on every rank and run."""

    def __init__(self, n: int, dim: int = 8) -> None:
        import torch

        g = torch.Generator().manual_seed(20240)
        self.x = torch.randn(n, dim, generator=g)
        w = torch.randn(dim, 1, generator=g)
        self.y = self.x @ w + 0.05 * torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[Any, Any]:
        return self.x[i], self.y[i]


def digest(tensors: list[Any]) -> str:
    """SHA-256 over the raw bytes of ``tensors``, in order."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(tensor_bytes(t))
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--ckpt", required=True, help="a checkpoint directory, or s3://bucket/prefix")
    p.add_argument("--endpoint-url", default=None, help="the S3-compatible endpoint of an s3:// --ckpt")
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds added to each step")
    p.add_argument("--own-group", action="store_true",
                   help="a process group of the script's own, used in every step: failures restart")
    args = p.parse_args(argv)

    import torch

    import resilient

    torch.set_num_threads(1)
    torch.manual_seed(1234)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + 0.01 * s))
    data = resilient.ElasticLoader(Synthetic(args.samples), batch_size=args.batch, seed=11)
    ckpt = resilient.CheckpointConfig(dir=args.ckpt, endpoint_url=args.endpoint_url, every_steps=args.every,
                                      async_save=False, when_busy="wait",
                                      timeout_s=60)
    run = resilient.Run(model=model, optimizer=optimizer, scheduler=scheduler, data=data, checkpoint=ckpt, ddp=True,
                        seed=0)
    own = torch.distributed.new_group() if args.own_group else None
    args.out.mkdir(parents=True, exist_ok=True)
    worker = os.environ.get("RESILIENT_WORKER_ID", "")
    fd = os.open(args.out / "trace.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    for step in run.steps(args.steps):
        with run.attempt():
            for x, y in run.micro_batches():
                loss = torch.nn.functional.mse_loss(run.model(x), y)
                (loss / run.accumulation).backward()
            if own is not None:
                torch.distributed.all_reduce(torch.zeros(1), group=own)
            if args.step_sleep:
                time.sleep(args.step_sleep)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            run.report(loss=loss)
            line = {"step": step, "rank": run.rank, "world": run.world_size, "worker": worker, "time": time.time()}
            os.write(fd, (json.dumps(line) + "\n").encode())
    params = list(model.parameters())
    state = [v for _, s in sorted(optimizer.state_dict()["state"].items()) for _, v in sorted(s.items())
             if isinstance(v, torch.Tensor)]
    run.close()
    if run.rank == 0:
        final = {"step": run.step, "samples": run.samples, "world": run.world_size,
                 "params": digest(params), "optimizer": digest(state)}
        (args.out / "final.json").write_text(json.dumps(final))
    return 0


if __name__ == "__main__":
    sys.exit(main())
