"""One rank of a training loop fed by ElasticLoader(num_workers=2), under resilient.Run, in a real process.

Started by tests/test_loader_workers.py once per rank (gloo over a file store:
no port), it trains ``--steps`` steps from the newest checkpoint in
``--ckpt`` and writes the batches it received to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist

import resilient


class Samples:
    """A map-style dataset whose sample is derived from its index (and names the process that read it)."""

    def __init__(self, n: int, *, delay: float = 0.0, fail_at: int | None = None) -> None:
        self.n, self.delay, self.fail_at = n, delay, fail_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        if self.delay:
            time.sleep(self.delay)
        if i == self.fail_at:
            raise ValueError(f"sample {i} is corrupt")
        return {"x": torch.arange(3.0) + 10 * i, "i": i, "pid": os.getpid()}


N, BATCH, SEED = 37, 4, 7


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--init", required=True, help="file store path for gloo")
    p.add_argument("--ckpt", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.world > 1:
        dist.init_process_group("gloo", init_method=f"file://{args.init}", rank=args.rank, world_size=args.world)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = resilient.ElasticLoader(Samples(N), batch_size=BATCH, seed=SEED, num_workers=2, prefetch_factor=2,
                                   multiprocessing_context="fork")
    run = resilient.Run(model=model, optimizer=optimizer, data=data, agent=None,
                        checkpoint=resilient.CheckpointConfig(dir=args.ckpt, every_steps=None, elastic=True))
    records = []
    for step in run.steps(args.steps):
        batch = next(run.data)
        loss = model(batch["x"]).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        records.append({"step": step, "indices": list(data.last_indices), "x": batch["x"].tolist(),
                        "pids": sorted(set(batch["pid"].tolist()))})
    run.close()
    out = {"records": records, "consumed": data.consumed, "restored_from": run.restored_from,
           "rank": run.rank, "world_size": run.world_size, "pid": os.getpid()}
    with open(args.out, "w") as f:
        json.dump(out, f)
    data.close()
    if args.world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
