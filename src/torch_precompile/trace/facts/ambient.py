"""The thread and process state a trace ran under, for the driver to insist on at each call.

make_fx records ops after autocast has chosen their dtypes, tensors built without a dtype take
the default one, and an active torch function or dispatch mode acts on every op: all of it is
in the graph. The default dtype is recorded only where fn built a tensor from it, which
``DefaultDtypeUse`` notices while the trace runs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from torch_precompile.errors import PrecompileError
from torch_precompile.internals.tracing import dispatch_modes, function_modes
from torch_precompile.shipped.driver.call_state import ambient_now
from torch_precompile.shipped.driver.tensor_rules import qualified_name
from torch_precompile.spec import Ambient
from torch_precompile.trace.facts.code_homes import torch_own

# Functions that build a tensor of the default dtype when given no dtype (for float data).
_FACTORIES = frozenset(
    {
        torch.tensor,
        torch.as_tensor,
        torch.ones,
        torch.zeros,
        torch.empty,
        torch.full,
        torch.rand,
        torch.randn,
        torch.arange,
        torch.linspace,
        torch.logspace,
        torch.eye,
        torch.scalar_tensor,
        torch.range,
    }
)


class DefaultDtypeUse(TorchFunctionMode):
    """Pushed around fn while it is traced: notes a tensor built with the default dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.used = False

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _FACTORIES and kwargs.get("dtype") is None:
            self.used = True
        return func(*args, **kwargs)


def refuse_users_modes() -> None:
    """Refuse a capture under a torch function or dispatch mode of the user's: the trace
    records the operations as the mode left them, and at a call (which must have the same
    modes active) the mode would act on the graph's operations again."""
    theirs = [type(m) for m in (*function_modes(), *dispatch_modes()) if not torch_own(type(m))]
    if theirs:
        names = ", ".join(qualified_name(kind) for kind in theirs)
        raise PrecompileError(
            f"precompile was called with a torch function or dispatch mode of yours active "
            f"({names}). The trace records the operations as the mode made them, and at each "
            "call, which would need the mode active too, it would act on them a second time. "
            "Enter the mode inside fn (the artifact then does what it did, and calls run "
            "without it), or call precompile outside it."
        )


def ambient_at_capture(
    default_dtype_used: bool, settings: tuple[tuple[str, Any, str], ...]
) -> Ambient:
    """The state now, before the trace pushes modes of its own, and the settings fn read."""
    autocast, default_dtype, deterministic, modes = ambient_now()
    return Ambient(
        autocast=autocast,
        default_dtype=(str(default_dtype).removeprefix("torch.") if default_dtype_used else None),
        deterministic=deterministic,
        modes=modes,
        settings=settings,
    )
