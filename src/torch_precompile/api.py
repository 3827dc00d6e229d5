"""The public entry point: the process-wide ``precompile`` object."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TypeGuard, cast

from torch_precompile import progress, runtime, storage
from torch_precompile.artifact import bytecode, envelope, signature
from torch_precompile.errors import PrecompileError
from torch_precompile.spec import ArtifactSpec, parse_spec, with_strides

if TYPE_CHECKING:
    from torch_precompile.lower import VariantGraphs
    from torch_precompile.module_form import PrecompiledModule

BACKENDS = ("inductor", "eager")
TRACERS = ("make_fx", "dynamo")
WRAPPERS = ("auto", "cpp", "python")

# Tracing reparametrizes the caller's modules and swaps their .grad fields, and lowering drives
# process-global compiler state: one capture at a time. Reentrant so that fn may itself call
# precompile; recreated in a forked child, where a holder thread no longer exists.
_lock = threading.RLock()
log = logging.getLogger("torch_precompile")


def _reset_lock() -> None:
    global _lock
    _lock = threading.RLock()


os.register_at_fork(after_in_child=_reset_lock)


class Precompile:
    """Precompile a whole PyTorch computation ahead of time; load it back in any process.

    ``python_code, cache = precompile(fn, *example_inputs)`` traces ``fn`` once on the example
    arguments (``nn.Module`` arguments are models, passed again at every call; the rest are
    runtime inputs) and returns a self-contained Python source plus cache bytes, as an
    ``ArtifactPair`` (a named tuple: ``.code``, ``.cache``).
    ``precompile.load(python_code, cache)`` returns a callable taking the same arguments.

    Where ``fn`` runs no backward and its results depend on tensors that require grad, the
    artifact also holds a compiled forward and backward: under grad mode its results carry
    autograd history, so the caller's own ``backward()`` works as with eager (see
    ``precompile.module``). Called under ``torch.no_grad()``, ``precompile`` builds no backward
    (an inference artifact).

    Args:
        fn: the whole computation, e.g. ``lambda m, x: m(x)`` or a training step that calls
            ``loss.backward()`` (gradients then land on the runtime model's ``.grad``).
        example_inputs: positional arguments for one call of ``fn``.
        backend: ``"inductor"`` (compiled kernels) or ``"eager"`` (the captured ATen graph).
        wrapper: for the inductor backend, what calls the kernels: ``"auto"`` (the default:
            Inductor's C++ wrapper wherever it can run the graph, else its Python wrapper),
            ``"cpp"`` (the C++ wrapper, built into the cache beside the kernels; the Python one
            is used, with a warning, where it cannot be) or ``"python"``. The artifact and
            ``inspect`` say which one runs, and why.
        tracer: ``"make_fx"`` (the default: one traced run records the tensor operations) or
            ``"dynamo"`` (Dynamo also reads fn's Python, and each guard it puts on what the
            code read becomes a check of the artifact, or is reported dropped; see
            docs/TRACERS.md).
        require_all_guards: with ``tracer="dynamo"``, refuse a capture that dropped a guard
            no call can check (a value fn closes over).
        decompositions: optional ``{OpOverload: fn}`` table applied while tracing.
        sign_key: optional bytes; the returned cache then carries an HMAC over the pair, which
            ``load(..., verify_key=...)`` checks before anything is executed.
        progress: optional callable, told the name of each stage as it starts: ``"capture"``,
            ``"lower"`` (kernel builds happen here), ``"render"``.
        compile_on_one_rank: call it on every rank of an initialized default process group:
            rank 0 traces (on fake tensors, so no collective waits) and lowers, and every rank
            returns rank 0's pair. A rank the artifact cannot serve (another shard shape, a
            graph that depends on the rank) gets a ``PrecompileError`` at its first call.
    """

    PrecompileError = PrecompileError
    __name__ = __qualname__ = "precompile"

    def __call__(
        self,
        fn: Callable[..., Any],
        *example_inputs: Any,
        backend: str = "inductor",
        tracer: str = "make_fx",
        decompositions: Mapping[Any, Callable[..., Any]] | None = None,
        sign_key: bytes | None = None,
        progress: Callable[[str], None] | None = None,
        compile_on_one_rank: bool = False,
        wrapper: str = "auto",
        require_all_guards: bool = False,
    ) -> ArtifactPair:
        options = BuildOptions(
            require_all_guards=require_all_guards,
            backend=backend,
            tracer=tracer,
            decompositions=decompositions,
            sign_key=sign_key,
            progress=progress,
            compile_on_one_rank=compile_on_one_rank,
            wrapper=wrapper,
        )
        return build(fn, example_inputs, options)

    def load(
        self,
        python_code: str | os.PathLike[str],
        cache: bytes | str | os.PathLike[str] | None = None,
        *,
        verify_key: bytes | None = None,
        require_prebuilt: bool = False,
    ) -> runtime.LoadedArtifact:
        """Load an artifact pair: check it, then execute ``python_code``.

        Takes the pair itself, ``(python_code, cache)`` as ``precompile()`` returned it, or
        the files holding it, ``(artifact_path, cache_path)`` as ``capture()`` or ``save``
        wrote them (a one-line string or a path is a file's name; a cache path left out means
        the cache beside the source that belongs to it, as ``load_file`` finds it). ``cache``
        may be None (or unusable, with a warning): the artifact then builds its kernels on
        first use. A cache from another ``precompile()`` call is refused. With
        ``verify_key``, a pair whose signature is missing or wrong is refused before anything
        is unpickled or executed. With ``require_prebuilt`` (or the environment variable
        ``TORCH_PRECOMPILE_REQUIRE_PREBUILT=1``, for every load in the process), a load or
        call that would build a kernel (no usable cache, a cache lacking an object the source
        names) raises ``PrecompileError`` naming what is missing; an eager artifact builds
        nothing and loads as before.
        """
        absence = None
        if _names_a_file(python_code):
            if cache is None:
                saved = storage.read_saved(python_code)
                python_code, cache, absence = saved.code, saved.cache, saved.absence
            elif _names_a_file(cache):
                python_code, cache = storage.read_pair(python_code, cache)
            else:
                python_code = storage.read_source(Path(python_code))
        elif _names_a_file(cache):
            cache = storage.read_cache(Path(cache))
        # What names a file was read above: the source is a str, the cache bytes or None.
        return runtime.load(
            cast(str, python_code),
            cast("bytes | None", cache),
            verify_key=verify_key,
            require_prebuilt=require_prebuilt,
            cache_absence=absence,
        )

    def module(
        self,
        model: Any,
        *example_inputs: Any,
        example_kwargs: Mapping[str, Any] | None = None,
        modes: Sequence[str] | None = None,
        artifact: runtime.LoadedArtifact | None = None,
        **options: Any,
    ) -> PrecompiledModule:
        """``model`` as an ``nn.Module`` whose ``forward`` runs a precompiled artifact.

        It holds ``model`` (its parameters, ``state_dict()``, ``train()``, ``eval()`` and
        ``to()`` are the model's) and its results carry autograd history where eager's would,
        so code that calls ``backward()`` and steps an optimizer itself takes it as is.
        ``precompile.module(model, x, example_kwargs={...})`` captures ``model(x, **kwargs)``
        in each of ``modes`` (``"train"``, ``"eval"``; default: the model's current one), each
        a variant; a call in another mode is refused. ``options`` are ``precompile()``'s
        keywords. ``precompile.module(model, artifact=precompile.load(path))`` wraps an
        artifact saved earlier (``wrapped.save(path)``) instead of building one.
        """
        from torch_precompile.module_form import build_module, wrap_loaded

        if artifact is not None:
            if example_inputs or example_kwargs or modes or options:
                raise PrecompileError(
                    "precompile.module(model, artifact=...) wraps a loaded artifact as it is; "
                    "it takes no examples, modes or build options."
                )
            return wrap_loaded(model, artifact)
        return build_module(
            model,
            example_inputs,
            example_kwargs,
            tuple(modes) if modes is not None else None,
            _module_options(options),
        )

    def stages(
        self,
        make_stage: Callable[[int], tuple[Any, tuple[Any, ...]]],
        num_stages: int,
        stage_index: int,
        **options: Any,
    ) -> PrecompiledModule:
        """Pipeline stages built on one rank: this rank's stage in the module form.

        Call it on every rank of an initialized default process group. ``make_stage(i)``
        returns stage ``i``'s module and example inputs (a later stage's input requiring
        grad, as the schedule passes it). Rank 0 builds every stage's pair and sends them to
        every rank (the others trace and compile nothing); each rank then wraps its own stage,
        ``make_stage(stage_index)``'s module. ``options`` as for ``module``.
        """
        from torch_precompile.module_form import build_stages

        return build_stages(make_stage, num_stages, stage_index, _module_options(options))

    def save(
        self,
        python_code: str,
        cache: bytes | None,
        path: str | os.PathLike[str],
        *,
        sign_key: bytes | None = None,
    ) -> Path:
        """Write the pair to ``path`` (the source) and a cache file beside it, atomically.

        With ``sign_key`` the saved cache carries an HMAC over both. Returns ``path``.
        """
        return storage.save(python_code, cache, path, sign_key=sign_key)

    def inspect(self, python_code: str) -> ArtifactSpec:
        """The typed spec of an artifact: its calling convention, read without executing it.

        Raises ``PrecompileError`` for a source that is not an artifact, or one whose spec
        schema version this torch-precompile cannot read.
        """
        return parse_spec(python_code)

    def load_file(
        self,
        path: str | os.PathLike[str],
        *,
        verify_key: bytes | None = None,
        require_prebuilt: bool = False,
    ) -> runtime.LoadedArtifact:
        """Load a pair written by ``save`` (or ``capture``); ``verify_key`` and
        ``require_prebuilt`` as in ``load``.

        The cache is the one beside ``path`` that belongs to its source: the one named after
        the source's hash, else any ``*.cache`` there made for this source (a source renamed
        or copied, a cache path of your choosing). Without one, a warning names what lies
        there instead and the artifact runs from the source alone.
        """
        saved = storage.read_saved(path)
        return runtime.load(
            saved.code,
            saved.cache,
            verify_key=verify_key,
            require_prebuilt=require_prebuilt,
            cache_absence=saved.absence,
        )

    def __repr__(self) -> str:
        return "torch_precompile.precompile"

    def __reduce__(self) -> str:
        return "precompile"

    def __copy__(self) -> Precompile:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Precompile:
        return self


_MODULE_OPTIONS = {"backend", "wrapper", "decompositions", "sign_key", "progress"}


def _module_options(options: Mapping[str, Any]) -> BuildOptions:
    unknown = sorted(set(options) - _MODULE_OPTIONS)
    if unknown:
        raise PrecompileError(
            f"got unknown keywords {unknown}; the module form takes precompile()'s build "
            f"keywords ({', '.join(sorted(_MODULE_OPTIONS))})."
        )
    return BuildOptions(**options)


def _grad_mode() -> bool:
    import torch

    return torch.is_grad_enabled()


def _names_a_file(value: object) -> TypeGuard[str | os.PathLike[str]]:
    """A path, or a non-empty string of one line: an artifact's source always has many."""
    return isinstance(value, os.PathLike) or (
        isinstance(value, str) and bool(value) and "\n" not in value
    )


class ArtifactPair(NamedTuple):
    """What ``precompile()`` returns: the artifact's source and its cache bytes.

    It unpacks as ``code, cache`` and equals the plain tuple ``(code, cache)``.
    """

    code: str
    cache: bytes


@dataclass(frozen=True)
class BuildOptions:
    """How ``precompile()`` builds an artifact; the keywords of ``precompile()``, checked once
    when made (see ``Precompile`` for each one's meaning)."""

    backend: str = "inductor"
    tracer: str = "make_fx"
    decompositions: Mapping[Any, Callable[..., Any]] | None = None
    sign_key: bytes | None = None
    progress: Callable[[str], None] | None = None
    compile_on_one_rank: bool = False
    wrapper: str = "auto"
    require_all_guards: bool = False
    # Whether precompile() was called under grad mode: where it was not, results of an fn
    # without a backward carry no history, and no backward graph is built.
    grad_mode: bool = dataclasses.field(default_factory=lambda: _grad_mode())

    def __post_init__(self) -> None:
        if self.wrapper not in WRAPPERS:
            raise PrecompileError(f"wrapper must be one of {WRAPPERS}, got {self.wrapper!r}.")
        if self.wrapper == "cpp" and self.backend != "inductor":
            raise PrecompileError(
                f"wrapper={self.wrapper!r} chooses how the inductor backend calls its kernels; "
                f"backend={self.backend!r} has none. Leave wrapper out, or use "
                "backend='inductor'."
            )
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}.")
        if self.tracer not in TRACERS:
            raise ValueError(f"tracer must be one of {TRACERS}, got {self.tracer!r}.")
        if self.require_all_guards and self.tracer != "dynamo":
            raise PrecompileError(
                "require_all_guards=True asks about the guards of tracer='dynamo'; the make_fx "
                "tracer keeps none. Pass tracer='dynamo' too, or leave require_all_guards out."
            )
        if self.decompositions is not None and not isinstance(self.decompositions, Mapping):
            raise PrecompileError(
                "decompositions must be a mapping {OpOverload: function} or None, got "
                f"{type(self.decompositions).__name__}."
            )


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
    report = options.progress or (lambda stage: None)
    # The build pipeline is imported here, not at module level: load() never needs it.
    from torch_precompile.internals.origin import describe_callable
    from torch_precompile.lower import lower_graph
    from torch_precompile.lower.history import with_history
    from torch_precompile.trace import capture

    with _lock:
        report("capture")
        with progress.step("tracing fn (one traced run)"):
            captured = capture(
                fn,
                example_inputs,
                options.backend,
                options.decompositions,
                on_fakes=on_fakes,
                tracer=options.tracer,
            )
        if options.require_all_guards:
            _refuse_dropped_guards(captured.spec)
        report("lower")
        with progress.step(f"lowering with the {options.backend} backend"):
            lowered = lower_graph(captured, options.backend, options.wrapper)
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


Precompile.__module__ = "torch_precompile"
precompile = Precompile()
precompile.__doc__ = Precompile.__doc__
