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

from collections import namedtuple
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from torch_precompile.shipped.driver.call_state import AmbientPlan
from torch_precompile.shipped.driver.module_rules import (
    GLOBAL_HOOKS,
    GLOBAL_HOOKS_OWNER,
    MODULE_HOOKS,
    TENSOR_HOOKS,
    check_is_model,
    check_module,
    hook_sets,
    hooks_error,
    members_differ,
    members_missing,
    no_values,
    shown_member,
    shown_module,
    submodules_differ,
    tied_apart,
    tied_since,
    walk_owner,
)
from torch_precompile.shipped.driver.records import (
    SPEC_DEFAULTS,
    SPEC_LISTS,
    SPEC_RECORDS,
    SPEC_SINGLE,
)
from torch_precompile.shipped.driver.tensor_rules import (
    LeafPlan,
    accumulate_grads,
    argument_kind,
    arguments_error,
    check_input,
    check_model_tensor,
    check_reads,
    positional_inputs,
    runs_backward,
    written_apart,
)

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
            ", ".join(f"{a.name} ({argument_kind(a)})" for a in spec.args) or "no arguments"
        )
        self.out_spec = pytree.treespec_loads(spec.out_spec)
        # A common shape of a call takes a shortcut: one tensor result.
        self.single_result = self.out_spec == pytree.tree_flatten(0)[1]
        training = runs_backward(spec)
        # Flat inputs a driver part unwraps; every other one must be a plain tensor.
        carried = {d.index for d in (*spec.distributed, *spec.wrapped) if d.role == "input"}
        self.leaves = [leaf_plan(leaf, training) for leaf in spec.inputs]
        self.reading = [(i, plan) for i, plan in enumerate(self.leaves) if plan.read]
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
        # Parameters whose .grad from before the call fn reads (a call must come without one)
        # or drops first (the graph's gradient replaces it).
        self.grads_read = [i for i, t in enumerate(self.model.interned) if t.old_grad == "read"]
        self.grads_dropped = [
            i for i, t in enumerate(self.model.interned) if t.old_grad == "replaced"
        ]
        self.value_guards = [(g.description, g.expected) for g in spec.value_guards]
        self.num_results = self.out_spec.num_leaves
        self.guards_start = self.num_results + len(self.grad_indices)
        self.graph_outputs = self.guards_start + len(self.value_guards)
        # The flat inputs the graph writes, and the buffers and inputs they must not share
        # memory with (the graph takes them as separate tensors).
        self.mutated = set(spec.mutated)
        self.first_buffer = len([t for t in self.model.interned if t.kind == "parameter"])
        end = len(self.model.interned) + sum(p.is_tensor for p in self.leaves)
        self.separate = written_apart(self.mutated, self.first_buffer, end)
        self.rollback = sorted(self.mutated) if self.value_guards else []
        self.seed = spec.seed  # set inside fn before its first random draw
        # Optional parts: Any, since each is a class of another shipped module.
        self.values: Any = values(self) if values is not None else None
        self.ambient = ambient_plan(spec.ambient)
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
        self.autograd_records = (spec.autograd, spec.autograd_for_inputs)
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
            return shown_member(interned[index].kind, interned[index].name, self.model.names)
        tensors = [p for p in self.leaves if p.is_tensor]
        return f"input {tensors[index - len(interned)].name}"

    def run(self, args: Sequence[Any], checked: CheckedCall) -> Any:
        """Run the graph on a checked call, then put its gradients and results in place."""
        state, inputs, stepped = checked
        flat = [*state, *inputs, *stepped]
        grad_enabled = torch.is_grad_enabled()
        # Results get history where eager's would: under grad mode, from inputs requiring it.
        history = self.autograd.wanted(flat) if grad_enabled and self.autograd else None
        if self.data_parallel is not None:
            self.data_parallel.average_left_gradients(args, state)
        torch._C._set_grad_enabled(history is not None)
        try:
            # Value guards are read after the graph ran: keep what it writes, to undo it.
            kept = [(flat[i], flat[i].clone()) for i in self.rollback] if self.rollback else ()
            if self.seed is not None:
                torch.manual_seed(self.seed)
            outputs = self.call(flat) if history is None else self.autograd(flat, history)
            if self.value_guards:
                self.values.check_guards(outputs[self.guards_start :], kept)
            for index in self.grads_dropped:
                state[index].grad = None  # as fn's own zero_grad() does first
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


def check_arguments(driver: Driver, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    raise arguments_error(kwargs, len(args), driver.arity, driver.arity_text)


def positional_leaves(driver: Driver, args: Sequence[Any]) -> list[Any]:
    """The inputs, when the captured ones were positional tensors; no nesting in their place."""
    return list(positional_inputs([args[i] for i in driver.input_positions], driver.leaves))


def ambient_plan(record: Any) -> AmbientPlan:
    """The check of the state a call is made in, as the spec recorded it (None: not
    recorded, by artifacts made before it was)."""
    if record is None:
        return AmbientPlan(recorded=False)
    return AmbientPlan(
        True,
        record.autocast,
        record.default_dtype,
        record.deterministic,
        record.modes,
        record.settings,
    )


def leaf_plan(leaf: Any, training: bool) -> LeafPlan:
    """The plan of a spec's input leaf; with a backward inside fn, requires_grad decides
    which gradients eager would produce."""
    return LeafPlan(
        leaf.path,
        leaf.kind,
        leaf.shape or (),
        leaf.dtype,
        leaf.device,
        leaf.strides,
        leaf.requires_grad if training else None,
        leaf.value,
        leaf.bounds,
        read=leaf.read,
    )


def checked_inputs(driver: Driver, leaves: Sequence[Any]) -> list[torch.Tensor]:
    """The tensor leaves, each checked against its plan (Python values by ``values``)."""
    remembers = driver.memo is not None and driver.plain_inputs
    if remembers and driver.memo.inputs_unchanged(leaves):
        for index, plan in driver.reading:  # offsets and flags no tensor guard compares
            check_reads(plan, leaves[index])
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
    checked = check_input(plan, leaf, driver.spec.backend, driver.sizes)
    if plan.read:  # what fn read of the caller's tensor, before any copy into a layout
        check_reads(plan, leaf)
    return checked


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
        check_is_model(module, name)
    members = list(_members(models))
    records = model.records
    for index, (kind, name, _) in enumerate(members):
        if index >= len(records) or (records[index].kind, records[index].name) != (kind, name):
            _report_mismatch(model, index, kind, name)
    if len(members) < len(records):
        raise members_missing([f"{t.kind} {t.name!r}" for t in records[len(members) :]])
    walked = WalkedModels(_untied_tensors(model, members), _checked_modes(model, models))
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
    expected = ("", "", "")
    if index < len(model.records):
        record = model.records[index]
        owner, local = walk_owner(record.name, model.names)
        expected = (owner, record.kind, local)
    argument, local = walk_owner(name, model.names)
    raise members_differ(expected, (argument, kind, local))


def _untied_tensors(model: ModelPlan, members: Sequence[Any]) -> list[torch.Tensor]:
    """One tensor per record not tied to an earlier one; ties must be as at capture."""
    tensors: list[torch.Tensor] = []
    first_name: dict[int, str] = {}
    for record, (kind, name, tensor) in zip(model.records, members, strict=True):
        owner = first_name.get(id(tensor))
        if record.tied_to is not None:
            if owner != record.tied_to:
                raise tied_apart(kind, name, record.tied_to)
            continue
        if owner is not None:
            raise tied_since(kind, name, owner)
        _check_model_tensor(model, record, tensor)
        first_name[id(tensor)] = name
        tensors.append(tensor)
    return tensors


def _check_model_tensor(model: ModelPlan, record: Any, tensor: torch.Tensor) -> None:
    check_model_tensor(
        tensor,
        shown_member(record.kind, record.name, model.names),
        record.shape,
        record.dtype,
        record.device,
        record.strides,
        record.requires_grad if model.training else None,
        record.name in model.carried,
    )


def _checked_modes(model: ModelPlan, models: Sequence[torch.nn.Module]) -> list[Any]:
    """Every submodule in walk order, each of its captured class, forward and mode."""
    qualify = len(models) > 1
    found = [
        (f"m{mi}.{name}" if qualify else name, module)
        for mi, root in enumerate(models)
        for name, module in root.named_modules(remove_duplicate=False)
    ]
    names = [name for name, _ in found]
    if names != [name for name, _ in model.submodules]:
        raise submodules_differ(names, [name for name, _ in model.submodules])
    for (name, module), (_, training), cls, forward in zip(
        found, model.submodules, model.classes, model.forwards, strict=True
    ):
        check_module(module, name, cls, forward, training, model.names)
    return [module for _, module in found]


def check_hooks(model: ModelPlan, walked: WalkedModels) -> None:
    """Hooks run Python the artifact does not: they must be those the trace ran through."""
    for (name, _), captured, module in zip(
        model.submodules, model.hooks, walked.submodules, strict=True
    ):
        now = hook_sets(module, MODULE_HOOKS, model.hook_values)
        if now != captured:
            raise hooks_error(shown_module(name, model.names), captured, now)
    now = hook_sets(torch.nn.modules.module, GLOBAL_HOOKS, model.hook_values)
    if now != model.global_hooks:
        raise hooks_error(GLOBAL_HOOKS_OWNER, model.global_hooks, now)
    for (name, captured), tensor in zip(model.parameter_hooks, walked.tensors, strict=False):
        now = hook_sets(tensor, TENSOR_HOOKS, model.hook_values)
        if now != captured:
            raise hooks_error(shown_member("parameter", name, model.names), captured, now)


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
        if name in SPEC_SINGLE:  # one record, not a list
            fields[name] = None if value is None else make(**value)
        else:
            fields[name] = tuple(make(**v) for v in value)
    return _RECORD_TYPES["ArtifactSpec"](**fields)
