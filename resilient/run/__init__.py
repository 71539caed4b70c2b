"""The Run: the object a training script creates, and the parts it is made of.

- :mod:`.core`: :class:`Run`, the script's face: the step loop, ``report``,
  ``attempt``, ``micro_batches``, ``save``, ``close``, ``section``;
- :mod:`.state`: :class:`~.state.RunState`, the one object every part below
  reads and changes (none of them reaches into the Run);
- :mod:`.records`, :mod:`.streams`: what the state holds of the step (where
  the rank is in the update, an attempt's start, a verdict not read yet) and
  of the random streams and data cursor; they import nothing of the Run;
- :mod:`.attempt`: ``with run.attempt():``, the micro-batches, the random
  streams, where a rank is in the optimizer's update;
- :mod:`.ddp`: the DDP wrapper the Run owns, made again on a re-formed group;
- :mod:`.payloads` and :mod:`.saving`: what a checkpoint holds and how it is
  put back; when the Run saves, and a graceful stop;
- :mod:`.resume`: the resumed run checked at its first step, ``run.prefetch``;
- :mod:`.memory`: the node's memory tier;
- :mod:`.recovery`: in-process recovery under the agent (survivor, spare,
  growing back);
- :mod:`.nonfinite`, :mod:`.audit`: non-finite gradients, the replica audit;
- :mod:`.integration`: what the script's integration allows each rung of
  recovery, told to the agent; declining in-process recovery;
- :mod:`.sections`, :mod:`.timing`: sections as the agent sees them, step
  time by section for the straggler and slowdown detectors.
"""

from .core import Run

__all__ = ["Run"]
