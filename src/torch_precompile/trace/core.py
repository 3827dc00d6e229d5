"""Capture: one non-strict ``make_fx`` trace of ``fn`` with the model state lifted to inputs."""

from __future__ import annotations

import contextlib
import dataclasses
import keyword
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.fx

from torch_precompile.errors import PrecompileError
from torch_precompile.internals import pytree, storage_id, torch_build
from torch_precompile.internals.distributed import pretend_coordinate, sharding_wrapper
from torch_precompile.internals.dynamo import DynamoReading
from torch_precompile.internals.tracing import (
    FakeTensorMode,
    GuardOnDataDependentSymNode,
    differentiable_rnns,
    is_view,
    padded_lengths_in_python,
    plain_checkpoints,
    rename_node,
    reparametrize_module,
    trace_with_user_lines,
    tracer_refusal,
    version_of,
    written_inputs,
)
from torch_precompile.spec import (
    SCHEMA_VERSION,
    Ambient,
    Argument,
    ArtifactSpec,
    DynamicDim,
    InputLeaf,
    OutputAlias,
    SizeRelation,
    ValueGuard,
)
from torch_precompile.trace import checks, data_parallel, dynamic, dynamo_guards, fully_shard
from torch_precompile.trace.ambient import DefaultDtypeUse, ambient_at_capture
from torch_precompile.trace.data_parallel import DataParallelArg
from torch_precompile.trace.distributed import (
    Distribution,
    check_graph,
    find_dtensors,
    name_collectives,
)
from torch_precompile.trace.fully_shard import FullySharded
from torch_precompile.trace.grads import GradUse
from torch_precompile.trace.guards import GuardRecorder
from torch_precompile.trace.hooks import (
    assigned_names,
    global_hooks,
    hook_functions,
    module_hooks,
    named_function,
    reachable_containers,
    reachable_state,
    refuse_iterators,
    refuse_unreplayable_modules,
)
from torch_precompile.trace.inputs import (
    UserInputs,
    arg_names_of,
    encode_value,
    flatten_user_inputs,
    refuse_unplain_tensors,
)
from torch_precompile.trace.optimizers import (
    OptimizerArg,
    check_returned_lrs,
    kept_entries,
    only_arguments_step,
    optimizer_records,
    read_optimizers,
    stepping,
)
from torch_precompile.trace.param_writes import ParamWrites
from torch_precompile.trace.python_state import put_back, refuse_changes, take_snapshot
from torch_precompile.trace.random_state import PythonDraws, SeedWatch
from torch_precompile.trace.reads import ReadRecorder, drop_changed_reads
from torch_precompile.trace.settings import SettingReads
from torch_precompile.trace.state import (
    ModelState,
    intern_model_state,
    model_records,
    submodule_records,
)
from torch_precompile.trace.subclasses import Wrapping, find_wrapped, refuse_mixed
from torch_precompile.trace.tensor_reads import TensorReads

log = logging.getLogger("torch_precompile")


@dataclass(frozen=True)
class Capture:
    """A captured computation: its graph and the spec of its calling convention.

    ``graph`` takes the flat inputs of ``spec`` followed by ``literals`` (tensors the artifact
    rebuilds from source) and returns a list: result leaves, gradients, value guards.
    ``example_inputs`` are the flat example tensors it was traced with: fake tensors with
    unbacked symbols when dims were marked dynamic, ``fake_mode`` then holding their ShapeEnv.
    """

    graph: torch.fx.GraphModule
    literals: list[torch.Tensor]
    spec: ArtifactSpec
    example_inputs: list[torch.Tensor]
    fake_mode: Any = None
    memory_formats: dict[int, str] = dataclasses.field(default_factory=dict)
    symbol_names: dict[str, str] = dataclasses.field(default_factory=dict)


def capture(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    backend: str,
    decompositions: Mapping[Any, Callable[..., Any]] | None = None,
    on_fakes: bool = False,
    tracer: str = "make_fx",
) -> Capture:
    """Trace ``fn(*args)`` once; lift module state; harvest gradients; enforce invariants.

    ``on_fakes`` traces on fake tensors, so that nothing runs and no collective communicates
    (one rank capturing for all), and checks whether the graph depends on the rank. With
    ``tracer="dynamo"`` Dynamo reads fn's Python first (see ``trace.dynamo_guards``).
    """
    layout = _read_layout(fn, args, backend, on_fakes)
    recorder, outputs = GuardRecorder(), _Outputs()
    watch = _Watch(layout)
    watch.reads.hold(fn)
    refuse_unreplayable_modules(watch.named_submodules())
    flat_fn = _flat_function(fn, layout, recorder, outputs, watch)
    functions = [
        named_function(fn),
        *hook_functions(watch.submodules, layout.state.tensors[: layout.num_params]),
    ]
    refuse_iterators(functions)
    before = take_snapshot(
        [(layout.arg_names[i], args[i]) for i in layout.module_positions],
        [(o.name, o.optimizer) for o in layout.optimizers],
        [*reachable_containers(functions), *assigned_names(functions)],
        reachable_state(functions, watch.named_submodules()),
    )
    if tracer == "dynamo":
        _refuse_unread(layout, on_fakes)
    try:
        traced = _trace(flat_fn, layout, recorder, decompositions, on_fakes)
    except BaseException:
        put_back(before)  # fn's own error is the one to report
        raise
    finally:
        watch.param_writes.put_back()  # fn's in-place writes to parameters
    _refuse_swapped_data(layout, watch.param_writes.swapped, before)
    refuse_changes(before)
    if backend == "inductor" and traced.dynamic_inputs is None:  # dynamic: sizes symbolic
        _refuse_input_layout_changes(layout, traced.examples)
    watch.draws.refuse()
    watch.tensor_reads.refuse_addresses(layout.inputs.names)
    drop_changed_reads(watch.reads)
    reports = (
        # Under Dynamo, each value fn closes over is a dropped guard, said with the others.
        watch.reads.closure_report() if tracer != "dynamo" else None,
        watch.reads.clock_report(),
        watch.reads.output_report(),
        outputs.returned_reads_report(),
    )
    for unchecked in reports:
        if unchecked is not None:  # in the graph, beyond any call's reach: said at capture
            log.warning(unchecked)
    _refuse_aliased_writes(layout, traced.mutated)
    traced = _drop_unstepped_state(traced, layout)
    _drop_constant_guards(traced.graph, recorder, outputs)
    gm = traced.graph
    check_graph(gm)
    checks.reject_control_flow(gm)
    checks.reject_effects(gm)
    checks.reject_own_generators(gm)
    if layout.sharding is not None or layout.data_parallel:
        stable = data_parallel.stable_group_names(layout.data_parallel)
        if layout.sharding is not None:
            stable.update(layout.sharding.group_names())
        name_collectives(gm, stable)
    literals = checks.lift_literals(
        gm,
        checks.origin_finder(fn, [(layout.arg_names[i], args[i]) for i in layout.module_positions]),
    )
    _name_placeholders(gm, layout)
    spec = _artifact_spec(backend, layout, recorder, outputs, traced, watch)
    if tracer == "dynamo":  # after every refusal of the trace, judged on untouched state
        spec = _with_guards(spec, _read_with_dynamo(fn, layout, before), fn, layout, watch, gm)
    if traced.dynamic_inputs is None:
        return Capture(gm, literals, spec, traced.examples)
    return Capture(
        gm,
        literals,
        spec,
        traced.examples,
        traced.dynamic_inputs.fake_mode,
        *_symbolic_names(layout, traced.dynamic_inputs),
    )


@dataclass(frozen=True)
class _Layout:
    """Where each of ``args`` goes: modules and their lifted state, flat user inputs, marks."""

    args: tuple[Any, ...]
    arg_names: list[str]
    module_positions: list[int]
    modules: list[torch.nn.Module]
    state: ModelState
    inputs: UserInputs
    tensor_positions: list[int]  # indices into inputs.leaves
    sharding: Distribution | None
    wrapping: Wrapping
    marks: list[dict[int, dynamic.Mark]]
    optimizer_positions: list[int]
    optimizers: list[OptimizerArg]
    data_parallel: list[DataParallelArg]
    fully_sharded: FullySharded

    @property
    def num_params(self) -> int:
        return self.state.num_params

    @property
    def num_state(self) -> int:
        return len(self.state.tensors)

    @property
    def optimizer_start(self) -> int:
        """The flat index of the first optimizer state tensor (after the input tensors)."""
        return self.num_state + len(self.tensor_positions)

    @property
    def num_optimizer_state(self) -> int:
        return sum(len(o.entries) for o in self.optimizers)


@dataclass
class _Outputs:
    """What the flat function learns about fn's results while it is traced."""

    spec: pytree.TreeSpec | None = None
    grad_indices: list[int] = dataclasses.field(default_factory=list)
    aliases: tuple[OutputAlias, ...] = ()
    # Where fn returns a number it read off a tensor (``loss.item()``): every call checks it.
    returned_reads: list[str] = dataclasses.field(default_factory=list)

    def returned_reads_report(self) -> str | None:
        """Said at capture: a returned ``.item()`` makes every call with another value fail."""
        if not self.returned_reads:
            return None
        where = "; ".join(read.rsplit(" at ", 1)[-1] for read in self.returned_reads)
        return (
            f"fn returns a number it read off a tensor (.item(), at {where}). "
            "The artifact checks such a read at every call, so a call where it comes out "
            "another number is refused. Return the tensor instead (loss.detach()) and call "
            ".item() on the result."
        )


@dataclass(frozen=True)
class _Traced:
    graph: torch.fx.GraphModule
    examples: list[torch.Tensor]
    dynamic_inputs: dynamic.DynamicInputs | None
    coordinate_dependent: bool
    mutated: tuple[int, ...] = ()  # flat inputs the graph writes in place


class _Watch:
    """What capture notes about fn beyond tensors while it is traced: the Python values it
    reads, whether it builds tensors of the default dtype; and the state before it runs."""

    def __init__(self, layout: _Layout) -> None:
        self.layout = layout
        self.submodules = [
            m for root in layout.modules for _, m in root.named_modules(remove_duplicate=False)
        ]
        self.reads = ReadRecorder(self.submodules)
        self.default_dtype = DefaultDtypeUse()
        self.settings = SettingReads()
        self.grads = GradUse()
        self.param_writes = ParamWrites()
        self.tensor_reads = TensorReads()
        self.global_hooks = global_hooks()
        self.hooks = [module_hooks(m) for m in self.submodules]
        self.seeds = SeedWatch()
        self.draws = PythonDraws()

    def named_submodules(self) -> list[tuple[str, torch.nn.Module]]:
        """Each submodule as messages name it, in walk order."""
        names = [
            arg for i, arg in enumerate(self.layout.arg_names) if i in self.layout.module_positions
        ]
        return [
            (f"module {name!r} of {arg}" if name else f"model {arg}", module)
            for arg, root in zip(names, self.layout.modules, strict=True)
            for name, module in root.named_modules(remove_duplicate=False)
        ]

    def ambient(self) -> Ambient:
        return ambient_at_capture(self.default_dtype.used, self.settings.records())


def _read_layout(
    fn: Callable[..., Any], args: tuple[Any, ...], backend: str, on_fakes: bool
) -> _Layout:
    arg_names = arg_names_of(fn, len(args))
    module_positions = [i for i, a in enumerate(args) if isinstance(a, torch.nn.Module)]
    modules: list[torch.nn.Module] = [args[i] for i in module_positions]
    _refuse_sharding_wrappers(modules, [arg_names[i] for i in module_positions])
    model_names = [arg_names[i] for i in module_positions]
    ddp = data_parallel.find_data_parallel(modules, model_names)
    sharded_groups = fully_shard.find_fully_sharded(modules, model_names)
    state = intern_model_state(modules)
    optimizer_positions = [i for i, a in enumerate(args) if isinstance(a, torch.optim.Optimizer)]
    optimizers = read_optimizers(
        [args[i] for i in optimizer_positions],
        [arg_names[i] for i in optimizer_positions],
        state,
        backend,
    )
    input_positions = [
        i for i in range(len(args)) if i not in module_positions and i not in optimizer_positions
    ]
    inputs = flatten_user_inputs(
        tuple(args[i] for i in input_positions), [arg_names[i] for i in input_positions]
    )
    tensor_positions = inputs.tensor_positions
    flat = [*state.tensors, *(inputs.leaves[i] for i in tensor_positions)]
    flat_names = [
        *(f"model parameter {n!r}" for n in state.param_names),
        *(f"model buffer {n!r}" for n in state.buffer_names),
        *(f"input {inputs.names[i]}" for i in tensor_positions),
    ]
    refuse_unplain_tensors(flat, flat_names)
    wrapping = find_wrapped(flat, flat_names)
    # An optimizer's state follows the flat inputs; that of DTensor parameters is DTensors.
    state_names = [
        f"state {e.key!r} of model parameter {state.param_names[e.param]!r} in optimizer {o.name}"
        for o in optimizers
        for e in o.entries
    ]
    sharding = find_dtensors(
        [*flat, *(e.example for o in optimizers for e in o.entries)], [*flat_names, *state_names]
    )
    refuse_mixed(wrapping, sharding is not None)
    data_parallel.refuse_with_dtensors(ddp, sharding is not None)
    marks = dynamic.read_marks(inputs.leaves, inputs.names)
    if optimizers and any(marks):
        raise PrecompileError(
            f"optimizer {optimizers[0].name} steps inside fn, which is carried for dims of "
            "static shape; with dims marked dynamic, call its step outside the artifact (loss "
            "= run(model, x, t); opt.step(); opt.zero_grad())."
        )
    if any(marks) and (sharding is not None or on_fakes):
        raise PrecompileError(
            "dims marked with mark_unbacked (dynamic shapes) are not supported together with "
            "DTensors or compile_on_one_rank yet; leave the dims static."
        )
    return _Layout(
        args,
        arg_names,
        module_positions,
        modules,
        state,
        inputs,
        tensor_positions,
        sharding,
        wrapping,
        marks,
        optimizer_positions,
        optimizers,
        ddp,
        sharded_groups,
    )


def _flat_function(
    fn: Callable[..., Any],
    layout: _Layout,
    recorder: GuardRecorder,
    outputs: _Outputs,
    watch: _Watch,
) -> Callable[..., list[Any]]:
    """``fn`` over flat tensors (model state, then input tensors), as make_fx traces it.

    It returns result leaves, then gradients, then value guards, and fills ``outputs``.
    """
    state, inputs, sharding = layout.state, layout.inputs, layout.sharding
    wrapping = layout.wrapping
    # A symbolic trace reads no values, so it has no guards to record.
    recording = contextlib.nullcontext() if any(layout.marks) else recorder

    def flat_fn(*locals_: torch.Tensor) -> list[Any]:
        flat = wrapping.rebuild(locals_)
        flat = flat if sharding is None else sharding.rebuild(flat)
        leaves = list(inputs.leaves)
        start, lrs = layout.optimizer_start, layout.optimizer_start + layout.num_optimizer_state
        placed = list(zip(layout.tensor_positions, flat[layout.num_state : start], strict=True))
        for position, tensor in placed:
            leaves[position] = tensor
        user_args = iter(pytree.tree_unflatten(leaves, inputs.spec))
        passed = {*layout.module_positions, *layout.optimizer_positions}
        call_args = [a if i in passed else next(user_args) for i, a in enumerate(layout.args)]
        with contextlib.ExitStack() as stack:
            for module, binding in zip(layout.modules, state.bindings, strict=True):
                reparam = {name: flat[index] for name, index in binding.items()}
                stack.enter_context(reparametrize_module(module, reparam, tie_weights=True))
            stack.enter_context(
                stepping(
                    layout.optimizers,
                    flat[start:lrs],
                    flat[lrs:],
                    flat[: layout.num_params],
                    state.tensors,
                )
            )
            stack.enter_context(only_arguments_step(layout.optimizers))
            stack.enter_context(data_parallel.tracing(layout.data_parallel, _trained(layout, flat)))
            stack.enter_context(fully_shard.tracing(layout.fully_sharded, state.tensors, flat))
            with (
                watch.draws,  # outermost: what it runs to compare is not fn's
                recording,
                watch.reads,
                watch.default_dtype,
                watch.settings,
                watch.grads.watching(flat[: layout.num_params]),
                watch.param_writes.watching(
                    flat[: layout.num_params], copied=bool(layout.optimizers)
                ),
                watch.seeds,
                watch.tensor_reads.watching(placed, inputs.leaves),
                plain_checkpoints(),
                padded_lengths_in_python(),
            ):
                result = fn(*call_args)
        _reject_stray_gradients(state, flat, layout.num_params)
        result_leaves, outputs.spec = pytree.tree_flatten(result)
        checks.check_result_leaves(result_leaves)
        outputs.returned_reads = _returned_reads(recorder, result_leaves)
        check_returned_lrs(layout.optimizers, result_leaves)
        grads = [(i, p.grad) for i, p in enumerate(flat[: layout.num_params]) if p.grad is not None]
        if sharding is not None:
            result_leaves = sharding.local_results(result_leaves)
            grads = [(i, sharding.local_grad(i, g)) for i, g in grads]
        result_leaves, inner = wrapping.flat_results(result_leaves)
        outputs.grad_indices = [i for i, _ in grads]
        outputs.aliases = _output_aliases(result_leaves, locals_)
        return [
            *result_leaves,
            *(g for _, g in grads),
            *(g.tensor for g in recorder.guards),
            *inner,
        ]

    return flat_fn


def _trained(layout: _Layout, flat: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Each DDP model's traced parameters that require grad, once each."""
    bindings = layout.state.bindings
    return [
        [
            flat[i]
            for i in sorted(set(bindings[arg.model].values()))
            if i < layout.num_params and flat[i].requires_grad
        ]
        for arg in layout.data_parallel
    ]


def _trace(
    flat_fn: Callable[..., list[Any]],
    layout: _Layout,
    recorder: GuardRecorder,
    decompositions: Mapping[Any, Callable[..., Any]] | None,
    on_fakes: bool,
) -> _Traced:
    """Trace with every parameter's ``.grad`` cleared, and put the caller's back afterwards.

    Parameters are traced as themselves, so an optimizer step inside fn would update them for
    real: with an optimizer among the arguments their values are put back too. So are the
    buffers traced as themselves (see ``_examples``).
    """
    params = layout.state.tensors[: layout.num_params]
    saved_grads = [p.grad for p in params]
    buffers = _buffers_as_themselves(layout)
    written = [*(params if layout.optimizers else ()), *buffers]
    saved_values = [t.detach().clone() for t in written] if not on_fakes else []
    # Subclasses and DTensors are laid out otherwise: their examples are not flat inputs.
    plain = layout.sharding is None and not layout.wrapping.inputs
    try:
        for p in params:
            p.grad = None
        if any(layout.marks):
            dynamic_inputs = dynamic.fake_inputs(
                layout.state.tensors, layout.inputs.leaves, layout.inputs.names, layout.marks
            )
            dynamic_inputs = dataclasses.replace(
                dynamic_inputs, fakes=layout.wrapping.expand(dynamic_inputs.fakes)
            )
            gm = _trace_symbolic(flat_fn, dynamic_inputs.fakes, dynamic_inputs, decompositions)
            mutated = tuple(written_inputs(gm.graph)) if plain else ()
            return _Traced(gm, dynamic_inputs.fakes, dynamic_inputs, False, mutated)
        examples = _examples(layout, buffers)
        versions = [version_of(e) for e in examples]
        trace = _Trace(flat_fn, decompositions, examples, on_fakes)
        gm = trace.run()
        _refuse_grad_flags_set(layout, examples)
        # Which examples the trace wrote shows which inputs the graph writes, and so do the
        # operators' schemas (native_batch_norm writes its running statistics without moving
        # their versions): as laid out here, an example is a flat input.
        mutated = (
            tuple(
                sorted(
                    {
                        i
                        for i, (e, v) in enumerate(zip(examples, versions, strict=True))
                        if version_of(e) != v
                    }.union(written_inputs(gm.graph))
                )
            )
            if plain
            else ()
        )
        sharding = layout.sharding
        dependent = sharding is not None and (
            not on_fakes or trace.depends_on_coordinate(sharding, gm.code, recorder)
        )
        return _Traced(gm, examples, None, dependent, mutated)
    finally:
        for p, grad in zip(params, saved_grads, strict=True):
            p.grad = grad
        with torch.no_grad():
            for t, value in zip(written, saved_values, strict=False):
                t.copy_(value)
        for t in buffers:
            if t.grad_fn is not None:  # an in-place write of a value with history
                t.detach_()


def _refuse_unread(layout: _Layout, on_fakes: bool) -> None:
    """What the dynamo tracer does not read yet, refused by name before anything runs."""
    unread = [
        what
        for what, present in (
            ("a capture on one rank for all (compile_on_one_rank)", on_fakes),
            ("DTensors", layout.sharding is not None),
            ("tensor subclasses", bool(layout.wrapping.inputs)),
            ("DistributedDataParallel", bool(layout.data_parallel)),
            ("fully_shard (FSDP2)", bool(layout.fully_sharded.modules)),
        )
        if present
    ]
    if unread:
        raise PrecompileError(
            f"tracer='dynamo' does not read {' or '.join(unread)} yet; capture with "
            "tracer='make_fx' (the default), which does."
        )


def _read_with_dynamo(fn: Callable[..., Any], layout: _Layout, before: Any) -> DynamoReading:
    """Dynamo's reading of fn, run on the caller's own objects and everything put back:
    tensors' values, layouts, flags and gradients, optimizer state, Python state, random
    streams."""
    leaves = [layout.inputs.leaves[i] for i in layout.tensor_positions]
    tensors = [*layout.state.tensors, *leaves]
    # Cleared as the trace clears them: a backward would add to them in place.
    grads = [t.grad for t in tensors]
    saved = [_TensorState.of(t) for t in tensors]
    optimizers = [(o.optimizer, _optimizer_state(o.optimizer)) for o in layout.optimizers]
    try:
        for t in tensors:
            t.grad = None
        with fork_rng(tensors):
            reading = dynamo_guards.read_with_dynamo(fn, layout.args)
    except BaseException:
        put_back(before)
        raise
    finally:
        for t, held in zip(tensors, saved, strict=True):
            held.put_back(t)
        for t, grad in zip(tensors, grads, strict=True):
            t.grad = grad
        for optimizer, (state, groups) in optimizers:
            optimizer.state.clear()
            optimizer.state.update(state)
            for group, options in zip(optimizer.param_groups, groups, strict=True):
                group.update(options)
    put_back(before)
    dynamo_guards.refuse_breaks(reading)
    return reading


@dataclass(frozen=True)
class _TensorState:
    """A tensor's value, layout and flags, to put back after a run of fn."""

    value: torch.Tensor
    layout: tuple[Any, ...]
    requires_grad: bool

    @staticmethod
    def of(t: torch.Tensor) -> _TensorState:
        return _TensorState(t.detach().clone(), _layout_of(t), t.requires_grad)

    def put_back(self, t: torch.Tensor) -> None:
        if t.requires_grad != self.requires_grad and t.is_leaf:
            t.requires_grad_(self.requires_grad)
        # Compared by value: a write through .data leaves the version counter as it was.
        if _layout_of(t) == self.layout and torch.equal(t.detach(), self.value):
            return
        inference = torch.inference_mode() if t.is_inference() else contextlib.nullcontext()
        with inference, torch.no_grad():
            if _layout_of(t) != self.layout:
                t.as_strided_(self.value.shape, self.layout[1], self.layout[2])
            t.copy_(self.value)


def _optimizer_state(optimizer: Any) -> tuple[dict[Any, Any], list[dict[str, Any]]]:
    state = {
        p: {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
        for p, s in optimizer.state.items()
    }
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return state, groups


def _with_guards(
    spec: ArtifactSpec,
    reading: DynamoReading,
    fn: Callable[..., Any],
    layout: _Layout,
    watch: _Watch,
    gm: torch.fx.GraphModule,
) -> ArtifactSpec:
    """The spec with Dynamo's guards translated: new read values and the guard report."""
    if not reading.frames and not any(n.op == "call_function" for n in gm.graph.nodes):
        return spec  # no tensor operation for Dynamo to read: nothing to compile either
    members = reversed(layout.state.members)  # a tied tensor goes by its first name
    inputs = [
        (f"input {layout.inputs.names[i]}", layout.inputs.leaves[i])
        for i in layout.tensor_positions
    ]
    anchors = dynamo_guards.Anchors.of(
        watch.submodules,
        [
            *((f"model {kind} {name!r}", layout.state.tensors[i]) for kind, name, i in members),
            *inputs,
        ],
        [(o.name, o.optimizer) for o in layout.optimizers],
        dict(zip(layout.arg_names, layout.args, strict=True)),
    )
    translated = dynamo_guards.translate(reading, fn, anchors, spec.read_values)
    dropped = translated.dropped
    if dropped:
        listed = "; ".join(f"{n.reads} ({n.by})" for n in dropped[:4])
        more = f" and {len(dropped) - 4} more" if len(dropped) > 4 else ""
        log.warning(
            f"tracer='dynamo' dropped {len(dropped)} guard(s) no call can check: {listed}{more}. "
            "precompile.inspect lists every guard; require_all_guards=True refuses such a "
            "capture."
        )
    return dataclasses.replace(
        spec,
        read_values=spec.read_values + translated.reads,
        guards=translated.notes,
    )


def _refuse_swapped_data(layout: _Layout, swapped: Sequence[int], before: Any) -> None:
    """Refuse fn's ``p.data = ...`` on a parameter (put back already): a graph records
    operators, and replacing a tensor's data is none, so the artifact would never update it."""
    if not swapped:
        return
    put_back(before)
    names = ", ".join(repr(layout.state.param_names[i]) for i in swapped[:4])
    more = f" and {len(swapped) - 4} more" if len(swapped) > 4 else ""
    raise PrecompileError(
        f"fn replaces the data of parameter{'s' if len(swapped) > 1 else ''} {names}{more} "
        "(p.data = ...), which no graph can "
        "record: the artifact would leave the parameter as it was. Write it in place instead "
        "(with torch.no_grad(): p -= lr * p.grad, or p.data.copy_(new)); the model is as it "
        "was before precompile."
    )


def _refuse_grad_flags_set(layout: _Layout, examples: Sequence[torch.Tensor]) -> None:
    """Refuse fn's ``x.requires_grad_()`` on an input tensor: the copy the trace ran on took
    the flag, but an artifact leaves the caller's tensor as it was, where eager leaves it
    requiring grad."""
    if layout.sharding is not None or layout.wrapping.inputs:
        return  # examples laid out otherwise
    for k, i in enumerate(layout.tensor_positions):
        given = layout.inputs.leaves[i].requires_grad
        if examples[layout.num_state + k].requires_grad != given:
            name = layout.inputs.names[i]
            raise PrecompileError(
                f"fn sets requires_grad={not given} on input {name} (requires_grad_()) while "
                f"it is traced. An artifact leaves the tensor passed in as it was, so {name} "
                f"would not come back with the flag eager gives it. Set it before the call, "
                f"outside fn ({name}.requires_grad_({not given}) before precompile and before "
                "each call): fn computes the same gradients with it."
            )


def _refuse_input_layout_changes(layout: _Layout, examples: Sequence[torch.Tensor]) -> None:
    """Refuse fn's in-place change of an input tensor's shape, strides or storage (``resize_``,
    ``set_``, ``t_``) for Inductor, which compiles its kernels for the layout the trace ends
    with, not the one a call passes."""
    if layout.sharding is not None or layout.wrapping.inputs:
        return  # examples laid out otherwise
    for k, i in enumerate(layout.tensor_positions):
        given, traced = layout.inputs.leaves[i], examples[layout.num_state + k]
        if _layout_of(traced) != _layout_of(given):
            name = layout.inputs.names[i]
            raise PrecompileError(
                f"fn changes the shape or layout of input {name} in place (resize_, set_, t_, "
                "unsqueeze_, as_strided_, ...), which the inductor backend cannot compile for "
                f"the layout a call passes. Compute a new tensor instead ({name}.t() for "
                f"{name}.t_()), or use backend='eager'."
            )


def _layout_of(t: torch.Tensor) -> tuple[Any, ...]:
    return (tuple(t.shape), tuple(t.stride()), t.storage_offset())


def _buffers_as_themselves(layout: _Layout) -> list[torch.Tensor]:
    """Plain buffers, which the trace takes as themselves: code that reaches one by another
    path (a cache object holding the tensor a wrapper registered) then reads the graph input,
    not a constant. ``_trace`` puts back what fn writes to them (BatchNorm statistics)."""
    if layout.sharding is not None:
        return []
    return [
        t
        for i, t in enumerate(layout.state.tensors)
        if layout.num_params <= i
        and i not in layout.wrapping.inputs
        and not is_view(t)
        and not t.requires_grad
    ]


def _examples(layout: _Layout, themselves: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    # Parameters are traced as themselves (a backward writes their .grad, which _trace
    # restores), and so are plain buffers (see _buffers_as_themselves); input tensors as
    # copies, so that mutations fn makes while being traced never touch the caller's.
    state, wrapped = layout.state, layout.wrapping.inputs
    as_themselves = {id(t) for t in themselves}
    # Optimizer state is copied for the same reason; each param group's lr is a 0-dim input.
    # A subclass's inner tensors are copied instead of it (see Wrapping.expand).
    flat = [*state.tensors, *(layout.inputs.leaves[i] for i in layout.tensor_positions)]
    examples = [
        *(
            t
            if i < layout.num_params
            or i in wrapped
            or (i < layout.num_state and id(t) in as_themselves)
            else _copy(t)
            for i, t in enumerate(flat)
        ),
        *(_copy(e.example) for o in layout.optimizers for e in o.entries),
        *(learning_rate(group) for o in layout.optimizers for group in o.optimizer.param_groups),
    ]
    if layout.sharding is not None:
        return layout.sharding.locals(examples)
    return layout.wrapping.expand(examples, _copy, layout.num_params)


def learning_rate(group: dict[str, Any]) -> torch.Tensor:
    """A param group's lr as the graph reads it: a 0-dim float64 tensor (a float's exact
    value)."""
    return torch.tensor(float(group["lr"]), dtype=torch.float64)


def _drop_constant_guards(
    gm: torch.fx.GraphModule, recorder: GuardRecorder, outputs: _Outputs
) -> None:
    """Without guards on constants (DTensor reads index tensors it made itself): a value no
    input can change needs no check."""
    assert outputs.spec is not None  # the trace called the flat function
    output = gm.graph.output_node()
    values = list(cast("Sequence[Any]", output.args[0]))
    start = outputs.spec.num_leaves + len(outputs.grad_indices)
    constant = [values[start + i].op == "get_attr" for i in range(len(recorder.guards))]
    if not any(constant):
        return
    recorder.guards[:] = [g for g, c in zip(recorder.guards, constant, strict=True) if not c]
    kept = [
        v
        for i, v in enumerate(values)
        if not (start <= i < start + len(constant) and constant[i - start])
    ]
    output.args = (kept,)
    gm.graph.eliminate_dead_code()
    gm.recompile()


def _drop_unstepped_state(traced: _Traced, layout: _Layout) -> _Traced:
    """Without the state of parameters the optimizer did not step (they had no gradient), as
    eager creates no state for them."""
    keep = kept_entries(layout.optimizers)
    if all(keep):
        return traced
    if layout.sharding is not None:
        raise PrecompileError(
            "the optimizer steps parameters of which some got no gradient in fn, beside "
            "DTensors; such a step is not carried. Give every parameter it steps a gradient, "
            "or build the optimizer over those that get one."
        )
    gm = traced.graph
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    start = layout.optimizer_start
    dropped = {start + i for i, kept in enumerate(keep) if not kept}
    for index in sorted(dropped, reverse=True):
        assert not placeholders[index].users  # an unstepped parameter's state is never read
        gm.graph.erase_node(placeholders[index])
    gm.recompile()
    examples = [e for i, e in enumerate(traced.examples) if i not in dropped]
    # The written inputs after a dropped one move down with the graph's inputs.
    mutated = tuple(i - sum(d < i for d in dropped) for i in traced.mutated if i not in dropped)
    return dataclasses.replace(traced, graph=gm, examples=examples, mutated=mutated)


def _artifact_spec(
    backend: str,
    layout: _Layout,
    recorder: GuardRecorder,
    outputs: _Outputs,
    traced: _Traced,
    watch: _Watch,
) -> ArtifactSpec:
    assert outputs.spec is not None  # the trace called the flat function
    inputs = layout.inputs
    shapes = _input_shapes(layout, traced.dynamic_inputs)
    optimizers, groups, optimizer_state = optimizer_records(layout.optimizers, layout.state)
    return ArtifactSpec(
        schema_version=SCHEMA_VERSION,
        backend=backend,
        torch=torch_build(),
        args=tuple(
            Argument(name, i in layout.module_positions, i in layout.optimizer_positions)
            for i, name in enumerate(layout.arg_names)
        ),
        model=model_records(
            layout.state,
            outputs.grad_indices,
            training=bool(outputs.grad_indices or layout.optimizers),
            old_grads=watch.grads.old_grad,
        ),
        submodules=submodule_records(layout.modules, watch.hooks),
        inputs=tuple(
            _input_record(leaf, name, value, shape, bound, watch.tensor_reads.records(i))
            for i, (leaf, name, value, shape, bound) in enumerate(
                zip(
                    inputs.leaves,
                    inputs.names,
                    inputs.values,
                    shapes.shapes,
                    shapes.bounds,
                    strict=True,
                )
            )
        ),
        in_spec=_dump_in_spec(inputs.spec),
        out_spec=_dump_out_spec(outputs.spec),
        value_guards=tuple(
            ValueGuard(g.description, encode_value(g.description, g.expected))
            for g in recorder.guards
        ),
        dynamic_dims=shapes.dynamic_dims,
        size_relations=shapes.relations,
        output_aliases=outputs.aliases,
        optimizers=optimizers,
        param_groups=groups,
        optimizer_state=optimizer_state,
        **_distribution_records(layout.sharding, traced.coordinate_dependent),
        **layout.wrapping.spec_records(),
        data_parallel=tuple(arg.record() for arg in layout.data_parallel),
        fully_sharded=layout.fully_sharded.records(),
        global_hooks=watch.global_hooks,
        read_values=watch.reads.records(),
        ambient=watch.ambient(),
        mutated=traced.mutated,
        seed=watch.seeds.replayed_seed(),
    )


@dataclass(frozen=True)
class _InputShapes:
    """Each input leaf's recorded shape (None at a dynamic dim) and bounds; the dynamic dims."""

    shapes: list[Any]
    bounds: list[Any]
    dynamic_dims: tuple[DynamicDim, ...] = ()
    relations: tuple[SizeRelation, ...] = ()


def _input_shapes(layout: _Layout, dynamic_inputs: dynamic.DynamicInputs | None) -> _InputShapes:
    names = layout.inputs.names
    shapes: list[Any] = [_shape(leaf) for leaf in layout.inputs.leaves]
    bounds: list[Any] = [None for _ in layout.inputs.leaves]
    if dynamic_inputs is None:
        return _InputShapes(shapes, bounds)
    dynamic.check_not_specialized(dynamic_inputs, names)
    relations = dynamic.shape_relations(dynamic_inputs, names)
    for leaf_index, leaf_marks in enumerate(layout.marks):
        if leaf_marks:
            shapes[leaf_index] = tuple(
                None if d in leaf_marks else s for d, s in enumerate(shapes[leaf_index])
            )
            bounds[leaf_index] = {
                d: (m.low, m.high)
                for d, m in leaf_marks.items()
                if m.low is not None or m.high is not None
            } or None
    dynamic_dims = tuple(
        DynamicDim(label, tuple(cast("tuple[int, int]", tuple(place)) for place in places))
        for label, places in zip(dynamic_inputs.labels, dynamic_inputs.occurrences, strict=True)
    )
    return _InputShapes(shapes, bounds, dynamic_dims, relations)


def _symbolic_names(
    layout: _Layout, dynamic_inputs: dynamic.DynamicInputs
) -> tuple[dict[int, str], dict[str, str]]:
    """Memory format of each marked flat input, and each size symbol named after its input."""
    flat_index = {leaf: layout.num_state + i for i, leaf in enumerate(layout.tensor_positions)}
    formats = {flat_index[leaf]: name for leaf, name in dynamic_inputs.memory_formats.items()}
    symbol_names = {
        str(symbol): f"input {layout.inputs.names[places[0][0]]} dim {places[0][1]}"
        for symbol, places in zip(dynamic_inputs.symbols, dynamic_inputs.occurrences, strict=True)
    }
    return formats, symbol_names


class _Trace:
    """One make_fx trace of the flat function, on the examples or on fakes of them."""

    def __init__(
        self,
        flat_fn: Callable[..., Any],
        decompositions: Mapping[Any, Callable[..., Any]] | None,
        examples: list[torch.Tensor],
        on_fakes: bool,
    ) -> None:
        self.flat_fn, self.decompositions, self.examples = flat_fn, decompositions, examples
        self.on_fakes = on_fakes

    def run(self) -> torch.fx.GraphModule:
        with torch.enable_grad(), fork_rng(self.examples), differentiable_rnns():
            if not self.on_fakes:
                try:
                    return trace_with_user_lines(
                        self.flat_fn, self.decompositions, tolerate_data_dependent_ops=True
                    )(*self.examples)
                except (NotImplementedError, TypeError) as e:
                    _raise_tracer_refusal(e)
                    raise
            fake_mode = FakeTensorMode()
            with fake_mode:
                fakes = [fake_mode.from_tensor(e) for e in self.examples]
                try:
                    return trace_with_user_lines(self.flat_fn, self.decompositions)(*fakes)
                except PrecompileError:
                    raise
                except Exception as e:
                    first_line = (str(e).splitlines() or [""])[0]
                    raise PrecompileError(
                        "compile_on_one_rank traces fn on fake tensors (so that no collective "
                        "waits for ranks that are not tracing), and fn failed there: "
                        f"{type(e).__name__}: {first_line}. Reading tensor "
                        "values (.item(), data-dependent Python branches) needs real tensors: "
                        "precompile on every rank instead (compile_on_one_rank=False)."
                    ) from e

    def depends_on_coordinate(
        self, sharding: Distribution, code: str, recorder: GuardRecorder
    ) -> bool:
        """Whether the graph changes when this rank pretends to sit elsewhere in its meshes."""
        guards = list(recorder.guards)
        others = [
            [(c + 1) % size for c, size in zip(mesh.get_coordinate(), mesh.shape, strict=True)]
            for mesh in sharding.meshes
        ]
        recorder.guards.clear()  # the rerun records its own
        try:
            with pretend_coordinate(sharding.meshes, others):
                return self.run().code != code
        except PrecompileError:
            return True  # e.g. shards of other shapes there: the graph is this rank's alone
        finally:
            recorder.guards[:] = guards


def _distribution_records(
    sharding: Distribution | None, coordinate_dependent: bool
) -> dict[str, Any]:
    if sharding is None:
        return {}
    return {
        "meshes": sharding.mesh_records(coordinate_dependent),
        "distributed": (*(s.record for s in sharding.inputs.values()), *sharding.results),
    }


def _refuse_aliased_writes(layout: _Layout, mutated: Sequence[int]) -> None:
    """The trace ran on separate copies of the caller's tensors: where fn writes one that
    shares memory with another, eager would see the write through the other, the graph not."""
    if not mutated:
        return
    flat = [*layout.state.tensors, *(layout.inputs.leaves[i] for i in layout.tensor_positions)]
    names = [
        *(f"model parameter {n!r}" for n in layout.state.param_names),
        *(f"model buffer {n!r}" for n in layout.state.buffer_names),
        *(f"input {layout.inputs.names[i]}" for i in layout.tensor_positions),
    ]
    owners: dict[int, int] = {}
    for index, tensor in enumerate(flat):
        owners.setdefault(storage_id(tensor), index)
    for index in mutated:
        if index >= len(flat):
            continue
        first = owners[storage_id(flat[index])]
        others = [
            i for i, t in enumerate(flat) if i != index and storage_id(t) == storage_id(flat[index])
        ]
        if others:
            raise PrecompileError(
                f"fn writes {names[index]} in place, and it shares memory with "
                f"{names[others[0] if first == index else first]} in the example. A precompiled "
                "graph takes its inputs as separate tensors, so the write would not show "
                "through the other. Pass separate tensors (x.clone()), or write fn without "
                "the in-place update."
            )


def _refuse_sharding_wrappers(modules: list[torch.nn.Module], names: list[str]) -> None:
    for name, module in zip(names, modules, strict=True):
        wrapper = sharding_wrapper(module)
        if wrapper in (None, "DistributedDataParallel", "fully_shard"):
            continue
        raise PrecompileError(
            f"model argument {name} is wrapped in {wrapper}, whose parameters are gathered and "
            "gradients reduce-scattered in module and autograd hooks, which a precompiled "
            f"graph does not replay yet. Precompile the model built without {wrapper}: "
            "wrapped in DistributedDataParallel (data parallelism, carried), or with its "
            "parameters sharded as DTensors (parallelize_module)."
        )


def _input_record(
    leaf: Any, name: str, value: Any, shape: Any, bounds: Any, read: Any
) -> InputLeaf:
    if not isinstance(leaf, torch.Tensor):
        return InputLeaf(path=name, kind="value", value=value)
    return InputLeaf(
        path=name,
        kind="tensor",
        shape=shape,
        dtype=str(leaf.dtype),
        device=str(leaf.device),
        requires_grad=leaf.requires_grad,
        bounds=bounds,
        read=read,
    )


def _trace_symbolic(
    flat_fn: Callable[..., Any],
    fakes: list[torch.Tensor],
    dynamic_inputs: dynamic.DynamicInputs,
    decompositions: Mapping[Any, Callable[..., Any]] | None,
) -> torch.fx.GraphModule:
    try:
        with torch.enable_grad(), dynamic_inputs.fake_mode, differentiable_rnns():
            return trace_with_user_lines(flat_fn, decompositions, tracing_mode="symbolic")(*fakes)
    except (NotImplementedError, TypeError) as e:
        _raise_tracer_refusal(e)
        raise
    except GuardOnDataDependentSymNode as e:
        raise PrecompileError(
            "fn branches on, or needs a fixed value of, a dim marked with mark_unbacked (or a "
            "value computed from one), so no single artifact can serve every size. Marked dims "
            "that must be equal should share one shape_id; a decision on whether a size is 1 "
            "is settled by declaring min=2 (mark_unbacked(x, dim, min=2)); otherwise leave the "
            "dim static or write fn without the size-dependent decision. The trace stopped at: "
            f"{str(e).splitlines()[0]}"
        ) from e


def _raise_tracer_refusal(error: BaseException) -> None:
    """Raise a PrecompileError for the tracer's refusal of what fn did; return on any other
    error (fn's own ones reach the caller unchanged)."""
    refusal = tracer_refusal(error)
    if refusal is None:
        return
    where = refusal.where
    if refusal.storage:
        raise PrecompileError(
            f"fn reads or writes a tensor's memory through its storage at {where} "
            "(x.untyped_storage()[i], x.storage()), which the trace cannot record: a graph "
            "takes tensors, not storages. Use tensor operations instead (x.flatten()[i].item() "
            "to read a value, x.view(torch.uint8) for its bytes), or do it outside fn."
        ) from error
    first_line = (str(error).splitlines() or [""])[0]
    raise PrecompileError(
        f"the trace cannot follow fn at {where}: it hands an operator something a graph cannot "
        f"record ({type(error).__name__}: {first_line}). Compute it with tensor operations, "
        "or do it outside fn."
    ) from error


def _returned_reads(recorder: GuardRecorder, leaves: Sequence[Any]) -> list[str]:
    """Where a float fn returns is one a read gave (``loss.item()``). Compared by value (torch
    makes a new float for the caller): floats only, where equal values seldom meet by chance,
    and only for a warning."""
    returned = {leaf for leaf in leaves if type(leaf) is float}
    return [
        g.description
        for g in recorder.guards
        if type(g.expected) is float and g.expected in returned
    ]


def _output_aliases(results: list[Any], flat: tuple[torch.Tensor, ...]) -> tuple[OutputAlias, ...]:
    owners = {storage_id(t): i for i, t in enumerate(flat)}
    aliases: list[OutputAlias] = []
    for out, result in enumerate(results):
        if not isinstance(result, torch.Tensor):
            continue
        source = owners.get(storage_id(result))
        if source is None:
            continue
        if result is flat[source]:
            aliases.append(OutputAlias(out, source))
            continue
        layout = (*result.shape, *result.stride(), result.storage_offset())
        if all(isinstance(v, int) for v in layout):  # a view with symbolic sizes stays a copy
            # An int: the result's offset is (checked above), and the flat inputs' are static.
            offset = cast(int, result.storage_offset() - flat[source].storage_offset())
            aliases.append(
                OutputAlias(out, source, tuple(result.shape), tuple(result.stride()), offset)
            )
    return tuple(aliases)


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A copy with exactly the same layout (strides, offset, even overlap), so that what the
    trace sees of an input's layout is what the caller passes."""
    with torch.no_grad():
        source = t.detach()
        try:
            if type(source) is not torch.Tensor or source.layout is not torch.strided:
                raise NotImplementedError("not a plain strided tensor")
            copy = torch.empty(0, dtype=t.dtype, device=t.device).set_(
                source.untyped_storage().clone(),
                source.storage_offset(),
                source.shape,
                source.stride(),
            )
        except (NotImplementedError, RuntimeError):
            # Subclasses, sparse tensors, or storage access refused (inside another trace).
            copy = source.clone(memory_format=torch.preserve_format)
    return copy.requires_grad_(t.requires_grad)


@contextlib.contextmanager
def fork_rng(tensors: list[torch.Tensor]) -> Any:
    """Run the trace without advancing the caller's random streams (dropout draws)."""
    cuda = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
    with torch.random.fork_rng(devices=cuda):
        yield


def _reject_stray_gradients(
    state: ModelState, flat: Sequence[torch.Tensor], num_params: int
) -> None:
    for name, tensor in zip(state.buffer_names, flat[num_params : len(state.tensors)], strict=True):
        if tensor.grad is not None:
            raise PrecompileError(
                f"buffer {name!r} received a gradient (it has requires_grad=True), but only "
                "parameters get gradients from a precompiled step. Register it with "
                "register_parameter, or make it requires_grad=False."
            )
    if any(t.grad is not None for t in flat[len(state.tensors) :]):
        raise PrecompileError(
            "a runtime input received a gradient; a precompiled step only puts gradients on "
            "model parameters, so the input's gradient would be lost. Make it a parameter of "
            "a module argument, or return torch.autograd.grad(...) from fn instead."
        )


def _dump_in_spec(spec: pytree.TreeSpec) -> str | None:
    try:
        return pytree.treespec_dumps(spec)
    except (NotImplementedError, TypeError):
        return None  # the driver then checks the leaf count only


def _dump_out_spec(spec: pytree.TreeSpec) -> str:
    try:
        return pytree.treespec_dumps(spec)
    except (NotImplementedError, TypeError) as e:
        raise PrecompileError(
            "fn's result structure cannot be written into the artifact (its pytree spec does "
            f"not serialize: {e}). This happens for an unregistered namedtuple; register it "
            "with torch.utils._pytree._register_namedtuple(cls, serialized_type_name=...), or "
            "return a tuple, list or dict."
        ) from e


def _shape(leaf: Any) -> tuple[int, ...] | None:
    return tuple(leaf.shape) if isinstance(leaf, torch.Tensor) else None


def _name_placeholders(gm: torch.fx.GraphModule, layout: _Layout) -> None:
    """Give graph inputs the names of what they hold, so the artifact reads like source."""
    state = layout.state
    names = [
        *("p_" + n for n in state.param_names),
        *("b_" + n for n in state.buffer_names),
        *("in_" + layout.inputs.names[i] for i in layout.tensor_positions),
        *(
            f"{o.name}_{state.param_names[e.param]}_{e.key}"
            for o in layout.optimizers
            for e in o.entries
            if e.param in o.stepped
        ),
        *(
            f"{o.name}_lr_{g}"
            for o in layout.optimizers
            for g in range(len(o.optimizer.param_groups))
        ),
    ]
    names = layout.wrapping.graph_names(names)
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    for node, name in zip(placeholders, names, strict=False):
        rename_node(node, _identifier(name))
        node.target = node.name
    gm.recompile()


def _identifier(text: str) -> str:
    name = re.sub(r"\W+", "_", text).strip("_").lower() or "arg"
    return name + "_" if keyword.iskeyword(name) else name
