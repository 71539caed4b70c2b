"""A spare's process until its promotion: nothing of the training script runs before it has a rank.

The agent starts a spare as ``python -u -m resilient.worker.standby COMMAND...`` (forked from its fork server,
which has imported torch, or as a new interpreter when it cannot fork), where ``COMMAND`` is the workers'
own command line.  This module tells the agent the spare is ready, waits on the agent's recovery store until
an assignment makes it a member of a generation, and only then starts ``COMMAND`` with the rank it was given:
``RANK``, ``WORLD_SIZE``, ``ROLE_RANK``, ``ROLE_WORLD_SIZE`` of its assignment (``LOCAL_RANK`` is its own
slot on this node, set at its start), and ``RESILIENT_PROMOTED`` naming the generation.  A Python script runs
in this process (``runpy``, as the fork server runs a worker), so what the fork server or this module imported
stays imported; any other command replaces the process (``exec``).

Why the script waits at its top rather than in ``resilient.Run()``: a script reads its rank wherever it likes
(``int(os.environ["RANK"])`` before anything else, a seed offset, a logging rank, a gradient accumulation
divided by ``WORLD_SIZE``), and a spare that ran it before it had one would act on a rank it does not have.
Here it cannot: the script's first line runs with the right variables, its ``Run()`` finds the generation it
was promoted into and takes the state of the survivors (it restores no checkpoint).  What it costs is the
script's start-up (its imports, data set-up, model build) at promotion, which the survivors wait for; the
fork server's ``--preload`` takes a script's heavy imports out of it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

from .env import WorkerEnv
from .forkserver import run_main, split_argv
from .heartbeat import HeartbeatSender

PROMOTED = "RESILIENT_PROMOTED"
"""The generation a spare was promoted into before its script started (read by :class:`~resilient.worker.env.WorkerEnv`)."""


def command(entrypoint: Sequence[str]) -> tuple[str, ...]:
    """A spare's command line for the workers' ``entrypoint``: this module first, with the interpreter's options
    of the entrypoint (``-u``, ``-B``) when it is this Python, then the entrypoint itself."""
    options: list[str] = []
    if entrypoint and os.path.realpath(entrypoint[0]) == os.path.realpath(sys.executable):
        for arg in entrypoint[1:]:
            if arg not in ("-u", "-B"):
                break
            options.append(arg)
    return (sys.executable, *options, "-m", __name__, *entrypoint)


def promotion(environ: Mapping[str, str]) -> dict[str, str]:
    """Say ready, wait until an assignment makes this spare a member; the variables its script starts with.

    Raises :class:`~resilient.elastic.reform.ReformError` when the agent's store cannot be reached (the agent is
    gone: the spare has nothing to do) and :class:`~resilient.core.errors.ConfigError` for a process that is not
    a spare.
    """
    from ..core.errors import ConfigError
    from ..elastic.reform import connect_store, wait_until_assigned

    env = WorkerEnv.from_environ(environ)
    if env is None or env.role != "spare" or env.recovery_store is None or env.worker_id is None:
        raise ConfigError("python -m resilient.worker.standby is a spare's process, started by resilient run with "
                          "RESILIENT_ROLE=spare and RESILIENT_RECOVERY_STORE: it is not meant to be run by hand")
    host, port = env.recovery_store
    store = connect_store(host, port, env.recovery_timeout_s)  # first: ready means it can start at once
    sender = HeartbeatSender(env.agent_socket, rank=env.rank, local_rank=env.local_rank, generation=env.generation)
    sender.send("recovery", "standby", 0, recovery={"event": "ready", "worker": env.worker_id, "role": "spare",
                                                     "step": None, "standby": True})
    sender.close()
    assignment = wait_until_assigned(store, env.worker_id, env.generation, env.recovery_timeout_s)
    del store  # the Run connects again: this connection would stay open, unused, for the process's life
    member = next(m for m in assignment.members if m.worker_id == env.worker_id)
    world = str(len(assignment.members))
    return {"RANK": str(member.new_rank), "WORLD_SIZE": world, "ROLE_RANK": str(member.new_rank),
            "ROLE_WORLD_SIZE": world, "ROLE_NAME": "default", PROMOTED: str(assignment.generation)}


def start(entrypoint: Sequence[str]) -> None:
    """Run ``entrypoint`` in this process: a Python script or module with ``runpy``, anything else by ``exec``."""
    argv = list(entrypoint)
    if argv and os.path.realpath(argv[0]) == os.path.realpath(sys.executable):
        try:
            _, kind, target, args = split_argv(argv)
        except ValueError:
            pass  # interpreter options a process cannot take on: a new interpreter runs it
        else:
            run_main(kind, target, args)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(argv[0], argv, dict(os.environ))


def main(argv: Sequence[str] | None = None) -> None:
    entrypoint = list(argv if argv is not None else sys.argv[1:])
    if not entrypoint:
        raise SystemExit("usage: python -m resilient.worker.standby COMMAND [ARGS...] (started by resilient run)")
    os.environ.update(promotion(os.environ))
    start(entrypoint)


if __name__ == "__main__":
    main()
