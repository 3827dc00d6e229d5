"""The driver every artifact holds: ``forward(*args)`` checks a call, then runs ``call``.

A call is checked in this order: the state it is made in (autocast, default dtype,
deterministic algorithms, modes, grad mode), the arguments, the structure of the inputs, each
input, each model (its classes, modes, forwards, hooks and the values the trace read off it),
the globals the trace read, each optimizer. Then the graph runs, the value guards are compared
(what the graph wrote is put back if one differs), gradients land on ``.grad`` and the result
is rebuilt. Every broken rule raises ``PrecompileError`` naming what was captured and what
was given. Beyond tensors, torch is touched for ``torch.utils._pytree`` (input and result
structure), ``torch._C._set_grad_enabled`` (cheaper than the context manager) and the few
``torch._C`` reads of the state a call is made in (``AmbientPlan``).
"""

import functools
from collections import namedtuple
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from torch_precompile.shipped.driver.records import SPEC_DEFAULTS, SPEC_LISTS, SPEC_RECORDS


class PrecompileError(RuntimeError):
    """A precompile contract was broken: at capture, at load, or by a call to an artifact."""

    check_stage: int  # set by a call's checks: how far they got (see Driver.checked)


# A call that passed the checks, as a plain tuple (cheapest per call): the model tensors,
# the input tensors and the optimizer inputs.
CheckedCall = tuple[Any, ...]


class Driver:
    """``forward``: the captured computation over the artifact's spec and compiled graph.

    The artifact ends with ``forward = Driver(ARTIFACT_SPEC, call, ...)``, naming the optional
    parts its spec needs: ``values`` (nested inputs, Python values, value guards), ``memo``
    (remembers checked models), ``sizes`` (dynamic dims), ``distributed`` (DTensors),
    ``subclasses`` (other tensor subclasses), ``optimizers`` (optimizer arguments) and
    ``data_parallel`` (DistributedDataParallel models), ``hooks`` (where the capture had
    hooks: ``hook_values``, what each holds) and ``autograd`` (where fn runs no backward:
    ``NoHistory``, or ``differentiable`` for results with history).
    """

    def __init__(
        self,
        literal: Mapping[str, Any],
        call: Callable[[list[Any]], list[Any]],
        checks: Callable[["Driver", Sequence[Any], Mapping[str, Any]], CheckedCall],
        *,
        values: Any = None,
        memo: Any = None,
        sizes: Any = None,
        distributed: Any = None,
        subclasses: Any = None,
        optimizers: Any = None,
        data_parallel: Any = None,
        facts: Any = None,
        hooks: Any = None,
        autograd: Any = None,
    ) -> None:
        spec = self.spec = read_spec(literal)
        self.checks = checks
        self.arity = len(spec.args)
        self.arg_names = [a.name for a in spec.args]
        self.model_positions = [i for i, a in enumerate(spec.args) if a.is_model]
        self.input_positions = [
            i for i, a in enumerate(spec.args) if not a.is_model and not a.is_optimizer
        ]
        self.arity_text = (
            ", ".join(f"{a.name} ({_argument_kind(a)})" for a in spec.args) or "no arguments"
        )
        self.out_spec = pytree.treespec_loads(spec.out_spec)
        # A common shape of a call takes a shortcut: one tensor result.
        self.single_result = self.out_spec == pytree.tree_flatten(0)[1]
        # A backward ran inside fn: gradients come out, or an optimizer inside fn took them.
        training = any(t.gets_grad for t in spec.model) or bool(spec.optimizers)
        # Flat inputs a driver part unwraps; every other one must be a plain tensor.
        carried = {d.index for d in (*spec.distributed, *spec.wrapped) if d.role == "input"}
        self.leaves = [LeafPlan(leaf, training) for leaf in spec.inputs]
        num_model = len([t for t in spec.model if t.tied_to is None])
        # The eager graph runs on any layout but its views' own: an input it neither writes
        # nor returns a view of is copied into the example's layout where a call differs.
        viewed = {*spec.mutated, *(a.source for a in spec.output_aliases)}
        for index, plan in enumerate(p for p in self.leaves if p.is_tensor):
            plan.subclass = num_model + index in carried
            plan.relayout = spec.backend == "eager" and num_model + index not in viewed
        self.model = ModelPlan(
            spec, [self.arg_names[i] for i in self.model_positions], training, carried
        )
        self.grad_indices = [i for i, t in enumerate(self.model.interned) if t.gets_grad]
        self.value_guards = [(g.description, g.expected) for g in spec.value_guards]
        self.num_results = self.out_spec.num_leaves
        self.guards_start = self.num_results + len(self.grad_indices)
        # The flat inputs the graph writes, and the buffers and inputs they must not share
        # memory with (the graph takes them as separate tensors).
        self.mutated = set(spec.mutated)
        first_buffer = len([t for t in self.model.interned if t.kind == "parameter"])
        end = len(self.model.interned) + sum(p.is_tensor for p in self.leaves)
        self.separate = (
            sorted(i for i in self.mutated | set(range(first_buffer, end)) if i < end)
            if self.mutated & set(range(first_buffer, end))
            else []
        )
        self.rollback = sorted(self.mutated) if self.value_guards else []
        self.seed = spec.seed  # set inside fn before its first random draw
        # Optional parts: Any, since each is a class of another shipped module.
        self.values: Any = values(self) if values is not None else None
        self.ambient = AmbientPlan(spec.ambient)
        self.facts: Any = facts(self) if facts is not None else None
        self.model.facts = self.facts
        if hooks is not None:
            self.model.hook_values = hooks
        self.memo: Any = memo(self.model) if memo is not None else None
        # Positional tensors of static shapes: a layout check the memo can remember.
        self.plain_inputs = (
            values is None
            and sizes is None
            and all(p.is_tensor and p.static and not p.subclass for p in self.leaves)
        )
        self.sizes: Any = sizes(spec) if sizes is not None else None
        self.optimizers: Any = optimizers(self) if optimizers is not None else None
        self.data_parallel: Any = data_parallel(self) if data_parallel is not None else None
        call = call if subclasses is None else subclasses(self, call)
        self.call = call if distributed is None else distributed(self, call)
        self.autograd: Any = autograd(self) if autograd is not None else None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the precompiled computation on ``args`` (the captured fn's positional
        arguments, models included)."""
        return self.run(args, self.checked(args, kwargs))

    def checked(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> CheckedCall:
        """Check a call without running anything: the artifact's generated check function,
        which runs only the checks its spec needs. A failure's ``check_stage`` says how far
        they got, in call order: 0 the state and the arguments, 1 input structure, 2 inputs,
        3 models (and the globals the trace read), 4 optimizers (``Variants`` names the
        variant that came nearest by it)."""
        return self.checks(self, args, kwargs)

    def flat_name(self, index: int) -> str:
        """How flat input ``index`` (a model tensor or an input tensor) is named."""
        interned = self.model.interned
        if index < len(interned):
            return f"model {interned[index].kind} {interned[index].name!r}"
        tensors = [p for p in self.leaves if p.is_tensor]
        return f"input {tensors[index - len(interned)].name}"

    def run(self, args: Sequence[Any], checked: CheckedCall) -> Any:
        """Run the graph on a checked call, then put its gradients and results in place."""
        state, inputs, stepped = checked
        flat = [*state, *inputs, *stepped]
        grad_enabled = torch.is_grad_enabled()
        # Results get history where eager's would: under grad mode, from inputs requiring it.
        with_history = grad_enabled and self.autograd is not None and self.autograd.wanted(flat)
        if self.separate:  # before anything is written, the averaged gradients included
            check_separate_writes(self, flat)
        if self.data_parallel is not None:
            self.data_parallel.average_left_gradients(args, state)
        torch._C._set_grad_enabled(with_history)
        try:
            # Value guards are read after the graph ran: keep what it writes, to undo it.
            kept = [(flat[i], flat[i].clone()) for i in self.rollback] if self.rollback else ()
            if self.seed is not None:
                torch.manual_seed(self.seed)
            outputs = self.autograd(flat) if with_history else self.call(flat)
            if self.value_guards:
                self.values.check_guards(outputs[self.guards_start :], kept)
            if self.grad_indices:
                accumulate_grads(
                    state, self.grad_indices, outputs[self.num_results : self.guards_start]
                )
        finally:
            torch._C._set_grad_enabled(grad_enabled)
        if self.optimizers is not None:
            self.optimizers.stepped(args)
        if self.data_parallel is not None:
            self.data_parallel.finished(args)
        if self.single_result:
            return outputs[0]
        return pytree.tree_unflatten(outputs[: self.num_results], self.out_spec)


def check_separate_writes(driver: Driver, flat: Sequence[torch.Tensor]) -> None:
    """Refuse a call where a tensor the graph writes shares memory with another input."""
    owner: dict[int, int] = {}
    for index in driver.separate:
        tensor = flat[index]
        if not tensor.numel():
            continue
        other = owner.setdefault(tensor.untyped_storage().data_ptr(), index)
        if other != index and (index in driver.mutated or other in driver.mutated):
            written, alias = (index, other) if index in driver.mutated else (other, index)
            raise PrecompileError(
                f"{driver.flat_name(written)} shares memory with {driver.flat_name(alias)} at "
                "this call, and the artifact writes the first in place: eager fn would see the "
                "write through the other, the graph (which takes them as separate tensors) "
                "would not. Pass separate tensors (x.clone())."
            )


def check_arguments(driver: Driver, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    if kwargs:
        raise PrecompileError(
            f"keyword arguments {sorted(kwargs)} given; a precompiled artifact takes the same "
            f"positional arguments as the captured fn: {driver.arity_text}."
        )
    if len(args) != driver.arity:
        raise PrecompileError(
            f"expected {driver.arity} positional arguments ({driver.arity_text}), got {len(args)}."
        )


def positional_leaves(driver: Driver, args: Sequence[Any]) -> list[Any]:
    """The inputs, when the captured ones were positional tensors; no nesting in their place."""
    leaves = [args[i] for i in driver.input_positions]
    if not all([isinstance(a, torch.Tensor) for a in leaves]) and (
        pytree.tree_flatten(leaves)[1] != pytree.tree_flatten(driver.leaves)[1]
    ):
        expected = tuple(Shown(f"Tensor{p.shown}") for p in driver.leaves)
        raise structure_error(expected, tuple(leaves))
    return leaves


def structure_error(expected: Any, given: Any) -> PrecompileError:
    return PrecompileError(
        "the runtime inputs have a different structure than at capture: expected "
        f"{sketch(expected)}, got {sketch(given)}. Pass the same nesting of lists, tuples "
        "and dicts."
    )


class Shown:
    """A leaf of a structure sketch, shown as ``text``."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def sketch(tree: Any) -> str:
    """A structure with tensors shown as ``Tensor``, for error messages."""
    text = repr(
        pytree.tree_map(lambda v: Shown("Tensor") if isinstance(v, torch.Tensor) else v, tree)
    )
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
        self.relayout = False  # whether a call's other layout is copied into ``strides``
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
            tensors.append(check_tensor_leaf(driver, leaf_plan, leaf))
        else:
            driver.values.check_value(leaf_plan, leaf)
    if driver.sizes is not None:
        driver.sizes.check_shared(driver.leaves, leaves)
    if remembers:
        driver.memo.remember_inputs(tensors)
    return tensors


def check_tensor_leaf(driver: Driver, plan: LeafPlan, leaf: Any) -> torch.Tensor:
    """The tensor the graph gets for one input leaf, after checking it."""
    name = plan.name
    if not isinstance(leaf, torch.Tensor):
        raise PrecompileError(
            f"input {name}: expected a tensor of shape {plan.shown}, got {type(leaf).__name__}."
        )
    if leaf.is_nested:  # it has no shape to compare
        raise dense_error(f"input {name}", leaf)
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
    if leaf.layout is not torch.strided:
        raise dense_error(f"input {name}", leaf)
    if plan.requires_grad is not None and leaf.requires_grad != plan.requires_grad:
        raise PrecompileError(_requires_grad_message(f"input {name}", plan.requires_grad))
    if isinstance(plan.strides, str):  # an input with dynamic dims: its memory format
        driver.sizes.check_memory_format(leaf, plan.strides, f"input {name}")
    elif plan.strides is not None:
        if plan.relayout and layout_differs(leaf, plan.strides):
            return torch.empty_strided(
                leaf.shape, plan.strides, dtype=leaf.dtype, device=leaf.device
            ).copy_(leaf)
        check_layout(leaf, plan.strides, f"input {name}", driver.spec.backend)
    return leaf


def _argument_kind(arg: Any) -> str:
    return "model" if arg.is_model else "optimizer" if arg.is_optimizer else "input"


PLAIN = (torch.Tensor, torch.nn.Parameter)


def subclass_error(what: str, tensor: torch.Tensor) -> PrecompileError:
    """A tensor subclass where the artifact was captured with a plain tensor: the kernels
    would read its wrapper as if it held the data."""
    kind = f"{type(tensor).__module__}.{type(tensor).__qualname__}"
    if kind == "torch.distributed.tensor.DTensor":
        fix = (
            "A module the artifact runs was sharded after capture (fully_shard, say): its "
            "hooks never run inside the artifact. Shard the precompiled module as a whole "
            "(fully_shard(wrapped)), or precompile the sharded model."
        )
    else:
        fix = (
            "Pass a plain tensor (the checkpoint unquantized, as at capture), or precompile "
            "again with this one."
        )
    return PrecompileError(f"{what} is a {kind}, but was a plain tensor at capture. {fix}")


def dense_error(what: str, tensor: torch.Tensor) -> PrecompileError:
    """A sparse, nested (or other non-strided) tensor where the capture had a dense one."""
    nested = tensor.is_nested
    kind = "nested" if nested else tensor.layout
    fix = ".to_padded_tensor(0.0)" if nested else ".to_dense()"
    return PrecompileError(
        f"{what}: the graph reads a dense tensor, got a {kind} one. Pass it dense ({fix})."
    )


def layout_differs(tensor: torch.Tensor, strides: Sequence[int]) -> bool:
    # Strides of dims of size 0 or 1 never matter, as in Inductor's own assert.
    return bool(tensor.numel()) and any(
        size > 1 and got != want
        for size, got, want in zip(tensor.shape, tensor.stride(), strides, strict=True)
    )


def check_layout(
    tensor: torch.Tensor, strides: Sequence[int], name: str, backend: str = "inductor"
) -> None:
    """The graph assumes a layout; anything else is refused before it runs."""
    if tensor.layout is not torch.strided:
        raise dense_error(name, tensor)
    if not layout_differs(tensor, strides):
        return
    if backend == "eager":  # an input the graph writes, or returns a view of
        raise PrecompileError(
            f"{name}: the graph writes this input or returns a view of it, and its views were "
            f"traced on strides {tuple(strides)} (the example's layout); got "
            f"{tuple(tensor.stride())}. Pass it in the example's layout (.contiguous() for a "
            "contiguous example)."
        )
    raise PrecompileError(
        f"{name}: the compiled kernels assume strides {tuple(strides)} (the example's "
        f"layout), got {tuple(tensor.stride())}. Pass it in the example's layout "
        "(.contiguous() for a contiguous example), or precompile with backend='eager', "
        "which takes any layout."
    )


class ModelPlan:
    """The captured models' structure: what the full walk over a call's models compares."""

    def __init__(
        self, spec: Any, model_names: Sequence[str], training: bool, carried: set[int]
    ) -> None:
        self.names = list(model_names)
        self.records = spec.model
        self.interned = [t for t in self.records if t.tied_to is None]
        self.carried = {self.interned[i].name for i in carried if i < len(self.interned)}
        self.training = training
        self.submodules = [(s.name, s.training) for s in spec.submodules]
        self.classes = [s.cls for s in spec.submodules]
        self.forwards = [s.forward for s in spec.submodules]
        self.hooks = [s.hooks for s in spec.submodules]
        self.global_hooks = spec.global_hooks
        # Tensor hooks on parameters run in a backward: they matter where fn has one.
        self.parameter_hooks = [(t.name, t.hooks) for t in self.interned] if training else []
        self.facts: Any = None  # the driver's PythonFacts, where the spec has read values
        self.hook_values: Callable[[Any], Any] = no_values  # HookValues' where hooks were


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
        missing = [f"{t.kind} {t.name!r}" for t in records[len(members) :]]
        raise PrecompileError(
            f"the runtime model lacks {', '.join(missing[:5])}"
            f"{' and more' if len(missing) > 5 else ''}, which the captured model had. Pass a "
            "model with the same parameters and buffers."
        )
    walked = WalkedModels(_interned(model, members), _checked_modes(model, models))
    check_hooks(model, walked)
    if model.facts is not None:
        model.facts.check_modules(walked.submodules)
    return walked


def _members(models: Sequence[torch.nn.Module]) -> Any:
    qualify = len(models) > 1
    for kind, named in (
        ("parameter", torch.nn.Module.named_parameters),
        ("buffer", torch.nn.Module.named_buffers),
    ):
        for mi, module in enumerate(models):
            for local, tensor in named(module, remove_duplicate=False):
                yield kind, f"m{mi}.{local}" if qualify else local, tensor


def _report_mismatch(model: ModelPlan, index: int, kind: str, name: str) -> None:
    """Name the model argument whose walk first differs, and the member it has instead."""
    records = model.records
    argument, local = _owner(model, name)
    if index < len(records):
        expected = _owner(model, records[index].name)
        where = (
            f"where the captured model {expected[0]} has {records[index].kind} "
            f"{expected[1]!r}, the runtime model has {kind} {local!r}"
            + (f" (of argument {argument})" if argument != expected[0] else "")
        )
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
    if tensor.layout is not torch.strided:
        raise dense_error(what, tensor)
    if record.strides is not None:
        check_layout(tensor, record.strides, what)


def _checked_modes(model: ModelPlan, models: Sequence[torch.nn.Module]) -> list[Any]:
    """Every submodule in walk order; each must be in the training mode it was captured in."""
    qualify = len(models) > 1
    found = [
        (f"m{mi}.{name}" if qualify else name, module)
        for mi, root in enumerate(models)
        for name, module in root.named_modules(remove_duplicate=False)
    ]
    names = [name for name, _ in found]
    if names != [name for name, _ in model.submodules]:
        added = sorted(set(names) - {name for name, _ in model.submodules})
        raise PrecompileError(
            "the runtime model's submodules differ from the captured model's"
            + (f" (new: {', '.join(repr(n or '<root>') for n in added[:5])})" if added else "")
            + ". Pass a model with the same modules as the example."
        )
    for (name, module), (_, training), cls, forward in zip(
        found, model.submodules, model.classes, model.forwards, strict=True
    ):
        if cls is not None and qualified_name(type(module)) != cls:
            raise PrecompileError(
                f"{_shown_module(name)} is a {qualified_name(type(module))}, but was a {cls} at "
                "capture: the artifact runs the code the captured class ran. Pass a model "
                "built like the example, or precompile again with this one."
            )
        if cls is not None and forward_name(module) != forward:
            raise forward_error(_shown_module(name), forward, forward_name(module))
        if module.training != training:
            shown = _shown_module(name)
            mode, fix = ("training", ".train()") if training else ("eval", ".eval()")
            raise PrecompileError(
                f"{shown} is in {'training' if module.training else 'eval'} mode, but "
                f"was captured in {mode} mode (dropout and BatchNorm behave differently). Call "
                f"{fix} on the model before calling the artifact, or precompile again in this "
                "mode."
            )
    return [module for _, module in found]


def _shown_module(name: str) -> str:
    return f"module {name!r}" if name else "the model"


def qualified_name(obj: Any) -> str:
    """``module.qualname`` of a class or function (a hook's name in the spec)."""
    return f"{getattr(obj, '__module__', None)}.{getattr(obj, '__qualname__', '?')}"


def forward_name(module: Any) -> str | None:
    """None where ``module`` runs its class's own forward (as the class, or the base that
    defines it, wrote it); otherwise the name of what it runs instead: a forward set on the
    instance, or one patched into the class."""
    if "forward" in vars(module):
        return hook_name(vars(module)["forward"])
    for klass in type(module).__mro__:
        function = vars(klass).get("forward")
        if function is not None:
            own = klass is torch.nn.Module or (
                getattr(function, "__qualname__", None) == f"{klass.__qualname__}.forward"
                and getattr(function, "__module__", None) == klass.__module__
            )
            return None if own else hook_name(function)
    return None


def forward_error(what: str, captured: str | None, now: str | None) -> PrecompileError:
    def shown(name: str | None) -> str:
        return "its class's own forward" if name is None else f"the forward {name}"

    return PrecompileError(
        f"{what} runs {shown(now)}, but ran {shown(captured)} at capture: the artifact runs "
        "the code the captured forward ran. Set the forward back, or precompile again with "
        "this one."
    )


# Where nn.Module keeps hooks, by the kind the spec names them.
MODULE_HOOKS = (
    ("forward_pre", "_forward_pre_hooks"),
    ("forward", "_forward_hooks"),
    ("backward_pre", "_backward_pre_hooks"),
    ("backward", "_backward_hooks"),
)
GLOBAL_HOOKS = (
    ("forward_pre", "_global_forward_pre_hooks"),
    ("forward", "_global_forward_hooks"),
    ("backward_pre", "_global_backward_pre_hooks"),
    ("backward", "_global_backward_hooks"),
)
TENSOR_HOOKS = (
    ("grad", "_backward_hooks"),
    ("post_accumulate_grad", "_post_accumulate_grad_hooks"),
)


def hook_name(hook: Any) -> str:
    """A hook by the name of the code it runs (a bound method by its function, a partial by
    the function it wraps), the same in every process."""
    while isinstance(hook, functools.partial):
        hook = hook.func
    hook = getattr(hook, "__func__", hook)
    return qualified_name(hook if hasattr(hook, "__qualname__") else type(hook))


def no_values(hook: Any) -> list[tuple[str, str, Callable[[], Any]]]:
    """The values of hooks where the capture had none: any hook now is one too many."""
    return []


def hook_sets(
    owner: Any, places: Sequence[tuple[str, str]], values: Callable[[Any], Any] = no_values
) -> tuple[Any, ...]:
    """The hooks found on ``owner`` (a module, a tensor, or torch's module of global hooks)
    as (kind, hook labels) pairs, kinds without hooks left out: a hook by its name and the
    plain ``values`` it holds. torch.distributed's own hooks (FSDP2, distribute_module) are
    left to the parts that check sharding."""
    found = []
    for kind, attribute in places:
        hooks = getattr(owner, attribute, None)
        labels = tuple(
            hook_name(h) + "".join(f" {n}={v}" for n, v, _ in values(h))
            for h in (hooks or {}).values()
            if not hook_name(h).startswith(DISTRIBUTED_HOOKS)
        )
        if labels:
            found.append((kind, labels))
    return tuple(found)


DISTRIBUTED_HOOKS = "torch.distributed."


def check_hooks(model: ModelPlan, walked: WalkedModels) -> None:
    """Hooks run Python the artifact does not: they must be those the trace ran through."""
    for (name, _), captured, module in zip(
        model.submodules, model.hooks, walked.submodules, strict=True
    ):
        now = hook_sets(module, MODULE_HOOKS, model.hook_values)
        if now != captured:
            raise hooks_error(_shown_module(name), captured, now)
    now = hook_sets(torch.nn.modules.module, GLOBAL_HOOKS, model.hook_values)
    if now != model.global_hooks:
        raise hooks_error(
            "the process (global module hooks, as register_module_forward_hook adds)",
            model.global_hooks,
            now,
        )
    for (name, captured), tensor in zip(model.parameter_hooks, walked.tensors, strict=False):
        now = hook_sets(tensor, TENSOR_HOOKS, model.hook_values)
        if now != captured:
            raise hooks_error(f"model parameter {name!r}", captured, now)


def hooks_error(what: str, captured: Any, now: Any) -> PrecompileError:
    def shown(sets: Any) -> str:
        return "; ".join(f"{kind}: {', '.join(names)}" for kind, names in sets) or "none"

    return PrecompileError(
        f"{what} has hooks {shown(now)}, but had {shown(captured)} at capture (each hook "
        "with the plain values it holds). The artifact holds what the hooks present at "
        "capture computed with those values, so a hook added since would never run, one "
        "removed would still act and a changed value would not be seen. Register the same "
        "hooks, holding the same values, as at capture, or precompile again with the hooks "
        "you want."
    )


class AmbientPlan:
    """Thread and process state the graph was specialized to: autocast, the default dtype
    (where fn built tensors from it), deterministic algorithms and active modes."""

    def __init__(self, ambient: Any) -> None:
        self.recorded = ambient is not None
        self.autocast = tuple(ambient.autocast) if self.recorded else ()
        self.default_dtype = (
            _dtype(ambient.default_dtype) if self.recorded and ambient.default_dtype else None
        )
        self.deterministic = bool(self.recorded and ambient.deterministic)
        self.modes = tuple(ambient.modes) if self.recorded else ()

    def check(self) -> None:
        """A few C calls when nothing differs; the full comparison names what does."""
        if not self.recorded:
            return
        if (
            (_ANY_AUTOCAST() or self.autocast)
            or _DETERMINISTIC() is not self.deterministic
            or _FUNCTION_MODES() + _DISPATCH_MODES() != len(self.modes)
            or (
                self.default_dtype is not None
                and torch.get_default_dtype() is not self.default_dtype
            )
        ):
            self._compare()

    def _compare(self) -> None:
        now = ambient_now()
        for what, captured, current in (
            ("autocast", self.autocast, now[0]),
            ("the default dtype", self.default_dtype or now[1], now[1]),
            ("deterministic algorithms", self.deterministic, now[2]),
            ("active torch function and dispatch modes", self.modes, now[3]),
        ):
            if captured != current:
                raise PrecompileError(
                    f"{what} at this call: {_shown_state(current)}; at capture: "
                    f"{_shown_state(captured)}. The graph was traced under the capture's "
                    "state (autocast's casts, the dtype of tensors fn builds, the modes' "
                    "behaviour are in it), so this call would not compute what fn computes "
                    "now. Call it as at capture, or precompile again in this state."
                )


def ambient_now() -> tuple[Any, ...]:
    """(autocast per device type, default dtype, deterministic algorithms, modes) now."""
    autocast = tuple(
        (device, str(torch.get_autocast_dtype(device)).removeprefix("torch."))
        for device in ("cpu", "cuda")
        if torch.is_autocast_enabled(device)
    )
    modes = tuple(
        qualified_name(type(m))
        for m in (
            *torch.overrides._get_current_function_mode_stack(),
            *torch.utils._python_dispatch._get_current_dispatch_mode_stack(),
        )
    )
    return autocast, torch.get_default_dtype(), _DETERMINISTIC(), modes


def _shown_state(value: Any) -> str:
    if isinstance(value, tuple):
        return (
            ", ".join(" ".join(map(str, v)) if isinstance(v, tuple) else str(v) for v in value)
            or "none"
        )
    return str(value)


_ANY_AUTOCAST = torch._C._is_any_autocast_enabled
_DETERMINISTIC = torch._C._get_deterministic_algorithms
_FUNCTION_MODES = torch._C._len_torch_function_stack
_DISPATCH_MODES = torch._C._len_torch_dispatch_stack


def grad_mode_error() -> PrecompileError:
    return PrecompileError(
        "fn runs a backward, but this call is under torch.no_grad() (or inference_mode), "
        "where eager fn would fail: no gradient can flow. Call the artifact with gradients "
        "enabled."
    )


def accumulate_grads(
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


def _requires_grad_message(what: str, captured: bool) -> str:
    return (
        f"{what} has requires_grad={not captured}, but was captured with requires_grad="
        f"{captured}: which tensors get gradients from the backward inside fn is fixed at "
        "capture. Set it back, or precompile again."
    )


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


# Each record of ARTIFACT_SPEC becomes a named tuple with exactly the fields SPEC_RECORDS
# names (a table generated from the package's spec records), so a field the driver names that
# the spec lacks fails at once.
_RECORD_TYPES = {
    name: namedtuple(name, fields, defaults=SPEC_DEFAULTS.get(name, ()))
    for name, fields in SPEC_RECORDS.items()
}


def read_spec(literal: Mapping[str, Any]) -> Any:
    """``ARTIFACT_SPEC`` as named tuples (``spec.model[0].shape``); ``variants`` stays as
    the literal holds it (``Variants`` reads it)."""
    fields = dict(literal)
    for name, record in SPEC_LISTS.items():
        make = _RECORD_TYPES[record]
        if name not in fields:
            continue  # at its default
        value = fields[name]
        if name in ("torch", "ambient", "autograd"):  # one record, not a list
            fields[name] = None if value is None else make(**value)
        else:
            fields[name] = tuple(make(**v) for v in value)
    return _RECORD_TYPES["ArtifactSpec"](**fields)
