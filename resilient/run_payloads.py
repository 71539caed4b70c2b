"""What a :class:`~resilient.run.Run` checkpoints, and how a restored checkpoint is put back.

Rank 0 saves the replicated state (model, optimizer, scheduler, scaler);
every rank saves its own (RNG, data cursor, user state, counters).  Putting
it back refuses a checkpoint whose components do not match the Run's, with
a message naming the fix, and restores the RNG last so that nothing loaded
before it consumes random numbers.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from .checkpoint.restore import RANK, REPLICATED, Restored
from .errors import ConfigError
from .events import EventKind
from .state import capture_rng, load_model_state, load_optimizer_state, restore_rng, unwrap

if TYPE_CHECKING:
    from .checkpoint.manager import CheckpointManager, SaveResult
    from .run import Run


def capture_payloads(run: Run) -> dict[str, Any]:
    """What one rank saves: its own state (RANK) and, on rank 0, the replicated state (REPLICATED)."""
    payloads: dict[str, Any] = {
        RANK: {
            "rng": capture_rng(),
            "data": run.data.state_dict() if run.data is not None else None,
            "user": {name: obj.state_dict() for name, obj in run.user_state.items()},
            "counters": {"step": run.step, "samples": run.samples, "tokens": run.tokens},
        }
    }
    if run.rank == 0:
        payloads[REPLICATED] = {
            "model": unwrap(run.model).state_dict(),
            "optimizer": run.optimizer.state_dict() if run.optimizer is not None else None,
            "scheduler": run.scheduler.state_dict() if run.scheduler is not None else None,
            "scaler": run.scaler.state_dict() if run.scaler is not None else None,
            "step": run.step,
        }
    return payloads


def apply_restored(run: Run, restored: Restored) -> None:
    """Put a verified checkpoint back into the Run's components, refusing one that does not fit them."""
    name = restored.manifest.name
    rep, mine = restored.replicated, restored.rank_state
    load_model_state(run.model, rep["model"], name)
    for label, obj, value in (
        ("optimizer", run.optimizer, rep["optimizer"]),
        ("scheduler", run.scheduler, rep["scheduler"]),
        ("scaler", run.scaler, rep["scaler"]),
    ):
        if (obj is None) != (value is None):
            raise ConfigError(
                f"checkpoint {name} {'has' if value is not None else 'lacks'} {label} state but this Run "
                f"{'lacks' if obj is None else 'has'} a {label}; create the Run with the same components"
            )
    if run.optimizer is not None:
        load_optimizer_state(run.optimizer, rep["optimizer"], name)
    if run.scheduler is not None:
        run.scheduler.load_state_dict(rep["scheduler"])
    if run.scaler is not None:
        run.scaler.load_state_dict(rep["scaler"])
    missing = set(run.user_state) - set(mine["user"])
    if missing:
        raise ConfigError(f"checkpoint {name} has no state for {sorted(missing)}; it was saved without them")
    for key, obj in run.user_state.items():
        obj.load_state_dict(mine["user"][key])
    if run.data is not None:
        if mine["data"] is None:
            raise ConfigError(f"checkpoint {name} has no data cursor; it was saved without data=ElasticLoader")
        run.data.load_state_dict(mine["data"])
    counters = mine["counters"]
    run.step, run.samples, run.tokens = counters["step"], counters["samples"], counters["tokens"]
    restore_rng(mine["rng"])  # last: loading above must not consume random numbers after it
    saved_config = restored.manifest.fingerprint.get("config")
    if saved_config != run._fingerprint["config"]:
        run.events.emit(EventKind.CONFIG_CHANGED, checkpoint=name, saved=saved_config,
                         now=run._fingerprint["config"])
    run.restored_from = name


def digest_config(config: Mapping[str, Any] | None) -> str | None:
    """The config's fingerprint in every manifest (a resume under another config is an event)."""
    if config is None:
        return None
    text = json.dumps(config, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


def refuse_sharded(model: torch.nn.Module) -> None:
    """Sharded parameters need per-owner saving; say so up front instead of failing mid-save."""
    for name, p in model.named_parameters():
        if type(p.data) is not torch.Tensor:  # a plain Parameter's data is a plain Tensor
            raise ConfigError(
                f"parameter {name!r} is a {type(p.data).__qualname__} (sharded, e.g. FSDP2/DTensor); resilient "
                "checkpoints hold replicated (DDP) or single-process state only. Use DDP, or save sharded state "
                "with torch.distributed.checkpoint"
            )


def new_save_report(checkpoints: CheckpointManager | None,
                    reported: SaveResult | None) -> tuple[dict[str, Any] | None, SaveResult | None]:
    """The newest finished save if not ``reported`` yet (what the agent exports as checkpoint duration and
    bytes), and the save reported now."""
    results = checkpoints.results if checkpoints is not None else None
    if not results or results[-1] is reported:
        return None, reported
    result = results[-1]
    size = result.manifest.total_bytes if result.manifest is not None else 0
    return {"step": result.step, "duration_s": round(result.stall_s + result.write_s, 6), "ok": result.ok,
            "bytes": size, "deferred_from": result.deferred_from, "deferred_slots": result.deferred_slots}, result
