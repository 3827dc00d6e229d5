"""``capture``: precompile inside the caller's own loop, writing the pair when the block ends.

    with capture(step, artifact_path="step.py") as cap:
        loss = cap(model, x, target)      # runs for real; this call is the one captured
    run = precompile.load("step.py")

Each call is run for real by the artifact built so far, so its result, gradients and state
updates are the artifact's own. A call the artifact does not fit (another batch size, another
Python value, the model in another mode: whatever its checks refuse) is traced as
``precompile()`` traces it and becomes one more variant of the same artifact; a call that fits
an existing variant runs it. The loaded artifact picks a variant the same way at every call.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from torch_precompile import runtime, storage
from torch_precompile.build import ArtifactPair, CompiledVariant, build, compile_variant, package
from torch_precompile.errors import PrecompileError
from torch_precompile.options import BuildOptions


class _State(enum.Enum):
    NEW = "not entered yet"
    OPEN = "open"
    CLOSED = "closed"


class CaptureSession:
    """The object ``capture()`` returns: enter it, call it like ``fn``, leave it."""

    def __init__(
        self,
        fn: Callable[..., Any],
        artifact_path: Path,
        cache_path: Path | None,
        options: BuildOptions,
        save_each: bool = False,
    ) -> None:
        self._fn = fn
        self.artifact_path = artifact_path
        self.cache_path = cache_path
        self._options = options
        self._save_each = save_each
        self._state = _State.NEW
        self._pair: ArtifactPair | None = None
        self._variants: list[CompiledVariant] = []
        self._forward: Any = None  # the loaded artifact's dispatch: Driver or Variants
        self._saved = False

    def __enter__(self) -> CaptureSession:
        if self._state is not _State.NEW:
            raise PrecompileError("a capture is single-use: call capture() again to capture again.")
        self._state = _State.OPEN
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._state is not _State.OPEN:
            raise PrecompileError(
                f"this capture is {self._state.value}: call it inside its with block."
            )
        if kwargs:
            raise PrecompileError(
                f"call the capture with positional arguments only (got {sorted(kwargs)}): the "
                "artifact matches arguments by position, at capture and at every call."
            )
        if self._forward is not None:
            try:
                checked = self._forward.checked(args, {})
            except PrecompileError:
                pass  # a call of another kind: it becomes a variant
            else:
                return self._forward.run(args, checked)
        self._add_variant(args)
        if self._save_each:
            # Before the call runs: a process killed inside it keeps every variant so far.
            self.save()
        return self._forward(*args)

    def _add_variant(self, args: tuple[Any, ...]) -> None:
        if self._options.compile_on_one_rank:
            if self._pair is not None:
                raise PrecompileError(
                    "with compile_on_one_rank=True a capture takes one kind of call, and this "
                    "one differs from the first (see the artifact's checks). Capture each kind "
                    "in a capture of its own, or capture without compile_on_one_rank."
                )
            pair = build(self._fn, args, self._options)
        else:
            variants = [*self._variants, compile_variant(self._fn, args, self._options)]
            pair = package(variants, self._options)
            self._variants = variants
        self._forward = runtime.load(pair.code, pair.cache)._forward
        self._pair = pair
        self._saved = False

    def save(self) -> Path:
        """Write the pair now (atomically); the block's end then leaves it as it is."""
        if self._pair is None:
            raise PrecompileError("nothing to save: the capture has not taken a call yet.")
        path = storage.save_pair(
            self._pair.code,
            self._pair.cache,
            self.artifact_path,
            self.cache_path,
            sign_key=self._options.sign_key,
        )
        self._saved = True
        return path

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self._state = _State.CLOSED
        if kind is not None:
            return  # the block failed: write nothing beyond what save() already wrote
        if self._pair is None:
            raise PrecompileError(
                "the capture block ended without a call: call the capture object inside the "
                "block, as you would call fn, e.g. `cap(model, x)`."
            )
        if not self._saved:
            self.save()

    @property
    def pair(self) -> ArtifactPair | None:
        """The captured ``(code, cache)``, once the block has taken its call."""
        return self._pair


def capture(
    fn: Callable[..., Any],
    /,
    *,
    artifact_path: str | os.PathLike[str],
    cache_path: str | os.PathLike[str] | None = None,
    save: str = "end",
    **options: Any,
) -> CaptureSession:
    """Capture ``fn`` from the call your code makes inside a ``with`` block.

    Enter the returned object, call it exactly as you would call ``fn``: the first call is
    traced (as ``precompile(fn, *args)`` traces it), then run for real by the built artifact,
    and its result is returned. A later call that the artifact's checks refuse (another input
    shape, Python value or module mode) is traced too and added as a variant; one that fits a
    variant runs it. When the block ends the pair is written atomically to ``artifact_path``
    and ``cache_path`` (by default a cache file beside the source, named after its hash, as
    ``precompile.save`` does); ``save()`` writes it earlier (a variant added after it is
    written at the end). With ``save="each"`` the pair is written again, atomically, each time
    a call adds a variant, so a job killed midway leaves every variant collected so far,
    loadable. A block that raises writes nothing new; a block without a call raises
    ``PrecompileError``. One use: to capture again, call ``capture()`` again. ``options`` are
    ``precompile()``'s keywords (``backend``, ``sign_key``, ``compile_on_one_rank``, ...; with
    ``compile_on_one_rank`` a capture takes one kind of call).
    """
    if not callable(fn):
        raise PrecompileError(f"fn must be callable, got {type(fn).__name__}.")
    unknown = sorted(set(options) - {f.name for f in dataclasses.fields(BuildOptions)})
    if unknown:
        raise PrecompileError(
            f"capture() got unknown keywords {unknown}; it takes artifact_path, cache_path, "
            "save and precompile()'s keywords: "
            f"{', '.join(f.name for f in dataclasses.fields(BuildOptions))}."
        )
    if save not in ("end", "each"):
        raise PrecompileError(
            f"save must be 'end' (write the pair when the block ends) or "
            f"'each' (also after every call that adds a variant), got "
            f"{save!r}."
        )
    return CaptureSession(
        fn,
        _path(artifact_path, "artifact_path"),
        None if cache_path is None else _path(cache_path, "cache_path"),
        BuildOptions(**options),
        save_each=save == "each",
    )


def _path(value: Any, name: str) -> Path:
    if not isinstance(value, str | os.PathLike) or not str(value):
        raise PrecompileError(
            f"{name} must be a file's path (a str or os.PathLike), got {value!r}."
        )
    return Path(value)
