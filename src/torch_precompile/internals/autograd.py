"""AOTAutograd's joint trace and partitioner, as the differentiable form uses them.

``aot_function`` traces a function's forward and backward together and splits the joint
graph into a forward graph (which also returns what the backward needs) and a backward graph
(saved values, then one tangent per output with history, in; one gradient per input out).
Its own runtime is not used: the package takes the two graphs and runs them itself.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.fx

if TYPE_CHECKING:
    from torch._functorch._aot_autograd.schemas import (
        AOTDispatchCompiler,
        ViewAndMutationMeta,
    )

__all__ = ["NoBackward", "SplitGraphs", "is_tangent", "returns_alias", "split_forward_backward"]


class NoBackward(RuntimeError):
    """No traced result depends on an input that requires grad: there is no backward."""


@dataclass(frozen=True)
class SplitGraphs:
    """The two graphs of one differentiable function, and what joined them.

    ``forward`` returns the new value of each input it writes (``written``, in input order),
    the outputs, then the saved values; ``backward`` takes the saved values then the
    tangents, and returns one gradient (or None) per input. ``outputs`` are what the traced
    run returned (real tensors, with history where AOTAutograd gave them one).
    """

    forward: torch.fx.GraphModule
    backward: torch.fx.GraphModule
    outputs: list[torch.Tensor]
    written: list[int]


def split_forward_backward(
    fn: Callable[..., list[torch.Tensor]],
    inputs: Sequence[torch.Tensor],
    min_cut: bool,
    decompositions: Mapping[Any, Callable[..., Any]] | None,
) -> SplitGraphs:
    """Trace ``fn(*inputs)`` (inputs that require grad get gradients) forward and backward.

    ``min_cut`` picks the partitioner Inductor uses (it recomputes cheap values rather than
    saving them); otherwise the default one, which saves what eager autograd saves. The
    backward graph is traced by running a backward of ones through the traced outputs.
    """
    from torch._functorch.aot_autograd import aot_function
    from torch._functorch.partitioners import (
        default_partition,
        min_cut_rematerialization_partition,
    )

    graphs: dict[str, torch.fx.GraphModule] = {}
    written: list[int] = []

    def keep(name: str) -> AOTDispatchCompiler:
        def compiler(gm: torch.fx.GraphModule, _: Any) -> Any:
            graphs[name] = gm
            if name == "forward":  # AOTAutograd's account of the inputs the function writes
                # Set by AOTAutograd before it calls the forward compiler.
                metadata = cast(
                    "ViewAndMutationMeta", torch._guards.TracingContext.get().fw_metadata
                )
                written.extend(metadata.mutated_inp_runtime_indices)
            return _boxed(gm)

        return cast("AOTDispatchCompiler", compiler)

    partition = min_cut_rematerialization_partition if min_cut else default_partition
    traced = aot_function(
        fn,
        fw_compiler=keep("forward"),
        bw_compiler=keep("backward"),
        partition_fn=partition,
        decompositions=dict(decompositions or {}),
    )
    with warnings.catch_warnings(), torch._guards.tracing(torch._guards.TracingContext(None)):
        warnings.simplefilter("ignore")  # AOTAutograd's notes on boxed calling conventions
        outputs = list(traced(*inputs))
        wanted = [o for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad]
        if wanted:
            torch.autograd.backward(wanted, [torch.ones_like(o) for o in wanted])
    if "backward" not in graphs:
        raise NoBackward("no result depends on an input that requires grad")
    return SplitGraphs(graphs["forward"], graphs["backward"], outputs, written)


def _boxed(gm: torch.fx.GraphModule) -> Any:
    # Re-exported there without an explicit `as`, which mypy does not see as an export.
    from torch._functorch.aot_autograd import make_boxed_func  # type: ignore[attr-defined]

    return make_boxed_func(gm)


def is_tangent(node: torch.fx.Node) -> bool:
    """Whether a backward graph's placeholder is a tangent (AOTAutograd names them so)."""
    return node.op == "placeholder" and str(node.target).startswith("tangents")


def returns_alias(node: torch.fx.Node) -> bool:
    """Whether a graph value may share memory with an input or another value (a placeholder,
    or the result of a view operator)."""
    if node.op == "placeholder":
        return True
    schema = getattr(node.target, "_schema", None)
    return bool(
        node.op == "call_function"
        and schema is not None
        and schema.returns
        and schema.returns[0].alias_info is not None
    )
