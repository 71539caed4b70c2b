"""Chaos drills: a workload, a topology, a fault schedule and what must hold, run and scored on this machine.

Never imported by ``import resilient``.  The fault plans and the in-worker
injector the drills use live below, in :mod:`resilient.faults`.  Import the
submodules: :mod:`resilient.chaos.drill` (the file), :mod:`resilient.chaos.runner`,
:mod:`resilient.chaos.score`, :mod:`resilient.chaos.report`,
:mod:`resilient.chaos.workload` (the bundled workload) and
:mod:`resilient.chaos.host` (faults from outside the workers).
"""
