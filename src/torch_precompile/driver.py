"""The driver of a precompiled artifact: ``forward(*args)`` checks a call and runs ``call``.

This module's source is copied verbatim into every artifact, after the compiled graph (which
defines ``call``) and the spec literal ``ARTIFACT_SPEC``; the artifact ends with
``PLAN = Plan(ARTIFACT_SPEC, call)``. So it imports only torch and the standard library and never
grows a ``from __future__`` import. Its touches of torch beyond tensors are few:
``torch.utils._pytree`` (input and result structure), ``torch._C._set_grad_enabled`` (cheaper
than the context manager), ``torch._C._dynamo.guards.TensorGuards`` (torch.compile's C++
tensor check, used when present to re-check remembered model tensors quickly), the public
module-registration hooks of ``torch.nn.modules.module`` (to notice a replaced parameter,
buffer or submodule cheaply) and, for artifacts with DTensors only, DTensor's public API and
``torch._C._distributed_c10d``'s process-group registry (to bind the graph's group names).

A call runs, in order: ``check_arguments``, ``input_leaves``, ``checked_inputs``,
``model_tensors``, ``call`` (for DTensors: ``call_distributed``, which unwraps them to local
tensors and rewraps gradients and results), ``check_value_guards``, ``accumulate_grads``, and
the result is rebuilt. Every broken rule raises ``PrecompileError`` naming the argument, what
was expected and what was given.
"""

import contextlib
import math
import operator
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree


class PrecompileError(RuntimeError):
    """A precompile contract was broken: at capture, at load, or by a call to an artifact."""


# The artifact's last line sets this: ``PLAN = Plan(ARTIFACT_SPEC, call)``.
PLAN: "Plan" = None  # type: ignore[assignment]


def forward(*args: Any, **kwargs: Any) -> Any:
    """Run the precompiled computation on ``args`` (the captured fn's positional arguments)."""
    check_arguments(PLAN, args, kwargs)
    inputs = checked_inputs(PLAN, input_leaves(PLAN, args))
    state = model_tensors(PLAN, [args[i] for i in PLAN.model_positions])
    grad_enabled = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)
    try:
        if PLAN.distributed is None:
            outputs = PLAN.call([*state, *inputs])
        else:
            outputs = call_distributed(PLAN, state, inputs)
        check_value_guards(PLAN, outputs[PLAN.guards_start:])
        accumulate_grads(state, PLAN.grad_indices, outputs[PLAN.num_results:PLAN.guards_start])
    finally:
        torch._C._set_grad_enabled(grad_enabled)
    if PLAN.single_result:
        return outputs[0]
    return pytree.tree_unflatten(outputs[:PLAN.num_results], PLAN.out_spec)


class Plan:
    """``ARTIFACT_SPEC`` turned into what the per-call checks compare against, once per load."""

    def __init__(self, spec: Mapping[str, Any], call: Callable[[list[Any]], list[Any]]) -> None:
        self.call = call
        args = spec["args"]
        self.arity = len(args)
        self.arg_names = [a["name"] for a in args]
        self.model_positions = [i for i, a in enumerate(args) if a["is_model"]]
        self.input_positions = [i for i, a in enumerate(args) if not a["is_model"]]
        self.arity_text = ", ".join(
            f"{a['name']} ({'model' if a['is_model'] else 'input'})" for a in args
        ) or "no arguments"
        self.in_spec = None if spec["in_spec"] is None else pytree.treespec_loads(spec["in_spec"])
        self.out_spec = pytree.treespec_loads(spec["out_spec"])
        # Common shapes of a call take shortcuts: top-level tensor inputs, one tensor result.
        self.flat_inputs = self.in_spec == pytree.tree_flatten(tuple(self.input_positions))[1]
        self.single_result = self.out_spec == pytree.tree_flatten(0)[1]
        training = any(t["gets_grad"] for t in spec["model"])
        self.leaves = [LeafPlan(leaf, training) for leaf in spec["inputs"]]
        self.dynamic_dims = [(d["shape_id"], d["places"]) for d in spec["dynamic_dims"]]
        self.relations = [(r["expr"], r["readable"]) for r in spec["size_relations"]]
        self.model = ModelPlan(spec, self.model_names(), training)
        self.grad_indices = [i for i, t in enumerate(self.model.interned) if t["gets_grad"]]
        self.value_guards = [(g["description"], g["expected"]) for g in spec["value_guards"]]
        self.num_results = self.out_spec.num_leaves
        self.guards_start = self.num_results + len(self.grad_indices)
        self.distributed = DistributedPlan(spec) if spec.get("meshes") else None

    def model_names(self) -> list[str]:
        return [self.arg_names[i] for i in self.model_positions]


def check_arguments(plan: Plan, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    if kwargs:
        raise PrecompileError(
            f"keyword arguments {sorted(kwargs)} given; a precompiled artifact takes the same "
            f"positional arguments as the captured fn: {plan.arity_text}."
        )
    if len(args) != plan.arity:
        raise PrecompileError(
            f"expected {plan.arity} positional arguments ({plan.arity_text}), got {len(args)}."
        )


def input_leaves(plan: Plan, args: Sequence[Any]) -> Sequence[Any]:
    """The leaves of the runtime inputs, after checking their structure."""
    user_args = tuple([args[i] for i in plan.input_positions])
    if plan.flat_inputs and all([isinstance(a, torch.Tensor) for a in user_args]):
        return user_args
    leaves, structure = pytree.tree_flatten(user_args)
    if plan.in_spec is not None and structure != plan.in_spec:
        expected = pytree.tree_unflatten(plan.leaves, plan.in_spec)
        raise PrecompileError(
            "the runtime inputs have a different structure than at capture: expected "
            f"{_sketch(expected)}, got {_sketch(user_args)}. Pass the same nesting of lists, "
            "tuples and dicts."
        )
    if len(leaves) != len(plan.leaves):
        raise PrecompileError(
            f"the runtime inputs hold {len(leaves)} leaves; the captured ones held "
            f"{len(plan.leaves)}. Pass the same inputs as at capture."
        )
    return leaves


class LeafPlan:
    """What a call must pass for one input leaf."""

    def __init__(self, leaf: Mapping[str, Any], training: bool) -> None:
        self.name: str = leaf["path"]
        self.is_tensor = leaf["kind"] == "tensor"
        self.value = leaf["value"]
        shape = leaf["shape"] or ()
        self.static = None not in shape
        self.shape = torch.Size(shape) if self.static else tuple(shape)
        self.shown = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
        self.dtype = _dtype(leaf["dtype"]) if self.is_tensor else None
        self.device = torch.device(leaf["device"]) if self.is_tensor else None
        self.strides = leaf["strides"]
        self.bounds = leaf["bounds"] or {}
        # With a backward inside fn, requires_grad decides which gradients eager would produce.
        self.requires_grad = leaf["requires_grad"] if training else None

    def __repr__(self) -> str:  # how a leaf shows in a structure sketch
        return f"Tensor{self.shown}" if self.is_tensor else _shown(self.value)


def checked_inputs(plan: Plan, leaves: Sequence[Any]) -> list[torch.Tensor]:
    """The tensor leaves, each checked against its plan; Python values must match."""
    tensors = []
    for leaf_plan, leaf in zip(plan.leaves, leaves, strict=True):
        if leaf_plan.is_tensor:
            check_tensor_leaf(leaf_plan, leaf)
            tensors.append(leaf)
        elif not _value_matches(leaf_plan.value, leaf):
            raise PrecompileError(
                f"input {leaf_plan.name}: expected the value {_shown(leaf_plan.value)}, got "
                f"{leaf!r}. Python values are baked into the graph at capture; precompile again "
                "for another value, or pass it as a tensor."
            )
    if plan.dynamic_dims:
        check_dynamic_sizes(plan, leaves)
    return tensors


def check_tensor_leaf(plan: LeafPlan, leaf: Any) -> None:
    name = plan.name
    if not isinstance(leaf, torch.Tensor):
        raise PrecompileError(
            f"input {name}: expected a tensor of shape {plan.shown}, got {type(leaf).__name__}."
        )
    if plan.static:
        if leaf.shape != plan.shape:
            raise PrecompileError(
                f"input {name}: expected shape {plan.shown}, got {tuple(leaf.shape)}. Shapes are "
                "specialized to the example; precompile again for this shape."
            )
    else:
        _check_dynamic_shape(plan, leaf)
    if leaf.dtype != plan.dtype:
        raise PrecompileError(f"input {name}: expected dtype {plan.dtype}, got {leaf.dtype}.")
    if leaf.device != plan.device:
        raise PrecompileError(f"input {name}: expected device {plan.device}, got {leaf.device}.")
    if plan.requires_grad is not None and leaf.requires_grad != plan.requires_grad:
        raise PrecompileError(_requires_grad_message(f"input {name}", plan.requires_grad))
    if plan.strides is not None:
        check_layout(leaf, plan.strides, f"input {name}")


def _check_dynamic_shape(plan: LeafPlan, leaf: torch.Tensor) -> None:
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


def check_dynamic_sizes(plan: Plan, leaves: Sequence[Any]) -> None:
    """Dims sharing a size must agree, and the trace's size relations must hold."""

    def where(place: Sequence[int]) -> str:
        return f"input {plan.leaves[place[0]].name} dim {place[1]}"

    sizes = []
    for shape_id, places in plan.dynamic_dims:
        first = places[0]
        size = leaves[first[0]].shape[first[1]]
        for place in places[1:]:
            other = leaves[place[0]].shape[place[1]]
            if other != size:
                raise PrecompileError(
                    f"{where(place)} (={other}) must equal {where(first)} (={size}): they share "
                    f"shape_id {shape_id!r}."
                )
        sizes.append(size)
    for expr, readable in plan.relations:
        if evaluate(expr, sizes):
            continue
        if expr[0] == "==" and all(isinstance(side, tuple) and side[0] == "d"
                                   for side in expr[1:]):
            (_, a), (_, b) = expr[1:]
            raise PrecompileError(
                f"{where(plan.dynamic_dims[a][1][0])} (={sizes[a]}) must equal "
                f"{where(plan.dynamic_dims[b][1][0])} (={sizes[b]}): the computation was captured "
                "for equal sizes."
            )
        values = ", ".join(f"{where(places[0])} = {size}"
                           for (_, places), size in zip(plan.dynamic_dims, sizes, strict=True))
        raise PrecompileError(
            f"the input sizes must satisfy {readable}, which the computation was captured with; "
            f"this call has {values}."
        )


_OPERATIONS: dict[str, Callable[[list[Any]], Any]] = {
    "+": sum, "*": math.prod, "min": min, "max": max, "and": all, "or": any,
    "not": lambda v: not v[0], "//": lambda v: v[0] // v[1], "%": lambda v: v[0] % v[1],
    "/": lambda v: v[0] / v[1], "**": lambda v: v[0] ** v[1],
    "==": lambda v: v[0] == v[1], "!=": lambda v: v[0] != v[1], "<": lambda v: v[0] < v[1],
    "<=": lambda v: v[0] <= v[1], ">": lambda v: v[0] > v[1], ">=": lambda v: v[0] >= v[1],
}


def evaluate(expr: Any, sizes: Sequence[int]) -> Any:
    """Evaluate a size expression: an int, ``("d", i)`` (dynamic size i) or ``(op, *args)``."""
    if isinstance(expr, int):
        return expr
    if expr[0] == "d":
        return sizes[expr[1]]
    return _OPERATIONS[expr[0]]([evaluate(arg, sizes) for arg in expr[1:]])


_MEMORY_FORMATS = {
    "contiguous": torch.contiguous_format,
    "channels_last": torch.channels_last,
    "channels_last_3d": torch.channels_last_3d,
}


def check_layout(tensor: torch.Tensor, strides: Sequence[int] | str, name: str) -> None:
    """The compiled kernels assume a layout; anything else is refused before they run."""
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
            f"{name}: the compiled kernels assume strides {tuple(strides)} (the example's "
            f"layout), got {tuple(tensor.stride())}. Pass it in the example's layout "
            "(.contiguous() for a contiguous example), or precompile with backend='eager', "
            "which takes any layout."
        )


class ModelPlan:
    """The captured models' structure, and a memo of the last few models that matched it.

    A full walk over the models names any difference. Its result is remembered per set of
    model objects; while no parameter, buffer or submodule has been registered anywhere
    since (module-registration hooks count each one) and no module lost a member, a call
    re-checks only each tensor's shape, dtype, device, layout and requires_grad, and each
    submodule's training flag.
    """

    def __init__(self, spec: Mapping[str, Any], model_names: Sequence[str], training: bool
                 ) -> None:
        self.names = list(model_names)
        self.records = spec["model"]
        self.interned = [t for t in self.records if t["tied_to"] is None]
        self.expected = [
            (torch.Size(t["shape"]), _dtype(t["dtype"]), torch.device(t["device"]))
            + ((t["requires_grad"],) if training else ())
            for t in self.interned
        ]
        self.read = operator.attrgetter(
            "shape", "dtype", "device", *(("requires_grad",) if training else ()))
        self.training = training
        self.layouts = [(i, t["strides"], f"model {t['kind']} {t['name']!r}")
                        for i, t in enumerate(self.interned) if t["strides"] is not None]
        self.submodules = [(s["name"], s["training"]) for s in spec["submodules"]]
        self.modes = [s["training"] for s in spec["submodules"]]
        self.memo: dict[tuple[int, ...], Any] = {}
        self.lock = threading.Lock()
        _count_registrations()


def model_tensors(plan: Plan, models: Sequence[Any]) -> list[torch.Tensor]:
    """The models' tensors in flat-input order, after checking them against the capture."""
    model = plan.model
    key = tuple([id(m) for m in models])
    entry = model.memo.get(key)
    if entry is not None:
        refs, registrations, sizes, dicts, submodules, tensors, guard = entry
        if (registrations == _REGISTRATIONS[0]
                and all([r() is m for r, m in zip(refs, models, strict=True)])
                and sum(map(len, dicts)) == sizes
                and list(map(_TRAINING, submodules)) == model.modes
                and (guard.check(*tensors) if guard is not None else _tensors_unchanged(
                    model, tensors))):
            return list(tensors)
    tensors, submodules, dicts = walk_models(model, models)
    with model.lock:
        if len(model.memo) >= 8:
            model.memo.pop(next(iter(model.memo), None), None)
        model.memo[key] = ([weakref.ref(m) for m in models], _REGISTRATIONS[0],
                           sum(map(len, dicts)), dicts, submodules, tensors,
                           _tensor_guard(tensors))
    return list(tensors)


def _tensors_unchanged(model: ModelPlan, tensors: Sequence[torch.Tensor]) -> bool:
    return list(map(model.read, tensors)) == model.expected and all(
        [_layout_holds(tensors[i], s) for i, s, _ in model.layouts])


def _tensor_guard(tensors: Sequence[torch.Tensor]) -> Any:
    """A check, in C++, that tensors still have the dtype, device, sizes, strides and
    requires_grad they have now (torch.compile's own tensor guard); None where this torch has
    none, and the checks then run in Python. It is stricter than the capture's contract
    (exact strides everywhere): a call it refuses takes the full walk, which decides."""
    try:
        from torch._C._dynamo.guards import TensorGuards

        return TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                            dynamic_dims_strides=[list(t.stride()) for t in tensors],
                            tensor_check_names=[f"t{i}" for i in range(len(tensors))])
    except Exception:
        return None


_TRAINING = operator.attrgetter("training")


def _layout_holds(tensor: torch.Tensor, strides: Sequence[int]) -> bool:
    return tensor.stride() == strides or not any(
        size > 1 and got != want
        for size, got, want in zip(tensor.shape, tensor.stride(), strides, strict=True))


def walk_models(model: ModelPlan, models: Sequence[Any]) -> tuple[list[Any], list[Any], list[Any]]:
    """Walk the models as capture did, naming the first difference.

    Returns the flat tensors, the submodules in walk order, and every member dict read.
    """
    for name, module in zip(model.names, models, strict=True):
        if not isinstance(module, torch.nn.Module):
            raise PrecompileError(
                f"argument {name} was a torch.nn.Module at capture; got "
                f"{type(module).__name__}. Pass the model in the same position."
            )
    members = list(_members(models))
    for index, (kind, name, _) in enumerate(members):
        records = model.records
        if index >= len(records) or (records[index]["kind"], records[index]["name"]) != (kind,
                                                                                          name):
            _report_mismatch(records, index, kind, name)
    if len(members) < len(model.records):
        missing = [f"{t['kind']} {t['name']!r}" for t in model.records[len(members):]]
        raise PrecompileError(
            f"the runtime model lacks {', '.join(missing[:5])}"
            f"{' and more' if len(missing) > 5 else ''}, which the captured model had. Pass a "
            "model with the same parameters and buffers."
        )
    tensors = _interned(model, members)
    submodules = _checked_modes(model, models)
    dicts = [d for m in submodules for d in (m._parameters, m._buffers, m._modules)]
    return tensors, submodules, dicts


def _members(models: Sequence[torch.nn.Module]) -> Any:
    qualify = len(models) > 1
    for kind, named in (("parameter", torch.nn.Module.named_parameters),
                        ("buffer", torch.nn.Module.named_buffers)):
        for mi, module in enumerate(models):
            for local, tensor in named(module, remove_duplicate=False):
                yield kind, f"m{mi}.{local}" if qualify else local, tensor


def _report_mismatch(records: Sequence[Any], index: int, kind: str, name: str) -> None:
    want = (f"{records[index]['kind']} {records[index]['name']!r}" if index < len(records)
            else "nothing more")
    raise PrecompileError(
        f"the runtime model does not match the captured one: at position {index} expected "
        f"{want}, got {kind} {name!r}. Pass a model with the same parameters and buffers, in "
        "the same order."
    )


def _interned(model: ModelPlan, members: Sequence[Any]) -> list[torch.Tensor]:
    """One tensor per record not tied to an earlier one; ties must be as at capture."""
    tensors: list[torch.Tensor] = []
    first_name: dict[int, str] = {}
    for record, (kind, name, tensor) in zip(model.records, members, strict=True):
        owner = first_name.get(id(tensor))
        if record["tied_to"] is not None:
            if owner != record["tied_to"]:
                raise PrecompileError(
                    f"model {kind} {name!r} was tied to {record['tied_to']!r} at capture; at "
                    "runtime it is a separate tensor. Tie the weights as in the example model."
                )
            continue
        if owner is not None:
            raise PrecompileError(
                f"model {kind} {name!r} is tied to {owner!r} at runtime but was a separate "
                "tensor at capture. Use a model with the same weight tying."
            )
        _check_model_tensor(model, record, tensor)
        first_name[id(tensor)] = name
        tensors.append(tensor)
    return tensors


def _check_model_tensor(model: ModelPlan, record: Mapping[str, Any], tensor: torch.Tensor
                        ) -> None:
    what = f"model {record['kind']} {record['name']!r}"
    shape, dtype, device = torch.Size(record["shape"]), _dtype(record["dtype"]), record["device"]
    if tensor.shape != shape or tensor.dtype != dtype or tensor.device != torch.device(device):
        raise PrecompileError(
            f"{what}: expected shape {tuple(shape)}, dtype {dtype}, device {device}; got shape "
            f"{tuple(tensor.shape)}, dtype {tensor.dtype}, device {tensor.device}. Load a "
            "checkpoint of the same architecture."
        )
    if model.training and tensor.requires_grad != record["requires_grad"]:
        raise PrecompileError(_requires_grad_message(what, record["requires_grad"]))
    if record["strides"] is not None:
        check_layout(tensor, record["strides"], what)


def _checked_modes(model: ModelPlan, models: Sequence[torch.nn.Module]) -> list[Any]:
    """Every submodule in walk order; each must be in the training mode it was captured in."""
    qualify = len(models) > 1
    found = [(f"m{mi}.{name}" if qualify else name, module)
             for mi, root in enumerate(models)
             for name, module in root.named_modules(remove_duplicate=False)]
    names = [name for name, _ in found]
    if names != [name for name, _ in model.submodules]:
        added = sorted(set(names) - {name for name, _ in model.submodules})
        raise PrecompileError(
            "the runtime model's submodules differ from the captured model's"
            + (f" (new: {', '.join(repr(n or '<root>') for n in added[:5])})" if added else "")
            + ". Pass a model with the same modules as the example."
        )
    for (name, module), (_, training) in zip(found, model.submodules, strict=True):
        if module.training != training:
            shown = f"module {name!r}" if name else "the model"
            mode, fix = ("training", ".train()") if training else ("eval", ".eval()")
            raise PrecompileError(
                f"{shown} is in {'training' if module.training else 'eval'} mode, but "
                f"was captured in {mode} mode (dropout and BatchNorm behave differently). Call "
                f"{fix} on the model before calling the artifact, or precompile again in this "
                "mode."
            )
    return [module for _, module in found]


# Counts registrations of parameters, buffers and submodules anywhere in the process: while it
# stands still, no model a memo remembers can have a replaced, re-tied or added member.
_REGISTRATIONS = [0]
_HOOKED: list[bool] = []


def _count_registrations() -> None:
    if _HOOKED:
        return
    _HOOKED.append(True)

    def count(*_: Any) -> None:
        _REGISTRATIONS[0] += 1

    hooks = torch.nn.modules.module
    hooks.register_module_parameter_registration_hook(count)
    hooks.register_module_buffer_registration_hook(count)
    hooks.register_module_module_registration_hook(count)


def check_value_guards(plan: Plan, tensors: Sequence[torch.Tensor]) -> None:
    for (description, expected), tensor in zip(plan.value_guards, tensors, strict=True):
        value = tensor.item()
        if not _value_matches(expected, value):
            raise PrecompileError(
                f"this call left the path the artifact was captured on: {description} was "
                f"{_shown(expected)} at capture and is {value!r} now, so the result would be "
                "wrong and is withheld (mutations of inputs and buffers may already have "
                "happened). Capture with an example that takes this path, or keep fn from "
                "deciding on tensor values."
            )


def accumulate_grads(state: Sequence[torch.Tensor], indices: Sequence[int],
                     grads: Sequence[torch.Tensor]) -> None:
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


def _requires_grad_message(what: str, captured: bool) -> str:
    return (
        f"{what} has requires_grad={not captured}, but was captured with requires_grad="
        f"{captured}: which tensors get gradients from the backward inside fn is fixed at "
        "capture. Set it back, or precompile again."
    )


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


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


def _sketch(tree: Any) -> str:
    """A structure with tensors shown as ``Tensor``, for error messages."""

    class Shown:
        def __init__(self, leaf: Any) -> None:
            self.text = "Tensor" if isinstance(leaf, torch.Tensor) else repr(leaf)

        def __repr__(self) -> str:
            return self.text

    text = repr(pytree.tree_map(Shown, tree))
    return text if len(text) <= 300 else text[:297] + "..."


# Distributed artifacts: DTensors at the call, local tensors in the graph.


class DistributedPlan:
    """How a call's DTensors map onto the graph's local tensors, and the meshes they need.

    Built only for an artifact with meshes; DTensor is imported then and not before.
    """

    def __init__(self, spec: Mapping[str, Any]) -> None:
        from torch.distributed.tensor import DTensor

        self.dtensor = DTensor
        self.meshes = spec["meshes"]
        self.agreed = False  # whether a first call passed on every rank (see first_call)
        self.inputs = [(d, _placements(d)) for d in spec["distributed"] if d["role"] == "input"]
        self.by_input = {d["index"]: (d, placements) for d, placements in self.inputs}
        self.results = [(d, _placements(d)) for d in spec["distributed"] if d["role"] == "result"]


def call_distributed(plan: Plan, state: Sequence[Any], inputs: Sequence[Any]) -> list[Any]:
    """``call`` on the local tensors of the call's DTensors; gradients and results rewrapped."""
    flat = [*state, *inputs]
    if plan.distributed.agreed:
        meshes = unwrap_dtensors(plan.distributed, flat)
    else:
        meshes = first_call(plan.distributed, flat)
    outputs = plan.call(flat)
    grads = outputs[plan.num_results:plan.guards_start]
    results = outputs[:plan.num_results]
    rewrap_dtensors(plan.distributed, meshes, plan.grad_indices, grads, results)
    return [*results, *grads, *outputs[plan.guards_start:]]


def first_call(plan: DistributedPlan, flat: list[Any]) -> list[Any]:
    """``unwrap_dtensors``, then every rank of the mesh learns whether all ranks passed.

    A rank the artifact cannot serve raises ``PrecompileError``; the others would then wait
    for it in the graph's first collective. So on the first call the ranks agree first, and
    all of them raise.
    """
    mesh = next((t.device_mesh for t in flat if isinstance(t, plan.dtensor)), None)
    error: PrecompileError | None = None
    meshes: list[Any] = []
    try:
        meshes = unwrap_dtensors(plan, flat)
    except PrecompileError as e:
        error = e
    if mesh is None:  # no DTensor given at all: nothing to agree over
        if error is not None:
            raise error
        return meshes
    failed = torch.tensor([0 if error is None else 1], device=mesh.device_type)
    for dim in range(mesh.ndim):
        torch.distributed.all_reduce(failed, torch.distributed.ReduceOp.MAX,
                                     group=mesh.get_group(dim))
    if error is not None:
        raise error
    if failed.item():
        raise PrecompileError(
            "another rank of the device mesh refused this artifact at its first call (its own "
            "error says why), so no rank runs it: the graph's collectives would wait for that "
            "rank forever."
        )
    plan.agreed = True
    return meshes


def unwrap_dtensors(plan: DistributedPlan, flat: list[Any]) -> list[Any]:
    """Swap each DTensor in ``flat`` for its local tensor after checking its layout; returns the
    runtime mesh bound to each mesh record."""
    meshes: list[Any] = [None] * len(plan.meshes)
    for record, _ in plan.inputs:
        tensor, what = flat[record["index"]], record["name"]
        expected = (f"a DTensor of shape {tuple(record['shape'])} with placements "
                    f"{_listed(record['placements'])} on {_mesh_text(plan.meshes[record['mesh']])}")
        if not isinstance(tensor, plan.dtensor):
            raise PrecompileError(
                f"{what}: expected {expected}, got a plain tensor. Shard the model and inputs "
                "as at capture (parallelize_module, distribute_tensor)."
            )
        given = tuple(placement_text(p) for p in tensor.placements)
        if given != record["placements"] or tensor.shape != torch.Size(record["shape"]):
            raise PrecompileError(
                f"{what}: expected {expected}; got shape {tuple(tensor.shape)} with placements "
                f"{_listed(given)}. Shard it as at capture, or precompile again."
            )
        check_mesh(plan.meshes[record["mesh"]], tensor.device_mesh, what)
        local = tensor.to_local()
        if local.shape != torch.Size(record["local_shape"]):
            raise PrecompileError(
                f"{what}: this rank's shard has shape {tuple(local.shape)}; the artifact was "
                f"built for a shard of shape {tuple(record['local_shape'])} (uneven sharding "
                "gives ranks different shards). Precompile on every rank "
                "(compile_on_one_rank=False), or pick sizes that divide evenly."
            )
        if meshes[record["mesh"]] is None:
            meshes[record["mesh"]] = bind_mesh(plan, record["mesh"], tensor.device_mesh)
        if record["local_strides"] is not None:
            check_layout(local, record["local_strides"], f"{what} (its local shard)")
        flat[record["index"]] = local
    return meshes


def bind_mesh(plan: DistributedPlan, index: int, mesh: Any) -> Any:
    """Check this rank's place in a runtime mesh and bind the graph's group names to its
    groups (once per mesh, unless another mesh took the names meanwhile)."""
    record = plan.meshes[index]
    coordinate = tuple(mesh.get_coordinate() or ())
    if record["coordinate"] is not None and coordinate != tuple(record["coordinate"]):
        raise PrecompileError(
            f"this rank sits at coordinate {coordinate} of {_mesh_text(record)}, but the "
            f"artifact was built at coordinate {tuple(record['coordinate'])} and its graph "
            "depends on the rank (it takes this rank's slice of a replicated tensor). Load the "
            "artifact built on this rank, or precompile on every rank."
        )
    if _BOUND_MESHES.get(record["groups"]) is not mesh:
        bind_groups(mesh, record["groups"])
    return mesh


def check_mesh(record: Mapping[str, Any], mesh: Any, what: str) -> None:
    """A runtime mesh must have the recorded device type, shape and dim names.

    Its ranks may differ: the sub-mesh ``mesh["tp"]`` of another data-parallel replica serves.
    """
    if (mesh.device_type, tuple(mesh.shape), mesh.mesh_dim_names) != (
            record["device_type"], tuple(record["shape"]), record["dim_names"]):
        given = {"device_type": mesh.device_type, "shape": tuple(mesh.shape),
                 "dim_names": mesh.mesh_dim_names, "ranks": mesh.mesh.flatten().tolist()}
        raise PrecompileError(
            f"{what} lives on {_mesh_text(given)}; the artifact was captured on "
            f"{_mesh_text(record)}. Initialize that mesh (torch.distributed.init_process_group, "
            f"then init_device_mesh({record['device_type']!r}, {tuple(record['shape'])}"
            + (f", mesh_dim_names={tuple(record['dim_names'])}" if record["dim_names"] else "")
            + ")), or precompile again for this one."
        )


# Group names -> the mesh whose groups they resolve to in this process now.
_BOUND_MESHES: dict[tuple[str, ...], Any] = {}


def bind_groups(mesh: Any, names: Sequence[str]) -> None:
    """Make ``names[d]`` resolve to ``mesh``'s process group for dim ``d`` in this process."""
    registry = torch._C._distributed_c10d
    for dim, name in enumerate(names):
        group = mesh.get_group(dim)
        with contextlib.suppress(Exception):  # not bound yet in this process
            registry._unregister_process_group(name)
        registry._register_process_group(name, group)
    _BOUND_MESHES[tuple(names)] = mesh


def rewrap_dtensors(plan: DistributedPlan, meshes: Sequence[Any], grad_indices: Sequence[int],
                    grads: list[Any], results: list[Any]) -> None:
    """Turn local gradients and result leaves back into DTensors, in place."""
    for position, index in enumerate(grad_indices):
        entry = plan.by_input.get(index)
        if entry is not None:
            grads[position] = _dtensor(plan, meshes, entry, grads[position])
    for entry in plan.results:
        results[entry[0]["index"]] = _dtensor(plan, meshes, entry, results[entry[0]["index"]])


def _dtensor(plan: DistributedPlan, meshes: Sequence[Any], entry: Any, local: Any) -> Any:
    record, placements = entry
    return plan.dtensor.from_local(local, meshes[record["mesh"]], placements, run_check=False,
                                   shape=torch.Size(record["shape"]), stride=record["strides"])


def placement_text(placement: Any) -> str:
    """A DTensor placement as the spec writes it: ``Shard(0)``, ``Replicate()``,
    ``Partial(sum)``."""
    kind = type(placement).__name__
    if kind == "Shard":
        return f"Shard({placement.dim})"
    if kind == "Partial":
        return f"Partial({placement.reduce_op})"
    return f"{kind}()" if kind == "Replicate" else repr(placement)


def _placements(record: Mapping[str, Any]) -> tuple[Any, ...]:
    from torch.distributed.tensor import Partial, Replicate, Shard

    made = []
    for text in record["placements"]:
        kind, argument = text[:-1].split("(")
        made.append(Shard(int(argument)) if kind == "Shard"
                    else Partial(argument) if kind == "Partial" else Replicate())
    return tuple(made)


def _mesh_text(mesh: Mapping[str, Any]) -> str:
    names = f" named {tuple(mesh['dim_names'])}" if mesh["dim_names"] else ""
    return (f"a {mesh['device_type']} device mesh of shape {tuple(mesh['shape'])}{names} over "
            f"ranks {list(mesh['ranks'])}")


def _listed(placements: Sequence[str]) -> str:
    return "(" + ", ".join(placements) + ")"
