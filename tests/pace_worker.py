"""A steady training loop for the straggler and slowdown tests, under ``resilient run``.

An MLP under ``Run(ddp=True)`` fed by an ``ElasticLoader`` trains
``--steps`` steps of about 30 ms (15 of them waiting, as a host waits for its
accelerator: three compute-bound ranks on two cores would measure the
kernel's scheduler), the workload of ``benchmarks/record_step_noise.py``; the tests slow a rank or the
input path with a ``slow`` fault plan and read what the agent made of it.
Each rank writes its final parameter digest to ``--out`` (rank suffix), so a
test can check that timing changed nothing; ``--perturb RANK,STEP`` changes
one rank's copy of a weight, for the replica audit; ``--ckpt DIR`` commits a
checkpoint every ``--every`` steps, so a restart resumes.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import time

import torch

import resilient


class SlowReads(torch.utils.data.Dataset):
    """A dataset whose every read takes ``delay_s`` (storage or decoding that cannot keep up)."""

    def __init__(self, samples: torch.Tensor, delay_s: float) -> None:
        self.samples, self.delay_s = samples, delay_s

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(self.delay_s)
        return self.samples[i]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--device-ms", type=float, default=15.0,
                   help="per step, wait this long after the forward, as a host waits for its accelerator")
    p.add_argument("--audit-every", type=int, default=100)
    p.add_argument("--data-ms", type=float, default=0.0,
                   help="reading a batch takes this long (a slow input path: each sample sleeps its share)")
    p.add_argument("--ckpt", default=None, help="commit a checkpoint here every --every steps (a restart resumes)")
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--wrap-self", action="store_true",
                   help="as most scripts do: init_process_group and DistributedDataParallel by the script, Run(model=ddp)")
    p.add_argument("--fsdp", action="store_true",
                   help="shard the MLP with FSDP2 (fully_shard) on a mesh of every rank instead of DDP")
    p.add_argument("--own-hook", action="store_true",
                   help="with --wrap-self: register a DDP communication hook of the script's after resilient.Run()")
    p.add_argument("--perturb", default=None, metavar="RANK,STEP",
                   help="add 1e-3 to the first weight of RANK at STEP, on that rank only (for the replica audit)")
    args = p.parse_args()
    torch.manual_seed(0)
    w = args.width
    model = torch.nn.Sequential(torch.nn.Linear(64, w), torch.nn.ReLU(), torch.nn.Linear(w, w), torch.nn.ReLU(),
                                torch.nn.Linear(w, 64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    samples = torch.randn(4096, 64, generator=torch.Generator().manual_seed(1))
    data = resilient.ElasticLoader(SlowReads(samples, args.data_ms / 1e3 / 32) if args.data_ms else samples,
                                   batch_size=32, seed=3)
    checkpoint = None if args.ckpt is None else resilient.CheckpointConfig(dir=args.ckpt, every_steps=args.every,
                                                                          elastic=True)
    own_hook_calls = [0]
    if args.fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        torch.distributed.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        for layer in (model[0], model[2], model[4]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # over the sharded parameters
        run = resilient.Run(model=model, optimizer=optimizer, data=data, checkpoint=checkpoint)
    elif args.wrap_self:
        torch.distributed.init_process_group("gloo")
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
        run = resilient.Run(model=wrapped, optimizer=optimizer, data=data, audit_every=args.audit_every,
                            checkpoint=checkpoint)
        if args.own_hook:
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            def counted(state, bucket):
                own_hook_calls[0] += 1
                return allreduce_hook(state, bucket)

            wrapped.register_comm_hook(None, counted)
    else:
        run = resilient.Run(model=model, optimizer=optimizer, data=data, ddp=True, audit_every=args.audit_every,
                            checkpoint=checkpoint)
    perturb = tuple(int(x) for x in args.perturb.split(",")) if args.perturb else None
    for step in run.steps(args.steps):
        if perturb == (run.rank, step):
            with torch.no_grad():
                model[0].weight.add_(1e-3)  # a replica drifts: only this rank's copy changes
        batch = next(run.data)
        loss = torch.nn.functional.mse_loss(run.model(batch), batch.roll(1, dims=1))
        time.sleep(args.device_ms / 1e3)  # the CPUs are not all busy, as on a GPU machine (see record_step_noise.py)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        run.report(loss=loss)
    h = hashlib.sha256()
    for t in model.parameters():
        full = t.full_tensor() if hasattr(t, "full_tensor") else t  # a sharded parameter: all of it, on every rank
        h.update(full.detach().numpy().tobytes())
    with open(f"{args.out}.{run.rank}", "w") as f:
        json.dump({"rank": run.rank, "params": h.hexdigest(), "step": run.step, "own_hook_calls": own_hook_calls[0]}, f)
    run.close()
    gc.collect()  # reference cycles holding the group go before it is destroyed
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
