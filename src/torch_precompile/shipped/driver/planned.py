"""The driver part for plain tensors the graph reads beside the models and inputs: an
optimizer's state, a tensor subclass's inner tensors. Each is planned from its spec record
and checked against it."""

from typing import Any

import torch

from torch_precompile.shipped.driver.refusals import PrecompileError, check_layout


class TensorPlan:
    """A plain tensor the graph reads: its shape, dtype, device, and the layout the kernels
    assume (None: any)."""

    def __init__(self, record: Any) -> None:
        self.shape = torch.Size(record.shape)
        self.dtype = getattr(torch, record.dtype.removeprefix("torch."))
        self.device = torch.device(record.device)
        self.strides = record.strides


def check_planned(tensor: torch.Tensor, plan: TensorPlan, what: str, fix: str) -> None:
    """``tensor`` must be as planned; ``fix`` ends the message, saying what to do."""
    if tensor.shape != plan.shape or tensor.dtype != plan.dtype or tensor.device != plan.device:
        raise PrecompileError(
            f"{what}: expected shape {tuple(plan.shape)}, dtype {plan.dtype}, device "
            f"{plan.device}; got shape {tuple(tensor.shape)}, dtype {tensor.dtype}, device "
            f"{tensor.device}. {fix}"
        )
    if plan.strides is not None:
        check_layout(tensor, plan.strides, what)
