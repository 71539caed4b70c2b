"""Fault plans and the injector that carries them out inside a worker.

A plan (:mod:`resilient.faults.plan`) names faults by rank, step, section and
attempt; the agent hands it to its workers (``RESILIENT_FAULT_PLAN``), and a
worker's :class:`~resilient.faults.inject.FaultInjector` fires each one as the
rank enters its section.  Below the worker and the data loader, which call
the injector; the drills (:mod:`resilient.chaos`) build on it.  Never imported
by ``import resilient`` unless a plan is given.
"""
