"""What capture reads of torch.optim's private state: step hooks and a step count's dtype."""

from __future__ import annotations

from typing import cast

import torch
from torch.optim.optimizer import (
    _get_scalar_dtype,
    _global_optimizer_post_hooks,
    _global_optimizer_pre_hooks,
)


def step_hooks(optimizer: torch.optim.Optimizer) -> str:
    """What step hooks would run around ``optimizer.step()``, in words ('' for none)."""
    kinds = [
        ("step pre-hooks", getattr(optimizer, "_optimizer_step_pre_hooks", {})),
        ("step post-hooks", getattr(optimizer, "_optimizer_step_post_hooks", {})),
        ("global step pre-hooks", _global_optimizer_pre_hooks),
        ("global step post-hooks", _global_optimizer_post_hooks),
    ]
    return " and ".join(f"{len(hooks)} {kind}" for kind, hooks in kinds if hooks)


def step_count_dtype(fused: bool | None) -> torch.dtype:
    """The dtype torch.optim gives a new ``step`` tensor."""
    return cast(torch.dtype, _get_scalar_dtype(is_fused=fused))
