"""The script's side of recovery: Run(ddp=True), run.micro_batches(), run.attempt().

Real gloo ranks under torchrun for the runs that compare a script written
the new way with the classic way, and a run shrunk from two ranks to one
with the reference that never shrank; the rest in this process.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from resilient import ConfigError, ElasticLoader, EventLog, Run
from resilient.data import DataFetchError
from resilient.run.attempt import is_recoverable, rewind_current
from resilient.run.ddp import rebuild

from . import launch
from .docs_text import the_block

WORKER = Path(__file__).with_name("attempt_worker.py")
REPO = WORKER.parent.parent
GLOO_RESET = "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:41234"


def run_worker(trace: Path, *args: str, nproc: int) -> None:
    """``nproc`` ranks of the worker, as torchrun would start them (forked: :mod:`tests.launch`)."""
    ranks = launch.run_ranks([sys.executable, str(WORKER), "--trace", str(trace), *args], nproc, timeout=180,
                             world=nproc > 1)
    assert [r.returncode for r in ranks] == [0] * nproc, "worker failed:\n" + "\n".join(
        f"--- rank {i} (exit {r.returncode}):\n{r.output[-3000:]}" for i, r in enumerate(ranks))


def read(trace: Path, rank: int) -> tuple[list[dict], dict[int, dict], dict]:
    starts, steps, end = [], {}, {}
    for line in Path(f"{trace}.rank{rank}").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("event") == "start":
            starts.append(rec)
        elif rec.get("event") == "end":
            end = rec
        else:
            steps[rec["step"]] = rec
    return starts, steps, end


STEPS, SAVED_AT = 8, 4


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """Two gloo ranks, the new API, never interrupted: the run every other run is compared with."""
    trace = tmp_path_factory.mktemp("reference") / "t"
    run_worker(trace, "--style", "attempt", "--steps", str(STEPS), nproc=2)
    return trace


def test_the_new_api_at_full_size_trains_exactly_like_the_classic_loop(reference, tmp_path):
    run_worker(tmp_path / "classic", "--style", "classic", "--steps", str(STEPS), nproc=2)
    for rank in range(2):
        starts, new, new_end = read(reference, rank)
        _, old, old_end = read(tmp_path / "classic", rank)
        assert starts[0]["wrapped"] == "DistributedDataParallel", "Run(ddp=True) wraps the model under a group"
        assert sorted(new) == sorted(old) == list(range(STEPS))
        for step in range(STEPS):
            assert new[step]["accumulation"] == 1
            for key in ("indices", "losses", "consumed", "samples"):
                assert new[step][key] == old[step][key], f"rank {rank} step {step}: {key} differs"
        assert new_end["params"] == old_end["params"], "final parameters differ"


def test_a_run_saved_on_two_ranks_and_restored_on_one_keeps_the_global_batch(reference, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run_worker(tmp_path / "b", "--style", "attempt", "--steps", str(SAVED_AT), "--dir", ckpt, nproc=2)
    run_worker(tmp_path / "b", "--style", "attempt", "--steps", str(STEPS), "--dir", ckpt,
               "--events", str(tmp_path / "events"), nproc=1)
    starts, shrunk, end = read(tmp_path / "b", 0)
    assert [(s["restored_from"], s["world_size"], s["wrapped"]) for s in starts[-1:]] == \
        [(f"step_{SAVED_AT:010d}", 1, "Sequential")]
    ref = [read(reference, r)[1] for r in range(2)]
    for step in range(SAVED_AT, STEPS):
        got = shrunk[step]
        assert got["accumulation"] == 2
        # Each micro-batch is the batch the reference's rank of that slot took: the same global sample set.
        assert got["indices"] == [ref[0][step]["indices"][0], ref[1][step]["indices"][0]], f"step {step}"
        assert got["consumed"] == ref[0][step]["consumed"] == 8 * (step + 1)
        assert got["samples"] == 4 * SAVED_AT + 8 * (step + 1 - SAVED_AT), "this rank now trains on 8 samples a step"
    # The first step after the restore starts from the same parameters, samples and seeds: the same losses.
    assert shrunk[SAVED_AT]["losses"] == [ref[0][SAVED_AT]["losses"][0], ref[1][SAVED_AT]["losses"][0]]
    # Only the order of the gradient reduction differs from then on: DDP halves each rank's gradient and sums the
    # two, one rank sums two halved micro-batch gradients. Halving is exact in floating point and a sum of two is
    # commutative, so here the shrunk run stays bitwise the reference (an accumulation that is not a power of two,
    # or more than two terms, would round differently and agree only to rounding).
    for step in range(SAVED_AT, STEPS):
        assert shrunk[step]["losses"] == [ref[0][step]["losses"][0], ref[1][step]["losses"][0]], f"step {step}"
    assert end["params"] == read(reference, 0)[2]["params"], "parameters differ from the run that never shrank"
    events = [json.loads(line) for line in Path(f"{tmp_path / 'events'}.rank0").read_text().splitlines()]
    [planned] = [e for e in events if e["kind"] == "batch_planned"]
    assert (planned["world_size"], planned["global_batch"], planned["accumulation"], planned["even"]) == (1, 8, 2, True)
    assert planned["reason"] == "global batch 8 = 1 rank x 2 micro-batches x 4 samples: accumulation 2 keeps the global batch"


def test_a_peer_killed_in_the_step_is_a_recoverable_failure_and_without_recovery_it_passes_through(tmp_path):
    # The test hosts the store (as the agent will) on a free port; the workers only connect to it.
    store = dist.TCPStore("127.0.0.1", 0, world_size=3, is_master=True, wait_for_workers=False)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(store.port), "WORLD_SIZE": "2", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    trace = tmp_path / "t"
    procs = [launch.popen([sys.executable, str(WORKER), "--trace", str(trace), "--style", "attempt", "--steps",
                           "6", "--die-rank", "1", "--die-step", "3"], {**env, "RANK": str(r), "LOCAL_RANK": str(r)})
             for r in range(2)]
    try:
        outputs = [launch.collect(p, timeout=120).output for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert procs[1].returncode == -9, outputs[1][-2000:]
    assert procs[0].returncode == 0, outputs[0][-3000:]
    lines = [json.loads(line) for line in Path(f"{trace}.rank0").read_text().splitlines()]
    error = lines[-1]
    assert error["event"] == "error" and error["step"] == 3, lines
    assert error["recoverable"] and error["asked_recovery"] == 1, f"not recognised as a peer failure: {error}"
    assert [rec["step"] for rec in lines if "losses" in rec] == [0, 1, 2], "the failed step was not recorded"
    del store


# ------------------------------------------------------------------ in this process (no process group)
class Noisy(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int):
        return torch.full((4,), i / 40) + torch.randn(4)


def make_run(global_batch: int | None = None, **kwargs) -> Run:
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
    data = ElasticLoader(Noisy(), batch_size=4, seed=5, rank=0, world_size=1)
    if global_batch is not None:  # as restored from a checkpoint of a larger run
        data.load_state_dict({**data.state_dict(), "global_batch": global_batch})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    return Run(model=model, optimizer=optimizer, data=data, agent=None, events=EventLog(), ddp=True, **kwargs)


def draws(run: Run) -> list:
    """One step's micro-batches (indices and tensors) and what the step draws from every RNG stream."""
    out: list = [random.random(), float(np.random.rand())]
    for x in run.micro_batches():
        out += [list(run.data.last_indices), x.tolist(), torch.rand(2).tolist()]
        run.model(x).mean().backward()
    return out


def test_attempt_without_in_process_recovery_passes_every_error_through():
    run = make_run()
    assert type(run.model) is torch.nn.Sequential, "no process group: ddp=True leaves the module plain"
    for error in (RuntimeError(GLOO_RESET), ValueError("a bug in the script")):
        with pytest.raises(type(error)) as info:
            for _ in run.steps(3):
                with run.attempt():
                    draws(run)
                    raise error
        assert info.value is error, "re-raised unchanged"
        assert run.step == 0 and run._state.attempt.start is None
    assert is_recoverable(RuntimeError(GLOO_RESET)), "a peer failure, but nothing here can re-form the group"


def test_rewind_attempt_restores_the_cursor_and_every_random_stream():
    run = make_run(global_batch=12)  # three micro-batches of 4 on this one rank
    assert run.accumulation == 3
    for _ in run.steps(1):
        with run.attempt():
            first = draws(run)
            assert run.data.consumed == 12
            assert all(p.grad is not None for p in run.model.parameters())
            rewind_current(run._state)
            assert run.data.consumed == 0 and all(p.grad is None for p in run.model.parameters())
            again = draws(run)
    assert first == again, "the retried step reads the same batches and draws the same numbers"
    assert [len(first[i]) for i in (2, 5, 8)] == [4, 4, 4] and first[2] + first[5] + first[8] == \
        run.data.indices_at(0, 12), "the step's three micro-batches are its twelve stream positions in order"
    with pytest.raises(ConfigError, match="only inside run.attempt"):
        rewind_current(run._state)


def train(run: Run, fail_at: int | None) -> tuple[list, list]:
    random.seed(4)  # the step draws from python's RNG too: both runs start it alike
    failed = False
    seen, losses = [], []
    for step in run.steps(4):
        seen.append(step)
        with run.attempt():
            for k, x in enumerate(run.micro_batches()):
                loss = run.model(x).pow(2).mean() / run.accumulation + 1e-3 * random.random()
                loss.backward()
                if step == fail_at and not failed and k == run.accumulation - 1:
                    failed = True  # in the last backward, the one whose gradients DDP all-reduces
                    raise RuntimeError(GLOO_RESET)
            run.optimizer.step()
            run.optimizer.zero_grad()
            run.report(loss=loss)
            losses.append(loss.item())
    return seen, losses + [p.detach().clone() for p in run.model.parameters()]


def test_a_recovered_attempt_is_retried_and_the_run_is_the_run_that_never_failed():
    reference = train(make_run(global_batch=8), None)
    run = make_run(global_batch=8)
    calls: list = []
    # What in-process recovery plugs in: it rewinds the attempt itself (first), re-forms the group, and says retry.
    run._state.recovery = lambda exc: calls.append(exc) or rewind_current(run._state) or True
    seen, got = train(run, 2)
    assert seen == [0, 1, 2, 2, 3], "steps() yields the failed step again"
    assert len(calls) == 1 and isinstance(calls[0], RuntimeError)
    assert all(torch.isfinite(t).all() for t in got[4:]), "a run that diverged would compare nothing"
    for a, b in zip(got, reference[1], strict=True):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, "not the run that never failed"
    assert run.samples == 4 * 8 and run.data.consumed == 4 * 8, "the failed attempt counted nothing"
    [retried] = run.events.of_kind("attempt_retried")
    assert retried.fields["step"] == 2 and "Connection closed by peer" in retried.fields["error"]


def test_only_peer_and_collective_failures_are_recoverable():
    assert is_recoverable(RuntimeError(GLOO_RESET))
    assert is_recoverable(dist.DistBackendError("NCCL communicator was aborted on rank 1"))
    assert is_recoverable(RuntimeError("[gloo] Timed out waiting 30000ms for recv operation to complete"))
    try:
        try:
            raise ConnectionResetError("Connection reset by peer")
        except ConnectionResetError as inner:
            raise RuntimeError("DDP backward failed") from inner
    except RuntimeError as outer:
        assert is_recoverable(outer), "the cause is in the chain"
    assert not is_recoverable(ValueError("shapes do not match"))
    assert not is_recoverable(KeyboardInterrupt())
    assert not is_recoverable(DataFetchError("broken pipe in a sample", position=3, index=3, cause_type="OSError",
                                             cause="broken pipe"))


def test_ddp_true_owns_the_wrapper_and_syncs_only_the_last_micro_batch():
    with pytest.raises(ConfigError, match=r"Run\(ddp='yes'\): pass True, False, or a dict"):
        Run(model=torch.nn.Linear(2, 1), agent=None, ddp="yes")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        wrapped = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
        with pytest.raises(ConfigError, match=r"wrapped already: pass the plain module \(model.module\)"):
            Run(model=wrapped, agent=None, ddp=True)
        run = make_run(global_batch=12)
        ddp = run.model
        assert isinstance(ddp, torch.nn.parallel.DistributedDataParallel)
        syncing = []
        for _ in run.steps(1):
            with pytest.raises(RuntimeError), run.attempt():
                for x in run.micro_batches():
                    syncing.append(ddp.require_backward_grad_sync)
                    run.model(x).mean().backward()
                    if len(syncing) == 2:
                        raise RuntimeError(GLOO_RESET)  # inside no_sync(): leaving the attempt must leave it
            assert ddp.require_backward_grad_sync
            with run.attempt():
                syncing += [ddp.require_backward_grad_sync for _ in run.micro_batches()]
        assert syncing == [False, False, False, False, True], "no_sync() on all but the last micro-batch"
        rebuild(run._state)
        assert isinstance(run.model, torch.nn.parallel.DistributedDataParallel) and run.model is not ddp
        assert run.model.module is ddp.module, "rebuilt around the same module (and the optimizer's parameters)"
    finally:
        dist.destroy_process_group()


def test_the_docs_recovery_example_runs_under_plain_python(tmp_path):
    script = the_block("docs/in-process.md", "py", "with run.attempt():")
    (tmp_path / "train.py").write_text(script)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=180,
                          env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("step 1000, accumulation 1, restored from None")
    assert (tmp_path / "ckpt" / "step_0000001000" / "manifest.json").exists()


def test_a_rebuilt_ddp_wrapper_can_start_in_the_bucket_layout_of_the_one_it_replaces():
    from resilient.run.ddp import ddp_layout, wrap_ddp

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
        old = wrap_ddp(module, {})
        assert ddp_layout(old) == [[0, 1, 2, 3]], "DDP's first-iteration layout: parameter order"
        for _ in range(2):  # DDP rebuilds its buckets at the forward after its first backward
            old(torch.randn(2, 8)).sum().backward()
        assert ddp_layout(old) == [[3, 2, 1, 0]], "rebuilt in the order gradients became ready"
        assert ddp_layout(wrap_ddp(module, {})) == [[0, 1, 2, 3]], "a fresh wrapper starts over"
        assert ddp_layout(wrap_ddp(module, {}, ddp_layout(old))) == [[3, 2, 1, 0]], "carried over"
        assert ddp_layout(wrap_ddp(module, {}, [[1, 0]])) == [[0, 1, 2, 3]], "another model's layout is ignored"
        assert ddp_layout(module) is None
    finally:
        dist.destroy_process_group()
