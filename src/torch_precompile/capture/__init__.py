"""Stage 1: trace ``fn`` into an ATen graph plus the calling convention around it."""

from torch_precompile.capture.trace import Capture, capture

__all__ = ["Capture", "capture"]
