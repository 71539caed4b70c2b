"""Recovery policy and plans: restart, promote a spare, shrink or grow under the batch contract.

Importing this package imports nothing else (in particular not torch): the
node agent uses its pure policies.  Import the submodules you need.
"""
