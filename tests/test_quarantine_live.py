"""Node quarantine on a live run: two agents of 2 ranks each meeting through a real etcd.

The script (``tests/pace_worker.py``) does not opt into in-process recovery, so the other node answers the
departure by restart from the newest commit on fewer nodes.

Node n1's second rank is slowed (a ``slow`` fault in its compute): it is
flagged as a straggler, the flag persists, and n1 quarantines itself.  It
leaves the generation, stays out of the next rendezvous (n0 goes on alone),
burns in once its record lapses, is judged against n0's burn-in and
rejoins.  An operator then quarantines it again: the second offence gets
twice the expiry; released at once, n1 burns in and rejoins, and the run
finishes on both nodes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from .agent_helpers import agent_env, events, node_status, start_agent, wait_for
from .test_stragglers_live import scrape

pytestmark = [pytest.mark.timeout(400), pytest.mark.serial]

WORKER = Path(__file__).parent / "pace_worker.py"
EXPIRY_S = 20
STEPS = 700  # n0 alone must still be training when n1 is back from its first expiry and burn-in


def _flags(url: str, run_id: str, fleet: str, node: str) -> tuple[str, ...]:
    return ("--nnodes", "1:2", "--nproc-per-node", "2", "--store", url, "--run-id", run_id, "--node-id", node,
            "--local-addr", "127.0.0.1", "--rdzv-last-call", "1", "--stop-grace", "3", "--max-restarts", "5",
            "--metrics-port", "0", "--fleet", fleet, "--burn-in", "--quarantine-expiry", str(EXPIRY_S),
            "--quarantine-after-windows", "6",
            # Two agents, four workers and etcd share two cores here, and this disk's write speed varies
            # fivefold from one repeat to the next (benchmarks/results/sharded_bench.md): the burn-in is
            # judged loosely, and its verdicts are tested exactly in test_quarantine.py.
            "--burn-in-min-ratio", "0.2",
            "--burn-in-arg=--matmul-n=384", "--burn-in-arg=--disk-mib=8", "--burn-in-arg=--allreduce-mib=2")


def _cli(url: str, fleet: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "resilient", "quarantine", *args, "--store", url, "--fleet", fleet],
                          capture_output=True, text=True, timeout=60, env=agent_env(), check=True)


def _of(run_dir: Path, node: str, *kinds: str) -> list[dict]:
    if not (run_dir / "events.jsonl").exists():
        return []
    return [e for e in events(run_dir) if e.get("node") == node and e["kind"] in kinds]


def test_a_persistent_straggler_node_is_kept_out_burns_in_rejoins_and_a_second_offence_doubles(
        tmp_path, etcd_server, etcd_run_id):
    run, out, fleet = tmp_path / "run", tmp_path / "out", f"f-{uuid.uuid4().hex[:10]}"
    # n1's second rank (global rank 1 or 3, by its node rank), first attempt only: 30 ms more per step.
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"version": 1, "seed": 0, "faults": [
        {"kind": "slow", "node": "n1", "rank": r, "step": 60, "section": "step", "duration_s": 0.03}
        for r in (1, 3)]}))
    script = ("--steps", str(STEPS), "--out", str(out), "--device-ms", "40", "--ckpt", str(tmp_path / "ckpt"),
              "--every", "25", "--audit-every", "0")
    agents = {n: start_agent(run, *_flags(etcd_server.url, etcd_run_id, fleet, n), "--fault-plan", str(plan),
                             script=WORKER, script_args=script, log=tmp_path / f"{n}.log") for n in ("n0", "n1")}
    try:
        first = wait_for(lambda: _of(run, "n1", "node_quarantined"), 180, "n1 to quarantine itself")[0]
        # Held out: its status says so while the record stands.
        held = wait_for(lambda: (s := node_status(run, "n1")) and s["phase"].startswith("quarantined") and s, 30,
                        "n1's status to show the quarantine")
        assert held["quarantine"]["standing"]["offence"] == 1, held["quarantine"]
        [listening] = _of(run, "n1", "metrics_listening")
        samples = scrape(listening["url"])
        assert samples[f'resilient_node_quarantined{{node="n1",run_id="{etcd_run_id}"}}'] == 1.0
        assert samples[f'resilient_node_quarantine_offences{{node="n1",run_id="{etcd_run_id}"}}'] == 1.0
        wait_for(lambda: len(_of(run, "n1", "burn_in_passed")) >= 2, 120, "n1's burn-in after the record lapsed")
        wait_for(lambda: len([e for e in _of(run, "n1", "rendezvous_joined") if e["num_nodes"] == 2]) >= 2, 120,
                 "n1 to rejoin")
        # The second offence, from an operator: twice the expiry.  Released at once, it burns in and rejoins.
        _cli(etcd_server.url, fleet, "add", "n1", "--reason", "ECC errors", "--expiry", str(EXPIRY_S))
        second = json.loads(_cli(etcd_server.url, fleet, "ls", "--json").stdout)["nodes"]
        wait_for(lambda: [e for e in _of(run, "n1", "quarantine_held") if e["offence"] == 2], 60,
                 "n1 to leave its generation for the second record")
        _cli(etcd_server.url, fleet, "release", "n1")
        codes = {n: a.wait(timeout=240) for n, a in agents.items()}
    finally:
        for a in agents.values():
            if a.poll() is None:
                a.kill()
    logs = {n: (tmp_path / f"{n}.log").read_text()[-4000:] for n in agents}
    assert codes == {"n0": 0, "n1": 0}, logs

    # The quarantine: a persistent straggler on n1, its rank and section named, the first offence.
    assert first["source"] == "straggler" and first["offence"] == 1 and first["expiry_s"] == EXPIRY_S, first
    assert first["evidence"]["section"] == "compute" and first["evidence"]["rank"] in (1, 3), first
    assert first["evidence"]["windows_flagged"] >= 6 and "a persistent straggler: rank" in first["reason"]
    flagged = _of(run, "n1", "straggler_flagged")
    assert flagged and {(e["rank"], e["section"]) for e in flagged} == {(first["evidence"]["rank"], "compute")}

    # Kept out of the next rendezvous: n0 ran a generation alone between n1's leaving and its burn-in.
    log = events(run)
    at = log.index(first)
    passed = [i for i, e in enumerate(log) if e["kind"] == "burn_in_passed" and e["node"] == "n1" and i > at]
    back = passed[0]
    alone = [e for e in log[at:back] if e["kind"] == "rendezvous_joined"]
    assert alone and all(e["node"] == "n0" and e["num_nodes"] == 1 for e in alone), alone
    outcome = [e for e in log[at:back] if e["kind"] == "quarantine_held" and e["node"] == "n1"]
    assert outcome and outcome[0]["offence"] == 1
    # The burn-in was judged against the fleet: n0's own burn-in at start is the reference for every measure.
    result = log[back]["result"]
    assert result["passed"] and all(c["reference"] is not None for c in result["checks"]), result
    assert "of the fleet's median" in log[back]["reason"]

    # The second offence doubled the expiry, and the offences stay on record after the release.
    [row] = [r for r in second if r["node"] == "n1"]
    assert row["standing"]["offence"] == 2 and row["standing"]["expiry_s"] == 2 * EXPIRY_S, row
    assert row["standing"]["source"] == "operator" and row["offences"] == 2
    final = json.loads(_cli(etcd_server.url, fleet, "ls", "--json").stdout)["nodes"]
    assert {r["node"]: (r["standing"], r["offences"]) for r in final}["n1"] == (None, 2)
    # n1 rejoined after the release too, and the run finished on both nodes.
    joined = [e for e in log if e["kind"] == "rendezvous_joined" and e["node"] == "n1"]
    assert joined[-1]["num_nodes"] == 2 and len(joined) >= 3, joined
    steps = {json.loads((out.parent / f"{out.name}.{r}").read_text())["step"] for r in range(4)}
    assert steps == {STEPS}
