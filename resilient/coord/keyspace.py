"""The control store's keyspace: every etcd key of the project is named here, and nowhere else.

The agents and the CLI take a key from here (``LaunchKeys(launch).verdict()``) and hand it to an operation
(:class:`~resilient.agent.shared.SharedFacts`, :class:`~resilient.agent.cluster.ClusterStore`,
:class:`~resilient.coord.rounds.RoundStore`, :class:`~resilient.coord.presence.Presence`,
:class:`~resilient.coord.quarantine.FleetQuarantine`); the mechanism underneath (:mod:`.etcd`,
:mod:`.etcd_transport`, :mod:`.txn`, :mod:`.watch`, :mod:`.store`) moves bytes under whatever key it is
given and knows no names.  Where a key is read back into its parts (the node a presence key names, what a
recovery key of a generation is), the parser is here too.  The names are the stored state of running
clusters: changing one is changing a format on disk.

A run's keys live under its root, ``/resilient/<run_id>/`` (:func:`run_root`).  Every key below is relative
to it, as a :class:`~resilient.coord.proof.SignedStore` sees them, unless it starts with ``/``; the key
classes take a ``root`` to name the full etcd keys instead.  *Signed*: the value carries an HMAC of the run
token bound to its key (:mod:`.proof`), and a reader ignores a forged one.

The run's own keys:

* ``launch``: the launch record ``{id, state, reason}``, by compare-and-swap (:mod:`.launch`); as a
  prefix, every launch of the run too, which every agent watches.  Signed.
* ``generation``: the run's generation counter, moved by a round's formation and by an in-process
  decision.  Signed.
* ``token_fingerprint``: which token the run uses, published by its first agent (an HMAC itself).
* ``incidents/<id>``: the run's incidents (signed); ``status/<node>``: each node's status snapshot, every
  5 s (not signed).

A launch's keys, ``launch/<id>/`` (:class:`LaunchKeys`), all signed:

* ``verdict``, ``stop``, ``stop_request``: why the launch stopped; the step a graceful stop commits at;
  ``resilient stop --store``;
* ``restarts/<G>``: one record per failed generation, the first writer's (the global restart budget);
* ``detectors``, ``stragglers``: detector changes made at run time; the scorer's straggler flags;
* ``places/<G>/<slot>``: a spare node taking a lost node's place in the restart after ``G``;
* ``nodes/<node>``: a node's presence, on its lease; ``suspect/<node>/<prober>``,
  ``vouch/<node>/<prober>``: an accusation, a vouch (:mod:`.presence`);
* ``rec/current``, ``rec/g<G>/lost/<worker>``, ``rec/g<G>/failed``, ``rec/g<G>/claim``,
  ``rec/g<G>/decision``: in-process recovery across machines (:mod:`resilient.agent.cluster`,
  :mod:`.claims`); ``pool/<worker>``: a warm spare, on its agent's lease.

A launch's keys outside ``launch/`` (every agent watches ``launch``; what every node writes here reaches
only the agent that reads it), all signed:

* ``reports/launch/<id>/g<G>/node/<node>``, ``.../waiting/<worker>`` (:class:`ReportKeys`): what a node
  holds in a generation; a survivor waiting (read by the generation's collector);
* ``timing/<id>/<node>``: a node's newest timing windows (read by the straggler scorer);
* ``rdzv/<id>/round``, ``j/<n>/<node>``, ``out/r/<n>``, ``out/waiting``, ``out/closed``
  (:class:`RoundKeys`): the launch's rendezvous rounds (:mod:`.rounds`);
* ``rdzv/<id>/rdzv``, ``rdzv/<id>/c10d/``: torch's rendezvous state and c10d store (:mod:`.rendezvous`,
  not signed); outside a launch ``/resilient/rdzv/<run_id>`` and ``c10d/``.

A fleet's keys, ``/resilient-fleet/<fleet>/`` (:class:`FleetKeys`), outside every run and not signed (who
may write them is etcd's access control): ``quarantine/<node>`` (on a lease), ``offences/<node>``,
``burn_in/<node>`` (:mod:`.quarantine`).

``<G>`` and ``<n>`` are written with 8 digits in ``restarts/``, ``places/``, ``j/`` and ``out/r/`` (so
that they sort), plainly in ``g<G>``.  ``docs/architecture.md`` ("The keyspace") holds the same keys in a
table, checked against this module by ``tests/test_keyspace.py``, which also fails when a module elsewhere
spells a key.

Not here: the keys of an agent's own TCPStore for in-process recovery (``assign/<G>/<worker>``,
``abort/<G>``, ``grow/<G>``, ``reform/g<G>/``) are not etcd's, and stay with their protocol in
:mod:`resilient.elastic.reform`; checkpoint paths are the object store's (:mod:`resilient.checkpoint`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

from ..core.errors import ConfigError

RUNS = "/resilient/"
"""Where every run's keys live: ``/resilient/<run_id>/``."""
FLEETS = "/resilient-fleet/"
"""Where every fleet's quarantine keys live, outside every run: ``/resilient-fleet/<fleet>/``."""

# The run's own keys, relative to its root.
LAUNCH = "launch"
"""The launch record (:mod:`.launch`); as a prefix, the record and every launch's keys."""
LAUNCHES = "launch/"
"""Every launch's keys."""
GENERATION = "generation"
"""The run's generation counter (the rendezvous and the in-process decisions move it)."""
TOKEN_FINGERPRINT = "token_fingerprint"
"""Which token the run uses (:func:`~resilient.coord.proof.token_fingerprint`)."""
INCIDENTS = "incidents/"
"""The run's incidents, one key each."""
STATUS = "status/"
"""The nodes' status snapshots, one key each."""
TIMING = "timing/"
"""Every launch's timing windows (a watch of their own, opened by the straggler scorer)."""

# torch elastic's rendezvous (:mod:`.rendezvous`).
TORCH_STATES = RUNS + "rdzv"
"""Where torch's rendezvous state of a run outside a launch lives: ``/resilient/rdzv/<run_id>``."""
TORCH_STATE = "rdzv"
"""The name of torch's rendezvous state in a launch's rendezvous space."""

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


def run_root(run_id: str) -> str:
    """The key prefix of a run, ``/resilient/<run_id>/``; rejects ids that would escape it."""
    if not run_id or "/" in run_id or run_id in (".", ".."):
        raise ConfigError(f"run id {run_id!r} is invalid: use a non-empty name without '/'")
    return f"{RUNS}{run_id}/"


def incident(incident_id: str) -> str:
    return f"{INCIDENTS}{incident_id}"


def status(node: str) -> str:
    return f"{STATUS}{node}"


def is_restart(key: str) -> bool:
    """``key`` is a restart record of any launch of the run (the run-wide restart budget)."""
    return key.startswith(LAUNCHES) and "/restarts/" in key


def torch_state(prefix: str, name: str) -> str:
    """torch's rendezvous state ``name`` under ``prefix`` (:data:`TORCH_STATES` and a run id, or a launch's
    rendezvous space and :data:`TORCH_STATE`)."""
    return f"{prefix.rstrip('/')}/{name}"


def c10d(space: str) -> str:
    """The c10d store given to torch's rendezvous handler, under ``space`` (a run's root or a launch's rendezvous
    space)."""
    return f"{space}c10d/"


def check_name(what: str, name: str) -> str:
    """A fleet or node name that is safe as one key segment, or a ConfigError naming the rule."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigError(f"{what} {name!r} is invalid: use 1-63 letters, digits, '.', '_' or '-', starting with a "
                          "letter or digit")
    return name


RecoveryKind = Literal["lost", "failed", "claim", "decision"]
AccusationKind = Literal["suspect", "vouch"]
ReportKind = Literal["node", "waiting"]


@dataclass(frozen=True)
class LaunchKeys:
    """A launch's keys, ``launch/<id>/...``, and those of it kept outside ``launch/`` (its reports, its timing
    windows, its rendezvous).  Relative to the run's root, or under ``root`` (the full etcd keys)."""

    launch_id: str
    root: str = ""

    @cached_property
    def prefix(self) -> str:
        """Every key of the launch under ``launch/`` (its facts, its nodes' presence, its recovery keys)."""
        return f"{self.root}{LAUNCHES}{self.launch_id}/"

    # -- the facts every node agrees on (:mod:`resilient.agent.shared`)
    def verdict(self) -> str:
        return self.prefix + "verdict"

    def stop(self) -> str:
        return self.prefix + "stop"

    def stop_request(self) -> str:
        return self.prefix + "stop_request"

    def detectors(self) -> str:
        return self.prefix + "detectors"

    def stragglers(self) -> str:
        return self.prefix + "stragglers"

    def scorer(self) -> str:
        """Which node scores stragglers, and where its timing link listens (:mod:`resilient.agent.timing_link`)."""
        return self.prefix + "scorer"

    def restarts(self) -> str:
        return self.prefix + "restarts/"

    def restart(self, generation: int) -> str:
        return f"{self.restarts()}{generation:08d}"

    def place(self, generation: int, slot: int) -> str:
        """A lost node's place ``slot`` in the restart after ``generation``, claimed by a spare node."""
        return f"{self.prefix}places/{generation:08d}/{slot}"

    # -- presence and liveness (:mod:`.presence`)
    def nodes(self) -> str:
        return self.prefix + "nodes/"

    def node(self, node: str) -> str:
        return self.nodes() + node

    def node_of(self, key: str) -> str | None:
        """The node a presence key names (None: ``key`` is none)."""
        return key[len(self.nodes()):] if key.startswith(self.nodes()) else None

    def suspects(self) -> str:
        return self.prefix + "suspect/"

    def suspect(self, node: str, by: str) -> str:
        """``by`` accuses ``node``: its probes go unanswered."""
        return f"{self.suspects()}{node}/{by}"

    def vouches(self) -> str:
        return self.prefix + "vouch/"

    def vouch(self, node: str, by: str) -> str:
        """``by`` vouches for ``node``: it answers while its presence key is gone."""
        return f"{self.vouches()}{node}/{by}"

    def accusation_of(self, key: str) -> tuple[AccusationKind, str, str] | None:
        """``(kind, node, by)`` of an accusation or vouch key (either name may be empty in a malformed key), None
        for any other key."""
        kind: AccusationKind
        if key.startswith(self.suspects()):
            kind, base = "suspect", self.suspects()
        elif key.startswith(self.vouches()):
            kind, base = "vouch", self.vouches()
        else:
            return None
        node, _, by = key[len(base):].partition("/")
        return kind, node, by

    # -- in-process recovery across machines (:mod:`resilient.agent.cluster`)
    def recovery(self) -> str:
        return self.prefix + "rec/"

    def current(self) -> str:
        """The generation the launch runs now."""
        return self.recovery() + "current"

    def recovery_of(self, generation: int) -> str:
        """Every recovery key of ``generation``."""
        return f"{self.recovery()}g{generation}/"

    def lost(self, generation: int, worker: str) -> str:
        return f"{self.recovery_of(generation)}lost/{worker}"

    def failed(self, generation: int) -> str:
        return self.recovery_of(generation) + "failed"

    def claim(self, generation: int) -> str:
        return self.recovery_of(generation) + "claim"

    def decision(self, generation: int) -> str:
        return self.recovery_of(generation) + "decision"

    def recovery_key(self, generation: int, key: str) -> tuple[RecoveryKind, str] | None:
        """What ``key`` is among ``generation``'s recovery keys: ``("lost", worker)``, or ``("failed" | "claim" |
        "decision", "")``; None for any other key."""
        base = self.recovery_of(generation)
        if not key.startswith(base):
            return None
        rest = key[len(base):]
        kind, _, name = rest.partition("/")
        if kind == "lost":
            return "lost", name
        if rest == "failed":
            return "failed", ""
        if rest == "claim":
            return "claim", ""
        if rest == "decision":
            return "decision", ""
        return None

    def is_decision(self, key: str) -> bool:
        """``key`` is the decision of some generation of the launch."""
        return key.startswith(self.recovery()) and key.endswith("/decision")

    def pool(self) -> str:
        """The spare pool."""
        return self.prefix + "pool/"

    def spare(self, worker: str) -> str:
        return self.pool() + worker

    def reports(self) -> ReportKeys:
        return ReportKeys(self.launch_id, self.root)

    # -- the nodes' timing windows (:mod:`resilient.agent.shared`), outside ``launch/``
    def timings(self) -> str:
        return f"{self.root}{TIMING}{self.launch_id}/"

    def timing(self, node: str) -> str:
        return self.timings() + node

    # -- the rendezvous, outside ``launch/``
    def rendezvous(self) -> RoundKeys:
        """The launch's rendezvous space: beside the launch's keys, not under them (see :func:`rendezvous_space`)."""
        return RoundKeys(f"{self.root}rdzv/{self.launch_id}/")


@dataclass(frozen=True)
class ReportKeys:
    """What every node of a launch reports in each generation, ``reports/launch/<id>/g<G>/...``: outside the
    launch's watched keys (read whole by the one agent that needs them)."""

    launch_id: str
    root: str = ""

    @cached_property
    def prefix(self) -> str:
        return f"{self.root}reports/{LAUNCHES}{self.launch_id}/"

    def generation(self, generation: int) -> str:
        """Every report of ``generation``."""
        return f"{self.prefix}g{generation}/"

    def node(self, generation: int, node: str) -> str:
        """The members ``node`` holds in ``generation``."""
        return f"{self.generation(generation)}node/{node}"

    def waiting(self, generation: int, worker: str) -> str:
        """A survivor of ``generation`` that left the failed group and waits."""
        return f"{self.generation(generation)}waiting/{worker}"

    def report_of(self, generation: int, key: str) -> tuple[ReportKind, str] | None:
        """``("node", node)`` or ``("waiting", worker)`` for a report of ``generation``; None for any other key."""
        base = self.generation(generation)
        if not key.startswith(base):
            return None
        kind, _, name = key[len(base):].partition("/")
        if kind == "node":
            return "node", name
        if kind == "waiting":
            return "waiting", name
        return None


@dataclass(frozen=True)
class RoundKeys:
    """A launch's rendezvous rounds (:mod:`.rounds`), under its rendezvous ``space`` (full etcd keys)."""

    space: str

    @property
    def round(self) -> str:
        """The round open for joining."""
        return self.space + "round"

    @property
    def out(self) -> str:
        """What every joiner follows: the results, ``waiting`` and ``closed``."""
        return self.space + "out/"

    @property
    def waiting(self) -> str:
        return self.out + "waiting"

    @property
    def closed(self) -> str:
        return self.out + "closed"

    @property
    def results(self) -> str:
        return self.out + "r/"

    def joins(self, n: int) -> str:
        return f"{self.space}j/{n:08d}/"

    def join(self, n: int, node: str) -> str:
        return self.joins(n) + node

    def result(self, n: int) -> str:
        return f"{self.results}{n:08d}"

    @staticmethod
    def node_of(key: str) -> str:
        """The node a join names."""
        return key.rsplit("/", 1)[1]


def rendezvous_space(run_id: str, launch_id: str) -> str:
    """Where launch ``launch_id``'s rendezvous keeps its state and store: beside the launch's keys
    (``/resilient/<run_id>/rdzv/<launch_id>/``), not under them.  Every agent follows the launch's keys through
    a watch, and torch's keep-alive rewrites the rendezvous state (a blob that grows with the nodes) every few
    seconds on every node: under the launch each rewrite would reach every agent, N² events a keep-alive
    period."""
    return LaunchKeys(launch_id, run_root(run_id)).rendezvous().space


@dataclass(frozen=True)
class FleetKeys:
    """A fleet's quarantine keys, ``/resilient-fleet/<fleet>/...``: outside every run, not signed (who may write
    them is etcd's access control).  Names that are not one safe key segment are refused (:func:`check_name`)."""

    fleet: str

    def __post_init__(self) -> None:
        check_name("fleet name", self.fleet)

    @property
    def prefix(self) -> str:
        return f"{FLEETS}{self.fleet}/"

    def quarantined(self) -> str:
        """Every quarantine record in force."""
        return self.prefix + "quarantine/"

    def quarantine(self, node: str) -> str:
        return self.quarantined() + check_name("node id", node)

    def offences(self) -> str:
        """Every node's offence count."""
        return self.prefix + "offences/"

    def offences_of(self, node: str) -> str:
        return self.offences() + check_name("node id", node)

    def burn_ins(self) -> str:
        """Every node's latest burn-in result."""
        return self.prefix + "burn_in/"

    def burn_in(self, node: str) -> str:
        return self.burn_ins() + check_name("node id", node)

    @staticmethod
    def node_of(key: str) -> str:
        """The node a quarantine record, offence count or burn-in names."""
        return key.rsplit("/", 1)[-1]
