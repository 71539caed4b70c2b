"""Straggler scoring across machines: three agents with one rank each, meeting through a real etcd.

Alone, an agent with one rank has nobody to compare it with; the agents pass their ranks' timing windows to
each other (straight to the scorer's timing link, the store until it is announced), and the slowed rank is named by the agent that runs it, on the node it runs on.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from resilient.coord.etcd import EtcdClient, EtcdConfig

from .agent_helpers import events, node_status, start_agent

pytestmark = [pytest.mark.timeout(360), pytest.mark.serial]

WORKER = Path(__file__).parent / "pace_worker.py"
NODES = ("n0", "n1", "n2")


def test_a_slowed_rank_on_one_of_three_nodes_is_flagged_by_its_own_agent_with_its_node(tmp_path, etcd_server,
                                                                                      etcd_run_id):
    run = tmp_path / "run"
    faults = tmp_path / "plan.json"
    faults.write_text(json.dumps({"version": 1, "seed": 0, "faults": [
        {"kind": "slow", "rank": 1, "step": 120, "section": "step", "duration_s": 0.02}]}))
    flags = ("--nnodes", "3", "--nproc-per-node", "1", "--store", etcd_server.url, "--run-id", etcd_run_id,
             "--local-addr", "127.0.0.1", "--rdzv-last-call", "1", "--fault-plan", str(faults), "--no-evict")
    script = ("--steps", "450", "--out", str(tmp_path / "out"), "--device-ms", "60", "--audit-every", "0")
    agents = {n: start_agent(run, *flags, "--node-id", n, script=WORKER, script_args=script,
                             log=tmp_path / f"{n}.log") for n in NODES}
    try:
        codes = {n: a.wait(timeout=300) for n, a in agents.items()}
    finally:
        for a in agents.values():
            if a.poll() is None:
                a.kill()
    assert codes == {n: 0 for n in NODES}, {n: (tmp_path / f"{n}.log").read_text()[-3000:] for n in NODES}
    [slow_node] = [e["node"] for e in events(run, "workers_started") if "1" in e["pids"]]
    flagged = events(run, "straggler_flagged")
    assert flagged, "no straggler flagged"
    # Named once, by the agent of the slowed rank, in the section the fault slowed, with the peers' numbers.
    assert {(e["node"], e["rank"], e["section"]) for e in flagged} == {(slow_node, 1, "compute")}, flagged
    assert f"rank 1 (node {slow_node}) is a straggler in compute" in flagged[0]["reason"]
    assert flagged[0]["ratio"] > 1.2 and flagged[0]["window"] * 5 >= 120, flagged[0]
    # One agent, rank 0's, scored every rank against the others, each labelled with its own node; no other
    # agent followed the windows.
    [scorer] = [e["node"] for e in events(run, "workers_started") if "0" in e["pids"]]
    node_of = {int(r): e["node"] for e in events(run, "workers_started") for r in e["pids"]}
    for node in NODES:
        scores = node_status(run, node)["slowness"]["scores"]
        if node != scorer:
            assert scores == [], (node, scores)
            continue
        assert {(s["rank"], s["node"]) for s in scores} == set(node_of.items()), scores
        assert {"compute", "optimizer"} <= {s["section"] for s in scores}, scores
    digests = {json.loads((tmp_path / f"out.{r}").read_text())["params"] for r in range(3)}
    assert len(digests) == 1
    # The windows went to the scorer's timing link, not through etcd: a node writes its timing key only until
    # the scorer announced its link (its first window or two), where each of the 90 windows was a write before.
    client = EtcdClient(EtcdConfig.from_url(etcd_server.url))
    writes = {e.key.rsplit("/", 1)[-1]: e.version for e in client.get_prefix(f"/resilient/{etcd_run_id}/timing/")}
    assert scorer not in writes and sum(writes.values()) <= 2 * (len(NODES) - 1), writes
