"""A GPT script written for in-process recovery, that still reads its rank from the environment before ``Run()``.

As users keep their launcher habits: ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` are read at the top, the seed is
offset by the rank, rank 0 is the logging rank, and the script's own gradient accumulation is a global count
divided by ``WORLD_SIZE``.  Then the spare-capable integration: ``Run(ddp=True)`` makes the group and the DDP
wrapper, each step's body is under ``with run.attempt():``, its batches drawn from the global torch generator
(which the attempt seeds per step and rank) inside the step.  A process that ran this with a rank it does not
have would train another model: a world of 1 runs twice the micro-steps and the all-reduces of its peers.

``crash_at=N crash_rank=R``: rank R SIGKILLs itself at the top of iteration N, in the launch's first process of
that rank only.  ``trace=PATH``: one JSON line per completed iteration and rank, and the logging rank's digest of
the final parameters and optimizer state.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys

import torch
import torch.nn.functional as F
from torch import nn

# The launcher's variables, read first, as such scripts do.
rank = int(os.environ.get("RANK", "0"))
world_size = int(os.environ.get("WORLD_SIZE", "1"))
local_rank = int(os.environ.get("LOCAL_RANK", "0"))
master_process = rank == 0
seed_offset = rank

max_iters, micro_steps, batch_size, block_size, n_embd = 30, 4, 4, 16, 32
ckpt_dir, crash_at, crash_rank, trace = "out/ckpt", -1, 0, ""
for arg in sys.argv[1:]:
    key, _, value = arg[2:].partition("=")
    if key == "ckpt_dir":
        ckpt_dir = value
    elif key == "trace":
        trace = value
    elif key in ("max_iters", "crash_at", "crash_rank"):
        globals()[key] = int(value)
    else:
        raise SystemExit(f"unknown argument {arg}")
assert micro_steps % world_size == 0, "the global number of micro-steps must divide among the ranks"
gradient_accumulation_steps = micro_steps // world_size
torch.manual_seed(1337 + seed_offset)
torch.set_num_threads(1)

import resilient

vocab = 48
corpus = (torch.arange(12_000) * 7 % 31 + torch.arange(12_000) // 97) % vocab


def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
    ix = torch.randint(len(corpus) - block_size - 1, (batch_size,))
    x = torch.stack([corpus[i : i + block_size] for i in ix])
    return x, torch.stack([corpus[i + 1 : i + 1 + block_size] for i in ix])


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, n_embd), nn.Embedding(block_size, n_embd)
        layer = nn.TransformerEncoderLayer(n_embd, 2, 4 * n_embd, dropout=0.1, batch_first=True, norm_first=True)
        self.body = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(n_embd, vocab)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        h = self.body(self.tok(x) + self.pos(torch.arange(x.shape[1])), mask=mask, is_causal=True)
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


model = TinyGPT()
optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
run = resilient.Run(model=model, optimizer=optimizer, ddp=True, seed=1234,
                    checkpoint=resilient.CheckpointConfig(dir=ckpt_dir, every_steps=10, keep=2))
trace_fd = os.open(trace, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if trace else None


def write(record: dict) -> None:
    if trace_fd is not None:
        os.write(trace_fd, (json.dumps(record) + "\n").encode())


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(str(t.tolist()).encode())
    return h.hexdigest()[:16]


first_process = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and \
    os.environ.get("RESILIENT_WORKER_ID") in (None, f"w{crash_rank}")
for it in run.steps(max_iters):
    done = False
    with run.attempt():
        if crash_at == it and rank == crash_rank and first_process:
            os.kill(os.getpid(), signal.SIGKILL)
        for micro_step in range(gradient_accumulation_steps):
            x, y = get_batch()
            run.model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
            loss = run.model(x, y) / gradient_accumulation_steps
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        run.report(loss=loss)
        done = True
    if done:
        write({"iter": it, "rank": rank, "world_size": world_size, "loss": float(loss.detach()).hex()})
        if master_process and it % 10 == 0:
            print(f"iter {it}: loss {float(loss) * gradient_accumulation_steps:.4f}", flush=True)
run.close()
if master_process:
    write({"final": digest([p.detach() for p in model.parameters()]),
           "optimizer": digest([v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)])})
