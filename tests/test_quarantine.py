"""Node quarantine: the expiry rule and the burn-in verdict (pure), the fleet's records in a real etcd, the
burn-in process, and the command line."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import uuid

import pytest

from resilient.agent.quarantine_gate import QuarantineGate
from resilient.coord.etcd import EtcdClient, EtcdConfig
from resilient.coord.quarantine import FleetQuarantine, QuarantineConfig, decide_expiry
from resilient.core.errors import ConfigError
from resilient.core.events import Event
from resilient.core.exitcodes import EXIT_PREEMPTED_AGENT
from resilient.watchdog.burnin import MEASURES, judge

from .agent_helpers import agent_env

pytestmark = pytest.mark.timeout(120)


def fleet_of(server, **config) -> FleetQuarantine:
    client = EtcdClient(EtcdConfig.from_url(server.url, outage_tolerance_s=5.0))
    return FleetQuarantine(client, QuarantineConfig(fleet=f"f-{uuid.uuid4().hex[:10]}", **config))


def test_each_offence_doubles_the_expiry_up_to_the_longest_allowed():
    config = QuarantineConfig(expiry_s=600, max_expiry_s=3000)
    assert decide_expiry(0, config) == (600, "first offence: kept out for 600 s")
    expiry, reason = decide_expiry(1, config)
    assert expiry == 1200 and reason == "offence 2: kept out for 1200 s, doubled once for each of 1 earlier offence(s)"
    assert decide_expiry(2, config)[0] == 2400
    expiry, reason = decide_expiry(3, config)
    assert expiry == 3000 and "(the longest allowed)" in reason
    with pytest.raises(ConfigError, match="max_expiry_s=10 is below expiry_s=600"):
        QuarantineConfig(expiry_s=600, max_expiry_s=10)
    with pytest.raises(ConfigError, match="fleet name 'a/b' is invalid"):
        QuarantineConfig(fleet="a/b")
    with pytest.raises(ConfigError, match=r"burn_in_min_ratio=1.5 must be in \(0, 1\]"):
        QuarantineConfig(burn_in_min_ratio=1.5)


FLEET = {"n0": {"matmul_gflops": 100.0, "disk_write_mbps": 1000.0, "allreduce_gbps": 2.0, "passed": True},
         "n1": {"matmul_gflops": 120.0, "disk_write_mbps": 800.0, "allreduce_gbps": 1.0, "passed": True},
         "n2": {"matmul_gflops": 1.0, "disk_write_mbps": 1.0, "allreduce_gbps": 0.01, "passed": False}}


def test_a_burn_in_is_judged_against_the_median_of_the_other_nodes_that_passed():
    good = {"matmul_gflops": 90.0, "disk_write_mbps": 700.0, "allreduce_gbps": 1.2}
    verdict = judge(good, FLEET, "n3", 0.7)
    assert verdict.passed, verdict
    # Medians of n0 and n1 (n2 failed its own burn-in: not a reference): 110, 900, 1.5.
    assert [c.reference for c in verdict.checks] == [110.0, 900.0, 1.5]
    assert verdict.reason == "burn-in passed: every measure at least 70% of the fleet's median (lowest: disk_write_mbps at 78%)"
    slow = {**good, "matmul_gflops": 50.0}
    verdict = judge(slow, FLEET, "n3", 0.7)
    assert not verdict.passed
    assert verdict.reason == ("burn-in failed (needs 70% of the fleet's median): matmul_gflops 50 is 45% of the "
                              "fleet's median 110")
    # A node is not its own reference: n0's own older numbers are left out.
    assert judge({**good, "matmul_gflops": 60.0}, FLEET, "n0", 0.5).checks[0].reference == 120.0
    broken = judge({**good, "disk_write_mbps": float("nan")}, FLEET, "n3", 0.7)
    assert not broken.passed and "disk_write_mbps nan" in broken.reason
    alone = judge(good, {}, "n3", 0.7)
    assert alone.passed and "no other node of the fleet has a burn-in" in alone.reason
    assert [c.measure for c in alone.checks] == list(MEASURES)


def test_records_in_etcd_lapse_on_their_lease_count_offences_and_release(etcd_server):
    fleet = fleet_of(etcd_server, expiry_s=2, max_expiry_s=60)
    assert fleet.get("n1") is None and fleet.offences("n1") == 0
    created, record = fleet.add("n1", reason="flagged", source="straggler", by="n1", evidence={"ratio": 1.4})
    assert created and record.offence == 1 and record.expiry_s == 2
    standing = fleet.get("n1")
    assert standing is not None and standing.record == record and 0 <= standing.remaining_s <= 2
    assert "node n1 is quarantined (straggler, offence 1," in standing.describe()
    # A second cause while the first record stands is the same offence.
    again, same = fleet.add("n1", reason="unhealthy", source="health", by="n1")
    assert not again and same == record and fleet.offences("n1") == 1
    assert [s.record.node for s in fleet.list()] == ["n1"]
    while fleet.get("n1") is not None:  # etcd's clock ends it (no bound: the test's timeout guards)
        time.sleep(0.25)
    assert fleet.list() == []
    # The offences outlive the record: the second one is kept out twice as long.
    created, second = fleet.add("n1", reason="flagged again", source="operator", by="ops")
    assert created and second.offence == 2 and second.expiry_s == 4 and "doubled once" in second.expiry_reason
    assert fleet.release("n1") and fleet.get("n1") is None and fleet.offences("n1") == 2
    assert not fleet.release("n1")
    fleet.release("n1", forget=True)
    assert fleet.offences("n1") == 0 and fleet.add("n1", reason="x", source="operator", by="ops")[1].expiry_s == 2
    fleet.publish_burn_in("n1", {"matmul_gflops": 1.0, "passed": True})
    assert fleet.burn_ins() == {"n1": {"matmul_gflops": 1.0, "passed": True}}
    with pytest.raises(ConfigError, match="node id 'a/b' is invalid"):
        fleet.get("a/b")


def test_the_burn_in_process_measures_this_node(tmp_path):
    done = subprocess.run([sys.executable, "-m", "resilient.watchdog.burnin", "--scratch", str(tmp_path),
                           "--matmul-n", "256", "--disk-mib", "4", "--allreduce-mib", "1", "--repeats", "2"],
                          capture_output=True, text=True, timeout=90, env=agent_env(), check=False)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert all(result[m] > 0 for m in MEASURES), result
    assert isinstance(result["device"], str) and result["sizes"]["disk_mib"] == 4
    assert list(tmp_path.iterdir()) == []  # the scratch file is gone


def test_the_command_line_adds_lists_and_releases(etcd_server):
    fleet = f"f-{uuid.uuid4().hex[:10]}"

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "resilient", "quarantine", *args, "--store", etcd_server.url,
                               "--fleet", fleet], capture_output=True, text=True, timeout=60, env=agent_env(),
                              check=False)

    assert cli("ls").stdout.strip() == f"fleet {fleet}: no node is quarantined, has an offence or has burned in"
    added = cli("add", "gpu-7", "--reason", "ECC errors on GPU 3", "--expiry", "300")
    assert added.returncode == 0 and added.stdout.strip() == \
        "node gpu-7 quarantined (offence 1): first offence: kept out for 300 s", added.stderr
    listed = cli("ls")
    assert listed.stdout.startswith("gpu-7: QUARANTINED (operator, offence 1, "), listed.stdout
    assert "of 300 s): ECC errors on GPU 3; offences 1" in listed.stdout
    rows = json.loads(cli("ls", "--json").stdout)["nodes"]
    assert rows[0]["standing"]["by"].endswith("@" + socket.gethostname())
    assert cli("release", "gpu-7").stdout.strip() == "node gpu-7 released: it burns in before it rejoins"
    assert cli("ls").stdout.strip() == "gpu-7: free; offences 1"
    bad = cli("add", "../x", "--reason", "r")
    assert bad.returncode == 2 and "node id '../x' is invalid" in bad.stderr


SMALL = ("--matmul-n", "256", "--disk-mib", "4", "--allreduce-mib", "1", "--repeats", "2")


def gate_of(fleet: FleetQuarantine, tmp_path, node: str = "n1") -> tuple[QuarantineGate, list[Event], list[str]]:
    seen: list[Event] = []
    phases: list[str] = []
    gate = QuarantineGate(fleet, node, tmp_path, "127.0.0.1",
                          lambda kind, **f: seen.append(Event(kind=str(kind), wall_time=0.0, fields=f)),
                          set_phase=phases.append, poll_s=0.1, retry_s=0.1, burn_in_argv=SMALL)
    return gate, seen, phases


def test_the_gate_holds_while_the_record_stands_then_burns_in(tmp_path, etcd_server):
    fleet = fleet_of(etcd_server, expiry_s=1)
    gate, seen, phases = gate_of(fleet, tmp_path)
    assert gate.hold(lambda: False, lambda: None, burn_in_at_start=False) is None  # free: no burn-in either
    assert seen == []
    fleet.add("n1", reason="bad DIMM", source="operator", by="ops")
    assert gate.hold(lambda: False, lambda: None, burn_in_at_start=False) is None
    assert [e.kind for e in seen] == ["quarantine_held", "burn_in_passed"], seen
    assert phases[0].startswith("quarantined: ") and phases[0].endswith("(bad DIMM)") and phases[-1] == "burning in"
    assert gate.view()["standing"] is None and gate.view()["offences"] == 1
    assert gate.view()["burn_in"]["passed"] and fleet.burn_ins()["n1"]["passed"]
    # A record seen by the peer watch that lapsed before the hold still needs a burn-in.
    fleet.add("n1", reason="again", source="operator", by="ops")
    gate.check()
    fleet.release("n1")
    seen.clear()
    assert gate.hold(lambda: False, lambda: None, burn_in_at_start=False) is None
    assert [e.kind for e in seen] == ["burn_in_passed"]


def test_a_failed_burn_in_is_a_new_offence_and_a_held_node_stops_when_asked_or_when_the_run_ends(
        tmp_path, etcd_server):
    fleet = fleet_of(etcd_server, expiry_s=30, burn_in_min_ratio=0.9)
    # The fleet's numbers are far beyond what this machine does: the burn-in cannot pass.
    fleet.publish_burn_in("n0", {"matmul_gflops": 1e9, "disk_write_mbps": 1e9, "allreduce_gbps": 1e9, "passed": True})
    gate, seen, _ = gate_of(fleet, tmp_path)
    calls = []

    def stopping() -> bool:
        calls.append(1)
        return any(e.kind == "burn_in_failed" for e in seen)

    ending = gate.hold(stopping, lambda: None, burn_in_at_start=True)
    assert ending == (EXIT_PREEMPTED_AGENT, "preempted", "stopped while held out of the run")
    failed = [e for e in seen if e.kind == "burn_in_failed"]
    assert "burn-in failed (needs 90% of the fleet's median)" in failed[0].fields["reason"]
    [record] = [e for e in seen if e.kind == "node_quarantined"]
    assert record.fields["source"] == "burn_in" and record.fields["offence"] == 1
    assert record.fields["evidence"]["matmul_gflops"] > 0
    standing = fleet.get("n1")
    assert standing is not None and standing.record.source == "burn_in"
    # Held by that record, the node ends when the run does.
    assert gate.hold(lambda: False, lambda: (0, "succeeded", "the run ended"), burn_in_at_start=False) == \
        (0, "succeeded", "the run ended")


def test_a_persistent_straggler_quarantines_its_node_only_where_the_run_can_go_on_without_it(tmp_path, etcd_server):
    fleet = fleet_of(etcd_server)
    gate, seen, _ = gate_of(fleet, tmp_path)
    flag = {"reason": "rank 3 (node n1) is a straggler in compute", "windows_flagged": 60, "rank": 3}
    gate.persistent_straggler(flag, can_leave=False)
    [skipped] = seen
    assert skipped.kind == "quarantine_skipped" and "cannot go on without this node" in skipped.fields["why"]
    assert fleet.get("n1") is None
    gate.persistent_straggler(flag, can_leave=True)  # written on a thread of its own
    while (standing := fleet.get("n1")) is None:  # no bound: the test's timeout guards
        time.sleep(0.05)
    record = standing.record
    assert record.source == "straggler" and record.evidence["rank"] == 3
    assert record.reason == "a persistent straggler: rank 3 (node n1) is a straggler in compute (flagged for 60 windows)"
