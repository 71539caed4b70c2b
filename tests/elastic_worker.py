"""The script's side of in-process recovery, as a user writes it, for tests/test_agent_inproc.py.

No ``init_process_group``: ``Run(ddp=True)`` creates the group (and a spare
never joins one until it is promoted).  The step body is under
``run.attempt()`` and reads ``run.micro_batches()``; the model has dropout
and every sample draws a random augmentation, so the random streams matter.

Each rank appends one JSON line per completed attempt to
``<out>/trace.jsonl`` (``O_APPEND``, one write per line): the step, rank,
world size, worker id, accumulation, each micro-batch's sample indices and
unscaled loss as hex floats, the clock time.  Rank 0 writes ``<out>/final.json`` at the end:
every parameter and every optimizer state tensor as hex floats, the
scheduler's state and the counters.

Faults strike only in the worker named by ``--die-worker`` (its
``RESILIENT_WORKER_ID``), so a replacement at the same rank does not repeat
them: ``--die-how kill`` SIGKILLs it inside step ``--die-step``'s backward
(from a gradient hook, before its gradients are all-reduced), ``start``
SIGKILLs it at the top of that step (its peers are already in the
all-reduce), ``hang`` SIGSTOPs it inside the backward, ``raise`` raises a
``DistBackendError`` at the top of that step once (a network error: every
process lives), ``raise-late`` raises it once after the first micro-batch's
loss was counted in the ``state=`` object, ``in-step`` SIGKILLs it inside
``optimizer.step()`` between the two halves of ``--optimizer split`` (its
peers then fail inside theirs), ``after-step`` SIGKILLs it right after
``optimizer.step()`` (with ``--tail-collective`` its peers then fail in the
step's last collective, their update applied, the step unfinished).

``--optimizer split`` is an optimizer with a collective inside ``step()``,
as LAMB, Shampoo or ZeRO have: half the parameters updated, a statistic
all-reduced, the other half updated.  ``--ema`` passes a ``state=`` object
(an exponential average of the loss and a count of the losses it saw),
updated inside the attempt before the backward; ``final.json`` holds it.

``--mesh R,S`` (HSDP: R replicas of S shards) or ``--mesh N`` (pure FSDP)
shards the model with FSDP2 on a mesh from ``resilient.device_mesh`` (a
spare waits there for its promotion) instead of DDP; the kill then strikes
from a hook on the model's output gradient, and ``final.json`` holds the
tensors gathered to full.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from recovery_worker import Noisy  # this script's directory is on sys.path

import resilient

SEED = 0


class SplitStep(torch.optim.Optimizer):
    """Momentum SGD whose step updates the first half of the parameters, all-reduces a statistic of the
    gradients and scales the second half's update by it (a trust ratio, as LAMB has)."""

    def __init__(self, params, lr: float) -> None:  # type: ignore[no-untyped-def]
        super().__init__(params, {"lr": lr})
        self.between = None  # called between the halves: the fault

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[no-untyped-def, override]
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        lr, half = self.param_groups[0]["lr"], len(params) // 2
        for p in params[:half]:
            self._update(p, lr)
        if self.between is not None:
            self.between()
        stat = torch.stack([p.grad.norm() for p in params]).sum().reshape(1)
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(stat)
            stat /= torch.distributed.get_world_size()
        for p in params[half:]:
            self._update(p, lr / (1.0 + float(stat)))

    def _update(self, p: torch.Tensor, lr: float) -> None:
        state = self.state[p]
        if "momentum" not in state:
            state["momentum"] = torch.zeros_like(p)
        state["momentum"].mul_(0.9).add_(p.grad)
        p.add_(state["momentum"], alpha=-lr)


class LossAverage:
    """A ``state=`` object: an exponential average of the losses seen and their count."""

    def __init__(self) -> None:
        self.value, self.count = 0.0, 0

    def update(self, loss: float) -> None:
        self.value, self.count = 0.9 * self.value + 0.1 * loss, self.count + 1

    def state_dict(self) -> dict:  # type: ignore[type-arg]
        return {"value": self.value, "count": self.count}

    def load_state_dict(self, state: dict) -> None:  # type: ignore[type-arg]
        self.value, self.count = float(state["value"]), int(state["count"])


def hexes(t: torch.Tensor) -> list[str]:
    return [v.hex() for v in t.detach().double().reshape(-1).tolist()]


def wait_for_spares(count: int) -> None:
    """Block until the agent's event log shows ``count`` warm spares (so the fault meets a ready pool)."""
    wait_for_event('"kind": "spare_ready"', count)


def wait_for_event(text: str, count: int = 1) -> None:
    """Block until ``text`` occurs ``count`` times in the agent's event log (bounded)."""
    log = Path(os.environ["RESILIENT_RUN_DIR"]) / "events.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if log.read_text().count(text) >= count:
            return
        time.sleep(0.05)
    raise SystemExit(f"{text} did not occur {count} time(s) in {log} within 120 s")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--samples", type=int, default=48)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--die-worker", default=None)
    p.add_argument("--die-step", type=int, default=None)
    p.add_argument("--die-how", choices=["kill", "start", "hang", "raise", "raise-late", "in-step", "after-step",
                                                "after-hold"],
                   default="kill", help="after-hold: SIGKILL as the --hold-at wait ends (the grow just decided)")
    p.add_argument("--optimizer", choices=["adamw", "split"], default="adamw")
    p.add_argument("--ema", action="store_true", help="a state= object updated inside the attempt")
    p.add_argument("--own-group", choices=["script", "run"], default=None,
                   help="a process group of the script's own, used in every step: made by the script after Run() "
                   "(in-process recovery is then declined) or through Run(groups=fn)")
    p.add_argument("--barrier-at", type=int, default=None,
                   help="at this step, after the attempt, rank 0 sleeps --barrier-s seconds before a barrier")
    p.add_argument("--barrier-s", type=float, default=0.0)
    p.add_argument("--tail-collective", action="store_true",
                   help="all-reduce the loss after the update, inside the attempt (for logging, as scripts do)")
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--plain", action="store_true",
                   help="no dropout and no random augmentation: a shrunk run then differs from the full-size one "
                   "only by the order of the gradient sums (its micro-batches, and so its random draws, are "
                   "smaller than the full-size ranks' when the new world times the batch size does not divide "
                   "the global batch)")
    p.add_argument("--hold-at", type=int, default=None,
                   help="every rank waits at this step until the agent decided to grow (a boundary ahead of it)")
    p.add_argument("--stop-after", type=int, default=None,
                   help="leave the loop after this step, as a script that stops early (converged) does")
    p.add_argument("--spares-at-end", type=int, default=0,
                   help="rank 0 waits at the end until the agent logged this many spare_ready events")
    p.add_argument("--mesh", default=None, help="R,S: HSDP over R replicas of S shards; N: pure FSDP over N ranks")
    p.add_argument("--spares-ready", type=int, default=0,
                   help="the doomed worker first waits until the agent logged this many spare_ready events")
    args = p.parse_args()
    me = os.environ.get("RESILIENT_WORKER_ID", "")
    started_nice = os.getpriority(os.PRIO_PROCESS, 0)  # a spare's until it is promoted
    doomed = args.die_worker is not None and me in args.die_worker.split(",")

    torch.set_num_threads(1)
    torch.manual_seed(1234)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Dropout(0.0 if args.plain else 0.2), torch.nn.Linear(16, 1))
    sharded = args.mesh is not None
    if sharded:
        from torch.distributed.fsdp import fully_shard

        shape = tuple(int(n) for n in args.mesh.split(","))
        mesh = resilient.device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")[-len(shape):])
        for layer in (model[0], model[3]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    if args.optimizer == "split":
        optimizer = SplitStep(model.parameters(), lr=0.05)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    average = LossAverage()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + 0.1 * s))
    data = resilient.ElasticLoader(Noisy(args.samples, 0.0 if args.plain else 0.01), batch_size=args.batch, seed=11)
    ckpt = resilient.CheckpointConfig(dir=args.ckpt, every_steps=args.every, async_save=False, when_busy="wait",
                                      timeout_s=60)
    run = resilient.Run(model=model, optimizer=optimizer, scheduler=scheduler, data=data, checkpoint=ckpt,
                        ddp=not sharded, seed=SEED, state={"average": average} if args.ema else None,
                        groups=(lambda: {"mine": torch.distributed.new_group()}) if args.own_group == "run" else None)
    if args.own_group == "script":
        made = {"mine": torch.distributed.new_group()}
    fd = os.open(args.out / "trace.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    for step in run.steps(args.steps):
        if doomed and step == args.die_step and args.spares_ready:
            wait_for_spares(args.spares_ready)
        if args.hold_at == step:
            # Every rank waits, in a section of its own (a rank waiting in a collective for a held peer would
            # be a hung step), until the agent decided to grow.
            with run.section("hold"):
                wait_for_event('"action": "grow"')
            if doomed and step == args.die_step and args.die_how == "after-hold":
                os.kill(os.getpid(), signal.SIGKILL)
        with run.attempt():
            if doomed and step == args.die_step and args.die_how == "start":
                os.kill(os.getpid(), signal.SIGKILL)
            marker = args.out / "raised"
            strikes = doomed and step == args.die_step
            if strikes and args.die_how == "in-step" and isinstance(optimizer, SplitStep):
                optimizer.between = lambda: os.kill(os.getpid(), signal.SIGKILL)
            if strikes and args.die_how == "raise" and not marker.exists():
                marker.touch()  # once: the retried step goes through
                raise torch.distributed.DistBackendError("injected: Connection reset by peer (a network error)")
            indices, losses = [], []
            for k, (x, y) in enumerate(run.micro_batches()):
                out = run.model(x)
                loss = torch.nn.functional.mse_loss(out, y)
                if args.ema:
                    average.update(loss.item())
                if strikes and k == 0 and args.die_how == "raise-late" and not marker.exists():
                    marker.touch()  # once, after the state= object counted this loss
                    raise torch.distributed.DistBackendError("injected: Connection reset by peer (a network error)")
                if doomed and step == args.die_step and k == 0 and args.die_how in ("kill", "hang"):
                    sig = signal.SIGKILL if args.die_how == "kill" else signal.SIGSTOP
                    hooked = out if sharded else model[0].weight  # FSDP's sharded parameters get no autograd hook
                    hooked.register_hook(lambda grad, sig=sig: os.kill(os.getpid(), sig))
                (loss / run.accumulation).backward()
                indices.append(run.data.last_indices)
                losses.append(loss.item().hex())
            if args.own_group is not None:  # the script's own group in every step (a zero: the state stays)
                torch.distributed.all_reduce(torch.zeros(1), group=(run.groups if args.own_group == "run"
                                                                    else made)["mine"])
            optimizer.step()
            if strikes and args.die_how == "after-step":
                os.kill(os.getpid(), signal.SIGKILL)
            scheduler.step()
            if args.tail_collective:
                logged = loss.detach().clone()
                torch.distributed.all_reduce(logged)
            optimizer.zero_grad()
            run.report(loss=loss)
            line = {"step": step, "rank": run.rank, "world": run.world_size, "worker": me,
                    "accumulation": run.accumulation, "indices": indices, "losses": losses,
                    "started_nice": started_nice, "nice": os.getpriority(os.PRIO_PROCESS, 0), "time": time.time()}
            os.write(fd, (json.dumps(line) + "\n").encode())
        if args.barrier_at == step:  # longer than the recovery timeout: the script's collective timeout holds
            with run.section("eval"):
                if run.rank == 0:
                    time.sleep(args.barrier_s)
                torch.distributed.barrier()
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if args.stop_after == step:
            break
    if args.spares_at_end and run.rank == 0:
        wait_for_spares(args.spares_at_end)  # the refilled pool comes up warm while this run still holds it
    # Sharded tensors are gathered to full on every rank (a collective), before the Run lets the group go.
    full = (lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t)
    params = [hexes(full(t)) for t in model.parameters()]
    state = optimizer.state_dict()["state"]
    moments = {str(k): {n: hexes(full(v)) if isinstance(v, torch.Tensor) else v for n, v in s.items()}
               for k, s in sorted(state.items())}
    run.close()
    if run.rank == 0:
        final = {"step": run.step, "samples": run.samples, "world": run.world_size, "params": params,
                 "optimizer": moments,
                 "scheduler": scheduler.state_dict()["last_epoch"], "lr": scheduler.get_last_lr(),
                 "average": [average.value.hex(), average.count]}
        (args.out / "final.json").write_text(json.dumps(final))
    return 0


if __name__ == "__main__":
    sys.exit(main())
