"""What the non-finite gradient check costs a training step: ``Run(nonfinite="retry")`` against ``"off"``.

The same model, optimizer (AdamW) and batches, trained in this process (no
agent) through the public API (``resilient.Run``, ``ElasticLoader``,
``run.attempt()``, ``run.micro_batches()``), once with the check and once
without, in alternating blocks so that both see the same machine; the
result is the ratio of the median times, of ``optimizer.step()`` (where
the check runs, as its pre-hook: the peer is the optimizer's own update)
and of the whole training step.  Two models: the drills' small MLP (a step
of a millisecond or two, where any fixed cost shows) and a wider MLP of
about 8 M parameters (where the check's one read of the gradients is what
it costs: AdamW's update reads and writes several arrays of that size).
Target: the check under 25% of AdamW's update on the 8 M model.  What it
is of a whole step depends on the compute per parameter (the batch); both
are reported.  Two more rows run the wide model with the fused AdamW
(``fused=True``), checked with the verdict read now and read late
(``nonfinite_verdict="late"``: a flag on the device, the update skipped by
it, read a step later), each against the fused AdamW unchecked.  On this
machine's CPU a host read costs nothing, so these rows show what the late
check's device pass costs, not the host sync it saves on a GPU.

    python benchmarks/nonfinite_bench.py            # ~1 minute
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _provenance import commit, load_now, uncommitted_code_changes

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results"
TARGET = 0.25


class Data:
    def __init__(self, n: int, dim: int) -> None:
        import torch

        g = torch.Generator().manual_seed(5)
        self.x, self.y = torch.randn(n, dim, generator=g), torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Any:
        return self.x[i], self.y[i]


def model_of(kind: str) -> tuple[Any, int]:
    import torch

    if kind == "small":
        return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 1)), 8
    width = 1024
    layers: list[Any] = []
    for _ in range(8):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 1)), width


def block(kind: str, mode: str, steps: int, batch: int, *, fused: bool = False,
          verdict: str = "now") -> list[tuple[float, float]]:
    """(step, optimizer.step()) seconds of ``steps`` steps with ``nonfinite=mode``, the first few left out."""
    import torch

    import resilient

    torch.manual_seed(0)
    model, dim = model_of(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    data = resilient.ElasticLoader(Data(batch * (steps + 4), dim), batch_size=batch, seed=1)
    run = resilient.Run(model=model, optimizer=opt, data=data, agent=None, nonfinite=mode,
                        nonfinite_verdict=verdict if mode != "off" else "now")
    times, updates = [], []
    for _ in run.steps(steps + 3):
        started = time.perf_counter()
        with run.attempt():
            for x, y in run.micro_batches():
                torch.nn.functional.mse_loss(run.model(x), y).backward()
            update = time.perf_counter()
            opt.step()
            updates.append(time.perf_counter() - update)
            opt.zero_grad()
            run.report()
        times.append(time.perf_counter() - started)
    run.close()
    return list(zip(times[3:], updates[3:]))


def measure(kind: str, blocks: int, steps: int, batch: int, *, fused: bool = False,
            verdict: str = "now") -> dict[str, Any]:
    on: list[tuple[float, float]] = []
    off: list[tuple[float, float]] = []
    for i in range(blocks):
        for mode in (("retry", "off") if i % 2 == 0 else ("off", "retry")):
            (on if mode == "retry" else off).extend(block(kind, mode, steps, batch, fused=fused, verdict=verdict))
    step_on, step_off = (statistics.median(t for t, _ in arm) for arm in (on, off))
    upd_on, upd_off = (statistics.median(u for _, u in arm) for arm in (on, off))
    model, _ = model_of(kind)
    return {"params": sum(p.numel() for p in model.parameters()), "batch": batch, "steps_each": len(on),
            "optimizer": "AdamW(fused=True)" if fused else "AdamW", "verdict": verdict,
            "update_ms_checked": round(upd_on * 1e3, 4), "update_ms_unchecked": round(upd_off * 1e3, 4),
            "update_overhead": round(upd_on / upd_off - 1, 4), "check_ms": round((upd_on - upd_off) * 1e3, 4),
            "step_ms_checked": round(step_on * 1e3, 4), "step_ms_unchecked": round(step_off * 1e3, 4),
            "step_overhead": round(step_on / step_off - 1, 4)}


def render(record: dict[str, Any]) -> str:
    lines = ["# Non-finite gradient check: cost per training step", "",
             (f"commit `{record['commit']}`{' (uncommitted changes)' if record['uncommitted'] else ''}; "
             f"`{record['command']}`; load before {record['load_before']['loadavg']}, after "
             f"{record['load_after']['loadavg']}"), "",
             ("| model | parameters | batch | optimizer | verdict | update, checked / unchecked (ms) | "
              "check / update | target | whole step, checked / unchecked (ms) | check / step |"),
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in record["results"].items():
        target = f"< {TARGET:.0%}: {'MET' if r['update_overhead'] < TARGET else 'MISSED'}" if name == "wide" else "-"
        lines.append(f"| {name} | {r['params']:,} | {r['batch']} | {r['optimizer']} | {r['verdict']} | "
                     f"{r['update_ms_checked']} / "
                     f"{r['update_ms_unchecked']} | {r['update_overhead']:+.1%} ({r['check_ms']:+.3f} ms) | {target} | "
                     f"{r['step_ms_checked']} / {r['step_ms_unchecked']} | {r['step_overhead']:+.1%} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--out-dir", type=Path, default=OUT)
    args = p.parse_args()
    import torch

    torch.set_num_threads(1)  # the same core count in both arms, and the machine's other work steady
    before = load_now()
    results = {"small": measure("small", args.blocks, 300, 4), "wide": measure("wide", args.blocks, 30, 16),
               "wide, fused, now": measure("wide", args.blocks, 30, 16, fused=True, verdict="now"),
               "wide, fused, late": measure("wide", args.blocks, 30, 16, fused=True, verdict="late")}
    record = {"commit": commit(), "uncommitted": uncommitted_code_changes(), "load_before": before,
              "load_after": load_now(), "command": "python " + " ".join(["benchmarks/nonfinite_bench.py", *sys.argv[1:]]),
              "torch": torch.__version__, "threads": 1, "target": TARGET, "results": results}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "nonfinite_bench.json").write_text(json.dumps(record, indent=1) + "\n")
    (args.out_dir / "nonfinite_bench.md").write_text(render(record))
    print(render(record))


if __name__ == "__main__":
    main()
