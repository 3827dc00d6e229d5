"""Stage 2: realize a captured graph as Python source exposing ``call(flat_inputs)``."""

from __future__ import annotations

import io
import tokenize
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

from torch_precompile.spec import KernelObject

if TYPE_CHECKING:
    from torch_precompile.trace import Capture

# The line of an inductor artifact's section 2 that says which wrapper calls the kernels (no
# such line: the Python one).
WRAPPER_LINE = "# Wrapper: "
# The comment above each piece of a graph whose repeated blocks are compiled once.
PIECE_LINE = "# Piece "


@dataclass(frozen=True)
class LoweredGraph:
    """A compiled graph as section 2 of the artifact holds it, and the acceleration bytes that
    go into the cache.

    ``source`` defines ``call(flat_inputs)``; ``stand_ins`` are the shipped modules it uses
    (the kernel loader, say), written once ahead of every graph that uses them.
    ``input_strides`` holds, per flat graph input, the strides the compiled kernels assume
    (None where any layout will do); None altogether for a layout-flexible backend.
    ``kernels`` names every built kernel object in ``acceleration``, with its digest.
    ``wrapper`` is the kind of Inductor wrapper that runs the graph ("cpp" or "python"; None
    for the eager backend).
    """

    source: str
    acceleration: bytes | None
    input_strides: list[tuple[int, ...] | str | None] | None = None
    kernels: tuple[KernelObject, ...] = ()
    stand_ins: tuple[ModuleType, ...] = ()
    wrapper: str | None = None


@dataclass(frozen=True)
class VariantGraphs:
    """One variant's compiled graphs: the plain one, and where its results carry autograd
    history, the forward (results, then what backward needs) and the backward; the
    ``input_`` pair does the same for calls where an input tensor requires grad that did not
    at capture (its backward also gives their gradients)."""

    plain: LoweredGraph
    forward: LoweredGraph | None = None
    backward: LoweredGraph | None = None
    input_forward: LoweredGraph | None = None
    input_backward: LoweredGraph | None = None

    @property
    def all(self) -> list[LoweredGraph]:
        graphs = (self.plain, self.forward, self.backward, self.input_forward, self.input_backward)
        return [g for g in graphs if g is not None]


def lower_graph(
    captured: Capture, backend: str, wrapper: str, blocks: object = None
) -> LoweredGraph:
    """Realize the captured graph with ``backend`` (and, for inductor, ``wrapper``); the
    operations of repeated blocks once each where that pays (``blocks`` None), wherever they
    repeat (True, or the classes of the blocks), or never (False)."""
    if blocks is not False:
        from torch_precompile.lower.shared_blocks import lower_shared

        shared = lower_shared(captured, backend, wrapper, always=blocks is not None)
        if shared is not None:
            return shared
    if backend == "eager":
        from torch_precompile.lower.eager import lower_eager

        return lower_eager(captured)
    from torch_precompile.lower.inductor import lower_inductor

    return lower_inductor(captured, wrapper)


def indented(source: str) -> str:
    """``source`` one level in, runs of blank lines made one, but for the lines inside a
    multi-line string: a kernel's C++ text is what its kernel key hashes, so it stays as it
    is."""
    inside: set[int] = set()
    opened: list[int] = []
    fstring_start = getattr(tokenize, "FSTRING_START", None)
    fstring_end = getattr(tokenize, "FSTRING_END", None)
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == fstring_start:
            opened.append(token.start[0])
            continue
        first = opened.pop() if token.type == fstring_end else token.start[0]
        if token.type in (tokenize.STRING, fstring_end) and token.end[0] > first:
            inside.update(range(first + 1, token.end[0] + 1))
    lines: list[str] = []
    for number, line in enumerate(source.splitlines(), 1):
        if number in inside:
            lines.append(line)
        elif line.strip():
            lines.append("    " + line)
        elif lines and lines[-1]:  # inside a function, one blank line between definitions
            lines.append("")
    return "\n".join(lines) + "\n"
