"""Stage 2: realize a captured graph as Python source exposing ``call(flat_inputs)``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoweredGraph:
    """Section 2 of the artifact, and the acceleration bytes that go into the cache."""

    source: str
    acceleration: bytes | None
