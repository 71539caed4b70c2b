"""Chaos: declarative, seeded fault plans and the injector that carries them out inside a worker.

Never imported by ``import resilient``: a worker loads it only when its
agent hands it a plan (``RESILIENT_FAULT_PLAN``).  Import the submodules:
:mod:`resilient.chaos.plan` (the format) and :mod:`resilient.chaos.inject`.
"""
