"""The driver part for calls that are more than positional tensors: nested inputs (their
structure checked), Python values (baked, so each call must pass the captured one), and the
value guards (decisions the trace took on tensor values, re-checked after the graph ran)."""

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from torch_precompile.driver.core import (
    Driver,
    LeafPlan,
    PrecompileError,
    Shown,
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
        if not _value_matches(plan.value, value):
            raise PrecompileError(
                f"input {plan.name}: expected the value {_shown(plan.value)}, got {value!r}. "
                "Python values are baked into the graph at capture; precompile again for "
                "another value, or pass it as a tensor."
            )

    def check_guards(self, tensors: Sequence[torch.Tensor]) -> None:
        for (description, expected), tensor in zip(self.guards, tensors, strict=True):
            value = tensor.item()
            if not _value_matches(expected, value):
                raise PrecompileError(
                    f"this call left the path the artifact was captured on: {description} was "
                    f"{_shown(expected)} at capture and is {value!r} now, so the result would "
                    "be wrong and is withheld (mutations of inputs and buffers may already "
                    "have happened). Capture with an example that takes this path, or keep fn "
                    "from deciding on tensor values."
                )


def _value_matches(encoded: Any, value: Any) -> bool:
    kind, expected = encoded
    if kind == "float":
        return type(value) is float and (
            math.isnan(value) if expected == "nan" else value == float(expected)
        )
    if kind == "dtype":
        return isinstance(value, torch.dtype) and value == getattr(torch, expected)
    if kind == "device":
        return isinstance(value, torch.device) and value == torch.device(expected)
    if kind == "enum":
        return _qualified(value) == expected[0] and getattr(value, "name", None) == expected[1]
    if kind == "frozen":
        return _qualified(value) == expected[0] and all(
            hasattr(value, field) and _value_matches(item, getattr(value, field))
            for field, item in expected[1])
    return type(value) is type(expected) and value == expected


def _qualified(value: Any) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}"


def _shown(encoded: Any) -> str:
    kind, expected = encoded
    if kind == "float":
        return repr(float(expected))
    if kind == "dtype":
        return f"torch.{expected}"
    if kind == "device":
        return f"device({expected!r})"
    if kind == "enum":
        return f"{expected[0]}.{expected[1]}"
    if kind == "frozen":
        fields = ", ".join(f"{field}={_shown(item)}" for field, item in expected[1])
        return f"{expected[0]}({fields})"
    return repr(expected)


def _shown_leaf(plan: LeafPlan) -> Shown:
    return Shown(f"Tensor{plan.shown}" if plan.is_tensor else _shown(plan.value))
