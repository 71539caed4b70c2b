"""``resilient incident ls|show|bundle|release|replay``: a run's incidents, listed, shown, bundled, replayed.

The work is in :mod:`resilient.agent.incident_view` and
:mod:`resilient.agent.incident_bundle`; the records are the agents'
(``<run_dir>/incidents/<id>.json``), read-only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any


def add_parser(commands: Any) -> None:
    group = commands.add_parser("incident", help="a run's incidents: list them, show one")
    verbs = group.add_subparsers(dest="incident", metavar="VERB", required=True)
    ls = verbs.add_parser("ls", help="one line per incident: id, time, kind, step, first failure",
                          description="List the run's incidents, oldest first, one line each.")
    ls.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the --run-dir of `resilient run`")
    ls.add_argument("--json", action="store_true", help="the records, as a JSON list")
    ls.set_defaults(handler=cmd_ls)
    show = verbs.add_parser("show", help="one incident: its failure, traceback, samples, stacks, decision",
                            description="Show one incident whole (ID, or a prefix only it has).")
    _names_an_incident(show)
    show.add_argument("--json", action="store_true", help="the record as the agent wrote it")
    show.set_defaults(handler=cmd_show)
    bundle = verbs.add_parser(
        "bundle", help="one incident in a tarball: record, events, logs, script, data position, its checkpoint",
        description="Bundle an incident to investigate it elsewhere: its record, the events around it, every "
                    "rank's log, error file and stacks, the launch record (command, settings, versions), the "
                    "script and its hash, the failing step's samples, and the newest committed checkpoint at or "
                    "before the failing step, pinned until `resilient incident release` (copied when small "
                    "enough, else referenced). The run token is never in it.")
    _names_an_incident(bundle)
    bundle.add_argument("--out", type=Path, metavar="FILE", help="the tarball (default ./incident-ID.tar.gz)")
    copy = bundle.add_mutually_exclusive_group()
    copy.add_argument("--with-checkpoint", dest="with_checkpoint", action="store_const", const=True,
                      help="copy the checkpoint whatever its size")
    copy.add_argument("--no-checkpoint-copy", dest="with_checkpoint", action="store_const", const=False,
                      help="reference the checkpoint only (still pinned)")
    bundle.add_argument("--max-checkpoint-bytes", type=int, default=None, metavar="N",
                        help="copy a checkpoint up to N bytes (default 1 GiB); a larger one is referenced")
    bundle.add_argument("--endpoint-url", help="S3-compatible endpoint of an s3:// checkpoint location (default: "
                        "$RESILIENT_S3_ENDPOINT_URL, else AWS)")
    bundle.set_defaults(handler=cmd_bundle, with_checkpoint=None)
    rel = verbs.add_parser("release", help="let retention delete the checkpoint an incident's bundle pinned",
                           description="Release the pins an incident's bundle put on its run's checkpoints.")
    _names_an_incident(rel)
    rel.add_argument("--endpoint-url", help="S3-compatible endpoint (default: $RESILIENT_S3_ENDPOINT_URL, else AWS)")
    rel.set_defaults(handler=cmd_release)
    rep = verbs.add_parser(
        "replay", help="run a bundled incident's failing step again; exit 0 when the failure came back",
        description="Unpack the bundle, restore its checkpoint, run the bundled script with the run's arguments "
                    "on --ranks processes (the run's world size by default) up to and through the failing step, and "
                    "say whether the same exception came back at the same step, with the samples each read. "
                    "It first prints the script's path and SHA-256 and runs nothing without --yes: a bundle's "
                    "script is code, run as you. Exit 0: reproduced; 1: not; 2: not run.")
    rep.add_argument("bundle", type=Path, metavar="BUNDLE", help="the tarball `resilient incident bundle` wrote")
    rep.add_argument("--ranks", type=int, metavar="N", help="processes to replay on (default: the run's world size)")
    rep.add_argument("--workdir", type=Path, metavar="DIR", help="where to unpack and run (default: a new temp dir)")
    rep.add_argument("--timeout", type=float, default=600.0, metavar="S", help="give up after S seconds (600)")
    rep.add_argument("--endpoint-url", help="S3-compatible endpoint of a referenced s3:// checkpoint")
    rep.add_argument("--yes", action="store_true",
                     help="run the bundled script (read what it is first: the replay prints it without --yes)")
    rep.set_defaults(handler=cmd_replay)


def _names_an_incident(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the --run-dir of `resilient run`")
    parser.add_argument("id", metavar="ID", help="the incident's id (from `resilient incident ls`), or a prefix "
                        "only it has")


def cmd_ls(args: argparse.Namespace) -> int:
    from ..agent.incident_view import incidents_of, lines

    records = incidents_of(args.run_dir)
    if args.json:
        print(json.dumps(records, indent=1))
    elif not records:
        print(f"no incidents in {args.run_dir}")
    else:
        width = max(80, shutil.get_terminal_size().columns) if sys.stdout.isatty() else None  # piped: whole lines
        print("\n".join(lines(records, width=width)))
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from ..agent.incident_view import find, incidents_of, render

    record = find(incidents_of(args.run_dir), args.id, args.run_dir)
    print(json.dumps(record, indent=1) if args.json else render(record))
    return 0


def cmd_bundle(args: argparse.Namespace) -> int:
    from ..agent.incident_bundle import CHECKPOINT_LIMIT, make_bundle
    from .checkpoint_cmd import human_size, resolve_endpoint

    limit = args.max_checkpoint_bytes if args.max_checkpoint_bytes is not None else CHECKPOINT_LIMIT
    made = make_bundle(args.run_dir, args.id, args.out, with_checkpoint=args.with_checkpoint, limit=limit,
                       endpoint_url=resolve_endpoint(args.endpoint_url, os.environ))
    ckpt = made.index.get("checkpoint") or {}
    print(f"bundled incident {made.index['incident']} into {made.path} ({human_size(made.bytes)})")
    if ckpt.get("name"):
        how = "copied" if ckpt.get("copied") else "referenced, not copied"
        print(f"checkpoint {ckpt['name']} ({human_size(ckpt['bytes'])}) in {ckpt['location']}: {how}; pinned until "
              f"`resilient incident release {args.run_dir} {made.index['incident']}`")
    elif ckpt:
        print(ckpt.get("note"))
    return 0


def cmd_release(args: argparse.Namespace) -> int:
    from ..agent.incident_bundle import release
    from .checkpoint_cmd import resolve_endpoint

    done = release(args.run_dir, args.id, resolve_endpoint(args.endpoint_url, os.environ))
    names = ", ".join(done["released"]) or "nothing (no pin of it)"
    print(f"incident {done['incident']}: released {names} in {done['location']}")
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from ..agent.incident_replay import prepare, replay
    from ..core.errors import ConfigError
    from .checkpoint_cmd import resolve_endpoint

    if args.ranks is not None and args.ranks < 1:
        raise ConfigError(f"--ranks {args.ranks}: replay on at least one process")
    prepared = prepare(args.bundle, ranks=args.ranks, workdir=args.workdir)
    print("\n".join(prepared.lines))
    if not args.yes:
        print("not run: the bundle's script is code that runs as you. Read it (above), then run this again with "
              "--yes", file=sys.stderr)
        return 2
    report = replay(prepared, timeout_s=args.timeout, endpoint_url=resolve_endpoint(args.endpoint_url, os.environ))
    print("\n".join(report.lines))
    print(f"work directory: {report.workdir}")
    return 0 if report.reproduced else 1

