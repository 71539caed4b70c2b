"""The detectors' settings as one tree of dotted keys, read and changed on a running job.

``straggler.rule.decision``, ``slowdown.enabled``, ``straggler.min_history``:
every field of :class:`~resilient.watchdog.straggler.StragglerConfig` and
:class:`~resilient.watchdog.slowdown.SlowdownConfig` (with their
:class:`~resilient.watchdog.cusum.CusumRule`) by its path.  A change is
validated by building the new configs, so a bad value is refused with the
config's own message and nothing changes; the agent applies an accepted
change from the next window on (:mod:`resilient.agent.slowness`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ..core.errors import ConfigError
from .slowdown import SlowdownConfig
from .straggler import StragglerConfig

Configs = tuple[StragglerConfig, SlowdownConfig]
ROOTS = ("straggler", "slowdown")


def flatten(configs: Configs) -> dict[str, Any]:
    """Every setting by its dotted key, e.g. ``{"straggler.rule.decision": 10.0, ...}``."""
    out: dict[str, Any] = {}

    def walk(prefix: str, obj: Any) -> None:
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                walk(f"{prefix}{f.name}.", value)
            else:
                out[f"{prefix}{f.name}"] = value

    for root, config in zip(ROOTS, configs, strict=True):
        walk(f"{root}.", config)
    return out


def parse_value(text: str) -> Any:
    """A command-line value: true/false, an int, a float, else the text."""
    lowered = text.strip().lower()
    if lowered in ("true", "on", "yes"):
        return True
    if lowered in ("false", "off", "no"):
        return False
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            continue
    return text


def apply(configs: Configs, changes: Mapping[str, Any]) -> Configs:
    """``configs`` with ``changes`` (dotted key -> value) applied; ConfigError naming a bad key or value."""
    known = flatten(configs)
    for key, value in changes.items():
        if key not in known:
            raise ConfigError(f"unknown detector setting {key!r}; the settings are: {', '.join(sorted(known))}")
        old = known[key]
        if isinstance(old, bool) != isinstance(value, bool) or not isinstance(value, (int, float, bool)):
            raise ConfigError(f"detector setting {key}={value!r}: expected a {type(old).__name__} like {old!r}")
        if isinstance(old, int) and not isinstance(old, bool) and not isinstance(value, int):
            raise ConfigError(f"detector setting {key}={value!r}: expected an int (windows), like {old!r}")
    new = []
    for root, config in zip(ROOTS, configs, strict=True):
        mine = {k[len(root) + 1:]: v for k, v in changes.items() if k.startswith(root + ".")}
        new.append(_replace(config, mine))
    return new[0], new[1]


def _replace(obj: Any, changes: Mapping[str, Any]) -> Any:
    """``obj`` (a frozen dataclass) with dotted ``changes`` applied; its ``__post_init__`` validates."""
    if not changes:
        return obj
    direct = {k: v for k, v in changes.items() if "." not in k}
    nested: dict[str, dict[str, Any]] = {}
    for k, v in changes.items():
        if "." in k:
            head, rest = k.split(".", 1)
            nested.setdefault(head, {})[rest] = v
    for head, sub in nested.items():
        direct[head] = _replace(getattr(obj, head), sub)
    return dataclasses.replace(obj, **direct)
