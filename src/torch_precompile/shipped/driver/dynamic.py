"""The driver part for artifacts with dynamic dims: sizes within bounds, shared sizes equal,
the trace's size relations true, and the memory format the kernels assume."""

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from torch_precompile.shipped.driver.tensor_rules import LeafPlan, PrecompileError

_MEMORY_FORMATS = {
    "contiguous": torch.contiguous_format,
    "channels_last": torch.channels_last,
    "channels_last_3d": torch.channels_last_3d,
}


class DynamicSizes:
    """The spec's dynamic dims and size relations, checked at every call."""

    def __init__(self, spec: Any) -> None:
        self.dims = [(d.shape_id, d.places) for d in spec.dynamic_dims]
        self.relations = [(r.expr, r.readable) for r in spec.size_relations]

    def check_shape(self, plan: LeafPlan, leaf: torch.Tensor) -> None:
        """Static dims as captured; each dynamic dim within its declared bounds."""
        if leaf.dim() != len(plan.shape) or any(
            s is not None and s != got for s, got in zip(plan.shape, leaf.shape, strict=True)
        ):
            raise PrecompileError(
                f"input {plan.name}: expected shape {plan.shown} (* is dynamic), got "
                f"{tuple(leaf.shape)}."
            )
        for dim, (low, high) in plan.bounds.items():
            size = leaf.shape[dim]
            if (low is not None and size < low) or (high is not None and size > high):
                raise PrecompileError(
                    f"input {plan.name}: dim {dim} is {size}, outside the declared range "
                    f"[{low if low is not None else 0}, {high if high is not None else 'inf'}]."
                )

    def check_memory_format(
        self, tensor: torch.Tensor, plan: LeafPlan, where: str, backend: str
    ) -> torch.Tensor:
        """``tensor`` in the memory format the graph assumes (``plan.strides`` names it): as
        it is, or copied into it where the eager graph may take a copy (``plan.relayout``)."""
        name = plan.strides
        memory_format = _MEMORY_FORMATS[name]
        if tensor.is_contiguous(memory_format=memory_format):
            return tensor
        if plan.relayout:  # the eager graph neither writes it nor returns a view of it
            return tensor.contiguous(memory_format=memory_format)
        if backend == "eager":
            raise PrecompileError(
                f"{where}: the graph writes this input or returns a view of it, and its views "
                f"were traced on the {name} memory format (the example's); got strides "
                f"{tuple(tensor.stride())}. Pass it in that format "
                "(.contiguous(memory_format=...))."
            )
        raise PrecompileError(
            f"{where}: the compiled kernels assume the {name} memory format (the "
            f"example's), got strides {tuple(tensor.stride())}. Pass it in that format "
            "(.contiguous(memory_format=...)), or precompile with backend='eager'."
        )

    def check_shared(self, plans: Sequence[LeafPlan], leaves: Sequence[Any]) -> None:
        """Dims sharing a size must agree, and the trace's size relations must hold."""

        def where(place: Sequence[int]) -> str:
            return f"input {plans[place[0]].name} dim {place[1]}"

        sizes = []
        for shape_id, places in self.dims:
            first = places[0]
            size = leaves[first[0]].shape[first[1]]
            for place in places[1:]:
                other = leaves[place[0]].shape[place[1]]
                if other != size:
                    raise PrecompileError(
                        f"{where(place)} (={other}) must equal {where(first)} (={size}): they "
                        f"share shape_id {shape_id!r}."
                    )
            sizes.append(size)
        for expr, readable in self.relations:
            if evaluate(expr, sizes):
                continue
            if expr[0] == "==" and all(
                isinstance(side, tuple) and side[0] == "d" for side in expr[1:]
            ):
                (_, a), (_, b) = expr[1:]
                raise PrecompileError(
                    f"{where(self.dims[a][1][0])} (={sizes[a]}) must equal "
                    f"{where(self.dims[b][1][0])} (={sizes[b]}): the computation was captured "
                    "for equal sizes."
                )
            values = ", ".join(
                f"{where(places[0])} = {size}"
                for (_, places), size in zip(self.dims, sizes, strict=True)
            )
            raise PrecompileError(
                f"the input sizes must satisfy {readable}, which the computation was captured "
                f"with; this call has {values}."
            )


_OPERATIONS: dict[str, Callable[[list[Any]], Any]] = {
    "+": sum,
    "*": math.prod,
    "min": min,
    "max": max,
    "and": all,
    "or": any,
    "not": lambda v: not v[0],
    "//": lambda v: v[0] // v[1],
    "%": lambda v: v[0] % v[1],
    "/": lambda v: v[0] / v[1],
    "**": lambda v: v[0] ** v[1],
    "==": lambda v: v[0] == v[1],
    "!=": lambda v: v[0] != v[1],
    "<": lambda v: v[0] < v[1],
    "<=": lambda v: v[0] <= v[1],
    ">": lambda v: v[0] > v[1],
    ">=": lambda v: v[0] >= v[1],
}


def evaluate(expr: Any, sizes: Sequence[int]) -> Any:
    """Evaluate a size expression: an int, ``("d", i)`` (dynamic size i) or ``(op, *args)``."""
    if isinstance(expr, int):
        return expr
    if expr[0] == "d":
        return sizes[expr[1]]
    return _OPERATIONS[expr[0]]([evaluate(arg, sizes) for arg in expr[1:]])
