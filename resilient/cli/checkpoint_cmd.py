"""``resilient checkpoint ls|verify|inspect|gc``: examine a checkpoint store from a shell.

Formatting only: the work is done by :mod:`resilient.checkpoint.inspect`,
imported inside each handler so the parser can be built without torch.
The S3 endpoint comes from ``--endpoint-url``, else from the environment
variable named by :data:`ENDPOINT_ENV`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from ..checkpoint.storage import GC_MIN_AGE_S
from ..core.errors import CheckpointCorruptError, CheckpointError, ConfigError

if TYPE_CHECKING:
    from ..checkpoint.inspect import GcReport, VerifyReport
    from ..checkpoint.storage import Storage

ENDPOINT_ENV = "RESILIENT_S3_ENDPOINT_URL"


def add_parser(commands: Any) -> None:
    """Register ``checkpoint`` and its actions on the top-level subparsers."""
    group = commands.add_parser("checkpoint", help="list, verify, inspect and garbage-collect checkpoints")
    actions = group.add_subparsers(dest="action", metavar="ACTION", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("location", metavar="PATH_OR_S3_URL", help="checkpoint directory or s3://bucket/prefix")
    common.add_argument("--endpoint-url", help=f"S3-compatible endpoint (default: ${ENDPOINT_ENV}, else AWS)")
    common.add_argument("--json", action="store_true", help="print JSON instead of tables")

    ls = actions.add_parser("ls", parents=[common], help="list committed checkpoints (reads manifests only)")
    ls.set_defaults(handler=cmd_ls)

    verify = actions.add_parser("verify", parents=[common], help="check sizes, digests and decoding of every file")
    verify.add_argument("names", nargs="*", metavar="NAME", help="checkpoints to verify (default: the newest)")
    verify.add_argument("--all", action="store_true", help="verify every committed checkpoint")
    verify.set_defaults(handler=cmd_verify)

    insp = actions.add_parser("inspect", parents=[common], help="show manifest, counters and tensors of one checkpoint")
    insp.add_argument("name", nargs="?", metavar="NAME", help="checkpoint to inspect (default: the newest)")
    insp.set_defaults(handler=cmd_inspect)

    gc = actions.add_parser(
        "gc",
        parents=[common],
        help="apply retention and remove leftovers of crashed saves",
        description="Keep the newest K checkpoints, every M-th step and the newest one that passes "
        "verification; delete the rest, and leftovers of crashed saves. Safe beside a live job: on a directory "
        "it takes the location's lock (a commit never runs in the middle of it), and a save written to within "
        "--min-age seconds is taken for one in progress and left alone (listed as skipped).",
    )
    gc.add_argument("--keep", type=int, required=True, metavar="K", help="newest checkpoints to keep (>= 1)")
    gc.add_argument("--permanent-every", type=int, metavar="M", help="also keep steps that are multiples of M")
    gc.add_argument("--dry-run", action="store_true", help="only say what would be removed")
    gc.add_argument("--min-age", type=float, default=GC_MIN_AGE_S, metavar="S",
                    help=f"leave saves written to within S seconds alone: they may still be under way (default "
                         f"{GC_MIN_AGE_S:g}; 0 removes every unfinished save, only when no job writes here)")
    gc.set_defaults(handler=cmd_gc)


# ------------------------------------------------------------------ commands
def cmd_ls(args: argparse.Namespace) -> int:
    from ..checkpoint.inspect import list_checkpoints

    storage = open_location(args)
    infos = list_checkpoints(storage)
    quarantined = storage.list_quarantined()
    if args.json:
        _print_json({"location": storage.url, "checkpoints": [asdict(i) for i in infos], "quarantined": quarantined})
        return 0
    if not infos:
        print(f"no committed checkpoints in {storage.url}")
    else:
        now = time.time()
        rows = [
            [
                i.name,
                str(i.step),
                _opt(i.world_size),
                human_size(i.total_bytes),
                _opt(i.n_files),
                _utc(i.created_unix),
                age(now, i.created_unix),
                i.parent or "-",
                "ok" if i.manifest_ok else f"BAD: {i.problem}",
            ]
            for i in infos
        ]
        print(
            format_table(["NAME", "STEP", "WORLD", "SIZE", "FILES", "CREATED (UTC)", "AGE", "PARENT", "STATUS"], rows)
        )
        print("(STATUS checks manifests only; `resilient checkpoint verify` reads the files)")
    print(f"quarantined: {len(quarantined)}" + (f" ({', '.join(quarantined)})" if quarantined else ""))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from ..checkpoint.inspect import verify_checkpoint

    if args.all and args.names:
        raise ConfigError("give checkpoint NAMEs or --all, not both")
    storage = open_location(args)
    names = select(storage, args.names, every=args.all)
    reports = []
    for name in names:
        report = verify_checkpoint(storage, name)
        reports.append(report)
        if not args.json:
            _print_verify(report)
    failed = [r.name for r in reports if not r.ok]
    if args.json:
        _print_json({"location": storage.url, "ok": not failed, "checkpoints": [asdict(r) for r in reports]})
    elif len(reports) > 1:
        print(f"{len(reports)} checkpoints: {len(reports) - len(failed)} ok, {len(failed)} failed")
    return 1 if failed else 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from ..checkpoint.inspect import inspect_checkpoint

    storage = open_location(args)
    (name,) = select(storage, [args.name] if args.name else [], every=False)
    try:
        detail = inspect_checkpoint(storage, name)
    except CheckpointCorruptError as e:
        print(f"resilient: {name}: {e.file}: {e.problem}", file=sys.stderr)
        return 1
    m = detail.manifest
    if args.json:
        body = {"location": storage.url, "manifest": {**asdict(m), "total_bytes": m.total_bytes}}
        _print_json({**body, "files": [asdict(f) for f in detail.files],
                     "sharded": [asdict(t) for t in detail.sharded]})
        return 1 if any(f.problem for f in detail.files) else 0
    fields = [
        ("checkpoint", m.name),
        ("location", storage.url),
        ("step", str(m.step)),
        ("world size", str(m.world_size)),
        ("created", f"{_utc(m.created_unix)} ({age(time.time(), m.created_unix)} ago)"),
        ("parent", m.parent or "-"),
        ("size", f"{human_size(m.total_bytes)} in {len(m.files)} files"),
        ("format", f"{m.schema}, {m.digest_algorithm} in {human_size(m.chunk_bytes)} blocks"
                   f"{', each listed' if all(f.blocks for f in m.files) else ''}"),
        ("counters", _kv(m.counters)),
    ]
    fields += [(f"fingerprint.{k}", _kv(v) if isinstance(v, dict) else str(v)) for k, v in m.fingerprint.items()]
    width = max(len(k) for k, _ in fields)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in fields))
    for f in detail.files:
        owner = "replicated" if f.rank is None else f"rank {f.rank}"
        status = "digest ok" if f.digest_ok else "DIGEST BAD" if f.digest_ok is False else "not read"
        print(f"\n{f.path} ({owner}, {human_size(f.size)}, {status})")
        if f.n_tensors is not None:
            print(f"  tensors   {f.n_tensors} ({human_size(f.tensor_bytes)})")
        if f.keys:
            parts = [f"{k} ({n} tensors, {human_size(b)})" if n else k for k, (n, b) in f.sections.items()]
            print(f"  keys      {', '.join(parts)}")
        if f.counters is not None:
            print(f"  counters  {_kv(f.counters)}")
        if f.data is not None:
            print(f"  data      {_kv(f.data)}")
        if f.problem:
            print(f"  PROBLEM   {f.problem}")
    if detail.sharded:
        print(f"\nsharded state ({len(detail.sharded)} tensors, index {m.index})")
        rows = [[t.key, f"{t.dtype}{list(t.shape)}", f"{', '.join(t.placements)} on mesh {list(t.mesh)}",
                 _chunks(t.chunks)] for t in detail.sharded]
        print("\n".join("  " + line for line in format_table(["tensor", "global", "placement", "chunks"],
                                                             rows).splitlines()))
    return 1 if any(f.problem for f in detail.files) else 0


def _chunks(chunks: Sequence[tuple[int, tuple[int, ...], tuple[int, ...]]], shown: int = 4) -> str:
    """``rank 0 [0:17, 0:8], ...``: which rank's file holds which region (the first ``shown``)."""
    parts = [f"rank {r} [{', '.join(f'{o}:{o + n}' for o, n in zip(offsets, sizes))}]"
             for r, offsets, sizes in chunks[:shown]]
    more = f", ... ({len(chunks)} chunks)" if len(chunks) > shown else ""
    return ", ".join(parts) + more


def cmd_gc(args: argparse.Namespace) -> int:
    from ..checkpoint.inspect import collect

    if args.keep < 1:
        raise ConfigError(f"--keep {args.keep}: keep at least 1 checkpoint")
    if args.permanent_every is not None and args.permanent_every < 1:
        raise ConfigError(f"--permanent-every {args.permanent_every} must be >= 1")
    if not (args.min_age >= 0 and math.isfinite(args.min_age)):
        raise ConfigError(f"--min-age {args.min_age} must be a finite number of seconds >= 0")
    storage = open_location(args)
    report = collect(storage, keep=args.keep, permanent_every=args.permanent_every, dry_run=args.dry_run,
                     min_age_s=args.min_age)
    if args.json:
        _print_json({"location": storage.url, **asdict(report)})
        return 0
    _print_gc(report, args.keep, args.permanent_every)
    return 0


# ------------------------------------------------------------------- helpers
def resolve_endpoint(flag: str | None, environ: Mapping[str, str]) -> str | None:
    """The S3 endpoint: an explicit flag beats the environment, which beats the default (None)."""
    return flag or environ.get(ENDPOINT_ENV) or None


def open_location(args: argparse.Namespace) -> Storage:
    """The storage behind ``args.location``; :class:`ResilientError` if it cannot be used."""
    from ..checkpoint.locations import open_storage

    location: str = args.location
    is_local = "://" not in location
    if is_local and not os.path.isdir(location):
        raise CheckpointError(f"no checkpoint directory at {location}: check the path, or give s3://bucket/prefix")
    if is_local and args.endpoint_url:
        print(f"resilient: warning: --endpoint-url has no effect on the local directory {location}", file=sys.stderr)
    try:
        return open_storage(location, endpoint_url=resolve_endpoint(args.endpoint_url, os.environ))
    except ImportError as e:
        raise ConfigError(f"cannot open {location} ({e}); S3 needs `pip install 'resilient-train[s3]'`") from e


def select(storage: Storage, wanted: Sequence[str], *, every: bool) -> list[str]:
    """Checkpoint names to act on: ``wanted`` (names or step numbers), all, or the newest."""
    from ..checkpoint.manifest import checkpoint_name

    committed = storage.list_committed()
    if not committed:
        raise CheckpointError(f"no committed checkpoints in {storage.url}: check the location (and --endpoint-url)")
    if every:
        return committed
    if not wanted:
        return [committed[-1]]
    names = [checkpoint_name(int(w)) if w.isdigit() else w for w in wanted]
    unknown = [n for n in names if n not in committed]
    if unknown:
        raise CheckpointError(
            f"no committed checkpoint named {', '.join(unknown)} in {storage.url}; "
            "`resilient checkpoint ls` lists the committed ones"
        )
    return names


def _print_verify(report: VerifyReport) -> None:
    rows = []
    for c in report.files:
        if c.size_actual is None:
            size = "missing"
        elif c.size_actual == c.size_expected:
            size = human_size(c.size_actual)
        else:
            size = f"{c.size_actual} B != {c.size_expected} B"
        rows.append([c.path, _opt(c.rank), size, _check(c.digest_ok), _check(c.decode_ok)])
    if rows:
        print(format_table(["FILE", "RANK", "SIZE", "DIGEST", "DECODE"], rows))
    if report.ok:
        total = sum(c.size_expected for c in report.files)
        print(f"OK {report.name}: {len(report.files)} files, {human_size(total)}; sizes, digests and decoding verified")
    else:
        print(f"FAILED {report.name}: {report.problem}")


def _print_gc(report: GcReport, keep: int, permanent_every: int | None) -> None:
    ordered = sorted(report.kept + report.deleted)  # names sort by step: fixed-width
    recent = set(ordered[-keep:])
    for name, problem in report.failed:
        print(f"failed verification: {name}: {problem}")
    print(f"newest verified: {report.newest_verified or 'none'}")
    for name in ordered:
        if name in report.deleted:
            verb = "would delete" if report.dry_run else "deleted"
            print(f"{verb:<13}{name}  (older than the newest {keep}, not permanent, not the newest verified)")
            continue
        why = [
            label
            for label, hit in (
                (f"among the newest {keep}", name in recent),
                (f"step multiple of {permanent_every}", permanent_every and _step(name) % permanent_every == 0),
                ("newest verified", name == report.newest_verified),
            )
            if hit
        ] or ["nothing verified: deleting nothing"]
        print(f"{'keep':<13}{name}  ({', '.join(why)})")
    print(f"policy: {report.reason}")
    if report.dry_run:
        print("dry run: nothing was removed (leftovers of crashed saves are listed only when removed)")
    else:
        print(f"removed {len(report.garbage)} leftovers of crashed saves" + "".join(f"\n  {g}" for g in report.garbage))
    for entry, reason in report.skipped:
        print(f"{'skipped':<13}{entry}  ({reason})")


def human_size(n: int | None) -> str:
    """``n`` bytes in B, KiB, MiB, GiB or TiB."""
    if n is None:
        return "-"
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in [list(headers), *rows]) for i in range(len(headers))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [list(headers), *rows]]
    return "\n".join(lines)


def age(now: float, then: float | None) -> str:
    if then is None:
        return "-"
    seconds = max(0.0, now - then)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"


def _utc(ts: float | None) -> str:
    return "-" if ts is None else datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _step(name: str) -> int:
    from ..checkpoint.manifest import step_of

    return step_of(name) or 0


def _opt(value: object) -> str:
    return "-" if value is None else str(value)


def _check(ok: bool | None) -> str:
    return "-" if ok is None else "ok" if ok else "BAD"


def _kv(d: Mapping[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in d.items()) or "-"


def _print_json(body: Any) -> None:
    print(json.dumps(body, indent=1, default=str))
