"""The driver part for a call where a tensor requires grad, when fn runs no backward.

Shipped wherever fn runs no backward; on its own where results never carry history. An
artifact may hold two differentiable forms (the spec's ``autograd`` and
``autograd_for_inputs``): the first gives gradients for the flat inputs that required grad at
capture, the second also for the floating-point input tensors that did not. A call runs the
first form that covers every tensor requiring grad now; a tensor neither covers is refused.
Where the artifact could not give its results history (built under ``no_grad``, say), the
call runs without it and warns once, saying why. ``autograd`` builds on this for results with
history.
"""

import sys
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from torch_precompile.shipped.driver.core import Driver
from torch_precompile.shipped.driver.tensor_rules import PrecompileError


class NoHistory:
    """``autograd`` of a driver whose results never carry history."""

    def __init__(self, driver: "Driver") -> None:
        records = [r for r in driver.autograd_records if r is not None]
        self.driver = driver
        self.covered = [frozenset(r.inputs) for r in records]
        self.unavailable = records[0].unavailable
        # Why the form for inputs that require grad at a call is missing, if it is.
        self.no_form_for_inputs = records[1].unavailable if len(records) > 1 else None
        self.warned = False

    def wanted(self, flat: Sequence[torch.Tensor]) -> Any:
        """The form that gives this call's results history (under grad mode): none here."""
        self.form_for(flat)
        return None

    def form_for(self, flat: Sequence[torch.Tensor]) -> int | None:
        """Which form serves this call (0: the capture's, 1: with input gradients), or None
        where nothing requires grad or the artifact cannot give history; a tensor that
        requires grad and that no form computes a gradient for is refused."""
        requiring = {i for i, t in enumerate(flat) if t.requires_grad}
        if not requiring:
            return None
        if self.unavailable is not None:
            if not self.warned:
                self.warned = True
                warnings.warn(
                    f"this precompiled artifact's {self.unavailable}; call it under "
                    "torch.no_grad(), or keep the backward inside fn.",
                    stacklevel=_caller_level(),
                )
            return None
        for form, inputs in enumerate(self.covered):
            if requiring <= inputs:
                return form
        index = min(requiring - self.covered[-1])
        raise PrecompileError(self._not_covered(index))

    def _not_covered(self, index: int) -> str:
        name = self.driver.flat_name(index)
        said = f"{name} requires grad at this call but did not at capture"
        if not name.startswith("input "):
            return (
                f"{said}, so the artifact computes no gradient for it (which parameters get "
                "gradients is fixed at capture). Precompile with it requiring grad, or call "
                "under torch.no_grad() if no backward will follow."
            )
        if self.no_form_for_inputs is not None:
            return (
                f"{said}, and the artifact computes no gradient for it: its "
                f"{self.no_form_for_inputs}. Precompile with it requiring grad, or call under "
                "torch.no_grad() if no backward will follow."
            )
        return (
            f"{said}, and fn writes it in place, so the artifact computes no gradient for it. "
            "Precompile with it requiring grad, or pass a copy that does not require grad."
        )


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
