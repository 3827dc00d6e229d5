"""The build pipeline behind ``precompile()``: capture, lower, then the artifact pair.

``compile_variant`` captures one call of ``fn`` (``trace``) and lowers its graphs (``lower``,
with those that give results autograd history, ``lower.history``); ``package`` renders the
variants into one artifact source (``artifact.render``), seals it and packs the cache.
``build`` is both, for one call.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from torch_precompile import progress
from torch_precompile.artifact import bytecode, envelope, signature
from torch_precompile.errors import PrecompileError
from torch_precompile.frame_room import with_frame_room
from torch_precompile.options import BuildOptions
from torch_precompile.spec import ArtifactSpec, with_strides

if TYPE_CHECKING:
    from torch_precompile.lower import VariantGraphs

# Tracing reparametrizes the caller's modules and swaps their .grad fields, and lowering drives
# process-global compiler state: one capture at a time. Reentrant so that fn may itself call
# precompile; recreated in a forked child, where a holder thread no longer exists.
_lock = threading.RLock()


def _reset_lock() -> None:
    global _lock
    _lock = threading.RLock()


os.register_at_fork(after_in_child=_reset_lock)


class ArtifactPair(NamedTuple):
    """What ``precompile()`` returns: the artifact's source and its cache bytes.

    It unpacks as ``code, cache`` and equals the plain tuple ``(code, cache)``.
    """

    code: str
    cache: bytes


def build(
    fn: Callable[..., Any], example_inputs: tuple[Any, ...], options: BuildOptions | None = None
) -> ArtifactPair:
    """The pipeline behind ``precompile()``; ``options.progress`` hears about each stage."""
    options = options if options is not None else BuildOptions()
    if not callable(fn):
        raise PrecompileError(f"fn must be callable, got {type(fn).__name__}.")
    if not options.compile_on_one_rank:
        return _build(fn, example_inputs, options)
    from torch_precompile.one_rank import build_on_rank_zero

    return ArtifactPair(
        *build_on_rank_zero(lambda: _build(fn, example_inputs, options, on_fakes=True))
    )


def _build(
    fn: Callable[..., Any],
    example_inputs: tuple[Any, ...],
    options: BuildOptions,
    on_fakes: bool = False,
) -> ArtifactPair:
    return package([compile_variant(fn, example_inputs, options, on_fakes)], options)


@dataclass(frozen=True)
class CompiledVariant:
    """One captured call, lowered: its spec (strides and kernels filled in) and its graphs."""

    spec: ArtifactSpec
    graphs: VariantGraphs
    origin: str  # fn's name and where it is defined, for the artifact's header


def compile_variant(
    fn: Callable[..., Any],
    example_inputs: tuple[Any, ...],
    options: BuildOptions,
    on_fakes: bool = False,
    origin: str | None = None,
) -> CompiledVariant:
    """Capture and lower one call of ``fn``; ``options.progress`` hears about each stage.
    ``origin`` says what the header names as captured (default: ``fn`` and its file)."""
    return with_frame_room(lambda: _compile_variant(fn, example_inputs, options, on_fakes, origin))


def _compile_variant(
    fn: Callable[..., Any],
    example_inputs: tuple[Any, ...],
    options: BuildOptions,
    on_fakes: bool,
    origin: str | None,
) -> CompiledVariant:
    report = options.progress or (lambda stage: None)
    # The build pipeline is imported here, not at module level: load() never needs it.
    from torch_precompile.internals.origin import describe_callable
    from torch_precompile.lower import lower_graph
    from torch_precompile.lower.history import with_history
    from torch_precompile.trace import capture
    from torch_precompile.trace.stand_ins import standing_in

    with _lock, standing_in(example_inputs, options.device) as (args, stand_ins):
        report("capture")
        with progress.step("tracing fn (one traced run)"):
            captured = capture(
                fn,
                args,
                options.backend,
                options.decompositions,
                on_fakes=on_fakes,
                tracer=options.tracer,
                stand_ins=stand_ins,
                blocks=options.blocks,
            )
        if options.require_all_guards:
            _refuse_dropped_guards(captured.spec)
        report("lower")
        with progress.step(f"lowering with the {options.backend} backend"):
            lowered = lower_graph(captured, options.backend, options.wrapper, options.blocks)
        built = with_history(captured, lowered, options, on_fakes)
    graphs = built.graphs
    kernels = {k.key: k for g in graphs.all for k in g.kernels}
    spec = dataclasses.replace(
        with_strides(captured.spec, lowered.input_strides),
        autograd=built.autograd,
        autograd_for_inputs=built.autograd_for_inputs,
        wrappers=tuple(g.wrapper for g in graphs.all if g.wrapper is not None),
    ).with_kernels(sorted(kernels.values(), key=lambda k: k.key))
    return CompiledVariant(spec, graphs, origin or describe_callable(fn))


def _refuse_dropped_guards(spec: ArtifactSpec) -> None:
    dropped = [g for g in spec.guards if g.outcome == "dropped"]
    if dropped:
        listed = "; ".join(f"{g.kind} on {g.reads}: {g.by}" for g in dropped[:6])
        more = f" (and {len(dropped) - 6} more)" if len(dropped) > 6 else ""
        raise PrecompileError(
            f"require_all_guards=True: Dynamo put {len(dropped)} guard(s) on what fn read that "
            f"no call of the artifact can check: {listed}{more}. Make those values arguments of "
            "fn or globals of an importable module, or leave require_all_guards out (inspect "
            "then lists them as dropped)."
        )


def package(variants: Sequence[CompiledVariant], options: BuildOptions) -> ArtifactPair:
    """The pair holding ``variants`` (the first is the top level of the spec); kernels the
    variants share are built and cached once."""
    from torch_precompile.artifact.kernel_payload import merged_payloads
    from torch_precompile.artifact.render import render

    (options.progress or (lambda stage: None))("render")
    spec = variants[0].spec.with_variants([v.spec for v in variants[1:]])
    with progress.step("writing the artifact source"):
        python_code, compiled = bytecode.seal(
            render(
                spec, [v.graphs for v in variants], tracer=options.tracer, origin=variants[0].origin
            )
        )
    payloads = [
        g.acceleration for v in variants for g in v.graphs.all if g.acceleration is not None
    ]
    acceleration = (
        (payloads[0] if len(payloads) <= 1 else merged_payloads(payloads)) if payloads else None
    )
    cache = envelope.pack(options.backend, python_code, acceleration, compiled)
    if options.sign_key is not None:
        cache = signature.sign(options.sign_key, python_code, cache)
    return ArtifactPair(python_code, cache)
