"""The training script memory_tier_bench.py starts under ``resilient run``: one rank, about 100 MB of state.

An MLP of ``--layers`` x Linear(``--width``, ``--width``) with AdamW (parameters plus two moments: 4 x 1440
x 1441 x 3 x 4 bytes = 99.6 MB by default), a batch of 32 per step, each step padded by a sleep to
``--step-ms`` measured from the step's start (the time a GPU would compute, the host idle), so whatever the
memory tier does at a boundary lengthens the period between two steps' starts.  A durable tier is
configured, as the memory tier needs one, but saves nothing while steps are timed.

At the end it writes ``--out`` (JSON): the wall period of every step (``time.perf_counter`` at the top of
each step of ``Run.steps``), the state's size, and the steps where the memory tier saved (from the Run's
own events, ``--events``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch

import resilient


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--events", required=True)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--step-ms", type=float, default=50.0)
    p.add_argument("--width", type=int, default=1440)
    p.add_argument("--layers", type=int, default=4)
    args = p.parse_args()

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ckpt = resilient.CheckpointConfig(dir=args.ckpt, every_steps=args.steps + 1, keep=1, save_on_finish=False)
    run = resilient.Run(model=model, optimizer=optimizer, checkpoint=ckpt, events=resilient.EventLog(args.events))
    x = torch.randn(32, args.width)
    pad = args.step_ms / 1e3
    starts: list[float] = []
    compute: list[float] = []
    for _ in run.steps(args.steps):
        t0 = time.perf_counter()
        starts.append(t0)
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        compute.append(time.perf_counter() - t0)
        left = pad - (time.perf_counter() - t0)
        if left > 0:
            time.sleep(left)
    starts.append(time.perf_counter())  # the loop's end: the last step's period includes its boundary too
    run.close()
    state = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    state += sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor))
    periods = [b - a for a, b in itertools.pairwise(starts)]
    args.out.write_text(json.dumps({"periods_s": periods, "compute_s": compute, "state_bytes": state}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
