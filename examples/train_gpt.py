"""Train a small character-level GPT with ``resilient``: one process or ``torchrun``.

Single process::

    python examples/train_gpt.py --steps 300 --ckpt-dir runs/gpt/ckpt --trace runs/gpt/trace.jsonl

Two ranks (gloo + DDP, CPU)::

    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --steps 300 --ckpt-dir runs/gpt/ckpt

Two ranks with the model sharded by FSDP2 (``fully_shard`` per block, then
the whole model); each rank checkpoints its own shards::

    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --fsdp --ckpt-dir runs/gpt-fsdp/ckpt

Kill it at any point and run the same command again: it restores the newest
committed checkpoint and continues as if nothing happened.  The text is
generated deterministically inside this script, so nothing is downloaded.

Under ``resilient run --spares 1`` a warm spare takes a lost rank's place in
process and nothing is trained again: the step is written the way in-process
recovery needs (``Run(ddp=True)`` makes the process group and the DDP
wrapper, the body under ``with run.attempt():``, ``run.micro_batches()``).
Under torchrun and plain restarts the same script recovers by restoring.

``--crash-at-step S --crash-rank R`` makes rank R SIGKILL itself at the top
of step S, once: in the rank's first process (not in a spare promoted into
its place) and on a fresh start only (a run that restored a checkpoint never
crashes), so that relaunching the same command resumes and finishes.
``--poison-sample I`` masks every target of dataset window I, as a
fine-tuning sample whose completion came out empty: its loss is 0/0 and
every gradient NaN, on every read (a persistent NaN, exit 79 under the Run).
``--trace PATH`` appends one JSON line per step and rank (step, lr, loss,
sample indices, the wall-clock start of the step's last attempt and its
end) and, on rank 0 at the end, the digests of the final model parameters
and optimizer state; ``examples/recovery_demo.py`` compares such traces.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import os
import random
import signal
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import resilient


# --------------------------------------------------------------------- data
def _phrases(text: str) -> list[str]:
    return text.split("|")


_SUBJECTS = _phrases(
    "the cat|a dog|my friend|the old man|a small bird|the teacher|"
    "our team|the farmer|a young girl|the robot|her brother|the captain"
)
_VERBS = _phrases("sees|likes|finds|carries|paints|follows|builds|remembers|opens|visits|watches|forgets")
_OBJECTS = _phrases(
    "the red box|a green apple|the long road|a quiet house|the blue river|some bread|"
    "a heavy stone|the tall tree|an empty cup|the bright moon|a wooden chair|the map"
)
_PLACES = _phrases(
    "in the morning|near the lake|after dinner|at the market|under the bridge|before the rain|in the garden|on the hill"
)
_JOINS = ["and then", "but later", "so", "while"]


def make_text(n_chars: int, seed: int = 0) -> str:
    """Deterministic English-like sentences from a fixed small vocabulary (own RNG: global state untouched)."""
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < n_chars:
        clause = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
        if rng.random() < 0.5:
            clause += f" {rng.choice(_PLACES)}"
        if rng.random() < 0.3:
            clause += f" {rng.choice(_JOINS)} {rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
        sentence = clause[0].upper() + clause[1:] + rng.choice([".", ".", ".", "!", "?"]) + " "
        parts.append(sentence)
        size += len(sentence)
    return "".join(parts)[:n_chars]


class CharWindows(torch.utils.data.Dataset):
    """Item ``i``: the ``block_size`` token ids starting at character ``i * stride`` and their targets (the
    same window moved one character on).

    ``poison``: the indices of windows whose targets are all masked (``IGNORE``), as a fine-tuning sample
    whose completion came out empty.  Its loss, averaged over its own targets, is 0/0, and its gradient
    (the mask's zeros times 1/0) is NaN: every read of it makes every parameter's gradient NaN.
    """

    def __init__(self, text: str, block_size: int, stride: int = 1, poison: frozenset[int] = frozenset()) -> None:
        self.chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        self.ids = torch.tensor([self.stoi[c] for c in text], dtype=torch.long)
        self.block_size = block_size
        self.stride = stride
        self.poison = poison
        self._len = (len(self.ids) - (block_size + 1)) // stride + 1

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < self._len:
            raise IndexError(i)
        start = i * self.stride
        window = self.ids[start : start + self.block_size + 1]
        targets = torch.full((self.block_size,), IGNORE) if i in self.poison else window[1:].clone()
        return window[:-1].clone(), targets


IGNORE = -100  # a target that does not count (cross_entropy's ignore_index)


# -------------------------------------------------------------------- model
class Block(nn.Module):
    """Pre-LN transformer block: causal self-attention + MLP."""

    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.dropout = dropout
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(
        self, vocab_size: int, block_size: int, d_model: int, n_layers: int, n_heads: int, dropout: float = 0.1
    ) -> None:
        super().__init__()
        self.block_size = block_size
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(block_size, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, dropout) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.drop(self.tok(idx) + self.pos(torch.arange(t, device=idx.device)))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        # Each sequence weighs the same: its loss is the mean over its own targets that count.
        counts = targets != IGNORE
        per_token = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.clamp(min=0).reshape(-1),
                                    reduction="none").view(targets.shape)
        return ((per_token * counts).sum(dim=1) / counts.sum(dim=1)).mean()


def warmup_cosine(warmup: int, total: int, floor: float = 0.1):
    """LR multiplier: linear warmup, then cosine decay to ``floor``."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


# ------------------------------------------------------------------ digests
def _tensor_bytes(t: torch.Tensor) -> bytes:
    if hasattr(t, "full_tensor"):  # a sharded DTensor: gathered whole on every rank (call on all ranks)
        t = t.full_tensor()
    return t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def param_digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
        h.update(_tensor_bytes(p))
    return h.hexdigest()


def optimizer_digest(optimizer: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    state = optimizer.state_dict()["state"]
    for pid in sorted(state):
        for key in sorted(state[pid]):
            value = state[pid][key]
            h.update(f"{pid}.{key};".encode())
            h.update(_tensor_bytes(value) if isinstance(value, torch.Tensor) else repr(value).encode())
    return h.hexdigest()


class Trace:
    """Append-only JSON lines; one ``write`` per record so that ranks can share a file."""

    def __init__(self, path: str | None) -> None:
        self.fd = None
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, record: dict[str, Any]) -> None:
        if self.fd is not None:
            os.write(self.fd, (json.dumps(record) + "\n").encode())

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


# --------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300, help="total optimizer updates")
    p.add_argument("--ckpt-dir", default="runs/gpt/ckpt", help="checkpoint directory (or s3://bucket/prefix)")
    p.add_argument("--every", type=int, default=50, help="checkpoint every N steps")
    p.add_argument("--keep", type=int, default=3, help="committed checkpoints to keep")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--batch-size", type=int, default=16, help="sequences per rank per step")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--text-chars", type=int, default=200_000)
    p.add_argument(
        "--crash-at-step",
        type=int,
        default=None,
        help="SIGKILL --crash-rank at the top of this step, on a fresh start only (never after a restore)",
    )
    p.add_argument("--crash-rank", type=int, default=0)
    p.add_argument(
        "--poison-sample",
        type=int,
        action="append",
        default=[],
        metavar="I",
        help="dataset window I has every target masked: its loss is NaN on every read (repeatable)",
    )
    p.add_argument("--fsdp", action="store_true", help="shard the model with FSDP2 instead of wrapping it in DDP")
    p.add_argument("--trace", default=None, help="append per-step JSON lines here")
    p.add_argument("--log-every", type=int, default=50)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # This script's rank and world size are the Run's (run.rank, run.world_size), read after Run() and each time
    # they are used: they follow an in-process re-formation (a shrink renumbers the ranks), which the launcher's
    # variables do not.  Only the sharded model's mesh is made before the Run, from its shape.
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if args.fsdp else 1
    if world_size > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    torch.use_deterministic_algorithms(True)

    text = make_text(args.text_chars, seed=args.seed)
    dataset = CharWindows(text, args.block_size, poison=frozenset(args.poison_sample))
    data = resilient.ElasticLoader(dataset, batch_size=args.batch_size, seed=args.seed)

    torch.manual_seed(args.seed)  # identical initial weights on every rank
    gpt = GPT(dataset.vocab_size, args.block_size, args.d_model, args.layers, args.heads, dropout=0.1)
    if world_size > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        for block in gpt.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(gpt, mesh=mesh)  # parameters are now DTensors, each rank holding its shard

    decay = [p for n, p in gpt.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in gpt.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args.warmup, args.steps))

    # Without --fsdp the Run creates the process group and wraps the model in DDP itself (ddp=True), so that
    # it can form the group again around a spare that takes a lost rank's place.
    run = resilient.Run(
        model=gpt,
        optimizer=optimizer,
        scheduler=scheduler,
        data=data,
        ddp=not args.fsdp,
        seed=args.seed,
        checkpoint=resilient.CheckpointConfig(dir=args.ckpt_dir, every_steps=args.every, keep=args.keep),
        config={
            k: v
            for k, v in vars(args).items()  # what defines the run (a change is logged on restore)
            if k not in ("crash_at_step", "crash_rank", "trace", "ckpt_dir", "log_every", "keep", "every")
        },
    )
    trace = Trace(args.trace)
    trace.write(
        {
            "kind": "start",
            "rank": run.rank,
            "world_size": run.world_size,
            "step": run.step,
            "restored_from": run.restored_from,
            "pid": os.getpid(),
            "t": time.time(),
        }
    )
    if run.rank == 0:
        n_params = sum(p.numel() for p in gpt.parameters())
        where = f"restored {run.restored_from} (step {run.step})" if run.restored_from else "fresh start"
        print(
            f"[train_gpt] world_size={run.world_size} params={n_params} vocab={dataset.vocab_size} "
            f"windows={len(dataset)} {where}",
            flush=True,
        )

    # The crash happens once: in the rank's first process (a spare promoted into its place has another
    # RESILIENT_WORKER_ID), and never after a restore.
    first_process = os.environ.get("RESILIENT_WORKER_ID") in (None, f"w{args.crash_rank}")
    crash_armed = (
        args.crash_at_step is not None and run.rank == args.crash_rank and run.restored_from is None and first_process
    )
    gpt.train()
    t0, s0 = time.perf_counter(), run.step
    t_last, s_last = t0, run.step
    for step in run.steps(args.steps):
        done = False
        with run.attempt():  # a peer lost in here is survived in process where the launcher can; else a restart
            started = time.time()  # the start of the step's last attempt
            if crash_armed and step == args.crash_at_step:
                print(f"[train_gpt] rank {run.rank}: simulated crash, SIGKILL at the top of step {step}", flush=True)
                trace.write({"kind": "crash", "rank": run.rank, "step": step, "t": time.time()})
                os.kill(os.getpid(), signal.SIGKILL)
            lr = optimizer.param_groups[0]["lr"]
            indices: list[int] = []
            tokens = 0
            for inputs, targets in run.micro_batches():  # one micro-batch, unless the run shrank
                loss = run.model(inputs, targets)
                (loss / run.accumulation).backward()
                indices += data.last_indices
                tokens += targets.numel()
            torch.nn.utils.clip_grad_norm_(gpt.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            run.report(loss=loss, tokens=tokens)
            done = True
        if not done:  # the attempt failed and was recovered: run.steps() gives the same step again
            continue
        trace.write(
            {
                "kind": "step",
                "rank": run.rank,
                "step": step,
                "lr": lr,
                "loss": run.last_loss,
                "indices": indices,
                "t0": started,
                "t": time.time(),
            }
        )
        if run.rank == 0 and ((step + 1) % args.log_every == 0 or step + 1 == args.steps):
            now = time.perf_counter()
            rate = (step + 1 - s_last) / max(now - t_last, 1e-9)
            print(
                f"[train_gpt] step {step + 1:5d}/{args.steps}  loss {run.last_loss:.4f}  lr {lr:.2e}  "
                f"{rate:.1f} steps/s",
                flush=True,
            )
            t_last, s_last = now, step + 1
    elapsed = time.perf_counter() - t0
    result = run.close()

    p_digest, o_digest = param_digest(gpt), optimizer_digest(optimizer)
    if run.rank == 0:
        trace.write(
            {
                "kind": "final",
                "rank": run.rank,
                "step": run.step,
                "restored_from": run.restored_from,
                "param_sha256": p_digest,
                "optimizer_sha256": o_digest,
                "last_checkpoint": result.name if result is not None else None,
                "steps_per_s": (run.step - s0) / max(elapsed, 1e-9),
                "t": time.time(),
            }
        )
        print(
            f"[train_gpt] done: restored_from={run.restored_from} final_step={run.step} "
            f"ran {run.step - s0} steps in {elapsed:.1f}s ({(run.step - s0) / max(elapsed, 1e-9):.1f} steps/s) "
            f"last_checkpoint={result.name if result is not None else None} ok={result.ok if result else None} "
            f"param_sha256={p_digest[:16]} optimizer_sha256={o_digest[:16]}",
            flush=True,
        )
    trace.close()
    if world_size > 1:
        import torch.distributed as dist

        # The sharded model's groups sit in reference cycles: collect them now, not while Python exits.
        gpt = run = optimizer = scheduler = None
        gc.collect()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
