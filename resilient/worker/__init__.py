"""The worker's side of the agent contract: what a training process does for its node agent.

:mod:`~resilient.worker.env` reads the environment the agent sets,
:mod:`~resilient.worker.protocol` is the heartbeat format both sides speak,
:mod:`~resilient.worker.heartbeat` sends heartbeats from the training loop
and :mod:`~resilient.worker.hooks` installs stack dumps, the error file,
graceful stop and planned faults.  Importing this package imports nothing
else; :class:`resilient.Run` imports the submodules when an agent is present.
"""
