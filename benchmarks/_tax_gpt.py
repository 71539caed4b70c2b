"""The loop the step-tax benchmark times: one GPT training loop, in blocks with and without the Run, in one run.

    python benchmarks/_tax_gpt.py --mode five|attempt --size small|10m --iters N --block B --out FILE

Two gloo ranks under ``resilient run``.  The loop alternates blocks of ``B`` iterations: a block of the script as
it is without resilient (the loop over ``range``, its own optimizer step, nothing of the Run called), then a
block through the integration, and so on, so that both see the same machine at the same time (a 2-core
machine's speed drifts by 10% and more from one minute to the next).  ``five``: the README's five lines
(``Run(model=DDP(...))``, ``for _ in run.steps(...)``, ``run.report``), the script's own DDP wrapper;
``attempt``: the in-process integration (``Run(ddp=True)``, the body under ``run.attempt()``), whose wrapper
``run.model`` the plain blocks use too.  The plain blocks step a second optimizer over the same parameters,
on which the Run has no hooks.  Batches are drawn from the global generator in the step, as such scripts do.
The integration commits a durable checkpoint every ``--every`` of its steps; the memory tier and everything
else run with the agent's defaults.  Rank 0 writes each iteration's seconds, by kind, to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch import nn

SIZES = {"small": {"n_layer": 3, "n_embd": 48, "n_head": 4, "block": 32, "batch": 8},
         "10m": {"n_layer": 6, "n_embd": 384, "n_head": 6, "block": 64, "batch": 2}}
VOCAB = 64


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, n_layer: int, n_embd: int, n_head: int, block: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, n_embd), nn.Embedding(block, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln, self.head = nn.LayerNorm(n_embd), nn.Linear(n_embd, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.ln(x)).flatten(0, 1), targets.flatten())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("five", "attempt"), required=True)
    p.add_argument("--size", choices=tuple(SIZES), default="small")
    p.add_argument("--iters", type=int, default=1000, help="iterations of each kind")
    p.add_argument("--block", type=int, default=25, help="iterations per block")
    p.add_argument("--every", type=int, default=500, help="durable checkpoint every N steps of the integration")
    p.add_argument("--ckpt", default="ckpt")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    cfg = SIZES[args.size]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    corpus = torch.randint(0, VOCAB, (50_000,), generator=torch.Generator().manual_seed(1))

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(corpus) - cfg["block"] - 1, (cfg["batch"],))
        x = torch.stack([corpus[i : i + cfg["block"]] for i in ix])
        return x, torch.stack([corpus[i + 1 : i + 1 + cfg["block"]] for i in ix])

    import resilient

    model = GPT(cfg["n_layer"], cfg["n_embd"], cfg["n_head"], cfg["block"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plain_optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # the Run has no hooks on this one
    checkpoint = resilient.CheckpointConfig(dir=args.ckpt, every_steps=args.every)
    wrapped: nn.Module | None = None
    if args.mode == "five":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        wrapped = nn.parallel.DistributedDataParallel(model)
        run = resilient.Run(model=wrapped, optimizer=optimizer, checkpoint=checkpoint)
    else:
        run = resilient.Run(model=model, optimizer=optimizer, ddp=True, checkpoint=checkpoint)
    times: dict[str, list[float]] = {"plain": [], args.mode: []}

    def plain_block() -> None:
        net = wrapped if wrapped is not None else run.model
        for _ in range(args.block):
            started = time.perf_counter()
            x, y = get_batch()
            loss = net(x, y)
            loss.backward()
            plain_optimizer.step()
            plain_optimizer.zero_grad(set_to_none=True)
            times["plain"].append(time.perf_counter() - started)

    steps = run.steps(args.iters)
    done = 0
    while done < args.iters:
        plain_block()
        for _ in range(args.block):
            started = time.perf_counter()  # the Run's boundary work is inside next(steps): timed too
            if next(steps, None) is None:
                break
            if args.mode == "attempt":
                with run.attempt():
                    x, y = get_batch()
                    loss = run.model(x, y)
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    run.report(loss=loss)
            else:
                x, y = get_batch()
                loss = wrapped(x, y)  # type: ignore[misc]
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                run.report(loss=loss)
            times[args.mode].append(time.perf_counter() - started)
            done += 1
    for _ in steps:  # the loop's end: the save on finish
        pass
    rank = run.rank
    run.close()
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"mode": args.mode, "size": args.size, "block": args.block,
                       "params": sum(p.numel() for p in model.parameters()), "times": times}, f)
    if wrapped is not None:  # the wrapper goes before the group (torch 2.13's gloo group can hang in its
        del run, steps, wrapped  # destructor when a DDP wrapper outlives destroy_process_group())
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
