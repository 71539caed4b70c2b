"""Two gloo ranks save checkpoints, then restore them with a failure injected on one rank.

``save DIR`` commits steps 1 and 2 (world size 2).  ``restore OUT
SCENARIO=DIR ...`` restores each DIR in turn, with the storage of one rank
failing as SCENARIO says (see ``FAILURES``; ``count`` fails nothing and
counts the bytes each rank read from storage), and writes per rank what came
out (the checkpoint restored or the error) and how long it took.  The
storage is injected through CheckpointManager's public ``storage=``.
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist

import resilient
from resilient.checkpoint import CheckpointConfig, CheckpointManager, LocalStorage
from resilient.checkpoint.coordinator import Coordinator
from resilient.core.errors import StorageError


def failing(rank_to_fail: int, methods: tuple[str, ...], error: BaseException):
    class Failing(LocalStorage):
        pass

    def broken(self, *args, **kwargs):
        raise error

    if dist.get_rank() == rank_to_fail:
        for method in methods:
            setattr(Failing, method, broken)
    return Failing


class Counting(LocalStorage):
    """Counts the bytes each file read from storage returned (``count`` scenario)."""

    reads: dict[str, int] = {}

    def read_file(self, name, path, spec):
        buf, digest = super().read_file(name, path, spec)
        Counting.reads[path] = Counting.reads.get(path, 0) + len(buf)
        return buf, digest

    def open_ranges(self, name, path):
        reader = super().open_ranges(name, path)
        read = reader.readinto

        def counted(offset, views):
            n = read(offset, views)
            Counting.reads[path] = Counting.reads.get(path, 0) + n
            return n

        reader.readinto = counted
        return reader


class CountingShared(Counting):
    """A store that cannot read byte ranges (as S3 here): the replicated state goes out from rank 0."""

    ranged = False


FAILURES = {
    "none": (0, None, None),
    "list0": (0, ("list_committed",), StorageError("injected: listing failed on rank 0")),
    "manifest0": (0, ("read_manifest",), RuntimeError("injected: manifest read blew up on rank 0")),
    "read0": (0, ("read_file", "open_ranges"), MemoryError("injected: out of memory on rank 0")),
    "read1": (1, ("read_file", "open_ranges"), StorageError("injected: rank 1 cannot read")),
}


def manager(directory: str, storage=None, events=None) -> CheckpointManager:
    config = CheckpointConfig(dir=directory, every_steps=None, timeout_s=120)
    coord = Coordinator.from_environment(120)
    return CheckpointManager(config, coord, events or resilient.EventLog(), storage=storage)


def main(argv: list[str]) -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if argv[0] == "save":
        m = manager(argv[1])
        for step in (1, 2):
            payloads = {"rank": {"rank": rank, "step": step, "w": torch.full((8,), float(rank + step))}}
            if rank == 0:
                payloads["replicated"] = {"model": torch.arange(16, dtype=torch.float32) * step}
            result = m.save(step, payloads, counters={"samples": 0, "tokens": 0}, fingerprint={}, wait=True)
            assert result is not None and result.ok, result
    else:
        out = {}
        for item in argv[2:]:
            scenario, directory = item.split("=", 1)
            who, method, error = FAILURES.get(scenario, (0, None, None))
            storage = failing(who, method, error)(directory) if method else None
            if scenario in ("count", "count_shared"):
                Counting.reads.clear()
                storage = (Counting if scenario == "count" else CountingShared)(directory)
            started = time.monotonic()
            events = resilient.EventLog()
            restored = None
            try:
                m = manager(directory, storage, events)
                restored = m.restore()
                outcome = f"restored {restored.manifest.name if restored else None}"
                detail = restored.rank_state["rank"] if restored else None
            except Exception as e:  # noqa: BLE001  the point of the test: which error, on which rank
                outcome, detail = f"{type(e).__name__}: {e}", None
            out[scenario] = {"outcome": outcome, "elapsed_s": time.monotonic() - started, "state_of": detail,
                             "quarantined": [e.fields for e in events.of_kind("checkpoint_quarantined")],
                             "reads": dict(Counting.reads) if scenario.startswith("count") else None,
                             "restored": [e.fields for e in events.of_kind("checkpoint_restored")],
                             "model": restored.replicated["model"].tolist() if restored else None}
        with open(f"{argv[1]}.rank{rank}", "w") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
