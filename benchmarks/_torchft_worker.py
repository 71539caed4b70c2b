"""One torchft replica group (one rank) of recovery_bench.py's `torchft` mode.

The workload of _recovery_worker.py (an MLP 64-256-64, batches of 32 of the same random dataset, AdamW,
steps padded by a sleep to ``--step-ms``) trained the way torchft's own ``train_ddp.py`` does it: a
``ProcessGroupGloo`` that the ``Manager`` reconfigures on each quorum, torchft's
``DistributedDataParallel`` (gradients all-reduced across replica groups through the Manager) and
``Optimizer`` wrapper (``zero_grad()`` starts the step's quorum, ``step()`` applies the update only if
every participant's all-reduce succeeded: ``should_commit``).  Each replica group is one process with its
own TCPStore (port 0); the lighthouse runs in its own process (recovery_bench.py starts it).  With
``min_replica_size=1`` a survivor continues alone when the other group dies; there is no checkpoint
(torchft heals a joining replica from a live peer) and the dead group is not restarted.

Trace (``<trial-dir>/trace.<pid>.jsonl``, wall clocks): proc_start, imported, ready (Manager and wrappers
built), step (a committed step: ``step`` = its index, ``t0`` = start of the attempt, ``participants`` =
replica groups in its quorum), uncommitted (an attempt that ``should_commit`` refused), kill, end.
Replica ``--fault-replica`` SIGKILLs itself at the top of step ``--fault-step``.
"""

from __future__ import annotations

import time

T_PROC_START = time.time()

import argparse
import json
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--trial-dir", required=True, type=Path)
    p.add_argument("--replica", type=int, required=True)
    p.add_argument("--lighthouse", required=True, help="the lighthouse's address, http://host:port")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--step-ms", type=float, default=45.0)
    p.add_argument("--fault", choices=["none", "kill"], default="none")
    p.add_argument("--fault-step", type=int, default=37)
    p.add_argument("--fault-replica", type=int, default=1)
    p.add_argument("--pg-timeout-s", type=float, default=5.0, help="ProcessGroupGloo timeout (train_ddp.py: 5 s)")
    p.add_argument("--timeout-s", type=float, default=30.0, help="Manager timeout (train_ddp.py: 30 s)")
    p.add_argument("--quorum-timeout-s", type=float, default=60.0, help="Manager quorum_timeout (default 60 s)")
    p.add_argument("--heartbeat-ms", type=float, default=100.0, help="Manager heartbeat_interval (default 100 ms)")
    args = p.parse_args()

    f = open(args.trial_dir / f"trace.{os.getpid()}.jsonl", "a", encoding="utf-8")  # noqa: SIM115

    def rec(ev: str, t: float | None = None, **fields: Any) -> None:
        base = {"pid": os.getpid(), "replica": args.replica, "rank": args.replica}
        f.write(json.dumps({"ev": ev, "t": time.time() if t is None else t, **base, **fields}) + "\n")
        f.flush()

    rec("proc_start", t=T_PROC_START)
    import torch
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    rec("imported")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    xs, ys = torch.randn(1024, 64, generator=g), torch.randn(1024, 64, generator=g)
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # this group's

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=args.pg_timeout_s)), min_replica_size=1,
        load_state_dict=load_state_dict, state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        replica_id=f"bench_{args.replica}", timeout=timedelta(seconds=args.timeout_s),
        quorum_timeout=timedelta(seconds=args.quorum_timeout_s), heartbeat_interval=timedelta(milliseconds=args.heartbeat_ms),
        store_addr="127.0.0.1", store_port=store.port, rank=0, world_size=1, lighthouse_addr=args.lighthouse,
        hostname="127.0.0.1",
    )  # fmt: skip
    ddp = DistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, inner)
    rec("ready")

    pad_s, batches = args.step_ms / 1000.0, len(xs) // 32
    while (step := manager.current_step()) < args.steps:
        top, t0 = time.perf_counter(), time.time()
        if args.fault == "kill" and args.replica == args.fault_replica and step == args.fault_step:
            rec("kill", step=step)
            os.kill(os.getpid(), signal.SIGKILL)
        b = (step * 2 + args.replica) % batches  # each group its own batch of the step, as two DDP ranks
        x, y = xs[b * 32:(b + 1) * 32], ys[b * 32:(b + 1) * 32]
        optimizer.zero_grad()  # starts the quorum of this step
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        optimizer.step()  # applies the update only if every participant's all-reduce succeeded
        if manager.current_step() <= step:
            rec("uncommitted", step=step, t0=t0, error=str(manager.errored())[:300])
            continue
        left = pad_s - (time.perf_counter() - top)
        if left > 0:
            time.sleep(left)
        rec("step", step=step, t0=t0, participants=manager.num_participants(), world=manager.num_participants())
    manager.shutdown(wait=False)
    rec("end", step=manager.current_step())
    return 0


if __name__ == "__main__":
    sys.exit(main())
