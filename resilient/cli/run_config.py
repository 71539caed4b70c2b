"""``resilient run --config FILE.toml``: the flags of ``resilient run`` from a file, the command line over it.

Every key is a flag's name without its dashes (``nproc-per-node = 2``; ``nproc_per_node`` is the same key),
and every flag is a key.  A flag without a value is a boolean (``quiet = true``; ``false`` leaves it out);
a repeatable flag takes a list (``health-path = ["/ckpt", "/data"]``), and one of ``KEY=VALUE`` also a table
(``section-timeout = {step = 30}``, ``detector = {"straggler.rule.decision" = 12}``).  The script and its
arguments stay on the command line.  A flag given on the command line wins: a single one is parsed after
the file's, and a repeatable one replaces the file's list.

The file is turned into flags before the command line is parsed (:func:`expand`), so it is checked exactly
as typed flags are, and a key that is no flag is refused naming the nearest one.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tomllib

from ..core.errors import ConfigError

CONFIG_FLAG = "--config"


def _flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Long flag name without dashes (hyphenated) -> its action, for every flag of ``parser``."""
    out = {}
    for action in parser._actions:
        for option in action.option_strings:
            if option.startswith("--") and option not in ("--help", CONFIG_FLAG):
                out[option[2:].replace("_", "-")] = action
    return out


def _takes_value(action: argparse.Action) -> bool:
    return action.nargs != 0


def _split(argv: Sequence[str], flags: Mapping[str, argparse.Action]) -> int:
    """Index of the first token that is neither a flag nor a flag's value (the script), or len(argv)."""
    i = 0
    while i < len(argv):
        token = argv[i]
        if not token.startswith("-") or token in ("-", "--"):
            return i
        i += 1
        if token.startswith("--") and "=" not in token:
            name = token[2:].replace("_", "-")
            action = flags.get(name)
            if name == CONFIG_FLAG[2:] or (action is not None and _takes_value(action)):
                i += 1  # its value
    return i


def load(path: Path, parser: argparse.ArgumentParser) -> dict[str, list[str]]:
    """The flags ``path`` gives, by flag name: each as the tokens it stands for (``["--spares", "1"]``)."""
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config {path}: not TOML: {e}") from None
    flags = _flags(parser)
    out: dict[str, list[str]] = {}
    for key, value in raw.items():
        name = key.replace("_", "-")
        action = flags.get(name)
        if action is None:
            near = difflib.get_close_matches(name, list(flags), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ConfigError(f"--config {path}: {key!r} is not a flag of resilient run{hint}; every key is a flag's "
                              "name without its dashes, e.g. nproc-per-node = 2")
        flag, where = f"--{name}", f"--config {path}: {key}"
        if not _takes_value(action):
            if not isinstance(value, bool):
                raise ConfigError(f"{where} = {value!r}: {flag} takes no value: write true (or false to leave it out)")
            out[name] = [flag] if value else []
        elif isinstance(action, argparse._AppendAction):
            items: list[Any]
            if isinstance(value, Mapping):
                items = [f"{k}={_scalar(v, where)}" for k, v in value.items()]
            elif isinstance(value, list):
                items = value
            else:
                items = [value]
            out[name] = [token for item in items for token in (flag, _scalar(item, where))]
        else:
            out[name] = [flag, _scalar(value, where)]
    return out


def _scalar(value: Any, where: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str)):
        return str(value)
    raise ConfigError(f"{where} = {value!r}: give a number or a string (a list or a table only for a repeatable flag)")


def expand(argv: Sequence[str], parser: argparse.ArgumentParser) -> list[str]:
    """``argv`` of ``resilient run`` (after ``run``) with ``--config FILE`` replaced by the file's flags, put
    before the command line's so that those win; a repeatable flag on the command line drops the file's."""
    flags = _flags(parser)
    end = _split(argv, flags)
    head, tail = list(argv[:end]), list(argv[end:])
    found = [i for i, token in enumerate(head) if token == CONFIG_FLAG or token.startswith(CONFIG_FLAG + "=")]
    if not found:
        return list(argv)
    if len(found) > 1:
        raise ConfigError("--config given twice: give one file")
    i = found[0]
    if head[i] == CONFIG_FLAG:
        if i + 1 >= len(head):
            raise ConfigError("--config needs a file: --config FILE.toml")
        path, rest = head[i + 1], head[:i] + head[i + 2:]
    else:
        path, rest = head[i].split("=", 1)[1], head[:i] + head[i + 1:]
    given = load(Path(path), parser)
    typed = {token.lstrip("-").split("=", 1)[0].replace("_", "-") for token in rest if token.startswith("--")}
    from_file = [token for name, tokens in given.items()
                 if not (name in typed and isinstance(flags[name], argparse._AppendAction)) for token in tokens]
    return [*from_file, *rest, *tail]
