"""Dynamic dims: inputs marked with ``torch._dynamo.decorators.mark_unbacked`` are traced with
unbacked symbols, so one artifact serves every size of those dims.

The marks are read through ``internals.tracing.tensor_marks``.
An unbacked symbol cannot be guarded on, so a computation that would branch on or specialize
a marked dim fails at capture. What the trace needed to assume about the sizes (``Eq(u0, u1)``
when two marked dims meet in one operation) is recorded as deferred runtime asserts; those
become checks the driver runs before any kernel.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from torch_precompile.errors import PrecompileError
from torch_precompile.internals.tracing import (
    FakeTensorMode,
    ShapeEnv,
    check,
    deferred_asserts,
    forget_pending_unbacked,
    is_traceable_wrapper_subclass,
    set_size_hint,
    size_function_types,
    symbol_pinning,
    tensor_marks,
)
from torch_precompile.spec import SizeRelation

MEMORY_FORMATS = {
    "contiguous": torch.contiguous_format,
    "channels_last": torch.channels_last,
    "channels_last_3d": torch.channels_last_3d,
}


@dataclass(frozen=True)
class Mark:
    shape_id: Any
    low: int | None
    high: int | None
    hint: int | None


@dataclass(frozen=True)
class DynamicInputs:
    """Fake inputs with unbacked symbols, and how each symbol maps back to the user's dims."""

    fakes: list[torch.Tensor]
    fake_mode: Any
    symbols: list[Any]  # one sympy symbol per dynamic size
    labels: list[str]  # the shape_id, or "" when the symbol is not shared by label
    occurrences: list[list[tuple[int, int]]]  # per symbol: (leaf index, dim) pairs
    memory_formats: dict[int, str]  # leaf index -> layout name of a marked input


def read_marks(leaves: Sequence[Any], names: Sequence[str]) -> list[dict[int, Mark]]:
    """The marked dims of each leaf; rejects marks that one artifact cannot honour."""
    marks: list[dict[int, Mark]] = []
    for leaf, name in zip(leaves, names, strict=True):
        if not isinstance(leaf, torch.Tensor):
            marks.append({})
            continue
        found = tensor_marks(leaf)
        if found.backed_dims:
            raise PrecompileError(
                f"input {name} has a dim marked with mark_dynamic (a backed dynamic dim), which "
                "precompile cannot honour: one artifact cannot re-specialize per size. Mark it "
                "with torch._dynamo.decorators.mark_unbacked instead, or leave it static."
            )
        if any(found.specialize_on.values()):
            raise PrecompileError(
                f"input {name} is marked with mark_unbacked(..., specialize_on=...), which asks "
                "for per-value specializations; a precompiled artifact is one graph. Remove "
                "specialize_on."
            )
        dims = found.unbacked_dims
        if dims and is_traceable_wrapper_subclass(leaf):
            raise PrecompileError(
                f"input {name} is a tensor subclass ({type(leaf).__name__}) with a "
                "mark_unbacked dim; dynamic capture handles plain tensors only. Mark a plain "
                "tensor, or leave the dim static."
            )
        shape_ids, bounds, hints = found.shape_ids, found.bounds, found.hints
        for dim in dims:
            if not -leaf.dim() <= dim < leaf.dim():
                raise PrecompileError(
                    f"input {name} is marked dynamic in dim {dim}, but it has {leaf.dim()} dims."
                )
        marks.append(
            {
                dim % leaf.dim(): Mark(
                    shape_ids.get(dim), *bounds.get(dim, (None, None)), hints.get(dim)
                )
                for dim in dims
            }
        )
    return marks


def memory_format_name(leaf: torch.Tensor, name: str) -> str:
    for format_name, memory_format in MEMORY_FORMATS.items():
        if leaf.is_contiguous(memory_format=memory_format):
            return format_name
    raise PrecompileError(
        f"input {name} has a dynamic dim but a layout that is neither contiguous, channels_last "
        f"nor channels_last_3d (strides {tuple(leaf.stride())}); the artifact could not check "
        "it at other sizes. Pass it in one of those layouts (.contiguous()), or leave its dims "
        "static."
    )


def fake_inputs(
    state: Sequence[torch.Tensor],
    leaves: Sequence[Any],
    names: Sequence[str],
    marks: Sequence[dict[int, Mark]],
) -> DynamicInputs:
    """Fake tensors for the flat inputs: static model state, unbacked symbols for marked dims."""
    shape_env = ShapeEnv()
    fake_mode = FakeTensorMode(shape_env=shape_env, allow_non_fake_inputs=True)
    by_label: dict[Any, int] = {}
    symbols: list[Any] = []
    labels: list[str] = []
    occurrences: list[list[tuple[int, int]]] = []
    memory_formats: dict[int, str] = {}
    fakes: list[torch.Tensor] = []
    with fake_mode:
        for tensor in state:
            fake: torch.Tensor = fake_mode.from_tensor(tensor, static_shapes=True)
            fakes.append(fake.requires_grad_(tensor.requires_grad) if tensor.is_leaf else fake)
        for index, (leaf, name, leaf_marks) in enumerate(zip(leaves, names, marks, strict=True)):
            if not isinstance(leaf, torch.Tensor):
                continue
            if not leaf_marks:
                fakes.append(fake_mode.from_tensor(leaf, static_shapes=True))
                continue
            sizes: list[Any] = []
            for dim, size in enumerate(leaf.shape):
                mark = leaf_marks.get(dim)
                if mark is None:
                    sizes.append(int(size))
                    continue
                slot = by_label.get(mark.shape_id) if mark.shape_id is not None else None
                if slot is None:
                    symbol = shape_env.create_unbacked_symint()
                    check(symbol >= 0)
                    if mark.hint is not None:
                        set_size_hint(shape_env, symbol, mark.hint)
                    slot = len(symbols)
                    symbols.append(symbol)
                    labels.append("" if mark.shape_id is None else str(mark.shape_id))
                    occurrences.append([])
                    if mark.shape_id is not None:
                        by_label[mark.shape_id] = slot
                symbol = symbols[slot]
                if mark.low is not None:
                    check(symbol >= mark.low)
                if mark.high is not None:
                    check(symbol <= mark.high)
                occurrences[slot].append((index, dim))
                sizes.append(symbol)
            memory_formats[index] = memory_format_name(leaf, name)
            fake = torch.empty(
                sizes,
                dtype=leaf.dtype,
                device=leaf.device,
                memory_format=MEMORY_FORMATS[memory_formats[index]],
            )
            fakes.append(fake.requires_grad_(leaf.requires_grad))
        forget_pending_unbacked(shape_env)
    return DynamicInputs(
        fakes, fake_mode, [s.node.expr for s in symbols], labels, occurrences, memory_formats
    )


def refuse_specialized(dynamic: DynamicInputs, names: Sequence[str]) -> None:
    """A trace may narrow a marked dim's range, but must not pin it to one value."""
    shape_env = dynamic.fake_mode.shape_env
    for symbol, places in zip(dynamic.symbols, dynamic.occurrences, strict=True):
        value = symbol_pinning(shape_env, symbol)
        if value is not None:
            leaf, dim = places[0]
            raise PrecompileError(
                f"fn fixes the dynamic dim {dim} of input {names[leaf]} to {value} (for example "
                "with a view or reshape to a constant size), so the artifact could only serve "
                "that size. Leave that dim static, or write fn so the size stays free."
            )


def shape_relations(dynamic: DynamicInputs, names: Sequence[str]) -> tuple[SizeRelation, ...]:
    """The trace's deferred runtime asserts that relate dynamic dims, as driver checks.

    Each is an expression tree over the dynamic sizes (see ``SizeRelation``) and the same
    relation written with the user's names. Bounds the driver already checks are skipped.
    """
    shape_env = dynamic.fake_mode.shape_env
    slot_of = {symbol: i for i, symbol in enumerate(dynamic.symbols)}
    readable = [f"input {names[places[0][0]]} dim {places[0][1]}" for places in dynamic.occurrences]
    relations: list[SizeRelation] = []
    for expr in deferred_asserts(shape_env):
        if not expr.free_symbols or _is_plain_bound(expr, slot_of):
            continue
        unknown = [s for s in expr.free_symbols if s not in slot_of]
        if unknown:
            raise PrecompileError(
                f"the trace needs {expr} to hold at run time, which involves values computed "
                "inside fn; precompile can only check relations between input sizes. Leave "
                "those dims static."
            )
        tree = _tree(expr, expr, slot_of)
        relation = SizeRelation(tree, _text(tree, readable))
        if relation not in relations:
            relations.append(relation)
    return tuple(relations)


def _is_plain_bound(expr: Any, slot_of: dict[Any, int]) -> bool:
    """``0 <= u0``, ``u0 >= 2``: bounds, which the driver checks from the marks already."""
    import sympy

    if isinstance(expr, sympy.core.relational.Relational) and len(expr.free_symbols) == 1:
        sides = (expr.lhs, expr.rhs)
        return any(s in slot_of for s in sides) and any(s.is_number for s in sides)
    return False


def _tree(e: Any, whole: Any, slot_of: dict[Any, int]) -> Any:
    """A sympy size expression as the driver's expression tree (see ``SizeRelation``)."""
    import sympy

    if e.is_Symbol:
        return ("d", slot_of[e])
    if e.is_Integer:
        return int(e)
    if e.is_Rational:
        return ("/", int(e.p), int(e.q))
    if isinstance(e, sympy.Pow) and e.exp.is_Integer and int(e.exp) > 0:
        return ("**", _tree(e.base, whole, slot_of), int(e.exp))
    op = _operator(e)
    if op is None:
        raise PrecompileError(
            f"the trace needs the sizes to satisfy {whole}, which precompile cannot turn into "
            "a check. Leave those dims static."
        )
    return (op, *(_tree(arg, whole, slot_of) for arg in e.args))


def _operator(e: Any) -> str | None:
    import sympy

    floor_div, mods = size_function_types()
    kinds: list[tuple[Any, str]] = [
        (sympy.Add, "+"),
        (sympy.Mul, "*"),
        (floor_div, "//"),
        ((*mods, sympy.Mod), "%"),
        (sympy.Eq, "=="),
        (sympy.Ne, "!="),
        (sympy.Le, "<="),
        (sympy.Lt, "<"),
        (sympy.Ge, ">="),
        (sympy.Gt, ">"),
        (sympy.And, "and"),
        (sympy.Or, "or"),
        (sympy.Not, "not"),
        (sympy.Max, "max"),
        (sympy.Min, "min"),
    ]
    return next((op for kind, op in kinds if isinstance(e, kind)), None)


_INFIX = {"+", "*", "//", "%", "/", "**", "==", "!=", "<=", "<", ">=", ">", "and", "or"}


def _text(tree: Any, names: Sequence[str]) -> str:
    """An expression tree written out with the user's names for the sizes."""
    if isinstance(tree, int):
        return str(tree)
    op, *args = tree
    if op == "d":
        return cast(str, names[args[0]])
    parts = [_text(arg, names) for arg in args]
    if op == "not":
        return f"(not {parts[0]})"
    if op in _INFIX:
        joined = f" {op} ".join(parts)
        return joined if op in ("==", "!=", "<=", "<", ">=", ">") else f"({joined})"
    return f"{op}({', '.join(parts)})"
