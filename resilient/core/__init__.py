"""The layer everything in resilient stands on, importing nothing else of the project.

Errors (:mod:`.errors`), the exit-code contract (:mod:`.exitcodes`), events
and their kinds (:mod:`.events`), atomic files (:mod:`.fsutil`), tensor
bytes (:mod:`.tensors`), what a model, optimizer and the random generators
hold (:mod:`.state`), the private torch APIs probed (:mod:`.compat`), which
errors mean a collective failed (:mod:`.collective`), and the package's
lazy exports (:mod:`.lazy`) and version (:mod:`.version`).
"""
