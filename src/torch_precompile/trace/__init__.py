"""Stage 1, trace: turn ``fn`` into an ATen graph plus the calling convention around it.

Here the capture itself (its arguments, inputs, model state, dynamic dims, optimizers, tensor
subclasses, the differentiable form and the records it ends in); ``frontends/`` reads ``fn``,
``facts/`` records what the trace relies on, ``parallel/`` handles DTensors, DDP and FSDP2.
"""

from torch_precompile.trace.core import Capture, capture

__all__ = ["Capture", "capture"]
