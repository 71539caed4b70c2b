"""Recovery without restarting the world: the decision, the batch plan, re-formation and state sync.

``decide.py`` and ``costs.py`` hold the pure recovery decision (which rung of
the ladder answers a failure, and when to grow back) and need nothing but the
standard library: the node agent imports them without torch.  This package
imports no submodule itself; import the ones you need.
"""
