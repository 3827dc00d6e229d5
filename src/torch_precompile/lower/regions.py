"""Repeated blocks compiled once.

The capture marks each operation with the block call that recorded it (``trace.blocks``).
Here the captured graph is cut where the mark changes; pieces that compute the same thing on
inputs of the same layout (the forward of every decoder layer, their backwards) are lowered
once, and section 2's ``call`` runs the pieces in order, each on its own tensors. A graph
with no piece that repeats is lowered whole, as before.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.fx

from torch_precompile.folding import fold_lines
from torch_precompile.internals.tracing import (
    effect_of,
    operator_schema,
    writes_an_argument,
)
from torch_precompile.lower import PIECE_LINE
from torch_precompile.trace import Capture
from torch_precompile.trace.blocks import BlockMark, block_mark
from torch_precompile.trace.checks import constant_source


@dataclass(frozen=True)
class Piece:
    """A run of the captured graph's operations that one block call recorded (or none did)."""

    nodes: tuple[torch.fx.Node, ...]
    inputs: tuple[torch.fx.Node, ...]  # values from before it, in the order it first uses them
    # Its values used after it; None where it runs a larger piece's code (``_covering``)
    # for a value of that piece it does not compute itself.
    outputs: tuple[torch.fx.Node | None, ...]
    mark: BlockMark | None
    key: str  # equal for pieces computing the same thing on inputs of the same layout

    def graph(self, root: torch.fx.GraphModule) -> torch.fx.GraphModule:
        """The piece as a function of its inputs that returns its outputs (a tuple; only
        a piece that runs its own code is made one)."""
        graph = torch.fx.Graph()
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        for node in self.inputs:
            env[node] = graph.placeholder(node.name)
            env[node].meta = dict(node.meta)
        for node in self.nodes:
            env[node] = graph.node_copy(node, env.__getitem__)
        graph.output(tuple(env[node] for node in self.outputs if node is not None))
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
    inputs = _inputs(run)
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


def _covered(pieces: list[Piece]) -> list[Piece]:
    """Each block piece that repeats nowhere but computes part of what another piece of its
    pass computes, from the same inputs, made a call of that piece. The first block's
    backward is one: its input needs no gradient, so it computes all but that one; with two
    blocks, the first's forward keeps a value fewer for the backward than the second's."""
    counts = Counter(piece.key for piece in pieces)
    repeated: dict[str, Piece] = {}
    for piece in pieces:
        if piece.mark is not None and counts[piece.key] > 1:
            repeated.setdefault(piece.key, piece)
    lone = [p for p in pieces if p.mark is not None and counts[p.key] == 1]
    made: dict[int, Piece] = {}
    # Pieces with more outputs first: a piece that covers another is never covered itself
    # afterwards (only a piece with more outputs can cover one).
    for piece in sorted(lone, key=lambda p: -len(p.outputs)):
        wholes = [*repeated.values(), *(w for w in lone if w is not piece and id(w) not in made)]
        same_pass = (
            w for w in wholes if w.mark and piece.mark and w.mark.pass_ == piece.mark.pass_
        )
        call = next(filter(None, (_covering(w, piece) for w in same_pass)), None)
        if call is not None:
            made[id(piece)] = call
    return [made.get(id(piece), piece) for piece in pieces]


# The most outputs of a repeated piece that a piece it covers may leave out (each count
# tried is a search over which ones).
_MOST_LEFT_OUT = 2


def _covering(whole: Piece, part: Piece) -> Piece | None:
    """``part`` as a call of ``whole``'s code, if ``whole`` pruned to some of its outputs is
    ``part`` (the same operations on inputs of the same layout, but for the gradients an
    operation's ``output_mask`` leaves out) and needs every input it had; None if not. Only
    values are pruned: operations that write or draw random numbers stay in both."""
    left_out = len(whole.outputs) - len(part.outputs)
    if not 0 < left_out <= _MOST_LEFT_OUT:
        return None
    part_run = _needed(part.nodes, part.outputs)
    # Quick refusals first: ``part`` may do no operation ``whole`` does not.
    surplus = Counter(_target_name(n.target) for n in whole.nodes)
    surplus.subtract(_target_name(n.target) for n in part_run)
    if min(surplus.values(), default=0) < 0:
        return None
    part_inputs = _inputs(part_run)
    part_masks: list[Any] = []
    part_key = _key(part_run, part_inputs, part.outputs, part_masks)
    for dropped in itertools.combinations(range(len(whole.outputs)), left_out):
        kept = [o for k, o in enumerate(whole.outputs) if k not in dropped]
        run = _needed(whole.nodes, kept)
        if len(run) != len(part_run):
            continue
        inputs = _inputs(run)
        masks: list[Any] = []
        if set(inputs) != set(whole.inputs) or _key(run, inputs, kept, masks) != part_key:
            continue
        if not all(map(_covers, masks, part_masks)):
            continue
        given = dict(zip(inputs, part_inputs, strict=True))
        made = iter(part.outputs)
        outputs = tuple(None if k in dropped else next(made) for k in range(len(whole.outputs)))
        return Piece(
            part.nodes, tuple(given[i] for i in whole.inputs), outputs, part.mark, whole.key
        )
    return None


def _covers(mask: Sequence[bool], other: Sequence[bool]) -> bool:
    """Whether ``mask`` asks for every gradient ``other`` asks for."""
    return len(mask) == len(other) and all(m or not o for m, o in zip(mask, other, strict=True))


def _inputs(run: Sequence[torch.fx.Node]) -> list[torch.fx.Node]:
    """The values ``run`` takes from before it, in the order it first uses them."""
    inside = set(run)
    return list(dict.fromkeys(i for n in run for i in n.all_input_nodes if i not in inside))


def _needed(
    nodes: Sequence[torch.fx.Node], wanted: Sequence[torch.fx.Node | None]
) -> list[torch.fx.Node]:
    """The nodes, of ``nodes``, that compute ``wanted`` or do more than compute a value
    (write, draw random numbers), and those they are computed from, in their order."""
    among = set(nodes)
    needed: set[torch.fx.Node] = set()
    pending = [n for n in (*wanted, *(n for n in nodes if not _pure(n))) if n in among]
    while pending:
        node = pending.pop()
        if node not in needed:
            needed.add(node)
            pending.extend(i for i in node.all_input_nodes if i in among)
    return [n for n in nodes if n in needed]


def _pure(node: torch.fx.Node) -> bool:
    """Whether leaving ``node`` out changes nothing but its own value."""
    if node.target is operator.getitem:
        return True
    if operator_schema(node.target) is None:
        return False
    random = torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())
    return not writes_an_argument(node) and not random and effect_of(node.target) is None


def _key(
    run: Sequence[torch.fx.Node],
    inputs: Sequence[torch.fx.Node],
    outputs: Sequence[torch.fx.Node | None],
    masks: list[Any] | None = None,
) -> str:
    """The piece's operations with values named by position, its inputs' layouts, and which
    of its values it returns: pieces of one key are one function, so they must agree on all
    three (the same operations may leave other values needed after them). With ``masks``,
    each ``output_mask`` argument is left out of the key and added to ``masks`` instead."""
    names = {node: f"i{k}" for k, node in enumerate(inputs)}
    names.update({node: f"n{k}" for k, node in enumerate(run)})
    lines = [_layout(node.meta["val"]) for node in inputs]
    for node in run:
        given = (node.args, node.kwargs) if masks is None else _unmasked(node, masks)
        args = torch.fx.node.map_arg(given, names.__getitem__)
        lines.append(f"{names[node]} = {_target_name(node.target)}{args!r}")
    lines.append("return " + ", ".join(names[node] for node in outputs if node is not None))
    return "\n".join(lines)


def _unmasked(node: torch.fx.Node, masks: list[Any]) -> tuple[Any, Any]:
    """``node``'s arguments with its ``output_mask`` (which gradients a backward operation
    computes) put in ``masks`` and replaced by a stand-in."""
    schema = operator_schema(node.target)
    names = [a.name for a in schema.arguments] if schema is not None else []
    if "output_mask" not in names:
        return node.args, node.kwargs
    args, kwargs = list(node.args), dict(node.kwargs)
    position = names.index("output_mask")
    if position < len(args):
        masks.append(tuple(cast("Sequence[bool]", args[position])))
        args[position] = "<output_mask>"
    elif "output_mask" in kwargs:
        masks.append(tuple(cast("Sequence[bool]", kwargs.pop("output_mask"))))
        kwargs["output_mask"] = "<output_mask>"
    return tuple(args), kwargs


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
    pieces = _merged(_covered(pieces))
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
        whole = next(p for p in same if None not in p.outputs)
        code = compile_piece(whole, number, same)
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
            if node is not None:
                names[node] = f"v[{number}][{k}]"
        lines.append(f"    v[{number}] = list({codes[piece.key].name}({given}))")
        freed = [names[i] for i in piece.inputs if i not in flat and last_use.get(i) == number]
        freed += [f"v[{number}][{k}]" for k, node in enumerate(piece.outputs) if node is None]
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
