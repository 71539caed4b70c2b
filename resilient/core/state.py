"""Capture and restore of the state that makes a resumed run the same run.

Model, optimizer, scheduler and scaler state are *replicated* (identical on
every data-parallel rank), so rank 0 saves them once.  RNG streams, the data
cursor and the counters are *per rank*.  Model state is taken from the
unwrapped module, so a checkpoint written under DDP restores into a plain
module and back.
"""

from __future__ import annotations

import hashlib
import random
import sys
from typing import Any, Protocol, runtime_checkable

import torch

from .errors import CheckpointMismatchError, ConfigError


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside DDP (and similar ``.module`` wrappers)."""
    inner = model
    from torch.nn.parallel import DistributedDataParallel

    while isinstance(inner, DistributedDataParallel):
        inner = inner.module
    return inner


def check_stateful(name: str, obj: Any) -> None:
    if not isinstance(obj, Stateful):
        raise ConfigError(
            f"state[{name!r}] is a {type(obj).__qualname__} without state_dict()/load_state_dict(); "
            "pass objects that implement both (see resilient.Stateful)"
        )


def model_fingerprint(model: torch.nn.Module) -> str:
    """A digest of parameter and buffer names, shapes and dtypes."""
    h = hashlib.sha256()
    for key, value in unwrap(model).state_dict().items():
        if isinstance(value, torch.Tensor):
            h.update(f"{key}:{tuple(value.shape)}:{value.dtype};".encode())
    return h.hexdigest()


_ACCELERATORS: list[Any] | None = None


def seed_torch(seed: int) -> None:
    """``torch.manual_seed(seed)`` at a thousandth of its cost where there is no accelerator.

    ``torch.manual_seed`` seeds every backend, and one that is not initialised (CUDA on a machine without a GPU
    included) queues the call with a formatted stack trace for a later initialisation: about 0.2 to 1 ms a call,
    paid at every step by code that seeds per step.  This seeds the CPU generator and the backends that exist
    here (checked once per process), each as ``torch.manual_seed`` would.
    """
    global _ACCELERATORS
    if _ACCELERATORS is None:
        _ACCELERATORS = [backend for backend in (getattr(torch, name, None) for name in ("cuda", "xpu", "mtia"))
                         if backend is not None and backend.is_available()]
        mps = getattr(torch, "mps", None)
        if mps is not None and torch.backends.mps.is_available():
            _ACCELERATORS.append(mps)
    seed = int(seed)
    for backend in _ACCELERATORS:
        if hasattr(backend, "manual_seed_all"):
            backend.manual_seed_all(seed)
        else:
            backend.manual_seed(seed)
    torch.default_generator.manual_seed(seed)


def capture_rng() -> dict[str, Any]:
    """Every RNG stream this process uses: python, numpy (if imported), torch CPU and CUDA."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        state["numpy"] = numpy.random.get_state()
    if torch.cuda.is_initialized():  # initialised implies available
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"].clone())
    if "numpy" in state:
        import numpy

        name, keys, pos, has_gauss, cached = state["numpy"]
        numpy.random.set_state((name, keys.numpy().astype(numpy.uint32), pos, has_gauss, cached))
    if "cuda" in state:
        if not torch.cuda.is_available():
            raise CheckpointMismatchError("checkpoint holds CUDA RNG state but no GPU is available here")
        torch.cuda.set_rng_state_all([t.clone() for t in state["cuda"]])


def load_model_state(model: torch.nn.Module, state: dict[str, Any], checkpoint: str) -> None:
    try:
        unwrap(model).load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise CheckpointMismatchError(
            f"checkpoint {checkpoint} does not fit this model ({e}). Restore it with the model configuration "
            "it was trained with, or point CheckpointConfig.dir at a fresh location to start a new run"
        ) from None


def load_optimizer_state(optimizer: Any, state: dict[str, Any], checkpoint: str) -> None:
    try:
        optimizer.load_state_dict(state)
    except (ValueError, KeyError, RuntimeError) as e:
        raise CheckpointMismatchError(
            f"checkpoint {checkpoint}: optimizer state does not fit this optimizer ({e}); use the optimizer "
            "and parameter groups the run was started with"
        ) from None
