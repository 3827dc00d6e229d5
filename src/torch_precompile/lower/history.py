"""The graphs that give results autograd history, where ``fn`` runs no backward itself.

Two sets of inputs may need gradients at a call: those that required grad at capture (the
model's parameters, mostly), and, besides them, the floating-point input tensors that did not
but may at a call (a pipeline stage's activations, a GAN's generated sample, an input whose
saliency is wanted). Each set gets its own forward and backward (``trace.differentiable``
traces them, the backend lowers them), so a call where no input requires grad runs exactly
the graphs it would without the second pair.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch_precompile import progress
from torch_precompile.lower import LoweredGraph, VariantGraphs, lower_graph
from torch_precompile.spec import Autograd

if TYPE_CHECKING:
    from torch_precompile.options import BuildOptions
    from torch_precompile.trace import Capture

log = logging.getLogger("torch_precompile")


@dataclass(frozen=True)
class WithHistory:
    """A variant's graphs, and the records of its two differentiable forms (None where fn
    runs its backward itself, or no input can require grad at a call)."""

    graphs: VariantGraphs
    autograd: Autograd | None = None
    autograd_for_inputs: Autograd | None = None


@dataclass(frozen=True)
class _Pair:
    """One differentiable form: its record, and its graphs where results get history."""

    record: Autograd
    forward: LoweredGraph | None = None
    backward: LoweredGraph | None = None


def with_history(
    captured: Capture, lowered: LoweredGraph, options: BuildOptions, on_fakes: bool
) -> WithHistory:
    """The plain graph, and where fn runs no backward but its results would carry history,
    the forward and backward graphs that give them history, for each set of inputs."""
    from torch_precompile.trace import differentiable

    spec = captured.spec
    if spec.runs_backward:
        return WithHistory(VariantGraphs(lowered))  # fn runs its backward itself
    inputs = differentiable.differentiable_inputs(spec)
    more = differentiable.inputs_that_may_require_grad(spec)
    if not inputs and not more:
        return WithHistory(VariantGraphs(lowered), Autograd())
    reason = differentiable.why_not_differentiable(spec, captured.fake_mode is not None or on_fakes)
    if reason is None and not options.grad_mode:
        reason = (
            "results carry no autograd history because it was precompiled under torch.no_grad()"
        )
    if reason is not None:
        return WithHistory(
            VariantGraphs(lowered), Autograd(inputs=tuple(inputs), unavailable=reason)
        )
    first = _pair(captured, options, inputs, "") if inputs else _Pair(Autograd())
    if first.record.unavailable is not None or not more:
        second = None
    else:
        second = _pair(captured, options, sorted([*inputs, *more]), _FOR_INPUTS)
    return WithHistory(
        VariantGraphs(
            lowered,
            first.forward,
            first.backward,
            second.forward if second else None,
            second.backward if second else None,
        ),
        first.record,
        second.record if second else None,
    )


_FOR_INPUTS = " for inputs that require grad at a call"


def _pair(captured: Capture, options: BuildOptions, inputs: Sequence[int], which: str) -> _Pair:
    """The forward and backward giving gradients for ``inputs``; where they cannot be built,
    a record saying why (the plain graph serves every call that needs no history)."""
    from torch_precompile.internals.autograd import NoBackward
    from torch_precompile.trace import differentiable

    try:
        with progress.step(f"tracing the backward{which} (results with autograd history)"):
            split = differentiable.differentiate(
                captured, options.backend, _decompositions(options), inputs
            )
        if not split.record.outputs:
            return _Pair(split.record)
        with progress.step(
            f"lowering the forward and backward{which} with the {options.backend} backend"
        ):
            forward = lower_graph(split.forward, options.backend, options.wrapper, options.blocks)
            backward = lower_graph(split.backward, options.backend, options.wrapper, options.blocks)
    except NoBackward:  # as in eager, no result gets history: none needs a backward
        return _Pair(Autograd(inputs=tuple(inputs)))
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0][:200]
        log.warning(
            "results of this artifact will carry no autograd history%s: its backward could not "
            "be built (%s: %s).",
            which,
            type(e).__name__,
            first,
        )
        unavailable = (
            f"results carry no autograd history{which} because its backward could not be "
            f"built ({type(e).__name__}: {first})"
        )
        return _Pair(Autograd(inputs=tuple(inputs), unavailable=unavailable))
    return _Pair(split.record, forward, backward)


def _decompositions(options: BuildOptions) -> Mapping[Any, Callable[..., Any]] | None:
    """The decompositions of the backward's trace: Inductor's own for that backend."""
    if options.backend != "inductor":
        return options.decompositions
    from torch_precompile.internals.inductor import decomposition_table

    return decomposition_table()
