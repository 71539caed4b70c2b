"""A small, deterministic training script driven by the tests.

It trains a tiny MLP with dropout on synthetic data whose items draw random
augmentations, and uses python, numpy and torch RNG in the loop, so every
piece of state a resume must carry influences the result.  Each rank writes
one JSON line per step (sample ids, learning rate, exact loss) and a final
line with digests of parameters, optimizer state and RNG streams.

``--fault POINT --fault-step S`` SIGKILLs the process at POINT during the
save at step S (first attempt only: a marker file records that it fired);
``--fault-signal STOP`` SIGSTOPs it there instead, and it carries on from
that point once continued (SIGCONT).  ``--crash-step S`` SIGKILLs it in the
middle of step S instead (after the backward, before the update).  ``--events PATH`` writes the Run's
events as JSON lines.  ``--fsdp`` shards the model with FSDP2
(``fully_shard``) instead of DDP; ``--mesh R,S`` makes it HSDP over R
replicas of S shards.  Digests of sharded state are of the full tensors, so
they compare across world sizes.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import itertools
import json
import os
import random
import signal
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

import resilient
from resilient.checkpoint import storage as ckpt_storage
from resilient.checkpoint import writer as ckpt_writer


class Noisy(torch.utils.data.Dataset):
    """Items are fixed features plus fresh torch-RNG noise (an 'augmentation')."""

    def __init__(self, n: int = 96, augment: float = 0.01) -> None:
        self.augment = augment
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(n, 8, generator=g)
        self.y = torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i] + self.augment * torch.randn(8), self.y[i]


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        if hasattr(t, "full_tensor"):  # a DTensor: every rank gathers the whole tensor (a collective)
            t = t.full_tensor()
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def state_digests(model, optimizer) -> dict:
    opt_tensors = [v for s in optimizer.state.values() for _, v in sorted(s.items()) if torch.is_tensor(v)]
    return {
        "params": digest(list(model.parameters())),
        "optimizer": digest(opt_tensors),
        "torch_rng": hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest(),
        "python_rng": hashlib.sha256(repr(random.getstate()).encode()).hexdigest(),
        "numpy_rng": hashlib.sha256(repr(np.random.get_state()).encode()).hexdigest(),
    }


def _s3():
    from resilient.checkpoint.s3 import S3Storage

    return S3Storage


_write_calls = itertools.count(1)

# point -> (owner of the function, its name, which calls to die in)
FAULT_POINTS = {
    "snapshot": (lambda: ckpt_writer, "take_snapshots", lambda *a: True),  # during the host copy
    # the second piece: the first one of a shard already reached the file
    "write": (lambda: ckpt_storage.os, "write", lambda *a: next(_write_calls) == 2),
    "before_manifest": (lambda: ckpt_storage.LocalStorage, "commit", lambda *a, **k: True),
    "before_rename": (lambda: ckpt_storage.os, "rename", lambda src, dst: ".staging" in str(src)),
    # the commit returned (published and durable), its outcome not yet shared nor retention run
    "after_commit": (lambda: ckpt_storage.LocalStorage, "commit", lambda *a, **k: True),
    "before_delete": (lambda: ckpt_storage.LocalStorage, "delete", lambda *a, **k: True),  # retention decided
    "retention": (lambda: ckpt_storage.shutil, "rmtree", lambda path, *a, **k: ".trash" in str(path)),
    "s3_upload": (_s3, "write_file", lambda self, staging, relpath, *a: relpath.startswith("rank")),
    "s3_before_manifest": (_s3, "commit", lambda *a, **k: True),
}


AFTER_CALL = {"after_commit"}  # points that fire once the call returned


def arm_fault(point: str, marker: str, signum: int = signal.SIGKILL) -> None:
    """Install a one-shot ``signum`` (SIGKILL or SIGSTOP) at ``point`` of the commit path."""
    if point not in FAULT_POINTS:
        raise SystemExit(f"unknown fault point {point}")
    owner_of, attr, fires = FAULT_POINTS[point]
    owner = owner_of()
    real = getattr(owner, attr)
    armed = [True]

    def fire():
        armed[0] = False
        open(marker, "w").close()
        os.kill(os.getpid(), signum)

    def wrapper(*args, **kwargs):
        if not (armed[0] and fires(*args, **kwargs)):
            return real(*args, **kwargs)
        if point in AFTER_CALL:
            result = real(*args, **kwargs)
            fire()
            return result
        fire()
        return real(*args, **kwargs)

    setattr(owner, attr, wrapper)


def slow_storage(method: str, seconds: float) -> None:
    """Every call of ``LocalStorage.<method>`` in this process takes ``seconds`` longer."""
    real = getattr(ckpt_storage.LocalStorage, method)

    def slow(self, *args, **kwargs):
        time.sleep(seconds)
        return real(self, *args, **kwargs)

    setattr(ckpt_storage.LocalStorage, method, slow)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", default=None, help="checkpoint location; omit for no checkpointing")
    p.add_argument("--endpoint-url", default=None)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--keep", type=int, default=2)
    p.add_argument("--trace", required=True)
    p.add_argument("--fault", default=None)
    p.add_argument("--fault-step", type=int, default=None)
    p.add_argument("--fault-rank", type=int, default=None, help="only this rank faults (default: all)")
    p.add_argument("--fault-signal", choices=["KILL", "STOP"], default="KILL")
    p.add_argument("--events", default=None, help="write the Run's events here (JSON lines)")
    p.add_argument("--sync", action="store_true", help="synchronous saves")
    p.add_argument("--elastic", action="store_true", help="allow resuming on a different number of ranks")
    p.add_argument("--fsdp", action="store_true", help="shard the model with FSDP2 instead of DDP")
    p.add_argument("--dropout", type=float, default=0.2)
    p.add_argument("--augment", type=float, default=0.01, help="scale of each item's random noise")
    p.add_argument("--micro", action="store_true", help="train on run.micro_batches() (the global batch kept)")
    p.add_argument("--mesh", default=None, help="with --fsdp: R,S for HSDP over R replicas of S shards")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds each step sleeps (slower runs)")
    p.add_argument("--when-busy", default="wait",
                   help="CheckpointConfig.when_busy; 'wait' by default: the tests that compare runs need a save "
                        "at every scheduled step whatever the load on the machine (tests/test_save_pacing.py "
                        "passes 'defer')")
    p.add_argument("--crash-step", type=int, default=None,
                   help="SIGKILL this process after the backward of step S, before its update (first attempt only)")
    p.add_argument("--crash-rank", type=int, default=None, help="only this rank crashes (default: all)")
    p.add_argument("--mtbf", type=float, default=None, help="CheckpointConfig.mtbf_s: the save interval is computed")
    p.add_argument("--slow-storage", nargs=3, action="append", default=[], metavar=("RANK", "METHOD", "SECONDS"),
                   help="on RANK, LocalStorage.METHOD sleeps SECONDS first (e.g. write_file: a slow disk)")
    args = p.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
        torch.set_num_threads(1)
    rank = dist.get_rank() if world > 1 else 0

    torch.manual_seed(1234)
    random.seed(99)
    np.random.seed(5)
    model: torch.nn.Module = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Dropout(args.dropout), torch.nn.Linear(32, 1)
    )
    if args.fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if args.mesh:
            shape = tuple(int(n) for n in args.mesh.split(","))
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
        else:
            mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + 0.1 * s))
    data = resilient.ElasticLoader(Noisy(augment=args.augment), batch_size=4, seed=11)
    ckpt = None
    if args.dir:
        ckpt = resilient.CheckpointConfig(
            dir=args.dir, every_steps=args.every, keep=args.keep, endpoint_url=args.endpoint_url,
            async_save=not args.sync, timeout_s=60, elastic=args.elastic, when_busy=args.when_busy,
            mtbf_s=args.mtbf,
        )
    for slow_rank, method, seconds in args.slow_storage:
        if int(slow_rank) == rank:
            slow_storage(method, float(seconds))
    events = resilient.EventLog(f"{args.events}.rank{rank}" if args.events else None)
    run = resilient.Run(model=model, optimizer=optimizer, scheduler=scheduler, data=data, checkpoint=ckpt,
                        events=events)

    marker = f"{args.trace}.fault-fired"
    trace = open(f"{args.trace}.rank{rank}", "a")
    start = {"event": "start", "restored_from": run.restored_from, "step": run.step, "world_size": world,
             "mtbf": os.environ.get("RESILIENT_MTBF"), "mtbf_source": os.environ.get("RESILIENT_MTBF_SOURCE")}
    if args.fsdp:  # what was restored, gathered to full tensors
        start |= {k: v for k, v in state_digests(model, optimizer).items() if k in ("params", "optimizer")}
    trace.write(json.dumps(start) + "\n")
    trace.flush()  # a fault may end the process at its first step (os._exit: nothing buffered is written)
    for step in run.steps(args.steps):
        faulty = args.fault and args.fault_rank in (None, rank)
        if faulty and step == args.fault_step - 1 and not os.path.exists(marker):  # save runs at the top of fault_step
            run.checkpoints.wait()  # the fault is for the next save, not one still in flight
            arm_fault(args.fault, marker, getattr(signal, f"SIG{args.fault_signal}"))
        if args.micro:  # the global batch kept at any world size: run.accumulation micro-batches per rank
            indices, total = [], 0.0
            for x, y in run.micro_batches():
                loss = torch.nn.functional.mse_loss(model(x), y) / run.accumulation
                loss.backward()
                indices += run.data.last_indices
                total += loss.item()
            loss = torch.tensor(total)
        else:
            x, y = next(run.data)
            noise = random.random() * 1e-3 + float(np.random.rand()) * 1e-3
            loss = torch.nn.functional.mse_loss(model(x), y) + noise
            loss.backward()
            indices = run.data.last_indices
        if args.step_sleep:
            time.sleep(args.step_sleep)
        crash_marker = f"{args.trace}.crash-fired"
        if step == args.crash_step and args.crash_rank in (None, rank) and not os.path.exists(crash_marker):
            open(crash_marker, "w").close()
            trace.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        run.report(loss=loss, tokens=x.shape[0] * 8)
        trace.write(json.dumps({
            "step": step, "indices": indices, "world_size": run.world_size, "lr": float(optimizer.param_groups[0]["lr"]).hex(),
            "loss": loss.item().hex(),
        }) + "\n")
        trace.flush()
    run.close()
    inner = model.module if world > 1 and not args.fsdp else model
    end = {"event": "end", "step": run.step, **state_digests(inner, optimizer)}
    if args.fsdp:  # the parameters themselves, gathered, to compare runs that differ by reduction order
        end["full_params"] = [v for p in model.parameters() for v in p.full_tensor().reshape(-1).tolist()]
    trace.write(json.dumps(end) + "\n")
    trace.close()
    if world > 1:
        # The DDP wrapper goes first: a gloo group whose last reference is in DDP's reducer is destroyed in the
        # reducer's destructor, which can deadlock or abort the process at exit
        # (docs/design/in-process-worker.md). The wrapper (and a sharded model's groups) sit in reference
        # cycles: collect them now, not at exit.
        model = run = None
        gc.collect()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
