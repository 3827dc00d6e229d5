"""The driver part for calls that are more than positional tensors: nested inputs (their
structure checked), objects that hold tensors (a KV cache: opened like a model, its tensors
inputs and its other attributes values), Python values (baked, so each call must pass the
captured one), and the value guards (decisions the trace took on tensor values, re-checked
after the graph ran)."""

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
    qualified_name,
    sketch,
    structure_error,
)

# The key under which an opened object's class is kept, beside its attributes.
CLASS_KEY = "__class__"
# How deep opening looks for tensors: the call's arguments, a dict of them, a cache, its list
# of layers, a layer, its tensors, and two levels to spare.
_HOLDER_DEPTH = 8


# Values that are never opened, answered without a look inside.
_LEAVES = frozenset((bool, int, float, str, bytes, type(None), torch.device, torch.dtype))


def _openable(value: Any) -> bool:
    """An object of a user or library class, not a container, module, optimizer or tensor."""
    return (
        type(value) not in (list, tuple, dict)
        and not isinstance(value, torch.Tensor | torch.nn.Module | torch.optim.Optimizer | type)
        and isinstance(getattr(value, "__dict__", None), dict)
        and not callable(value)
    )


def _open(tree: Any, depth: int) -> tuple[Any, bool]:
    """``tree`` opened (see ``opened``), and whether it holds a tensor; in one pass."""
    kind = type(tree)
    if kind in _LEAVES:
        return tree, False
    if isinstance(tree, torch.Tensor):
        return tree, True
    if depth == 0:
        return tree, False
    if kind in (list, tuple):
        parts = [_open(v, depth - 1) for v in tree]
        return kind(p for p, _ in parts), any(found for _, found in parts)
    if kind is dict:
        items = [(k, _open(v, depth - 1)) for k, v in tree.items()]
        return {k: p for k, (p, _) in items}, any(found for _, (_, found) in items)
    if _openable(tree):
        attributes = [(k, _open(v, depth - 1)) for k, v in sorted(vars(tree).items())]
        if any(found for _, (_, found) in attributes):
            return {CLASS_KEY: qualified_name(kind), **{k: p for k, (p, _) in attributes}}, True
    return tree, False


def holds_tensors(value: Any) -> bool:
    """Whether ``value`` is an object (not a container, module, optimizer or tensor) whose
    attributes hold a tensor, directly or a few levels down: one that is opened."""
    return _openable(value) and _open(value, _HOLDER_DEPTH)[1]


def opened(tree: Any) -> Any:
    """``tree`` with each object that holds tensors replaced by a dict of its attributes (in
    name order) and its class under ``CLASS_KEY``: its tensors become leaves as a model's
    buffers do, and everything else about it a value each call must match."""
    return _open(tree, _HOLDER_DEPTH)[0]


def first_difference(expected: Any, given: Any, name: str) -> str | None:
    """Where two opened structures first differ, said in the caller's terms; None when only
    leaves differ."""
    if type(expected) is dict and CLASS_KEY in expected:
        # The expected class is shown as the driver shows a value: quoted.
        was = str(expected[CLASS_KEY]).strip("'")
        now = given.get(CLASS_KEY) if type(given) is dict else qualified_name(type(given))
        if now != was:
            return f"{name} is a {now}; at capture it was a {was}"
        missing = [k for k in expected if k not in given]
        if missing:
            return f"{name} has no attribute {missing[0]!r}, which it had at capture"
        extra = [k for k in given if k not in expected]
        if extra:
            return f"{name} has an attribute {extra[0]!r} it did not have at capture"
        pairs = [(expected[k], given[k], f"{name}.{k}") for k in expected if k != CLASS_KEY]
    elif type(expected) in (list, tuple, dict):
        if type(given) is not type(expected):
            return f"{name} is {sketch(given)}; at capture it was {sketch(expected)}"
        if type(expected) is dict and list(expected) != list(given):
            return f"{name} has the keys {list(given)}; at capture {list(expected)}"
        if len(given) != len(expected):
            return f"{name} holds {len(given)} items; at capture it held {len(expected)}"
        if type(expected) is dict:
            pairs = [(expected[k], given[k], f"{name}[{k!r}]") for k in expected]
        else:
            both = enumerate(zip(expected, given, strict=True))
            pairs = [(e, g, f"{name}[{i}]") for i, (e, g) in both]
    else:
        return None
    for e, g, inner in pairs:
        found = first_difference(e, g, inner)
        if found is not None:
            return found
    return None


class InputValues:
    """The captured input structure, Python values and value guards of a driver."""

    def __init__(self, driver: Driver) -> None:
        spec = driver.spec
        self.positions = driver.input_positions
        self.leaves = driver.leaves
        self.in_spec = None if spec.in_spec is None else pytree.treespec_loads(spec.in_spec)
        self.guards = driver.value_guards
        self.names = [spec.args[i].name for i in self.positions]
        # Whether the capture opened an object (a structure it could not write down may
        # hold one too): a call of any other artifact is not looked into.
        self.opens = spec.in_spec is None or CLASS_KEY in spec.in_spec

    def input_leaves(self, args: Sequence[Any]) -> Sequence[Any]:
        """The leaves of the runtime inputs, after checking their structure."""
        user_args = tuple([args[i] for i in self.positions])
        user_args = opened(user_args) if self.opens else user_args
        leaves, structure = pytree.tree_flatten(user_args)
        if self.in_spec is not None and structure != self.in_spec:
            expected = pytree.tree_unflatten([_shown_leaf(p) for p in self.leaves], self.in_spec)
            # Where objects were opened, name the part that differs; else show it all.
            shown = self.opens
            for name, e, g in zip(self.names, expected, user_args, strict=False):
                found = first_difference(e, g, f"input {name}") if shown else None
                if found is not None:
                    raise PrecompileError(
                        f"{found}. The artifact takes inputs shaped as at capture: pass an "
                        "object built the same way, or precompile again for this one."
                    )
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
