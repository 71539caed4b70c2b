"""The per-node agent: supervises a node's worker processes, and the worker-side glue that talks to it.

Importing this package imports nothing else (in particular not torch): the
supervisor must stay light and must never touch CUDA before it spawns its
workers.  Import the submodules you need.
"""
