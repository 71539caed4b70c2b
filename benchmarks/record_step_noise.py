"""Record this machine's real step-time noise by section, for the straggler tests and benchmark.

Three ranks train an MLP with gloo DDP on CPU for ``--steps`` healthy steps
(no fault), each step's forward and backward followed by ``--device-ms`` of
waiting, as a host waits for its accelerator (the CPUs are then not all
busy, as on a GPU machine; three compute-bound ranks on two cores would
measure the kernel's scheduler instead, ``--device-ms 0`` records that),
each timing its steps with the Run's own timer
(:class:`resilient.run.timing.StepTimer`: the same communication hook,
optimizer hooks and section switches a Run uses under the agent), and the
window reports are written with their provenance to
``tests/data/step_noise.json``.  The synthetic traces of
``tests/test_straggler_traces.py`` and ``benchmarks/straggler_bench.py``
take their noise from it (blocks of real windows, slowdowns added on top).

    python benchmarks/record_step_noise.py --steps 4000   # ~2 minutes
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _provenance import commit, load_now, uncommitted_code_changes  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "data" / "step_noise.json"


def _rank(rank: int, world: int, port: int, steps: int, device_s: float, width: int, queue: mp.SimpleQueue) -> None:
    from resilient.run.timing import StepTimer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                                torch.nn.ReLU(), torch.nn.Linear(width, 256))
    reports: list[dict] = []
    timer = StepTimer(reports.append)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(None, timer.comm_hook(None))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    opt.register_step_pre_hook(timer.optimizer_pre)
    opt.register_step_post_hook(timer.optimizer_post)
    gen = torch.Generator().manual_seed(rank)
    timer.begin()
    for step in range(steps):
        timer.switch("data")
        x = torch.randn(64, 256, generator=gen)  # the "loader": a fresh batch each step
        y = x.roll(1, dims=1)
        timer.switch("step")
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        if device_s:
            time.sleep(device_s)  # the host waits for its device
        loss.backward()
        opt.step()
        timer.end_step(step)
    queue.put((rank, reports))
    dist.barrier()
    del ddp, model, opt
    gc.collect()  # reference cycles holding the group go before it is destroyed
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--world", type=int, default=3)
    p.add_argument("--device-ms", type=float, default=15.0, help="per step, the host waits this long for its device")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    before, started = load_now(), time.time()
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = 29000 + os.getpid() % 2000
    procs = [ctx.Process(target=_rank, args=(r, args.world, port, args.steps, args.device_ms / 1e3, args.width, queue))
             for r in range(args.world)]
    for proc in procs:
        proc.start()
    by_rank = dict(queue.get() for _ in procs)
    for proc in procs:
        proc.join(timeout=60)
        if proc.exitcode != 0:
            raise SystemExit(f"a rank exited with {proc.exitcode}")
    windows = [[by_rank[r][i] for r in range(args.world)] for i in range(min(len(v) for v in by_rank.values()))]
    record = {
        "what": "healthy step time by section, one report per rank per window of 5 steps (resilient.run.timing)",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "commit": commit(), "uncommitted": uncommitted_code_changes(),
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release(), "torch": torch.__version__},
        "workload": f"{args.world} ranks, gloo DDP on CPU, MLP 256-{args.width}-{args.width}-256, batch 64, AdamW, "
                    f"{args.device_ms:g} ms of device wait per step, {args.steps} steps, OMP_NUM_THREADS=1",
        "load": {"before": before, "after": load_now()}, "seconds": round(time.time() - started, 1),
        "windows": windows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, separators=(",", ":")) + "\n")
    steps = [w["step"] for ws in windows for w in ws]
    print(f"{len(windows)} windows x {args.world} ranks -> {args.out}; median step "
          f"{sorted(steps)[len(steps) // 2] * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
