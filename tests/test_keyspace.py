"""The keyspace has one owner: every key's exact name, its parsers, the table in the docs, and no key elsewhere.

``resilient/coord/keyspace.py`` names every etcd key; the names are the stored state of running clusters, so
each is pinned here byte for byte.  The table of ``docs/architecture.md`` ("The keyspace") must list exactly
the keys the module makes, and no module outside it may spell one: its string constants and f-string pieces
are read with ``ast`` and a piece that names a key segment fails the test (the check is shown to catch one).
"""

from __future__ import annotations

import ast
import inspect
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from resilient.coord import keyspace
from resilient.coord.keyspace import FleetKeys, LaunchKeys, ReportKeys, RoundKeys
from resilient.core.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent

# -- what the module makes, as patterns ------------------------------------------------------------------------

G, N, SLOT = 40000001, 40000002, 40000003
"""Generation, round and slot numbers that read back unambiguously from a key (8 digits, padded or not)."""
FLEET, FLEET_NODE = "xfleetx", "xnodex"
"""A fleet and a node name that pass the fleet's name rule, standing for ``<fleet>`` and ``<node>``."""
PLACEHOLDERS = {str(G): "<G>", str(N): "<n>", str(SLOT): "<slot>", FLEET: "<fleet>", FLEET_NODE: "<node>"}


def pattern(key: str) -> str:
    for value, placeholder in PLACEHOLDERS.items():
        key = key.replace(value, placeholder)
    return key


def launch_keys(k: LaunchKeys) -> dict[str, str]:
    return {"verdict": k.verdict(), "stop": k.stop(), "stop_request": k.stop_request(), "detectors": k.detectors(),
            "stragglers": k.stragglers(), "scorer": k.scorer(), "restart": k.restart(G), "place": k.place(G, SLOT),
            "node": k.node("<node>"), "suspect": k.suspect("<node>", "<prober>"),
            "vouch": k.vouch("<node>", "<prober>"), "current": k.current(), "lost": k.lost(G, "<worker>"),
            "failed": k.failed(G), "claim": k.claim(G), "decision": k.decision(G), "spare": k.spare("<worker>"),
            "timing": k.timing("<node>")}


def report_keys(k: ReportKeys) -> dict[str, str]:
    return {"node": k.node(G, "<node>"), "waiting": k.waiting(G, "<worker>")}


def round_keys(k: RoundKeys) -> dict[str, str]:
    return {"round": k.round, "join": k.join(N, "<node>"), "result": k.result(N), "waiting": k.waiting,
            "closed": k.closed}


def fleet_keys(k: FleetKeys) -> dict[str, str]:
    return {"quarantine": k.quarantine(FLEET_NODE), "offences_of": k.offences_of(FLEET_NODE),
            "burn_in": k.burn_in(FLEET_NODE)}


# The other public names of each class: the prefixes its keys share, its parsers, its neighbours.
LAUNCH_OTHERS = {"prefix", "restarts", "nodes", "suspects", "vouches", "recovery", "recovery_of", "pool", "timings",
                 "node_of", "accusation_of", "recovery_key", "is_decision", "reports", "rendezvous"}
REPORT_OTHERS = {"prefix", "generation", "report_of"}
ROUND_OTHERS = {"space", "out", "results", "joins", "node_of"}
FLEET_OTHERS = {"prefix", "quarantined", "offences", "burn_ins", "node_of"}
MODULE_NAMES = {"RUNS", "FLEETS", "LAUNCH", "LAUNCHES", "GENERATION", "TOKEN_FINGERPRINT", "INCIDENTS", "STATUS",
                "TIMING", "TORCH_STATES", "TORCH_STATE", "run_root", "incident", "status", "is_restart",
                "torch_state", "c10d", "check_name", "rendezvous_space", "LaunchKeys", "ReportKeys", "RoundKeys",
                "FleetKeys", "RecoveryKind", "AccusationKind", "ReportKind"}


def every_key() -> set[str]:
    """Every key the module makes, as a pattern relative to a run's root (or absolute, starting with ``/``)."""
    launch = LaunchKeys("<id>")
    space = launch.rendezvous().space
    keys = [keyspace.LAUNCH, keyspace.GENERATION, keyspace.TOKEN_FINGERPRINT, keyspace.incident("<id>"),
            keyspace.status("<node>"), *launch_keys(launch).values(), *report_keys(launch.reports()).values(),
            *round_keys(launch.rendezvous()).values(), keyspace.torch_state(space, keyspace.TORCH_STATE),
            keyspace.c10d(space), keyspace.torch_state(keyspace.TORCH_STATES, "<run_id>"), keyspace.c10d(""),
            *fleet_keys(FleetKeys(FLEET)).values()]
    return {pattern(k) for k in keys}


def public(cls: type) -> set[str]:
    fields = set(getattr(cls, "__dataclass_fields__", {}))
    return {name for name in vars(cls) if not name.startswith("_")} | fields


def test_every_public_name_of_the_keyspace_is_accounted_for_here() -> None:
    """A key added to the module shows up here (and so must be added to the docs' table) or fails this."""
    assert public(LaunchKeys) - {"launch_id", "root"} == set(launch_keys(LaunchKeys("L"))) | LAUNCH_OTHERS
    assert public(ReportKeys) - {"launch_id", "root"} == set(report_keys(ReportKeys("L"))) | REPORT_OTHERS
    assert public(RoundKeys) == set(round_keys(RoundKeys("s/"))) | ROUND_OTHERS
    assert public(FleetKeys) - {"fleet"} == set(fleet_keys(FleetKeys("f"))) | FLEET_OTHERS
    def defined_there(value: object) -> bool:
        if inspect.isclass(value) or inspect.isfunction(value):
            return value.__module__ == keyspace.__name__
        return not inspect.ismodule(value)

    names = {n for n, v in vars(keyspace).items() if not n.startswith("_") and defined_there(v)}
    assert names - {"annotations", "Literal"} == MODULE_NAMES


# -- each key, byte for byte --------------------------------------------------------------------------------------

def test_the_run_s_keys() -> None:
    assert keyspace.run_root("exp42") == "/resilient/exp42/"
    for bad in ("", "a/b", ".", ".."):
        with pytest.raises(ConfigError, match="run id"):
            keyspace.run_root(bad)
    assert (keyspace.LAUNCH, keyspace.LAUNCHES, keyspace.GENERATION, keyspace.TOKEN_FINGERPRINT) == (
        "launch", "launch/", "generation", "token_fingerprint")
    assert (keyspace.incident("i-3"), keyspace.status("n0"), keyspace.TIMING) == ("incidents/i-3", "status/n0",
                                                                                  "timing/")
    assert keyspace.is_restart("launch/L0/restarts/00000004") and not keyspace.is_restart("launch/L0/verdict")
    assert not keyspace.is_restart("reports/launch/L0/restarts/1")


def test_a_launch_s_keys() -> None:
    k = LaunchKeys("L1")
    assert launch_keys(k) | {"prefix": k.prefix, "restarts": k.restarts(), "recovery_of": k.recovery_of(4)} == {
        "prefix": "launch/L1/",
        "verdict": "launch/L1/verdict", "stop": "launch/L1/stop", "stop_request": "launch/L1/stop_request",
        "detectors": "launch/L1/detectors", "stragglers": "launch/L1/stragglers", "scorer": "launch/L1/scorer",
        "restarts": "launch/L1/restarts/", "restart": f"launch/L1/restarts/{G:08d}",
        "place": f"launch/L1/places/{G:08d}/{SLOT}",
        "node": "launch/L1/nodes/<node>", "suspect": "launch/L1/suspect/<node>/<prober>",
        "vouch": "launch/L1/vouch/<node>/<prober>",
        "current": "launch/L1/rec/current", "recovery_of": "launch/L1/rec/g4/",
        "lost": f"launch/L1/rec/g{G}/lost/<worker>", "failed": f"launch/L1/rec/g{G}/failed",
        "claim": f"launch/L1/rec/g{G}/claim", "decision": f"launch/L1/rec/g{G}/decision",
        "spare": "launch/L1/pool/<worker>", "timing": "timing/L1/<node>"}
    assert (k.restart(7), k.place(3, 1)) == ("launch/L1/restarts/00000007", "launch/L1/places/00000003/1")
    assert (k.nodes(), k.suspects(), k.vouches(), k.recovery(), k.pool(), k.timings()) == (
        "launch/L1/nodes/", "launch/L1/suspect/", "launch/L1/vouch/", "launch/L1/rec/", "launch/L1/pool/",
        "timing/L1/")
    at = LaunchKeys("L1", "/resilient/r/")
    assert (at.prefix, at.node("n0"), at.suspect("n1", "n0"), at.timings(), at.claim(3)) == (
        "/resilient/r/launch/L1/", "/resilient/r/launch/L1/nodes/n0", "/resilient/r/launch/L1/suspect/n1/n0",
        "/resilient/r/timing/L1/", "/resilient/r/launch/L1/rec/g3/claim")
    assert LaunchKeys("L1") == k != at


def test_a_launch_s_reports_and_rendezvous() -> None:
    reports = LaunchKeys("L1").reports()
    assert (reports.prefix, reports.generation(4), reports.node(4, "n0"), reports.waiting(4, "n0.w1")) == (
        "reports/launch/L1/", "reports/launch/L1/g4/", "reports/launch/L1/g4/node/n0",
        "reports/launch/L1/g4/waiting/n0.w1")
    assert keyspace.rendezvous_space("r", "L1") == "/resilient/r/rdzv/L1/" == \
        LaunchKeys("L1", "/resilient/r/").rendezvous().space
    with pytest.raises(ConfigError):
        keyspace.rendezvous_space("a/b", "L1")
    r = RoundKeys("/resilient/r/rdzv/L1/")
    assert (r.round, r.out, r.waiting, r.closed, r.results, r.joins(2), r.join(2, "n0"), r.result(2)) == (
        "/resilient/r/rdzv/L1/round", "/resilient/r/rdzv/L1/out/", "/resilient/r/rdzv/L1/out/waiting",
        "/resilient/r/rdzv/L1/out/closed", "/resilient/r/rdzv/L1/out/r/", "/resilient/r/rdzv/L1/j/00000002/",
        "/resilient/r/rdzv/L1/j/00000002/n0", "/resilient/r/rdzv/L1/out/r/00000002")
    space = keyspace.rendezvous_space("r", "L1")
    assert keyspace.torch_state(space, keyspace.TORCH_STATE) == "/resilient/r/rdzv/L1/rdzv"
    assert keyspace.torch_state(keyspace.TORCH_STATES, "r") == "/resilient/rdzv/r"
    assert keyspace.torch_state("/custom/", "r") == "/custom/r"
    assert (keyspace.c10d(space), keyspace.c10d(keyspace.run_root("r"))) == ("/resilient/r/rdzv/L1/c10d/",
                                                                              "/resilient/r/c10d/")


def test_a_fleet_s_keys() -> None:
    f = FleetKeys("f1")
    assert (f.prefix, f.quarantined(), f.quarantine("n0"), f.offences(), f.offences_of("n0"), f.burn_ins(),
            f.burn_in("n0")) == (
        "/resilient-fleet/f1/", "/resilient-fleet/f1/quarantine/", "/resilient-fleet/f1/quarantine/n0",
        "/resilient-fleet/f1/offences/", "/resilient-fleet/f1/offences/n0", "/resilient-fleet/f1/burn_in/",
        "/resilient-fleet/f1/burn_in/n0")
    with pytest.raises(ConfigError, match="fleet name"):
        FleetKeys("a/b")
    for bad in ("../x", "", "a/b"):
        with pytest.raises(ConfigError, match="node id"):
            f.quarantine(bad)


# -- the parsers read back what the makers wrote ------------------------------------------------------------------

@pytest.mark.parametrize("root", ["", "/resilient/r/"])
def test_launch_parsers_round_trip(root: str) -> None:
    k = LaunchKeys("L1", root)
    assert k.node_of(k.node("n-7")) == "n-7" and k.node_of(k.spare("n-7")) is None
    assert k.accusation_of(k.suspect("n1", "n0")) == ("suspect", "n1", "n0")
    assert k.accusation_of(k.vouch("n1", "n0")) == ("vouch", "n1", "n0")
    assert k.accusation_of(k.node("n1")) is None
    for made, read in ((k.lost(4, "n0.w1"), ("lost", "n0.w1")), (k.failed(4), ("failed", "")),
                       (k.claim(4), ("claim", "")), (k.decision(4), ("decision", ""))):
        assert k.recovery_key(4, made) == read
        assert k.recovery_key(5, made) is None  # another generation's
    assert k.recovery_key(4, k.current()) is None and k.recovery_key(4, k.recovery_of(4) + "other") is None
    assert k.is_decision(k.decision(12)) and not k.is_decision(k.claim(12)) and not k.is_decision(k.current())
    reports = k.reports()
    assert reports.report_of(4, reports.node(4, "n0")) == ("node", "n0")
    assert reports.report_of(4, reports.waiting(4, "n0.w1")) == ("waiting", "n0.w1")
    assert reports.report_of(5, reports.node(4, "n0")) is None
    assert reports.report_of(4, reports.generation(4) + "other/x") is None
    assert keyspace.is_restart(LaunchKeys("L2").restart(9))


def test_round_and_fleet_parsers_round_trip() -> None:
    r = RoundKeys("/resilient/r/rdzv/L1/")
    assert RoundKeys.node_of(r.join(3, "node-10")) == "node-10"
    f = FleetKeys("f1")
    assert {FleetKeys.node_of(f.quarantine("n0")), FleetKeys.node_of(f.offences_of("n0")),
            FleetKeys.node_of(f.burn_in("n0"))} == {"n0"}


# -- the docs' table lists exactly these keys ----------------------------------------------------------------------

def table_keys(doc: str) -> set[str]:
    """Every key of the table in ``doc``'s section "The keyspace": a row's folder followed by each of its keys
    (a key that starts with ``/`` stands alone)."""
    section = re.search(r"^## The keyspace\n(.*?)^## ", doc, re.DOTALL | re.MULTILINE)
    assert section, "docs/architecture.md has no section '## The keyspace'"
    rows = [line for line in section.group(1).splitlines() if line.startswith("|")]
    assert rows and rows[0].split("|")[1:3] == [" under ", " key "], rows[:1]
    found = set()
    for row in rows[2:]:
        under, keys = row.split("|")[1:3]
        folder = re.findall(r"`([^`]*)`", under)
        base = folder[0] if folder else ""
        for key in re.findall(r"`([^`]*)`", keys):
            found.add(key if key.startswith("/") else base + key)
    return found


def test_the_docs_table_lists_every_key_and_only_those() -> None:
    doc = (REPO / "docs" / "architecture.md").read_text()
    listed, made = table_keys(doc), every_key()
    assert not made - listed, f"keys keyspace.py makes that docs/architecture.md's table lacks: {made - listed}"
    assert not listed - made, f"keys docs/architecture.md lists that keyspace.py does not make: {listed - made}"


def test_the_table_reader_reads_folders_and_absolute_keys() -> None:
    doc = ("## The keyspace\n\n| under | key | what |\n|---|---|---|\n| (the run) | `a`, `/x/<y>` | w |\n"
           "| `b/<id>/` | `c/<n>`, `d` | `not/a/key` |\n\n## Next\n")
    assert table_keys(doc) == {"a", "/x/<y>", "b/<id>/c/<n>", "b/<id>/d"}


# -- no module outside the keyspace spells a key ------------------------------------------------------------------

NOT_SCANNED = ("resilient/coord/keyspace.py", "resilient/elastic/reform.py", "resilient/chaos/",
               "resilient/deploy/", "resilient/checkpoint/")
"""The keyspace itself; the in-process recovery's TCPStore keys (not etcd's); the chaos drills and the deploy
renderers (files and manifests); checkpoint paths (the object store's)."""
NOT_KEYS = {
    ("resilient/agent/launcher.py", "/proc/self/status"): "a procfs file",
    ("resilient/cli/status_cmd.py", "nodes/*/status.json"): "the run directory's status files",
    ("resilient/cli/stop_cmd.py", "/nodes"): "the run directory's nodes folder, in a message",
}
"""Strings that look like keys and are not, with why."""
GENERIC = {"j", "r", "node", "resilient"}
"""Key segments too common to tell a key by (their keys are caught by the segments beside them)."""
STORE_CALLS = {"put", "put_if_absent", "compare_and_swap", "get_entry", "get_prefix", "delete", "delete_prefix",
               "add", "first_created", "snapshot_prefix"}
"""Store methods whose first argument is a key (``get`` is left out: every dict has one)."""


def segments() -> set[str]:
    """The words keys are made of (``launch``, ``rec``, ``claim``, ...), from the keys the module makes."""
    return {w for key in every_key() for w in key.split("/") if w and "<" not in w} - GENERIC


def spelled_keys(source: str, words: set[str]) -> Iterator[tuple[int, str]]:
    """``(line, piece)`` for each string constant or f-string piece of ``source`` that spells a key: one under a
    root (``/resilient/``, ``/resilient-fleet/``), one with a ``/`` beside a key segment (``"rec/"``,
    ``"/claim"``), or a bare segment where a key is built or used (``prefix + "verdict"``,
    ``f"{prefix}current"``, ``store.put("generation", ...)``, ``COUNTER_KEY = "generation"``).  Docstrings are
    prose, not read."""
    tree = ast.parse(source)
    prose = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    bare: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            bare |= {id(node.left), id(node.right)}
        elif isinstance(node, ast.JoinedStr):
            bare |= {id(v) for prev, v in zip(node.values, node.values[1:])
                     if isinstance(prev, ast.FormattedValue)}
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in STORE_CALLS \
                and node.args:
            bare.add(id(node.args[0]))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and any(
                re.search(r"(?i)(key|prefix)$", t.id if isinstance(t, ast.Name) else t.attr)
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                if isinstance(t, (ast.Name, ast.Attribute))):
            bare.add(id(node.value))
    for node in ast.walk(tree):
        if not isinstance(node, ast.Constant) or not isinstance(node.value, str) or id(node) in prose:
            continue
        piece = node.value
        if (any(root in piece for root in (keyspace.RUNS, keyspace.FLEETS))
                or ("/" in piece and words & set(piece.split("/")))
                or (id(node) in bare and piece in words)):
            yield node.lineno, piece


def scanned() -> Iterator[tuple[str, str]]:
    """``(path, source)`` of every module the scan reads."""
    for path in sorted((REPO / "resilient").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if not rel.startswith(NOT_SCANNED):
            yield rel, path.read_text()


def test_no_module_but_the_keyspace_spells_a_key() -> None:
    words = segments()
    found, excused = [], set()
    for rel, source in scanned():
        for line, piece in spelled_keys(source, words):
            if (rel, piece) in NOT_KEYS:
                excused.add((rel, piece))
            else:
                found.append(f"{rel}:{line}: {piece!r}")
    assert not found, ("these name etcd keys outside resilient/coord/keyspace.py; name the key there and use "
                       "it:\n" + "\n".join(found))
    assert excused == set(NOT_KEYS), f"NOT_KEYS lists strings that are no longer there: {set(NOT_KEYS) - excused}"


@pytest.mark.parametrize("snippet", [
    'key = prefix + "verdict"',
    'store.get_prefix("rec/")',
    'key = f"{base}g{generation}/claim"',
    'found = signed.get(f"{launch}rec/current")',
    'store = EtcdControlStore(client, f"/resilient/{run_id}/")',
    'control.put("generation", b"1")',
    'watch = PrefixWatch(client, root + "launch")',
    'under = f"timing/{launch_id}/"',
    'key = self.prefix + "quarantine/" + node',
    'x = "/resilient-fleet/"',
    'k = f"{self.prefix}current"',
    'COUNTER_KEY = "generation"',
    'self.round_key: str = "round"',
])
def test_the_scan_finds_a_key_spelled_outside_the_keyspace(snippet: str) -> None:
    assert list(spelled_keys(snippet, segments())), snippet


@pytest.mark.parametrize("snippet", [
    '"""Keys live under launch/<id>/ (rec/g<G>/claim, /resilient/<run>/)."""',
    'def f():\n    """``prefix + "verdict"``"""\n',
    'n = value.get("generation")',
    'record = {"verdict": v, "generation": g, "node": n}',
    'msg = f"{n} nodes joined, the current round"',
    'path = "/proc/self/stat"',
    'seed = f"resilient/{seed}/{step}"',
    'key = keyspace.LaunchKeys(launch_id).verdict()',
])
def test_the_scan_leaves_prose_values_and_paths_alone(snippet: str) -> None:
    assert not list(spelled_keys(snippet, segments())), snippet
