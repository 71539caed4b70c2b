"""A GPT training script written the way a popular open-source one is, to test integrations as users make them.

Its shape is that of the well-known single-file GPT trainers: configuration as module globals overridden by
``--key=value`` arguments, DDP set up from ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` with the script's own
``init_process_group``, a ``get_batch()`` that draws window offsets from the global torch generator, the next
batch fetched inside each micro-step (ahead of its use, to overlap it with the backward pass), an evaluation of
the loss on rank 0 every ``eval_interval`` iterations, and its own ``ckpt.pt`` with ``init_from='resume'``.

``resilient`` picks the integration:

- ``none``: the script unmodified (``while True`` loop, its own checkpoint every ``eval_interval``);
- ``five``: the README's five lines: ``resilient.Run(...)`` after the model, ``for iter_num in run.steps(...)``
  instead of the ``while`` loop, ``run.report``, ``run.close``; the rest as it was, prefetch included;
- ``prefetch``: the same five lines, with both batch fetches through ``run.prefetch(get_batch, 'train')``.

``crash_at=N crash_rank=R``: rank R SIGKILLs itself at the top of iteration N, in the launch's first process only
(``TORCHELASTIC_RESTART_COUNT`` 0).  ``trace=PATH``: one JSON line per iteration and rank (iteration, loss, a
digest of the batch), and rank 0's digest of the final parameters and optimizer state.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP

# ----------------------------------------------------------------------------- config
out_dir = "out"
eval_interval = 10
eval_iters = 2
log_interval = 5
always_save_checkpoint = True
init_from = "scratch"  # or "resume"
gradient_accumulation_steps = 4
batch_size = 4
block_size = 32
n_layer = 2
n_head = 2
n_embd = 32
dropout = 0.1
learning_rate = 3e-3
max_iters = 40
weight_decay = 0.1
beta1, beta2 = 0.9, 0.95
grad_clip = 1.0
warmup_iters = 5
lr_decay_iters = 40
min_lr = 3e-4
resilient_integration = "none"
ckpt_every = 10
crash_at = -1
crash_rank = 0
trace = ""
for arg in sys.argv[1:]:  # --key=value overrides a global of the same name, with its type
    key, _, value = arg[2:].partition("=")
    if not arg.startswith("--") or key not in globals():
        raise SystemExit(f"unknown argument {arg}")
    old = globals()[key]
    globals()[key] = type(old)(value) if not isinstance(old, bool) else value.lower() in ("1", "true")
config = {k: v for k, v in globals().items() if k in ("batch_size", "block_size", "n_layer", "n_head", "n_embd",
                                                     "learning_rate", "max_iters", "gradient_accumulation_steps")}

# ----------------------------------------------------------------------------- DDP, as such scripts set it up
ddp = int(os.environ.get("RANK", "-1")) != -1
if ddp:
    init_process_group(backend="gloo")
    ddp_rank = int(os.environ["RANK"])
    ddp_local_rank = int(os.environ["LOCAL_RANK"])
    ddp_world_size = int(os.environ["WORLD_SIZE"])
    master_process = ddp_rank == 0
    seed_offset = ddp_rank
    assert gradient_accumulation_steps % ddp_world_size == 0
    gradient_accumulation_steps //= ddp_world_size
else:
    ddp_rank, master_process, seed_offset, ddp_world_size = 0, True, 0, 1
if master_process:
    os.makedirs(out_dir, exist_ok=True)
torch.manual_seed(1337 + seed_offset)
torch.set_num_threads(1)

# ----------------------------------------------------------------------------- data
vocab_size = 64
_g = torch.Generator().manual_seed(7)  # the corpus: its own generator, the global one untouched
_walk = torch.randint(0, 4, (20_000,), generator=_g)
train_data = torch.cumsum(_walk, 0) % vocab_size  # a token stream with some structure to learn
val_data = torch.roll(train_data, 5_000)


def get_batch(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    data = train_data if split == "train" else val_data
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([data[i : i + block_size] for i in ix])
    y = torch.stack([data[i + 1 : i + 1 + block_size] for i in ix])
    return x, y


# ----------------------------------------------------------------------------- model
class SelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(n_embd, dim=2)
        q, k, v = (z.view(b, t, n_head, c // n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout if self.training else 0.0)
        return self.drop(self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(n_embd), SelfAttention(), nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd),
                                 nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(Block() for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(idx.shape[1])))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def get_lr(it: int) -> float:
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


iter_num, best_val_loss = 0, 1e9
model = GPT()
decay = [p for p in model.parameters() if p.dim() >= 2]
no_decay = [p for p in model.parameters() if p.dim() < 2]
optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": no_decay,
                              "weight_decay": 0.0}], lr=learning_rate, betas=(beta1, beta2))
if init_from == "resume" and os.path.exists(os.path.join(out_dir, "ckpt.pt")):
    checkpoint = torch.load(os.path.join(out_dir, "ckpt.pt"), map_location="cpu")
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    iter_num, best_val_loss = checkpoint["iter_num"], checkpoint["best_val_loss"]
    print(f"resuming from {out_dir}/ckpt.pt at iteration {iter_num}", flush=True)
raw_model = model
if ddp:
    model = DDP(model)


@torch.no_grad()
def estimate_loss() -> dict[str, float]:
    out = {}
    model.eval()
    for split in ("train", "val"):
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            x, y = get_batch(split)
            losses[k] = raw_model(x, y)[1].item()
        out[split] = losses.mean().item()
    model.train()
    return out


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(str(t.tolist()).encode())
    return h.hexdigest()[:16]


trace_fd = os.open(trace, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if trace else None


def write(record: dict) -> None:
    if trace_fd is not None:
        os.write(trace_fd, (json.dumps(record) + "\n").encode())


first_process = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and \
    os.environ.get("RESILIENT_WORKER_ID") in (None, f"w{crash_rank}")


def train_step(iter_num: int) -> torch.Tensor:
    """One iteration of the loop body, as the script has it: lr, micro-steps with the prefetch, the update."""
    global X, Y
    if crash_at == iter_num and ddp_rank == crash_rank and first_process:
        os.kill(os.getpid(), signal.SIGKILL)
    lr = get_lr(iter_num)
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    batches = []
    for micro_step in range(gradient_accumulation_steps):
        if ddp:
            model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
        batches.append(X)
        _, loss = model(X, Y)
        loss = loss / gradient_accumulation_steps
        X, Y = fetch("train")  # the next batch, fetched while the backward pass would run on a GPU
        loss.backward()
    if grad_clip != 0.0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    write({"iter": iter_num, "rank": ddp_rank, "loss": float(loss.detach()).hex(), "batch": digest(batches)})
    return loss


if resilient_integration == "none":
    fetch = get_batch
    X, Y = fetch("train")
    while True:
        if iter_num % eval_interval == 0 and master_process:
            losses = estimate_loss()
            if losses["val"] < best_val_loss or always_save_checkpoint:
                best_val_loss = losses["val"]
                if iter_num > 0:
                    torch.save({"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                                "iter_num": iter_num, "best_val_loss": best_val_loss, "config": config},
                               os.path.join(out_dir, "ckpt.pt"))
        if iter_num >= max_iters:
            break
        loss = train_step(iter_num)
        if iter_num % log_interval == 0 and master_process:
            print(f"iter {iter_num}: loss {loss.item() * gradient_accumulation_steps:.4f}", flush=True)
        iter_num += 1
else:
    import resilient

    run = resilient.Run(model=model, optimizer=optimizer, config=config,
                        checkpoint=resilient.CheckpointConfig(dir=os.path.join(out_dir, "ckpt"),
                                                              every_steps=ckpt_every, keep=2))
    fetch = (lambda split: run.prefetch(get_batch, split)) if resilient_integration == "prefetch" else get_batch
    X, Y = fetch("train")
    for iter_num in run.steps(max_iters):
        if iter_num % eval_interval == 0 and master_process:
            estimate_loss()
        loss = train_step(iter_num)
        run.report(loss=loss)
        if iter_num % log_interval == 0 and master_process:
            print(f"iter {iter_num}: loss {loss.item() * gradient_accumulation_steps:.4f}", flush=True)
    run.close()

if master_process:
    write({"final": digest([p.detach() for p in raw_model.parameters()]),
           "optimizer": digest([v for s in optimizer.state.values() for v in s.values()
                                if isinstance(v, torch.Tensor)])})
if ddp:
    # The one departure from the scripts it follows: the DDP wrapper (and the Run holding it) go before the
    # group, since torch 2.13's gloo group can hang in its destructor when a wrapper outlives
    # destroy_process_group() (under torchrun as under resilient run), which would make these tests flaky.
    model = run = None
    destroy_process_group()
