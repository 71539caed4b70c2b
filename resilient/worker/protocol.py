"""Worker heartbeats: the datagram format shared by the worker's sender and the agent's receiver.

A worker reports each section it enters (``init``, ``restore``, ``data``,
``step``, ``checkpoint`` or a user's name) to its node agent as one UTF-8
JSON object in one unix ``SOCK_DGRAM`` datagram::

    {"v": 2, "g": 3, "rank": 0, "local_rank": 0, "pid": 123, "section": "step", "step": 41,
     "seq": 97, "kind": "section", "checkpoint": null, "committed_step": 40}

``g`` is the worker's generation (``RESILIENT_GENERATION``): the agent
counts a heartbeat only when it comes from the generation it is running,
so a worker of an earlier one (a datagram still queued from before a
restart, a worker an earlier agent left) can neither look alive nor report
progress.  Version 1 had no ``g``; it still decodes (``generation`` None),
and the agent's tracker treats it like any other generation's.

``kind`` is ``hello`` (first message of a process; only it carries
``checkpoint``, the checkpoint location), ``section`` (entered a section),
``restored`` (the worker finished its restore; only it carries
``restored``: ``{"checkpoint": name or null, "step": int or null,
"seconds": float}``, null checkpoint meaning a fresh start) or ``bye`` (no
more heartbeats will come: finished or stopped).  ``committed_step`` is the
newest committed checkpoint step the worker knows.

``restored`` came after version 2 without a version change: it is always
sent as a single datagram, never inside a batch, so an agent that predates
it rejects that one datagram (unknown kind, counted as malformed) and
nothing else, and this agent still takes every version 1 and 2 sender.

The sender sits in the training loop, so it never blocks and never raises:
a datagram the agent cannot take (no agent, socket gone, queue full) is
dropped and counted; ``seq`` lets the agent see any gap.  Datagrams on
one socket keep their order, but the kernel queues only
``net.unix.max_dgram_qlen`` (default 10) of them per receiving socket: ranks
that share one socket overflow it with their synchronised bursts at step
boundaries (measured here: 8 ranks sending 4 heartbeats every 10 ms lost
40%).  Give each local rank its own socket, one :class:`~resilient.agent.heartbeat.HeartbeatReceiver`
each (the same load lost nothing).

A worker under the agent sends through :class:`~resilient.worker.heartbeat.BatchingSender`: each
heartbeat carries the monotonic time of its event; it is sent at once when
the previous datagram left 100 ms ago or more, else queued, and a thread
sends what is queued every 100 ms as one batch datagram
(``{"v", "g", "rank", "local_rank", "pid", "rows": [[kind, section, step, seq,
t, committed_step, tokens, samples, save, checkpoint], ...]}``), so a step
pays about a microsecond per section instead of a system call and a
wake-up of the agent in fast loops, while slower steps report each section
as it is entered.  The receiver hands each heartbeat over with its own
event time (the worker's and the agent's monotonic clocks are the same
clock on one host).

``recovery`` (in-process recovery, also without a version change and
also always alone) carries ``recovery``: an object whose string
``event`` says what happened: ``ready`` (this worker can recover in
process: a member at its first ``run.attempt()``, a spare once it waits
for an assignment), ``waiting`` (a survivor left the failed group and
waits for its next generation), ``rejoined`` (it is in a re-formed group with the
state synced, about to retry the step) or ``gave_up`` (it cannot recover
in process and is about to exit).  The other fields depend on the event;
see ``docs/design/in-process-worker.md`` and ``in-process-agent.md``.  A
spare sends nothing else until it is promoted; after a re-formation ``g``
and ``rank`` are the new generation's.

``timing`` (also alone, also without a version change) carries
``timing``: one window of the rank's step time by section, ``{"w": window
index, "n": steps measured, "step": mean seconds per step, "s": {section:
seconds per step}}`` (see :mod:`resilient.watchdog.timing`).  It is sent
once per window (every few steps), not per step.  ``audit`` (alone too)
carries ``audit``: the replica audit's finding when parameters differ across
data-parallel ranks (:mod:`resilient.run.audit`), sent by the lowest rank.
``notice`` (alone too) carries ``notice``: something the Run found that the
agent says on its console, in ``resilient status`` and in its ledger, an
object whose string ``kind`` is an event kind: ``config_changed`` (the
restored checkpoint was written under another config), ``resume_diverged``
(the first step after a restore is not where the saving run was, and
whether the run accepted it) or ``integration`` (what this rank's script
lets each rung of recovery do, sent once, at its first completed step).

The sender lives in :mod:`resilient.worker.heartbeat`, the receiver in
:mod:`resilient.agent.heartbeat`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from ..core.errors import ResilientError

PROTOCOL_VERSION = 2
"""2 added the generation ``g`` to the header; version 1 (no generation) still decodes."""
VERSIONS = (1, 2)
KINDS = ("hello", "section", "restored", "bye", "recovery", "timing", "audit", "notice")
REPORTS = ("restored", "recovery", "timing", "audit", "notice")
"""The kinds that carry an object of their own, in a field of the same name (each always sent alone)."""
RECOVERY_EVENTS = ("ready", "waiting", "rejoined", "gave_up")
"""The ``event`` of a ``recovery`` message this version sends (a receiver should tolerate others)."""
MAX_DATAGRAM = 65536
ROWS_PER_DATAGRAM = 150
"""Rows per batch datagram: about 100 bytes each, well inside MAX_DATAGRAM."""


class HeartbeatError(ResilientError):
    """A datagram is not a valid heartbeat."""


@dataclass(frozen=True)
class Heartbeat:
    """One message from a worker to its agent."""

    rank: int
    local_rank: int
    pid: int
    section: str
    step: int
    seq: int
    kind: str
    checkpoint: str | None = None
    """Checkpoint directory or URL (hello only)."""
    committed_step: int | None = None
    """Newest committed checkpoint step known to the worker."""
    tokens: int = 0
    """The rank's cumulative token counter (``Run.tokens``)."""
    samples: int = 0
    """The rank's cumulative sample counter (``Run.samples``)."""
    save: dict[str, Any] | None = None
    """A save that finished since the last heartbeat: step, duration_s, bytes, ok."""
    t: float | None = None
    """When the worker entered the section, on its ``time.monotonic`` clock (set by batched senders)."""
    generation: int | None = None
    """The worker's generation (``g`` on the wire); None from a version 1 sender."""
    restored: dict[str, Any] | None = None
    """``restored`` only: the checkpoint name (None: fresh start), its step and the restore's seconds."""
    recovery: dict[str, Any] | None = None
    """``recovery`` only: ``{"event": "ready" | "rejoined" | "gave_up", ...}`` (see the module docstring)."""
    timing: dict[str, Any] | None = None
    """``timing`` only: one window of step time by section (see the module docstring)."""
    audit: dict[str, Any] | None = None
    """``audit`` only: which ranks and tensors differ from the other replicas."""
    notice: dict[str, Any] | None = None
    """``notice`` only: ``{"kind": an event kind, ...}`` (see the module docstring)."""
    v: int = PROTOCOL_VERSION


_INT_FIELDS = ("rank", "local_rank", "pid", "step", "seq")
_COUNTERS = ("tokens", "samples")  # optional: absent means 0


def encode(hb: Heartbeat) -> bytes:
    obj = asdict(hb)
    generation = obj.pop("generation")
    if hb.v >= 2:
        obj["g"] = generation
    return json.dumps(obj, separators=(",", ":")).encode()


ROW_FIELDS = ("kind", "section", "step", "seq", "t", "committed_step", "tokens", "samples", "save", "checkpoint")


def decode_datagram(data: bytes) -> list[Heartbeat]:
    """One datagram: a single heartbeat, or a batch ``{"v", "g", "rank", "local_rank", "pid", "rows": [[...], ...]}``
    whose rows list :data:`ROW_FIELDS` in order.  Raises :class:`HeartbeatError` for anything malformed."""
    obj = _loads(data)
    rows = obj.get("rows")
    if rows is None:
        return [_validate(obj)]
    if not isinstance(rows, list):
        raise HeartbeatError(f"field 'rows' must be a list, got {type(rows).__name__}")
    head = {k: obj.get(k) for k in ("v", "g", "rank", "local_rank", "pid") if k in obj}
    found = []
    for row in rows:
        if not isinstance(row, list) or len(row) != len(ROW_FIELDS):
            raise HeartbeatError(f"a batch row must be a list of {len(ROW_FIELDS)} values, got {row!r:.80}")
        found.append(_validate({**head, **dict(zip(ROW_FIELDS, row))}))
    return found


def _loads(data: bytes) -> Any:
    try:
        obj = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HeartbeatError(f"not UTF-8 JSON: {e}") from None
    if not isinstance(obj, dict):
        raise HeartbeatError(f"not a JSON object but {type(obj).__name__}")
    return obj


def decode(data: bytes) -> Heartbeat:
    """Parse and validate one single-heartbeat datagram; raise :class:`HeartbeatError` saying what is wrong."""
    return _validate(_loads(data))


def _validate(obj: Any) -> Heartbeat:
    if not isinstance(obj, dict):
        raise HeartbeatError(f"not a JSON object but {type(obj).__name__}")
    if not _is_int(obj.get("v")) or obj["v"] not in VERSIONS:
        raise HeartbeatError(f"protocol version {obj.get('v')!r}, this agent speaks {' and '.join(map(str, VERSIONS))}")
    version: int = obj["v"]
    generation: Any = obj.get("g")
    if version >= 2 and not (_is_int(generation) and generation >= 0):
        raise HeartbeatError(f"field 'g' (generation) must be an integer >= 0 in version {version}, got {generation!r}")
    for key in _INT_FIELDS:
        if not _is_int(obj.get(key)):
            raise HeartbeatError(f"field {key!r} must be an integer, got {obj.get(key)!r}")
    if obj.get("kind") not in KINDS:
        raise HeartbeatError(f"field 'kind' must be one of {KINDS}, got {obj.get('kind')!r}")
    section = obj.get("section")
    if not isinstance(section, str) or not section:
        raise HeartbeatError(f"field 'section' must be a non-empty string, got {section!r}")
    checkpoint = obj.get("checkpoint")
    if checkpoint is not None and not isinstance(checkpoint, str):
        raise HeartbeatError(f"field 'checkpoint' must be a string or null, got {checkpoint!r}")
    committed = obj.get("committed_step")
    if committed is not None and not _is_int(committed):
        raise HeartbeatError(f"field 'committed_step' must be an integer or null, got {committed!r}")
    for key in _COUNTERS:
        if not _is_int(obj.get(key, 0)):
            raise HeartbeatError(f"field {key!r} must be an integer, got {obj.get(key)!r}")
    t = obj.get("t")
    if t is not None and not (isinstance(t, int | float) and not isinstance(t, bool)):
        raise HeartbeatError(f"field 't' must be a number or null, got {t!r}")
    save = obj.get("save")
    if save is not None and not (isinstance(save, dict) and _is_int(save.get("step"))):
        raise HeartbeatError(f"field 'save' must be null or an object with an integer step, got {save!r}")
    restored = obj.get("restored")
    if obj["kind"] == "restored":
        _check_restored(restored)
    elif restored is not None:
        raise HeartbeatError(f"field 'restored' belongs to kind 'restored' only, got it with {obj['kind']!r}")
    recovery = obj.get("recovery")
    if obj["kind"] == "recovery":
        if not (isinstance(recovery, dict) and isinstance(recovery.get("event"), str) and recovery["event"]):
            raise HeartbeatError(f"kind 'recovery' needs an object 'recovery' with a string 'event', got {recovery!r:.80}")
    elif recovery is not None:
        raise HeartbeatError(f"field 'recovery' belongs to kind 'recovery' only, got it with {obj['kind']!r}")
    timing = obj.get("timing")
    if obj["kind"] == "timing":
        if not (isinstance(timing, dict) and isinstance(timing.get("s"), dict)
                and all(_is_int(timing.get(k)) for k in ("w", "n"))):
            raise HeartbeatError(f"kind 'timing' needs an object 'timing' with integers w, n and an object s, "
                                 f"got {timing!r:.80}")
    elif timing is not None:
        raise HeartbeatError(f"field 'timing' belongs to kind 'timing' only, got it with {obj['kind']!r}")
    audit = obj.get("audit")
    if obj["kind"] == "audit":
        if not (isinstance(audit, dict) and isinstance(audit.get("ranks"), list)):
            raise HeartbeatError(f"kind 'audit' needs an object 'audit' with a list 'ranks', got {audit!r:.80}")
    elif audit is not None:
        raise HeartbeatError(f"field 'audit' belongs to kind 'audit' only, got it with {obj['kind']!r}")
    notice = obj.get("notice")
    if obj["kind"] == "notice":
        if not (isinstance(notice, dict) and isinstance(notice.get("kind"), str) and notice["kind"]):
            raise HeartbeatError(f"kind 'notice' needs an object 'notice' with a string 'kind', got {notice!r:.80}")
    elif notice is not None:
        raise HeartbeatError(f"field 'notice' belongs to kind 'notice' only, got it with {obj['kind']!r}")
    return Heartbeat(
        rank=obj["rank"], local_rank=obj["local_rank"], pid=obj["pid"], section=section, step=obj["step"],
        seq=obj["seq"], kind=obj["kind"], checkpoint=checkpoint, committed_step=committed,
        tokens=obj.get("tokens", 0), samples=obj.get("samples", 0), save=save,
        t=float(t) if t is not None else None, generation=generation if version >= 2 else None, v=version,
        restored=restored, recovery=recovery, timing=timing, audit=audit, notice=notice,
    )


def _check_restored(restored: Any) -> None:
    if not isinstance(restored, dict):
        raise HeartbeatError(f"kind 'restored' needs an object 'restored', got {restored!r:.80}")
    name, step, seconds = restored.get("checkpoint"), restored.get("step"), restored.get("seconds")
    if name is not None and not isinstance(name, str):
        raise HeartbeatError(f"restored.checkpoint must be a string or null, got {name!r}")
    if step is not None and not _is_int(step):
        raise HeartbeatError(f"restored.step must be an integer or null, got {step!r}")
    if not (isinstance(seconds, int | float) and not isinstance(seconds, bool) and seconds >= 0):
        raise HeartbeatError(f"restored.seconds must be a number >= 0, got {seconds!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
