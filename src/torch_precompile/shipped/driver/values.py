"""The driver part for calls that are more than positional tensors: nested inputs (their
structure checked), Python values (baked, so each call must pass the captured one), and the
value guards (decisions the trace took on tensor values, re-checked after the graph ran)."""

from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from torch_precompile.shipped.driver.core import Driver
from torch_precompile.shipped.driver.encoded import shown_value, value_matches
from torch_precompile.shipped.driver.tensor_rules import (
    LeafPlan,
    PrecompileError,
    Shown,
    sketch,
    structure_error,
)


class InputValues:
    """The captured input structure, Python values and value guards of a driver."""

    def __init__(self, driver: Driver) -> None:
        spec = driver.spec
        self.positions = driver.input_positions
        self.leaves = driver.leaves
        self.in_spec = None if spec.in_spec is None else pytree.treespec_loads(spec.in_spec)
        self.guards = driver.value_guards

    def input_leaves(self, args: Sequence[Any]) -> Sequence[Any]:
        """The leaves of the runtime inputs, after checking their structure."""
        user_args = tuple([args[i] for i in self.positions])
        leaves, structure = pytree.tree_flatten(user_args)
        if self.in_spec is not None and structure != self.in_spec:
            expected = pytree.tree_unflatten([_shown_leaf(p) for p in self.leaves], self.in_spec)
            raise structure_error(expected, user_args)
        if len(leaves) != len(self.leaves):
            raise PrecompileError(
                f"the runtime inputs hold {len(leaves)} leaves; the captured ones held "
                f"{len(self.leaves)}. Pass the same inputs as at capture."
            )
        return leaves

    def check_value(self, plan: LeafPlan, value: Any) -> None:
        if not value_matches(plan.value, value):
            raise PrecompileError(
                f"input {plan.name}: expected the value {shown_value(plan.value)}, got "
                f"{sketch(value)}. "
                "Python values are baked into the graph at capture; precompile again for "
                "another value, or pass it as a tensor."
            )

    def check_guards(
        self, tensors: Sequence[torch.Tensor], kept: Sequence[tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        """Compare the values the trace decided on; where one differs, put back what the
        graph wrote (``kept``: each written tensor and its value before) and refuse."""
        for (description, expected), tensor in zip(self.guards, tensors, strict=True):
            value = tensor.item()
            if not value_matches(expected, value):
                for written, before in kept:
                    written.copy_(before)
                undone = (
                    ", and what the graph wrote to inputs and buffers is put back" if (kept) else ""
                )
                raise PrecompileError(
                    f"this call left the path the artifact was captured on: {description} was "
                    f"{shown_value(expected)} at capture and is {value!r} now, so the result "
                    f"would be wrong: it is withheld{undone}. Capture with an example that "
                    "takes this path, or keep fn from deciding on tensor values (a number fn "
                    "returns, such as loss.item(), is one: return the tensor, loss.detach(), "
                    "and call .item() on the result)."
                )


def _shown_leaf(plan: LeafPlan) -> Shown:
    return Shown(f"Tensor{plan.shown}" if plan.is_tensor else shown_value(plan.value))
