"""The per-node agent: supervises a node's worker processes (the worker's side lives in resilient.worker).

Importing this package imports nothing else (in particular not torch): the
supervisor must stay light and must never touch CUDA before it spawns its
workers.  Import the submodules you need.
"""
