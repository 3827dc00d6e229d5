"""Section 2 for a capture whose repeated blocks are compiled once (cut by ``lower.regions``):
each distinct piece defined once, with either backend, then the ``call`` that runs them."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch.fx

from torch_precompile.errors import PrecompileError
from torch_precompile.internals.tracing import graph_function_source, operator_schema
from torch_precompile.lower import WRAPPER_LINE, LoweredGraph, indented
from torch_precompile.lower.regions import Code, Cut, Piece, lower_regions
from torch_precompile.spec import Layout
from torch_precompile.trace import Capture

log = logging.getLogger("torch_precompile")


def lower_shared(
    capture: Capture, backend: str, wrapper_kind: str, always: bool
) -> LoweredGraph | None:
    """The capture lowered piece by piece, each repeated piece once; None where no piece
    repeats (or, unless ``always``, where that spares little), or where the pieces could not
    be lowered apart (the whole graph then is)."""
    try:
        if backend == "eager":
            return _eager(capture, always)
        return _inductor(capture, wrapper_kind, always)
    except Exception as e:  # the unrolled graph is always there to fall back on
        reason = (str(e).strip().splitlines() or [""])[0][:200]
        expected = isinstance(e, PrecompileError) and not always
        (log.info if expected else log.warning)(
            "the repeated blocks are compiled unrolled: %s: %s", type(e).__name__, reason
        )
        return None


def _eager(capture: Capture, always: bool) -> LoweredGraph | None:
    from torch_precompile.lower.eager import input_layouts, literal_lines, used_imports

    def piece_code(piece: Piece, number: int, same: list[Piece]) -> Code:
        name = f"piece_{number}"
        source = graph_function_source(piece.graph(capture.graph), name).strip("\n")
        return Code(name, source, takes_list=False)

    cut = lower_regions(capture, piece_code, always=always)
    if cut is None:
        return None
    pieces = _defined(cut)
    literals = literal_lines(capture)
    source = "\n".join(
        [
            "# The names the pieces' code and the literals refer to.",
            *used_imports("\n".join([pieces, *literals])),
            "",
            *literals,
            pieces,
            "",
            "",
            cut.call,
        ]
    )
    return LoweredGraph(source, None, input_strides=input_layouts(capture))


def _inductor(capture: Capture, wrapper_kind: str, always: bool) -> LoweredGraph | None:
    from torch_precompile.artifact.kernel_payload import merged_payloads
    from torch_precompile.lower.eager import used_imports
    from torch_precompile.lower.inductor import driver_checkable, literal_lines
    from torch_precompile.shipped import kernel_loader, wrapper_imports

    placeholders = list(capture.graph.graph.find_nodes(op="placeholder"))
    flat = {node: i for i, node in enumerate(placeholders)}
    checkable = driver_checkable(capture.spec, len(capture.example_inputs))

    def piece_code(piece: Piece, number: int, same: list[Piece]) -> Code:
        def unasserted(asserted: list[int]) -> set[int]:
            return {
                j for j in asserted if all(flat.get(p.inputs[j], -1) in checkable for p in same)
            }

        if piece.mark is None and len(same) == 1 and len(piece.nodes) <= SMALL_PIECE:
            return _aten_piece(capture, piece, number)
        code = _compiled_piece(capture, piece, number, wrapper_kind, unasserted)
        _refuse_unseen_writes(code, same, flat)
        return code

    cut = lower_regions(capture, piece_code, always=always)
    if cut is None:
        return None
    codes = [code for code in cut.codes.values() if code.kernels is not None]
    cpp = all(code.cpp for code in codes)
    note = (
        f"{WRAPPER_LINE}C++. Each compiled piece is one compiled function; its shared object is "
        "in the cache."
        if cpp
        else f"{WRAPPER_LINE}Python. the C++ wrapper is not used for every piece (each says why)."
    )
    aten = [code.source for code in cut.codes.values() if code.kernels is None]
    source = "\n".join(
        [
            note,
            *(["# The names the pieces run as ATen calls refer to."] if aten else []),
            *used_imports("\n".join(aten)),
            *literal_lines(capture),
            _defined(cut),
            "",
            "",
            cut.call,
        ]
    )
    objects = {k.key: k for code in codes for k in code.kernels.objects}
    payloads = [code.kernels.payload for code in codes if code.kernels.objects]
    return LoweredGraph(
        source,
        merged_payloads(payloads) if payloads else None,
        input_strides=_input_strides(capture, cut, flat),
        kernels=tuple(sorted(objects.values(), key=lambda k: k.key)),
        stand_ins=(kernel_loader,) if cpp else (kernel_loader, wrapper_imports),
        wrapper="cpp" if cpp else "python",
    )


# A piece outside the blocks with at most this many operations (a loss and its gradient's
# seed, say) runs them as ATen calls: compiled, it would cost a build of its own (seconds)
# to spare microseconds a call.
SMALL_PIECE = 12


def _aten_piece(capture: Capture, piece: Piece, number: int) -> Code:
    name = f"piece_{number}"
    source = graph_function_source(piece.graph(capture.graph), name).strip("\n")
    comment = "# Its few operations run as ATen calls, uncompiled (see SMALL_PIECE)."
    return Code(name, f"{comment}\n{source}", takes_list=False)


def _refuse_unseen_writes(code: Code, same: list[Piece], flat: dict[torch.fx.Node, int]) -> None:
    """A compiled piece is functional inside: what it writes in place must be a flat input
    that no other input of the piece views (a view made by an earlier piece would not see
    the write, where the whole graph's would)."""
    for piece in same:
        for j in code.written:
            written = piece.inputs[j]
            others = [i for k, i in enumerate(piece.inputs) if k != j]
            if written not in flat or any(_viewed(i) is written for i in others):
                raise PrecompileError(
                    "a piece writes in place into a value another piece computed or viewed, "
                    "which pieces compiled apart would not see"
                )


def _viewed(node: torch.fx.Node) -> torch.fx.Node:
    """The value ``node`` is a view of, through any chain of views (itself if none)."""
    while node.op == "call_function" and node.args and isinstance(node.args[0], torch.fx.Node):
        schema = operator_schema(node.target)
        returned = schema.returns[0].alias_info if schema is not None and schema.returns else None
        if returned is None or returned.is_write:
            break
        node = node.args[0]
    return node


def _compiled_piece(
    capture: Capture,
    piece: Piece,
    number: int,
    wrapper_kind: str,
    unasserted: Callable[[list[int]], set[int]],
) -> Code:
    """One piece compiled by Inductor, inside a function that readies its kernels."""
    from torch_precompile.internals.inductor import loader_resolving_now
    from torch_precompile.lower.inductor import GENERATED_END, GENERATED_START, compile_piece

    examples = [node.meta["val"] for node in piece.inputs]
    compiled = compile_piece(piece.graph(capture.graph), examples, wrapper_kind, unasserted)
    body = [
        f"{GENERATED_START}, its torch._inductor imports replaced by the stand-ins.",
        *(f"# {line.removeprefix(WRAPPER_LINE)}" for line in compiled.wrapper_note),
        loader_resolving_now(compiled.source).strip("\n"),
        GENERATED_END,
        "return inductor_call",
    ]
    name = f"piece_{number}"
    inner = indented("\n".join(body)).rstrip("\n")  # (C++ text inside strings kept as is)
    return Code(
        name,
        "\n".join([f"def _{name}():", inner, "", "", f"{name} = _{name}()"]),
        takes_list=True,
        kernels=compiled.kernels,
        asserted=tuple(compiled.asserted),
        cpp=compiled.cpp,
        written=tuple(compiled.written),
    )


def _defined(cut: Cut) -> str:
    """Each compiled piece, under the comment that says which block calls run it."""
    return "\n\n\n".join(f"{code.comment}\n{code.source}" for code in cut.codes.values())


def _input_strides(capture: Capture, cut: Cut, flat: dict[torch.fx.Node, int]) -> list[Layout]:
    """The layout the kernels assume for each flat input (None where none assumes one)."""
    strides: list[Layout] = [None] * len(capture.example_inputs)
    for piece in cut.pieces:
        for position in cut.codes[piece.key].asserted:
            index = flat.get(piece.inputs[position])
            if index is not None and index < len(strides) and strides[index] is None:
                strides[index] = tuple(int(s) for s in piece.inputs[position].meta["val"].stride())
    return strides
