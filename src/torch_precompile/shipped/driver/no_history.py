"""The driver part for a call where a tensor requires grad, when fn runs no backward.

Shipped wherever fn runs no backward; on its own where results never carry history. A tensor
that did not require grad at capture is refused: the artifact computes no gradient for it.
Where the artifact could not give its results history (built under ``no_grad``, say), the call
runs without it and warns once, saying why. ``autograd`` builds on this for results with
history.
"""

import sys
import warnings
from collections.abc import Sequence

import torch

from torch_precompile.shipped.driver.core import Driver
from torch_precompile.shipped.driver.refusals import PrecompileError


class NoHistory:
    """``autograd`` of a driver whose results never carry history."""

    def __init__(self, driver: "Driver") -> None:
        record = driver.autograd_record
        self.driver = driver
        self.inputs = frozenset(record.inputs)
        self.unavailable = record.unavailable
        self.warned = False

    def wanted(self, flat: Sequence[torch.Tensor]) -> bool:
        """Whether this call (under grad mode) must give its results history: never."""
        self.may_have_history(flat)
        return False

    def may_have_history(self, flat: Sequence[torch.Tensor]) -> bool:
        """Whether tensors of this call require grad and the artifact can give its results
        history; a tensor it computes no gradient for is refused."""
        requiring = [i for i, t in enumerate(flat) if t.requires_grad]
        if not requiring:
            return False
        if self.unavailable is not None:
            if not self.warned:
                self.warned = True
                warnings.warn(
                    f"this precompiled artifact's {self.unavailable}; call it under "
                    "torch.no_grad(), or keep the backward inside fn.",
                    stacklevel=_caller_level(),
                )
            return False
        other = [i for i in requiring if i not in self.inputs]
        if other:
            raise PrecompileError(
                f"{self.driver.flat_name(other[0])} requires grad at this call but did not at "
                "capture, so the artifact computes no gradient for it. Precompile with it "
                "requiring grad, or call under torch.no_grad() if no backward will follow."
            )
        return True


def _caller_level() -> int:
    """The stack level of the caller's code: the first frame outside the artifact and this
    package (as ``warnings.warn`` counts from the function that calls it)."""
    frame, level = sys._getframe(2), 2
    while frame.f_back is not None and (
        frame.f_globals is globals()
        or str(frame.f_globals.get("__name__", "")).startswith("torch_precompile")
    ):
        frame, level = frame.f_back, level + 1
    return level
