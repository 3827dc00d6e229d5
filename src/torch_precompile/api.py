"""The public entry point: the process-wide ``precompile`` object."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard, cast

from torch_precompile import runtime, storage
from torch_precompile.build import ArtifactPair, build
from torch_precompile.errors import PrecompileError
from torch_precompile.options import BuildOptions
from torch_precompile.spec import ArtifactSpec, parse_spec

if TYPE_CHECKING:
    import torch

    from torch_precompile.module_form import PrecompiledModule


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
        device: for a build without the weights, the device the artifact will run on. A
            model created on the ``meta`` device, with meta example inputs, is then traced and
            lowered on stand-ins of that device: nothing of the size of the weights is
            allocated, and the artifact runs with the real model there. A model and inputs
            created under a ``FakeTensorMode`` build the same way (on the fakes' device).
        blocks: repeated blocks compiled once. The children of a ``ModuleList`` or
            ``Sequential`` that share a class (a model's ``layers[i]``) are found, and the
            operations of those whose forward (and backward) came out the same are compiled
            once and run once per block with its own weights: by default (None) where that
            spares enough lowering to pay for the pieces' own builds (deep models), with
            ``True`` wherever blocks repeat; a list of classes names the blocks; ``False``
            compiles the whole graph unrolled. ``inspect`` and the artifact say which blocks
            share code.
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
        device: str | torch.device | None = None,
        blocks: bool | Sequence[type] | None = None,
    ) -> ArtifactPair:
        options = BuildOptions(
            require_all_guards=require_all_guards,
            device=device,
            blocks=blocks,
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

    def for_generate(
        self,
        model: Any,
        path: str | os.PathLike[str],
        *,
        max_cache_len: int,
        batch_sizes: Sequence[int] = (1,),
        **options: Any,
    ) -> Any:
        """Make a transformers causal LM's ``generate()`` run its forward from an artifact.

        ``precompile.for_generate(model, path, max_cache_len=64)`` loads the pair saved at
        ``path``, or builds and saves it first where there is none, and sets
        ``model.forward`` to run it; ``model.generate(...)`` is then called as before. The
        artifact serves a static KV cache of ``max_cache_len`` tokens (set on the model's
        generation config), prompts of 1 to ``max_cache_len`` tokens and decode steps, at
        each of ``batch_sizes``. ``options`` are ``precompile()``'s keywords.
        """
        from torch_precompile.generation import GenerateSettings, for_generate

        settings = GenerateSettings(max_cache_len, tuple(batch_sizes))
        return for_generate(model, path, settings, _module_options(options))

    def stages(
        self,
        make_stage: Callable[[int], tuple[Any, tuple[Any, ...]]],
        num_stages: int,
        stage_index: int,
        **options: Any,
    ) -> PrecompiledModule:
        """Pipeline stages built on one rank: this rank's stage in the module form.

        Call it on every rank of an initialized default process group. ``make_stage(i)``
        returns stage ``i``'s module and example inputs (plain ones: a later stage's input
        that requires grad at the call gets its gradient). Rank 0 builds every stage's pair
        and sends them to every rank (the others trace and compile nothing); each rank then
        wraps its own stage, ``make_stage(stage_index)``'s module. ``options`` as for
        ``module``.
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


def _names_a_file(value: object) -> TypeGuard[str | os.PathLike[str]]:
    """A path, or a non-empty string of one line: an artifact's source always has many."""
    return isinstance(value, os.PathLike) or (
        isinstance(value, str) and bool(value) and "\n" not in value
    )


Precompile.__module__ = "torch_precompile"
precompile = Precompile()
precompile.__doc__ = Precompile.__doc__
