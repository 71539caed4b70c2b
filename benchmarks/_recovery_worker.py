"""The training script that recovery_bench.py starts under `resilient run` (spare, shrink, restart) and torchrun.

The workload of agent_bench.py (two gloo ranks on CPU, an MLP 64-256-64, steps padded by a sleep to
``--step-ms``, a checkpoint every ``--every`` steps) written in the attempt style of "Recovery without
restarting": ``Run(ddp=True)`` creates the process group and wraps the model, ``with run.attempt():``
around the step body, ``for x, y in run.micro_batches():`` and ``loss / run.accumulation``.  The same
script runs unchanged under every launcher: under torchrun and a plain restart ``attempt()`` passes
errors through and recovery is by restart; with a spare or ``MIN:MAX`` the agent recovers in process.
``--style classic`` is the script as most users have it: it creates the process group and wraps the model in
DDP itself, ``Run(model=ddp_model, ...)`` owns only checkpoints and the loader, and there is no
``run.attempt()``: every launcher recovers it by a restart.

Every process (rank, spare, restarted rank) appends JSON lines with wall-clock times (``time.time()``,
all on one host) to ``<trial-dir>/trace.<pid>.jsonl``:

    proc_start (first line, before importing torch), imported, run_ready (Run() returned: restored, or
    for a spare promoted; ``restored_step`` = run.step), step (after each completed update: ``step``,
    ``t0`` = start of its last attempt, ``rank`` and ``world`` at that time), kill (just before the
    fault), end (after run.close()).  Code after ``with run.attempt():`` runs once per attempt, so a
    step is recorded only when its attempt completed.

and gives the Run an ``EventLog`` at ``<trial-dir>/events.<pid>.jsonl`` (``attempt_retried``,
``group_rejoined`` with the worker's own timing of its recovery).

``--fault kill --fault-step S --fault-rank R``: rank R SIGKILLs itself at step S, at the top of its
attempt (``--fault-at top``) or inside its backward from a gradient hook (``backward``), once per trial
(``<trial-dir>/fault.marker`` is created first) and, under an agent that names its workers, only in
its first process (``w1`` for rank 1: a promoted spare must not repeat it).  ``--fault-rank -1``: every
rank does so at the same step (one marker per rank), so no survivor is left and the run restarts.  ``--wait-spare S``: before the fault, wait (at most
S seconds) until the agent's events.jsonl (``RESILIENT_RUN_DIR``) shows a ``spare_ready`` event, so that
the fault meets a warm spare.
"""

from __future__ import annotations

import time

T_PROC_START = time.time()  # before the imports below, which are most of a start

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

DOOMED_WORKER = "w1"  # the agent's id of rank 1's first process (w<n> for ranks, s<n> for spares)


class Trace:
    """Line-buffered JSON-lines trace of one process (flushed per record: it must survive SIGKILL)."""

    def __init__(self, path: Path) -> None:
        self._f = open(path, "a", encoding="utf-8")  # noqa: SIM115  open for the life of the process
        self.base: dict[str, Any] = {"pid": os.getpid(), "worker": os.environ.get("RESILIENT_WORKER_ID"),
                                     "role": os.environ.get("RESILIENT_ROLE"),
                                     "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}  # fmt: skip

    def rec(self, ev: str, t: float | None = None, **fields: Any) -> None:
        self._f.write(json.dumps({"ev": ev, "t": time.time() if t is None else t, **self.base, **fields}) + "\n")
        self._f.flush()


def wait_for_spare(bound_s: float) -> float:
    """Block until the agent logged a ``spare_ready`` event; return the seconds waited."""
    log = Path(os.environ["RESILIENT_RUN_DIR"]) / "events.jsonl"
    start = time.monotonic()
    while time.monotonic() - start < bound_s:
        if log.exists() and '"kind": "spare_ready"' in log.read_text(errors="replace"):
            return time.monotonic() - start
        time.sleep(0.02)
    raise SystemExit(f"no spare_ready event in {log} within {bound_s:.0f} s: the spare never got warm")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--trial-dir", required=True, type=Path, help="traces, checkpoints and the fault marker go here")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    p.add_argument("--step-ms", type=float, default=45.0, help="pad each step with a sleep to this length")
    p.add_argument("--fault", choices=["none", "kill"], default="none")
    p.add_argument("--fault-at", choices=["top", "backward"], default="top")
    p.add_argument("--fault-step", type=int, default=37)
    p.add_argument("--fault-rank", type=int, default=1, help="the rank that dies; -1: every rank")
    p.add_argument("--style", choices=["attempt", "classic"], default="attempt",
                   help="attempt: Run(ddp=True) and run.attempt(); classic: the script wraps DDP itself, no attempt")
    p.add_argument("--wait-spare", type=float, default=0.0, metavar="S",
                   help="before the fault, wait at most S s for the agent's spare_ready event (0: do not wait)")
    args = p.parse_args()

    trace = Trace(args.trial_dir / f"trace.{os.getpid()}.jsonl")
    trace.rec("proc_start", t=T_PROC_START)

    import torch

    import resilient

    trace.rec("imported")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    dataset = torch.utils.data.TensorDataset(torch.randn(1024, 64, generator=g), torch.randn(1024, 64, generator=g))
    data = resilient.ElasticLoader(dataset, batch_size=32, seed=2)
    classic = args.style == "classic"
    module = model
    if classic and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        torch.distributed.init_process_group("gloo")
        model = torch.nn.parallel.DistributedDataParallel(model)
    run = resilient.Run(
        model=model, optimizer=optimizer, data=data, ddp=not classic,
        checkpoint=resilient.CheckpointConfig(dir=os.fspath(args.trial_dir / "ckpt"), every_steps=args.every, keep=3),
        events=resilient.EventLog(args.trial_dir / f"events.{os.getpid()}.jsonl"),
    )  # fmt: skip
    trace.rec("run_ready", restored_step=run.step, restored_from=run.restored_from, rank=run.rank,
              world=run.world_size)

    every_rank = args.fault_rank == -1
    marker = args.trial_dir / (f"fault.marker.{run.rank}" if every_rank else "fault.marker")
    worker = os.environ.get("RESILIENT_WORKER_ID")
    first = f"w{run.rank}" if every_rank else DOOMED_WORKER  # the agent's id of the rank's first process
    doomed = args.fault == "kill" and (every_rank or run.rank == args.fault_rank) and worker in (None, first)
    pad_s = args.step_ms / 1000.0

    def die(where: str) -> None:
        trace.rec("kill", step=args.fault_step, rank=run.rank, world=run.world_size, at=where)
        os.kill(os.getpid(), signal.SIGKILL)

    for step in run.steps(args.steps):
        if classic:
            top = time.perf_counter()
            if doomed and step == args.fault_step and not marker.exists():
                marker.touch()
                die("top")
            t0 = time.time()
            x, y = next(run.data)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            run.report(loss=loss)
            left = pad_s - (time.perf_counter() - top)
            if left > 0:
                time.sleep(left)
            trace.rec("step", step=step, t0=t0, rank=run.rank, world=run.world_size)
            continue
        top = time.perf_counter()
        strike = doomed and step == args.fault_step and not marker.exists()
        if strike:
            waited = wait_for_spare(args.wait_spare) if args.wait_spare > 0 else None
            trace.rec("fault_armed", step=step, spare_wait_s=waited)
            marker.touch()
        t0, completed = time.time(), False
        with run.attempt():
            t0 = time.time()  # the start of this step's last attempt: a step begun after the kill is re-done
            if strike and args.fault_at == "top":
                die("top")
            for x, y in run.micro_batches():
                loss = torch.nn.functional.mse_loss(run.model(x), y)
                if strike and args.fault_at == "backward":
                    module[0].weight.register_hook(lambda grad: die("backward"))  # before its all-reduce
                (loss / run.accumulation).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            run.report(loss=loss)
            completed = True
        if not completed:  # the attempt failed and was recovered: run.steps() yields the same step again
            continue
        left = pad_s - (time.perf_counter() - top)
        if left > 0:
            time.sleep(left)
        trace.rec("step", step=step, t0=t0, rank=run.rank, world=run.world_size)
    run.close()
    trace.rec("end", step=run.step, rank=run.rank, world=run.world_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
