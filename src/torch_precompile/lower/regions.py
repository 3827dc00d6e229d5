"""Repeated blocks compiled once.

The capture marks each operation with the block call that recorded it (``trace.blocks``).
Here the captured graph is cut where the mark changes; pieces that compute the same thing on
inputs of the same layout (the forward of every decoder layer, their backwards) are lowered
once, and section 2's ``call`` runs the pieces in order, each on its own tensors. A graph
with no piece that repeats is lowered whole, as before.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.fx

from torch_precompile.folding import fold_lines
from torch_precompile.lower import PIECE_LINE
from torch_precompile.trace import Capture
from torch_precompile.trace.blocks import BlockMark, block_mark
from torch_precompile.trace.checks import constant_source


@dataclass(frozen=True)
class Piece:
    """A run of the captured graph's operations that one block call recorded (or none did)."""

    nodes: tuple[torch.fx.Node, ...]
    inputs: tuple[torch.fx.Node, ...]  # values from before it, in the order it first uses them
    outputs: tuple[torch.fx.Node, ...]  # its values used after it
    mark: BlockMark | None
    key: str  # equal for pieces computing the same thing on inputs of the same layout

    def graph(self, root: torch.fx.GraphModule) -> torch.fx.GraphModule:
        """The piece as a function of its inputs that returns its outputs (a tuple)."""
        graph = torch.fx.Graph()
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        for node in self.inputs:
            env[node] = graph.placeholder(node.name)
            env[node].meta = dict(node.meta)
        for node in self.nodes:
            env[node] = graph.node_copy(node, env.__getitem__)
        graph.output(tuple(env[node] for node in self.outputs))
        return torch.fx.GraphModule(root, graph)


@dataclass(frozen=True)
class Code:
    """One compiled piece, shared by the pieces of its key: what section 2 defines for it."""

    name: str
    source: str  # defines ``name``, a function of the piece's inputs (a list for inductor)
    takes_list: bool
    kernels: Any = None  # BuiltKernels, for inductor
    asserted: tuple[int, ...] = ()  # the input positions whose layout the kernels assume
    cpp: bool = False
    written: tuple[int, ...] = ()  # the input positions it writes in place
    comment: str = ""  # which block calls run it


@dataclass(frozen=True)
class Cut:
    """The capture cut into pieces: each piece's code (by key), and the ``call`` source."""

    pieces: list[Piece]
    codes: dict[str, Code]
    call: str


def cut(gm: torch.fx.GraphModule) -> list[Piece] | None:
    """The graph's pieces, or None where it cannot be cut (a value that is no tensor crosses
    a cut, or the graph holds attributes)."""
    body = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    if any(n.op != "call_function" for n in body):
        return None
    runs: list[list[torch.fx.Node]] = []
    for node in body:
        if runs and block_mark(runs[-1][0]) == block_mark(node):
            runs[-1].append(node)
        else:
            runs.append([node])
    pieces = [_piece(run) for run in runs]
    return None if None in pieces else cast("list[Piece]", pieces)


def _piece(run: list[torch.fx.Node]) -> Piece | None:
    """The piece of a run of nodes; None where a value that is no tensor crosses its edge."""
    inside = set(run)
    inputs = list(dict.fromkeys(i for n in run for i in n.all_input_nodes if i not in inside))
    outputs = [n for n in run if any(u not in inside for u in n.users)]
    if not all(isinstance(v.meta.get("val"), torch.Tensor) for v in (*inputs, *outputs)):
        return None
    marks = {block_mark(n) for n in run}
    mark = marks.pop() if len(marks) == 1 else None
    return Piece(tuple(run), tuple(inputs), tuple(outputs), mark, _key(run, inputs, outputs))


def _merged(pieces: list[Piece]) -> list[Piece]:
    """Consecutive pieces that repeat nowhere made one: each piece is compiled apart, at a
    cost of its own, which only a piece that runs more than once pays back."""
    counts: dict[str, int] = {}
    for piece in pieces:
        counts[piece.key] = counts.get(piece.key, 0) + 1
    merged: list[Piece] = []
    lone: list[torch.fx.Node] = []
    for item in [*pieces, None]:
        if item is not None and counts[item.key] == 1:
            lone.extend(item.nodes)
            continue
        if lone:
            joined = _piece(lone)
            if joined is None:
                return pieces  # (the pieces themselves passed this check)
            merged.append(joined)
            lone = []
        if item is not None:
            merged.append(item)
    return merged


def _key(
    run: Sequence[torch.fx.Node],
    inputs: Sequence[torch.fx.Node],
    outputs: Sequence[torch.fx.Node],
) -> str:
    """The piece's operations with values named by position, its inputs' layouts, and which
    of its values it returns: pieces of one key are one function, so they must agree on all
    three (the same operations may leave other values needed after them)."""
    names = {node: f"i{k}" for k, node in enumerate(inputs)}
    names.update({node: f"n{k}" for k, node in enumerate(run)})
    lines = [_layout(node.meta["val"]) for node in inputs]
    for node in run:
        args = torch.fx.node.map_arg((node.args, node.kwargs), names.__getitem__)
        lines.append(f"{names[node]} = {_target_name(node.target)}{args!r}")
    lines.append("return " + ", ".join(names[node] for node in outputs))
    return "\n".join(lines)


def _layout(value: torch.Tensor) -> str:
    return f"{value.dtype} {value.device} {tuple(value.shape)} {value.stride()}"


def _target_name(target: Any) -> str:
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", None) or ""
    return f"{module}.{getattr(target, '__qualname__', None) or target}"


# Operations a build must be spared before it is cut by default: each piece is compiled on
# its own, at the cost of about as many operations lowered (its wrapper's own build).
WORTH_CUTTING = 250


def lower_regions(
    capture: Capture,
    compile_piece: Callable[[Piece, int, list[Piece]], Code],
    always: bool,
) -> Cut | None:
    """The capture cut into pieces, each key compiled once by ``compile_piece(piece,
    number, pieces_of_its_key)``; None where no piece of a block repeats, or (unless
    ``always``) where the repeats spare fewer operations than ``WORTH_CUTTING``."""
    spec = capture.spec
    # Kept whole: results aliasing inputs, dynamic dims, collectives, tensor subclasses.
    if (
        spec.output_aliases
        or capture.fake_mode is not None
        or spec.distributed
        or spec.data_parallel
        or spec.fully_sharded
        or spec.wrapped
    ):
        return None
    pieces = cut(capture.graph)
    if pieces is None:
        return None
    pieces = _merged(pieces)
    by_key: dict[str, list[Piece]] = {}
    for piece in pieces:
        by_key.setdefault(piece.key, []).append(piece)
    spared = sum(
        (len(same) - 1) * len(same[0].nodes) for same in by_key.values() if same[0].mark is not None
    )
    if spared == 0 or (spared < WORTH_CUTTING and not always):
        return None
    codes: dict[str, Code] = {}
    for number, (key, same) in enumerate(by_key.items(), 1):
        code = compile_piece(same[0], number, same)
        codes[key] = dataclasses.replace(code, comment=describe(same, number, len(by_key)))
    return Cut(pieces, codes, _orchestration(capture, pieces, codes))


def describe(same: Sequence[Piece], number: int, count: int) -> str:
    """The comment above a compiled piece: which block calls run it."""
    marks = [p.mark for p in same if p.mark is not None]
    if not marks:
        what = "operations outside the repeated blocks"
    else:
        blocks = list(dict.fromkeys(m.block for m in marks))
        shown = ", ".join(blocks[:3]) + (f", ... {blocks[-1]}" if len(blocks) > 3 else "")
        what = f"the {marks[0].pass_} of block{'s' if len(blocks) > 1 else ''} {shown}"
    runs = f", run {len(same)} times" if len(same) > 1 else ""
    return f"{PIECE_LINE}{number} of {count}: {what}{runs}."


def _orchestration(capture: Capture, pieces: list[Piece], codes: dict[str, Code]) -> str:
    """``call``: each piece run on its values (flat inputs as slices of ``args``, a block's
    tensors being consecutive ones), the values no later piece needs let go, the outputs
    gathered; the calls of alike blocks in loops."""
    placeholders = list(capture.graph.graph.find_nodes(op="placeholder"))
    flat = {node: k for k, node in enumerate(placeholders)}
    names: dict[torch.fx.Node, str] = {}
    outputs = list(cast("Sequence[Any]", capture.graph.graph.output_node().args[0]))
    last_use = _last_uses(pieces, outputs)
    lines = [
        "def call(flat_inputs):",
        '    """Run the pieces in order on the flat inputs (consumed); v[n]: what piece call n '
        'returned."""',
        "    args = [*flat_inputs, *TENSOR_LITERALS]"
        if capture.literals
        else "    args = list(flat_inputs)",
        "    flat_inputs.clear()",
        f"    v = [None] * {len(pieces)}",
    ]
    for number, piece in enumerate(pieces):
        given = _arguments(piece.inputs, flat, names)
        given = f"[{given}]" if codes[piece.key].takes_list else given
        for k, node in enumerate(piece.outputs):
            names[node] = f"v[{number}][{k}]"
        lines.append(f"    v[{number}] = list({codes[piece.key].name}({given}))")
        freed = [names[i] for i in piece.inputs if i not in flat and last_use.get(i) == number]
        if freed:
            lines.append(f"    {' = '.join(freed)} = None")
    lines += [
        "    return [",
        *(
            "        "
            + (
                (names[o] if o in names else f"args[{flat[o]}]")
                if isinstance(o, torch.fx.Node)
                else constant_source(o)
            )
            + ","
            for o in outputs
        ),
        "    ]",
    ]
    return "\n".join(fold_lines(lines)) + "\n"


def _arguments(
    inputs: Sequence[torch.fx.Node], flat: dict[torch.fx.Node, int], names: dict[Any, str]
) -> str:
    """A piece's arguments: runs of consecutive flat inputs as ``*args[i:j]``."""
    parts: list[str] = []
    run: list[int] = []

    def close() -> None:
        if len(run) > 2:
            parts.append(f"*args[{run[0]}:{run[-1] + 1}]")
        else:
            parts.extend(f"args[{k}]" for k in run)
        run.clear()

    for node in inputs:
        if node in flat and (not run or flat[node] == run[-1] + 1):
            run.append(flat[node])
            continue
        close()
        if node in flat:
            run.append(flat[node])
        else:
            parts.append(names[node])
    close()
    return ", ".join(parts)


def _last_uses(pieces: list[Piece], outputs: list[Any]) -> dict[torch.fx.Node, int]:
    """Each value's last piece, for values the result does not hold."""
    kept = {o for o in outputs if isinstance(o, torch.fx.Node)}
    last: dict[torch.fx.Node, int] = {}
    for number, piece in enumerate(pieces):
        for node in piece.inputs:
            last[node] = number
    return {node: number for node, number in last.items() if node not in kept}
