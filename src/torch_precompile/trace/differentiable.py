"""The differentiable form: a forward and a backward graph for a capture that runs no backward.

When ``fn`` returns results that depend on tensors requiring grad and runs no backward itself,
the user's own code will: a training loop, a pipeline schedule. The captured graph is traced
again through AOTAutograd, which splits forward from backward; each becomes a capture of its
own for the backend to lower. At a call under grad mode the artifact runs the forward and
hands the backward to autograd (see ``driver/autograd.py``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.fx

from torch_precompile.errors import PrecompileError
from torch_precompile.internals.autograd import (
    SplitGraphs,
    is_tangent,
    returns_alias,
    split_forward_backward,
)
from torch_precompile.internals.tracing import (
    BAKED_READS,
    rename_node,
    reshape_unwritten_views,
)
from torch_precompile.spec import ArtifactSpec, Autograd
from torch_precompile.trace.blocks import carry_marks, take_marks
from torch_precompile.trace.core import Capture
from torch_precompile.trace.frontends.make_fx import fork_rng

if TYPE_CHECKING:
    from torch_precompile.spec import InputLeaf, ModelTensor


@dataclass(frozen=True)
class Differentiable:
    """A capture's forward (its outputs, then the saved values) and backward graphs."""

    forward: Capture
    backward: Capture
    record: Autograd


def differentiable_inputs(spec: ArtifactSpec) -> list[int]:
    """The flat inputs that required grad at capture (parameters, input tensors)."""
    tensors: list[ModelTensor | InputLeaf] = [*spec.interned, *spec.tensor_inputs]
    return [i for i, t in enumerate(tensors) if t.requires_grad]


def inputs_that_may_require_grad(spec: ArtifactSpec) -> list[int]:
    """The flat input tensors that did not require grad at capture but may at a call: those
    of a floating-point or complex dtype (token ids never do) that fn does not write in
    place (autograd refuses an in-place write to a leaf that requires grad)."""
    first = len(spec.interned)
    return [
        first + n
        for n, leaf in enumerate(spec.tensor_inputs)
        if not leaf.requires_grad
        and _differentiable_dtype(leaf.dtype)
        and first + n not in spec.mutated
    ]


def _differentiable_dtype(name: str | None) -> bool:
    dtype = getattr(torch, (name or "").removeprefix("torch."), None)
    return isinstance(dtype, torch.dtype) and (dtype.is_floating_point or dtype.is_complex)


def why_not_differentiable(spec: ArtifactSpec, dynamic: bool) -> str | None:
    """Why this capture's results cannot carry history, if they cannot."""
    reasons = (
        (dynamic, "dims are marked dynamic"),
        (bool(spec.meshes), "it takes DTensors"),
        (bool(spec.wrapped), "it takes tensor subclasses"),
        (
            bool(spec.data_parallel or spec.fully_sharded),
            "it takes DistributedDataParallel or fully_shard models",
        ),
        (bool(spec.output_aliases), "fn returns an input or a view of one"),
        (_backward_hooks(spec), "a module has backward hooks (they would run at capture only)"),
    )
    for applies, reason in reasons:
        if applies:
            return (
                f"results carry no autograd history because {reason}, which the "
                "differentiable form does not support yet"
            )
    return None


def _backward_hooks(spec: ArtifactSpec) -> bool:
    """Whether a module or the process holds module backward hooks."""
    sets = [*spec.global_hooks, *(h for m in spec.submodules for h in m.hooks)]
    return any(kind.startswith("backward") and names for kind, names in sets)


def differentiate(
    capture: Capture,
    backend: str,
    decompositions: Mapping[Any, Callable[..., Any]] | None,
    inputs: Sequence[int],
) -> Differentiable:
    """Split ``capture`` (whose fn ran no backward) into its forward and a backward that gives
    gradients for the flat ``inputs``."""
    inputs = sorted(inputs)
    gm = capture.graph
    outputs = list(cast("Sequence[Any]", gm.graph.output_node().args[0]))
    tensor_slots = [i for i, o in enumerate(outputs) if isinstance(o, torch.fx.Node)]
    split = _traced(capture, inputs, tensor_slots, backend, decompositions)
    take_marks(split.forward.graph, "forward")
    take_marks(split.backward.graph, "backward")
    mutated = split.written
    with_history = [n for n, o in enumerate(split.outputs) if o.requires_grad]
    placeholders = list(split.backward.graph.find_nodes(op="placeholder"))
    num_tangents = sum(is_tangent(p) for p in placeholders)
    if num_tangents != len(with_history):  # the others are for inputs written in place
        raise PrecompileError(
            "fn writes values that carry autograd history into an input or buffer in place "
            "(a key-value cache, say), which the differentiable form does not carry yet"
        )
    num_saved = len(placeholders) - num_tangents
    # AOTAutograd returns the new values of the inputs fn writes (BatchNorm statistics) first;
    # the forward graph writes them back, as the capture did.
    forward = _forward_graph(split.forward, gm, outputs, tensor_slots, mutated, num_saved)
    saved_values = [p.meta.get("val") for p in placeholders if not is_tangent(p)]
    saved_nodes = list(cast("Sequence[Any]", forward.graph.output_node().args[0]))[len(outputs) :]
    backward = _backward_graph(
        split.backward,
        len(capture.example_inputs),
        inputs,
        [
            *(node.name for node in saved_nodes),
            *(f"grad_of_result_{tensor_slots[n]}" for n in with_history),
        ],
    )
    record = Autograd(
        inputs=tuple(inputs),
        outputs=tuple(tensor_slots[n] for n in with_history),
        tangent_strides=tuple(tuple(split.outputs[n].stride()) for n in with_history),
        saved=tuple(
            _saved_entry(node, value) for node, value in zip(saved_nodes, saved_values, strict=True)
        ),
    )
    backward_examples = [
        *(_example(v) for v in saved_values),
        *(torch.zeros_like(split.outputs[n]) for n in with_history),
    ]
    return Differentiable(
        dataclasses.replace(capture, graph=forward),
        Capture(backward, [], _backward_spec(capture.spec), backward_examples),
        record,
    )


def _traced(
    capture: Capture,
    inputs: list[int],
    tensor_slots: list[int],
    backend: str,
    decompositions: Mapping[Any, Callable[..., Any]] | None,
) -> SplitGraphs:
    """AOTAutograd's forward and backward of the captured graph's tensor results; a result
    that may alias an input or another result is returned as a copy."""
    outputs = list(cast("Sequence[Any]", capture.graph.graph.output_node().args[0]))
    copies = {i for i in tensor_slots if returns_alias(outputs[i])}
    retraced = _without_baked_reads(capture.graph)
    # Its forward and backward are cut into blocks as it is; the min-cut partitioner's
    # recomputations would interleave the blocks' operations, so that cutting takes the
    # partitioner that saves what eager saves.
    marked = carry_marks(retraced.graph)
    interpreter = torch.fx.Interpreter(retraced)

    def pure(*flat: torch.Tensor) -> list[torch.Tensor]:
        results = interpreter.run(*flat)
        return [results[i].clone() if i in copies else results[i] for i in tensor_slots]

    # Copies: the traced run writes what fn writes (BatchNorm statistics), and the examples
    # include the caller's own buffers.
    examples = [
        t.detach().clone().requires_grad_(i in inputs)
        for i, t in enumerate([*capture.example_inputs, *capture.literals])
    ]
    # The graph already holds autocast's casts: it is traced with autocast off.
    with fork_rng(examples), contextlib.ExitStack() as stack:
        for device in sorted({t.device.type for t in examples}):
            stack.enter_context(torch.autocast(device, enabled=False))
        return split_forward_backward(
            pure,
            examples,
            min_cut=backend == "inductor" and not marked,
            decompositions=decompositions,
        )


def _without_baked_reads(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy without the reads of tensor values the trace decided on (the value guards check
    them): they cannot run on the fake tensors AOTAutograd traces with. Its views that nothing
    writes through are reshapes, which the retrace's strides need not match."""
    graph = copy.deepcopy(gm.graph)
    for node in reversed(list(graph.nodes)):
        if node.op == "call_function" and node.target in BAKED_READS and not node.users:
            graph.erase_node(node)
    reshape_unwritten_views(graph)  # views recorded on eager's strides (see that function)
    return torch.fx.GraphModule(gm, graph)


def _forward_graph(
    aot_forward: torch.fx.GraphModule,
    captured: torch.fx.GraphModule,
    outputs: list[Any],
    tensor_slots: list[int],
    mutated: list[int],
    num_saved: int,
) -> torch.fx.GraphModule:
    """AOTAutograd's forward with the capture's calling convention: the same inputs (named
    as the capture names them), the writes to mutated inputs done in the graph, the capture's
    outputs (constants included), then the saved values."""
    graph = aot_forward.graph
    placeholders = list(graph.find_nodes(op="placeholder"))
    for node, original in zip(
        placeholders, captured.graph.find_nodes(op="placeholder"), strict=True
    ):
        rename_node(node, original.name)
        node.target = node.name
    output = graph.output_node()
    values = list(cast("Sequence[Any]", output.args[0]))
    new_values, rest = values[: len(mutated)], values[len(mutated) :]
    if len(rest) != len(tensor_slots) + num_saved:
        raise PrecompileError(
            "internal: AOTAutograd's forward returns values this package does not place "
            f"({len(values)} for {len(mutated)} written inputs, {len(tensor_slots)} results "
            f"and {num_saved} saved values)"
        )
    with graph.inserting_before(output):
        for index, value in zip(mutated, new_values, strict=True):
            graph.call_function(torch.ops.aten.copy_.default, (placeholders[index], value))
    results = list(outputs)
    for slot, value in zip(tensor_slots, rest, strict=False):
        results[slot] = value
    output.args = ([*results, *rest[len(tensor_slots) :]],)
    graph.lint()
    gm = torch.fx.GraphModule(aot_forward, graph)
    gm.recompile()
    return gm


def _backward_graph(
    aot_backward: torch.fx.GraphModule, num_flat: int, inputs: list[int], names: list[str]
) -> torch.fx.GraphModule:
    """AOTAutograd's backward, returning a gradient for each differentiable flat input only
    (literals and other inputs get none). Each saved value is named as the forward names it,
    each tangent after the result it belongs to."""
    graph = aot_backward.graph
    for node, name in zip(graph.find_nodes(op="placeholder"), names, strict=True):
        rename_node(node, name)
        node.target = node.name
    output = graph.output_node()
    grads = list(cast("Sequence[Any]", output.args[0]))[:num_flat]
    output.args = ([grads[i] for i in inputs],)
    graph.eliminate_dead_code()
    gm = torch.fx.GraphModule(aot_backward, graph)
    gm.recompile()
    return gm


def _backward_spec(spec: ArtifactSpec) -> ArtifactSpec:
    """The spec a lowering reads for the backward graph: no driver-checked inputs (Inductor
    keeps its own layout asserts), no aliases, nothing written."""
    return dataclasses.replace(
        spec, model=(), inputs=(), output_aliases=(), mutated=(), value_guards=(), variants=()
    )


def _example(value: Any) -> torch.Tensor:
    """A real tensor standing in for a saved value the backward graph takes."""
    if not isinstance(value, torch.Tensor):
        raise PrecompileError(
            "internal: the backward graph takes a saved value that is not a tensor"
        )
    return torch.empty_strided(
        value.shape, value.stride(), dtype=value.dtype, device=value.device
    ).zero_()


def _saved_entry(node: torch.fx.Node, value: torch.Tensor) -> str:
    """What a saved value is, for ``inspect``: a flat input by name, or an activation."""
    shape = ", ".join(str(s) for s in value.shape)
    kind = node.name if node.op == "placeholder" else "activation"
    return f"{kind}: {str(value.dtype).removeprefix('torch.')}[{shape}]"
