"""``resilient deploy render --target slurm|k8s|compose|systemd TOPOLOGY``: the files to deploy a run.

The work is in :mod:`resilient.deploy`; this writes the files, and never over
a file that is there (a user's edits are theirs) unless ``--force``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..deploy.render import TARGETS


def add_parser(commands: Any) -> None:
    group = commands.add_parser("deploy", help="render the files that deploy a run (Slurm, Kubernetes, compose, "
                                               "systemd) from one topology")
    kinds = group.add_subparsers(dest="deploy", metavar="ACTION", required=True)
    p = kinds.add_parser("render", help="write a target's files from a topology file",
                         description="Write the files that deploy the run of TOPOLOGY (a TOML file; see "
                                     "deploy/README.md) on one target.")
    p.add_argument("topology", type=Path, metavar="TOPOLOGY", help="the topology file")
    p.add_argument("--target", required=True, choices=TARGETS, help="where the run is deployed")
    p.add_argument("--out", type=Path, metavar="DIR", help="where the files go (default: ./deploy-TARGET)")
    p.add_argument("--force", action="store_true", help="overwrite files that are already there")
    p.set_defaults(handler=cmd_render)


def cmd_render(args: argparse.Namespace) -> int:
    from ..core.errors import ConfigError
    from ..deploy.render import render
    from ..deploy.topology import load_topology
    from ..metrics.assets import assets_dir

    topology = load_topology(args.topology)
    files = render(topology, args.target, assets=assets_dir(), source=args.topology.name)
    out: Path = args.out if args.out is not None else Path(f"deploy-{args.target}")
    there = sorted(rel for rel in files if (out / rel).exists())
    if there and not args.force:
        raise ConfigError(f"{out} already has {', '.join(there[:3])}{' ...' if len(there) > 3 else ''}: "
                          "give another --out, or --force to overwrite (your edits there are lost)")
    for rel, text in files.items():
        path = out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if text.startswith("#!"):
            path.chmod(0o755)
    print(f"wrote {len(files)} file(s) for {args.target} to {out}: {', '.join(sorted(files))}")
    return 0
