"""A rank's random streams and data cursor: what they are at one moment, and what moved between two.

A checkpoint holds, for each rank, the process's random streams (torch's
CPU and CUDA generators, Python's and numpy's global ones:
:func:`~resilient.core.state.capture_rng`), the states of the generators
given to ``Run(generators=...)`` (:func:`generator_states`) and the
loader's cursor.  :class:`Streams` is all of it at one moment, and
:func:`moved` names what differs between two.  The resume check
(:mod:`.resume`) keeps its records in these terms (:class:`Fetched`,
:class:`Expected`, held by :class:`~.state.RunState`); an attempt's start
(:mod:`.attempt`) copies the generators with :func:`generator_states`.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..core.errors import ConfigError


def check_generators(generators: Mapping[str, Any] | None) -> dict[str, Any]:
    """``Run(generators=...)`` as a dict, refusing what cannot be saved and put back."""
    found = dict(generators or {})
    for name, gen in found.items():
        if not isinstance(name, str):
            raise ConfigError(f"Run(generators=...): the names are strings, got {name!r}")
        if _kind(gen) is None:
            raise ConfigError(
                f"Run(generators={{{name!r}: ...}}) is a {type(gen).__qualname__}: give a torch.Generator, a "
                "random.Random, or a numpy RandomState or Generator (the Run saves, restores and checks its state)")
    return found


def _kind(gen: Any) -> str | None:
    if isinstance(gen, torch.Generator):
        return "torch"
    if isinstance(gen, random.Random):
        return "python"
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(gen, numpy.random.RandomState):
        return "numpy"
    if numpy is not None and isinstance(gen, numpy.random.Generator):
        return "numpy-generator"
    return None


def generator_states(generators: Mapping[str, Any]) -> dict[str, Any]:
    """Each generator's state, in a form a checkpoint holds (tensors, ints, strings)."""
    states: dict[str, Any] = {}
    for name, gen in generators.items():
        kind = _kind(gen)
        if kind == "torch":
            states[name] = gen.get_state()
        elif kind == "python":
            states[name] = gen.getstate()
        elif kind == "numpy":
            states[name] = gen.get_state()
        else:
            states[name] = gen.bit_generator.state
    return states


def set_generator_states(generators: Mapping[str, Any], states: Mapping[str, Any], where: str) -> None:
    """Put each generator back; ConfigError naming ``where`` when a state is missing."""
    missing = sorted(set(generators) - set(states))
    if missing:
        raise ConfigError(f"{where} has no state for the generators {missing}; it was saved without them")
    for name, gen in generators.items():
        kind, state = _kind(gen), states[name]
        if kind == "torch":
            gen.set_state(state.clone())
        elif kind == "python":
            version, internal, gauss = state
            gen.setstate((version, tuple(internal), gauss))
        elif kind == "numpy":
            label, keys, pos, has_gauss, cached = state
            numpy = sys.modules["numpy"]
            keys = keys.numpy() if isinstance(keys, torch.Tensor) else keys
            gen.set_state((label, numpy.asarray(keys, dtype=numpy.uint32), pos, has_gauss, cached))
        else:
            gen.bit_generator.state = state


@dataclass(frozen=True)
class Streams:
    """A rank's random streams and data cursor at one moment."""

    rng: dict[str, Any]
    """:func:`~resilient.core.state.capture_rng`'s streams (torch, cuda, python, numpy)."""
    generators: dict[str, Any]
    consumed: int | None
    """The loader's cursor (None: no loader)."""

    def to_payload(self) -> dict[str, Any]:
        return {"rng": self.rng, "generators": self.generators, "consumed": self.consumed}

    @classmethod
    def from_payload(cls, d: Mapping[str, Any]) -> Streams:
        return cls(rng=dict(d["rng"]), generators=dict(d.get("generators") or {}), consumed=d.get("consumed"))


def moved(expected: Streams, now: Streams) -> list[str]:
    """The names of what differs between two moments: ``torch``, ``cuda``, ``python``, ``numpy``,
    ``generator NAME``, ``data``."""
    found = [name for name in sorted(set(expected.rng) | set(now.rng))
             if not _same(expected.rng.get(name), now.rng.get(name))]
    found += [f"generator {name}" for name in sorted(set(expected.generators) | set(now.generators))
              if not _same(expected.generators.get(name), now.generators.get(name))]
    if expected.consumed is not None and now.consumed is not None and expected.consumed != now.consumed:
        found.append("data")
    return found


def _same(a: Any, b: Any) -> bool:
    """Equal streams, whatever mix of tensors, numpy arrays and Python values each is held in."""
    if _array(a) or _array(b):
        if not (_array(a) and _array(b)):
            return False
        x, y = torch.as_tensor(a), torch.as_tensor(b)
        return x.shape == y.shape and bool(torch.equal(x.to(torch.int64), y.to(torch.int64)))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


def _array(x: Any) -> bool:
    return isinstance(x, torch.Tensor) or (type(x).__module__ == "numpy" and hasattr(x, "shape"))


@dataclass(frozen=True)
class Fetched:
    """The newest fetch through ``run.prefetch`` (:func:`.resume.prefetch`): for which step, and the streams around it."""

    for_step: int
    """The step whose batch it fetched (the next one when made in a step's body)."""
    before: Streams
    after: Streams

    def to_payload(self) -> dict[str, Any]:
        return {"for_step": self.for_step, "before": self.before.to_payload(), "after": self.after.to_payload()}


@dataclass
class Expected:
    """What the first step after a restore must find (:func:`.resume.verify`)."""

    step: int
    source: str
    """The checkpoint restored (a memory-tier one is ``memory:...``)."""
    streams: Streams
    """The streams and cursor the saving run had at this step's start."""
    refetch: tuple[Streams, Streams] | None = None
    """The saving run had fetched this step's batch ahead (``run.prefetch``): the streams right before and right
    after that fetch, which the resumed script's own fetch must go from and to; None once it did (or without a
    prefetch)."""
