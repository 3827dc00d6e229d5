"""Capture: one non-strict ``make_fx`` trace of ``fn`` with the model state lifted to inputs."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.fx

from torch_precompile.errors import PrecompileError
from torch_precompile.internals import storage_id
from torch_precompile.internals.dynamo import DynamoReading
from torch_precompile.spec import ArtifactSpec
from torch_precompile.trace import checks
from torch_precompile.trace.arguments import Layout, read_layout
from torch_precompile.trace.facts.ambient import refuse_users_modes
from torch_precompile.trace.facts.hooks import (
    assigned_names,
    hook_functions,
    named_function,
    reachable_containers,
    reachable_state,
    refuse_iterators,
    refuse_unreplayable_modules,
)
from torch_precompile.trace.facts.python_state import put_back, refuse_changes, take_snapshot
from torch_precompile.trace.facts.reads import drop_changed_reads
from torch_precompile.trace.facts.value_guards import GuardRecorder
from torch_precompile.trace.frontends import dynamo_guards
from torch_precompile.trace.frontends.dynamo_breaks import refuse_breaks
from torch_precompile.trace.frontends.make_fx import (
    Outputs,
    Traced,
    Watch,
    flat_function,
    fork_rng,
    run_trace,
)
from torch_precompile.trace.optimizers import kept_entries
from torch_precompile.trace.parallel import data_parallel
from torch_precompile.trace.parallel.dtensor import name_collectives, refuse_inplace_collectives
from torch_precompile.trace.recorded import artifact_spec, name_placeholders, symbolic_names
from torch_precompile.trace.stand_ins import StandIns

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
    stand_ins: StandIns | None = None,
    blocks: bool | Sequence[type] | None = None,
) -> Capture:
    """Trace ``fn(*args)`` once; lift module state; harvest gradients; enforce invariants.

    ``on_fakes`` traces on fake tensors, so that nothing runs and no collective communicates
    (one rank capturing for all), and checks whether the graph depends on the rank.
    ``stand_ins``: the arguments' tensors are fakes standing in for the weights (a build
    without them), traced as they are. ``blocks`` chooses the repeated blocks whose
    operations are marked (``trace.blocks``). With
    ``tracer="dynamo"`` Dynamo reads fn's Python first (see ``trace.dynamo_guards``).
    """
    refuse_users_modes()
    layout = read_layout(fn, args, backend, on_fakes, stand_ins)
    recorder, outputs = GuardRecorder(), Outputs()
    watch = Watch(layout, blocks)
    watch.reads.hold(fn)
    refuse_unreplayable_modules(watch.named_submodules())
    flat_fn = flat_function(fn, layout, recorder, outputs, watch)
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
        _refuse_unread(layout, on_fakes, stand_ins is not None)
    try:
        traced = run_trace(flat_fn, layout, recorder, decompositions, on_fakes, stand_ins)
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
    said = watch.reads.output_report(tracer)
    if said is not None and tracer == "dynamo":
        raise PrecompileError(said)
    reports = (
        # Under Dynamo, each value fn closes over is a dropped guard, said with the others.
        watch.reads.closure_report() if tracer != "dynamo" else None,
        watch.reads.clock_report(),
        said,
        outputs.returned_reads_report(),
    )
    for unchecked in reports:
        if unchecked is not None:  # in the graph, beyond any call's reach: said at capture
            log.warning(unchecked)
    _refuse_aliased_writes(layout, traced.mutated)
    traced = _drop_unstepped_state(traced, layout)
    _drop_constant_guards(traced.graph, recorder, outputs)
    gm = traced.graph
    refuse_inplace_collectives(gm)
    checks.refuse_control_flow(gm)
    checks.refuse_effects(gm)
    checks.refuse_own_generators(gm)
    if layout.sharding is not None or layout.data_parallel:
        stable = data_parallel.stable_group_names(layout.data_parallel)
        if layout.sharding is not None:
            stable.update(layout.sharding.group_names())
        name_collectives(gm, stable)
    literals = checks.lift_literals(
        gm,
        checks.origin_finder(fn, [(layout.arg_names[i], args[i]) for i in layout.module_positions]),
    )
    name_placeholders(gm, layout)
    spec = artifact_spec(backend, layout, recorder, outputs, traced, watch)
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
        *symbolic_names(layout, traced.dynamic_inputs),
    )


def _refuse_unread(layout: Layout, on_fakes: bool, weightless: bool) -> None:
    """What the dynamo tracer does not read yet, refused by name before anything runs."""
    unread = [
        what
        for what, present in (
            ("a capture on one rank for all (compile_on_one_rank)", on_fakes),
            ("a build without the weights (meta or fake tensors)", weightless),
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


def _read_with_dynamo(fn: Callable[..., Any], layout: Layout, before: Any) -> DynamoReading:
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
    refuse_breaks(reading)
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
    layout: Layout,
    watch: Watch,
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


def _refuse_swapped_data(layout: Layout, swapped: Sequence[int], before: Any) -> None:
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


def _refuse_input_layout_changes(layout: Layout, examples: Sequence[torch.Tensor]) -> None:
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


def _drop_constant_guards(
    gm: torch.fx.GraphModule, recorder: GuardRecorder, outputs: Outputs
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


def _drop_unstepped_state(traced: Traced, layout: Layout) -> Traced:
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


def _refuse_aliased_writes(layout: Layout, mutated: Sequence[int]) -> None:
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
