"""Chaos: seeded fault plans, the injector that carries them out inside a worker, and scored drills.

Never imported by ``import resilient``: a worker loads it only when its
agent hands it a plan (``RESILIENT_FAULT_PLAN``), and ``resilient drill``
when it runs.  Import the submodules: :mod:`resilient.chaos.plan` (the
format), :mod:`resilient.chaos.inject`, and for drills
:mod:`resilient.chaos.drill` (the file), :mod:`resilient.chaos.runner`,
:mod:`resilient.chaos.score`, :mod:`resilient.chaos.report` and
:mod:`resilient.chaos.workload` (the bundled workload).
"""
