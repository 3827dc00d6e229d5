"""What ``inspect`` and ``verify`` say about a saved pair, read without executing it:
``report`` gathers it as data (``describe``, ``verify``), ``text`` writes it for a terminal."""

from torch_precompile.inspection.report import Verification, describe, verify
from torch_precompile.inspection.text import render

__all__ = ["Verification", "describe", "render", "verify"]
