"""``DataParallel(overlap="forward")``: averages that run on into the next forward, each layer
waiting only for its own. The algorithm is :class:`ForwardOverlap` (``runtime.py``); the other
modules intercept torch for it: ``gates.py`` (a pre-hook per layer), ``pending.py`` (pending
gradients, parameters marked while their update waits), ``steps.py`` (optimizer steps heard,
deferred and timed). What lands at which gate is :class:`interlace.comm.forward_plan.GateDues`.
"""

from interlace.dp.forward_overlap.runtime import ForwardOverlap

__all__ = ["ForwardOverlap"]
