"""The driver part for plain tensors the graph reads beside the models and inputs: an
optimizer's state, a tensor subclass's inner tensors. Each is planned from its spec record
and checked against it."""

from collections.abc import Sequence

import torch

from torch_precompile.shipped.driver.tensor_rules import PrecompileError, check_layout


class TensorPlan:
    """A plain tensor the graph reads: its shape, dtype, device, and the layout the kernels
    assume (None: any)."""

    def __init__(
        self,
        shape: Sequence[int],
        dtype: str,
        device: str,
        strides: Sequence[int] | None = None,
    ) -> None:
        self.shape = torch.Size(shape)
        self.dtype = getattr(torch, dtype.removeprefix("torch."))
        self.device = torch.device(device)
        self.strides = strides


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
