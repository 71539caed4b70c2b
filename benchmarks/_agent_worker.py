"""The training script that agent_bench.py starts under both launchers (`resilient run` and torchrun).

Two gloo DDP ranks on CPU train a small MLP through ``resilient.Run`` with a checkpoint every
``--every`` steps and an ``ElasticLoader``, so under either launcher a restarted worker resumes from the
newest committed checkpoint (under torchrun the Run simply has no agent).  Each step is padded with a
sleep to ``--step-ms`` so that both launchers train at the same, known pace.

Every rank appends JSON lines with wall-clock times (``time.time()``; all on one host) to
``<trial-dir>/trace.rank<R>.jsonl``:

    proc_start (first line of the script, before importing torch), imported, pg_ready
    (init_process_group returned), ddp_ready (model wrapped in DDP), run_ready (restore done;
    ``restored_step`` = Run.step),
    step (after each completed update, ``step`` = its 0-based index), kill / sigstop (just before the
    fault), end (after Run.close()).

``--fault kill|sigstop --fault-step S --fault-rank R``: rank R SIGKILLs / SIGSTOPs itself at the top of
step S (before any work of it: the last completed step is S-1), only if ``<trial-dir>/fault.marker``
does not exist yet; the marker is created first, so the fault fires on the first attempt only.
"""

from __future__ import annotations

import gc
import time

T_PROC_START = time.time()  # before the imports below, which are most of a start

import argparse
import json
import os
import signal
import sys
from typing import Any


class Trace:
    """Line-buffered JSON-lines trace of one rank (flushed per record: it must survive SIGKILL)."""

    def __init__(self, path: str, rank: int, attempt: int) -> None:
        self._f = open(path, "a", encoding="utf-8")  # noqa: SIM115  open for the life of the process
        self._base = {"rank": rank, "attempt": attempt, "pid": os.getpid()}

    def rec(self, ev: str, t: float | None = None, **fields: Any) -> None:
        self._f.write(json.dumps({"ev": ev, "t": time.time() if t is None else t, **self._base, **fields}) + "\n")
        self._f.flush()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--trial-dir", required=True, help="traces, checkpoints and the fault marker go here")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    p.add_argument("--step-ms", type=float, default=45.0, help="pad each step with a sleep to this length")
    p.add_argument("--fault", choices=["none", "kill", "sigstop"], default="none")
    p.add_argument("--fault-step", type=int, default=37)
    p.add_argument("--fault-rank", type=int, default=1)
    args = p.parse_args()

    rank = int(os.environ["RANK"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # both launchers set it
    trace = Trace(os.path.join(args.trial_dir, f"trace.rank{rank}.jsonl"), rank, attempt)
    trace.rec("proc_start", t=T_PROC_START)

    import torch
    import torch.distributed as dist

    import resilient

    trace.rec("imported")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    trace.rec("pg_ready", world_size=dist.get_world_size())

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    ddp = torch.nn.parallel.DistributedDataParallel(model)  # its first construction imports a lot (~2-4 s here)
    trace.rec("ddp_ready")
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    dataset = torch.utils.data.TensorDataset(torch.randn(1024, 64, generator=g), torch.randn(1024, 64, generator=g))
    data = resilient.ElasticLoader(dataset, batch_size=32, seed=2)
    run = resilient.Run(
        model=ddp, optimizer=optimizer, data=data,
        checkpoint=resilient.CheckpointConfig(dir=os.path.join(args.trial_dir, "ckpt"), every_steps=args.every,
                                              keep=3),
    )
    trace.rec("run_ready", restored_step=run.step, restored_from=run.restored_from)

    marker = os.path.join(args.trial_dir, "fault.marker")
    pad_s = args.step_ms / 1000.0
    for step in run.steps(args.steps):
        t0 = time.perf_counter()
        if args.fault != "none" and rank == args.fault_rank and step == args.fault_step and not os.path.exists(marker):
            open(marker, "w").close()
            trace.rec(args.fault, step=step)
            os.kill(os.getpid(), signal.SIGKILL if args.fault == "kill" else signal.SIGSTOP)
        x, y = next(data)  # the Run's loader (run.data), restored with it
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        run.report(loss=loss)
        left = pad_s - (time.perf_counter() - t0)
        if left > 0:
            time.sleep(left)
        trace.rec("step", step=step)
    run.close()
    trace.rec("end", step=run.step)
    ddp = run = None  # the wrapper before the group (see examples/train_gpt.py)
    gc.collect()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
