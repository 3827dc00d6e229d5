"""What a capture recorded, as the artifact spec's records: the arguments, inputs and their
shapes (dynamic dims named), the pytree structures, the models' state and submodules, and the
graph's placeholders named after what they take."""

from __future__ import annotations

import keyword
import re
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.fx

from torch_precompile.errors import PrecompileError
from torch_precompile.internals import pytree, torch_build
from torch_precompile.internals.tracing import rename_node
from torch_precompile.spec import (
    SCHEMA_VERSION,
    Argument,
    ArtifactSpec,
    DynamicDim,
    InputLeaf,
    SizeRelation,
    ValueGuard,
)
from torch_precompile.trace import dynamic
from torch_precompile.trace.arguments import Layout
from torch_precompile.trace.facts.value_guards import GuardRecorder
from torch_precompile.trace.frontends.make_fx import Outputs, Traced, Watch
from torch_precompile.trace.inputs import encode_value
from torch_precompile.trace.optimizers import optimizer_records
from torch_precompile.trace.parallel.dtensor import Distribution
from torch_precompile.trace.state import model_records, submodule_records


def artifact_spec(
    backend: str,
    layout: Layout,
    recorder: GuardRecorder,
    outputs: Outputs,
    traced: Traced,
    watch: Watch,
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


def _input_shapes(layout: Layout, dynamic_inputs: dynamic.DynamicInputs | None) -> _InputShapes:
    names = layout.inputs.names
    shapes: list[Any] = [_shape(leaf) for leaf in layout.inputs.leaves]
    bounds: list[Any] = [None for _ in layout.inputs.leaves]
    if dynamic_inputs is None:
        return _InputShapes(shapes, bounds)
    dynamic.refuse_specialized(dynamic_inputs, names)
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


def symbolic_names(
    layout: Layout, dynamic_inputs: dynamic.DynamicInputs
) -> tuple[dict[int, str], dict[str, str]]:
    """Memory format of each marked flat input, and each size symbol named after its input."""
    flat_index = {leaf: layout.num_state + i for i, leaf in enumerate(layout.tensor_positions)}
    formats = {flat_index[leaf]: name for leaf, name in dynamic_inputs.memory_formats.items()}
    symbol_names = {
        str(symbol): f"input {layout.inputs.names[places[0][0]]} dim {places[0][1]}"
        for symbol, places in zip(dynamic_inputs.symbols, dynamic_inputs.occurrences, strict=True)
    }
    return formats, symbol_names


def _distribution_records(
    sharding: Distribution | None, coordinate_dependent: bool
) -> dict[str, Any]:
    if sharding is None:
        return {}
    return {
        "meshes": sharding.mesh_records(coordinate_dependent),
        "distributed": (*(s.record for s in sharding.inputs.values()), *sharding.results),
    }


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


def name_placeholders(gm: torch.fx.GraphModule, layout: Layout) -> None:
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
