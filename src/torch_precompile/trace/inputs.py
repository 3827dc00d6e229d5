"""Runtime inputs: the non-module arguments of ``fn``, flattened to named, described leaves."""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any, cast

import torch

from torch_precompile.errors import PrecompileError
from torch_precompile.internals import pytree
from torch_precompile.shipped.driver.tensor_rules import qualified_name
from torch_precompile.shipped.driver.values import CLASS_KEY, opened
from torch_precompile.spec import EncodedValue
from torch_precompile.trace.values import Use, encode


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
    """Flatten the runtime inputs ``args`` (already without the module arguments); objects
    that hold tensors are opened first, as the driver opens them."""
    with_paths, spec = pytree.tree_flatten_with_path(opened(args))
    leaves: list[Any] = []
    names: list[str] = []
    values: list[EncodedValue | None] = []
    for path, leaf in with_paths:
        head, *rest = path
        # The top level is the args tuple: its keys are sequence indices.
        index = cast("pytree.SequenceKey[Any]", head).idx
        name = arg_names[index] + _path_text(args[index], rest)
        leaves.append(leaf)
        names.append(name)
        values.append(None if isinstance(leaf, torch.Tensor) else encode_value(name, leaf))
    return UserInputs(leaves, names, spec, values)


def _path_text(arg: Any, path: list[Any]) -> str:
    """``path`` into ``arg`` as Python spells it: ``cache.layers[0].keys``."""
    text, node = "", opened(arg)
    for key in path:
        if type(node) is dict and CLASS_KEY in node:
            text += f".{key.key}"
        else:
            text += pytree.keystr((key,))
        # Follow the opened structure (lists, tuples, dicts); past any other node, plain text.
        if isinstance(key, pytree.SequenceKey) and type(node) in (list, tuple):
            node = node[key.idx]
        elif isinstance(key, pytree.MappingKey) and type(node) is dict:
            node = node[key.key]
        else:
            node = None
    return text


def refuse_unplain_tensors(tensors: list[torch.Tensor], names: list[str]) -> None:
    """Refuse, before tracing, tensors a graph cannot take as inputs: quantized, nested,
    sparse and other non-strided ones."""
    for tensor, name in zip(tensors, names, strict=True):
        if tensor.is_quantized:
            why, fix = f"a quantized tensor ({tensor.qscheme()})", "x.dequantize()"
        elif tensor.is_nested:
            why, fix = "a nested tensor", "padded (x.to_padded_tensor(0.0)) with a mask"
        elif tensor.layout is not torch.strided:
            why, fix = f"a {tensor.layout} tensor", "dense (x.to_dense())"
        else:
            continue
        raise PrecompileError(
            f"{name} is {why}; a precompiled graph takes plain dense tensors. Pass it as {fix}, "
            "and do the conversion back inside fn if fn needs it."
        )


def encode_value(name: str, value: Any) -> EncodedValue:
    """Encode an immutable Python leaf so the driver can insist on an equal value at every call.

    None, numbers, strings, bytes, dtypes, devices, enum members and frozen dataclasses of
    such are compared by equality; anything else could change after capture without the
    artifact knowing, so it is refused.
    """
    encoded = encode(value, Use.INPUT)
    if encoded is not None:
        return encoded
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):  # name the field to blame (``cfg.generator``)
            encode_value(f"{name}.{f.name}", getattr(value, f.name))
    if isinstance(value, torch.Generator):
        raise PrecompileError(
            f"input {name} is a torch.Generator; the artifact cannot carry its state from "
            "call to call. Draw from the default generator (seed it with torch.manual_seed) "
            "or pass the noise in as an input tensor."
        )
    if isinstance(value, torch.optim.lr_scheduler.LRScheduler):
        raise PrecompileError(
            f"input {name} is a learning-rate scheduler ({qualified_name(type(value))}). Step it "
            "outside fn, after each call: the artifact reads each param group's lr at every "
            "call, so the schedule takes effect as in eager."
        )
    if isinstance(value, torch.amp.GradScaler):
        raise PrecompileError(
            f"input {name} is a GradScaler: its scale and the skipping of steps with "
            "non-finite gradients are Python decisions a trace cannot carry. Train in bfloat16 "
            "under autocast (no scaler needed), or precompile the model alone "
            "(precompile.module(model, *inputs)) and keep the scaler, backward and step in "
            "your loop."
        )
    if isinstance(value, torch.optim.Optimizer):
        raise PrecompileError(
            f"input {name} is an optimizer nested inside another argument. Pass each "
            "optimizer as its own positional argument of fn, as models are passed, so that "
            "its state and learning rate are read at every call."
        )
    if qualified_name(type(value)).startswith("transformers.cache_utils."):
        raise PrecompileError(
            f"input {name} is a {qualified_name(type(value))} that holds no tensors yet: its "
            "layers create them on first use, and a DynamicCache makes new ones at every "
            "step, neither of which an artifact replays. Pass a StaticCache created before "
            "the call with cache.early_initialization(batch_size, num_heads, head_dim, dtype, "
            "device); for generate(), precompile.for_generate(model, path) does so."
        )
    raise PrecompileError(
        f"input {name} is a {qualified_name(type(value))}, which is neither a tensor nor an "
        "immutable value. Python values are baked into the graph and compared at every call, so a "
        "mutable object would act at every call as it was at capture. Pass tensors, numbers, "
        "strings, dtypes, devices, enum members, or frozen dataclasses and named tuples of "
        "those; pass models as nn.Module arguments and optimizers as torch.optim.Optimizer "
        "arguments."
    )


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
