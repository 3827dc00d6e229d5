"""Traceable tensor subclasses in a capture (torchao's quantized weights, any class with
``__tensor_flatten__``): the graph runs on their inner tensors.

A subclass parameter, buffer or input becomes its inner tensors at the graph's boundary: the
first takes its flat position, the others follow every flat input. Inside the trace it is
rebuilt with ``__tensor_unflatten__`` around those inputs, so its ``__torch_dispatch__``
records plain ATen operations on them. A subclass result leaf leaves the graph the same way
and the driver rebuilds it. The spec records the class by name, the flatten context encoded
as source (refused when it cannot be) and each inner tensor's shape, dtype, device and
layout; DTensors keep their own, richer path (``capture.distributed``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from torch_precompile.errors import PrecompileError
from torch_precompile.internals.distributed import is_dtensor
from torch_precompile.internals.tracing import FakeTensor, is_traceable_wrapper_subclass
from torch_precompile.shipped.driver.subclasses import decode_context
from torch_precompile.shipped.driver.tensor_rules import qualified_name
from torch_precompile.spec import EncodedValue, InnerTensor, WrappedTensor
from torch_precompile.trace.values import Use, encode, unencodable_part

PLAIN = (torch.Tensor, torch.nn.Parameter)


@dataclass(frozen=True)
class Flattened:
    """One subclass tensor taken apart: its class, flatten, and inner tensors."""

    cls: type
    attrs: tuple[str, ...]
    context: Any
    shape: torch.Size
    strides: tuple[int, ...]
    inner: tuple[torch.Tensor, ...]

    def rebuild(self, inner: Sequence[torch.Tensor]) -> Any:
        # A traceable wrapper subclass: flatten checked that it has __tensor_unflatten__.
        return cast(Any, self.cls).__tensor_unflatten__(
            dict(zip(self.attrs, inner, strict=True)), self.context, self.shape, self.strides
        )


@dataclass
class Wrapping:
    """The subclass flat inputs of one capture, and the records of subclass results (filled
    while tracing)."""

    inputs: dict[int, Flattened]
    records: list[WrappedTensor]
    inner: list[InnerTensor]
    results: list[tuple[WrappedTensor, list[InnerTensor]]] = field(default_factory=list)

    def expand(
        self,
        flat: Sequence[torch.Tensor],
        copy: Callable[[torch.Tensor], torch.Tensor] | None = None,
        copy_from: int = 0,
    ) -> list[torch.Tensor]:
        """Graph inputs from flat inputs: each subclass's first inner tensor in its place,
        the others after the flat inputs; those of flat inputs from ``copy_from`` on copied."""
        extras: list[torch.Tensor]
        graph, extras = list(flat), []
        for index, flattened in self.inputs.items():
            inner = [getattr(flat[index], attr) for attr in flattened.attrs]
            if copy is not None and index >= copy_from:
                inner = [copy(t) for t in inner]
            graph[index] = inner[0]
            extras.extend(inner[1:])
        return [*graph, *extras]

    def graph_names(self, names: Sequence[str]) -> list[str]:
        """Names of the graph inputs, from those of the flat inputs."""
        extras: list[str]
        graph, extras = list(names), []
        for index, flattened in self.inputs.items():
            graph[index] = f"{names[index]}_{flattened.attrs[0]}"
            extras.extend(f"{names[index]}_{attr}" for attr in flattened.attrs[1:])
        return [*graph, *extras]

    def rebuild(self, graph: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Inside the trace: the flat inputs, subclasses rebuilt around their inner tensors."""
        num_flat = len(graph) - sum(len(f.attrs) - 1 for f in self.inputs.values())
        flat, rest = list(graph[:num_flat]), iter(graph[num_flat:])
        for index, flattened in self.inputs.items():
            inner = [graph[index], *(next(rest) for _ in flattened.attrs[1:])]
            flat[index] = flattened.rebuild(inner)
        return flat

    def flat_results(self, leaves: Sequence[Any]) -> tuple[list[Any], list[torch.Tensor]]:
        """Result leaves with subclasses replaced by their first inner tensor, each recorded,
        and their other inner tensors (which go after every other output)."""
        self.results.clear()
        extras: list[torch.Tensor]
        unwrapped, extras = list(leaves), []
        for index, leaf in enumerate(leaves):
            # (A symbolic trace's results are fake tensors: plain ones, for this purpose.)
            if not is_traceable_wrapper_subclass(leaf) or is_dtensor(leaf):
                continue
            name = f"result leaf {index}"
            flattened = flatten(cast(torch.Tensor, leaf), name)  # the check saw a Tensor
            wrapper = len(self.records) + len(self.results)
            self.results.append(
                (_record(flattened, "result", index, name), _inner_records(flattened, wrapper))
            )
            unwrapped[index] = flattened.inner[0]
            extras.extend(flattened.inner[1:])
        return unwrapped, extras

    def spec_records(self) -> dict[str, Any]:
        return {
            "wrapped": (*self.records, *(r for r, _ in self.results)),
            "wrapped_inner": (*self.inner, *(t for _, inner in self.results for t in inner)),
        }


def find_wrapped(
    tensors: Sequence[torch.Tensor], names: Sequence[str], fakes_are_plain: bool = False
) -> Wrapping:
    """The capture's subclass flat inputs other than DTensors (none, mostly); in a build
    without the weights, fake tensors stand for plain ones."""
    inputs: dict[int, Flattened] = {}
    records: list[WrappedTensor] = []
    inner: list[InnerTensor] = []
    for index, (tensor, name) in enumerate(zip(tensors, names, strict=True)):
        if type(tensor) in PLAIN or is_dtensor(tensor):
            continue
        if fakes_are_plain and isinstance(tensor, FakeTensor):
            continue
        flattened = flatten(tensor, name)
        if tensor.requires_grad:
            raise PrecompileError(
                f"{name} is a {qualified_name(type(tensor))} with requires_grad=True; precompile "
                "carries tensor subclasses other than DTensor without gradients. Freeze it "
                "(requires_grad_(False), as quantize_ leaves quantized weights) and train the "
                "plain parameters around it."
            )
        inner.extend(_inner_records(flattened, len(records)))
        records.append(_record(flattened, "input", index, name))
        inputs[index] = flattened
    return Wrapping(inputs, records, inner)


def flatten(tensor: torch.Tensor, name: str) -> Flattened:
    """Take a subclass tensor apart, refusing what the artifact could not rebuild."""
    if not is_traceable_wrapper_subclass(tensor):
        raise PrecompileError(
            f"{name} is a {qualified_name(type(tensor))}, a tensor subclass without "
            "__tensor_flatten__ / __tensor_unflatten__, so precompile cannot take it apart into "
            "plain tensors for the compiled graph. Convert it to a plain tensor, or make the "
            "class a traceable wrapper subclass."
        )
    attrs, context = tensor.__tensor_flatten__()
    inner = tuple(getattr(tensor, attr) for attr in attrs)
    odd = [a for a, t in zip(attrs, inner, strict=True) if type(t) not in PLAIN]
    if odd or not attrs:
        raise PrecompileError(
            f"{name} is a {qualified_name(type(tensor))} whose inner tensor {odd[0]!r} is itself a "
            f"{qualified_name(type(inner[attrs.index(odd[0])]))}; nested tensor subclasses are not "
            "carried. Keep one level of subclass around plain tensors."
            if odd
            else f"{name} is a {qualified_name(type(tensor))} with no inner tensors to carry."
        )
    return Flattened(
        type(tensor), tuple(attrs), context, tensor.shape, tuple(tensor.stride()), inner
    )


def refuse_mixed(wrapping: Wrapping, sharded: bool) -> None:
    if wrapping.records and sharded:
        name = wrapping.records[0].name
        raise PrecompileError(
            f"{name} is a {wrapping.records[0].cls} and other tensors are DTensors; an "
            "artifact carries either DTensors or other tensor subclasses, not both yet."
        )


def _record(flattened: Flattened, role: str, index: int, name: str) -> WrappedTensor:
    cls = qualified_name(flattened.cls)
    context = encode_context(flattened.context, name)
    try:
        rebuilt = decode_context(context) == flattened.context
    except Exception:  # a class that cannot be rebuilt from its fields, say
        rebuilt = False
    if not rebuilt:
        raise PrecompileError(
            f"{name} is a {cls} whose flatten context does not come back equal when rebuilt "
            "from source, so the artifact could not check it at a call. Precompile carries "
            "subclasses whose flatten context holds plain values, dtypes, enums and "
            "dataclasses that compare by value."
        )
    return WrappedTensor(role, index, name, cls, context, tuple(flattened.shape), flattened.strides)


def _inner_records(flattened: Flattened, wrapper: int) -> list[InnerTensor]:
    return [
        InnerTensor(wrapper, attr, tuple(t.shape), str(t.dtype), str(t.device))
        for attr, t in zip(flattened.attrs, flattened.inner, strict=True)
    ]


def encode_context(value: Any, name: str) -> EncodedValue:
    """A flatten context as the spec holds it, to be built again by the artifact."""
    encoded = encode(value, Use.CONTEXT)
    if encoded is not None:
        return encoded
    culprit = type(unencodable_part(value, Use.CONTEXT))
    raise PrecompileError(
        f"{name} is a tensor subclass whose flatten context holds a {qualified_name(culprit)}, "
        "which the artifact cannot write as source (it writes numbers, strings, None, dtypes, "
        "devices, sizes, enum members, dataclasses, and lists, tuples and dicts of those)."
    )
