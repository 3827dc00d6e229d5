"""The runtime driver of a precompiled artifact.

This module's source is copied verbatim into every artifact, after the calling-convention
metadata, and ``bind_forward(globals(), call)`` turns that metadata into ``forward(*args)``.
So it imports only torch and the standard library, and it must never grow a
``from __future__`` import (the copy does not sit at the top of a file).

``forward`` checks a call in a fixed order (arity, input structure, user inputs, models),
hands the flat tensors to the compiled ``call``, re-checks the tensor values the trace
decided on, accumulates harvested gradients onto the runtime model's ``.grad`` and rebuilds
``fn``'s result. Every broken rule raises ``PrecompileError`` naming the argument, what was
expected and what was given.
"""

import math
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree


class PrecompileError(RuntimeError):
    """A precompile contract was broken: at capture, at load, or by a call to an artifact."""


def bind_forward(meta: Mapping[str, Any], call: Callable[[list[Any]], list[Any]]) -> Callable:
    """Return ``forward(*args)`` for the artifact described by ``meta`` and running ``call``."""
    arity: int = meta["NUM_POSITIONAL_ARGS"]
    arg_names: list[str] = meta["ARG_NAMES"]
    module_positions: tuple[int, ...] = tuple(meta["MODULE_POSITIONS"])
    input_positions = tuple(i for i in range(arity) if i not in module_positions)
    in_spec = None if meta["IN_SPEC"] is None else pytree.treespec_loads(meta["IN_SPEC"])
    out_spec = pytree.treespec_loads(meta["OUT_SPEC"])
    leaf_checks = _leaf_checks(meta)
    state_layouts, input_layouts = _layout_checks(meta)
    size_check = _dynamic_size_check(meta)
    model_state = _model_state(meta, [arg_names[i] for i in module_positions], state_layouts)
    grad_indices: list[int] = meta["GRAD_PARAM_INDICES"]
    guards = meta["VALUE_GUARDS"]
    num_results = out_spec.num_leaves
    guards_start = num_results + len(grad_indices)
    num_leaves = len(leaf_checks)
    arity_text = _describe_arity(arg_names, module_positions)
    # Fast paths for the common shapes of a call: inputs that are all tensors at the top level,
    # and a result that is a single tensor.
    flat_inputs = in_spec is not None and in_spec == pytree.tree_flatten(input_positions)[1]
    single_result = out_spec == pytree.tree_flatten(0)[1]

    def forward(*args: Any, **kwargs: Any) -> Any:
        if kwargs:
            raise PrecompileError(
                f"keyword arguments {sorted(kwargs)} given; a precompiled artifact takes the "
                f"same positional arguments as the captured fn: {arity_text}."
            )
        if len(args) != arity:
            raise PrecompileError(
                f"expected {arity} positional arguments ({arity_text}), got {len(args)}."
            )
        user_args = tuple([args[i] for i in input_positions])
        if flat_inputs and all([isinstance(a, torch.Tensor) for a in user_args]):
            leaves: Sequence[Any] = user_args
        else:
            leaves, spec = pytree.tree_flatten(user_args)
            if in_spec is not None:
                if spec != in_spec:
                    raise PrecompileError(
                        "the runtime inputs have a different structure than at capture: "
                        f"expected {_sketch(pytree.tree_unflatten(leaf_checks, in_spec))}, got "
                        f"{_sketch(user_args)}. Pass the same nesting of lists, tuples and dicts."
                    )
            elif len(leaves) != num_leaves:
                raise PrecompileError(
                    f"the runtime inputs hold {len(leaves)} leaves; the captured ones held "
                    f"{num_leaves}. Pass the same inputs as at capture."
                )
        flat: list[Any] = []
        for check, leaf in zip(leaf_checks, leaves, strict=True):
            check(leaf, flat)
        if size_check is not None:
            size_check(leaves)
        for index, strides, name in input_layouts:
            _check_layout(flat[index], strides, name)
        state = model_state([args[i] for i in module_positions])
        flat[:0] = state
        grad_enabled = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            outputs = call(flat)
            if guards:
                _check_guards(guards, outputs[guards_start:])
            if grad_indices:
                _accumulate_grads(state, grad_indices, outputs[num_results:guards_start])
        finally:
            torch._C._set_grad_enabled(grad_enabled)
        if single_result:
            return outputs[0]
        return pytree.tree_unflatten(outputs[:num_results], out_spec)

    return forward


def _dynamic_size_check(meta: Mapping[str, Any]) -> Callable[[Sequence[Any]], None] | None:
    """Check that dims sharing a size agree and that the trace's size relations hold."""
    dims = meta["DYNAMIC_DIMS"]
    if not dims:
        return None
    names = meta["USER_INPUT_NAMES"]
    # The relations are arithmetic over sizes that capture wrote into this same file.
    relations = [
        (eval(f"lambda d: {code}", {"min": min, "max": max}), code, readable)
        for code, readable in meta["SHAPE_RELATIONS"]
    ]

    def where(place: Sequence[int]) -> str:
        return f"input {names[place[0]]} dim {place[1]}"

    def check(leaves: Sequence[Any]) -> None:
        sizes = []
        for label, places in dims:
            first = places[0]
            size = leaves[first[0]].shape[first[1]]
            for place in places[1:]:
                other = leaves[place[0]].shape[place[1]]
                if other != size:
                    raise PrecompileError(
                        f"{where(place)} (={other}) must equal {where(first)} (={size}): they "
                        f"share shape_id {label!r}."
                    )
            sizes.append(size)
        for holds, code, readable in relations:
            if not holds(sizes):
                raise PrecompileError(_relation_message(code, readable, dims, sizes, where))

    return check


def _relation_message(code: str, readable: str, dims: Sequence[Any], sizes: Sequence[int],
                      where: Callable[[Sequence[int]], str]) -> str:
    parts = code.split(" == ")
    if len(parts) == 2 and all(p.startswith("d[") and p.endswith("]") for p in parts):
        a, b = (int(p[2:-1]) for p in parts)
        return (f"{where(dims[a][1][0])} (={sizes[a]}) must equal {where(dims[b][1][0])} "
                f"(={sizes[b]}): the computation was captured for equal sizes.")
    values = ", ".join(f"{where(places[0])} = {size}"
                       for (_, places), size in zip(dims, sizes, strict=True))
    return (f"the input sizes must satisfy {readable}, which the computation was captured "
            f"with; this call has {values}.")


def _layout_checks(meta: Mapping[str, Any]) -> tuple[list[Any], list[Any]]:
    """(index, strides, name) of each flat input whose layout the kernels assume."""
    strides = meta["INPUT_STRIDES"]
    if strides is None:
        return [], []
    names = [
        *(f"model parameter {n!r}" for n in meta["PARAM_NAMES"]),
        *(f"model buffer {n!r}" for n in meta["BUFFER_NAMES"]),
    ]
    num_state = len(names)
    names += [
        f"input {n}"
        for n, shape in zip(meta["USER_INPUT_NAMES"], meta["USER_INPUT_SHAPES"], strict=True)
        if shape is not None
    ]
    checks = [
        (i, s if isinstance(s, str) else tuple(s), names[i])
        for i, s in enumerate(strides)
        if s is not None
    ]
    return (
        [c for c in checks if c[0] < num_state],
        [(i - num_state, s, name) for i, s, name in checks if i >= num_state],
    )


_MEMORY_FORMATS = {
    "contiguous": torch.contiguous_format,
    "channels_last": torch.channels_last,
    "channels_last_3d": torch.channels_last_3d,
}


def _check_layout(tensor: torch.Tensor, strides: tuple[int, ...] | str, name: str) -> None:
    if isinstance(strides, str):  # an input with dynamic dims: its memory format
        if not tensor.is_contiguous(memory_format=_MEMORY_FORMATS[strides]):
            raise PrecompileError(
                f"{name}: the compiled kernels assume the {strides} memory format (the "
                f"example's), got strides {tuple(tensor.stride())}. Pass it in that format "
                "(.contiguous(memory_format=...)), or precompile with backend='eager'."
            )
        return
    # Strides of dims of size 0 or 1 never matter, as in Inductor's own assert.
    if tensor.numel() and any(
        size > 1 and got != want
        for size, got, want in zip(tensor.shape, tensor.stride(), strides, strict=True)
    ):
        raise PrecompileError(
            f"{name}: the compiled kernels assume strides {strides} (the example's layout), "
            f"got {tuple(tensor.stride())}. Pass it in the example's layout (.contiguous() for "
            "a contiguous example), or precompile with backend='eager', which takes any layout."
        )


def _describe_arity(arg_names: Sequence[str], module_positions: Sequence[int]) -> str:
    parts = [
        f"{name} ({'model' if i in module_positions else 'input'})"
        for i, name in enumerate(arg_names)
    ]
    return ", ".join(parts) if parts else "no arguments"


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def _leaf_checks(meta: Mapping[str, Any]) -> list[Callable[[Any, list[Any]], None]]:
    """One check per user-input leaf; a tensor check appends the tensor to the flat inputs."""
    checks: list[Callable[[Any, list[Any]], None]] = []
    # With a backward inside fn, requires_grad decides which gradients eager would produce.
    has_backward = bool(meta["GRAD_PARAM_INDICES"])
    for i, name in enumerate(meta["USER_INPUT_NAMES"]):
        shape = meta["USER_INPUT_SHAPES"][i]
        if shape is None:
            checks.append(_value_check(name, meta["USER_INPUT_VALUES"][i]))
        else:
            checks.append(
                _tensor_check(
                    name,
                    tuple(shape),
                    _dtype(meta["USER_INPUT_DTYPES"][i]),
                    torch.device(meta["USER_INPUT_DEVICES"][i]),
                    meta["USER_INPUT_BOUNDS"][i] or {},
                    meta["USER_INPUT_REQUIRES_GRAD"][i] if has_backward else None,
                )
            )
    return checks


class _Leaf:
    """Stands for one captured leaf when a structure is sketched in an error message."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _sketch(tree: Any) -> str:
    def show(leaf: Any) -> _Leaf:
        if isinstance(leaf, torch.Tensor):
            return _Leaf("Tensor")
        if callable(leaf) and hasattr(leaf, "expected"):
            return _Leaf(leaf.expected)
        return _Leaf(repr(leaf))

    text = repr(pytree.tree_map(show, tree))
    return text if len(text) <= 300 else text[:297] + "..."


def _tensor_check(
    name: str,
    shape: tuple[int | None, ...],
    dtype: torch.dtype,
    device: torch.device,
    bounds: Mapping[int, tuple[int | None, int | None]],
    requires_grad: bool | None,
) -> Callable[[Any, list[Any]], None]:
    static = None not in shape
    shown = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"

    def check(leaf: Any, flat: list[Any]) -> None:
        if not isinstance(leaf, torch.Tensor):
            raise PrecompileError(
                f"input {name}: expected a tensor of shape {shown}, got {type(leaf).__name__}."
            )
        if static:
            if leaf.shape != shape:
                raise PrecompileError(
                    f"input {name}: expected shape {shown}, got {tuple(leaf.shape)}. Shapes are "
                    "specialized to the example; precompile again for this shape."
                )
        else:
            _check_dynamic_shape(name, leaf, shape, shown, bounds)
        if leaf.dtype != dtype:
            raise PrecompileError(f"input {name}: expected dtype {dtype}, got {leaf.dtype}.")
        if leaf.device != device:
            raise PrecompileError(f"input {name}: expected device {device}, got {leaf.device}.")
        if requires_grad is not None and leaf.requires_grad != requires_grad:
            raise PrecompileError(_requires_grad_message(f"input {name}", requires_grad))
        flat.append(leaf)

    check.expected = f"Tensor{shown}"  # type: ignore[attr-defined]
    return check


def _requires_grad_message(what: str, captured: bool) -> str:
    return (
        f"{what} has requires_grad={not captured}, but was captured with requires_grad="
        f"{captured}: which tensors get gradients from the backward inside fn is fixed at "
        "capture. Set it back, or precompile again."
    )


def _check_dynamic_shape(
    name: str,
    leaf: torch.Tensor,
    shape: tuple[int | None, ...],
    shown: str,
    bounds: Mapping[int, tuple[int | None, int | None]],
) -> None:
    if leaf.dim() != len(shape) or any(
        s is not None and s != got for s, got in zip(shape, leaf.shape, strict=True)
    ):
        raise PrecompileError(
            f"input {name}: expected shape {shown} (* is dynamic), got {tuple(leaf.shape)}."
        )
    for dim, (low, high) in bounds.items():
        size = leaf.shape[dim]
        if (low is not None and size < low) or (high is not None and size > high):
            raise PrecompileError(
                f"input {name}: dim {dim} is {size}, outside the declared range "
                f"[{low if low is not None else 0}, {high if high is not None else 'inf'}]."
            )


def _value_matches(encoded: Any, value: Any) -> bool:
    kind, expected = encoded
    if kind == "float":
        return type(value) is float and (
            math.isnan(value) if expected == "nan" else value == float(expected)
        )
    if kind == "repr":
        return f"{type(value).__module__}.{type(value).__qualname__}" == expected[0] and (
            repr(value) == expected[1]
        )
    return type(value) is type(expected) and value == expected


def _shown(encoded: Any) -> str:
    kind, expected = encoded
    if kind == "repr":
        return expected[1]
    return repr(float(expected) if kind == "float" else expected)


def _value_check(name: str, encoded: Any) -> Callable[[Any, list[Any]], None]:
    """Python values are baked into the graph, so a call must pass the captured value."""

    def check(leaf: Any, flat: list[Any]) -> None:
        if not _value_matches(encoded, leaf):
            raise PrecompileError(
                f"input {name}: expected the value {_shown(encoded)}, got {leaf!r}. Python "
                "values are baked into the graph at capture; precompile again for another "
                "value, or pass it as a tensor."
            )

    check.expected = _shown(encoded)  # type: ignore[attr-defined]
    return check


def _check_guards(guards: Sequence[Any], tensors: Sequence[torch.Tensor]) -> None:
    for (description, encoded), tensor in zip(guards, tensors, strict=True):
        value = tensor.item()
        if not _value_matches(encoded, value):
            raise PrecompileError(
                f"this call left the path the artifact was captured on: {description} was "
                f"{_shown(encoded)} at capture and is {value!r} now, so the result would be "
                "wrong and is withheld (mutations of inputs and buffers may already have "
                "happened). Capture with an example that takes this path, or keep fn from "
                "deciding on tensor values."
            )


def _model_state(
    meta: Mapping[str, Any], module_names: Sequence[str], layouts: Sequence[Any]
) -> Callable[[Sequence[Any]], list[torch.Tensor]]:
    """Return a function that checks the runtime models and lists their interned tensors.

    The full walk over ``named_parameters`` / ``named_buffers`` names every problem. Its result
    is remembered per model, with every dict the walk read; while those hold the same items,
    a call only re-checks each tensor's shape, dtype, device and strides.
    """
    walk = _model_walk(meta, module_names, layouts)
    expected = [
        (torch.Size(shape), _dtype(dtype), torch.device(device))
        for shapes, dtypes, devices in (
            (meta["PARAM_SHAPES"], meta["PARAM_DTYPES"], meta["PARAM_DEVICES"]),
            (meta["BUFFER_SHAPES"], meta["BUFFER_DTYPES"], meta["BUFFER_DEVICES"]),
        )
        for shape, dtype, device in zip(shapes, dtypes, devices, strict=True)
    ]
    strides: list[Any] = [None] * len(expected)
    for index, stride, _ in layouts:
        strides[index] = stride
    requires_grad = _checked_requires_grad(meta, len(expected))
    checks = [(*e, s, r) for e, s, r in zip(expected, strides, requires_grad, strict=True)]
    remembered: dict[tuple[int, ...], tuple[Any, ...]] = {}

    def state(modules: Sequence[Any]) -> list[torch.Tensor]:
        key = tuple([id(m) for m in modules])
        entry = remembered.get(key)
        if entry is not None:
            refs, snapshot, tensors = entry
            if all([r() is m for r, m in zip(refs, modules, strict=True)]) and _unchanged(snapshot):
                for tensor, (shape, dtype, device, stride, grad) in zip(tensors, checks,
                                                                         strict=True):
                    if (tensor.shape != shape or tensor.dtype is not dtype
                            or tensor.device != device
                            or (stride is not None and tensor.stride() != stride)
                            or (grad is not None and tensor.requires_grad is not grad)):
                        return walk(modules)  # names the problem, or accepts a benign stride
                return list(tensors)
        tensors = walk(modules)
        if len(remembered) >= 8:
            remembered.pop(next(iter(remembered)))
        remembered[key] = ([weakref.ref(m) for m in modules], _snapshot(modules), tensors)
        return list(tensors)

    return state


def _checked_requires_grad(meta: Mapping[str, Any], count: int) -> list[bool | None]:
    """Per interned tensor, the requires_grad a call must present (None: not checked)."""
    if not meta["GRAD_PARAM_INDICES"]:
        return [None] * count
    flags: list[bool | None] = list(meta["PARAM_REQUIRES_GRAD"])
    return flags + [None] * (count - len(flags))


def _snapshot(modules: Sequence[torch.nn.Module]) -> list[tuple[dict[str, Any], list[Any]]]:
    """Every dict a walk over ``modules`` reads, with its items now."""
    seen: set[int] = set()
    dicts = []
    for root in modules:
        for _, module in root.named_modules(remove_duplicate=False):
            if id(module) not in seen:
                seen.add(id(module))
                for d in (module._parameters, module._buffers, module._modules):
                    dicts.append((d, list(d.items())))
    return dicts


def _unchanged(snapshot: Sequence[tuple[dict[str, Any], list[Any]]]) -> bool:
    for d, items in snapshot:
        if len(d) != len(items):
            return False
        for (key, value), (old_key, old_value) in zip(d.items(), items, strict=True):
            if value is not old_value or key != old_key:
                return False
    return True


def _model_walk(
    meta: Mapping[str, Any], module_names: Sequence[str], layouts: Sequence[Any]
) -> Callable[[Sequence[Any]], list[torch.Tensor]]:
    """The full check: walk the models as capture did, naming the first difference."""
    kinds = (
        ("parameter", meta["PARAM_NAMES"], meta["PARAM_SHAPES"], meta["PARAM_DTYPES"],
         meta["PARAM_DEVICES"]),
        ("buffer", meta["BUFFER_NAMES"], meta["BUFFER_SHAPES"], meta["BUFFER_DTYPES"],
         meta["BUFFER_DEVICES"]),
    )
    expected = [
        (kind, name, torch.Size(shape), _dtype(dtype), torch.device(device))
        for kind, names, shapes, dtypes, devices in kinds
        for name, shape, dtype, device in zip(names, shapes, dtypes, devices, strict=True)
    ]
    tied: Mapping[str, str] = meta["TIED_NAMES"]
    qualify = len(module_names) > 1
    requires_grad = _checked_requires_grad(meta, len(expected))

    def members(modules: Sequence[torch.nn.Module]) -> Any:
        for kind, named in (
            ("parameter", torch.nn.Module.named_parameters),
            ("buffer", torch.nn.Module.named_buffers),
        ):
            for mi, module in enumerate(modules):
                for local, tensor in named(module, remove_duplicate=False):
                    yield kind, f"m{mi}.{local}" if qualify else local, tensor

    def walk(modules: Sequence[Any]) -> list[torch.Tensor]:
        for name, module in zip(module_names, modules, strict=True):
            if not isinstance(module, torch.nn.Module):
                raise PrecompileError(
                    f"argument {name} was a torch.nn.Module at capture; got "
                    f"{type(module).__name__}. Pass the model in the same position."
                )
        tensors: list[torch.Tensor] = []
        first_name: dict[int, str] = {}
        for kind, name, tensor in members(modules):
            owner = first_name.get(id(tensor))
            if name in tied:
                if owner != tied[name]:
                    raise PrecompileError(
                        f"model {kind} {name!r} was tied to {tied[name]!r} at capture; at "
                        "runtime it is a separate tensor. Tie the weights as in the example model."
                    )
                continue
            if owner is not None:
                raise PrecompileError(
                    f"model {kind} {name!r} is tied to {owner!r} at runtime but was a separate "
                    "tensor at capture. Use a model with the same weight tying."
                )
            index = len(tensors)
            if index >= len(expected) or expected[index][:2] != (kind, name):
                want = f"{expected[index][0]} {expected[index][1]!r}" if index < len(
                    expected) else "nothing more"
                raise PrecompileError(
                    f"the runtime model does not match the captured one: at position {index} "
                    f"expected {want}, got {kind} {name!r}. Pass a model with the same "
                    "parameters and buffers, in the same order."
                )
            _, _, shape, dtype, device = expected[index]
            if tensor.shape != shape or tensor.dtype != dtype or tensor.device != device:
                raise PrecompileError(
                    f"model {kind} {name!r}: expected shape {tuple(shape)}, dtype {dtype}, "
                    f"device {device}; got shape {tuple(tensor.shape)}, dtype {tensor.dtype}, "
                    f"device {tensor.device}. Load a checkpoint of the same architecture."
                )
            if requires_grad[index] is not None and tensor.requires_grad != requires_grad[index]:
                raise PrecompileError(
                    _requires_grad_message(f"model {kind} {name!r}", requires_grad[index])
                )
            first_name[id(tensor)] = name
            tensors.append(tensor)
        if len(tensors) != len(expected):
            missing = [f"{kind} {name!r}" for kind, name, *_ in expected[len(tensors):]]
            raise PrecompileError(
                f"the runtime model lacks {', '.join(missing[:5])}"
                f"{' and more' if len(missing) > 5 else ''}, which the captured model had. Pass a "
                "model with the same parameters and buffers."
            )
        for index, strides, name in layouts:
            _check_layout(tensors[index], strides, name)
        return tensors

    return walk


def _accumulate_grads(
    state: Sequence[torch.Tensor], indices: Sequence[int], grads: Sequence[torch.Tensor]
) -> None:
    """Put harvested gradients on ``.grad`` the way eager backward does: set or add in place."""
    taken: set[int] = set()
    for index, grad in zip(indices, grads, strict=True):
        param = state[index]
        if param.grad is None:
            # A gradient can be taken as is only if nothing else holds it and it already has
            # the parameter's layout; otherwise a later in-place add would write through.
            if grad._base is None and id(grad) not in taken and grad.stride() == param.stride():
                taken.add(id(grad))
                param.grad = grad
            else:
                param.grad = torch.empty_like(param).copy_(grad)
        else:
            param.grad.add_(grad)
