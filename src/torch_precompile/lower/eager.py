"""The eager backend: the captured ATen graph's own code, run op by op."""

from __future__ import annotations

import re

import torch
import torch.fx

from torch_precompile.internals.tracing import fx_builtin_imports, graph_function_source
from torch_precompile.lower import LoweredGraph
from torch_precompile.trace import Capture
from torch_precompile.trace.checks import literal_source


def lower_eager(capture: Capture) -> LoweredGraph:
    gm = capture.graph
    graph_code = graph_function_source(gm, "captured_graph")
    literals = literal_lines(capture)
    lines = [
        "# The names the graph code and its literals refer to.",
        *used_imports("\n".join([graph_code, *literals])),
        "",
        *literals,
        "\n".join(line.rstrip() for line in graph_code.strip("\n").splitlines()).rstrip(),
        "",
        "",
        "def call(flat_inputs):",
        '    """Run the graph on the flat inputs (they are consumed) and return its outputs."""',
        "    args = [*flat_inputs, *TENSOR_LITERALS]"
        if capture.literals
        else "    args = list(flat_inputs)",
        "    flat_inputs.clear()",
        "    return captured_graph(*args)",
    ]
    return LoweredGraph(
        source="\n".join(lines) + "\n", acceleration=None, input_strides=input_layouts(capture)
    )


def input_layouts(capture: Capture) -> list[tuple[int, ...] | str | None] | None:
    """The example's layout of each input tensor that reaches a ``view`` in the graph: that
    view was traced on this layout and may fail on another, so a call passing another gets a
    copy in this one (see the driver's LeafPlan). Other inputs take any layout. An input with
    dynamic dims has strides that follow its sizes: its layout is its memory format's name."""
    spec = capture.spec
    if spec.wrapped or spec.distributed:
        return None
    model = len(spec.interned)
    placeholders = list(capture.graph.graph.find_nodes(op="placeholder"))
    viewed = _reaching_views(capture.graph.graph)
    return [
        capture.memory_formats.get(i) or tuple(int(s) for s in t.stride())
        if model <= i < model + len(spec.tensor_inputs) and placeholders[i] in viewed
        else None
        for i, t in enumerate(capture.example_inputs)
    ]


def _reaching_views(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The nodes from which some ``aten.view`` is reachable."""
    reaching: set[torch.fx.Node] = set()
    for node in reversed(graph.nodes):
        if node.target is torch.ops.aten.view.default or any(
            user in reaching for user in node.users
        ):
            reaching.add(node)
    return reaching


def used_imports(graph_code: str) -> list[str]:
    """The fx builtins (``inf``, ``device``, ...) the graph code uses, and torch."""
    used = set(re.findall(r"\b\w+\b", graph_code)) | {"torch"}
    return [
        line for line in fx_builtin_imports() if line.split()[-1] in used or line.split()[0] in used
    ]


def literal_lines(capture: Capture) -> list[str]:
    if not capture.literals:
        return [""]
    lines = ["# Tensor literals built inside fn (torch.tensor(...)), in graph-input order."]
    lines.append("TENSOR_LITERALS = [")
    lines.extend(f"    {literal_source(t)}," for t in capture.literals)
    lines.extend(["]", "", ""])
    return lines
