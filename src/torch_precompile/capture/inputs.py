"""Runtime inputs: the non-module arguments of ``fn``, flattened to named, described leaves."""

from __future__ import annotations

import inspect
import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from torch_precompile.errors import PrecompileError
from torch_precompile.internals import pytree
from torch_precompile.spec import EncodedValue

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


@dataclass(frozen=True)
class UserInputs:
    """Leaves of the runtime inputs, in pytree order, with what the driver checks of each."""

    leaves: list[Any]
    names: list[str]
    spec: pytree.TreeSpec
    values: list[EncodedValue | None]

    @property
    def tensor_positions(self) -> list[int]:
        return [i for i, leaf in enumerate(self.leaves) if isinstance(leaf, torch.Tensor)]


def flatten_user_inputs(args: tuple[Any, ...], arg_names: list[str]) -> UserInputs:
    """Flatten the runtime inputs ``args`` (already without the module arguments)."""
    with_paths, spec = pytree.tree_flatten_with_path(args)
    leaves: list[Any] = []
    names: list[str] = []
    values: list[EncodedValue | None] = []
    for path, leaf in with_paths:
        head, *rest = path
        name = arg_names[head.idx] + pytree.keystr(tuple(rest))
        leaves.append(leaf)
        names.append(name)
        values.append(None if isinstance(leaf, torch.Tensor) else encode_value(name, leaf))
    return UserInputs(leaves, names, spec, values)


def encode_value(name: str, value: Any) -> EncodedValue:
    """Encode a Python leaf so the driver can insist on the same value at every call."""
    if isinstance(value, float) and not math.isfinite(value):
        return ("float", repr(value))
    if type(value) in (bool, int, float, complex, str, bytes):
        return ("const", value)
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    text = repr(value)
    if _ADDRESS.search(text):
        raise PrecompileError(
            f"input {name} is a {kind} object whose value cannot be recorded (its repr names a "
            "memory address). Python values are baked into the graph and checked at every "
            "call; pass tensors, numbers, strings, or objects with a value-based repr."
        )
    return ("repr", (kind, text))


def arg_names_of(fn: Any, count: int) -> list[str]:
    """Names of ``fn``'s first ``count`` positional parameters, for error messages."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    names: list[str] = []
    for i in range(count):
        if i < len(params) and params[i].kind in (
            inspect.Parameter.POSITIONAL_ONLY,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
        ):
            names.append(params[i].name)
        else:
            names.append(f"args[{i}]")
    return names
