"""How a spec maps onto the compiled graph's flat inputs and outputs.

Flat graph inputs are the model tensors that are not tied to an earlier one (in ``model``
order), then the tensor leaves of ``inputs``, then each ``optimizer_state`` tensor, then one
0-dim float64 learning rate per param group. Graph outputs are ``fn``'s result leaves, then
one gradient per parameter with ``gets_grad``, then one tensor per value guard. A flat input or
result leaf that is a DTensor at the call is a plain local tensor in the graph; its
``DistributedTensor`` record says how to unwrap and rewrap it. One that is another tensor
subclass (torchao's quantized weights) is its inner tensors in the graph: the first in its
place, the others after every flat input (after the value guards, for a result leaf), in
``wrapped`` order; its ``WrappedTensor`` record says how to check and rebuild it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any, cast

from torch_precompile.spec.records import ArtifactSpec, InnerTensor, Layout


def with_strides(spec: ArtifactSpec, strides: Sequence[Layout] | None) -> ArtifactSpec:
    """The spec with the layout a lowering assumes for each flat input (None: any)."""
    if strides is None:
        return spec
    # A DTensor's layout is its local tensor's: the driver checks it after unwrapping.
    local = {d.index: d for d in spec.distributed if d.role == "input"}
    distributed = [
        replace(local[i], local_strides=cast(Any, s)) for i, s in enumerate(strides) if i in local
    ]
    # So is a subclass's: its inner tensors' layouts are recorded with them.
    unwrapped = local.keys() | {w.index for w in spec.wrapped if w.role == "input"}
    # Model and optimizer tensors have static shapes: their layouts are strides, not names.
    flat: Iterator[Any] = iter(None if i in unwrapped else s for i, s in enumerate(strides))
    model = tuple(replace(t, strides=next(flat)) if t.tied_to is None else t for t in spec.model)
    inputs = tuple(
        replace(leaf, strides=next(flat)) if leaf.kind == "tensor" else leaf for leaf in spec.inputs
    )
    state = tuple(replace(t, strides=next(flat)) for t in spec.optimizer_state)
    results = tuple(d for d in spec.distributed if d.role != "input")
    return replace(
        spec,
        model=model,
        inputs=inputs,
        optimizer_state=state,
        distributed=(*distributed, *results),
        wrapped_inner=_inner_strides(spec, strides),
    )


def _inner_strides(spec: ArtifactSpec, strides: Sequence[Layout]) -> tuple[InnerTensor, ...]:
    """Inner tensors of subclass inputs take the strides of their graph inputs: the first at
    the subclass's flat index, the others after every flat input (see the module)."""
    first: dict[int, int | None] = {
        w: r.index for w, r in enumerate(spec.wrapped) if r.role == "input"
    }
    extra = len(strides) - sum(1 for t in spec.wrapped_inner if t.wrapper in first) + len(first)
    inner = []
    for record in spec.wrapped_inner:
        if record.wrapper not in first:
            inner.append(record)
            continue
        held = first[record.wrapper]
        if held is not None:
            position, first[record.wrapper] = held, None
        else:
            position, extra = extra, extra + 1
        layout = strides[position]
        inner.append(replace(record, strides=layout if isinstance(layout, tuple) else None))
    return tuple(inner)
