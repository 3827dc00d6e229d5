"""The private names of transformers and torch that ``precompile.for_generate`` relies on:
which experts a mixture-of-experts config runs, the cache size generate() remembers between
calls, and the dynamic-dim mark on a recorded prefill."""

from __future__ import annotations

from typing import Any

import torch


def experts_implementation(config: Any) -> str | None:
    """The experts a transformers config runs (``"grouped_mm"``, ``"batched_mm"``,
    ``"eager"``), or None for a model without them (or a release that does not say)."""
    return getattr(config, "_experts_implementation", None)


def remember_cache_size(model: Any, length: int) -> None:
    """Have generate() size its next static cache from ``length`` on: it otherwise keeps the
    largest cache it made before."""
    model._previous_max_cache_length = length


def mark_dynamic_dim(tensor: torch.Tensor, dim: int, shape_id: str, low: int, high: int) -> None:
    """Mark ``dim`` of ``tensor`` dynamic for capture, within [low, high]."""
    from torch._dynamo.decorators import mark_unbacked

    mark_unbacked(tensor, dim, shape_id=shape_id, min=low, max=high)
