"""What the non-finite gradient check costs a training step: ``Run(nonfinite="retry")`` against ``"off"``.

The same model, optimizer (AdamW) and batches, trained in this process (no
agent) through the public API (``resilient.Run``, ``ElasticLoader``,
``run.attempt()``, ``run.micro_batches()``), once with the check and once
without, in alternating blocks so that both see the same machine; the
result is the ratio of the median step times.  Two models: the drills'
small MLP (a step of well under a millisecond, where any fixed cost shows)
and a wider MLP of about 8 M parameters (where the check's pass over the
gradients is what it costs).  Target: under 3% of a step on the 8 M model.

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
from _provenance import commit, load_now, uncommitted_code_changes  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results"
TARGET = 0.03


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


def block(kind: str, mode: str, steps: int, batch: int) -> list[float]:
    """Step times (seconds) of ``steps`` steps with ``nonfinite=mode``, the first few left out."""
    import torch

    import resilient

    torch.manual_seed(0)
    model, dim = model_of(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = resilient.ElasticLoader(Data(batch * (steps + 4), dim), batch_size=batch, seed=1)
    run = resilient.Run(model=model, optimizer=opt, data=data, agent=None, nonfinite=mode)
    times = []
    for _ in run.steps(steps + 3):
        started = time.perf_counter()
        with run.attempt():
            for x, y in run.micro_batches():
                torch.nn.functional.mse_loss(run.model(x), y).backward()
            opt.step()
            opt.zero_grad()
            run.report()
        times.append(time.perf_counter() - started)
    run.close()
    return times[3:]


def measure(kind: str, blocks: int, steps: int, batch: int) -> dict[str, Any]:
    on: list[float] = []
    off: list[float] = []
    for i in range(blocks):
        for mode in (("retry", "off") if i % 2 == 0 else ("off", "retry")):
            (on if mode == "retry" else off).extend(block(kind, mode, steps, batch))
    med_on, med_off = statistics.median(on), statistics.median(off)
    model, _ = model_of(kind)
    return {"params": sum(p.numel() for p in model.parameters()), "steps_each": len(on),
            "step_ms_checked": round(med_on * 1e3, 4), "step_ms_unchecked": round(med_off * 1e3, 4),
            "overhead": round(med_on / med_off - 1, 4), "overhead_ms": round((med_on - med_off) * 1e3, 4)}


def render(record: dict[str, Any]) -> str:
    lines = ["# Non-finite gradient check: cost per training step", "",
             f"commit `{record['commit']}`{' (uncommitted changes)' if record['uncommitted'] else ''}; "
             f"`{record['command']}`; load before {record['load_before']['loadavg']}, after "
             f"{record['load_after']['loadavg']}", "",
             "| model | parameters | step, checked (ms) | step, unchecked (ms) | overhead | target |",
             "|---|---|---|---|---|---|"]
    for name, r in record["results"].items():
        target = f"< {TARGET:.0%}: {'MET' if r['overhead'] < TARGET else 'MISSED'}" if name == "wide" else "-"
        lines.append(f"| {name} | {r['params']:,} | {r['step_ms_checked']} | {r['step_ms_unchecked']} | "
                     f"{r['overhead']:+.2%} ({r['overhead_ms']:+.3f} ms) | {target} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=6)
    p.add_argument("--out-dir", type=Path, default=OUT)
    args = p.parse_args()
    import torch

    torch.set_num_threads(1)  # the same core count in both arms, and the machine's other work steady
    before = load_now()
    results = {"small": measure("small", args.blocks, 300, 4), "wide": measure("wide", args.blocks, 30, 16)}
    record = {"commit": commit(), "uncommitted": uncommitted_code_changes(), "load_before": before,
              "load_after": load_now(), "command": "python " + " ".join(["benchmarks/nonfinite_bench.py", *sys.argv[1:]]),
              "torch": torch.__version__, "threads": 1, "target": TARGET, "results": results}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "nonfinite_bench.json").write_text(json.dumps(record, indent=1) + "\n")
    (args.out_dir / "nonfinite_bench.md").write_text(render(record))
    print(render(record))


if __name__ == "__main__":
    main()
