"""The driver every artifact holds: ``forward(*args)`` checks a call, then runs ``call``.

A call is checked in this order: the arguments, the structure of the inputs, each input,
each model, each optimizer. Then the graph runs, the value guards are compared, gradients
land on ``.grad`` and the result is rebuilt. Every broken rule raises ``PrecompileError``
naming the argument, what was captured and what was given. Beyond tensors, torch is touched for
``torch.utils._pytree`` (input and result structure) and ``torch._C._set_grad_enabled``
(cheaper than the context manager).
"""

from collections import namedtuple
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree


class PrecompileError(RuntimeError):
    """A precompile contract was broken: at capture, at load, or by a call to an artifact."""


# A call that passed the checks, as a plain tuple (cheapest per call): the model tensors,
# the input tensors and the optimizer inputs.
CheckedCall = tuple


class Driver:
    """``forward``: the captured computation over the artifact's spec and compiled graph.

    The artifact ends with ``forward = Driver(ARTIFACT_SPEC, call, ...)``, naming the optional
    parts its spec needs: ``values`` (nested inputs, Python values, value guards), ``memo``
    (remembers checked models), ``sizes`` (dynamic dims), ``distributed`` (DTensors),
    ``subclasses`` (other tensor subclasses), ``optimizers`` (optimizer arguments) and
    ``data_parallel`` (DistributedDataParallel models).
    """

    def __init__(self, literal: Mapping[str, Any], call: Callable[[list[Any]], list[Any]], *,
                 values: Any = None, memo: Any = None, sizes: Any = None,
                 distributed: Any = None, subclasses: Any = None,
                 optimizers: Any = None, data_parallel: Any = None) -> None:
        spec = self.spec = read_spec(literal)
        self.arity = len(spec.args)
        self.arg_names = [a.name for a in spec.args]
        self.model_positions = [i for i, a in enumerate(spec.args) if a.is_model]
        self.input_positions = [i for i, a in enumerate(spec.args)
                                if not a.is_model and not a.is_optimizer]
        self.arity_text = ", ".join(
            f"{a.name} ({'model' if a.is_model else 'optimizer' if a.is_optimizer else 'input'})"
            for a in spec.args
        ) or "no arguments"
        self.out_spec = pytree.treespec_loads(spec.out_spec)
        # A common shape of a call takes a shortcut: one tensor result.
        self.single_result = self.out_spec == pytree.tree_flatten(0)[1]
        training = any(t.gets_grad for t in spec.model)
        # Flat inputs a driver part unwraps; every other one must be a plain tensor.
        carried = {d.index for d in (*spec.distributed, *spec.wrapped) if d.role == "input"}
        self.leaves = [LeafPlan(leaf, training) for leaf in spec.inputs]
        num_model = len([t for t in spec.model if t.tied_to is None])
        for index, plan in enumerate(p for p in self.leaves if p.is_tensor):
            plan.subclass = num_model + index in carried
        self.model = ModelPlan(spec, [self.arg_names[i] for i in self.model_positions], training,
                               carried)
        self.grad_indices = [i for i, t in enumerate(self.model.interned) if t.gets_grad]
        self.value_guards = [(g.description, g.expected) for g in spec.value_guards]
        self.num_results = self.out_spec.num_leaves
        self.guards_start = self.num_results + len(self.grad_indices)
        self.values = values(self) if values is not None else None
        self.memo = memo(self.model) if memo is not None else None
        # Positional tensors of static shapes: a layout check the memo can remember.
        self.plain_inputs = values is None and sizes is None and all(
            p.is_tensor and p.static and not p.subclass for p in self.leaves)
        self.sizes = sizes(spec) if sizes is not None else None
        self.optimizers = optimizers(self) if optimizers is not None else None
        self.data_parallel = data_parallel(self) if data_parallel is not None else None
        call = call if subclasses is None else subclasses(self, call)
        self.call = call if distributed is None else distributed(self, call)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the precompiled computation on ``args`` (the captured fn's positional
        arguments, models included)."""
        return self.run(args, self.checked(args, kwargs))

    def checked(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> CheckedCall:
        """Check a call without running anything. A failure's ``check_stage`` says how far
        the checks got, in call order: 0 arguments, 1 input structure, 2 inputs, 3 models,
        4 optimizers (``Variants`` names the variant that came nearest by it)."""
        stage = 0
        try:
            if kwargs or len(args) != self.arity:
                check_arguments(self, args, kwargs)
            stage = 1
            if self.values is None:  # the inputs are positional tensors
                leaves: Sequence[Any] = positional_leaves(self, args)
            else:
                leaves = self.values.input_leaves(args)
            stage = 2
            inputs = checked_inputs(self, leaves)
            stage = 3
            if self.data_parallel is not None:
                self.data_parallel.check(args)
            state = model_tensors(self, [args[i] for i in self.model_positions])
            stage = 4
            stepped = (() if self.optimizers is None
                       else self.optimizers.flat_inputs(args, state))
        except PrecompileError as error:
            error.check_stage = stage
            raise
        return state, inputs, stepped

    def run(self, args: Sequence[Any], checked: CheckedCall) -> Any:
        """Run the graph on a checked call, then put its gradients and results in place."""
        state, inputs, stepped = checked
        if self.data_parallel is not None:
            self.data_parallel.average_left_gradients(args, state)
        grad_enabled = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            outputs = self.call([*state, *inputs, *stepped])
            if self.value_guards:
                self.values.check_guards(outputs[self.guards_start:])
            if self.grad_indices:
                accumulate_grads(state, self.grad_indices,
                                 outputs[self.num_results:self.guards_start])
        finally:
            torch._C._set_grad_enabled(grad_enabled)
        if self.optimizers is not None:
            self.optimizers.stepped(args)
        if self.data_parallel is not None:
            self.data_parallel.finished(args)
        if self.single_result:
            return outputs[0]
        return pytree.tree_unflatten(outputs[:self.num_results], self.out_spec)


def check_arguments(driver: Driver, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    if kwargs:
        raise PrecompileError(
            f"keyword arguments {sorted(kwargs)} given; a precompiled artifact takes the same "
            f"positional arguments as the captured fn: {driver.arity_text}."
        )
    if len(args) != driver.arity:
        raise PrecompileError(
            f"expected {driver.arity} positional arguments ({driver.arity_text}), got "
            f"{len(args)}."
        )


def positional_leaves(driver: Driver, args: Sequence[Any]) -> list[Any]:
    """The inputs, when the captured ones were positional tensors; no nesting in their place."""
    leaves = [args[i] for i in driver.input_positions]
    if not all([isinstance(a, torch.Tensor) for a in leaves]) and (
            pytree.tree_flatten(leaves)[1] != pytree.tree_flatten(driver.leaves)[1]):
        expected = tuple(Shown(f"Tensor{p.shown}") for p in driver.leaves)
        raise structure_error(expected, tuple(leaves))
    return leaves


def structure_error(expected: Any, given: Any) -> PrecompileError:
    return PrecompileError(
        "the runtime inputs have a different structure than at capture: expected "
        f"{_sketch(expected)}, got {_sketch(given)}. Pass the same nesting of lists, tuples "
        "and dicts."
    )


class Shown:
    """A leaf of a structure sketch, shown as ``text``."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _sketch(tree: Any) -> str:
    """A structure with tensors shown as ``Tensor``, for error messages."""
    text = repr(pytree.tree_map(
        lambda v: Shown("Tensor") if isinstance(v, torch.Tensor) else v, tree))
    return text if len(text) <= 300 else text[:297] + "..."


class LeafPlan:
    """What a call must pass for one input leaf."""

    def __init__(self, leaf: Any, training: bool) -> None:
        self.name: str = leaf.path
        self.is_tensor = leaf.kind == "tensor"
        self.value = leaf.value
        shape = leaf.shape or ()
        self.static = None not in shape
        self.shape = torch.Size(shape) if self.static else tuple(shape)
        self.shown = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
        self.dtype = _dtype(leaf.dtype) if self.is_tensor else None
        self.device = torch.device(leaf.device) if self.is_tensor else None
        self.strides = leaf.strides
        self.bounds = leaf.bounds or {}
        self.subclass = False  # whether a driver part unwraps it (DTensor, other subclasses)
        # With a backward inside fn, requires_grad decides which gradients eager would produce.
        self.requires_grad = leaf.requires_grad if training else None


def checked_inputs(driver: Driver, leaves: Sequence[Any]) -> list[torch.Tensor]:
    """The tensor leaves, each checked against its plan (Python values by ``values``)."""
    remembers = driver.memo is not None and driver.plain_inputs
    if remembers and driver.memo.inputs_unchanged(leaves):
        return list(leaves)
    tensors = []
    for leaf_plan, leaf in zip(driver.leaves, leaves, strict=True):
        if leaf_plan.is_tensor:
            check_tensor_leaf(driver, leaf_plan, leaf)
            tensors.append(leaf)
        else:
            driver.values.check_value(leaf_plan, leaf)
    if driver.sizes is not None:
        driver.sizes.check_shared(driver.leaves, leaves)
    if remembers:
        driver.memo.remember_inputs(tensors)
    return tensors


def check_tensor_leaf(driver: Driver, plan: LeafPlan, leaf: Any) -> None:
    name = plan.name
    if not isinstance(leaf, torch.Tensor):
        raise PrecompileError(
            f"input {name}: expected a tensor of shape {plan.shown}, got {type(leaf).__name__}."
        )
    if not plan.static:
        driver.sizes.check_shape(plan, leaf)
    elif leaf.shape != plan.shape:
        raise PrecompileError(
            f"input {name}: expected shape {plan.shown}, got {tuple(leaf.shape)}. Shapes are "
            "specialized to the example; precompile again for this shape."
        )
    if leaf.dtype != plan.dtype:
        raise PrecompileError(f"input {name}: expected dtype {plan.dtype}, got {leaf.dtype}.")
    if type(leaf) not in PLAIN and not plan.subclass:
        raise subclass_error(f"input {name}", leaf)
    if leaf.device != plan.device:
        raise PrecompileError(f"input {name}: expected device {plan.device}, got {leaf.device}.")
    if plan.requires_grad is not None and leaf.requires_grad != plan.requires_grad:
        raise PrecompileError(_requires_grad_message(f"input {name}", plan.requires_grad))
    if isinstance(plan.strides, str):  # an input with dynamic dims: its memory format
        driver.sizes.check_memory_format(leaf, plan.strides, f"input {name}")
    elif plan.strides is not None:
        check_layout(leaf, plan.strides, f"input {name}")


PLAIN = (torch.Tensor, torch.nn.Parameter)


def subclass_error(what: str, tensor: torch.Tensor) -> PrecompileError:
    """A tensor subclass where the artifact was captured with a plain tensor: the kernels
    would read its wrapper as if it held the data."""
    return PrecompileError(
        f"{what} is a {type(tensor).__module__}.{type(tensor).__qualname__}, but was a plain "
        "tensor at capture. Pass a plain tensor (the checkpoint unquantized, as at capture), "
        "or precompile again with this one."
    )


def check_layout(tensor: torch.Tensor, strides: Sequence[int], name: str) -> None:
    """The compiled kernels assume a layout; anything else is refused before they run."""
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
    """The captured models' structure: what the full walk over a call's models compares."""

    def __init__(self, spec: Any, model_names: Sequence[str], training: bool,
                 carried: set[int]) -> None:
        self.names = list(model_names)
        self.records = spec.model
        self.interned = [t for t in self.records if t.tied_to is None]
        self.carried = {self.interned[i].name for i in carried if i < len(self.interned)}
        self.training = training
        self.submodules = [(s.name, s.training) for s in spec.submodules]


def model_tensors(driver: Driver, models: Sequence[Any]) -> Sequence[torch.Tensor]:
    """The models' tensors in flat-input order, after checking them against the capture."""
    memo = driver.memo
    if memo is not None:
        remembered = memo.lookup(models)
        if remembered is not None:
            return remembered
    walked = walk_models(driver.model, models)
    if memo is not None:
        memo.remember(models, walked)
    return list(walked.tensors)


WalkedModels = namedtuple("WalkedModels", ["tensors", "submodules"])
"""What the full walk found: flat tensors, and every submodule in walk order."""


def walk_models(model: ModelPlan, models: Sequence[Any]) -> WalkedModels:
    """Walk the models as capture did, naming the first difference."""
    for name, module in zip(model.names, models, strict=True):
        if not isinstance(module, torch.nn.Module):
            raise PrecompileError(
                f"argument {name} was a torch.nn.Module at capture; got "
                f"{type(module).__name__}. Pass the model in the same position."
            )
    members = list(_members(models))
    records = model.records
    for index, (kind, name, _) in enumerate(members):
        if index >= len(records) or (records[index].kind, records[index].name) != (kind, name):
            _report_mismatch(model, index, kind, name)
    if len(members) < len(records):
        missing = [f"{t.kind} {t.name!r}" for t in records[len(members):]]
        raise PrecompileError(
            f"the runtime model lacks {', '.join(missing[:5])}"
            f"{' and more' if len(missing) > 5 else ''}, which the captured model had. Pass a "
            "model with the same parameters and buffers."
        )
    return WalkedModels(_interned(model, members), _checked_modes(model, models))


def _members(models: Sequence[torch.nn.Module]) -> Any:
    qualify = len(models) > 1
    for kind, named in (("parameter", torch.nn.Module.named_parameters),
                        ("buffer", torch.nn.Module.named_buffers)):
        for mi, module in enumerate(models):
            for local, tensor in named(module, remove_duplicate=False):
                yield kind, f"m{mi}.{local}" if qualify else local, tensor


def _report_mismatch(model: ModelPlan, index: int, kind: str, name: str) -> None:
    """Name the model argument whose walk first differs, and the member it has instead."""
    records = model.records
    argument, local = _owner(model, name)
    if index < len(records):
        expected = _owner(model, records[index].name)
        where = (f"where the captured model {expected[0]} has {records[index].kind} "
                 f"{expected[1]!r}, the runtime model has {kind} {local!r}"
                 + (f" (of argument {argument})" if argument != expected[0] else ""))
    else:
        where = f"it has {kind} {local!r} beyond the captured model's parameters and buffers"
    raise PrecompileError(
        f"model argument {argument} does not match the captured model: {where}. Pass a model "
        "with the same parameters and buffers, in the same order."
    )


def _owner(model: ModelPlan, name: str) -> tuple[str, str]:
    """(argument name, name within that model) of a walk name (``m1.fc.weight`` with several
    models)."""
    if len(model.names) == 1:
        return model.names[0], name
    head, _, local = name.partition(".")
    return model.names[int(head[1:])], local


def _interned(model: ModelPlan, members: Sequence[Any]) -> list[torch.Tensor]:
    """One tensor per record not tied to an earlier one; ties must be as at capture."""
    tensors: list[torch.Tensor] = []
    first_name: dict[int, str] = {}
    for record, (kind, name, tensor) in zip(model.records, members, strict=True):
        owner = first_name.get(id(tensor))
        if record.tied_to is not None:
            if owner != record.tied_to:
                raise PrecompileError(
                    f"model {kind} {name!r} was tied to {record.tied_to!r} at capture; at "
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


def _check_model_tensor(model: ModelPlan, record: Any, tensor: torch.Tensor) -> None:
    what = f"model {record.kind} {record.name!r}"
    shape, dtype, device = torch.Size(record.shape), _dtype(record.dtype), record.device
    if tensor.shape != shape or tensor.dtype != dtype or tensor.device != torch.device(device):
        raise PrecompileError(
            f"{what}: expected shape {tuple(shape)}, dtype {dtype}, device {device}; got shape "
            f"{tuple(tensor.shape)}, dtype {tensor.dtype}, device {tensor.device}. Load a "
            "checkpoint of the same architecture."
        )
    if model.training and tensor.requires_grad != record.requires_grad:
        raise PrecompileError(_requires_grad_message(what, record.requires_grad))
    if type(tensor) not in PLAIN and record.name not in model.carried:
        raise subclass_error(what, tensor)
    if record.strides is not None:
        check_layout(tensor, record.strides, what)


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


# How the driver reads ARTIFACT_SPEC: each record becomes a named tuple with exactly these
# fields, so a field the driver names that the spec lacks fails at once (and a test holds
# this table equal to the records of torch_precompile.spec).
SPEC_RECORDS: dict[str, tuple[str, ...]] = {
    "ArtifactSpec": ("schema_version", "backend", "torch", "args", "model", "submodules",
                     "inputs", "in_spec", "out_spec", "value_guards", "dynamic_dims",
                     "size_relations", "output_aliases", "meshes", "distributed", "kernels",
                     "optimizers", "param_groups", "optimizer_state", "wrapped",
                     "wrapped_inner", "data_parallel", "fully_sharded", "variants"),
    "TorchBuild": ("version", "git"),
    "Argument": ("name", "is_model", "is_optimizer"),
    "ModelTensor": ("name", "kind", "tied_to", "shape", "dtype", "device", "strides",
                    "requires_grad", "gets_grad"),
    "Submodule": ("name", "training"),
    "InputLeaf": ("path", "kind", "shape", "dtype", "device", "strides", "requires_grad",
                  "bounds", "value"),
    "ValueGuard": ("description", "expected"),
    "DynamicDim": ("shape_id", "places"),
    "SizeRelation": ("expr", "readable"),
    "OutputAlias": ("output", "source", "size", "stride", "offset"),
    "Mesh": ("device_type", "shape", "dim_names", "ranks", "groups", "coordinate"),
    "DistributedTensor": ("role", "index", "name", "mesh", "placements", "shape", "strides",
                          "local_shape", "local_strides"),
    "KernelObject": ("key", "sha256"),
    "Optimizer": ("argument", "cls", "zero_grad_first"),
    "ParamGroup": ("optimizer", "params", "call_time", "baked", "fresh_start"),
    "OptimizerState": ("optimizer", "param", "key", "shape", "dtype", "device", "strides"),
    "WrappedTensor": ("role", "index", "name", "cls", "context", "shape", "strides"),
    "InnerTensor": ("wrapper", "attr", "shape", "dtype", "device", "strides"),
    "DataParallel": ("argument", "model", "group", "world_size", "sync_grads", "forward_sync"),
    "FullyShardedGroup": ("model", "module", "reshard_after_forward", "param_dtype",
                          "reduce_dtype", "divide_factor"),
}
# Which record each list (or, for "torch", the one record) of the spec holds.
SPEC_LISTS: dict[str, str] = {
    "torch": "TorchBuild", "args": "Argument", "model": "ModelTensor",
    "submodules": "Submodule", "inputs": "InputLeaf", "value_guards": "ValueGuard",
    "dynamic_dims": "DynamicDim", "size_relations": "SizeRelation",
    "output_aliases": "OutputAlias", "meshes": "Mesh", "distributed": "DistributedTensor",
    "kernels": "KernelObject", "optimizers": "Optimizer", "param_groups": "ParamGroup",
    "optimizer_state": "OptimizerState", "wrapped": "WrappedTensor",
    "wrapped_inner": "InnerTensor", "data_parallel": "DataParallel",
    "fully_sharded": "FullyShardedGroup",
}
_RECORD_TYPES = {name: namedtuple(name, fields) for name, fields in SPEC_RECORDS.items()}


def read_spec(literal: Mapping[str, Any]) -> Any:
    """``ARTIFACT_SPEC`` as named tuples (``spec.model[0].shape``); ``variants`` stays as
    the literal holds it (``Variants`` reads it)."""
    fields = {"variants": (), **literal}
    for name, record in SPEC_LISTS.items():
        make = _RECORD_TYPES[record]
        value = fields[name]
        fields[name] = make(**value) if name == "torch" else tuple(make(**v) for v in value)
    return _RECORD_TYPES["ArtifactSpec"](**fields)
