"""Entry point of the ``resilient`` command: parsing, dispatch and error reporting.

Each subcommand module registers its parser with ``add_parser`` and sets a
``handler(args) -> int``.  Handlers import torch and the checkpoint code
inside the function, so building the parser (``resilient --help``) stays
cheap.  Exit codes: 0 success, 1 a check failed (e.g. a corrupt
checkpoint), 2 a usage or storage error, reported on stderr as
``resilient: error: <message>``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from ..core.errors import ResilientError
from . import (
    checkpoint_cmd,
    dashboards_cmd,
    deploy_cmd,
    detectors_cmd,
    diagnose_cmd,
    drill_cmd,
    incident_cmd,
    local_cluster_cmd,
    quarantine_cmd,
    report_cmd,
    run_cmd,
    run_config,
    status_cmd,
    stop_cmd,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="resilient",
        description="Tools for resilient training runs.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    run_cmd.add_parser(commands)
    status_cmd.add_parser(commands)
    stop_cmd.add_parser(commands)
    detectors_cmd.add_parser(commands)
    quarantine_cmd.add_parser(commands)
    diagnose_cmd.add_parser(commands)
    drill_cmd.add_parser(commands)
    report_cmd.add_parser(commands)
    incident_cmd.add_parser(commands)
    checkpoint_cmd.add_parser(commands)
    dashboards_cmd.add_parser(commands)
    deploy_cmd.add_parser(commands)
    local_cluster_cmd.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:
        try:
            argv = ["run", *run_config.expand(argv[1:], _subcommand(parser, "run"))]
        except ResilientError as e:
            print(f"resilient: error: {e}", file=sys.stderr)
            return 2
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version and usage errors; argparse already printed
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    try:
        return int(args.handler(args))
    except ResilientError as e:
        print(f"resilient: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("resilient: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        if not _stdout_gone():
            raise  # a pipe of the command's own broke: a failure to show, not a reader that went away
        # The reader went away (``| head``); don't let the interpreter complain at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _stdout_gone() -> bool:
    """Whether standard output is a pipe whose reader is gone (what a BrokenPipeError from ``| head`` means)."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        return True
    except (OSError, ValueError):
        return False
    try:
        os.write(sys.stdout.fileno(), b"")
    except BrokenPipeError:
        return True
    except (OSError, ValueError):
        return False
    return False


def _subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The parser of subcommand ``name``."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]
    raise KeyError(name)


def _version() -> str:
    from .. import __version__

    return __version__
