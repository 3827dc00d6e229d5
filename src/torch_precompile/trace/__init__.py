"""Stage 1, trace: turn ``fn`` into an ATen graph plus the calling convention around it."""

from torch_precompile.trace.core import Capture, capture

__all__ = ["Capture", "capture"]
